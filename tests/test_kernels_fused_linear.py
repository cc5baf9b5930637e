"""fused_linear_policy_loss and FusedLinearGRPOLoss: accuracy, chunking, Liger's conventions, Triton."""

from __future__ import annotations

import importlib
import importlib.util
import math

import pytest
import torch
from conftest import tile_elem_bytes
from test_kernels_helpers import (
    LOW_DTYPES,
    LargeFp32Storages,
    LargestFp32Tensor,
    assert_as_accurate,
    assert_close,
    needs_triton,
    triton_device,
)
from torch.utils._python_dispatch import TorchDispatchMode

from bitrl.integrations.liger import FusedLinearGRPOLoss
from bitrl.kernels import (
    POLICY_LOSSES,
    LossConfig,
    fused_linear_policy_loss,
    fused_linear_policy_loss_reference,
)
from bitrl.kernels.fused_logprobs import numerics, tiled_cpu  # the modules that read what the tests set

D = torch.float64


def _case(B=3, T=5, H=12, V=41, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=D)
    w = torch.randn(V, H, generator=g, dtype=D) / math.sqrt(H)
    y = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        lp0 = torch.log_softmax(h @ w.T, -1).gather(-1, y[..., None])[..., 0]
    old = lp0 + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    ref = lp0 + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    roll = old + 0.1 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    if B > 2:
        mask[2] = 0  # all-masked sequence
    dev = torch.device(device)
    cast = lambda x: x.to(dev, dtype)
    return cast(h), cast(w), y.to(dev), cast(old), cast(adv), mask.to(dev), cast(ref), cast(roll)


