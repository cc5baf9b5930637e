"""GPTQ for the block-scaled FP4 formats: round each weight column knowing what the next columns can absorb.

Round-to-nearest quantizes every weight alone. GPTQ (Frantar et al., 2022) quantizes the columns of a linear's
weight one at a time, in input order, and after each column moves its rounding error onto the columns not yet
quantized, weighted by the inverse Hessian of the layer's squared output error, ``H = X^T X`` over calibration
inputs X [tokens, in]. The output error ``||X W^T - X Q^T||`` it leaves is what the rollout copy's tokens see;
the weight error itself grows. For MXFP4 / NVFP4 the block scales are chosen when the quantizer reaches a
block's first column, from the block's weights as the earlier errors have moved them (the block-scaled form
of GPTQ that MR-GPTQ, Egiazarian et al. 2025, uses for FP4), by the layer's own scale rule (``scale_mode``).
The result is an ordinary QuantizedTensor: the format, the scales and the run-time cost are unchanged.

    hessians = collect_hessians(policy, calibration_sequences)           # name -> [in, in] fp32
    qt = gptq_quantize(linear.weight, hessians[name], "nvfp4", scale_mode="mse")
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from . import reference as ref
from .formats import get_format
from .quantize import global_amax, quantize_reference, resolve_spec
from .tensor import QuantizedTensor

__all__ = ["collect_hessians", "gptq_quantize", "gptq_requantize_"]

# Columns updated together (the paper's lazy batch): the error of a batch reaches the later columns in one
# product, which keeps the loop's cost in matrix products rather than in per-column updates.
LAZY_COLUMNS = 128


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and module.weight.dim() == 2)


@torch.no_grad()
def collect_hessians(
    model: nn.Module, sequences: Iterable[torch.Tensor], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """``X^T X / tokens`` (float32 [in, in]) of the input X of each linear (``nn.Linear`` or transformers
    ``Conv1D``) of ``model`` over ``sequences`` (int64 token ids [T] each, run one at a time so that no
    padding enters).

    names: the linears to collect (default: every one); a name the model lacks is a ValueError."""
    modules = dict(model.named_modules())
    wanted = [n for n, m in modules.items() if _is_linear(m)] if names is None else list(names)
    missing = [n for n in wanted if n not in modules or not _is_linear(modules[n])]
    if missing:
        raise ValueError(f"collect_hessians: the model has no linear {missing[0]!r}")
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(wanted, 0)

    def hook(name):
        def accumulate(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            if name not in sums:
                sums[name] = x.new_zeros(x.shape[1], x.shape[1])
            sums[name].addmm_(x.t(), x)
            counts[name] += x.shape[0]

        return accumulate

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in wanted]
    device = next(model.parameters()).device
    try:
        for seq in sequences:
            if seq.dim() != 1 or seq.numel() == 0 or seq.dtype != torch.int64:
                raise ValueError(
                    f"sequences: each must be a non-empty 1-D int64 tensor of ids, got {seq.dtype} "
                    f"{tuple(seq.shape)}"
                )
            model(seq.to(device)[None])
    finally:
        for h in handles:
            h.remove()
    unreached = [n for n in wanted if not counts[n]]
    if unreached:
        raise ValueError(f"collect_hessians: no input reached {unreached[0]!r} (no sequence given?)")
    return {n: sums[n] / counts[n] for n in wanted}


@torch.no_grad()
def gptq_requantize_(
    qmodel: nn.Module, source: nn.Module, sequences: list[torch.Tensor], damp: float = 0.01
) -> dict:
    """Re-round every FP4 QuantLinear of ``qmodel`` (bitrl.quant.quantize_model of a copy of ``source``)
    from ``source``'s current weights by GPTQ, on Hessians of ``source``'s own inputs over ``sequences``
    (int64 ids [T] each). Layers in other formats (e.g. the fp8 ones of a recipe) are left as they are.

    Returns ``{"gptq_layers": n, "calibration_tokens": n, "seconds": t}``."""
    from .linear import QuantLinear

    t0 = time.perf_counter()
    layers = {
        m.source_name: m
        for m in qmodel.modules()
        if isinstance(m, QuantLinear) and m.source_name and get_format(m.fmt).packed
    }
    was_training = source.training
    source.eval()
    try:
        hessians = collect_hessians(source, sequences, names=list(layers))
    finally:
        source.train(was_training)
    weights = dict(source.named_modules())
    for name, layer in layers.items():
        layer.set_weight(weights[name].weight.detach(), hessian=hessians[name], damp=damp)
    return {
        "gptq_layers": len(layers),
        "calibration_tokens": sum(int(s.numel()) for s in sequences),
        "seconds": time.perf_counter() - t0,
    }


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of (H + damp * mean(diag H) I)^-1 [in, in] fp32, dead columns [in] bool).

    A dead column (no calibration input ever reached it) gets a unit diagonal: its weight rounds alone."""
    h = hessian.to(torch.float64).clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32), dead


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: str,
    *,
    keep: torch.Tensor | None = None,
    damp: float = 0.01,
    **quant_kwargs,
) -> tuple[QuantizedTensor, torch.Tensor]:
    """GPTQ-quantize ``weight`` [out, in] (float) to the FP4 format ``fmt`` ("mxfp4" or "nvfp4").

    hessian: [in, in] ``X^T X`` of the layer's inputs (:func:`collect_hessians`). keep: bool [out, in], the
    weights held outside the format (the outlier fallback): they take no part in the block scales, are held
    exactly (their error, bf16 rounding, moves on like the others) and their codes are zero. damp: the
    fraction of the mean diagonal added to H (conditioning). quant_kwargs: ``scale_mode`` / ``block_size``
    as for :func:`bitrl.quant.quantize`.

    Returns (QuantizedTensor, float32 [out, in] final weights: the dequantized codes, and the kept weights'
    values at the positions of ``keep``).
    """
    f = get_format(fmt)
    if not (f.packed and f.scale_kind != "fp32"):
        raise ValueError(f"gptq_quantize takes the block-scaled FP4 formats (mxfp4, nvfp4), got {f.name}")
    if weight.dim() != 2 or tuple(hessian.shape) != (weight.shape[1],) * 2:
        raise ValueError(
            f"weight must be [out, in] and hessian [in, in]; got {tuple(weight.shape)} and "
            f"{tuple(hessian.shape)}"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian contains NaN or inf: the calibration forward produced non-finite inputs")
    spec = resolve_spec(f, **quant_kwargs)
    rows, cols = weight.shape
    bw = spec.block_size
    kp = -(-cols // bw) * bw
    w = torch.zeros(rows, kp, dtype=torch.float32, device=weight.device)
    w[:, :cols] = weight.to(torch.float32)
    h = torch.zeros(kp, kp, dtype=torch.float32, device=weight.device)
    h[:cols, :cols] = hessian.to(weight.device, torch.float32)
    kept = torch.zeros(rows, kp, dtype=torch.bool, device=weight.device)
    if keep is not None:
        if tuple(keep.shape) != tuple(weight.shape) or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool tensor of shape {tuple(weight.shape)}")
        kept[:, :cols] = keep
    # the tensor scale (NVFP4) is the plain quantizer's: from the weight without its kept entries
    gmax = global_amax(w.masked_fill(kept, 0.0), name="weight")
    upper, dead = _inverse_cholesky(h, damp)
    w[:, dead] = 0.0
    grid = torch.zeros(rows, kp, dtype=torch.float32, device=weight.device)  # codes' values (x / scale)
    final = torch.zeros_like(w)
    scales, tensor_scale = [], None
    for start in range(0, kp, LAZY_COLUMNS):
        stop = min(start + LAZY_COLUMNS, kp)
        block = w[:, start:stop].clone()
        errors = torch.zeros_like(block)
        hinv = upper[start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if col % bw == 0:  # a scale block begins: its scale from the weights as they stand now
                group = block[:, i : i + bw].masked_fill(kept[:, col : col + bw], 0.0)
                _, stored, tensor_scale = quantize_reference(group, spec, (1, bw), None, gmax)
                scales.append(stored)
                scale = (ref.e8m0_from_storage(stored) if f.scale_kind == "e8m0" else stored.float())[:, 0]
                value = scale if tensor_scale is None else scale * tensor_scale
                safe = torch.where(value > 0, value, torch.ones_like(value))
            x = block[:, i]
            g = ref.round_to_element((x / safe).abs(), f.element).copysign(x)
            g = torch.where(value > 0, g, torch.zeros_like(g)).masked_fill_(kept[:, col], 0.0)
            deq = g * scale if tensor_scale is None else g * scale * tensor_scale  # dequantize's order
            q = torch.where(kept[:, col], x.to(torch.bfloat16).float(), deq)
            grid[:, col], final[:, col] = g, q
            err = (x - q) / hinv[i, i]
            block[:, i:].addr_(err, hinv[i, i:], alpha=-1.0)
            errors[:, i] = err
        w[:, stop:].addmm_(errors, upper[start:stop, stop:], alpha=-1.0)
    qt = QuantizedTensor(
        fmt=f,
        shape=weight.shape,
        data=ref.pack_fp4(ref.encode_e2m1_nearest(grid)),
        scale=torch.cat(scales, dim=1),
        tensor_scale=tensor_scale,
        block=(1, bw),
        granularity="block",
        scale_mode=spec.scale_mode,
        dtype=weight.dtype,
    )
    return qt, final[:, :cols]
