"""A quantized rollout copy's recipe: the format and the remedies applied when it is built and at every sync.

    fp8 = ("model.layers.11.mlp.down_proj",)             # e.g. the top of `quant-report --sensitivity`
    recipe = QuantRecipe("nvfp4", scale_mode="mse", outlier_tau=8.0, fp8_layers=fp8)
    rollout = build_quantized_copy(policy, recipe)       # a new module; the policy is untouched
    ...                                                  # optimizer steps on the policy
    sync_quantized_copy_(rollout, policy, recipe)        # re-apply every remedy to the new weights

The remedies, each measured on SmolLM2-135M-Instruct in docs/low_precision.md:
- ``scale_mode="mse"``: each block's scale chosen among a few candidates by squared error (quantize); free
  at run time (the stored scales are the format's own).
- ``outlier_tau``: weights above tau block medians kept in bf16 beside the packed ones (QuantLinear).
- ``rotation``: block Hadamard rotations before quantizing (bitrl.quant.rotation).
- ``fp8_layers``: the named linears kept in FP8 (the most sensitive ones: bitrl.quant.sensitivity).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from .linear import quantize_model, requantize_
from .rotation import Rotation, rotate_model_, sync_rotated_

__all__ = ["QuantRecipe", "build_quantized_copy", "sync_quantized_copy_"]

SKIP = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class QuantRecipe:
    """fmt: the weight format of the rollout copy's linears; act: their activation quantization (see
    QuantLinear); scale_mode, outlier_tau: passed to every 4-bit/MX layer; rotation: None or a Rotation;
    fp8_layers: full module names kept in fp8_e4m3 (W8A8) instead of ``fmt``."""

    fmt: str
    act: str | None = "auto"
    scale_mode: str = "floor"
    outlier_tau: float | None = None
    rotation: Rotation | None = None
    fp8_layers: tuple[str, ...] = ()

    def quant_kwargs(self) -> dict:
        from .formats import get_format

        block_scaled = get_format(self.fmt).scale_kind != "fp32"
        kw = {"scale_mode": self.scale_mode} if block_scaled else {}
        if self.outlier_tau is not None:
            kw["outlier_tau"] = self.outlier_tau
        return kw


def build_quantized_copy(policy: nn.Module, recipe: QuantRecipe) -> nn.Module:
    """A quantized copy of ``policy`` (float weights, e.g. LoRA already merged) following ``recipe``."""
    model = copy.deepcopy(policy)
    if recipe.rotation is not None:
        rotate_model_(model, recipe.rotation)
    names = {n for n, _ in model.named_modules()}
    missing = sorted(set(recipe.fp8_layers) - names)
    if missing:
        raise ValueError(f"rollout.fp8_layers: the model has no module {missing[0]!r}")
    # fp8 layers first: quantize_model replaces nn.Linear modules only, so the second pass skips them
    if recipe.fp8_layers:
        keep = tuple(
            n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in recipe.fp8_layers
        )
        quantize_model(model, "fp8_e4m3", skip=(*SKIP, *keep), act="auto")
    return quantize_model(
        model, recipe.fmt, skip=SKIP, act=recipe.act, source=policy, **recipe.quant_kwargs()
    )


def sync_quantized_copy_(rollout_model: nn.Module, policy: nn.Module, recipe: QuantRecipe) -> dict:
    """Refresh the copy from the policy's current weights: rotated copies recompute every rotated tensor,
    others re-quantize what changed (bitrl.quant.requantize_). Returns counts."""
    if recipe.rotation is not None:
        return sync_rotated_(rollout_model, policy, recipe.rotation)
    return requantize_(rollout_model, policy)
