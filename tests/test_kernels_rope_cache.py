import math

import pytest
import torch

from bitrl.kernels.host_ext import load_host_library
from bitrl.kernels.rope_cache import rope_store, rope_store_reference


def _case(seed, dtype, rows=5, tokens=1, q_heads=6, kv_heads=2, d=16, columns=12):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, tokens, q_heads, d, generator=g).to(dtype)
    k = torch.randn(rows, tokens, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(rows, tokens, kv_heads, d, generator=g).to(dtype)
    angle = torch.rand(rows, tokens, d // 2, generator=g) * 50
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    cols = torch.stack([torch.randperm(columns, generator=g)[:tokens] for _ in range(rows)])
    cache = torch.randn(2, rows, kv_heads, columns, d, generator=g).to(dtype)
    return q, k, v, cos, sin, cache, cols


def _independent(q, k, v, cos, sin, cache, cols):
    """The formula element by element in fp64 (rounded to the dtype once at the end, so a bf16 result may
    differ from the dtype's own ops by the two intermediate roundings)."""
    rows, tokens, q_heads, d = q.shape
    half = d // 2
    out = torch.empty(rows, q_heads, tokens, d, dtype=torch.float64)
    kc, vc = cache[0].double().clone(), cache[1].double().clone()
    for r in range(rows):
        for t in range(tokens):
            c, s = cos[r, t].double(), sin[r, t].double()
            for name, x in (("q", q), ("k", k)):
                for h in range(x.shape[2]):
                    xv = x[r, t, h].double()
                    rot = torch.cat([-xv[half:], xv[:half]])
                    y = xv * c + rot * s
                    if name == "q":
                        out[r, h, t] = y
                    else:
                        kc[r, h, cols[r, t]] = y
            for h in range(v.shape[2]):
                vc[r, h, cols[r, t]] = v[r, t, h].double()
    return out, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed,tokens", [(0, 1), (1, 3), (2, 1)])
def test_rope_store_matches_the_formula_and_the_torch_ops_bits(dtype, seed, tokens):
    q, k, v, cos, sin, cache, cols = _case(seed, dtype, tokens=tokens, d=16 + 16 * seed)
    kc, vc = cache[0].clone(), cache[1].clone()
    out = rope_store(q, k, v, cos, sin, kc, vc, cols)
    want, want_k, want_v = _independent(q, k, v, cos, sin, cache, cols)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(kc.double(), want_k, atol=tol, rtol=tol)
    assert torch.equal(vc.double(), want_v)  # values are copied
    # the host kernel replaces torch ops in the decode step: their bits, not only their values
    rk, rv = cache[0].clone(), cache[1].clone()
    ref = rope_store_reference(q, k, v, cos, sin, rk, rv, cols)
    assert torch.equal(out, ref) and torch.equal(kc, rk) and torch.equal(vc, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_shows_nan_and_inf_where_the_formula_does(dtype):
    q, k, v, cos, sin, cache, cols = _case(3, dtype, rows=3)
    q[0, 0, 1, 2] = math.nan  # lane 2 and its partner lane 2 + d/2 of one query head
    k[1, 0, 0, 5] = math.inf
    v[2, 0, 1, 0] = math.nan
    kc, vc = cache[0].clone(), cache[1].clone()
    out = rope_store(q, k, v, cos, sin, kc, vc, cols)
    rk, rv = cache[0].clone(), cache[1].clone()
    ref = rope_store_reference(q, k, v, cos, sin, rk, rv, cols)
    assert torch.equal(out.isnan(), ref.isnan()) and out[0, 1, 0].isnan().sum() == 2
    assert torch.equal(kc.isnan(), rk.isnan()) and torch.equal(kc.isinf(), rk.isinf())
    assert vc[2, 1, cols[2, 0], 0].isnan() and vc.isnan().sum() == 1
    finite = ~ref.isnan()
    assert torch.equal(out[finite], ref[finite])


def test_rope_store_writes_only_its_columns_and_takes_views_of_a_larger_cache():
    q, k, v, cos, sin, cache, cols = _case(4, torch.float32, rows=4)
    big = torch.randn(2, 6, 2, 12, 16)
    kc, vc = big[0][:4], big[1][:4]  # the first rows of a larger cache, as after a compaction
    before_k, before_v = kc.clone(), vc.clone()
    rope_store(q, k, v, cos, sin, kc, vc, cols)
    touched = torch.zeros(4, 12, dtype=torch.bool)
    touched[torch.arange(4), cols[:, 0]] = True
    assert torch.equal(kc.transpose(1, 2)[~touched], before_k.transpose(1, 2)[~touched])
    assert torch.equal(vc.transpose(1, 2)[~touched], before_v.transpose(1, 2)[~touched])
    assert not torch.equal(kc, before_k)


def test_rope_store_arguments_are_checked():
    q, k, v, cos, sin, cache, cols = _case(5, torch.float32)
    kc, vc = cache[0], cache[1]
    with pytest.raises(ValueError, match="k: expected shape"):
        rope_store(q, k[:, :, :, :8], v, cos, sin, kc, vc, cols)
    with pytest.raises(ValueError, match="cos: expected shape"):
        rope_store(q, k, v, cos[:, :, :8], sin, kc, vc, cols)
    with pytest.raises(ValueError, match="cols"):
        rope_store(q, k, v, cos, sin, kc, vc, cols.int())
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        rope_store(q, k, v, cos, sin, kc[:, :1], vc, cols)
    for column in (12, -1):  # outside the 12 columns: nothing written
        bad = cols.clone()
        bad[3, 0] = column
        before = kc.clone()
        with pytest.raises(ValueError, match="outside the cache's 12 columns"):
            rope_store(q, k, v, cos, sin, kc, vc, bad)
        assert torch.equal(kc, before)


def test_the_host_kernel_is_the_cpu_path():
    if load_host_library() is None:
        pytest.skip("the host kernels need a C++ compiler")
    import bitrl.kernels.rope_cache as rc

    q, k, v, cos, sin, cache, cols = _case(6, torch.float32)
    called = []
    real = rc.rope_store_reference
    rc.rope_store_reference = lambda *a: called.append(1) or real(*a)
    try:
        rope_store(q, k, v, cos, sin, cache[0].clone(), cache[1].clone(), cols)
        assert not called
        rope_store(q, k, v, cos, sin, cache[0].double(), cache[1].double(), cols)  # another cache dtype
        assert called
    finally:
        rc.rope_store_reference = real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,tokens", [(17, 1), (3, 5), (40, 1)])
def test_rope_store_reads_feature_major_projections_where_they_lie(dtype, rows, tokens):
    """The weight-major decode step's q, k, v: column slices of one [tokens, features] view of a feature-major
    [features, tokens] buffer. Read in place (gathered by the kernel), with the bits of the contiguous ones;
    a NaN in the buffer lands where the formula puts it."""
    q0, k0, v0, cos, sin, cache, cols = _case(7 + rows, dtype, rows=rows, tokens=tokens, d=32)
    q_f, k_f = q0.shape[2] * 32, k0.shape[2] * 32
    flat = [t.reshape(rows * tokens, -1) for t in (q0, k0, v0)]
    buffer = torch.cat(flat, dim=1).t().contiguous()  # [features, tokens]
    buffer[3, 1] = math.nan  # token 1's feature 3: query head 0, lane 3
    by_token = buffer.t()
    q, k, v = (
        by_token[:, s:e].view(rows, tokens, -1, 32)
        for s, e in ((0, q_f), (q_f, q_f + k_f), (q_f + k_f, None))
    )
    assert not q.is_contiguous()
    kc, vc = cache[0].clone(), cache[1].clone()
    out = rope_store(q, k, v, cos, sin, kc, vc, cols)
    rk, rv = cache[0].clone(), cache[1].clone()
    ref = rope_store_reference(q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, rk, rv, cols)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().sum() == 2  # lane 3 and its partner
    finite = ~ref.isnan()
    assert torch.equal(out[finite], ref[finite]) and torch.equal(kc, rk) and torch.equal(vc, rv)
