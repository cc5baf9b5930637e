"""fused_logprobs: accuracy against fp64, gradients, edge cases, validation, Triton under the interpreter."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from conftest import tile_elem_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels_helpers import (
    LOW_DTYPES,
    LargestFp32Tensor,
    assert_as_accurate,
    assert_close,
    needs_triton,
    triton_device,
)
from torch.utils._python_dispatch import TorchDispatchMode

from bitrl.kernels import fused_logprobs, fused_logprobs_reference
from bitrl.kernels.fused_logprobs import tiled_cpu, triton_rows  # the modules that read what the tests set


def _inputs(N, H, V, dtype, seed=0, scale=1.0, bias=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    dev = torch.device(device)
    return h.to(dev), w.to(dev), y.to(dev), (None if b is None else b.to(dev))


def _run(fn, h, w, y, b=None, *, temperature=1.0, use_entropy=True, gseed=1, **kw):
    """Forward + backward of sum(g1 * lp) + sum(g2 * ent); returns detached (lp, ent, dh, dw, db)."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    lp, ent = fn(h, w, y, temperature=temperature, bias=b, **kw)
    gen = torch.Generator().manual_seed(gseed)
    g1 = torch.randn(lp.shape, generator=gen, dtype=torch.float64).to(lp.device, lp.dtype)
    obj = (lp * g1).sum()
    if use_entropy and ent is not None:
        g2 = torch.randn(ent.shape, generator=gen, dtype=torch.float64).to(ent.device, ent.dtype)
        obj = obj + (ent * g2).sum()
    params = [h, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad(obj, params)
    out = [lp.detach(), None if ent is None else ent.detach(), grads[0], grads[1]]
    out.append(grads[2] if b is not None else None)
    return out


def _ref64(h, w, y, b=None, **kw):
    t = kw.pop("temperature", 1.0)
    if isinstance(t, torch.Tensor):
        t = t.double()
    return _run(
        fused_logprobs_reference,
        h.double(),
        w.double(),
        y,
        None if b is None else b.double(),
        temperature=t,
        **kw,
    )


NAMES = ("logprobs", "entropy", "d_hidden", "d_weight", "d_bias")


@contextlib.contextmanager
def _tile_bytes(nbytes: int):
    """Shrink the torch backend's CPU tiles (0: leave them) so small cases span several tiles."""
    old = tiled_cpu.TILE_BYTES["logprobs"]["cpu"]
    tiled_cpu.TILE_BYTES["logprobs"]["cpu"] = nbytes or old
    try:
        yield
    finally:
        tiled_cpu.TILE_BYTES["logprobs"]["cpu"] = old


# (tile bytes, chunk_size): one tile; every token in each tile with 3 vocabulary blocks (a bf16 tile element
# takes 10 bytes with entropy, fp32 8); tiles of a few tokens by 64 columns
TILES = {"one": (0, None), "vocab-blocks": (10 * 260 * 40, None), "small": (700, 16)}
# bytes of kept products beside the tiles: every tile recomputed in the backward; the columns of a few tiles
# kept, the edge inside a tile (40 tokens x 150 fp32 or 300 bf16 columns); everything kept (the CPU default
# memory_budget at these sizes)
KEEP = {"recompute": 0, "part": 40 * 600, "all": None}


def _budget(keep, h, V, n=None, impl="torch", chunk=None):
    """The memory_budget that keeps ``keep`` bytes of products beside the engine's own buffers (the tiles,
    or the Triton path's [chunk, V] fp32 workspace); None (the default budget) for None. Call it where the
    tile budget in force is the one the op will see."""
    if keep is None:
        return None
    n = h.shape[0] if n is None else n
    if impl == "torch":
        return tiled_cpu.tile_bytes(n, V, h, "logprobs") + keep
    return min(chunk or n, n) * V * 4 + keep


@pytest.mark.parametrize("keep", list(KEEP))
@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("per_token_t", [False, True])
def test_torch_path_as_accurate_as_unfused(dtype, per_token_t, tiles, keep, cpu_bf16_matmul):
    N, H, V = 40, 24, 600
    h, w, y, b = _inputs(N, H, V, dtype, bias=True)
    y[5] = -100
    b[9] = float("-inf")
    t = torch.rand(N, generator=torch.Generator().manual_seed(3)) + 0.5 if per_token_t else 0.7
    ref = _ref64(h, w, y, b, temperature=t)
    unfused = _run(fused_logprobs_reference, h, w, y, b, temperature=t)
    tile_bytes, chunk = TILES[tiles]
    with _tile_bytes(tile_bytes):
        kw = dict(temperature=t, impl="torch", chunk_size=chunk, memory_budget=_budget(KEEP[keep], h, V))
        fused = _run(fused_logprobs, h, w, y, b, **kw)
    for name, f, u, r in zip(NAMES, fused, unfused, ref):
        assert_as_accurate(f, u, r, atol=1e-5, rtol=1e-5, what=f"{dtype} {name}")
        if dtype == torch.float32:  # absolute fp32 tolerances
            assert_close(f, r, atol=2e-5, rtol=2e-5, what=f"fp32 {name}")
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert fused[0][5] == 0 and fused[1][5] == 0


def test_output_contract_and_ignore_index():
    h, w, y, _ = _inputs(6, 8, 11, torch.bfloat16)
    y[:] = -100
    lp, ent = fused_logprobs(h, w, y, impl="torch")
    assert lp.shape == (6,) and ent.shape == (6,)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert torch.all(lp == 0) and torch.all(ent == 0)
    lp, ent = fused_logprobs(h, w, y, impl="torch", return_entropy=False)
    assert ent is None


def test_entropy_gradient_only_when_used():
    h, w, y, _ = _inputs(10, 8, 37, torch.float64)
    ref = _ref64(h, w, y, use_entropy=False)
    got = _run(fused_logprobs, h, w, y, impl="torch", chunk_size=3, use_entropy=False)
    for name, g, r in zip(NAMES, got, ref):
        if r is not None:
            assert_close(g, r, atol=1e-10, rtol=1e-10, what=name)
    # entropy-only objective
    hh = h.clone().requires_grad_(True)
    _, ent = fused_logprobs(hh, w, y, impl="torch")
    (gh,) = torch.autograd.grad(ent.sum(), [hh])
    hr = h.clone().requires_grad_(True)
    _, ent_r = fused_logprobs_reference(hr, w, y)
    (ghr,) = torch.autograd.grad(ent_r.sum(), [hr])
    assert_close(gh, ghr, atol=1e-10, rtol=1e-10, what="entropy-only grad")


def test_neg_inf_bias_and_huge_logits():
    N, H, V = 12, 8, 29
    h, w, y, b = _inputs(N, H, V, torch.float32, bias=True, scale=300.0)  # logits in the thousands
    b[::3] = float("-inf")
    y[0] = 0  # target on a masked vocabulary entry -> p = 0, finite very negative log-prob
    lp, ent = fused_logprobs(h, w, y, bias=b, impl="torch", chunk_size=5)
    assert torch.isfinite(ent).all()
    assert torch.isfinite(lp[1:]).all() and lp[0] <= -1e29
    lp64, ent64 = fused_logprobs_reference(h.double(), w.double(), y, bias=b.double())
    assert_close(lp[1:], lp64[1:], atol=2e-3, rtol=1e-5, what="lp huge logits")
    assert_close(ent, ent64, atol=2e-3, what="entropy huge logits")
    hh = h.clone().requires_grad_(True)
    lp, ent = fused_logprobs(hh, w, y, bias=b, impl="torch")
    (g,) = torch.autograd.grad(lp[1:].sum() + ent.sum(), [hh])
    assert torch.isfinite(g).all()


BF16_U = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


@pytest.mark.parametrize("tiles", ["one", "vocab-blocks"])
def test_bf16_cpu_error_bound(tiles, cpu_bf16_matmul):
    """bf16 GEMMs: each logit is the exact product of the bf16 inputs rounded once to bf16
    (|dz_v| <= u |z_v|, u = 2^-8) and everything after that is fp32. Against fp64 from the same bf16
    inputs, to first order, with M = max_v |z_v| / T per token:
    |lp - lp64| <= 2 u M (lp = z_y - lse);  |H - H64| <= u M E_p|z/T - E_p[z/T]| <= 2 u M^2;
    |dW - dW64| <= (2 u M + 3 u) (|dz64|^T |h|) elementwise (p off by 2 u M relatively, dz rounded to bf16,
    each tile's matmul output rounded to bf16), and |dh - dh64| <= (2 u M + 3 u) (|dz64| |W|).
    The test allows twice these (second-order terms) plus 1e-6.
    fp32 GEMMs of the bf16 operands: the same bounds with fp32's u (2^-24, times H for the sums) for lp and
    entropy, and one rounding of dW and dh to bf16 on top of the fp32 error for the gradients."""
    N, H, V = 48, 64, 600
    h, w, y, _ = _inputs(N, H, V, torch.bfloat16, scale=3.0, seed=5)  # logits up to ~10 / T
    T = 0.7
    tile_bytes, chunk = TILES[tiles]
    with _tile_bytes(tile_bytes):
        lp, ent, dh, dw, _ = _run(fused_logprobs, h, w, y, temperature=T, impl="torch", chunk_size=chunk)
    # fp64 reference from the bf16 inputs, with d objective / d logits
    h64, w64 = h.double(), w.double()
    z64 = (h64 @ w64.T).requires_grad_(True)
    logp = torch.log_softmax(z64 / T, -1)
    lp64 = logp.gather(-1, y[:, None])[:, 0]
    ent64 = -(logp.exp() * logp).sum(-1)
    gen = torch.Generator().manual_seed(1)  # the same upstream gradients as _run
    g1 = torch.randn(N, generator=gen, dtype=torch.float64).float().double()
    g2 = torch.randn(N, generator=gen, dtype=torch.float64).float().double()
    (dz64,) = torch.autograd.grad((lp64 * g1).sum() + (ent64 * g2).sum(), [z64])
    M = (z64.detach().abs().amax(-1) / T).double()
    dw64, dh64 = dz64.T @ h64, dz64 @ w64
    if cpu_bf16_matmul == torch.bfloat16:
        u = BF16_U
        rel = 2 * (2 * u * float(M.max()) + 3 * u)
        bound_w, bound_h = rel * (dz64.abs().T @ h64.abs()), rel * (dz64.abs() @ w64.abs())
    else:
        u = 2.0**-24 * H
        rel = 2 * (2 * u * float(M.max()) + 3 * u)
        bound_w = rel * (dz64.abs().T @ h64.abs()) + BF16_U * dw64.abs()
        bound_h = rel * (dz64.abs() @ w64.abs()) + BF16_U * dh64.abs()
    assert ((lp.double() - lp64.detach()).abs() <= 2 * (2 * u * M) + 1e-6).all()
    assert ((ent.double() - ent64.detach()).abs() <= 2 * (2 * u * M**2) + 1e-6).all()
    assert ((dw.double() - dw64).abs() <= bound_w + 1e-6).all()
    assert ((dh.double() - dh64).abs() <= bound_h + 1e-6).all()
    assert lp.dtype == torch.float32 and dw.dtype == torch.bfloat16 and dh.dtype == torch.bfloat16


def test_bf16_cpu_hostile_values(cpu_bf16_matmul):
    """Huge logits, -inf bias entries, NaN hidden states on an ignored token: finite outputs and gradients."""
    N, H, V = 20, 16, 300
    h, w, y, b = _inputs(N, H, V, torch.bfloat16, bias=True, scale=200.0)  # logits in the hundreds
    b[::4] = float("-inf")
    y[y % 4 == 0] += 1  # targets on allowed entries
    y[3] = -100
    h[3] = float("nan")  # an ignored token's hidden state is never read
    with _tile_bytes(TILES["vocab-blocks"][0]):
        lp, ent, dh, dw, db = _run(fused_logprobs, h, w, y, b, temperature=0.9, impl="torch")
    for name, x in zip(NAMES, (lp, ent, dh, dw, db)):
        assert torch.isfinite(x.float()).all(), name
    assert lp[3] == 0 and ent[3] == 0 and (dh[3] == 0).all()
    keep = torch.arange(N) != 3
    ref = _ref64(h[keep], w, y[keep], b, temperature=0.9)
    M = float((h[keep].double() @ w.double().T).abs().max()) / 0.9
    assert_close(lp[keep], ref[0], atol=4 * BF16_U * M, what="lp huge logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_weights_get_no_fp32_weight_sized_buffer(dtype, cpu_bf16_matmul, monkeypatch):
    """bf16 / fp16 inputs (multiplied in bf16 or fp32): the backward writes dW block by block in the
    weight's dtype, with no fp32 [V, H] tensor at any point, and stays as accurate as the unfused path."""
    N, H, V = 40, 32, 1024
    h, w, y, _ = _inputs(N, H, V, dtype)
    y[3] = -100
    monkeypatch.setitem(
        tiled_cpu.TILE_BYTES["logprobs"], "cpu", N * 128 * tile_elem_bytes(dtype, entropy=True)
    )
    spy = LargestFp32Tensor()
    with spy:  # no kept logits either (the tight budget; the budget is tested on its own)
        got = _run(fused_logprobs, h, w, y, impl="torch", memory_budget=0)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    assert 0 < spy.largest <= V * H // 4, f"an fp32 tensor of {spy.largest} elements (V x H = {V * H})"
    ref, unfused = _ref64(h, w, y), _run(fused_logprobs_reference, h, w, y)
    for name, f, u, r in zip(NAMES, got, unfused, ref):
        assert_as_accurate(f, u, r, atol=1e-5, rtol=1e-5, what=f"{dtype} {name}")


def _property_case(N, H, V, scale, per_token, ignore_frac, neg_inf, seed):
    h, w, y, b = _inputs(N, H, V, torch.float32, seed=seed, scale=scale, bias=True)
    gen = torch.Generator().manual_seed(seed + 1)
    if neg_inf and V > 1:  # mask part of the vocabulary with -inf, keeping the targets allowed
        banned = torch.rand(V, generator=gen) < 0.3
        banned[y] = False
        b[banned] = float("-inf")
    y[torch.rand(N, generator=gen) < ignore_frac] = -100
    t = torch.rand(N, generator=gen) * 2 + 0.25 if per_token else 1.3
    return h, w, y, b, t


PROPERTY = dict(
    N=st.integers(1, 9),
    H=st.integers(1, 9),
    V=st.integers(1, 70),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
    per_token=st.booleans(),
    ignore_frac=st.sampled_from([0.0, 0.5, 1.0]),
    neg_inf=st.booleans(),
    seed=st.integers(0, 10_000),
)


KEEP_BYTES = st.sampled_from([0, 4 * 9 * 20, None])  # recompute all, some columns or rows, keep all


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk=st.integers(1, 8), tile=st.sampled_from([0, 8, 96, 1000]), keep=KEEP_BYTES, **PROPERTY)
def test_property_matches_fp64(N, H, V, chunk, tile, keep, scale, per_token, ignore_frac, neg_inf, seed):
    _check_torch_case(N, H, V, chunk, tile, scale, per_token, ignore_frac, neg_inf, seed, keep)


def _check_torch_case(N, H, V, chunk, tile, scale, per_token, ignore_frac, neg_inf, seed, keep=None):
    """The torch backend is finite and as accurate as unfused fp32 against fp64, values and gradients."""
    h, w, y, b, t = _property_case(N, H, V, scale, per_token, ignore_frac, neg_inf, seed)
    ref = _ref64(h, w, y, b, temperature=t)
    with _tile_bytes(tile):
        budget = _budget(keep, h, V)
        got = _run(
            fused_logprobs, h, w, y, b, temperature=t, impl="torch", chunk_size=chunk, memory_budget=budget
        )
    unf = _run(fused_logprobs_reference, h, w, y, b, temperature=t)
    for name, g, u, r in zip(NAMES, got, unf, ref):
        assert torch.isfinite(g).all(), name
        assert_as_accurate(g, u, r, atol=1e-4, rtol=1e-5, what=name)


@pytest.mark.parametrize(
    "case",
    [  # (N, H, V, chunk, tile, scale, per_token, ignore_frac, neg_inf, seed): logits / T in the thousands
        (7, 7, 65, 6, 8, 30.0, True, 0.0, True, 5169),
        (2, 4, 59, 4, 1000, 30.0, True, 0.5, False, 2209),
        (8, 3, 45, 7, 8, 30.0, True, 0.5, False, 9403),
    ],
)
def test_huge_logits_at_low_temperature_keep_fp32_accuracy(case):
    """z / T ~ 1e3: the backward shifts the logits by the row max and by log sum exp(z - max) one after the
    other; shifting by their fp32 sum (lse, rounded at 1e3) made dW up to 100x less accurate than unfused."""
    _check_torch_case(*case)


@needs_triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keep=KEEP_BYTES, **PROPERTY)
def test_property_triton_matches_fp64(N, H, V, keep, scale, per_token, ignore_frac, neg_inf, seed):
    h, w, y, b, t = _property_case(N, H, V, scale, per_token, ignore_frac, neg_inf, seed)
    ref = _ref64(h, w, y, b, temperature=t)
    dev = triton_device()
    tt = t.to(dev) if isinstance(t, torch.Tensor) else t
    got = _run(
        fused_logprobs,
        h.to(dev),
        w.to(dev),
        y.to(dev),
        b.to(dev),
        temperature=tt,
        impl="triton",
        chunk_size=4,
        memory_budget=_budget(keep, h, V, impl="triton", chunk=4),
    )
    unf = _run(fused_logprobs_reference, h, w, y, b, temperature=t)
    for name, g, u, r in zip(NAMES, got, unf, ref):
        assert torch.isfinite(g).all(), name
        assert_as_accurate(g.cpu(), u, r, atol=1e-4, rtol=1e-5, what=name)


