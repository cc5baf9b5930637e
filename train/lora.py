"""LoRA adapters on the policy (through peft), the QeRL-style quantized frozen base, and merged weights.

The adapters are injected in place (`peft.inject_adapter_in_model`), so the policy stays the same Hugging Face
model object: `policy.base_model`, `policy.get_output_embeddings()` and the fused loss work unchanged. Each
adapted linear layer becomes a peft `LoraLayer` whose `base_layer` is the frozen original; with
`base_precision` fp8/mxfp4/nvfp4 that base layer is a `bitrl.quant.QuantLinear` quantized once (weights only),
and the rollout copy holds the very same module, so trainer and rollout see bit-identical base weights.
"""

from __future__ import annotations

import torch
from torch import nn

# model.lora.base_precision -> bitrl.quant format
BASE_FORMATS = {"fp8": "fp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
ADAPTER = "default"


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoraLayer of every adapted module of `model` (empty without LoRA)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def apply_lora(policy: nn.Module, cfg) -> nn.Module:
    """Inject LoRA adapters into `policy` in place and freeze everything else; returns `policy`.

    cfg: a bitrl.engine.config.LoraConfig with rank > 0. Adapters start as a no-op (B = 0). With
    cfg.base_precision != "full" every adapted base layer is replaced by a weight-only QuantLinear.
    """
    from peft import LoraConfig, inject_adapter_in_model

    targets = cfg.target_modules
    peft_cfg = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        inject_adapter_in_model(peft_cfg, policy)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules: {e}") from None
    for name, p in policy.named_parameters():
        p.requires_grad_("lora_" in name)
    if cfg.base_precision != "full":
        quantize_lora_base_(policy, BASE_FORMATS[cfg.base_precision])
    return policy


@torch.no_grad()
def quantize_lora_base_(policy: nn.Module, fmt: str) -> None:
    """Store every adapted layer's frozen base weight quantized (weights only, activations untouched)."""
    from bitrl.quant import QuantLinear

    for layer in lora_layers(policy).values():
        base = layer.base_layer
        if isinstance(base, QuantLinear):
            continue
        if not isinstance(base, nn.Linear):
            raise ValueError(f"model.lora.base_precision: cannot quantize a {type(base).__name__} base layer")
        layer.base_layer = QuantLinear.from_linear(base, fmt, act=None)


def base_weight(layer: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The frozen base weight [out, in] of a LoraLayer (dequantized if quantized), in `dtype`."""
    from bitrl.quant import QuantLinear

    base = layer.base_layer
    if isinstance(base, QuantLinear):
        return base.qweight.dequantize(dtype or base.compute_dtype)
    return base.weight.detach() if dtype is None else base.weight.detach().to(dtype)


def merged_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """W + (alpha / r) B A of a LoraLayer, computed in fp32 and returned in `dtype`: [out, in]."""
    delta = layer.get_delta_weight(ADAPTER).float()
    return (base_weight(layer, torch.float32) + delta).to(dtype)


@torch.no_grad()
def merge_lora(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace, in place, every LoraLayer of `model` by a plain nn.Linear holding the merged weight in `dtype`
    (a quantized base is dequantized first). Returns `model`, now a plain Hugging Face model."""
    for name, layer in lora_layers(model).items():
        base = layer.base_layer
        linear = nn.Linear(
            layer.in_features, layer.out_features, bias=base.bias is not None, dtype=dtype, device="meta"
        )
        linear.weight = nn.Parameter(merged_weight(layer, dtype), requires_grad=False)
        if base.bias is not None:
            linear.bias = nn.Parameter(base.bias.detach().to(dtype), requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    return model
