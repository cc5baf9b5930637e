"""Triton kernels: block quantize (scales + element rounding + FP4 packing) and dequantize.

They repeat, step for step, the float32 arithmetic of the torch reference in ``bitrl.quant.reference``
(exponents read from the float32 bits, powers of two built from bits, IEEE division via ``tl.div_rn``,
round-half-even by the 2**23 trick), so their output is bit-identical to it; ``tests/test_quant_triton.py``
checks that under ``TRITON_INTERPRET=1``.

Element formats are passed duck-typed (any object with ``emin, emax, mbits, bits, bias, max, min_normal,
min_subnormal``, e.g. ``bitrl.quant.E2M1``) so that this module does not import ``bitrl.quant``.

Layout: ``x`` is a row-major ``(R, K)`` matrix quantized in ``1 x bw`` blocks along K. Outputs:
codes ``(R, Kp)`` uint8 (8-bit elements) or packed ``(R, Kp // 2)`` uint8 (4-bit elements, even element in the
low nibble), scales ``(R, Kp // bw)``: uint8 biased E8M0 exponent (kind "e8m0"), or float32 (kinds "e4m3": the
E4M3-rounded block scale, and "fp32": amax / max).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton is optional
    HAS_TRITON = False

SCALE_KINDS = {"fp32": 0, "e8m0": 1, "e4m3": 2}
_E4M3 = dict(emin=-6, mbits=3, maxv=448.0)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _floor_log2(a):
        return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127

    @triton.jit
    def _exp2i(e):
        normal = (tl.maximum(e + 127, 1) << 23).to(tl.float32, bitcast=True)
        sub = tl.full(e.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)  # 2**-127
        return tl.where(e >= -126, normal, sub)

    @triton.jit
    def _rne_int(y):
        # round half to even for 0 <= y < 2**22
        return (y + 8388608.0) - 8388608.0

    @triton.jit
    def _round_elem(a, u, EMIN: tl.constexpr, MBITS: tl.constexpr, MAXV: tl.constexpr, STOCH: tl.constexpr):
        a = tl.minimum(a, MAXV)
        e = tl.maximum(_floor_log2(a), EMIN)
        y = a * _exp2i(MBITS - e)
        r = _rne_int(y)
        if STOCH:
            fl = r - (r > y).to(tl.float32)
            r = fl + (u < (y - fl)).to(tl.float32)
        return r * _exp2i(e - MBITS)

    @triton.jit
    def _encode(
        v, neg, EMIN: tl.constexpr, MBITS: tl.constexpr, BITS: tl.constexpr, INV_MIN_SUB: tl.constexpr
    ):
        bits = v.to(tl.int32, bitcast=True)
        fl = ((bits >> 23) & 0xFF) - 127
        mant = (bits >> (23 - MBITS)) & ((1 << MBITS) - 1)
        normal = ((fl - EMIN + 1) << MBITS) | mant
        min_normal = _exp2i(tl.full(v.shape, EMIN, tl.int32))
        sub = (tl.minimum(v, min_normal) * INV_MIN_SUB).to(tl.int32)
        code = tl.where(v < min_normal, sub, normal)
        code = code | (neg.to(tl.int32) << (BITS - 1))
        return code.to(tl.uint8)

    @triton.jit
    def _decode(c, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, BITS: tl.constexpr):
        c = c.to(tl.int32)
        neg = (c >> (BITS - 1)) & 1
        ef = (c >> MBITS) & ((1 << EBITS) - 1)
        m = (c & ((1 << MBITS) - 1)).to(tl.float32)
        frac = m * (1.0 / (1 << MBITS))
        normal = _exp2i(ef - BIAS) * (1.0 + frac)
        sub = _exp2i(tl.full(c.shape, 1 - BIAS, tl.int32)) * frac
        v = tl.where(ef == 0, sub, normal)
        return tl.where(neg == 1, -v, v)

    @triton.jit
    def _scale_and_scaled(
        x,
        amax,
        ts,
        KIND: tl.constexpr,
        FLOOR: tl.constexpr,
        EMAX: tl.constexpr,
        MAXV: tl.constexpr,
    ):
        """Returns (scaled x, stored scale) for a tile x [NB, W] with block maxima amax [NB]."""
        if KIND == 1:  # e8m0
            if FLOOR:
                e = _floor_log2(amax) - EMAX
            else:
                r = tl.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32))
                rb = r.to(tl.int32, bitcast=True)
                ef = (rb >> 23) & 0xFF
                e = ef - 127 + ((rb & 0x7FFFFF) != 0).to(tl.int32)
                e = tl.where(ef == 0, -127, e)
            e = tl.minimum(tl.maximum(e, -127), 127 - EMAX)
            scaled = x * _exp2i(-e)[:, None]
            stored = e + 127
        elif KIND == 2:  # nvfp4: E4M3 block scale and FP32 tensor scale
            six = tl.full(amax.shape, 6.0, tl.float32)
            t = tl.div_rn(tl.div_rn(amax, six), tl.zeros(amax.shape, tl.float32) + ts)
            bs = _round_elem(t, t, -6, 3, 448.0, False)
            denom = bs * ts
            safe = tl.where(denom > 0, denom, 1.0)
            q = tl.div_rn(x, tl.zeros(x.shape, tl.float32) + safe[:, None])
            scaled = tl.where(denom[:, None] > 0, q, 0.0)
            stored = bs
        else:  # fp32 amax scale
            s = tl.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32))
            s = tl.where(amax > 0, s, 1.0)
            scaled = tl.div_rn(x, tl.zeros(x.shape, tl.float32) + s[:, None])
            stored = s
        return scaled, stored

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        noise_ptr,
        out_ptr,
        scale_ptr,
        ts_ptr,
        K,
        KP,
        NBLK,
        BW: tl.constexpr,
        W: tl.constexpr,
        NB: tl.constexpr,
        PACKED: tl.constexpr,
        KIND: tl.constexpr,
        FLOOR: tl.constexpr,
        STOCH: tl.constexpr,
        EMIN: tl.constexpr,
        EMAX: tl.constexpr,
        MBITS: tl.constexpr,
        BITS: tl.constexpr,
        MAXV: tl.constexpr,
        INV_MIN_SUB: tl.constexpr,
        ELEM_MAXV: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64 offsets: R * K may exceed 2**31
        blk = tl.program_id(1) * NB + tl.arange(0, NB)  # [NB]
        j = tl.arange(0, W)  # [W]
        bmask = blk < NBLK
        ts = 1.0
        if KIND == 2:
            ts = tl.load(ts_ptr)
        if PACKED:
            # element pairs: column 2j (low nibble) and 2j + 1 (high nibble) of each block
            col0 = blk[:, None] * BW + 2 * j[None, :]
            m = bmask[:, None] & (2 * j[None, :] < BW)
            x0 = tl.load(x_ptr + row * K + col0, mask=m & (col0 < K), other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + row * K + col0 + 1, mask=m & (col0 + 1 < K), other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
            s0, stored = _scale_and_scaled(x0, amax, ts, KIND, FLOOR, EMAX, ELEM_MAXV)
            s1, _ = _scale_and_scaled(x1, amax, ts, KIND, FLOOR, EMAX, ELEM_MAXV)
            u0 = s0
            u1 = s1
            if STOCH:
                u0 = tl.load(noise_ptr + row * KP + col0, mask=m, other=0.0)
                u1 = tl.load(noise_ptr + row * KP + col0 + 1, mask=m, other=0.0)
            v0 = _round_elem(tl.abs(s0), u0, EMIN, MBITS, MAXV, STOCH)
            v1 = _round_elem(tl.abs(s1), u1, EMIN, MBITS, MAXV, STOCH)
            c0 = _encode(v0, s0.to(tl.int32, bitcast=True) < 0, EMIN, MBITS, BITS, INV_MIN_SUB)
            c1 = _encode(v1, s1.to(tl.int32, bitcast=True) < 0, EMIN, MBITS, BITS, INV_MIN_SUB)
            byte = c0 | (c1 << 4)
            tl.store(out_ptr + row * (KP // 2) + col0 // 2, byte, mask=m)
        else:
            col = blk[:, None] * BW + j[None, :]
            m = bmask[:, None] & (j[None, :] < BW)
            x = tl.load(x_ptr + row * K + col, mask=m & (col < K), other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            s, stored = _scale_and_scaled(x, amax, ts, KIND, FLOOR, EMAX, ELEM_MAXV)
            u = s
            if STOCH:
                u = tl.load(noise_ptr + row * KP + col, mask=m, other=0.0)
            v = _round_elem(tl.abs(s), u, EMIN, MBITS, MAXV, STOCH)
            c = _encode(v, s.to(tl.int32, bitcast=True) < 0, EMIN, MBITS, BITS, INV_MIN_SUB)
            tl.store(out_ptr + row * KP + col, c, mask=m)
        if KIND == 1:
            tl.store(scale_ptr + row * NBLK + blk, stored.to(tl.uint8), mask=bmask)
        else:
            tl.store(scale_ptr + row * NBLK + blk, stored, mask=bmask)

    @triton.jit
    def _dequantize_kernel(
        data_ptr,
        scale_ptr,
        ts_ptr,
        out_ptr,
        K,
        KP,
        NBLK,
        BW: tl.constexpr,
        W: tl.constexpr,
        NB: tl.constexpr,
        PACKED: tl.constexpr,
        HAS_TS: tl.constexpr,
        EBITS: tl.constexpr,
        MBITS: tl.constexpr,
        BIAS: tl.constexpr,
        BITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64 offsets: R * K may exceed 2**31
        blk = tl.program_id(1) * NB + tl.arange(0, NB)
        j = tl.arange(0, W)
        bmask = blk < NBLK
        s = tl.load(scale_ptr + row * NBLK + blk, mask=bmask, other=0.0)[:, None]
        ts = 1.0
        if HAS_TS:
            ts = tl.load(ts_ptr)
        if PACKED:
            col0 = blk[:, None] * BW + 2 * j[None, :]
            m = bmask[:, None] & (2 * j[None, :] < BW)
            byte = tl.load(data_ptr + row * (KP // 2) + col0 // 2, mask=m, other=0).to(tl.int32)
            v0 = _decode(byte & 0xF, EBITS, MBITS, BIAS, BITS) * s
            v1 = _decode(byte >> 4, EBITS, MBITS, BIAS, BITS) * s
            if HAS_TS:
                v0 = v0 * ts
                v1 = v1 * ts
            tl.store(out_ptr + row * K + col0, v0, mask=m & (col0 < K))
            tl.store(out_ptr + row * K + col0 + 1, v1, mask=m & (col0 + 1 < K))
        else:
            col = blk[:, None] * BW + j[None, :]
            m = bmask[:, None] & (j[None, :] < BW)
            c = tl.load(data_ptr + row * KP + col, mask=m, other=0)
            v = _decode(c, EBITS, MBITS, BIAS, BITS) * s
            if HAS_TS:
                v = v * ts
            tl.store(out_ptr + row * K + col, v, mask=m & (col < K))


if HAS_TRITON:

    @triton.jit
    def _pack_kernel(codes_ptr, out_ptr, NBYTES, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < NBYTES
        lo = tl.load(codes_ptr + 2 * i, mask=m, other=0)
        hi = tl.load(codes_ptr + 2 * i + 1, mask=m, other=0)
        tl.store(out_ptr + i, (lo & 0xF) | ((hi & 0xF) << 4), mask=m)

    @triton.jit
    def _unpack_kernel(packed_ptr, out_ptr, NBYTES, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < NBYTES
        b = tl.load(packed_ptr + i, mask=m, other=0)
        tl.store(out_ptr + 2 * i, b & 0xF, mask=m)
        tl.store(out_ptr + 2 * i + 1, b >> 4, mask=m)


def pack_fp4_triton(codes: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Pack uint8 4-bit codes (last dim even) two per byte, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even to pack, got {codes.shape[-1]}")
    c = codes.contiguous()
    out = torch.empty((*c.shape[:-1], c.shape[-1] // 2), dtype=torch.uint8, device=c.device)
    n = out.numel()
    _pack_kernel[(triton.cdiv(n, block),)](c, out, n, BLOCK=block)
    return out


def unpack_fp4_triton(packed: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Inverse of :func:`pack_fp4_triton`."""
    p = packed.contiguous()
    out = torch.empty((*p.shape[:-1], p.shape[-1] * 2), dtype=torch.uint8, device=p.device)
    n = p.numel()
    _unpack_kernel[(triton.cdiv(n, block),)](p, out, n, BLOCK=block)
    return out