PRODUCTS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)


class CountProducts(TorchDispatchMode):
    """Counts the matrix products (mm, addmm) run inside the context, and the largest tensor made."""

    def __init__(self):
        super().__init__()
        self.products = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func.overloadpacket in PRODUCTS
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_kept_logits_skip_the_recomputation(impl):
    """Kept logits replace the backward's product of each kept tile (2 products per tile, not 3), give the
    same values and gradients, and stay within their budget; half a budget keeps part of them."""
    N, H, V = 16, 8, 1280
    dev = "cpu" if impl == "torch" else triton_device()
    h, w, y, b = _inputs(N, H, V, torch.float32, bias=True, device=dev)
    y[4] = -100
    h, w = h.requires_grad_(True), w.requires_grad_(True)
    chunk = 5 if impl == "triton" else None  # 3 chunks of the 15 active rows
    runs = {}
    for keep in (0, 15 * V * 4 // 2, 15 * V * 4):
        with _tile_bytes(15 * 256 * 8):  # 5 vocabulary blocks of 256 columns (torch)
            budget = _budget(keep, h, V, n=15, impl=impl, chunk=chunk)
            lp, ent = fused_logprobs(
                h, w, y, bias=b, temperature=0.8, impl=impl, chunk_size=chunk, memory_budget=budget
            )
            counter = CountProducts()
            with counter:
                grads = torch.autograd.grad((lp * 0.3 - ent).sum(), (h, w))
        runs[keep] = (lp, ent, *grads, counter)
    tiles = 5 if impl == "torch" else 3
    products = [run[-1].products for run in runs.values()]
    assert products[0] > products[1] > products[2] == 2 * tiles  # dh and dW of each tile
    if impl == "torch":
        assert products[0] == 3 * tiles
    for keep, run in runs.items():
        for name, got, want in zip(NAMES, run[:4], runs[0][:4]):
            assert_close(got.cpu(), want.cpu(), atol=1e-6, rtol=1e-6, what=f"keep {keep} {name}")
    # no more than the budget, and nothing at all without a gradient to compute
    for grad_mode in (True, False):
        counter = CountProducts()
        with _tile_bytes(15 * 256 * 8), counter, torch.set_grad_enabled(grad_mode):
            budget = _budget(15 * V * 2, h, V, n=15, impl=impl, chunk=chunk)
            fused_logprobs(h, w, y, bias=b, impl=impl, chunk_size=chunk, memory_budget=budget)
        limit = 15 * V * 2 if grad_mode else 15 * 256 * 8
        assert counter.largest <= max(limit, V * H * 4), (grad_mode, counter.largest)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_memory_budget_picks_three_products_or_the_tiles(dtype, cpu_bf16_matmul):
    """A budget that holds the tiles and every active token's products runs 3 products of N x H x V (the
    logits formed once); one byte less keeps all but a column, and a budget below the tiles runs the two
    passes alone (4 products); all of them give the same values and gradients, as accurate as unfused."""
    N, H, V = 24, 16, 512
    h, w, y, b = _inputs(N, H, V, dtype, bias=True)
    y[2] = -100  # 23 active tokens
    n = N - 1
    mm_bytes = tiled_cpu.tile_matmul_dtype(h).itemsize
    fits = tiled_cpu.tile_bytes(n, V, h, "logprobs") + n * V * mm_bytes
    assert tiled_cpu.kept_columns(n, V, h, "logprobs", fits) == V
    assert tiled_cpu.kept_columns(n, V, h, "logprobs", fits - 1) == V - 1
    assert tiled_cpu.kept_columns(n, V, h, "logprobs", 0) == 0
    madds = {}
    runs = {}
    for budget in (fits, 0):
        meter = CountMultiplyAdds()
        with meter:
            runs[budget] = _run(
                fused_logprobs, h, w, y, b, temperature=0.9, impl="torch", memory_budget=budget
            )
        madds[budget] = meter.madds / (n * H * V)
    assert madds == {fits: 3, 0: 4}
    ref, unf = (
        _ref64(h, w, y, b, temperature=0.9),
        _run(fused_logprobs_reference, h, w, y, b, temperature=0.9),
    )
    for name, one, two, u, r in zip(NAMES, runs[fits], runs[0], unf, ref):
        assert_close(one, two, atol=0, rtol=0, what=f"{dtype} {name}: the same products kept or recomputed")
        assert_as_accurate(one, u, r, atol=1e-5, rtol=1e-5, what=f"{dtype} {name}")


class CountMultiplyAdds(TorchDispatchMode):
    """The multiply-adds of the matrix products (mm, addmm) run inside the context."""

    def __init__(self):
        super().__init__()
        self.madds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in PRODUCTS:
            a, bm = args[-2:]
            self.madds += a.shape[0] * a.shape[1] * bm.shape[1]
        return func(*args, **(kwargs or {}))


def test_validation_errors_name_the_argument():
    h, w, y, b = _inputs(4, 8, 10, torch.float32, bias=True)
    cases = [
        (dict(hidden=h[0]), "hidden"),
        (dict(weight=w[:, :3]), "weight"),
        (dict(weight=w.double()), "weight"),
        (dict(targets=y[:2]), "targets"),
        (dict(targets=y.float()), "targets"),
        (dict(bias=b[:3]), "bias"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=torch.ones(3)), "temperature"),
        (dict(temperature=-torch.ones(4)), "temperature"),
        (dict(hidden=torch.full_like(h, float("nan"))), "hidden"),
        (dict(weight=torch.full_like(w, float("inf"))), "weight"),
        (dict(bias=torch.full_like(b, float("nan"))), "bias"),
        (dict(impl="cuda-magic"), "impl"),
        (dict(memory_budget=-1), "memory_budget"),
        (dict(memory_budget=1.5), "memory_budget"),
        (dict(memory_budget="1GiB"), "memory_budget"),
        (dict(memory_budget=True), "memory_budget"),
        (dict(memory_budget=float("inf")), "memory_budget"),
    ]
    for over, name in cases:
        args = dict(hidden=h, weight=w, targets=y, bias=b)
        args.update(over)
        kw = {k: args.pop(k) for k in list(args) if k not in ("hidden", "weight", "targets")}
        with pytest.raises(ValueError, match=name):
            fused_logprobs(args["hidden"], args["weight"], args["targets"], **kw)
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        with pytest.raises(ValueError, match="targets"):
            fused_logprobs(h, w, y.cuda())


