"""The counter-based fused sampler: Philox, the reference semantics, the torch and Triton paths."""

import math
import shutil

import pytest
import torch
from conftest import fp32_sum_bound
from test_kernels_helpers import triton_device

from bitrl.kernels._common import triton_unavailable_reason
from bitrl.kernels.sampling import (
    fused_sample,
    fused_sample_reference,
    philox4x32,
    sample_seeds,
    sampling_uniforms,
)

TRITON_SKIP = triton_unavailable_reason(torch.device("cpu"))
needs_triton = pytest.mark.skipif(TRITON_SKIP is not None, reason=f"Triton path: {TRITON_SKIP}")
# The Triton sampler against the reference runs compiled on a GPU where there is one (the engine's sampler
# there), else under the interpreter.
TRITON_DEVICE = triton_device()
DEVICE_SKIP = triton_unavailable_reason(TRITON_DEVICE)
needs_triton_device = pytest.mark.skipif(DEVICE_SKIP is not None, reason=f"Triton path: {DEVICE_SKIP}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_philox_known_answers():
    """Random123's known-answer vectors for philox4x32-10."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in cases:
        got = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert [int(w) for w in got] == list(want)


def test_uniforms_layout_range_and_independence_of_the_batch():
    seeds = torch.tensor([5, -3, 2**62 + 7])  # negative: the high word of the seed is its two's complement
    positions = torch.tensor([0, 9, 2**33 + 1])
    u = sampling_uniforms(seeds, positions, 11)
    assert u.shape == (3, 11) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    # lane v % 4 of counter v // 4, key = the seed's two words, counter words 1-2 = the position
    s, p = 2**62 + 7, 2**33 + 1
    x = philox4x32((torch.tensor([2]), p & 0xFFFFFFFF, p >> 32, 0), (s & 0xFFFFFFFF, s >> 32))
    assert u[2, 9] == ((x[1] >> 8).float() + 0.5) * 2.0**-24
    # a row's numbers do not depend on the other rows
    torch.testing.assert_close(sampling_uniforms(seeds[1:2], positions[1:2], 11), u[1:2], rtol=0, atol=0)
    # the top of the range is capped below 1 (fp32 would round 2^24 - 0.5 up to 2^24)
    assert ((torch.tensor([2**24 - 1]).float() + 0.5) * 2.0**-24).item() == 1.0


def test_sample_seeds():
    ids = torch.tensor([0, 1, 2, 1, 2**40])
    a = sample_seeds(123, ids)
    assert a.dtype == torch.int64 and a[1] == a[3] and len(set(a.tolist())) == 4
    assert not torch.equal(sample_seeds(124, ids), a)
    assert torch.equal(sample_seeds(123, ids[[4, 0]]), a[[4, 0]])


def _random_case(seed, rows, vocab, dtype, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if ties:
        logits = logits.round()  # many exact ties
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    positions = torch.randint(0, 2**40, (rows,), generator=g)
    return logits.to(dtype), seeds, positions


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 12, 0.5), (0.5, 3, 0.95)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_torch_path_equals_the_reference(dtype, temperature, top_k, top_p):
    for seed, ties in [(0, False), (1, True)]:
        logits, seeds, positions = _random_case(seed, 16, 97, dtype, ties)
        args = (logits, seeds, positions, temperature, top_k, top_p)
        tok, lp = fused_sample(*args, impl="torch")
        ref_tok, ref_lp = fused_sample_reference(*args)
        assert torch.equal(tok, ref_tok)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_draws_only_near_the_top_yet_like_the_reference(dtype):
    """Logits spread like a language model's (most of the vocabulary tens of nats below the top): the torch
    path draws uniforms for the few tokens that can still win, and its draws stay the reference's exactly."""
    from bitrl.kernels.sampling import GUMBEL_MAX

    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(64, 3000, generator=g) * 12).to(dtype)
    logits[:8, :100] = float("-inf")
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=g)
    for temperature, top_k in [(1.0, 0), (0.7, 0), (1.0, 40)]:
        z = logits.float() / temperature
        near = (z >= z.max(-1, keepdim=True).values - (GUMBEL_MAX + 3)).float().mean()
        assert near < 0.1  # the case does exercise the pruning
        for position in (0, 2**33 + 5):
            positions = torch.full((64,), position)
            args = (logits, seeds, positions, temperature, top_k, 1.0)
            tok, lp = fused_sample(*args, impl="torch")
            ref_tok, ref_lp = fused_sample_reference(*args)
            assert torch.equal(tok, ref_tok)
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)


