"""The host C++ softmax passes of bf16 tiles (csrc/softmax_tile_host.cc) against the formulas in fp64.

``host_tile_stats`` folds one vocabulary block into the running (max, sum exp, sum exp * shift) of each row;
``host_tile_grad`` writes p (a log p + b) + c onehot over the tile in bf16. The engine's use of them (both
passes of ``TiledLinearSoftmax`` on bf16 GEMMs) is tested end to end through the ``cpu_bf16_matmul`` fixture
of the fused-op tests."""

import pytest
import torch

from bitrl.kernels import host_ext
from bitrl.kernels.fused_logprobs.host_tiles import host_tile_grad, host_tile_stats
from bitrl.kernels.fused_logprobs.numerics import NEG_LOGIT


@pytest.fixture
def lib():
    lib = host_ext.load_host_library()
    if lib is None:
        pytest.skip("no C++ compiler here (or BITRL_HOST_EXT=0): bf16 tiles use the torch formula")
    return lib


def _tile(c, w, ld, scale, seed):
    """A [c, w] bf16 view with row stride ld, logits of spread ``scale``; one row constant, one huge."""
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(c, ld, generator=g) * scale).bfloat16()
    buf[0, :w] = 3.0
    if c > 2:
        buf[2, :w] += 2.0e4  # |z| ~ 2e4: the shift must come before any rounding of its size
    return buf[:, :w]


def _stats64(x):
    """(max, sum exp(x - max), sum exp(x - max) (x - max)) per row, fp64."""
    m = x.amax(1)
    d = x - m[:, None]
    e = d.exp()
    return m, e.sum(1), (e * d).sum(1)


@pytest.mark.parametrize("c,w", [(1, 1), (3, 15), (5, 16), (7, 17), (33, 100), (64, 2500)])
@pytest.mark.parametrize("temperature", [None, "per-row"])
def test_stats_over_two_blocks_match_the_formula(lib, c, w, temperature):
    g = torch.Generator().manual_seed(c * w)
    blocks = [_tile(c, w, w + 3, 4.0, seed) for seed in (1, 2)]
    blocks[1][1 % c] -= 30.0  # the max moves between blocks in some rows and not in others
    inv_t = None if temperature is None else (0.5 + torch.rand(c, generator=g)).float()
    m = torch.full((c,), NEG_LOGIT)
    s, t = torch.zeros(c), torch.zeros(c)
    for z in blocks:
        host_tile_stats(lib, z, inv_t, m, s, t)
    x = torch.cat([z.float() * (1.0 if inv_t is None else inv_t[:, None]) for z in blocks], 1)  # fp32 x
    rm, rs, rt = _stats64(x.double())
    assert torch.equal(m.double(), rm)  # the max of the fp32 products, exactly
    torch.testing.assert_close(s.double(), rs, rtol=2e-6, atol=0)
    # t sums terms of both signs: relative to the sum of their magnitudes
    scale = ((x.double() - rm[:, None]).exp() * (x.double() - rm[:, None]).abs()).sum(1)
    assert ((t.double() - rt).abs() <= 2e-6 * scale + 1e-30).all()


def test_stats_exponential_is_accurate_over_its_range(lib):
    """One column per row under a preset larger max: s becomes exp(x - m) itself, within |x - m| 2^-23
    (the roundings of log2 e and of the argument to base 2) and fp32 rounding, and 0 where it is below the
    smallest normal fp32 (the torch formula gives a denormal there)."""
    d = torch.linspace(-100.0, 0.0, 4001)
    x = (d + 7.0).bfloat16()
    d = x.float() - 7.0  # the exact shifts of the bf16 logits
    m, s = torch.full((d.numel(),), 7.0), torch.zeros(d.numel())
    host_tile_stats(lib, x[:, None], None, m, s)
    want = d.double().exp()
    normal = want >= torch.finfo(torch.float32).tiny
    # log2 e and x log2 e rounded to fp32 cost up to |x| 2^-23; the polynomial and the scaling under 2.5e-7
    excess = ((s.double() - want).abs() / want - d.double().abs() * 2.0**-23)[normal]
    assert excess.max() <= 2.5e-7, f"relative error {excess.max():.2e} beyond |x| 2^-23"
    assert (s[~normal] <= torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("c,w", [(1, 1), (4, 17), (9, 64), (40, 3000)])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [None, "per-row"])
def test_grad_matches_the_formula(lib, c, w, entropy, temperature):
    g = torch.Generator().manual_seed(c + w)
    z = _tile(c, w, w + 5, 3.0, 7)
    inv_t = None if temperature is None else (0.5 + torch.rand(c, generator=g)).float()
    x = z.double() * (1.0 if inv_t is None else inv_t.double()[:, None])
    m = x.amax(1)
    log_s = (x - m[:, None]).exp().sum(1).log()
    a = torch.randn(c, generator=g) if entropy else None
    b, ct = torch.randn(c, generator=g), torch.randn(c, generator=g)
    target = torch.randint(-1, w, (c,), generator=g)
    target[0] = w - 1  # the last column, and (for c > 1) some rows without a target in this block
    got = host_tile_grad(lib, z.clone(), inv_t, m.float(), log_s.float(), a, b, ct, target)

    logp = x - m[:, None] - log_s[:, None]
    want = logp.exp() * ((0.0 if a is None else a.double()[:, None]) * logp + b.double()[:, None])
    rows = (target >= 0).nonzero().squeeze(1)
    want[rows, target[rows]] += ct.double()[rows]
    # one bf16 rounding of the fp32 result: within one bf16 ulp of the exact value
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-30)
    err = (got.double() - want).abs()
    assert (err <= ulp).all(), f"worst error {(err / ulp).max():.2f} ulp"


def test_threads_give_the_same_bits(lib):
    """Rows split across threads (a tile large enough to be split, rows not a multiple of the threads)."""
    z = _tile(301, 1000, 1000, 5.0, 3)
    c = z.shape[0]
    outs = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            m, s, t = torch.full((c,), NEG_LOGIT), torch.zeros(c), torch.zeros(c)
            host_tile_stats(lib, z, None, m, s, t)
            dz = host_tile_grad(
                lib,
                z.clone(),
                None,
                m,
                s.log(),
                None,
                -torch.ones(c),
                torch.ones(c),
                torch.zeros(c, dtype=torch.int64),
            )
            outs.append((m, s, t, dz))
    finally:
        torch.set_num_threads(previous)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_bad_arguments_are_named(lib):
    z = torch.zeros(4, 8, dtype=torch.bfloat16)
    v = torch.zeros(4)
    with pytest.raises(ValueError, match="bf16"):
        host_tile_stats(lib, z.float(), None, v, v.clone())
    with pytest.raises(ValueError, match="unit column stride"):
        host_tile_stats(lib, z.t(), None, v, v.clone())
    with pytest.raises(ValueError, match="4 elements"):
        host_tile_stats(lib, z, None, torch.zeros(3), v)
    with pytest.raises(ValueError, match="contiguous"):
        host_tile_grad(lib, z, None, v, v, None, v, v, torch.zeros(8, dtype=torch.int64)[::2])