def test_env_var_forces_path(monkeypatch):
    h, w, y, _ = _inputs(5, 4, 9, torch.float32)
    monkeypatch.setenv("BITRL_KERNEL_IMPL", "reference")
    lp_ref, _ = fused_logprobs(h, w, y)
    monkeypatch.setenv("BITRL_KERNEL_IMPL", "torch")
    lp_t, _ = fused_logprobs(h, w, y)
    assert_close(lp_t, lp_ref, atol=1e-5)
    monkeypatch.setenv("BITRL_KERNEL_IMPL", "bogus")
    with pytest.raises(ValueError, match="BITRL_KERNEL_IMPL"):
        fused_logprobs(h, w, y)


@needs_triton
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_triton_matches_torch_path(dtype, monkeypatch):
    monkeypatch.setattr(triton_rows, "BLOCK_V_MAX", 16)  # 45 = 2 full vocabulary tiles + a ragged one
    dev = triton_device()
    N, H, V = 9, 16, 45  # V not a multiple of the block
    h, w, y, b = _inputs(N, H, V, dtype, bias=True, device=dev)
    b[3] = float("-inf")
    y[2] = -100
    t = (torch.rand(N) + 0.5).to(dev)
    ref = _ref64(h.cpu(), w.cpu(), y.cpu(), b.cpu(), temperature=t.cpu())
    unf = _run(fused_logprobs_reference, h, w, y, b, temperature=t)
    tri = _run(fused_logprobs, h, w, y, b, temperature=t, impl="triton", chunk_size=4)
    for name, g, u, r in zip(NAMES, tri, unf, ref):
        assert_as_accurate(g.cpu(), u.cpu(), r, atol=2e-5, rtol=2e-5, what=f"triton {dtype} {name}")


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("where", ["hidden row", "hidden element", "weight row"])
def test_nan_input_shows_in_the_outputs_or_raises(impl, where, monkeypatch):
    """A NaN input is never clamped away: with the check it raises naming the input; without it the rows it
    reaches (one for a hidden state, all for a vocabulary row of the weight) get NaN log-prob and entropy,
    the others stay finite, and the weight gradient carries the NaN."""
    monkeypatch.setattr(triton_rows, "BLOCK_V_MAX", 16)  # several vocabulary tiles per row
    dev = triton_device() if impl == "triton" else "cpu"
    h, w, y, _ = _inputs(5, 8, 45, torch.float32, device=dev)
    h, w = h.detach().clone(), w.detach().clone()
    if where == "hidden row":
        h[2] = float("nan")
    elif where == "hidden element":
        h[2, 3] = float("nan")
    else:
        w[7] = float("nan")
    with pytest.raises(ValueError, match="hidden|weight"):
        fused_logprobs(h, w, y, impl=impl)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fused_logprobs(hh, ww, y, impl=impl, check_finite=False)
    reached = torch.zeros(5, dtype=torch.bool, device=lp.device)
    reached[2 if where.startswith("hidden") else slice(None)] = True
    assert torch.isnan(lp[reached]).all() and torch.isnan(ent[reached]).all(), (lp, ent)
    assert torch.isfinite(lp[~reached]).all() and torch.isfinite(ent[~reached]).all()
    (lp.sum() + ent.sum()).backward()
    assert torch.isnan(ww.grad).any()


