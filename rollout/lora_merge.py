"""The LoRA layers of a policy (peft `LoraLayer`s) and their merged weights W + (alpha / r) B A: what the
rollout copy holds (bitrl.rollout.precision) and what an export writes (bitrl.engine.export). The adapters
themselves are injected and trained by bitrl.train.lora."""

from __future__ import annotations

import torch
from torch import nn

ADAPTER = "default"  # the adapter name peft gives the adapters bitrl.train.lora injects


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoraLayer of every adapted module of `model` (empty without LoRA)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft, no LoRA layers
        return False
    return isinstance(module, LoraLayer)


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def base_weight(layer: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The frozen base weight [out, in] of a LoraLayer (dequantized if quantized), in `dtype`."""
    from bitrl.quant import QuantLinear

    base = layer.base_layer
    if isinstance(base, QuantLinear):
        return base.qweight.dequantize(dtype or base.compute_dtype)
    return base.weight.detach() if dtype is None else base.weight.detach().to(dtype)


def merged_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """W + (alpha / r) B A of a LoraLayer, computed in fp32 and returned in `dtype`: [out, in];
    differentiable in the adapters (the base is detached)."""
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
