"""Native FP4 GEMM on Blackwell: ``tl.dot_scaled`` over block-scaled operands (W4A4 and W4A8).

``fp4_gemm(a, a_scale, w, w_scale, *, recipe, k)`` computes ``deq(A)[M, K] @ deq(W)[N, K].T`` in fp32 where
both operands stay in their stored formats and the tensor cores apply the block scales:

===========  ==========================  ========================  ========================================
recipe       activations A               weights W                 sm_100 instruction (PTX)
===========  ==========================  ========================  ========================================
mxfp4_mxfp4  E2M1 pairs, E8M0 per 32     E2M1 pairs, E8M0 per 32   tcgen05.mma kind::mxf4 block_scale
mxfp4_mxfp8  E4M3, E8M0 per 32           E2M1 pairs, E8M0 per 32   tcgen05.mma kind::mxf8f6f4 block_scale
nvfp4_nvfp4  E2M1 pairs, E4M3 per 16     E2M1 pairs, E4M3 per 16   tcgen05.mma kind::mxf4nvf4 block16
===========  ==========================  ========================  ========================================

Layouts are those of ``bitrl.quant.QuantizedTensor`` (two codes per byte, even element in the low nibble; one
scale per block along K, E8M0 as its biased byte, NVFP4 block scales as ``float8_e4m3fn``); NVFP4's two fp32
tensor scales multiply the fp32 accumulator. The hardware's FP8 x FP4 kind takes E8M0 scales over 32 elements
only, so the W4A8 recipe is MXFP4 x MXFP8 (there is no NVFP4 W4A8 instruction to target).

Dispatch: the kernel runs on compute capability 10.x and above (``native_unavailable_reason``); elsewhere the
callers dequantize (the emulated path). ``TRITON_INTERPRET=1`` runs it on CPU for the MX recipes; the
interpreter reads every scale byte as E8M0, so it cannot run the NVFP4 recipe.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton is optional
    HAS_TRITON = False

# recipe -> (activation element format, weight element format, block length)
RECIPES = {
    "mxfp4_mxfp4": ("e2m1", "e2m1", 32),
    "mxfp4_mxfp8": ("e4m3", "e2m1", 32),
    "nvfp4_nvfp4": ("e2m1", "e2m1", 16),
}
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
# compiled and checked for these targets only: the kernel is dispatched on compute capability 10.x
KERNEL_TARGETS = {"_fp4_dot_scaled_kernel": (100,)}

if HAS_TRITON:

    @triton.jit
    def _fp4_dot_scaled_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        ts_ptr,
        out_ptr,
        M,
        N,
        K,
        A_FMT: tl.constexpr,
        VEC: tl.constexpr,
        HAS_TS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        A_PACK: tl.constexpr = 2 if A_FMT == "e2m1" else 1  # elements per stored byte along K
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ka = tl.arange(0, BLOCK_K // A_PACK)
        kw = tl.arange(0, BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // VEC)
        mm = rm[:, None] < M
        nn = rn[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(
                a_ptr + rm[:, None] * (K // A_PACK) + (k0 // A_PACK + ka)[None, :],
                mask=mm & ((k0 // A_PACK + ka) < K // A_PACK)[None, :],
                other=0,
            )
            # W is [N, K/2] row-major; dot_scaled wants the [K/2, N] operand
            w = tl.load(
                w_ptr + rn[None, :] * (K // 2) + (k0 // 2 + kw)[:, None],
                mask=nn & ((k0 // 2 + kw) < K // 2)[:, None],
                other=0,
            )
            smask = ((k0 // VEC + ks) < K // VEC)[None, :]
            sa = tl.load(
                as_ptr + rm[:, None] * (K // VEC) + (k0 // VEC + ks)[None, :], mask=mm & smask, other=0.0
            )
            sw = tl.load(
                ws_ptr + rn[:, None] * (K // VEC) + (k0 // VEC + ks)[None, :],
                mask=(rn < N)[:, None] & smask,
                other=0.0,
            )
            acc = tl.dot_scaled(a, sa, A_FMT, w, sw, "e2m1", acc)
        if HAS_TS:
            acc = acc * tl.load(ts_ptr)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mm & nn)


def native_unavailable_reason(device: torch.device) -> str | None:
    """Why the native FP4 kernel cannot run on ``device`` (None when it can)."""
    if not HAS_TRITON:
        return "triton is not importable"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    if device.type != "cuda":
        return f"native FP4 matmul needs a CUDA device (got {device.type})"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 10:
        return f"native FP4 matmul needs compute capability >= 10.0 (block-scaled tcgen05.mma), got {major}.x"
    return None


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as their uint8 biased exponent; E4M3 scales stay ``float8_e4m3fn``."""
    if scale.dtype == torch.float8_e4m3fn:
        return scale.contiguous()
    return scale.contiguous().view(torch.uint8)


def fp4_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    recipe: str,
    k: int,
    tensor_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``deq(A) @ deq(W).T`` as fp32 ``[M, N]`` on block-scaled tensor cores.

    Args:
        a: activations ``[M, Kp/2]`` uint8 (E2M1 pairs) or ``[M, Kp]`` ``float8_e4m3fn`` (MXFP8).
        a_scale: ``[M, Kp/vec]`` ``float8_e8m0fnu``/uint8 (MX) or ``float8_e4m3fn`` (NVFP4).
        w: weights ``[N, Kp/2]`` uint8 (E2M1 pairs); w_scale: ``[N, Kp/vec]`` like ``a_scale``.
        recipe: a name in ``RECIPES``; k: the padded reduction length Kp (a multiple of the block).
        tensor_scale: NVFP4 only, the product of the two fp32 tensor scales (1 element).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}")
    reason = native_unavailable_reason(a.device)
    if reason:
        raise RuntimeError(reason)
    a_fmt, _, vec = RECIPES[recipe]
    if k % vec:
        raise ValueError(f"k: must be a multiple of the block length {vec}, got {k}")
    m, n = a.shape[0], w.shape[0]
    if w.shape[1] * 2 != k or a.shape[1] * (2 if a_fmt == "e2m1" else 1) != k:
        raise ValueError(f"a {tuple(a.shape)} / w {tuple(w.shape)}: do not hold K = {k} elements per row")
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    ts = tensor_scale if tensor_scale is not None else torch.ones(1, device=a.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fp4_dot_scaled_kernel[grid](
        a.contiguous().view(torch.uint8),  # E2M1 pairs or E4M3 bytes
        _scale_bytes(a_scale),
        w.contiguous(),
        _scale_bytes(w_scale),
        ts.reshape(1).to(torch.float32),
        out,
        m,
        n,
        k,
        A_FMT=a_fmt,
        VEC=vec,
        HAS_TS=tensor_scale is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