def test_fp64_is_computed_in_fp64_never_in_the_fp32_kernels():
    """The Triton row kernels compute in fp32: fp64 inputs take the torch path by default (on CUDA too), and
    asking for the kernels with fp64 is an error naming why."""
    from bitrl.kernels._common import resolve_impl

    cuda = torch.device("cuda")
    assert resolve_impl(None, cuda, op="fused_logprobs", dtype=torch.float64) == "torch"
    h, w, y, _ = _inputs(3, 4, 7, torch.float64)
    with pytest.raises(ValueError, match="fp64"):
        fused_logprobs(h, w, y, impl="triton")
    from bitrl.kernels import fused_linear_policy_loss, policy_loss

    lp = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp64"):
        policy_loss(lp, lp, torch.ones(2, dtype=torch.float64), torch.ones(2, 3), impl="triton")
    with pytest.raises(ValueError, match="fp64"):
        fused_linear_policy_loss(
            h.view(1, 3, 4), w, y.view(1, 3), lp[:1], torch.ones(1, dtype=torch.float64), impl="triton"
        )


@needs_triton
def test_triton_n1_and_entropy_unused():
    dev = triton_device()
    h, w, y, _ = _inputs(1, 4, 7, torch.float32, device=dev)
    ref = _ref64(h.cpu(), w.cpu(), y.cpu(), use_entropy=False)
    tri = _run(fused_logprobs, h, w, y, impl="triton", use_entropy=False)
    for name, g, r in zip(NAMES, tri, ref):
        if r is not None:
            assert_close(g.cpu(), r, atol=1e-5, rtol=1e-5, what=name)


