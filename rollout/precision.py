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


def make_rollout_model(
    policy: torch.nn.Module, precision: str = "full", act: str | None = "auto", mx_scale_mode: str = "rceil"
):
    """A copy of `policy` for generation. precision: "full" (the policy's own dtype) or a name in PRECISIONS.

    act: activation quantization for quantized precisions ("auto": W8A8 for fp8, weights only for 4-bit;
    None: weights only; see bitrl.quant.QuantLinear). mx_scale_mode: the E8M0 block scale of mxfp8/mxfp4
    weights, "rceil" (amax / element max rounded up to a power of two: nothing saturates) or "floor" (OCP:
    the largest elements of a block saturate at the element max; for FP4 that costs up to a quarter of their
    value, and the largest weights are the ones that matter most).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"rollout.precision must be one of {PRECISIONS}, got {precision!r}")
    model = copy.deepcopy(policy).eval()
    if precision in FLOAT_PRECISIONS:
        model.to(FLOAT_PRECISIONS[precision])
    elif precision in QUANT_FORMATS:
        from bitrl.quant import quantize_model

        fmt = QUANT_FORMATS[precision]
        scale = {"scale_mode": mx_scale_mode} if fmt.startswith("mx") else {}
        model = quantize_model(model, fmt, act=act, source=policy, **scale)
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
