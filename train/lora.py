"""LoRA adapters on the policy (through peft) and the QeRL-style quantized frozen base (their merged weights:
bitrl.rollout.lora_merge).

The adapters are injected in place (`peft.inject_adapter_in_model`), so the policy stays the same Hugging Face
model object: `policy.base_model`, `policy.get_output_embeddings()` and the fused loss work unchanged. Each
adapted linear layer becomes a peft `LoraLayer` whose `base_layer` is the frozen original; with
`base_precision` fp8/mxfp4/nvfp4 that base layer is a `bitrl.quant.QuantLinear` quantized once (weights only),
and the rollout copy holds the very same module, so trainer and rollout see bit-identical base weights.
"""

from __future__ import annotations

import torch
from torch import nn

from bitrl.rollout.lora_merge import lora_layers

# model.lora.base_precision -> bitrl.quant format
BASE_FORMATS = {"fp8": "fp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


def apply_lora(policy: nn.Module, cfg, base_recipe=None, calibration=None) -> nn.Module:
    """Inject LoRA adapters into `policy` in place and freeze everything else; returns `policy`.

    cfg: a bitrl.engine.config.LoraConfig with rank > 0. Adapters start as a no-op (B = 0). With
    cfg.base_precision != "full" every adapted base layer is replaced by a weight-only QuantLinear, its
    scales and outlier fallback as `base_recipe` says (a bitrl.quant.QuantRecipe in that format; None: the
    format's measured defaults, `recipe_for`). A GPTQ base recipe rounds the base once, on Hessians of the
    policy's inputs over `calibration` (int64 token ids [T] per sequence; bitrl.quant.gptq).
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
        from bitrl.quant.recipe import recipe_for

        fmt = BASE_FORMATS[cfg.base_precision]
        recipe = base_recipe or recipe_for(fmt, act=None)
        if recipe.fmt != fmt or recipe.rotation is not None or recipe.fp8_layers:
            raise ValueError(
                f"model.lora.base_precision={cfg.base_precision}: the base recipe must be {fmt} weights "
                "without rotation or fp8 layers"
            )
        quantize_lora_base_(policy, recipe, calibration)
    return policy


@torch.no_grad()
def quantize_lora_base_(policy: nn.Module, recipe, calibration=None) -> None:
    """Store every adapted layer's frozen base weight quantized as `recipe` (a bitrl.quant.QuantRecipe)
    says: its format, scale selection, outlier fallback and GPTQ rounding (on `calibration`, int64 ids [T]
    per sequence); weights only, activations untouched."""
    from bitrl.quant import QuantLinear
    from bitrl.quant.gptq import gptq_requantize_

    if recipe.gptq and not calibration:
        raise ValueError("model.lora.base_precision: a GPTQ base needs calibration sequences")
    layers, quantized = lora_layers(policy), {}
    for name, layer in layers.items():
        base = layer.base_layer
        if isinstance(base, QuantLinear):
            continue
        if not isinstance(base, nn.Linear):
            raise ValueError(f"model.lora.base_precision: cannot quantize a {type(base).__name__} base layer")
        quantized[name] = QuantLinear.from_linear(base, recipe.fmt, act=None, **recipe.quant_kwargs())
    if recipe.gptq and quantized:
        # Rounded while the policy still holds its full-precision bases: the Hessians are of their inputs
        # (the adapters start as a no-op, so the policy computes what the plain model does).
        for name, q in quantized.items():
            q.source_name = f"{name}.base_layer"
        gptq_requantize_(nn.ModuleList(quantized.values()), policy, calibration, recipe.gptq_damp)
        for q in quantized.values():
            q.source_name = None
    for name, q in quantized.items():
        layers[name].base_layer = q
