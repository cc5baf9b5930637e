"""The rollout cache of speculative reuse (bitrl.rollout.reuse): for every prompt seen before, the response
sampled for it last time (a `Draft`: its tokens, the log-probs they were sampled with and, for the "exact"
mode, the top-k of each position's sampling distribution), least recently used out past a token budget."""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch


def prompt_fingerprint(prompt: list[int]) -> int:
    """A stable 32-bit hash of a prompt's token ids (guards a cache key against a changed prompt)."""
    return zlib.crc32(array("q", prompt).tobytes())


@dataclass
class Draft:
    """One cached response. tokens [L] int64 and logprobs [L] fp32 (log-probs of the distribution each token
    was sampled from); top_ids [L, K] int64 / top_logprobs [L, K] fp32: the K most likely tokens of that
    distribution (K may be 0). prompt_hash: `prompt_fingerprint` of the prompt it answers."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt_hash: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class RolloutCache:
    """Drafts keyed by prompt identity, least recently used out once they hold more than `max_tokens`
    tokens.

    A key is any hashable, picklable value (the loop uses (problem uid, sample index within the group)). The
    cost of an entry is its number of response tokens; a draft longer than the cap is not stored.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict = OrderedDict()
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def keys(self) -> list:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key, prompt_hash: int | None = None) -> Draft | None:
        """The draft for `key` (marking it most recently used), or None. A draft recorded for a different
        prompt (its prompt_hash differs from a given one) is dropped and counts as a miss."""
        draft = self._entries.get(key)
        if draft is None:
            return None
        if prompt_hash is not None and draft.prompt_hash != prompt_hash:
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return draft

    def put(self, key, draft: Draft) -> None:
        if key in self._entries:
            self._remove(key)
        if draft.num_tokens > self.max_tokens:
            return
        self._entries[key] = draft
        self.tokens += draft.num_tokens
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))
            self.evictions += 1

    def discard(self, key) -> None:
        """Forget the draft under `key`, if any."""
        if key in self._entries:
            self._remove(key)

    def _remove(self, key) -> None:
        self.tokens -= self._entries.pop(key).num_tokens

    def state_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "evictions": self.evictions,
            "entries": [(k, d.__dict__.copy()) for k, d in self._entries.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self._entries = OrderedDict((k, Draft(**d)) for k, d in state["entries"])
        self.tokens = sum(d.num_tokens for d in self._entries.values())
        self.evictions = state["evictions"]
        if self.tokens > self.max_tokens:  # the cap may have been lowered since the checkpoint
            while self.tokens > self.max_tokens:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