def _run(fn, h, w, y, old, adv, mask, config=None, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss, met = fn(h, w, y, old, adv, mask, config, **kw)
    gh, gw = torch.autograd.grad(loss, [h, w])
    return loss.detach(), gh, gw, met


LOSS = dict(
    kl_coef=0.05,
    entropy_coef=0.01,
    correction="tis-token",
    clip_ratio_c=3.0,
    loss_agg_mode="seq-mean-token-mean",
)
CFG = LossConfig(**LOSS)
KW = dict(temperature=0.8)


@pytest.mark.parametrize("tile_cols", [0, 20], ids=["one-tile", "small-tiles"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_as_accurate_as_unfused(dtype, tile_cols, cpu_bf16_matmul, monkeypatch):
    if tile_cols:  # bf16 and fp16 run over tiles: 1 token x 20 columns
        tile_bytes = tile_cols * tile_elem_bytes(dtype, entropy=True)
        monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", tile_bytes)
    h, w, y, old, adv, mask, ref, roll = _case(dtype=dtype)
    args64 = [x.double() if x.is_floating_point() else x for x in (h, w, y, old, adv, mask)]
    r64 = _run(
        fused_linear_policy_loss_reference,
        *args64,
        CFG,
        ref_logprobs=ref.double(),
        rollout_logprobs=roll.double(),
        **KW,
    )
    unf = _run(
        fused_linear_policy_loss_reference,
        h,
        w,
        y,
        old,
        adv,
        mask,
        CFG,
        ref_logprobs=ref,
        rollout_logprobs=roll,
        **KW,
    )
    got = _run(
        fused_linear_policy_loss,
        h,
        w,
        y,
        old,
        adv,
        mask,
        CFG,
        ref_logprobs=ref,
        rollout_logprobs=roll,
        impl="torch",
        chunk_size=2,
        **KW,
    )
    for name, a, u, r in zip(("loss", "d_hidden", "d_weight"), got[:3], unf[:3], r64[:3]):
        assert a.dtype == (torch.float32 if name == "loss" else dtype)
        # bf16 GEMMs over several vocabulary blocks: each block's partial dh leaves its matmul rounded to bf16
        # (then summed in fp32), one rounding more than the unfused single matmul: up to 2^-8 of |dh| more
        bf16_gemms = dtype == torch.bfloat16 and cpu_bf16_matmul == torch.bfloat16
        rtol = 2.0**-8 if (name == "d_hidden" and bf16_gemms and tile_cols) else 1e-5
        assert_as_accurate(a, u, r, atol=1e-6, rtol=rtol, what=f"{dtype} {name}")
        if dtype == torch.float32:
            assert_close(a, r, atol=1e-6, rtol=1e-5, what=name)
    for k in ("clipfrac", "kl", "entropy", "ratio_mean", "is_weight_mean"):
        # bf16 GEMMs: the metrics inherit bf16-rounded logits, as the unfused path's do
        assert_as_accurate(got[3][k], unf[3][k], r64[3][k], atol=1e-4, rtol=1e-3, what=k)
        if dtype != torch.bfloat16 or cpu_bf16_matmul == torch.float32:
            assert_close(got[3][k], r64[3][k], atol=1e-4, rtol=1e-3, what=k)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "gmpo", "cispo", "sapo", "vespo"])
def test_chunking_is_exact_for_every_loss(loss_type, monkeypatch):
    h, w, y, old, adv, mask, ref, roll = _case(B=4, T=3, dtype=D, seed=2)
    cfg = LossConfig(**LOSS | dict(loss_type=loss_type, loss_agg_mode="token-mean"))
    kw = dict(KW, ref_logprobs=ref, rollout_logprobs=roll)
    ref_out = _run(fused_linear_policy_loss_reference, h, w, y, old, adv, mask, cfg, **kw)
    # torch backend tiles (fp64 + entropy: 16 bytes per element): one; every token x blocks of 12 columns;
    # 2 tokens x every column; 1 token x 20 columns
    for tile_bytes, min_vocab in ((0, 256), (16 * 112, 8), (16 * 112, 256), (16 * 20, 256)):
        monkeypatch.setattr(tiled_cpu, "TILE_MIN_VOCAB", min_vocab)
        if tile_bytes:
            monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", tile_bytes)
        for chunk in (1, 3, 100, None):
            out = _run(
                fused_linear_policy_loss, h, w, y, old, adv, mask, cfg, impl="torch", chunk_size=chunk, **kw
            )
            for a, b in zip(out[:3], ref_out[:3]):
                assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo", "gspo", "gmpo", "vespo"])
def test_token_chunks_cross_sequences_exactly(loss_type, monkeypatch):
    """The one pass of a token-level loss takes runs of active tokens that cross sequence boundaries
    (chunks of 1, 4 and 7 tokens, over a masked hole and an all-masked sequence) and gives the unfused loss,
    gradients and every metric, with KL, entropy bonus and a sequence-level correction; sequence-level
    losses keep whole sequences whatever the token budget. The logits are formed in vocabulary blocks."""
    flpl = importlib.import_module("bitrl.kernels.policy_loss.fused_linear")
    B, T, V = 4, 6, 41
    h, w, y, old, adv, mask, ref, roll = _case(B=B, T=T, V=V, dtype=D, seed=11)
    mask[1, 2:4] = 0
    cfg = LossConfig(**LOSS | dict(loss_type=loss_type, correction=["tis-seq", "icepop"]))
    kw = dict(KW, ref_logprobs=ref, rollout_logprobs=roll)
    want = _run(fused_linear_policy_loss_reference, h, w, y, old, adv, mask, cfg, **kw)
    token_level = POLICY_LOSSES[loss_type].token_level
    monkeypatch.setattr(flpl, "ONE_PASS_MIN_TOKENS", 1)
    monkeypatch.setattr(numerics, "LOGITS_BLOCK", 16)  # each chunk's logits in blocks of 16, 16 and 9 columns
    for tokens in (1, 4, 7):
        budget = tokens * V * 8 * 2  # fp64 logits and the entropy buffer of that many tokens
        h2 = h.reshape(B * T, -1)
        tiled, (rows, per_chunk) = flpl._torch_path("torch", h2, B, T, V, None, token_level, budget, True)
        # a sequence-level loss keeps whole sequences (T = 6 tokens): one per chunk at 7, tiles below
        assert tiled == (not token_level and tokens < T)
        assert per_chunk == (tokens if token_level else None)
        got = _run(
            fused_linear_policy_loss, h, w, y, old, adv, mask, cfg, impl="torch", memory_budget=budget, **kw
        )
        for name, a, b in zip(("loss", "d_hidden", "d_weight"), got[:3], want[:3]):
            assert_close(a, b, atol=1e-10, rtol=1e-10, what=f"{tokens} tokens: {name}")
        assert got[3].keys() == want[3].keys()
        for k in want[3]:
            assert_close(got[3][k], want[3][k], atol=1e-10, rtol=1e-10, what=f"{tokens} tokens: {k}")


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sequences_longer_than_a_tile_take_tiles(dtype, loss_type, monkeypatch):
    """fp32 / fp64 sequences whose logits exceed the tile budget go through [tokens x vocabulary] tiles
    (several token chunks x several vocabulary blocks, masked tokens skipped) and give the unfused result."""
    flpl = importlib.import_module("bitrl.kernels.policy_loss.fused_linear")
    B, T, V = 3, 24, 41
    h, w, y, old, adv, mask, ref, roll = _case(B=B, T=T, V=V, dtype=dtype, seed=5)
    mask[1, 5:9] = 0  # a hole inside a sequence: the active rows are not one run
    monkeypatch.setattr(tiled_cpu, "TILE_MIN_VOCAB", 16)
    # the logits of one sequence (24 x 41), and of ONE_PASS_MIN_TOKENS tokens, exceed the memory budget;
    # tiles of 7 tokens x 16 columns, and the budget's rest keeps a few columns of products
    budget = 1024
    monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", 7 * 16 * torch.finfo(dtype).bits // 8)
    token_level = loss_type == "grpo"
    path = flpl._torch_path("torch", h.reshape(B * T, -1), B, T, V, None, token_level, budget, True)
    assert path == (True, (B, None))
    cfg = LossConfig(**LOSS | dict(loss_type=loss_type, loss_agg_mode="token-mean"))
    kw = dict(KW, ref_logprobs=ref, rollout_logprobs=roll)
    args64 = [x.double() if x.is_floating_point() else x for x in (h, w, y, old, adv, mask)]
    kw64 = dict(kw, ref_logprobs=ref.double(), rollout_logprobs=roll.double())
    want = _run(fused_linear_policy_loss_reference, *args64, cfg, **kw64)
    got = _run(
        fused_linear_policy_loss, h, w, y, old, adv, mask, cfg, impl="torch", memory_budget=budget, **kw
    )
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-6, rtol=1e-5)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got[:3], want[:3]):
        assert a.dtype == (torch.float32 if name == "loss" and dtype == torch.float32 else dtype), name
        assert_close(a.double(), b, what=name, **tol)
    assert_close(got[1][2].double(), torch.zeros_like(want[1][2]), atol=0, rtol=0, what="masked rows")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_weights_get_no_fp32_weight_sized_buffer(dtype, cpu_bf16_matmul, monkeypatch):
    """bf16 / fp16 weights (multiplied in bf16 or fp32): the weight gradient is written block by block in
    its own dtype, with no fp32 [V, H] tensor at any point of forward + backward, and matches fp64."""
    B, T, H, V = 2, 16, 32, 1024
    h, w, y, old, adv, mask, _, _ = _case(B=B, T=T, H=H, V=V, dtype=dtype, seed=7)
    mask[1, 10:] = 0
    tile_bytes = B * T * 128 * tile_elem_bytes(dtype, entropy=False)
    monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", tile_bytes)
    spy = LargestFp32Tensor()
    with spy:  # the tight budget: no kept products either (fp32 where the matmuls run in fp32)
        got = _run(fused_linear_policy_loss, h, w, y, old, adv, mask, impl="torch", memory_budget=0)
    assert got[2].dtype == dtype and got[1].dtype == dtype
    assert 0 < spy.largest <= V * H // 4, f"an fp32 tensor of {spy.largest} elements (V x H = {V * H})"
    args64 = [x.double() if x.is_floating_point() else x for x in (h, w, y, old, adv, mask)]
    want = _run(fused_linear_policy_loss_reference, *args64)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got[:3], want[:3]):
        assert_close(a.double(), b, atol=1e-4, rtol=2.0**-6, what=f"{dtype} {name}")


