"""Sampling distributions of the rollout, one definition: bitrl.kernels.sampling (temperature, sort-free
tie-robust top-k / top-p, counter-based Gumbel-max draw). Log-probs are those of the distribution actually
sampled from (the kept support, renormalised), in fp32."""

from __future__ import annotations

import torch

from bitrl.kernels.sampling import draw_step_seed, filter_logits, fused_sample, sample_seeds


def filtered_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Log-probabilities of the sampling distribution. logits: [..., V], any float dtype. Returns [..., V]
    fp32, -inf outside the kept support. temperature must be > 0 (greedy is the caller's)."""
    return torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    positions: torch.Tensor | None = None,
):
    """Draw one token per row of logits [B, V] with one step seed from `generator` (rows keyed by their
    index, counter `positions`, default 0). Returns (tokens [B] int64, logprobs [B] fp32); temperature 0 is
    greedy with log-prob 0."""
    rows = logits.shape[0]
    seeds = sample_seeds(draw_step_seed(generator), torch.arange(rows, device=logits.device))
    if positions is None:
        positions = torch.zeros(rows, dtype=torch.long, device=logits.device)
    return fused_sample(logits, seeds, positions, temperature, top_k, top_p)