def test_the_reference_fits_a_real_vocabulary():
    """Top-p at Qwen's vocabulary (V = 151936): the reference runs in O(V) memory per row (a pairwise
    [V, V] formulation would need ~100 GB), and agrees with the torch path."""
    from bitrl.kernels.bench_stats import rss_growth_mib

    logits, seeds, positions = _random_case(3, 2, 151936, torch.float32)
    args = (logits, seeds, positions, 0.7, 0, 0.9)
    peak_mib, _ = rss_growth_mib(lambda: fused_sample_reference(*args))
    assert peak_mib < 64, peak_mib
    tok, lp = fused_sample(*args, impl="torch")
    ref_tok, ref_lp = fused_sample_reference(*args)
    assert torch.equal(tok, ref_tok)
    # log-probs: each path's log-sum-exp adds ~1e5 kept terms in fp32, in its own order
    assert ((lp - ref_lp).abs() <= fp32_sum_bound(logits.shape[-1], 1.0)).all()


def test_uniforms_at_equal_the_full_table():
    from bitrl.kernels.sampling import uniforms_at

    seeds, positions = torch.tensor([3, -(2**60), 2**40 + 1]), torch.tensor([0, 7, 2**35])
    table = sampling_uniforms(seeds, positions, 37)
    row = torch.tensor([0, 0, 1, 2, 2, 2])
    token = torch.tensor([0, 36, 5, 1, 2, 3])
    assert torch.equal(uniforms_at(seeds[row], positions[row], token), table[row, token])


@pytest.mark.parametrize("vocab", [1, 3, 4, 5, 63, 64, 65, 1031])
def test_compiled_philox_equals_the_torch_formula(vocab):
    """The CPU draw runs csrc/sampler_host.cc; its uniforms are the torch formula's, bit for bit."""
    from bitrl.kernels import host_ext, sampling

    if host_ext.load_host_library() is None:
        pytest.skip("no C++ compiler here (or BITRL_HOST_EXT=0): the CPU draw uses the torch formula")
    seeds = torch.tensor([0, -1, -(2**63), 2**63 - 1, 12345, -(2**40) + 3])
    positions = torch.tensor([0, 2**32 - 1, 2**32, 2**62 + 9, 7, 1])
    table = sampling.sampling_uniforms(seeds, positions, vocab)
    assert torch.equal(table, sampling._sampling_uniforms_torch(seeds, positions, vocab))
    assert sampling.sampling_uniforms(seeds[:0], positions[:0], vocab).shape == (0, vocab)
    row = torch.arange(6).repeat_interleave(3)
    token = torch.randint(0, vocab, (18,), generator=torch.Generator().manual_seed(vocab))
    at = sampling.uniforms_at(seeds[row], positions[row], token)
    assert torch.equal(at, sampling._uniforms_at_torch(seeds[row], positions[row], token))


