"""A batch of generated responses (`Rollout`), and the left padding of prompts it is built from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    """A batch of generated responses.

    prompt_ids [B, P] int64, left-padded; prompt_mask [B, P] bool.
    response_ids [B, R] int64, right-padded with pad_id after EOS; response_mask [B, R] bool, True for every
    generated token up to and including EOS. logprobs [B, R] fp32: log-prob of each sampled token under the
    distribution it was sampled from (0 where masked).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def full_sequence(self):
        """(input_ids [B, P+R], attention_mask [B, P+R], position_ids [B, P+R]) of prompt + response."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask, position_ids_from_mask(mask)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over attended tokens only; padding gets position 0. mask: [B, T] -> [B, T] int64."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(sequences: list[list[int]], pad_id: int, device=None):
    """Left-pad token lists into (ids [B, L] int64, mask [B, L] bool)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = True
    return ids.to(device), mask.to(device)


def distinct_prompts(prompts: list[list[int]], pad_id: int, device=None):
    """The distinct prompts, left-padded, in order of first appearance (the G samples of a GRPO group share
    one). Returns (ids [U, P] int64, mask [U, P] bool, row_of [B] int64: the distinct prompt of row b)."""
    index: dict = {}
    row_of = [index.setdefault(tuple(p), len(index)) for p in prompts]
    ids, mask = left_pad([list(p) for p in index], pad_id, device)
    return ids, mask, torch.tensor(row_of, dtype=torch.long, device=device)
