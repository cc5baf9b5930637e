"""Which linear layers a 4-bit rollout copy should keep in FP8: each layer's sensitivity, measured alone.

A layer's sensitivity is the mismatch it adds when it alone is quantized: the mean per-token
KL(unquantized || quantized) of the next-token distributions on calibration tokens. On SmolLM2-135M-Instruct
in NVFP4 the 30 down_proj layers alone carry 0.107 of the whole model's 0.276 (docs/low_precision.md), so a
handful of layers kept in FP8 removes a large share of the mismatch at a small share of the memory.
``bitrl quant-report --sensitivity`` prints the ranking; ``rollout.fp8_layers=N`` keeps the N first in FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import QuantLinear, _skipped

__all__ = ["calibration_ids", "layer_sensitivity", "most_sensitive"]

# Calibration text for a model with a tokenizer: a mix of the prompts RL runs see (arithmetic word problems,
# chat questions, code), so that the ranking reflects the layers those inputs exercise.
CALIBRATION_TEXT = (
    "Tom has 12 apples and buys 7 more. How many apples does Tom have now? Answer: 19.",
    "What is 23 plus 45? Think step by step, then give the number.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
)


def calibration_ids(tokenizer=None, vocab_size: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Token ids [1, T] per calibration text (``tokenizer``), or two rows of random tokens [2, 48]."""
    if tokenizer is not None:
        return [torch.tensor([tokenizer(t).input_ids]) for t in CALIBRATION_TEXT]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (2, 48), generator=g)]


@torch.no_grad()
def _mean_kl(model: nn.Module, ids: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for x, ref in zip(ids, reference):
        lp = torch.log_softmax(model(x.to(ref.device)).logits.float(), -1)
        total += float((ref.exp() * (ref - lp)).sum())
        count += ref.shape[0] * ref.shape[1]
    return total / count


@torch.no_grad()
def layer_sensitivity(
    model: nn.Module,
    fmt: str,
    ids: list[torch.Tensor],
    *,
    skip=("lm_head", "embed_tokens"),
    **quant_kwargs,
) -> list[tuple[str, float]]:
    """(layer name, mean per-token KL) for every linear of ``model`` quantized alone to ``fmt`` (its weights
    as a QuantLinear with ``quant_kwargs`` holds them, activations not), most sensitive first. ``model`` is
    restored before returning."""
    model.eval()
    reference = [torch.log_softmax(model(x).logits.float(), -1) for x in ids]
    ranking = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _skipped(name, skip):
            continue
        original = module.weight.detach().clone()
        quantized = QuantLinear.from_linear(module, fmt, act=None, **quant_kwargs)
        module.weight.copy_(quantized.dequantized_weight(original.dtype))
        try:
            ranking.append((name, _mean_kl(model, ids, reference)))
        finally:
            module.weight.copy_(original)
    return sorted(ranking, key=lambda item: -item[1])


def most_sensitive(ranking: list[tuple[str, float]], count: int) -> tuple[str, ...]:
    """The names of the ``count`` most sensitive layers of a ``layer_sensitivity`` ranking."""
    if count < 0:
        raise ValueError(f"rollout.fp8_layers must be >= 0, got {count}")
    return tuple(name for name, _ in ranking[:count])
