"""Exact elementwise decomposition of the quantization error, and the corrections that target each part.

Definitions (per scale block ``b`` of the format: 1 x 32 for MX, 1 x 16 for NVFP4, the FP8 granularity block):

* ``x`` the input, ``x̂`` the dequantized output of the quantizer under study (the plain format or a corrected
  variant), ``R`` round-to-nearest-even onto the element grid with saturation, ``max`` the element max (6,
  448, 57344).
* ``H`` the entries a correction keeps in higher precision (outlier fallback; empty otherwise).
* The **ideal scale** of block ``b`` is ``s*_b = amax_b / max`` with ``amax_b`` the largest ``|x|`` of the
  block outside ``H`` (float32): the exact, unrounded scale that maps the block maximum onto the top of the
  grid.
* The **ideal quantization** is ``I = s*_b * R(x / s*_b)`` (float32 arithmetic, like the real dequantizer):
  what the format would give if its scale could be stored exactly.
* ``F = {i : x_i != 0, x̂_i == 0, i not in H}``: the entries the quantizer flushed to zero.

Then, elementwise (float64, where each of the following is exact)::

    deadzone   = -x            on F                 (truncation of small entries to zero)
    scale_bias = x̂ - I         off F and off H      (what rounding the scale to a power of two / to E4M3
                                                     costs, including the clipping it causes under FLOOR)
    grid_noise = I - x         off F and off H      (rounding to the element grid with the ideal scale)
               = x̂ - x         on H                 (rounding of the fallback entries to bf16)

so ``scale_bias + deadzone + grid_noise == x̂ - x`` holds exactly, bit for bit, in float64: every operand is a
float32 number, the supports of ``deadzone`` and the other two are disjoint, and the differences involved are
between numbers whose magnitudes are close enough for float64 to hold them exactly (tested on random and
adversarial inputs). FP8 with an FP32 amax scale has ``x̂ == I`` and therefore no scale bias.

The parts are not orthogonal (scale bias and grid noise share a support), so their energies need not add up to
the total energy; the report shows all four.

Corrections:

* :func:`quantize_macroblock` (targets scale bias): a higher-precision scale ``m = 2**(j / C)`` per macro
  block (e.g. 128 elements = 4 MX blocks), chosen by search to minimise the macro block's squared error,
  multiplies the power-of-two block scales, so the effective block scales ``m * 2**e`` are no longer
  restricted to powers of two. Storage: one byte (``j``) per macro block.
* :func:`quantize_outlier_fallback` (targets deadzone and clipping): entries with ``|x| > tau * median(|x|)``
  of their block (outliers that inflate the block scale and flush the rest of the block), plus entries the
  plain quantizer would clip by more than ``clip_tol`` relative, are kept in bf16 (a sparse side table:
  16-bit value + 32-bit index); the block is quantized without them.
* AQN (targets the entropy effect of grid noise, not its energy): see :mod:`bitrl.quant.aqn`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference as ref
from .quantize import blockify, quantize, resolve_spec

__all__ = [
    "ErrorDecomposition",
    "error_decomposition",
    "quantize_macroblock",
    "quantize_outlier_fallback",
]


@dataclass
class ErrorDecomposition:
    """Elementwise error parts (float64, the shape of ``x``); ``total == scale_bias + deadzone +
    grid_noise``."""

    x: torch.Tensor
    xhat: torch.Tensor
    total: torch.Tensor
    scale_bias: torch.Tensor
    deadzone: torch.Tensor
    grid_noise: torch.Tensor
    flushed: torch.Tensor
    fallback: torch.Tensor

    def energies(self, relative: bool = True) -> dict[str, float]:
        """Sum of squares of each part (divided by ``||x||^2`` when ``relative``)."""
        norm = float(self.x.pow(2).sum()) if relative else 1.0
        norm = norm if norm > 0 else 1.0
        return {
            k: float(getattr(self, k).pow(2).sum()) / norm
            for k in ("total", "scale_bias", "deadzone", "grid_noise")
        }

    @property
    def rel_error(self) -> float:
        n = float(self.x.norm())
        return float(self.total.norm()) / n if n > 0 else 0.0

    @property
    def deadzone_fraction(self) -> float:
        return float(self.flushed.sum()) / self.x.numel()

    @property
    def fallback_fraction(self) -> float:
        return float(self.fallback.sum()) / self.x.numel()

    def summary(self) -> dict[str, float]:
        e = self.energies()
        return {
            "rel_error": self.rel_error,
            "deadzone_frac": self.deadzone_fraction,
            "fallback_frac": self.fallback_fraction,
            "E_total": e["total"],
            "E_scale_bias": e["scale_bias"],
            "E_deadzone": e["deadzone"],
            "E_grid_noise": e["grid_noise"],
        }


def ideal_quantization(
    x: torch.Tensor, fmt, *, fallback: torch.Tensor | None = None, **quant_kwargs
) -> torch.Tensor:
    """``I = s* R(x / s*)`` with the exact per-block scale ``s* = amax / max`` (float32, shape of ``x``)."""
    spec = resolve_spec(fmt, **{k: v for k, v in quant_kwargs.items() if k != "rounding"})
    elem = spec.fmt.element
    x2 = x.reshape(1, -1) if x.dim() == 1 else x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    block = spec.block(rows, cols)
    xb, _, kp = blockify(x2, block)
    inl = xb
    if fallback is not None:
        hb, _, _ = blockify(fallback.reshape(rows, cols).to(torch.float32), block)
        inl = torch.where(hb > 0, torch.zeros_like(xb), xb)
    amax = inl.abs().amax(dim=(1, 3))
    s = amax / elem.max
    s = torch.where(amax > 0, s, torch.ones_like(s))[:, None, :, None]
    r = xb / s
    g = ref.round_to_element(r.abs(), elem)
    ideal = torch.where(torch.signbit(r), -g, g) * s
    return ideal.reshape(-1, kp)[:rows, :cols].reshape(x.shape)


def error_decomposition(
    x: torch.Tensor,
    fmt,
    *,
    xhat: torch.Tensor | None = None,
    fallback: torch.Tensor | None = None,
    **quant_kwargs,
) -> ErrorDecomposition:
    """Split the quantization error of ``x`` in ``fmt`` into scale bias, deadzone and grid noise (module doc).

    Args:
        x: the tensor (quantized along its last dim).
        fmt: the format; ``quant_kwargs`` (``block_size``, ``scale_mode``, ``granularity``) as for
        ``quantize``.
        xhat: the dequantized output of a corrected quantizer with the same blocks (default: plain
        ``quantize``).
        fallback: bool mask of entries that quantizer kept in higher precision.
    """
    x32 = x.detach().to(torch.float32)
    if xhat is None:
        xhat = quantize(x32, fmt, **quant_kwargs).dequantize()
    xhat = xhat.detach().to(torch.float32).reshape(x.shape)
    h = torch.zeros(x.shape, dtype=torch.bool, device=x.device) if fallback is None else fallback.bool()
    ideal = ideal_quantization(x32, fmt, fallback=h if fallback is not None else None, **quant_kwargs)
    xd, qd, idd = x32.double(), xhat.double(), ideal.double()
    flushed = (qd == 0) & (xd != 0) & ~h
    zero = torch.zeros_like(xd)
    regular = ~flushed & ~h
    deadzone = torch.where(flushed, -xd, zero)
    scale_bias = torch.where(regular, qd - idd, zero)
    grid_noise = torch.where(regular, idd - xd, torch.where(h, qd - xd, zero))
    return ErrorDecomposition(
        x=xd,
        xhat=qd,
        total=qd - xd,
        scale_bias=scale_bias,
        deadzone=deadzone,
        grid_noise=grid_noise,
        flushed=flushed,
        fallback=h,
    )


# ----------------------------------------------------------------------------------------------- corrections


def quantize_macroblock(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    macro_block: int = 128,
    candidates: int = 16,
    **quant_kwargs,
) -> tuple[torch.Tensor, dict]:
    """Macro-block scaling: ``x̂ = m * Q(x / m)`` with one ``m = 2**(j / candidates)`` per macro block.

    ``j`` is chosen per macro block (``macro_block`` elements along the last dim, a multiple of the format's
    block) to minimise the macro block's squared error. Returns (x̂ float32, info with the chosen ``j`` and
    the storage overhead in bits per element).
    """
    spec = resolve_spec(fmt, **quant_kwargs)
    bw = spec.block(1, x.shape[-1])[1]
    if macro_block % bw:
        raise ValueError(f"macro_block must be a multiple of the block size {bw}, got {macro_block}")
    x32 = x.detach().to(torch.float32)
    x2 = x32.reshape(1, -1) if x32.dim() == 1 else x32.reshape(-1, x32.shape[-1])
    rows, cols = x2.shape
    nm = -(-cols // macro_block)
    pad = nm * macro_block - cols
    xp = torch.nn.functional.pad(x2, (0, pad))
    best_err = torch.full((rows, nm), float("inf"), device=x.device)
    best = torch.zeros_like(xp)
    best_j = torch.zeros((rows, nm), dtype=torch.uint8, device=x.device)
    for j in range(candidates):
        m = 2.0 ** (j / candidates)
        xq = quantize(xp / m, spec.fmt, **quant_kwargs).dequantize() * m
        err = (xq - xp).pow(2).view(rows, nm, macro_block).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        sel = better.repeat_interleave(macro_block, dim=1)
        best = torch.where(sel, xq, best)
        best_j = torch.where(better, torch.full_like(best_j, j), best_j)
    xhat = best[:, :cols].reshape(x.shape)
    return xhat, {"j": best_j, "overhead_bits_per_element": 8.0 / macro_block}


def outlier_mask(x2: torch.Tensor, block: tuple[int, int], tau: float) -> torch.Tensor:
    """bool [rows, cols]: the entries of x2 [rows, cols] with ``|x| > tau * median(|x|)`` of their block."""
    rows, cols = x2.shape
    xb, _, kp = blockify(x2, block)
    nbr, bh, nbc, bw = xb.shape
    flat = xb.permute(0, 2, 1, 3).reshape(nbr, nbc, bh * bw).abs()
    med = flat.median(dim=-1).values[:, None, :, None]
    return (xb.abs() > tau * med).reshape(-1, kp)[:rows, :cols]


def quantize_outlier_fallback(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    tau: float = 8.0,
    clip_tol: float | None = 0.1,
    **quant_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Outlier fallback: keep in bf16 the block entries with ``|x| > tau * median_block(|x|)`` and, if
    ``clip_tol`` is set, those the plain quantizer would clip by more than ``clip_tol`` relative; quantize the
    rest of each block without them (its scale comes from the inliers).

    Returns (x̂ float32, fallback mask, info with the fraction kept and the overhead in bits per element).
    """
    spec = resolve_spec(fmt, **quant_kwargs)
    x32 = x.detach().to(torch.float32)
    x2 = x32.reshape(1, -1) if x32.dim() == 1 else x32.reshape(-1, x32.shape[-1])
    mask = outlier_mask(x2, spec.block(*x2.shape), tau)
    if clip_tol is not None:
        plain = quantize(x2, spec.fmt, **quant_kwargs).dequantize()
        clipped = (x2.abs() - plain.abs()) > clip_tol * x2.abs()
        clipped &= plain.abs() > 0
        mask = mask | clipped
    inliers = torch.where(mask, torch.zeros_like(x2), x2)
    q = quantize(inliers, spec.fmt, **quant_kwargs).dequantize()
    kept = x2.to(torch.bfloat16).to(torch.float32)
    xhat = torch.where(mask, kept, q)
    frac = float(mask.float().mean())
    info = {"fraction": frac, "overhead_bits_per_element": frac * (16 + 32)}
    return xhat.reshape(x.shape), mask.reshape(x.shape), info
