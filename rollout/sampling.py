"""Token sampling: temperature, top-k and top-p, and the log-prob of each sampled token under the
distribution actually sampled from (the filtered support, renormalised), in fp32."""

from __future__ import annotations

import torch


def filtered_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Log-probabilities of the sampling distribution.

    logits: [..., V], any float dtype. Returns [..., V] fp32 with -inf outside the kept support, so
    `exp` of the result sums to 1 over the support. temperature must be > 0 (greedy is handled by the caller);
    top_k = 0 keeps all tokens; top_p = 1 keeps all tokens. Top-k is applied before top-p.
    """
    z = logits.float() / temperature
    if top_k and 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # Keep a token if the mass strictly before it is below top_p: the smallest set reaching top_p.
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
):
    """Draw one token per row. logits: [B, V]. Returns (tokens [B] int64, logprobs [B] fp32).

    temperature == 0 means greedy decoding; its log-prob is 0 (the argmax has probability 1).
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    logp = filtered_logprobs(logits, temperature, top_k, top_p)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