def test_the_host_candidates_hold_the_formulas_winner():
    """The CPU draw scores only the tokens the host library names (approximate keys within a margin of the
    best): on flat rows (every token can win), peaked and tied rows, masks, huge logits and a real vocabulary
    its token is the full formula's; a row with NaN goes the plain way and its NaN shows."""
    from bitrl.kernels import host_ext, sampling

    if host_ext.load_host_library() is None:
        pytest.skip("no C++ compiler here (or BITRL_HOST_EXT=0): the CPU draw uses the torch formula")
    g = torch.Generator().manual_seed(11)
    cases = []
    for vocab, scale in [(49152, 0.3), (49152, 4.0), (5000, 1e4), (97, 1.0), (64, 0.0), (1, 1.0), (65, 30.0)]:
        z = torch.randn(16, vocab, generator=g) * scale
        cases += [z, z.round()]  # the rounded copy: ties everywhere
        masked = z.clone()
        masked[torch.rand(z.shape, generator=g) < 0.5] = float("-inf")
        masked[:, vocab // 2] = 0.0
        cases.append(masked)
    for z in cases:
        seeds = torch.randint(-(2**62), 2**62, (z.shape[0],), generator=g)
        positions = torch.randint(0, 2**40, (z.shape[0],), generator=g)
        full = z - torch.log(-torch.log(sampling.sampling_uniforms(seeds, positions, z.shape[1])))
        tokens, lse = sampling._gumbel_argmax(z, seeds, positions)
        assert torch.equal(tokens, full.argmax(-1))
        torch.testing.assert_close(lse, torch.logsumexp(z.double(), -1).float(), rtol=2e-6, atol=2e-6)
    z = torch.randn(3, 300, generator=g)
    z[1, 7] = float("nan")
    tok, lp = fused_sample(z, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    assert lp[1].isnan() and lp[[0, 2]].isfinite().all()


def test_the_torch_formula_runs_where_the_host_library_is_off(monkeypatch):
    from bitrl.kernels import host_ext, sampling

    monkeypatch.setenv("BITRL_HOST_EXT", "0")
    assert host_ext.load_host_library() is None
    seeds, positions = torch.tensor([1, 2]), torch.tensor([3, 4])
    want = sampling._sampling_uniforms_torch(seeds, positions, 9)
    assert torch.equal(sampling.sampling_uniforms(seeds, positions, 9), want)


@pytest.mark.parametrize("broken", ["failing compiler", "sources missing"])
def test_a_broken_host_build_warns_once_and_falls_back(broken, tmp_path, monkeypatch):
    """No usable compiler (or an install without csrc/) costs one warning and the torch formula, never a
    crash: the draw is the same bits either way."""
    from bitrl.kernels import host_ext, sampling

    monkeypatch.setattr(host_ext, "_TRIED", False)
    monkeypatch.setattr(host_ext, "_LIB", None)
    monkeypatch.setenv("BITRL_CACHE", str(tmp_path / "cache"))  # nothing built before
    monkeypatch.delenv("BITRL_KERNEL_CACHE", raising=False)
    if broken == "failing compiler":
        monkeypatch.setenv("CXX", shutil.which("false"))
    else:
        monkeypatch.setattr(host_ext, "CSRC", tmp_path / "no-csrc")
    with pytest.warns(UserWarning, match="host C[+][+] helpers unavailable") as caught:
        assert host_ext.load_host_library() is None
        seeds, positions = torch.tensor([5, 6]), torch.tensor([7, 8])
        table = sampling.sampling_uniforms(seeds, positions, 11)
    assert len(caught) == 1
    assert torch.equal(table, sampling._sampling_uniforms_torch(seeds, positions, 11))


# The interpreter is slow: every setting in fp32, the filtered ones in bf16 / fp16, one multi-tile vocabulary.
TRITON_CASES = [(torch.float32, *s) for s in SETTINGS] + [
    (dtype, *s) for dtype in DTYPES[1:] for s in (SETTINGS[1], SETTINGS[3])
]


@needs_triton_device
@pytest.mark.parametrize("dtype,temperature,top_k,top_p", TRITON_CASES)
def test_triton_kernel_equals_the_reference(dtype, temperature, top_k, top_p):
    shapes = [(0, (6, 97), False), (2, (6, 64), True)]
    if top_k == 12:
        shapes.append((1, (2, 5000), False))
    for seed, (rows, vocab), ties in shapes:
        logits, seeds, positions = _random_case(seed, rows, vocab, dtype, ties)
        args = (logits, seeds, positions, temperature, top_k, top_p)
        on = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        tok, lp = fused_sample(*on, impl="triton")
        ref_tok, ref_lp = fused_sample_reference(*args)
        assert torch.equal(tok.cpu(), ref_tok)
        torch.testing.assert_close(lp.cpu(), ref_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(TRITON_DEVICE.type != "cuda", reason="needs a CUDA device (the compiled Triton sampler)")
def test_triton_sampler_at_a_real_vocabulary_on_cuda():  # pragma: no cover - GPU only
    """The engine's sampler on a GPU at Qwen's vocabulary (many tiles per row): the reference's tokens (fp32
    masses summed in another order may move a top-p boundary, rarely), the same bits on every call."""
    logits, seeds, positions = _random_case(4, 64, 151936, torch.bfloat16)
    for t, top_k, top_p in [(1.0, 0, 1.0), (0.7, 50, 0.9), (1.0, 0, 0.9)]:
        args = (logits, seeds, positions, t, top_k, top_p)
        tok, lp = fused_sample(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], impl="triton")
        again = fused_sample(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], impl="triton")
        assert torch.equal(tok, again[0]) and torch.equal(lp, again[1])
        ref_tok, ref_lp = fused_sample_reference(*args)
        same = tok.cpu() == ref_tok
        assert same.float().mean() >= 0.97, same.float().mean()
        torch.testing.assert_close(lp.cpu()[same], ref_lp[same], atol=1e-4, rtol=1e-4)


def _filtered_softmax(logits, temperature, top_k, top_p):
    """The kept support and its renormalised probabilities, from sorted cumulative masses (no ties in the
    logits this is used with, so 'strictly more likely' is 'earlier in the sorted order')."""
    z = logits.double() / temperature
    order = torch.argsort(z, descending=True)
    keep = torch.zeros_like(z, dtype=torch.bool)
    n = len(z) if not (0 < top_k < len(z)) else top_k
    p = torch.softmax(z[order[:n]], -1)
    mass_before = p.cumsum(-1) - p
    keep[order[:n][mass_before < top_p]] = True
    probs = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
    return keep, probs


CHI2_SETTINGS = [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.5, 0, 0.7), (1.0, 3, 0.9)]


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("temperature,top_k,top_p", CHI2_SETTINGS)
def test_sampled_frequencies_match_the_filtered_softmax(impl, temperature, top_k, top_p):
    """Many draws (distinct seeds, one logits row): chi-square against the filtered softmax."""
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -2.0])
    n = 40000 if impl == "torch" else 4000
    seeds = sample_seeds(7, torch.arange(n))
    tokens, logps = fused_sample(
        logits.expand(n, -1), seeds, torch.zeros(n, dtype=torch.long), temperature, top_k, top_p, impl=impl
    )
    keep, expected = _filtered_softmax(logits, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=6).double()
    assert (counts[~keep] == 0).all()
    chi2 = (((counts - n * expected) ** 2) / (n * expected))[keep].sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, chi2
    torch.testing.assert_close(logps, expected.log()[tokens].float())


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_frequencies_over_positions(impl):
    """Draws along the position counter of one seed: chi-square on a 6-token vocabulary. The Triton kernel
    runs 120 positions (each program takes ~0.15 s under the interpreter) and must draw exactly what the
    torch path draws at them."""
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -2.0])
    n = 3000 if impl == "torch" else 120
    args = (logits.expand(n, -1), torch.full((n,), 11), torch.arange(n), 1.0, 0, 0.9)
    tokens, logps = fused_sample(*args, impl=impl)
    if impl == "triton":
        ref_tokens, ref_logps = fused_sample(*args, impl="torch")
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logps, ref_logps, atol=1e-6, rtol=1e-6)
        return
    keep, expected = _filtered_softmax(logits, 1.0, 0, 0.9)
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = (((counts - n * expected) ** 2) / (n * expected))[keep].sum().item()
    assert (counts[~keep] == 0).all() and chi2 < 30, chi2


