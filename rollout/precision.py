"""The rollout copy of the policy in its own precision, and its weight sync after each optimizer step.

Float precisions (fp32, bf16, fp16) are a cast copy; quantized ones (fp8, mxfp8, mxfp4, nvfp4) swap every
nn.Linear except the embeddings and the LM head for a bitrl.quant.QuantLinear, re-quantized on sync only
where the trainer's weights changed.

A policy with LoRA adapters (bitrl.train.lora) gets a plain copy holding the merged weights W + (alpha/r) B A
(bitrl.rollout.lora_merge), re-merged (and re-quantized) on sync; only adapted layers change, so only they
are touched. With a QeRL-style
quantized base the copy keeps the adapters unmerged and holds the trainer's own base modules: the base is
stored once and both models see the same bits.
"""

from __future__ import annotations

import copy

import torch

from bitrl.rollout.lora_merge import lora_layers, merge_lora, merged_weight

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
    layers = lora_layers(policy)
    shared = shared_base_modules(layers)
    if shared:
        fmt = next(iter(shared.values())).fmt
        if precision not in ("full", *(k for k, v in QUANT_FORMATS.items() if v == fmt)):
            raise ValueError(
                f"rollout.precision={precision!r}: the rollout shares the trainer's {fmt} LoRA base "
                "(model.lora.base_precision); use rollout.precision=full"
            )
        # deepcopy with the base modules pre-seeded in the memo: the copy refers to the same objects
        model = copy.deepcopy(policy, memo={id(m): m for m in shared.values()}).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model
    model = copy.deepcopy(policy).eval()
    if layers:
        merge_lora(model, next(iter(layers.values())).base_layer.weight.dtype)
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
    layers = lora_layers(policy)
    if layers:
        return _sync_lora_(rollout_model, policy, layers)
    if precision in QUANT_FORMATS:
        from bitrl.quant import requantize_

        return requantize_(rollout_model, policy)
    rollout_model.load_state_dict(policy.state_dict())
    return {}


def shared_base_modules(layers: dict) -> dict:
    """name -> QuantLinear base of each LoRA layer whose frozen base is stored quantized (QeRL-style)."""
    from bitrl.quant import QuantLinear

    return {n: m.base_layer for n, m in layers.items() if isinstance(m.base_layer, QuantLinear)}


def _sync_lora_(rollout_model: torch.nn.Module, policy: torch.nn.Module, layers: dict) -> dict:
    """Adapters changed, nothing else did: copy them (shared base) or re-merge the adapted layers."""
    from bitrl.quant import QuantLinear

    if shared_base_modules(layers):
        params = dict(rollout_model.named_parameters())
        trainable = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        for name, p in trainable:
            params[name].copy_(p.detach())
        return {"copied": len(trainable)}
    stats = {"requantized": 0, "merged": 0}
    for name, layer in layers.items():
        target = rollout_model.get_submodule(name)
        if isinstance(target, QuantLinear):
            target.set_weight(merged_weight(layer, target.compute_dtype))
            stats["requantized"] += 1
        else:
            target.weight.copy_(merged_weight(layer, target.weight.dtype))
            stats["merged"] += 1
    return stats
