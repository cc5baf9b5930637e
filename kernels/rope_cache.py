"""The rotary embedding of a decode step's queries and keys, the keys and values stored into the KV cache.

    q_rot = rope_store(q, k, v, cos, sin, k_cache, v_cache, cols)

q [R, T, Hq, d], k and v [R, T, Hk, d] (the projections viewed per head), cos and sin [R, T, d] (the
model's rotary table at each token's position): q_rot [R, Hq, T, d] = q cos + rotate_half(q) sin, and
token t of row r writes rotate(k) and v into column cols[r, t] of cache row r ([R, Hk, C, d]). One pass on
the CPU (csrc/rope_cache_host.cc) with the bits of the torch formula (`rope_store_reference`), reading q, k
and v where they lie when each is per-head rows or a slice of a feature-major [features, tokens] buffer (the
weight-major decode step's); elsewhere, or for other dtypes and layouts, that formula.
"""

from __future__ import annotations

import torch

from ._common import check_tensor
from .host_ext import load_host_library

HOST_DTYPES = (torch.float32, torch.bfloat16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_store_reference(q, k, v, cos, sin, k_cache, v_cache, cols) -> torch.Tensor:
    """The formula in torch ops, in the tensors' dtype (each product and the sum rounded to it)."""
    rows, tokens, _, d = q.shape
    cos, sin = cos[:, None], sin[:, None]  # [R, 1, T, d]: one table for every head
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    r = torch.arange(rows, device=q.device)[:, None].expand(rows, tokens)
    k_cache[r, :, cols] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[r, :, cols] = v.transpose(1, 2).to(v_cache.dtype)
    return q


def _check(q, k, v, cos, sin, k_cache, v_cache, cols):
    check_tensor("q", q, ndim=4)
    rows, tokens, _, d = q.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, shape=(rows, tokens, None, d), dtypes=(q.dtype,), device=q.device)
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {list(k.shape)}, got {list(v.shape)}")
    if d % 2:
        raise ValueError(f"q: the rotary embedding needs an even head_dim, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, shape=(rows, tokens, d), dtypes=(q.dtype,), device=q.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, shape=(rows, k.shape[2], None, d), device=q.device)
    check_tensor("cols", cols, shape=(rows, tokens), dtypes=(torch.long,), device=q.device)


def _token_feature_strides(x: torch.Tensor) -> tuple[int, int] | None:
    """(token, feature) strides of x [R, T, heads, d] when token r * T + t lies at (r * T + t) * token and
    feature h * d + c at (h * d + c) * feature: per-head rows (feature 1) or a slice of a feature-major
    [features, tokens] buffer (token 1); None otherwise."""
    rows, tokens, heads, d = x.shape
    s_row, s_tok, s_head, s_feat = x.stride()
    if rows > 1 and tokens > 1 and s_row != tokens * s_tok:
        return None
    if heads > 1 and s_head != d * s_feat:
        return None
    return (s_tok if tokens > 1 else s_row), s_feat


def rope_store(q, k, v, cos, sin, k_cache, v_cache, cols) -> torch.Tensor:
    """q_rot [R, Hq, T, d] in q's dtype; rotated k and v written into k_cache / v_cache [R, Hk, C, d] at
    columns cols [R, T] int64 (module docstring); a column outside the cache is an error."""
    _check(q, k, v, cos, sin, k_cache, v_cache, cols)
    rows, tokens, q_heads, d = q.shape
    kv_heads, columns = k_cache.shape[1], k_cache.shape[2]
    lib = load_host_library() if q.device.type == "cpu" and q.dtype in HOST_DTYPES else None
    layout = (columns * d, d, 1)
    if (
        lib is None
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or k_cache.stride()[1:] != layout
        or v_cache.stride() != k_cache.stride()
    ):
        on_host = q.device.type == "cpu" and cols.numel()  # (a CUDA check would sync)
        if on_host and (int(cols.min()) < 0 or int(cols.max()) >= columns):
            raise ValueError(f"cols: a column outside the cache's {columns} columns")
        return rope_store_reference(q, k, v, cos, sin, k_cache, v_cache, cols)
    strides = [_token_feature_strides(t) for t in (q, k, v)]
    # the kernel's layouts: features contiguous (any token stride), or feature-major (tokens contiguous)
    if (
        None in strides
        or strides[1] != strides[2]
        or strides[0][1] != strides[1][1]
        or (strides[0][1] != 1 and (strides[0][0], strides[1][0]) != (1, 1))
    ):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        strides = [_token_feature_strides(t) for t in (q, k, v)]
    (q_tok, feat), (kv_tok, _) = strides[0], strides[1]
    cos, sin, cols = cos.contiguous(), sin.contiguous(), cols.contiguous()
    out = torch.empty((rows, q_heads, tokens, d), dtype=q.dtype)
    bad = lib.bitrl_rope_store(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), cols.data_ptr(),
        out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        rows, tokens, q_heads, kv_heads, d, columns, k_cache.stride(0), q_tok, kv_tok, feat,
        int(q.dtype == torch.bfloat16),
    )  # fmt: skip
    if bad:
        raise ValueError(f"cols: column {int(cols.view(-1)[bad - 1])} outside the cache's {columns} columns")
    return out
