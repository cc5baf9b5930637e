"""The unfused formula (``impl="reference"``): full [N, V] logits -> /T -> log_softmax -> gather."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature=1.0,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = True,
):
    """The unfused path in the input dtype: logits -> /T -> log_softmax -> gather (and entropy).

    Materialises the full [N, V] logits. Outputs are cast to fp32 (fp64 stays fp64). Used as ground truth
    (fp64 inputs) and as the "unfused same dtype" baseline in the tests and benchmarks.
    """
    logits = F.linear(hidden, weight, bias)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)
    elif temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(out_dtype)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    ent = None
    if return_entropy:
        p = logp.exp()
        # p log p -> 0 where p = 0 (a -inf logit), without a NaN in the backward either
        logp_finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
        ent = (-(p * logp_finite).sum(-1)).to(out_dtype)
        ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent
