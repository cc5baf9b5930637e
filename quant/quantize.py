"""``quantize(x, fmt, ...)``: argument checking, the torch reference path, and dispatch to the Triton
kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference as ref
from .formats import E8M0_DTYPE, ScaledFormat, get_format
from .tensor import QuantizedTensor

__all__ = ["QuantSpec", "fake_quantize", "quantize", "resolve_spec"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SCALE_MODES = ("floor", "rceil", "mse")
# scale_mode="mse": each block takes, of these candidate scales, the one with the least squared error.
# MX (E8M0, powers of two): the floor exponent and the one above (rceil's is always one of them). NVFP4
# (E4M3 block scales, steps of 1/8 to 1/16): the amax scale shrunk by up to a quarter, which clips the
# block's largest element to buy finer steps for the rest (the largest weights are few, the rest many), or
# grown by up to 1/16, where rounding amax / 6 to E4M3 rounded it down.
MSE_FACTORS = (1.0, 1.0625, 1.03125, 0.96875, 0.9375, 0.90625, 0.875, 0.84375, 0.8125, 0.78125, 0.75)


@dataclass(frozen=True)
class QuantSpec:
    """A fully resolved quantization recipe (format + block + scale mode + rounding)."""

    fmt: ScaledFormat
    granularity: str
    block_size: int | tuple[int, int] | None
    scale_mode: str
    rounding: str

    def block(self, rows: int, cols: int) -> tuple[int, int]:
        """Block shape ``(bh, bw)`` for a ``(rows, cols)`` matrix."""
        if self.granularity == "tensor":
            return (rows, cols)
        if self.granularity == "row":
            return (1, cols)
        bs = self.block_size
        return (1, bs) if isinstance(bs, int) else (bs[0], bs[1])


def resolve_spec(
    fmt, *, block_size=None, scale_mode="floor", granularity=None, rounding="nearest"
) -> QuantSpec:
    """Check the options against the format; every error is a ValueError naming the argument."""
    f = get_format(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if block_size is not None:
        ok_int = isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
        ok_tuple = (
            isinstance(block_size, tuple)
            and len(block_size) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)
        )
        if not (ok_int or ok_tuple):
            raise ValueError(f"block_size must be a positive int or a (rows, cols) pair, got {block_size!r}")
    if f.scale_kind == "fp32":  # FP8 with an FP32 amax scale
        if scale_mode == "mse":
            raise ValueError(f"scale_mode='mse' applies to the block-scaled formats, not {f.name}")
        if granularity is None:
            granularity = "block" if block_size is not None else "tensor"
        if granularity not in ("tensor", "row", "block"):
            raise ValueError(
                f"granularity must be 'tensor', 'row' or 'block' for {f.name}, got {granularity!r}"
            )
        if granularity == "block" and block_size is None:
            block_size = 128
        if granularity != "block" and block_size is not None:
            raise ValueError(f"block_size is only meaningful with granularity='block', got {granularity!r}")
        return QuantSpec(f, granularity, block_size, "amax", rounding)
    if granularity not in (None, "block"):
        raise ValueError(f"granularity must be None or 'block' for {f.name}, got {granularity!r}")
    bs = f.block_size if block_size is None else block_size
    if not isinstance(bs, int):
        raise ValueError(f"block_size must be an int (blocks of 1 x block_size) for {f.name}, got {bs!r}")
    if f.packed and bs % 2:
        raise ValueError(f"block_size must be even for the 4-bit format {f.name}, got {bs}")
    mode = scale_mode if f.is_mx else "amax"
    if scale_mode == "mse":  # any block-scaled format: the scale chosen by error (see MSE_FACTORS)
        mode = "mse"
    elif not f.is_mx and scale_mode != "floor":
        raise ValueError(f"scale_mode: {f.name} takes 'floor' (its amax scale) or 'mse', got {scale_mode!r}")
    return QuantSpec(f, "block", bs, mode, rounding)


def check_input(x, *, name: str = "x", check_finite: bool = True) -> None:
    """ValueError naming ``name`` unless x is a float tensor with at least one element; with
    ``check_finite`` also unless every element is finite (one pass over x and one host sync)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32/float16/bfloat16/float64, got dtype {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(
            f"{name} must have at least one dimension and one element, got shape {tuple(x.shape)}"
        )
    if check_finite:
        global_amax(x, name=name)


def global_amax(x: torch.Tensor, *, name: str = "x", check_finite: bool = True) -> torch.Tensor:
    """max |x| as a float32 0-d tensor, in one pass (``aminmax``); with ``check_finite``, ValueError on
    NaN / inf (which propagate), at the cost of one host sync."""
    mn, mx = torch.aminmax(x)
    amax = torch.maximum(-mn, mx).to(torch.float32).abs()  # abs turns -0.0 into +0.0
    if check_finite and not bool(torch.isfinite(amax)):
        raise ValueError(f"{name} contains NaN or inf; quantization needs finite input")
    return amax


def _uniforms(shape, seed, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: str | ScaledFormat,
    *,
    block_size: int | tuple[int, int] | None = None,
    scale_mode: str = "floor",
    granularity: str | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> QuantizedTensor:
    """Quantize ``x`` along its last dimension.

    Args:
        x: float tensor (any shape with >= 1 dim); leading dims are flattened into rows.
        fmt: "fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4" or "nvfp4" (or a :class:`ScaledFormat`).
        block_size: MX/NV block length (default 32 / 16). FP8: an int ``b`` means 1 x b blocks (activations),
            a pair ``(bh, bw)`` 2-D blocks (weights, e.g. (128, 128)); implies granularity "block".
        scale_mode: MX: "floor" (OCP: ``2**(floor(log2 amax) - emax_elem)``, elements saturate) or "rceil"
            (``2**ceil(log2(amax / max_elem))``). MX and NVFP4: "mse", each block's scale chosen among a few
            candidates (``MSE_FACTORS``) by least squared error (torch path: for weights, once per sync).
        granularity: FP8 only: "tensor" (default), "row" or "block". Scale = amax / max_elem, 1 where amax
        is 0.
        rounding: "nearest" (round half to even, saturating) or "stochastic" (unbiased, uniforms from
        ``seed``).
        seed: seed of the stochastic-rounding generator (None: fresh entropy).
        backend: "auto" (Triton on CUDA, torch otherwise), "torch" or "triton".
        check_finite: raise ValueError on NaN/inf (one extra read of ``x``).

    Returns:
        QuantizedTensor; ``.dequantize()`` gives the float32 values.
    """
    spec = resolve_spec(
        fmt, block_size=block_size, scale_mode=scale_mode, granularity=granularity, rounding=rounding
    )
    check_input(x, check_finite=False)  # type, dtype, shape: metadata only, no sync
    gmax = global_amax(x) if check_finite else None
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if seed is not None and not isinstance(seed, int):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    x2 = x.reshape(1, -1) if x.dim() == 1 else x.reshape(-1, x.shape[-1])
    rows, cols = x2.shape
    bh, bw = spec.block(rows, cols)
    kp = -(-cols // bw) * bw
    noise = _uniforms((rows, kp), seed, x.device) if rounding == "stochastic" else None
    use_triton = backend == "triton" or (backend == "auto" and x.is_cuda and spec.fmt.scale_kind != "fp32")
    if spec.scale_mode == "mse":
        if backend == "triton":
            raise ValueError("scale_mode='mse' runs on the torch path; use backend='auto' or 'torch'")
        use_triton = False
    if use_triton:
        if bh != 1:
            raise ValueError(f"block_size: the Triton path supports 1-D blocks only, got {(bh, bw)}")
        data, scale, ts = quantize_triton(x2, spec, bw, noise, gmax)
    else:
        data, scale, ts = quantize_reference(x2, spec, (bh, bw), noise, gmax)
    return QuantizedTensor(
        fmt=spec.fmt,
        shape=x.shape,
        data=data,
        scale=scale,
        tensor_scale=ts,
        block=(bh, bw),
        granularity=spec.granularity,
        scale_mode=spec.scale_mode,
        dtype=x.dtype,
    )


def blockify(x2: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """float32 view ``(nbr, bh, nbc, bw)`` of ``x2`` zero-padded to whole blocks; returns (view, rows, kp)."""
    rows, cols = x2.shape
    bh, bw = block
    rp, kp = -(-rows // bh) * bh, -(-cols // bw) * bw
    x = x2.to(torch.float32)
    if (rp, kp) != (rows, cols):
        x = torch.nn.functional.pad(x, (0, kp - cols, 0, rp - rows))
    return x.reshape(rp // bh, bh, kp // bw, bw), rows, kp


def quantize_reference(
    x2: torch.Tensor,
    spec: QuantSpec,
    block: tuple[int, int],
    noise: torch.Tensor | None,
    gmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference: returns (data, scale, tensor_scale) exactly as stored in a QuantizedTensor.

    ``gmax``: max |x| if already known. Written to touch each element as few times as possible (in-place ops
    on its own temporaries); every value is the one the step-by-step definition in ``reference`` gives.
    """
    f = spec.fmt
    elem = f.element
    xb, rows, kp = blockify(x2, block)
    bh, bw = block
    nbr, _, nbc, _ = xb.shape
    if nbr == 1 and nbc == 1:  # one block: its amax is the tensor's
        amax = (gmax if gmax is not None else xb.abs().amax()).reshape(1, 1)
    elif bh == 1:
        amax = xb.view(nbr, nbc, bw).abs().amax(dim=-1)
    else:
        amax = xb.abs().amax(dim=(1, 3))
    ts = None
    if spec.scale_mode == "mse":
        if bh != 1:
            raise ValueError("scale_mode='mse' takes 1-D blocks")
        if f.scale_kind == "e4m3":
            ts = ref.nvfp4_tensor_scale(gmax if gmax is not None else amax.amax())
        scaled, scale = _mse_scaled(xb.view(nbr, nbc, bw), amax, elem, f.scale_kind, ts)
        scaled = scaled.view(nbr, 1, nbc, bw)
    elif f.scale_kind == "e8m0":
        e = ref.e8m0_exponent(amax, elem, spec.scale_mode)
        scaled = xb * ref.exp2i(-e)[:, None, :, None]
        scale = ref.e8m0_to_storage(e)
    elif f.scale_kind == "e4m3":
        ts = ref.nvfp4_tensor_scale(gmax if gmax is not None else amax.amax())
        bs = ref.nvfp4_block_scale(amax, ts)
        denom = bs * ts
        zero = denom <= 0
        scaled = xb / torch.where(zero, torch.ones_like(denom), denom)[:, None, :, None]
        scaled.masked_fill_(zero[:, None, :, None].expand_as(scaled), 0.0)  # always: a branch would sync
        scale = bs.to(torch.float8_e4m3fn)
    else:
        s = ref.fp8_scale(amax, elem)
        scaled = xb / s[:, None, :, None]
        scale = s
    scaled = scaled.reshape(-1, kp)[:rows]
    if spec.rounding == "nearest" and f.packed and elem.name == "e2m1":
        data = ref.pack_fp4(ref.encode_e2m1_nearest(scaled))  # fast path, same bits
    elif spec.rounding == "nearest" and not f.packed:
        # torch's float8 casts round half to even and are exact on the clamped range (tested bit for bit)
        data = scaled.clamp_(-elem.max, elem.max).to(elem.torch_dtype)
    else:
        mag = ref.round_to_element(scaled.abs(), elem, spec.rounding, noise)
        neg = torch.signbit(scaled)
        if f.packed:
            data = ref.pack_fp4(ref.encode_element(mag, neg, elem))
        else:
            data = torch.where(neg, -mag, mag).to(elem.torch_dtype)
    return data, scale, ts


def round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes ``a`` (float32, >= 0) rounded to the nearest E2M1 value, ties to the even code, saturating
    at 6: the value of reference.round_to_element(a, E2M1) in a few element-wise ops. The grid's step is 0.5
    below 2, 1 below 4 and 2 above, and torch.round's ties to even on a / step land on the even codes."""
    a = a.clamp(max=6.0)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.round(a / step).mul_(step)


def _mse_scaled(xb, amax, elem, scale_kind, ts):
    """(x / scale, stored scale) with each block's scale the candidate of least squared error.

    xb [nbr, nbc, bw] float32 blocks, amax [nbr, nbc]. Ties keep the earlier candidate (the amax scale)."""
    if scale_kind == "e8m0":
        e0 = ref.e8m0_exponent(amax, elem, "floor")
        candidates = [(ref.exp2i(e0 + k), e0 + k) for k in (0, 1)]
    else:
        candidates = []
        for factor in MSE_FACTORS:
            bs = ref.nvfp4_block_scale(amax * factor, ts)
            candidates.append((bs * ts, bs))
    best_err = best_scaled = best_stored = None
    for value, stored in candidates:
        zero = value <= 0
        scaled = xb / torch.where(zero, torch.ones_like(value), value)[..., None]
        scaled.masked_fill_(zero[..., None].expand_as(scaled), 0.0)
        mag = round_e2m1(scaled.abs()) if elem.name == "e2m1" else ref.round_to_element(scaled.abs(), elem)
        q = mag * value[..., None]
        err = (q - xb.abs()).square_().sum(-1)
        if best_err is None:
            best_err, best_scaled, best_stored = err, scaled, stored
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scaled = torch.where(better[..., None], scaled, best_scaled)
        best_stored = torch.where(better, stored, best_stored)
    if scale_kind == "e8m0":
        e = best_stored.clamp(-127, 127 - elem.emax)
        return best_scaled, ref.e8m0_to_storage(e)
    return best_scaled, best_stored.to(torch.float8_e4m3fn)


def quantize_triton(
    x2: torch.Tensor, spec: QuantSpec, bw: int, noise: torch.Tensor | None, gmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton path (1 x bw blocks): same outputs as :func:`quantize_reference`, bit for bit."""
    from bitrl.kernels.quantize import quantize_blocks_triton

    f = spec.fmt
    ts = None
    if f.scale_kind == "e4m3":
        ts = ref.nvfp4_tensor_scale(gmax if gmax is not None else global_amax(x2, check_finite=False))
    codes, scale = quantize_blocks_triton(
        x2,
        f.element,
        bw=bw,
        scale_kind=f.scale_kind,
        scale_mode=spec.scale_mode,
        noise=noise,
        tensor_scale=ts,
    )
    if f.scale_kind == "e8m0":
        scale = scale.view(E8M0_DTYPE) if E8M0_DTYPE is not None else scale
    elif f.scale_kind == "e4m3":
        scale = scale.to(torch.float8_e4m3fn)
    data = codes if f.packed else codes.view(f.element.torch_dtype)
    return data, scale, ts


def fake_quantize(x: torch.Tensor, fmt, **kw) -> torch.Tensor:
    """``quantize(x, fmt, **kw).dequantize(x.dtype)``: the quantize-dequantize round trip."""
    return quantize(x, fmt, **kw).dequantize(x.dtype)


def e8m0_storage_dtype() -> torch.dtype:
    return E8M0_DTYPE if E8M0_DTYPE is not None else torch.uint8