IMPLS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", IMPLS)
def test_hostile_rows(impl):
    V = 40
    ninf = float("-inf")
    rows = torch.zeros(6, V)
    rows[0] = ninf
    rows[0, 17] = 3.0  # one finite entry: always drawn, log-prob 0
    rows[1] = torch.linspace(-1e30, 1e30, V)  # huge logits: the largest has all the mass
    rows[2] = 1.0  # all tied: top-p keeps the whole tie group, log-prob -log V
    rows[3, :4] = 5.0  # a four-way tie on top
    rows[4] = torch.arange(V).float()
    rows[5] = ninf
    rows[5, [3, 30]] = -1e4
    seeds, positions = torch.arange(6) * 1000 + 1, torch.arange(6)
    for top_k, top_p in [(0, 1.0), (V + 5, 1.0), (0, 1e-6), (2, 1e-6)]:
        tok, lp = fused_sample(rows, seeds, positions, 1.0, top_k, top_p, impl=impl)
        assert torch.isfinite(lp).all() and (lp <= 0).all()
        assert tok[0] == 17 and lp[0] == 0
        assert tok[1] == V - 1 and lp[1] == 0
        assert tok[4] == V - 1 or top_p == 1.0
        assert tok[5] in (3, 30)
        if top_k == 0:
            torch.testing.assert_close(lp[2], torch.tensor(-math.log(V)))
        assert tok[3] < 4 or (top_k == 0 and top_p == 1.0 and tok[3] >= 0)
        if top_p < 1:
            torch.testing.assert_close(lp[3], torch.tensor(-math.log(4.0)))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_rows_draw_does_not_depend_on_its_batch(impl):
    logits, seeds, positions = _random_case(3, 8, 50, torch.float32)
    tok, lp = fused_sample(logits, seeds, positions, 1.0, 0, 0.9, impl=impl)
    perm = torch.tensor([5, 2, 7])
    tok2, lp2 = fused_sample(logits[perm], seeds[perm], positions[perm], 1.0, 0, 0.9, impl=impl)
    assert torch.equal(tok2, tok[perm])
    torch.testing.assert_close(lp2, lp[perm], atol=1e-6, rtol=0)
    other, _ = fused_sample(logits, seeds, positions + 1, 1.0, 0, 0.9, impl=impl)
    assert not torch.equal(other, tok)


def test_greedy_and_validation():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    one = torch.zeros(1, dtype=torch.long)
    tok, lp = fused_sample(logits, one, one, 0.0)
    assert tok.tolist() == [1] and lp.tolist() == [0.0]
    for kwargs, msg in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ]:
        with pytest.raises(ValueError, match=msg):
            fused_sample(logits, one, one, **kwargs)
    with pytest.raises(ValueError, match="seeds"):
        fused_sample(logits, one.int(), one)
    with pytest.raises(ValueError, match="positions"):
        fused_sample(logits, one, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        fused_sample(logits.long(), one, one)
    with pytest.raises(ValueError, match="impl"):
        fused_sample(logits, one, one, impl="cuda-graph")