TILE_ELEMENTS = 2048  # (element pairs for FP4) per program


def _tiles(bw: int, packed: bool, nblk: int) -> tuple[int, int]:
    """(W, NB): a tile of NB blocks of W lanes. NB does not follow the row length: one specialization per
    format, whatever K (short rows only mask part of the tile)."""
    w = next_pow2(bw // 2 if packed else bw)
    return w, max(1, TILE_ELEMENTS // w)


def quantize_blocks_triton(
    x2: torch.Tensor,
    elem,
    *,
    bw: int,
    scale_kind: str,
    scale_mode: str = "floor",
    noise: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a row-major ``(R, K)`` matrix in ``1 x bw`` blocks. Returns (codes or packed bytes, scales).

    ``tensor_scale`` (float32, 1 element) is required for kind "e4m3" (NVFP4). ``noise``: float32 ``(R, Kp)``
    uniforms for stochastic rounding (None: round to nearest even).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    x2 = x2.contiguous()
    rows, k = x2.shape
    nblk = -(-k // bw)
    kp = nblk * bw
    packed = elem.bits == 4
    out = torch.empty((rows, kp // 2 if packed else kp), dtype=torch.uint8, device=x2.device)
    sdt = torch.uint8 if scale_kind == "e8m0" else torch.float32
    scale = torch.empty((rows, nblk), dtype=sdt, device=x2.device)
    ts = tensor_scale if tensor_scale is not None else torch.ones(1, device=x2.device)
    ts = ts.reshape(1).to(torch.float32)
    w, nb = _tiles(bw, packed, nblk)
    grid = (rows, triton.cdiv(nblk, nb))
    _quantize_kernel[grid](
        x2,
        noise if noise is not None else x2,
        out,
        scale,
        ts,
        k,
        kp,
        nblk,
        BW=bw,
        W=w,
        NB=nb,
        PACKED=packed,
        KIND=SCALE_KINDS[scale_kind],
        FLOOR=scale_mode == "floor",
        STOCH=noise is not None,
        EMIN=elem.emin,
        EMAX=elem.emax,
        MBITS=elem.mbits,
        BITS=elem.bits,
        MAXV=float(elem.max),
        INV_MIN_SUB=float(1.0 / elem.min_subnormal),
        ELEM_MAXV=float(elem.max),
    )
    return out, scale


def dequantize_blocks_triton(
    data: torch.Tensor,
    scale_fp32: torch.Tensor,
    elem,
    *,
    bw: int,
    cols: int,
    tensor_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks_triton` given float32 block scales; returns ``(R, cols)``."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable")
    packed = elem.bits == 4
    rows = data.shape[0]
    kp = data.shape[1] * (2 if packed else 1)
    nblk = kp // bw
    out = torch.empty((rows, cols), dtype=out_dtype, device=data.device)
    w, nb = _tiles(bw, packed, nblk)
    ts = tensor_scale if tensor_scale is not None else torch.ones(1, device=data.device)
    _dequantize_kernel[(rows, triton.cdiv(nblk, nb))](
        data.view(torch.uint8).contiguous(),
        scale_fp32.contiguous(),
        ts.reshape(1).to(torch.float32),
        out,
        cols,
        kp,
        nblk,
        BW=bw,
        W=w,
        NB=nb,
        PACKED=packed,
        HAS_TS=tensor_scale is not None,
        EBITS=elem.ebits,
        MBITS=elem.mbits,
        BIAS=elem.bias,
        BITS=elem.bits,
    )
    return out
