"""The rollout copy of the policy in its own precision, and its weight sync after each optimizer step.

Float precisions (fp32, bf16, fp16) are a cast copy; quantized ones (fp8, mxfp8, mxfp4, nvfp4) swap every
nn.Linear except the embeddings and the LM head for a bitrl.quant.QuantLinear, re-quantized on sync only
where the trainer's weights changed.
"""

from __future__ import annotations

import copy

import torch

FLOAT_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANT_FORMATS = {"fp8": "fp8_e4m3", "mxfp8": "mxfp8", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
PRECISIONS = ("full", *FLOAT_PRECISIONS, *QUANT_FORMATS)


def make_rollout_model(policy: torch.nn.Module, precision: str = "full", act: str | None = "auto"):
    """A copy of `policy` for generation. precision: "full" (the policy's own dtype) or a name in PRECISIONS.

    act: activation quantization for quantized precisions ("auto": W8A8 for fp8, weights only for 4-bit;
    None: weights only; see bitrl.quant.QuantLinear).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"rollout.precision must be one of {PRECISIONS}, got {precision!r}")
    model = copy.deepcopy(policy).eval()
    if precision in FLOAT_PRECISIONS:
        model.to(FLOAT_PRECISIONS[precision])
    elif precision in QUANT_FORMATS:
        from bitrl.quant import quantize_model

        model = quantize_model(model, QUANT_FORMATS[precision], act=act, source=policy)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def sync_rollout_model_(
    rollout_model: torch.nn.Module, policy: torch.nn.Module, precision: str = "full"
) -> dict:
    """Copy the policy's current weights into the rollout copy (casting or re-quantizing). Returns stats."""
    if precision in QUANT_FORMATS:
        from bitrl.quant import requantize_

        return requantize_(rollout_model, policy)
    rollout_model.load_state_dict(policy.state_dict())
    return {}
