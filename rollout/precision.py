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


def make_rollout_model(policy: torch.nn.Module, precision: str = "full", recipe=None, calibration=None):
    """A copy of `policy` for generation. precision: "full" (the policy's own dtype) or a name in PRECISIONS.

    recipe: for quantized precisions, the bitrl.quant.QuantRecipe of the copy (scales, outlier fallback,
    rotation, layers kept in fp8; its format must be the precision's); None: `default_recipe(precision)`,
    the defaults of `rollout.*` (RolloutConfig.quant_recipe). calibration: int64 token ids [T] per sequence,
    the inputs a GPTQ recipe's Hessians are collected on (bitrl.quant.gptq).
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
    if layers and recipe is not None and recipe.rotation is not None:
        raise ValueError("rollout.rotation: not with LoRA adapters (their sync merges unrotated weights)")
    if layers and recipe is not None and recipe.gptq:
        raise ValueError("rollout.gptq: not with LoRA adapters (their sync merges without calibration)")
    model = copy.deepcopy(policy).eval()
    if layers:
        merge_lora(model, next(iter(layers.values())).base_layer.weight.dtype)
    if precision in FLOAT_PRECISIONS:
        model.to(FLOAT_PRECISIONS[precision])
        keep_rotary_frequencies_(model, policy)
    elif precision in QUANT_FORMATS:
        from bitrl.quant.recipe import quantize_with_recipe_

        recipe = recipe or default_recipe(precision)
        if recipe.fmt != QUANT_FORMATS[precision]:
            raise ValueError(f"recipe: format {recipe.fmt} is not rollout.precision={precision}")
        model = quantize_with_recipe_(model, recipe, source=policy, calibration=calibration)
        model._bitrl_recipe = recipe
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
        from bitrl.quant.recipe import sync_quantized_copy_

        return sync_quantized_copy_(rollout_model, policy, rollout_model._bitrl_recipe)
    rollout_model.load_state_dict(policy.state_dict())
    return {}


def keep_rotary_frequencies_(model: torch.nn.Module, policy: torch.nn.Module) -> None:
    """Give the cast copy the policy's own rotary frequencies (inv_freq buffers): the rotary embedding
    computes its angles in fp32 from them, and a bf16 copy of them would put every position's angle, and so
    every query and key, a rounding away from the trainer's."""
    for name, buffer in policy.named_buffers():
        if name.rpartition(".")[2] in ("inv_freq", "original_inv_freq"):
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.detach().clone()


def default_recipe(precision: str):
    """The recipe `rollout.*` gives `precision` by default (bitrl.quant.recipe.recipe_for)."""
    from bitrl.quant.recipe import recipe_for

    return recipe_for(QUANT_FORMATS[precision])


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
