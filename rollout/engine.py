"""Batched generation with a KV cache for any Hugging Face causal LM.

Prompts are left-padded so that every row's next token sits in the last column; position ids are
computed from the attention mask so padded rows see the same positions as unpadded ones.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache as memoize

import torch

from bitrl.rollout.sampling import sample_tokens


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


@memoize
def _cache_keyword(forward_owner: type) -> str:
    # transformers 5.2x renamed the forward's `past_key_values` to `cache`; an older release silently puts an
    # unknown `cache=` into **kwargs and decodes every token without its context.
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model, cache) -> dict:
    """The keyword arguments that hand `cache` to `model`'s forward under this transformers' name for it."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


def check_cache_filled(cache, tokens: int) -> None:
    """Fail loudly if a forward that was handed `cache` did not fill it (a KV cache silently ignored)."""
    if cache.get_seq_length() < tokens:
        raise RuntimeError(
            f"the model's forward did not fill the KV cache it was given ({cache.get_seq_length()} of "
            f"{tokens} positions): this transformers release names the cache argument differently"
        )


@torch.no_grad()
def prefill_distinct(model, prompts: list[list[int]], pad_id: int):
    """Prefill each distinct prompt once, with a fresh KV cache.

    Returns (cache, last_logits [U, V], ids [U, P] int64 left-padded, mask [U, P] bool, row_of [B] int64) as
    `distinct_prompts` does. Expand with `cache.batch_select_indices(row_of)` (or a selection derived from
    it) before decoding per row.
    """
    from transformers import DynamicCache

    ids, mask, row_of = distinct_prompts(prompts, pad_id, next(model.parameters()).device)
    attn = mask.long()
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=position_ids_from_mask(attn),
        logits_to_keep=1,
        **with_cache(model, cache),
    )
    check_cache_filled(cache, ids.shape[1])
    return cache, out.logits[:, -1], ids, mask, row_of


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample up to `max_new_tokens` tokens after each prompt, stopping a row at `eos_id`.

    model: a Hugging Face causal LM (anything whose forward takes input_ids, attention_mask, position_ids,
    cache, use_cache and returns .logits and .cache). Repeated prompts are prefilled once. Deterministic for
    a given `generator` state.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache, logits, ids, mask, row_of = prefill_distinct(model, prompts, pad_id)
    if len(ids) != len(prompts):
        cache.batch_select_indices(row_of)
    prompt_ids, prompt_mask, logits = ids[row_of], mask[row_of], logits[row_of]
    batch, device = prompt_ids.shape[0], prompt_ids.device
    attn = prompt_mask.long()
    next_pos = attn.sum(-1)
    tokens, logps, alive_cols = [], [], []
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    in_cache = torch.arange(batch, device=device)  # the rows the KV cache holds, in its order
    for _ in range(max_new_tokens):
        # Every row is sampled, finished ones too (their stale logits are ignored), so the random stream
        # does not depend on which rows are still decoding.
        tok, lp = sample_tokens(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        tokens.append(tok)
        logps.append(torch.where(alive, lp, torch.zeros_like(lp)))
        alive_cols.append(alive.clone())
        alive &= tok != eos_id
        if not alive.any() or len(tokens) == max_new_tokens:
            break
        in_cache, attn, next_pos, new_logits = decode_step(model, cache, in_cache, alive, tok, attn, next_pos)
        logits = logits.index_copy(0, in_cache, new_logits.to(logits.dtype))
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=torch.stack(tokens, 1),
        response_mask=torch.stack(alive_cols, 1),
        logprobs=torch.stack(logps, 1),
    )


def decode_step(model, cache, in_cache: torch.Tensor, alive: torch.Tensor, tokens: torch.Tensor, attn, pos):
    """One decoding step on the KV cache: feed each cached row its newest token.

    in_cache [C] int64: the batch rows the cache holds, in its order; alive [B] bool and tokens [B] int64
    over the whole batch; attn [C, T] int64: the cache's attention mask; pos [C] int64: each cached row's
    next position. Finished rows first leave the cache once at most 3/4 of the rows it holds are alive, so a
    step costs what its live rows cost (shrinking geometrically bounds the copying to a few cache sizes).
    Returns (in_cache, attn, pos, logits [C', V]) for the rows the cache now holds, positions advanced.
    """
    keep = alive[in_cache]
    if int(keep.sum()) <= 0.75 * len(in_cache):
        index = keep.nonzero().squeeze(-1)
        cache.batch_select_indices(index)
        in_cache, attn, pos = in_cache[index], attn[index], pos[index]
    attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
    out = model(
        input_ids=tokens[in_cache, None],
        attention_mask=attn,
        position_ids=pos[:, None],
        **with_cache(model, cache),
    )
    return in_cache, attn, pos + 1, out.logits[:, -1]
