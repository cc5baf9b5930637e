"""Quantized matmuls: a Triton dequantize-fused W4A16 kernel (MXFP4 / NVFP4 weights) and an FP8 W8A8 path
through ``torch._scaled_mm``.

``w4a16_matmul(a, packed, scale, elem, bw=..., tensor_scale=None)`` computes ``a @ deq(W).T`` where ``W`` is
an ``(N, K)`` weight stored as in ``bitrl.quant.QuantizedTensor`` (two E2M1 codes per byte, even element in
the low nibble, float32 block scales ``(N, Kp // bw)``). Each weight tile is decoded in registers and
multiplied by its block scale; for MX and NVFP4 the product ``code * block_scale`` is exact in bf16, so the
result equals ``a @ dequantize(W).T`` up to accumulation order. NVFP4's FP32 tensor scale is applied to the
fp32 accumulator.

Nothing here imports ``bitrl.quant``: element formats are passed duck-typed (``ebits, mbits, bias, bits``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover
    HAS_TRITON = False

if HAS_TRITON:
    from .quantize import _decode

    @triton.jit
    def _w4a16_kernel(
        a_ptr,
        w_ptr,
        s_ptr,
        ts_ptr,
        out_ptr,
        M,
        N,
        K,
        KP,
        NBLK,
        stride_am,
        stride_om,
        BW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_KH: tl.constexpr,
        HAS_TS: tl.constexpr,
        EBITS: tl.constexpr,
        MBITS: tl.constexpr,
        BIAS: tl.constexpr,
        BITS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0).to(tl.int64)  # int64 offsets: M * K and N * K / 2 may exceed 2**31
        pid_n = tl.program_id(1).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kh = tl.arange(0, BLOCK_KH)  # byte index inside the K tile: elements 2*kh and 2*kh + 1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(KP // 2, BLOCK_KH)):
            byte_idx = kb * BLOCK_KH + kh
            col0 = 2 * byte_idx
            a_mask = rm[:, None] < M
            a0 = tl.load(
                a_ptr + rm[:, None] * stride_am + col0[None, :], mask=a_mask & (col0 < K)[None, :], other=0.0
            )
            a1 = tl.load(
                a_ptr + rm[:, None] * stride_am + col0[None, :] + 1,
                mask=a_mask & (col0 + 1 < K)[None, :],
                other=0.0,
            )
            w_mask = (rn[:, None] < N) & (byte_idx < KP // 2)[None, :]
            byte = tl.load(w_ptr + rn[:, None] * (KP // 2) + byte_idx[None, :], mask=w_mask, other=0).to(
                tl.int32
            )
            s = tl.load(s_ptr + rn[:, None] * NBLK + (col0 // BW)[None, :], mask=w_mask, other=0.0)
            w0 = (_decode(byte & 0xF, EBITS, MBITS, BIAS, BITS) * s).to(a0.dtype)
            w1 = (_decode(byte >> 4, EBITS, MBITS, BIAS, BITS) * s).to(a0.dtype)
            if IEEE:  # float32 activations: no TF32 shortcut
                acc += tl.dot(a0, tl.trans(w0), input_precision="ieee", out_dtype=tl.float32)
                acc += tl.dot(a1, tl.trans(w1), input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(a0, tl.trans(w0), out_dtype=tl.float32)
                acc += tl.dot(a1, tl.trans(w1), out_dtype=tl.float32)
        if HAS_TS:
            acc = acc * tl.load(ts_ptr)
        o_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=o_mask)


def w4a16_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton W4A16 kernel cannot run on ``device`` (None when it can)."""
    import os

    if not HAS_TRITON:
        return "triton is not importable"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return "the fused W4A16 kernel needs a CUDA device (or TRITON_INTERPRET=1 to interpret it on CPU)"


def w4a16_matmul(
    a: torch.Tensor,
    packed: torch.Tensor,
    scale_fp32: torch.Tensor,
    elem,
    *,
    bw: int,
    n: int,
    k: int,
    tensor_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_kh: int = 32,
) -> torch.Tensor:
    """``a[..., K] @ deq(W)[N, K].T`` with the weight dequantized tile by tile inside the kernel.

    Tiles: 32 x 64 for bf16/fp16 activations (tensor cores); 16 x 32 for fp32, whose exact (non-TF32) dot
    runs on FMA units and would spill registers at 32 x 64."""
    reason = w4a16_unavailable_reason(a.device)
    if reason:
        raise RuntimeError(reason)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    kp = packed.shape[1] * 2
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    ts = tensor_scale if tensor_scale is not None else torch.ones(1, device=a.device)
    fp32 = a2.dtype == torch.float32
    block_m = block_m or (16 if fp32 else 32)
    block_n = block_n or (32 if fp32 else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        a2,
        packed.contiguous(),
        scale_fp32.contiguous(),
        ts.reshape(1).to(torch.float32),
        out,
        m,
        n,
        k,
        kp,
        kp // bw,
        a2.stride(0),
        out.stride(0),
        BW=bw,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_KH=block_kh,
        HAS_TS=tensor_scale is not None,
        EBITS=elem.ebits,
        MBITS=elem.mbits,
        BIAS=elem.bias,
        BITS=elem.bits,
        IEEE=a2.dtype == torch.float32,
    )
    return out.to(out_dtype or a.dtype).reshape(*lead, n)


# ----------------------------------------------------------------------------------------------- FP8


def scaled_mm_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` (FP8 tensor cores) cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"torch._scaled_mm needs a CUDA device with FP8 tensor cores (got {device.type})"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 matmul needs compute capability >= 8.9 (got {major}.{minor})"
    return None


def quantize_rows_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic FP8 quantization: returns (fp8 data, float32 scales ``(rows, 1)``)."""
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    s = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    return (x.to(torch.float32) / s).clamp(-fmax, fmax).to(dtype), s


def fp8_scaled_mm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W8A8: ``x`` quantized per token to E4M3, ``w_fp8 (N, K)`` with per-row scales ``(N, 1)`` or a
    scalar."""
    reason = scaled_mm_unavailable_reason(x.device)
    if reason:
        raise RuntimeError(reason)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows_fp8(x2)
    n = w_fp8.shape[0]
    ws = w_scale.reshape(1, n) if w_scale.numel() == n else w_scale.reshape(1, 1).expand(1, n).contiguous()
    out_dtype = out_dtype or x.dtype
    mm_dtype, fused_bias = scaled_mm_output(out_dtype, bias)
    out = torch._scaled_mm(
        xq, w_fp8.t(), scale_a=xs, scale_b=ws.to(torch.float32), bias=fused_bias, out_dtype=mm_dtype
    )
    out = out.to(out_dtype)
    if bias is not None and fused_bias is None:
        out = out + bias.to(out_dtype)
    return out.reshape(*lead, n)


def scaled_mm_output(out_dtype: torch.dtype, bias: torch.Tensor | None):
    """(out_dtype for ``torch._scaled_mm``, bias to fuse into it or None) for a requested output dtype.

    Row-wise scaling (per-token activations, per-channel weights) produces bf16 only, and a fused bias must
    have the output's dtype. So the matmul always writes bf16; a bias is fused (as bf16) only when the caller
    wants bf16, and otherwise added after the cast, in the caller's dtype (fp32 bias stays fp32)."""
    fuse = bias is not None and out_dtype == torch.bfloat16
    return torch.bfloat16, (bias.to(torch.bfloat16) if fuse else None)
