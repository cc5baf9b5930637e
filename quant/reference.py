"""Torch reference implementation of every format: the CPU execution path and the oracle for the Triton
kernels.

All arithmetic is float32 and every step is exact or a single IEEE rounding, so that a kernel doing the same
steps reproduces it bit for bit:

* ``floor_log2(a)`` reads the exponent field of the float32 bits (returns -127 for zero and subnormals);
* powers of two are built from bits, never with ``pow``;
* rounding to an element grid: ``e = max(floor_log2(a), emin)``, ``q = 2**(e - mbits)``, ``r = rne(a / q) *
q``
  after clamping ``a`` to the element max (saturating round-to-nearest-even). Division by a power of two is
  exact,
  so the only rounding is the one onto the grid;
* stochastic rounding uses caller-supplied uniforms ``u`` in [0, 1): ``r = (floor(y) + (u < y - floor(y)))
* q``,
  which is unbiased for every value inside [-max, max] (values beyond saturate).
"""

from __future__ import annotations

import torch

from .formats import E2M1, E4M3, E8M0_DTYPE, ElementFormat

_F32_EXP_SHIFT = 23


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exponent of non-negative float32 ``a`` as int32: floor(log2(a)) for normals, -127 for
    zero/subnormal."""
    return ((a.view(torch.int32) >> _F32_EXP_SHIFT) & 0xFF) - 127


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` as float32 for integer ``e`` in [-127, 127], built from bits (exact; -127 is
    subnormal)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << _F32_EXP_SHIFT).view(torch.float32)
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


def round_to_element(
    a: torch.Tensor, elem: ElementFormat, rounding: str = "nearest", noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Round non-negative float32 magnitudes onto ``elem``'s grid (saturating). Returns float32 grid
    values."""
    a = torch.clamp(a, max=elem.max)
    e = torch.clamp(floor_log2(a), min=elem.emin)
    quantum_inv = exp2i(elem.mbits - e)
    quantum = exp2i(e - elem.mbits)
    y = a * quantum_inv  # exact: multiplication by a power of two within range
    if rounding == "nearest":
        r = torch.round(y)  # round half to even
    else:
        fl = torch.floor(y)
        r = fl + (noise < (y - fl)).to(torch.float32)
    return r * quantum


def encode_element(v: torch.Tensor, negative: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """Bit code (uint8) of grid magnitudes ``v`` (float32, already on the grid) with sign flags
    ``negative``."""
    bits = v.view(torch.int32)
    fl = ((bits >> _F32_EXP_SHIFT) & 0xFF) - 127
    mant = (bits >> (_F32_EXP_SHIFT - elem.mbits)) & ((1 << elem.mbits) - 1)
    normal_code = ((fl - elem.emin + 1) << elem.mbits) | mant
    sub_code = (torch.clamp(v, max=elem.min_normal) * (1.0 / elem.min_subnormal)).to(torch.int32)
    code = torch.where(v < elem.min_normal, sub_code, normal_code)
    code = code | (negative.to(torch.int32) << (elem.bits - 1))
    return code.to(torch.uint8)


_DECODE_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}
_PAIR_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}
_ENC_CACHE: dict[torch.device, torch.Tensor] = {}


def e2m1_encode_table(device) -> torch.Tensor:
    """Lookup table for :func:`encode_e2m1_nearest`, built from the step-by-step reference.

    Every E2M1 rounding midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has at most 3 significant bits, so it
    sits exactly at the start of an interval of float32 bit patterns sharing their top 12 bits (sign,
    exponent, 3 mantissa bits). Hence the code of any float32 ``v`` is a function of ``key = bits >> 20`` and
    of whether the remaining 20 bits are zero (``v`` is the interval start, e.g. an exact tie) or not.
    """
    lut = _ENC_CACHE.get(device)
    if lut is None:
        keys = torch.arange(4096, dtype=torch.int32)
        start, above = (keys << 20).view(torch.float32), ((keys << 20) | 1).view(torch.float32)

        def code(v):
            v = torch.where(torch.isfinite(v), v, torch.full_like(v, 1e30).copysign(v))
            return encode_element(round_to_element(v.abs(), E2M1), torch.signbit(v), E2M1)

        lut = torch.stack((code(start), code(above)), dim=-1).reshape(-1).to(device)
        _ENC_CACHE[device] = lut
    return lut


