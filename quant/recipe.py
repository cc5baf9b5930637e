"""A quantized rollout copy's recipe: the format and the remedies applied when it is built and at every sync.

    fp8 = ("model.layers.11.mlp.down_proj",)             # e.g. the top of `quant-report --sensitivity`
    recipe = QuantRecipe("nvfp4", scale_mode="mse", outlier_tau=8.0, fp8_layers=fp8)
    rollout = quantize_with_recipe_(copy.deepcopy(policy), recipe, source=policy)
    ...                                                  # optimizer steps on the policy
    sync_quantized_copy_(rollout, policy, recipe)        # re-apply every remedy to the new weights

The remedies, each measured on SmolLM2-135M-Instruct in docs/low_precision.md:
- ``scale_mode="mse"``: each block's scale chosen among a few candidates by squared error (quantize); free
  at run time (the stored scales are the format's own).
- ``outlier_tau``: weights above tau block medians kept in bf16 beside the packed ones (QuantLinear).
- ``rotation``: block Hadamard rotations before quantizing (bitrl.quant.rotation).
- ``fp8_layers``: the named linears kept in FP8 (the most sensitive ones: bitrl.quant.sensitivity).
- ``gptq``: the FP4 weights rounded by GPTQ on calibration sequences (bitrl.quant.gptq); free at run time,
  re-run at every sync on the policy's own inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .gptq import gptq_requantize_
from .linear import quantize_model, requantize_
from .rotation import Rotation, rotate_model_, sync_rotated_

__all__ = ["QuantRecipe", "quantize_with_recipe_", "recipe_for", "sync_quantized_copy_"]

SKIP = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class QuantRecipe:
    """fmt: the weight format of the rollout copy's linears; act: their activation quantization (see
    QuantLinear); scale_mode, outlier_tau: passed to every 4-bit/MX layer; rotation: None or a Rotation;
    fp8_layers: full module names kept in fp8_e4m3 (W8A8) instead of ``fmt``; gptq: round the FP4 weights by
    GPTQ (gptq_damp: its Hessian damping, a fraction of the mean diagonal)."""

    fmt: str
    act: str | None = "auto"
    scale_mode: str = "floor"
    outlier_tau: float | None = None
    rotation: Rotation | None = None
    fp8_layers: tuple[str, ...] = ()
    gptq: bool = False
    gptq_damp: float = 0.1

    def quant_kwargs(self) -> dict:
        from .formats import get_format

        block_scaled = get_format(self.fmt).scale_kind != "fp32"
        kw = {"scale_mode": self.scale_mode} if block_scaled else {}
        if self.outlier_tau is not None:
            kw["outlier_tau"] = self.outlier_tau
        return kw


def recipe_for(
    fmt: str,
    *,
    act="auto",
    scale_mode="auto",
    outlier_tau="auto",
    rotation=None,
    fp8_layers=(),
    gptq=False,
    gptq_damp=0.1,
) -> QuantRecipe:
    """The recipe with every "auto" resolved to the measured default for ``fmt`` (docs/low_precision.md):
    scale_mode "mse" for the block-scaled formats (free at run time), outlier_tau 8 for mxfp4 (0.05% of the
    weights in bf16 cut SmolLM2's mismatch 3x; NVFP4's E4M3 scales gain nothing from it), no rotation."""
    from .formats import get_format

    block_scaled = get_format(fmt).scale_kind != "fp32"
    if scale_mode == "auto":
        scale_mode = "mse" if block_scaled else "floor"
    if (scale_mode == "rceil" and not fmt.startswith("mx")) or (scale_mode == "mse" and not block_scaled):
        raise ValueError(f"rollout.scale_mode={scale_mode} does not apply to {fmt} weights")
    if outlier_tau == "auto":
        outlier_tau = 8.0 if fmt == "mxfp4" else None
    if gptq and fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"rollout.gptq rounds FP4 weights (mxfp4, nvfp4), not {fmt}")
    if gptq and rotation is not None:
        raise ValueError("rollout.gptq: not with rollout.rotation (its Hessians are of the unrotated inputs)")
    if not 0 < gptq_damp < 1:
        raise ValueError(f"rollout.gptq_damp must be in (0, 1), got {gptq_damp}")
    return QuantRecipe(fmt, act, scale_mode, outlier_tau, rotation, tuple(fp8_layers), bool(gptq), gptq_damp)


def quantize_with_recipe_(
    model: nn.Module,
    recipe: QuantRecipe,
    *,
    source: nn.Module | None = None,
    calibration: list[torch.Tensor] | None = None,
):
    """Quantize ``model`` (a float copy of the policy, e.g. LoRA already merged) in place following
    ``recipe``; returns it. source: the policy it was copied from (for the first sync's change detection;
    needed by GPTQ, whose Hessians are of the policy's inputs). calibration: int64 token ids [T] per
    sequence, what GPTQ's Hessians are collected on (kept on the copy for every later sync)."""
    if recipe.gptq and (source is None or not calibration):
        raise ValueError("rollout.gptq: the copy needs its source policy and calibration sequences")
    if recipe.rotation is not None:
        rotate_model_(model, recipe.rotation)
    names = {n for n, _ in model.named_modules()}
    missing = sorted(set(recipe.fp8_layers) - names)
    if missing:
        raise ValueError(f"rollout.fp8_layers: the model has no module {missing[0]!r}")
    # fp8 layers first: quantize_model replaces nn.Linear modules only, so the second pass skips them
    if recipe.fp8_layers:
        keep = tuple(
            n
            for n, m in model.named_modules()
            # a rotated copy wraps some linears (InputRotation): `inner` is the layer the name means
            if isinstance(m, nn.Linear) and n.removesuffix(".inner") not in recipe.fp8_layers
        )
        quantize_model(model, "fp8_e4m3", skip=(*SKIP, *keep), act="auto")
    quantize_model(model, recipe.fmt, skip=SKIP, act=recipe.act, source=source, **recipe.quant_kwargs())
    if recipe.gptq:
        model._bitrl_calibration = list(calibration)
        gptq_requantize_(model, source, model._bitrl_calibration, recipe.gptq_damp)
    return model


def sync_quantized_copy_(rollout_model: nn.Module, policy: nn.Module, recipe: QuantRecipe) -> dict:
    """Refresh the copy from the policy's current weights: rotated copies recompute every rotated tensor,
    others re-quantize what changed (bitrl.quant.requantize_), GPTQ copies re-round every FP4 layer on the
    policy's new inputs. Returns counts."""
    if recipe.rotation is not None:
        return sync_rotated_(rollout_model, policy, recipe.rotation)
    stats = requantize_(rollout_model, policy)
    if recipe.gptq and stats["requantized"]:
        stats.update(
            gptq_requantize_(rollout_model, policy, rollout_model._bitrl_calibration, recipe.gptq_damp)
        )
    return stats