def test_triton_forced_without_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w, y, _ = _inputs(2, 4, 5, torch.float32)
    with pytest.raises(RuntimeError, match="triton"):
        fused_logprobs(h, w, y, impl="triton")


@needs_triton
def test_triton_gradient_written_in_low_precision_buffer():
    """On a GPU the row kernel writes d logits straight into a bf16 buffer for the next matmuls."""
    dev = triton_device()
    g = torch.Generator().manual_seed(0)
    c, V = 5, 37
    z = torch.randn(c, V, generator=g).to(dev)
    y = torch.randint(0, V, (c,), generator=g).to(dev)
    inv_t = torch.full((c,), 1.25, device=dev)
    valid = torch.ones(c, dtype=torch.bool, device=dev)
    lp, ent, stats = triton_rows.row_stats_triton(z, y, inv_t, valid, True)
    g_lp, g_ent = torch.randn(c, generator=g).to(dev), torch.randn(c, generator=g).to(dev)
    out = torch.empty(c, V, dtype=torch.bfloat16, device=dev)
    low = triton_rows.row_grad_triton(z, y, inv_t, stats, g_lp, g_ent, out=out)
    full = triton_rows.row_grad_triton(z.clone(), y, inv_t, stats, g_lp, g_ent)
    assert low.dtype == torch.bfloat16 and low.data_ptr() == out.data_ptr()
    assert_close(low.float().cpu(), full.cpu(), atol=1e-6, rtol=1e-2)


def test_wrong_device_names_the_argument():
    h, w, y, b = _inputs(4, 8, 10, torch.float32, bias=True)
    with pytest.raises(ValueError, match="targets"):
        fused_logprobs(h, w, y.to("meta"))
    with pytest.raises(ValueError, match="weight"):
        fused_logprobs(h, w.to("meta"), y)
    with pytest.raises(ValueError, match="bias"):
        fused_logprobs(h, w, y, bias=b.to("meta"))