def encode_e2m1_nearest(scaled: torch.Tensor) -> torch.Tensor:
    """Fast path, bit-identical to ``encode_element(round_to_element(|s|, E2M1), signbit(s), E2M1)``:
    one table lookup per element (see :func:`e2m1_encode_table`)."""
    b = scaled.contiguous().view(torch.int32)
    idx = (b >> 20).bitwise_and_(0xFFF)
    idx.add_(idx).add_((b & 0xFFFFF).ne_(0))
    return torch.index_select(e2m1_encode_table(scaled.device), 0, idx.flatten()).view(scaled.shape)


def decode_fp4_packed(packed: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """float32 values of packed FP4 bytes ``(..., n)`` -> ``(..., 2n)`` through a 256 x 2 lookup table."""
    key = (elem.name, packed.device)
    lut = _PAIR_CACHE.get(key)
    if lut is None:
        t = elem.decode_table()
        b = torch.arange(256)
        lut = torch.stack((t[b & 0xF], t[b >> 4]), dim=-1).to(packed.device)
        _PAIR_CACHE[key] = lut
    vals = torch.index_select(lut, 0, packed.reshape(-1).to(torch.int32))
    return vals.view(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_fp8(data: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 tensor through a 256-entry table built from torch's own cast (bit-identical to
    ``data.float()``, an order of magnitude faster on CPU)."""
    key = (str(data.dtype), data.device)
    lut = _DECODE_CACHE.get(key)
    if lut is None:
        lut = torch.arange(256, dtype=torch.uint8).view(data.dtype).to(torch.float32).to(data.device)
        _DECODE_CACHE[key] = lut
    vals = torch.index_select(lut, 0, data.reshape(-1).view(torch.uint8).to(torch.int32))
    return vals.view(data.shape)


def decode_element(codes: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """float32 values of uint8 ``codes`` via a lookup table."""
    key = (elem.name, codes.device)
    lut = _DECODE_CACHE.get(key)
    if lut is None:
        lut = elem.decode_table().to(codes.device)
        _DECODE_CACHE[key] = lut
    return lut[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 4-bit codes (last dim even) two per byte: even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even to pack, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------- scales


def e8m0_exponent(amax: torch.Tensor, elem: ElementFormat, scale_mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32 in [-127, 127]) for block maxima ``amax``.

    floor (OCP): ``floor(log2(amax)) - emax_elem``; rceil: ``ceil(log2(amax / max_elem))``.
    A zero block gets -127 (byte 0), as in the OCP reference code. The exponent is capped at
    ``127 - emax_elem`` (the largest FLOOR can give for a finite float32) so that every dequantized value
    stays
    finite in float32; this only affects RCEIL with amax above ~2**127.
    """
    if scale_mode == "floor":
        e = floor_log2(amax) - elem.emax
    else:
        r = amax / elem.max
        rb = r.view(torch.int32)
        efield = (rb >> _F32_EXP_SHIFT) & 0xFF
        e = efield - 127 + ((rb & 0x7FFFFF) != 0).to(torch.int32)
        e = torch.where(efield == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127 - elem.emax)


def e8m0_to_storage(e: torch.Tensor) -> torch.Tensor:
    byte = (e + 127).to(torch.uint8)
    return byte.view(E8M0_DTYPE) if E8M0_DTYPE is not None else byte


def e8m0_from_storage(s: torch.Tensor) -> torch.Tensor:
    """float32 value of stored E8M0 scales."""
    byte = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    return exp2i(byte.to(torch.int32) - 127)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor scale amax / (448 * 6); 1 where amax is 0."""
    ts = amax / (E4M3.max * 6.0)
    return torch.where(amax > 0, ts, torch.ones_like(ts))


def nvfp4_block_scale(block_amax: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale value (float32 on the E4M3 grid): RNE-saturate(block_amax / 6 / tensor_scale)."""
    return round_to_element(block_amax / 6.0 / tensor_scale, E4M3)


def fp8_scale(amax: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """FP32 scale amax / max_elem; 1 where amax is 0."""
    s = amax / elem.max
    return torch.where(amax > 0, s, torch.ones_like(s))