@pytest.mark.parametrize("path", ["one-pass", "tiles"])
def test_fp32_working_set_is_one_chunk_beside_the_gradients(path, monkeypatch):
    """fp32 GRPO with padding, on either path (one pass: chunks of 16 active tokens across sequences; tiles:
    16 tokens x 64 columns, tokens outside): nothing beside the inputs and their two gradients is larger
    than one chunk of logits, in particular no [active tokens, H] buffer of gathered rows or of their
    gradient, and the result is the unfused one."""
    flpl = importlib.import_module("bitrl.kernels.policy_loss.fused_linear")
    B, T, H, V = 4, 64, 256, 512
    h, w, y, old, adv, mask, _, _ = _case(B=B, T=T, H=H, V=V, dtype=torch.float32, seed=3)
    mask[1, 40:] = 0  # n = 153 active tokens: [n, H] is 4.8x a chunk
    chunk_bytes = 16 * V * 4
    # tiles: a chunk of the fewest tokens would exceed the memory budget, which the tiles then take whole
    monkeypatch.setattr(flpl, "ONE_PASS_MIN_TOKENS", 1 if path == "one-pass" else B * T)
    monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", chunk_bytes)
    monkeypatch.setattr(tiled_cpu, "TOKEN_TILE_ROWS", 16)
    monkeypatch.setattr(numerics, "LOGITS_BLOCK", 64)
    spy = LargeFp32Storages(limit=chunk_bytes)
    with spy:
        got = _run(fused_linear_policy_loss, h, w, y, old, adv, mask, impl="torch", memory_budget=chunk_bytes)
    # h and w (seen through the detach in _run), the clones _run makes, and their two gradients
    assert sorted(spy.sizes.values()) == [B * T * H * 4] * 3 + [V * H * 4] * 3, spy.sizes
    want = _run(
        fused_linear_policy_loss_reference, h.double(), w.double(), y, old.double(), adv.double(), mask
    )
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got[:3], want[:3]):
        assert_close(a.double(), b, atol=1e-6, rtol=1e-5, what=f"{path} {name}")


