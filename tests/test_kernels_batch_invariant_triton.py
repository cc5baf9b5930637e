"""The batch-invariant kernels (`bitrl.kernels.batch_invariant_triton`): the Triton matmul, RMSNorm, SiLU-mul
and row log-probs (interpreted on CPU, compiled on CUDA) against their fp64 references for fp32/bf16/fp16
inputs over random shapes and hostile values (NaN, inf, huge logits, -inf entries, ignored and out-of-range
targets); and the property the matched-precision mode needs: a row's bits are the same at M = 1, 7, 64 (and
100, a second row tile), at any position in its batch and beside any other rows (NaN rows included), and a
matmul column's bits the same in another column tile."""

import math

import pytest
import torch
from test_kernels_helpers import needs_triton, triton_device

from bitrl.kernels.batch_invariant_triton import (
    LOGPROBS_BLOCK_V,
    MATMUL_BLOCKS,
    RMS_BLOCK_H,
    invariant_matmul,
    invariant_matmul_reference,
    invariant_rms_norm,
    invariant_rms_norm_reference,
    invariant_row_logprobs,
    invariant_row_logprobs_reference,
    invariant_silu_mul,
    invariant_silu_mul_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one unit in the last place, relative to the value (its largest relative size: just above a power of two)
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}
ROW_COUNTS = (1, 7, 64, 100)  # 100: the probed rows fall in a second BLOCK_M = 64 tile too


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _assert_matches(out, ref, tol):
    """Same NaN positions, same infinities, finite values within `tol` (tensor or float) of the reference."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan()), (out, ref)
    inf = ref.isinf()
    assert torch.equal(out.isinf(), inf) and torch.equal(out[inf], ref[inf])
    ok = ~(ref.isnan() | inf)
    tol = torch.as_tensor(tol, dtype=torch.float64).expand(ref.shape)[ok]
    err = (out[ok].double() - ref[ok].double()).abs()
    assert bool((err <= tol).all()), f"max excess {float((err - tol).max()):.3e}"


def _wide(*shape, generator, dtype, device):
    """Normal values scaled by 2^-6 .. 2^6, so that a change of summation order shows in the bits."""
    scale = torch.exp2(torch.randint(-6, 7, shape, generator=generator).float())
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)


def _probe_batches(probes, make_filler, row_counts, seed):
    """For each row count M: (batch [M, ...], positions of the probe rows) with the probes at different
    positions among random filler rows, one of them NaN-filled (M >= 2)."""
    g = _gen(seed)
    n = probes.shape[0]
    for m in row_counts:
        if m == 1:
            for i in range(n):
                yield probes[i : i + 1], [0], [i]
            continue
        batch = make_filler(m, g)
        batch[int(torch.randint(0, m, (1,), generator=g))] = math.nan
        pos = torch.randperm(m, generator=g)[:n].tolist()
        batch[pos] = probes
        yield batch, pos, list(range(n))


# ------------------------------------------------------------------------------------------- matmul


def _matmul_tol(x, w, ref):
    """fp32 accumulation over K (K u_32 sum |x| |w|) plus one rounding to the output dtype."""
    k = x.shape[1]
    acc = k * 2**-24 * (x.double().abs() @ w.double().abs().T)
    return acc * (1 + ULP[x.dtype]) + ULP[x.dtype] * ref.double().abs() + 1e-30


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_matmul_matches_the_reference_on_random_shapes(dtype, seed):
    g = _gen(seed)
    m, k, n = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (90, 200, 300))
    dev = triton_device()
    x = torch.randn(m, k, generator=g).to(dtype).to(dev)
    w = torch.randn(n, k, generator=g).to(dtype).to(dev)
    ref = invariant_matmul_reference(x, w)
    _assert_matches(invariant_matmul(x, w), ref, _matmul_tol(x, w, ref))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_edge_shapes_and_strided_operands(dtype):
    dev = triton_device()
    g = _gen(1)
    for m, k, n in ((1, 1, 1), (3, 33, 129), (65, 64, 128), (2, 0, 5), (0, 8, 4)):
        x = torch.randn(m, k, generator=g).to(dtype).to(dev)
        w = torch.randn(n, k, generator=g).to(dtype).to(dev)
        ref = invariant_matmul_reference(x, w)
        _assert_matches(invariant_matmul(x, w), ref, _matmul_tol(x, w, ref))
    # row views of wider tensors and a transposed weight view: the same bits as contiguous copies
    x = torch.randn(9, 80, generator=g).to(dtype).to(dev)[:, 5:75]
    w = torch.randn(70, 40, generator=g).to(dtype).to(dev).T
    assert torch.equal(invariant_matmul(x, w), invariant_matmul(x.contiguous(), w.contiguous()))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_nan_and_inf_show_in_their_row_or_column_only(dtype):
    dev = triton_device()
    g = _gen(2)
    x = torch.randn(10, 40, generator=g).to(dtype)
    w = torch.randn(20, 40, generator=g).to(dtype)
    x[3, 7] = math.nan
    x[5, 0] = math.inf  # row 5: +-inf where w[:, 0] != 0
    w[11, 39] = math.nan
    x[8] *= 1e18 if dtype != torch.float16 else 3e3  # huge products (an fp32 overflow would be no
    # test: the fp64 reference sums past it)
    x, w = x.to(dev), w.to(dev)
    out, ref = invariant_matmul(x, w), invariant_matmul_reference(x, w)
    _assert_matches(out, ref, _matmul_tol(x.nan_to_num(), w.nan_to_num(), ref.nan_to_num()))
    nan = out.isnan()
    assert nan[3].all() and nan[:, 11].all()
    assert not nan[[0, 1, 2, 4, 6, 7, 9]][:, [j for j in range(20) if j != 11]].any()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_bits_depend_neither_on_the_batch_nor_on_the_row_or_column_position(dtype):
    dev = triton_device()
    g = _gen(3)
    k, n = 150, 90
    w = _wide(n, k, generator=g, dtype=dtype, device=dev)
    probes = _wide(3, k, generator=g, dtype=dtype, device=dev)
    # +2^20 from the first column and -2^20 from the last: the small products between are rounded to the
    # fp32 grid at 2^20 in an order the K tiles set, by more than a bf16 / fp16 output rounding hides
    probes[:, [0, -1]] = 1024.0
    w[:, 0], w[:, -1] = 1024.0, -1024.0
    alone = invariant_matmul(probes, w)
    counts = set()
    for batch, pos, which in _probe_batches(
        probes, lambda m, g: _wide(m, k, generator=g, dtype=dtype, device=dev), ROW_COUNTS, 4
    ):
        out = invariant_matmul(batch, w)
        assert torch.equal(out[pos], alone[which]), (batch.shape[0], pos)
        counts.add(batch.shape[0])
    assert counts == set(ROW_COUNTS)
    # the same columns in another column tile, at another position in it, beside other columns
    shift = MATMUL_BLOCKS[dtype][1] + 5
    wider = torch.cat([_wide(shift, k, generator=g, dtype=dtype, device=dev), w])
    assert torch.equal(invariant_matmul(probes, wider)[:, shift:], alone)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_is_exact_where_every_partial_sum_is(dtype):
    """Integer operands whose partial sums all fit in fp32's 24 bits: the kernel's result is the exact one,
    bit for bit, in any order. fp32 operands of 13 bits (up to 4096) also show IEEE fp32 dots: tf32 keeps 11
    bits and would round them."""
    dev = triton_device()
    g = _gen(5)
    top = {torch.float32: 4096, torch.bfloat16: 128, torch.float16: 256}[dtype]  # exact in the dtype
    x = torch.randint(-top, top + 1, (70, 130), generator=g).to(dtype).to(dev)
    w = torch.randint(-3, 4, (140, 130), generator=g).to(dtype).to(dev)
    if dtype == torch.float16:  # keep |sums| below fp16's 65504
        x, w = x[:, :64].contiguous(), w[:, :64].contiguous()
    assert torch.equal(invariant_matmul(x, w), invariant_matmul_reference(x, w))


# ----------------------------------------------------------------------------------------- RMSNorm


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_formula_bit_for_bit_where_the_sum_is_exact(dtype):
    """Integer rows (their sums of squares exact in any order): the output is the formula's fp32 steps,
    each IEEE-rounded (division and square root included), with y rounded to the dtype before the weight
    multiplies it; skipping that rounding gives other bits."""
    dev = triton_device()
    g = _gen(23)
    hidden = 1100  # two chunks
    x = torch.randint(-40, 41, (4, hidden), generator=g).to(dtype).to(dev)
    weight = (torch.rand(hidden, generator=g) * 3).to(dtype).to(dev)
    eps = 1e-5
    xf = x.float()
    ms = (xf * xf).sum(-1, keepdim=True) / hidden
    r = 1.0 / torch.sqrt(ms + torch.tensor(eps, dtype=torch.float32))
    y = (xf * r).to(dtype).float()
    out = invariant_rms_norm(x, weight, eps)
    assert torch.equal(out, (weight.float() * y).to(dtype))
    if dtype != torch.float32:
        assert not torch.equal(out, (weight.float() * (xf * r)).to(dtype))


def _rms_tol(ref):
    """y may round the other way (one ulp of y), then the output's own rounding; fp32: the sum's error."""
    rel = 2**-18 if ref.dtype == torch.float32 else 2 * ULP[ref.dtype]
    return rel * ref.double().abs() + 1e-30


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_rms_norm_matches_the_reference_on_random_shapes(dtype, seed):
    g = _gen(10 + seed)
    rows = int(torch.randint(1, 9, (1,), generator=g))
    hidden = [1, 37, 2500][seed]  # one element, one ragged chunk, three chunks of BLOCK_H
    weight_dtype = [dtype, torch.float32, dtype][seed]
    dev = triton_device()
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(dev)
    weight = (torch.rand(hidden, generator=g) * 2 - 0.5).to(weight_dtype).to(dev)
    for eps in (1e-6, 0.1):
        ref = invariant_rms_norm_reference(x, weight, eps)
        _assert_matches(invariant_rms_norm(x, weight, eps), ref, _rms_tol(ref))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_hostile_rows(dtype):
    dev = triton_device()
    g = _gen(20)
    hidden = RMS_BLOCK_H[dtype][0] + 300
    x = torch.randn(6, hidden, generator=g).to(dtype)
    x[1, 1200] = math.nan  # in the second chunk: the whole row NaN
    x[2, 5] = math.inf  # inf / inf: NaN where it sits, 0 elsewhere (x / inf)
    x[3] = 0.0  # a zero row with eps: zeros; eps = 0 below: 0 / 0
    x[4] = 1e17 if dtype != torch.float16 else 6e4  # squares far past fp16's range, within fp32's
    x = x.to(dev)
    weight = torch.randn(hidden, generator=g).to(dtype).to(dev)
    for eps in (1e-5, 0.0):
        out, ref = invariant_rms_norm(x, weight, eps), invariant_rms_norm_reference(x, weight, eps)
        _assert_matches(out, ref, _rms_tol(ref))
        assert out[1].isnan().all() and not out[[0, 5]].isnan().any()
        assert out[3].isnan().all() == (eps == 0.0)
    if dtype != torch.float16:  # a sum of squares past fp32's range: r = 1 / inf = 0, as the fp32 formula
        out = invariant_rms_norm(torch.full((1, 8), 1e30, dtype=dtype, device=dev), weight[:8], 1e-6)
        assert torch.equal(out.abs(), torch.zeros_like(out))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_bits_depend_neither_on_the_batch_nor_on_the_row_position(dtype):
    dev = triton_device()
    g = _gen(21)
    hidden = 1500
    weight = torch.randn(hidden, generator=g).to(dtype).to(dev)
    probes = _wide(3, hidden, generator=g, dtype=dtype, device=dev)
    alone = invariant_rms_norm(probes, weight, 1e-6)
    for batch, pos, which in _probe_batches(
        probes, lambda m, g: _wide(m, hidden, generator=g, dtype=dtype, device=dev), ROW_COUNTS[:3], 22
    ):
        assert torch.equal(invariant_rms_norm(batch, weight, 1e-6)[pos], alone[which])
    wide = torch.randn(3, hidden + 64, generator=g).to(dtype).to(dev)
    wide[:, 64:] = probes  # rows of a wider buffer (a row stride other than H)
    assert torch.equal(invariant_rms_norm(wide[:, 64:], weight, 1e-6), alone)


# ---------------------------------------------------------------------------------------- SiLU-mul


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_silu_mul_matches_the_reference_on_random_shapes(dtype, seed):
    g = _gen(30 + seed)
    rows, width = int(torch.randint(1, 9, (1,), generator=g)), [1, 77, 2100][seed]
    dev = triton_device()
    gate = (torch.randn(rows, width, generator=g) * 4).to(dtype).to(dev)
    up = torch.randn(rows, width, generator=g).to(dtype).to(dev)
    ref = invariant_silu_mul_reference(gate, up)
    _assert_matches(invariant_silu_mul(gate, up), ref, _rms_tol(ref))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_hostile_values(dtype):
    dev = triton_device()
    big = 1e30 if dtype != torch.float16 else 6e4
    g = torch.tensor([math.nan, math.inf, -math.inf, big, -big, 0.0, -0.0, 20.0, -20.0, 1.5])
    gate = g.repeat(3, 1)
    up = torch.ones_like(gate)
    up[1] = torch.tensor([1.0, 0.0, 1.0, math.inf, 2.0, math.nan, 3.0, -1.0, 1.0, math.inf])
    up[2] = -big
    gate, up = gate.to(dtype).to(dev), up.to(dtype).to(dev)
    out, ref = invariant_silu_mul(gate, up), invariant_silu_mul_reference(gate, up)
    _assert_matches(out, ref, _rms_tol(ref))
    assert out[0, 0].isnan() and out[0, 2].isnan() and out[0, 1] == math.inf and out[1, 1].isnan()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_bits_depend_neither_on_the_batch_nor_on_the_layout(dtype):
    dev = triton_device()
    g = _gen(31)
    width = 1300
    probes = (torch.randn(3, 2 * width, generator=g) * 4).to(dtype).to(dev)  # [gate | up], one projection
    alone = invariant_silu_mul(probes[:, :width].contiguous(), probes[:, width:].contiguous())
    assert torch.equal(invariant_silu_mul(probes[:, :width], probes[:, width:]), alone)
    for batch, pos, which in _probe_batches(
        probes, lambda m, g: torch.randn(m, 2 * width, generator=g).to(dtype).to(dev), ROW_COUNTS[:3], 32
    ):
        out = invariant_silu_mul(batch[:, :width], batch[:, width:])
        assert torch.equal(out[pos], alone[which])


# ----------------------------------------------------------------------------------- row log-probs


def _lp_tol(ref, logits, temperature):
    """fp32 sums over the row, plus the rounding of u = fp32(logits) / T to fp32 (of u[target] and of the
    max: 2 u_32 max |u| each, which near-ties far from 0 show)."""
    u = logits.double().abs().nan_to_num(0.0, 0.0, 0.0).amax(-1) / temperature
    return 1e-5 * (1 + ref.double().abs()) + 4 * 2**-24 * u.to(ref.device)


def _assert_logprobs(logits, targets, temperature):
    lp, ent = invariant_row_logprobs(logits, targets, temperature)
    ref_lp, ref_ent = invariant_row_logprobs_reference(logits, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    _assert_matches(lp, ref_lp, _lp_tol(ref_lp, logits, temperature))
    _assert_matches(ent, ref_ent, _lp_tol(ref_ent, logits, temperature))
    return lp, ent


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_row_logprobs_match_the_reference_on_random_shapes(dtype, seed):
    g = _gen(40 + seed)
    block = LOGPROBS_BLOCK_V[dtype][0]
    rows = int(torch.randint(1, 7, (1,), generator=g))
    vocab = [1, 300, 2 * block + 77][seed]  # one entry, one ragged tile, three tiles
    dev = triton_device()
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = -100
    for temperature in (1.0, 0.7):
        lp, _ = _assert_logprobs(logits.to(dev), targets.to(dev), temperature)
        assert lp[0] == 0.0


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_logprobs_hostile_rows(dtype):
    """NaN rows, -inf entries, an all -inf row, +inf, huge logits, near-ties far from 0, bad targets."""
    dev = triton_device()
    g = _gen(50)
    block = LOGPROBS_BLOCK_V[dtype][0]
    vocab = block + 500
    big = 3e4 if dtype != torch.float16 else 6e4
    logits = torch.randn(10, vocab, generator=g) * 3
    logits[0, block + 10] = math.nan  # NaN in the second tile: row 0 NaN
    logits[1, :] = math.nan  # and its target ignored: logprob 0, entropy NaN
    logits[2, : block + 1] = -math.inf  # the whole first tile and more -inf (nothing seen yet there)
    logits[3, :] = -math.inf  # nothing at all: NaN
    logits[4, 7] = math.inf  # inf - inf: NaN
    logits[5] = logits[5] * 1000  # a spread of thousands: p one-hot, tiny entropy
    logits[6] = big + torch.randn(vocab, generator=g)  # near-ties far from 0 (u - m is exact)
    logits[7, ::3] = -math.inf  # masked entries, its target among them: -inf
    logits = logits.to(dtype)
    targets = torch.randint(0, vocab, (10,), generator=g)
    targets[1] = -100
    targets[2] = block + 50
    targets[7] = 3
    targets[8] = vocab  # out of range: NaN logprob, the entropy stands
    targets[9] = -5
    lp, ent = _assert_logprobs(logits.to(dev), targets.to(dev), 0.8)
    lp, ent = lp.cpu(), ent.cpu()
    assert lp[[0, 3, 4, 8, 9]].isnan().all() and ent[[0, 1, 3, 4]].isnan().all()
    assert lp[1] == 0.0 and lp[7] == -math.inf
    assert torch.isfinite(lp[[2, 5, 6]]).all() and torch.isfinite(ent[[2, 5, 6, 7, 8, 9]]).all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_logprobs_bits_depend_neither_on_the_batch_nor_on_the_row_position(dtype):
    dev = triton_device()
    g = _gen(51)
    vocab = LOGPROBS_BLOCK_V[dtype][0] * 2 + 3
    probes = _wide(3, vocab, generator=g, dtype=dtype, device=dev)
    targets = torch.tensor([5, vocab - 1, -100], device=dev)
    alone = invariant_row_logprobs(probes, targets, 0.6)
    for batch, pos, which in _probe_batches(
        probes, lambda m, g: _wide(m, vocab, generator=g, dtype=dtype, device=dev), ROW_COUNTS[:3], 52
    ):
        tgt = torch.randint(0, vocab, (batch.shape[0],), generator=g).to(dev)
        tgt[pos] = targets[which]
        lp, ent = invariant_row_logprobs(batch, tgt, 0.6)
        assert torch.equal(lp[pos], alone[0][which]) and torch.equal(ent[pos], alone[1][which])


# --------------------------------------------------------------------------------------- arguments


def test_arguments_are_checked():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="w: expected dtype"):
        invariant_matmul(x, w.half())
    with pytest.raises(ValueError, match=r"w: expected shape \[N, 8\]"):
        invariant_matmul(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="x: expected dtype"):
        invariant_matmul(x.double(), w.double())
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        invariant_matmul(x[0], w)
    with pytest.raises(ValueError, match="weight: expected shape"):
        invariant_rms_norm(x, torch.ones(7), 1e-6)
    for eps in (-1.0, math.nan, "1e-6"):
        with pytest.raises(ValueError, match="eps"):
            invariant_rms_norm(x, torch.ones(8), eps)
    with pytest.raises(ValueError, match="up: expected dtype"):
        invariant_silu_mul(x, x.half())
    with pytest.raises(ValueError, match="up: expected shape"):
        invariant_silu_mul(x, x[:, :4])
    targets = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="targets: expected dtype"):
        invariant_row_logprobs(x, targets.int(), 1.0)
    with pytest.raises(ValueError, match="targets: expected shape"):
        invariant_row_logprobs(x, targets[:1], 1.0)
    with pytest.raises(ValueError, match="logits: vocabulary size is 0"):
        invariant_row_logprobs(x[:, :0], targets, 1.0)
    for t in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature: must be finite and > 0"):
            invariant_row_logprobs(x, targets, t)
    for t in (True, "1.0", torch.tensor(1.0)):
        with pytest.raises(ValueError, match="temperature: expected a float"):
            invariant_row_logprobs(x, targets, t)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 8)
    for op, call in (
        ("invariant_matmul", lambda: invariant_matmul(x, x)),
        ("invariant_rms_norm", lambda: invariant_rms_norm(x, torch.ones(8), 1e-6)),
        ("invariant_silu_mul", lambda: invariant_silu_mul(x, x)),
        ("invariant_row_logprobs", lambda: invariant_row_logprobs(x, torch.zeros(2, dtype=torch.int64))),
    ):
        with pytest.raises(RuntimeError, match=op):
            call()


@needs_triton
def test_inputs_that_require_grad_are_refused():
    x = torch.randn(2, 8, device=triton_device(), requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        invariant_matmul(x, x.detach())
    with torch.no_grad():
        torch.testing.assert_close(invariant_matmul(x, x), invariant_matmul_reference(x, x))


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernels)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernels_are_batch_invariant_at_model_sizes_on_cuda(dtype):  # pragma: no cover - GPU only
    """Qwen2-0.5B's sizes (H 896, F 4864, V 151936): a decode step's rows (M = 1, 7, 64) and a training
    batch's (M = 4096) give the same bits for the same rows."""
    g = _gen(60)
    hidden, inter, vocab = 896, 4864, 151936
    w = (torch.randn(inter, hidden, generator=g) * 0.03).to(dtype).cuda()
    norm = torch.rand(hidden, generator=g).to(dtype).cuda()
    head = (torch.randn(vocab, hidden, generator=g) * 0.03).to(dtype).cuda()
    probes = torch.randn(3, hidden, generator=g).to(dtype).cuda()
    targets = torch.tensor([1, 151935, -100], device="cuda")

    def forward(x, t):
        h = invariant_rms_norm(x, norm, 1e-6)
        up = invariant_matmul(h, w)
        act = invariant_silu_mul(up, up)
        logits = invariant_matmul(h, head)
        return (h, up, act, *invariant_row_logprobs(logits, t, 0.7))

    alone = forward(probes, targets)
    for m in (1, 7, 64, 4096):
        batch = torch.randn(m, hidden, generator=g).to(dtype).cuda()
        tgt = torch.randint(0, vocab, (m,), generator=g).cuda()
        pos = torch.randperm(m, generator=g)[: min(3, m)].tolist()
        which = list(range(len(pos)))
        batch[pos], tgt[pos] = probes[which], targets[which]
        for got, want in zip(forward(batch, tgt), alone):
            assert torch.equal(got[pos], want[which]), m
