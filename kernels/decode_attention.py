"""Attention of a few new query tokens over a KV cache read in its stored dtype (fp8 E4M3 included).

``decode_attention(q [R, kv_heads, M, d], k_cache, v_cache [R, kv_heads, C, d], visible [R, Tm, W] bool,
scale) -> [R, kv_heads, M, d]`` in q's dtype, where W <= C (only the first W cache columns are read).

Grouped-query layout (as `bitrl.rollout.decoder.Decoder.hidden` lays it out): query head h = j * group + g
reads KV head j, and the [R, heads, T, d] queries of T new tokens are viewed as [R, kv_heads, M, d] with
M = group * T, query row m = g * T + t. ``visible`` has one row per query row (Tm = M) or one per token
(Tm = T, shared by the group's heads): query row m uses mask row m % Tm.

Semantics (the reference below writes them out in fp64):

    s[m, w]   = scale * <q[m], k[w]>            for visible[m % Tm, w], -inf elsewhere
    p[m, w]   = exp(s[m, w] - max_w s[m, :]) / sum_w exp(s[m, w] - max_w s[m, :])
    out[m]    = sum_{w < W} p[m, w] * v[w]      (every column multiplies, masked ones by 0)

- fp8 K/V are E4M3 values, read as they are stored (no scale: `KVCache` stores clamped values).
- A query row that sees no column (all of its mask row False) gives 0, as torch's
  ``F.scaled_dot_product_attention`` does since 2.5 (`Slots` keeps column 0 visible, so the engine never
  asks for one).
- NaN is never hidden: a NaN in a query row, or in a visible key, makes that row NaN; a NaN in any value
  column w < W makes every row that sees some column NaN (0 * NaN, as in SDPA's product with V). A key
  behind the mask is never read into a score, so a NaN there does not show.

The Triton kernel (one program per (row, KV head) and block of ``BLOCK_M`` = 16 query rows) loads K/V tiles
in their stored dtype and converts them in registers to the query's dtype (exact for E4M3 into bf16, fp16 or
fp32; E4M3's NaN bytes made NaN by their bits), forms the scores with one ``tl.dot`` per tile (IEEE fp32 for
fp32 queries, tensor cores with fp32 accumulation for bf16/fp16), and keeps an online softmax in fp32
(running max, normaliser, fp32 output accumulator). The key axis is walked in tiles of ``BLOCK_N`` columns
from column 0 upwards, the tile size fixed per query dtype: the order of every reduction depends neither on
the number of rows R nor on the number of new tokens T, and trailing masked columns add exact zeros (a wider
W leaves the bits unchanged). As in FlashAttention, the probabilities are rounded to the query dtype before
the product with V (bf16/fp16 queries). Offsets are int64. NaN handling uses comparisons only: the running
max is made 0 where it is -inf (nothing seen yet) by ``where(m == -inf, 0, m)``, and the output is 0 where
``l == 0`` (false for NaN, which then reaches the output); a clamp such as ``maximum(x, -1e30)`` would turn
NaN into -1e30. Under ``TRITON_INTERPRET=1`` bf16 operands are multiplied as the fp32 values they hold (the
interpreter's numpy dot has no bf16): the same exact products, summed in fp32.

Implementations (``impl=`` or ``BITRL_KERNEL_IMPL``): ``"triton"`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``); ``"torch"``: the cache cast to q's dtype over the attended width, then, on the CPU
for fp32/bf16 queries, the host library's kernel (csrc/attention_host.cc: fp32, each query's reductions in
ascending column order, so batch- and width-invariant like the Triton kernel), elsewhere
``F.scaled_dot_product_attention``; ``"reference"``: the formula above in fp64, written out elementwise.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, check_tensor, next_pow2, resolve_impl
from .host_ext import load_host_library

__all__ = ["BLOCK_M", "QUERY_DTYPES", "decode_attention", "decode_attention_reference"]

QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
BLOCK_M = 16  # query rows per program (tl.dot's smallest M); decode has group * T of them
# key columns per tile, by query dtype: fixed, so the reduction order is the same for every R, T and W
BLOCK_N = {torch.float32: 16, torch.bfloat16: 64, torch.float16: 64}
# fp32's IEEE dot runs on FMA units, each thread holding whole rows of both operands: 8 warps at head_dim 128
WARPS = {torch.float32: 8, torch.bfloat16: 4, torch.float16: 4}
MAX_HEAD_DIM = 256


def _check(q, k_cache, v_cache, visible):
    check_tensor("q", q, ndim=4, dtypes=QUERY_DTYPES + (torch.float64,))
    rows, kv_heads, queries, dim = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, shape=(rows, kv_heads, None, dim), dtypes=(FP8, q.dtype), device=q.device)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache: expected the shape and dtype of k_cache {list(k_cache.shape)} {k_cache.dtype}, got "
            f"{list(v_cache.shape)} {v_cache.dtype}"
        )
    check_tensor("visible", visible, ndim=3, dtypes=(torch.bool,), device=q.device)
    tm, width = visible.shape[1], visible.shape[2]
    if visible.shape[0] != rows or tm == 0 or queries % tm:
        raise ValueError(
            f"visible: expected [{rows}, T, W] with T dividing the {queries} query rows, got "
            f"{list(visible.shape)}"
        )
    if width > k_cache.shape[2]:
        raise ValueError(f"visible: {width} columns, but the cache holds {k_cache.shape[2]}")
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {dim} > {MAX_HEAD_DIM}")


def decode_attention_reference(q, k_cache, v_cache, visible, scale: float) -> torch.Tensor:
    """The semantics of the module docstring in fp64, elementwise (no matmul, no softmax op)."""
    _check(q, k_cache, v_cache, visible)
    rows, kv_heads, queries, dim = q.shape
    width = visible.shape[-1]
    q64 = q.double()
    k64 = k_cache[:, :, :width].double()  # fp8 -> fp64 is exact
    v64 = v_cache[:, :, :width].double()
    tm = visible.shape[1]
    see = visible[:, torch.arange(queries, device=q.device) % tm][:, None]  # [R, 1, M, W]
    s = (q64[:, :, :, None, :] * k64[:, :, None, :, :]).sum(-1) * scale  # [R, H, M, W]
    s = torch.where(see, s, -math.inf)
    top = s.amax(-1, keepdim=True)
    empty = ~see.any(-1, keepdim=True)  # [R, 1, M, 1]
    e = torch.exp(s - torch.where(empty, 0.0, top))
    p = e / e.sum(-1, keepdim=True)
    p = torch.where(empty, 0.0, p)
    out = (p[..., None] * v64[:, :, None, :, :]).sum(-2)  # [R, H, M, d]
    return torch.where(empty, 0.0, out).to(q.dtype)


def _decode_attention_torch(q, k_cache, v_cache, visible, scale):
    rows, kv_heads, queries, dim = q.shape
    tm, width = visible.shape[1], visible.shape[2]
    host = q.device.type == "cpu" and q.dtype in HOST_DTYPES and dim % 16 == 0
    lib = load_host_library() if host else None
    if lib is not None:
        return _decode_attention_host(lib, q, k_cache, v_cache, visible, scale)
    keys, values = k_cache[:, :, :width].to(q.dtype), v_cache[:, :, :width].to(q.dtype)
    mask = visible[:, None, None].expand(rows, 1, queries // tm, tm, width).reshape(rows, 1, queries, width)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


# The host kernel's dtypes (csrc/attention_host.cc; head_dim a multiple of 16); fp16 and fp64 take SDPA.
HOST_DTYPES = (torch.float32, torch.bfloat16)


def _decode_attention_host(lib, q, k_cache, v_cache, visible, scale):
    """The torch path's attention on the CPU by csrc/attention_host.cc: one pass per (row, KV head), fp32,
    each query's reductions in a fixed order over its visible columns (so its bits do not depend on the rows,
    tokens or masked columns beside it). A contiguous cache in q's dtype is read in place; any other is cast
    over the attended width first."""
    rows, kv_heads, queries, dim = q.shape
    tm, width = visible.shape[1], visible.shape[2]
    keys, values = k_cache, v_cache
    if keys.dtype != q.dtype or not (keys.is_contiguous() and values.is_contiguous()):
        keys = k_cache[:, :, :width].to(q.dtype).contiguous()
        values = v_cache[:, :, :width].to(q.dtype).contiguous()
    q = q.contiguous()
    if visible.stride(2) != 1:
        visible = visible.contiguous()
    out = torch.empty_like(q)
    lib.bitrl_decode_attention(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        visible.data_ptr(),
        out.data_ptr(),
        rows,
        kv_heads,
        queries,
        tm,
        width,
        dim,
        keys.shape[2],
        visible.stride(0),
        visible.stride(1),
        ctypes.c_float(scale),
        int(q.dtype == torch.bfloat16),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Attention of the query rows q [R, kv_heads, M, d] (fp32/bf16/fp16; fp64 on the torch path) over the
    first W columns of k_cache / v_cache [R, kv_heads, C, d] (fp8 E4M3 or q's dtype, any strides with unit
    stride on d), visible [R, Tm, W] bool (Tm = M, or Tm = T with M = group * T: row m uses mask row m % Tm),
    scores scaled by `scale`. Returns [R, kv_heads, M, d] in q's dtype (module docstring). No host sync."""
    _check(q, k_cache, v_cache, visible)
    impl = resolve_impl(impl, q.device, op="decode_attention", dtype=q.dtype)
    if impl == "reference":
        return decode_attention_reference(q, k_cache, v_cache, visible, scale)
    if impl == "triton":
        return _decode_attention_triton(q, k_cache, v_cache, visible, scale)
    return _decode_attention_torch(q, k_cache, v_cache, visible, scale)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load_kv(ptrs, ok, dot_ty: tl.constexpr):
        """A K or V tile in q's dtype; 0 outside `ok` (an fp8 load takes no `other`, and a stale NaN there
        would reach the dots as 0 * NaN)."""
        x = tl.load(ptrs, mask=ok)
        y = x.to(dot_ty)
        if x.dtype == tl.float8e4nv:
            # E4M3FN's only NaN is S.1111.111; made NaN by its bits, whatever the conversion does with it
            # (Triton's interpreter decodes it as 480)
            y = tl.where((x.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), y)
        return tl.where(ok, y, 0.0).to(dot_ty)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        o_ptr,
        kv_heads,
        queries,
        width,
        mask_rows,
        head_dim,
        stride_qr,
        stride_qh,
        stride_qm,
        stride_kr,
        stride_kh,
        stride_kc,
        stride_vr,
        stride_vh,
        stride_vc,
        stride_mr,
        stride_mm,
        stride_mc,
        stride_or,
        stride_oh,
        stride_om,
        qk_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        F32_DOT: tl.constexpr,
    ):
        # program (r * kv_heads + j, b): query rows [b * BLOCK_M, +BLOCK_M) of KV head j of cache row r
        rh = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements
        r = rh // kv_heads
        j = rh % kv_heads
        m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_ok = m < queries
        d_ok = d < head_dim
        dot_ty = q_ptr.dtype.element_ty
        q_tile = q_ptr + r * stride_qr + j * stride_qh + m[:, None] * stride_qm + d[None, :]
        q = tl.load(q_tile, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        k_base = k_ptr + r * stride_kr + j * stride_kh
        v_base = v_ptr + r * stride_vr + j * stride_vh
        mask_base = mask_ptr + r * stride_mr + (m % mask_rows)[:, None] * stride_mm
        neg_inf = float("-inf")
        m_i = tl.full((BLOCK_M,), neg_inf, tl.float32)  # running max of the scores (log2 units)
        l_i = tl.zeros((BLOCK_M,), tl.float32)  # running normaliser
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for start in range(0, width, BLOCK_N):  # fixed tiles of the key axis, in order
            c = start + tl.arange(0, BLOCK_N).to(tl.int64)
            c_ok = c < width
            kv_ok = c_ok[:, None] & d_ok[None, :]
            k = _load_kv(k_base + c[:, None] * stride_kc + d[None, :], kv_ok, dot_ty)  # dequantized here
            if F32_DOT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            see = tl.load(mask_base + c[None, :] * stride_mc, mask=m_ok[:, None] & c_ok[None, :], other=0)
            s = tl.where(see != 0, s * qk_scale, neg_inf)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # comparisons, not clamps: NaN stays NaN; -inf (nothing seen yet) subtracts 0
            m_sub = tl.where(m_new == neg_inf, 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_kv(v_base + c[:, None] * stride_vc + d[None, :], kv_ok, dot_ty)
            if F32_DOT:  # p rounded to q's dtype as on the tensor cores, then multiplied in fp32
                pv = tl.dot(p.to(dot_ty).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(dot_ty), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # a row that saw nothing gives 0; `l == 0` is false for NaN, which then reaches the output
        empty = l_i[:, None] == 0.0
        out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_i[:, None]))
        o_tile = o_ptr + r * stride_or + j * stride_oh + m[:, None] * stride_om + d[None, :]
        tl.store(o_tile, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _interpreted() -> bool:
    # the interpreter stores bf16 as uint16 and its numpy dot multiplies those integers: bf16 operands are
    # multiplied there as the fp32 values they hold (exact products, fp32 sums, as on the tensor cores)
    return not isinstance(_decode_attention_kernel, triton.runtime.JITFunction)


def _decode_attention_triton(q, k_cache, v_cache, visible, scale):
    rows, kv_heads, queries, dim = q.shape
    tm, width = visible.shape[1], visible.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    mask = visible.view(torch.uint8)  # the same bytes, any strides (an expanded mask keeps stride 0)
    grid = (rows * kv_heads, triton.cdiv(queries, BLOCK_M))
    _decode_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        mask,
        out,
        kv_heads,
        queries,
        width,
        tm,
        dim,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        mask.stride(0),
        mask.stride(1),
        mask.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        float(scale) * math.log2(math.e),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N[q.dtype],
        BLOCK_D=max(16, next_pow2(dim)),
        F32_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreted()),
        num_warps=WARPS[q.dtype],
    )
    return out