def test_on_policy_ignore_index_bias_and_no_grad():
    h, w, y, _, adv, mask, _, _ = _case(B=2, T=4, dtype=D, seed=4)
    y[1, 2] = -100
    b = torch.randn(w.shape[0], dtype=D, requires_grad=True)
    hh = h.clone().requires_grad_(True)
    loss, met = fused_linear_policy_loss(hh, w, y, None, adv, mask, bias=b, impl="torch", chunk_size=1)
    g = torch.autograd.grad(loss, [hh, b])
    hr = h.clone().requires_grad_(True)
    br = b.detach().clone().requires_grad_(True)
    loss_r, _ = fused_linear_policy_loss_reference(hr, w, y, None, adv, mask, bias=br)
    gr = torch.autograd.grad(loss_r, [hr, br])
    assert_close(loss, loss_r, atol=1e-12)
    for a, c in zip(g, gr):
        assert_close(a, c, atol=1e-10, rtol=1e-10)
    assert float(met["ratio_mean"]) == pytest.approx(1.0)
    assert float(met["n_tokens"]) == float(mask.sum()) - 1
    with torch.no_grad():
        loss_ng, _ = fused_linear_policy_loss(h, w, y, None, adv, mask, impl="torch")
    assert_close(loss_ng, loss_r, atol=1e-12)


def test_validation_errors_name_the_argument():
    h, w, y, old, adv, mask, _, _ = _case(B=2, T=3)
    cases = [
        ((h[:, :2], w, y, old, adv, mask), "hidden"),
        ((h, w[:, :3], y, old, adv, mask), "weight"),
        ((h, w, y[0], old, adv, mask), "targets"),
        ((h, w, y, old[:, :2], adv, mask), "old_logprobs"),
        ((h, w, y, old, adv[:1], mask), "advantages"),
        ((h, w, y, old, adv, mask[:, :2]), "mask"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            fused_linear_policy_loss(*args)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_policy_loss(h, w, y, old, adv, mask, temperature=0.0)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_policy_loss(h * float("nan"), w, y, old, adv, mask)
    for bad in (-1, 0.5, "512MiB", True, float("nan")):
        with pytest.raises(ValueError, match="memory_budget"):
            fused_linear_policy_loss(h, w, y, old, adv, mask, impl="torch", memory_budget=bad)


class MultiplyAdds(TorchDispatchMode):
    """The multiply-adds of the matrix products (mm, addmm) run inside the context."""

    def __init__(self):
        super().__init__()
        self.madds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2:]
            self.madds += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_memory_budget_picks_three_products_or_the_tiles(dtype, cpu_bf16_matmul):
    """GRPO with padding at a budget that holds the 3-product form's working set runs 3 products of
    n x H x V (n active tokens): with fp32 GEMMs (fp32; fp16, bf16 without bf16 units) one pass over chunks of
    ONE_PASS_MIN_TOKENS tokens' fp32 logits (low-precision weights: plus the weight's fp32 copy and fp32
    gradient), with bf16 GEMMs the tiles and every active token's products. Just below it (fp32 GEMMs: the
    tiles; bf16: all but one column kept) or at 0, the two-pass tiles recompute what they did not keep (4
    products at 0); the same loss and gradients (bf16 GEMMs: bit for bit), as accurate as unfused."""
    flpl = importlib.import_module("bitrl.kernels.policy_loss.fused_linear")
    B, T, H, V = 4, 40, 16, 256
    h, w, y, old, adv, mask, _, _ = _case(B=B, T=T, H=H, V=V, dtype=dtype, seed=9)
    n = int(mask.sum())
    h2 = h.reshape(B * T, H)
    fp32_gemms = tiled_cpu.tile_matmul_dtype(h2) == torch.float32
    if fp32_gemms:  # ONE_PASS_MIN_TOKENS (128) tokens' fp32 logits, no entropy, and the [V, H] fp32 buffers
        fits = 128 * V * 4 + (0 if dtype == torch.float32 else 2 * V * H * 4)
        below = fits - 1
        assert flpl._torch_path("torch", h2, B, T, V, None, True, fits) == (False, (B, 128))
        assert flpl._torch_path("torch", h2, B, T, V, None, True, below)[0]
    else:
        fits = tiled_cpu.tile_bytes(n, V, h2, "loss") + n * V * tiled_cpu.tile_matmul_dtype(h2).itemsize
        below = fits - n  # all but one column kept
        assert flpl._torch_path("torch", h2, B, T, V, None, True, 2**40)[0]  # the tiles, whatever the budget
        assert tiled_cpu.kept_columns(n, V, h2, "loss", fits) == V
        assert tiled_cpu.kept_columns(n, V, h2, "loss", below) == V - 1
    runs, products = {}, {}
    for budget in (fits, below, 0):
        meter = MultiplyAdds()
        with meter:
            kw = dict(impl="torch", memory_budget=budget)
            runs[budget] = _run(fused_linear_policy_loss, h, w, y, old, adv, mask, **kw)
        products[budget] = meter.madds / (n * H * V)
    assert products[fits] == 3 and products[0] == 4 and 3 < products[below] <= 4, products
    args64 = [x.double() if x.is_floating_point() else x for x in (h, w, y, old, adv, mask)]
    want = _run(fused_linear_policy_loss_reference, *args64)
    unf = _run(fused_linear_policy_loss_reference, h, w, y, old, adv, mask)
    # fp32 GEMMs: fp32 sums in another order, rounded once to the output dtype (one ulp apart at most)
    ulp = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    tol = dict(atol=1e-6, rtol=ulp) if fp32_gemms else dict(atol=0, rtol=0)
    for i, name in enumerate(("loss", "d_hidden", "d_weight")):
        for budget in (below, 0):
            assert_close(runs[budget][i], runs[fits][i], **tol, what=f"{dtype} {name} at {budget}")
        assert_as_accurate(runs[fits][i], unf[i], want[i], atol=1e-6, rtol=1e-5, what=f"{dtype} {name}")


# ----------------------------------------------------------------------------------------------------------
# FusedLinearGRPOLoss against Liger-Kernel's conventions, written out independently here
# ----------------------------------------------------------------------------------------------------------


def _liger_formula(
    lp, old, ref, adv, m, *, loss_type, beta, eps_lo, eps_hi, level, delta, temp_pos, temp_neg, L
):
    """LigerFusedLinearGRPOLoss's loss and (kl, clip_ratio) metrics from its documented formulas."""
    B, T = lp.shape
    a = adv.unsqueeze(1)
    log_r = lp - old
    if level == "sequence":
        log_r = ((log_r * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)
    r = torch.exp(log_r)
    if loss_type == "cispo":
        c = r.clamp(max=eps_hi).detach()
        per = -c * a * lp
        clipped = (r > eps_hi) & (a > 0)
    elif loss_type == "sapo":
        tau = torch.where(a > 0, temp_pos, temp_neg)
        per = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        clipped = torch.zeros_like(r, dtype=torch.bool)
    else:
        r1 = r.clamp(max=delta) if delta is not None else r
        per = -torch.minimum(r1 * a, r.clamp(1 - eps_lo, 1 + eps_hi) * a)
        clipped = ((r < 1 - eps_lo) & (a < 0)) | ((r > 1 + eps_hi) & (a > 0))
    per = per.expand(B, T)
    clipped = clipped.expand(B, T)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per = per + beta * kl
    n = m.sum().clamp(min=1)
    if loss_type in ("grpo", "sapo"):
        loss = ((per * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / B
    elif loss_type in ("bnpo", "dapo", "cispo"):
        loss = (per * m).sum() / n
    elif loss_type == "dr_grpo":
        loss = (per * m).sum() / (B * L)
    else:
        raise AssertionError(loss_type)
    return loss, ((kl * m).sum() / n, (clipped * m).sum() / n)


LIGER_CASES = [
    ("grpo", "token", None),
    ("grpo", "sequence", None),
    ("bnpo", "token", 1.4),
    ("dapo", "token", None),
    ("dapo", "sequence", None),
    ("dr_grpo", "token", None),
    ("cispo", "token", None),
    ("sapo", "token", None),
]


@pytest.mark.parametrize("loss_type,level,delta", LIGER_CASES)
def test_grpo_module_matches_liger_conventions(loss_type, level, delta):
    B, T = 3, 5
    h, w, y, old, adv, mask, ref, _ = _case(B=B, T=T, dtype=D, seed=7)
    eps_hi = 4.0 if loss_type == "cispo" else 0.28
    mod = FusedLinearGRPOLoss(
        beta=0.1,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=eps_hi,
        max_completion_length=T,
        delta=delta,
        temperature=0.9,
        chunk_size=2,
        impl="torch",
    )
    hh = h.clone().requires_grad_(True)
    loss, (kl, clip) = mod(hh, w, y, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
    (g,) = torch.autograd.grad(loss, [hh])

    hr = h.clone().requires_grad_(True)
    lp = torch.log_softmax((hr @ w.T) / 0.9, -1).gather(-1, y[..., None])[..., 0]
    want, (kl_w, clip_w) = _liger_formula(
        lp,
        old,
        ref,
        adv,
        mask.to(D),
        loss_type=loss_type,
        beta=0.1,
        eps_lo=0.2,
        eps_hi=eps_hi,
        level=level,
        delta=delta,
        temp_pos=1.0,
        temp_neg=1.05,
        L=T,
    )
    (gw,) = torch.autograd.grad(want, [hr])
    assert_close(loss, want, atol=1e-10, what="loss")
    assert_close(g, gw, atol=1e-10, rtol=1e-9, what="grad")
    assert_close(kl, kl_w, atol=1e-6, what="kl")  # metrics are fp32
    assert_close(clip, clip_w, atol=1e-6, what="clip_ratio")


def test_grpo_module_signature_and_return_shape():
    mod = FusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=False, chunk_size=1)
    h, w, y, old, adv, mask, _, _ = _case(B=2, T=3)
    out = mod(h, w, y, mask, adv, None, None, old, None, None, None, None, 10)
    loss, metrics = out
    assert loss.dim() == 0 and isinstance(metrics, tuple) and len(metrics) == 1  # no KL entry when beta == 0
    with pytest.raises(ValueError, match="max_completion_length"):
        FusedLinearGRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        FusedLinearGRPOLoss(loss_type="cispo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="loss_type"):
        FusedLinearGRPOLoss(loss_type="nope")


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.parametrize("loss_type,level,delta", LIGER_CASES + [("vespo", "token", None)])
def test_grpo_module_matches_liger_kernel(loss_type, level, delta):  # pragma: no cover - optional peer
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    B, T = 3, 5
    h, w, y, old, adv, mask, ref, _ = _case(B=B, T=T, dtype=torch.float32, seed=9)
    isr = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) + 0.5
    isr = torch.where(mask > 0, isr, torch.ones_like(isr))  # bitrl ignores padding; Liger's vespo does not
    kw = dict(
        beta=0.1,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=4.0 if loss_type == "cispo" else 0.28,
        max_completion_length=T,
        delta=delta,
        temperature=0.9,
        chunk_size=2,
    )
    outs = []
    for mod in (LigerFusedLinearGRPOLoss(compiled=False, **kw), FusedLinearGRPOLoss(impl="torch", **kw)):
        hh = h.clone().requires_grad_(True)
        loss, mets = mod(
            hh, w, y, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, vllm_is_ratio=isr
        )
        (g,) = torch.autograd.grad(loss, [hh])
        outs.append((loss.detach(), g, *[m.detach() for m in mets]))
    for a, b in zip(*outs):
        assert_close(b, a, atol=2e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_triton_matches_torch(loss_type):
    dev = triton_device()
    h, w, y, old, adv, mask, ref, roll = _case(B=3, T=4, H=16, V=37, device=dev)
    cfg = LossConfig(**LOSS | dict(loss_type=loss_type))
    kw = dict(KW, ref_logprobs=ref, rollout_logprobs=roll, chunk_size=2)
    a = _run(fused_linear_policy_loss, h, w, y, old, adv, mask, cfg, impl="torch", **kw)
    b = _run(fused_linear_policy_loss, h, w, y, old, adv, mask, cfg, impl="triton", **kw)
    for x, z in zip(a[:3], b[:3]):
        assert_close(z.cpu(), x.cpu(), atol=1e-6, rtol=1e-5)
    for k in a[3]:
        assert_close(b[3][k].cpu(), a[3][k].cpu(), atol=1e-5, rtol=1e-4, what=k)


def test_upstream_gradient_is_applied():
    h, w, y, old, adv, mask, _, _ = _case(B=2, T=3, dtype=D, seed=5)
    grads = []
    for scale in (1.0, -2.5):
        hh = h.clone().requires_grad_(True)
        loss, _ = fused_linear_policy_loss(hh, w, y, old, adv, mask, impl="torch")
        (g,) = torch.autograd.grad(loss * scale, [hh])
        grads.append(g)
    assert_close(grads[1], -2.5 * grads[0], atol=1e-12, rtol=1e-12)


def _grpo_token_mean_fp64(h, w, bias, y, old, adv, mask, temperature, entropy_coef, eps=0.2):
    """The GRPO loss from its formula in fp64, written here independently of bitrl: logits -> /T ->
    log_softmax -> gather; r = exp(lp - old); -min(r A, clip(r, 1 - eps, 1 + eps) A), token mean over the
    mask, minus entropy_coef times the token-mean entropy."""
    z = (h.double() @ w.double().T + bias.double()) / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    m = mask.double() * (y != -100)
    r = torch.exp(lp - old.double())
    a = adv.double()[:, None]
    per = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
    n = m.sum().clamp(min=1.0)
    return (per * m).sum() / n - entropy_coef * (ent * m).sum() / n


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cols", ["narrow", "wide"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_tiles_narrower_and_wider_than_hidden_against_formula(
    dtype, entropy_coef, cols, seed, cpu_bf16_matmul, monkeypatch
):
    """Random shapes, masked and ignored tokens, an empty sequence, -inf bias entries and logits in the
    hundreds; bf16 and fp16 tiles of every token by fewer vocabulary columns than H (with bf16 GEMMs each
    tile's partial d hidden goes through its own fp32 buffer) or more (through the free fp32 tile buffer);
    fp32 takes the single pass, and so do fp16 and bf16 without bf16 units (fp32 GEMMs) at the default
    budget; seed 1 runs at budget 0 (the tiles for every dtype but fp32, nothing kept). Against the GRPO
    formula in fp64 and at least as accurate as the unfused path."""
    g = torch.Generator().manual_seed(100 + seed)
    B, T = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
    H, V = int(torch.randint(20, 48, (1,), generator=g)), int(torch.randint(70, 300, (1,), generator=g))
    scale = 40.0 if seed == 2 else 1.0  # seed 2: logits in the hundreds
    h = (torch.randn(B, T, H, generator=g, dtype=D) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=D) / math.sqrt(H)).to(dtype)
    bias = (torch.randn(V, generator=g, dtype=D) * 0.5).to(dtype)
    bias[::7] = float("-inf")
    y = torch.randint(0, V, (B, T), generator=g)
    y[y % 7 == 0] += 1  # targets on allowed entries
    y[0, -1] = -100
    old = -math.log(V) + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, generator=g, dtype=D)
    mask = torch.ones(B, T)
    mask[0, T // 2 :] = 0
    mask[-1] = 0  # an empty sequence
    # every token in one tile (TILE_MIN_VOCAB 1), about 8 or 64 columns per tile
    monkeypatch.setattr(tiled_cpu, "TILE_MIN_VOCAB", 1)
    elem = tile_elem_bytes(dtype, entropy=bool(entropy_coef)) if dtype != torch.float32 else 8
    monkeypatch.setitem(tiled_cpu.TILE_BYTES["loss"], "cpu", elem * B * T * (8 if cols == "narrow" else 64))
    cfg = LossConfig(entropy_coef=entropy_coef, loss_type="grpo", loss_agg_mode="token-mean")
    # seed 1 at the tight budget (every tile recomputed), the others at the default (products kept)
    kw = dict(temperature=0.7, bias=bias, memory_budget=0 if seed == 1 else None)

    def run(fn, hh, ww, bb, **extra):
        hh = hh.detach().clone().requires_grad_(True)
        ww = ww.detach().clone().requires_grad_(True)
        bb = bb.detach().clone().requires_grad_(True)
        loss = fn(hh, ww, bb)
        return (loss.detach(),) + torch.autograd.grad(loss, [hh, ww, bb])

    ref = run(
        lambda a, b_, c: _grpo_token_mean_fp64(a, b_, c, y, old, adv, mask, 0.7, entropy_coef), h, w, bias
    )
    unf = run(
        lambda a, b_, c: fused_linear_policy_loss_reference(
            a, b_, y, old, adv, mask, cfg, **dict(kw, bias=c, memory_budget=None)
        )[0],
        h,
        w,
        bias,
    )
    got = run(
        lambda a, b_, c: fused_linear_policy_loss(
            a, b_, y, old, adv, mask, cfg, impl="torch", **dict(kw, bias=c)
        )[0],
        h,
        w,
        bias,
    )
    for name, a, u, r in zip(("loss", "d_hidden", "d_weight", "d_bias"), got, unf, ref):
        assert torch.isfinite(a).all(), name
        if name != "loss":
            assert a.dtype == dtype, name
        bf16_gemms = dtype == torch.bfloat16 and cpu_bf16_matmul == torch.bfloat16
        if bf16_gemms and scale > 1:
            # bf16 logits in the hundreds are off by O(2^-8 |z|) ~ 1 in both paths, amplified by exp in the
            # ratio: which path lands nearer is chance; fused_logprobs' bf16 error-bound test covers them
            continue
        # bf16 tiles: each vocabulary block's partial d hidden leaves its matmul rounded to bf16 (then summed
        # in fp32), one rounding more than the unfused single matmul
        rtol = 2.0**-7 if (bf16_gemms and name == "d_hidden") else 1e-5
        assert_as_accurate(a, u, r, atol=1e-6, rtol=rtol, what=f"{dtype} {name}")
        if dtype == torch.float32:
            assert_close(a, r, atol=1e-5, rtol=1e-4, what=name)
    # masked, ignored and empty-sequence tokens get no hidden gradient
    off = (mask == 0) | (y == -100)
    assert (got[1][off] == 0).all()
