"""policy_loss: hand computations per loss type, aggregation, KL, correction; properties; dtypes; Triton."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels_helpers import LOW_DTYPES, assert_as_accurate, assert_close, needs_triton, triton_device

from bitrl.kernels import (
    AGGREGATIONS,
    CORRECTIONS,
    POLICY_LOSSES,
    FusedFallbackWarning,
    LossConfig,
    policy_loss,
    register_correction,
    register_policy_loss,
)
from bitrl.kernels.policy_loss import CorrectionResult, seq_sum

pl_triton = importlib.import_module("bitrl.kernels.policy_loss.triton")

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def _loss_and_grad(lp, *args, impl="torch", **kw):
    lp = lp.clone().requires_grad_(True)
    loss, met = policy_loss(lp, *args, impl=impl, **kw)
    (g,) = torch.autograd.grad(loss, [lp])
    return float(loss.detach()), g, met


R = [math.log(1.5), math.log(0.5)]  # token ratios 1.5 and 0.5 against old = 0
s75 = math.sqrt(0.75)


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


GMPO_MEAN = math.exp((0.4 + math.log(0.5)) / 2)
VESPO_PHI = math.exp(3.0 + 2.0 * math.log(0.75) - 3.0 * 0.75)

# (loss_type, advantage, extra kwargs, expected loss, expected d loss / d lp, expected metrics)
HAND = [
    ("grpo", 1.0, {}, (-1.2 - 0.5) / 2, [0.0, -0.25], {"clipfrac_high": 0.5, "clipfrac_low": 0.0}),
    ("grpo", -1.0, {}, (1.5 + 0.8) / 2, [0.75, 0.0], {"clipfrac_low": 0.5, "clipfrac_high": 0.0}),
    ("ppo", -1.0, {"delta": 1.3}, (1.3 + 0.8) / 2, [0.0, 0.0], {}),
    ("grpo", 1.0, {"eps_high": 0.6}, (-1.5 - 0.5) / 2, [-0.75, -0.25], {"clipfrac_high": 0.0}),
    ("gspo", 1.0, {}, -s75, [-s75 / 2, -s75 / 2], {"ratio_mean": s75}),
    ("gspo", -1.0, {"eps_low": 0.1, "eps_high": 0.1}, 0.9, [0.0, 0.0], {"clipfrac_low": 1.0}),
    (
        "cispo",
        1.0,
        {"cispo_clip_max": 1.2},
        (-1.2 * R[0] - 0.5 * R[1]) / 2,
        [-0.6, -0.25],
        {"clipfrac_high": 0.5},
    ),
    (
        "sapo",
        1.0,
        {},
        -2.0 * (sig(0.5) + sig(-0.5)),
        [-2 * sig(0.5) * (1 - sig(0.5)) * 1.5, -2 * sig(-0.5) * (1 - sig(-0.5)) * 0.5],
        {},
    ),
    (
        "sapo",
        -1.0,
        {"sapo_tau_neg": 2.0},
        (sig(1.0) + sig(-1.0)) * 2 / 2 * 2 / 2,
        [2 * sig(1.0) * (1 - sig(1.0)) * 1.5, 2 * sig(-1.0) * (1 - sig(-1.0)) * 0.5],
        {},
    ),
    (
        "gmpo",
        1.0,
        {"eps_low": 0.4, "eps_high": 0.4},
        -GMPO_MEAN,
        [0.0, -GMPO_MEAN / 2],
        {"clipfrac_high": 0.5},
    ),
    ("vespo", 1.0, {}, -VESPO_PHI * (R[0] + R[1]) / 2, [-VESPO_PHI / 2, -VESPO_PHI / 2], {}),
]


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("case", HAND, ids=lambda c: f"{c[0]}-A{c[1]}-{sorted(c[2])}")
def test_loss_types_by_hand(case, impl):
    loss_type, a, kw, want, want_grad, want_metrics = case
    cfg = LossConfig(loss_type=loss_type, **kw)
    loss, g, met = _loss_and_grad(t([R]), t([[0.0, 0.0]]), t([a]), None, cfg, impl=impl)
    assert loss == pytest.approx(want, abs=1e-12)
    assert g[0].tolist() == pytest.approx(want_grad, abs=1e-12)
    for k, v in want_metrics.items():
        assert float(met[k]) == pytest.approx(v, abs=1e-7), k


def test_dual_clip_by_hand():
    lp = t([[math.log(4.0), math.log(0.5)]])
    loss, g, met = _loss_and_grad(lp, t([[0.0, 0.0]]), t([-1.0]), None, LossConfig(clip_ratio_c=3.0))
    assert loss == pytest.approx((3.0 + 0.8) / 2)
    assert g[0].tolist() == pytest.approx([0.0, 0.0])
    assert float(met["clipfrac_dual"]) == pytest.approx(0.5)


AGG_ADV = [[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]
AGG_MASK = [[1, 1, 0], [1, 0, 0]]
AGG = [
    ("token-mean", {}, -2.0),
    ("token-mean", {"global_token_count": 12}, -0.5),
    ("seq-mean-token-mean", {}, -2.25),
    ("seq-mean-token-mean", {"global_seq_count": 4}, -1.125),
    ("seq-mean-token-sum", {}, -3.0),
    ("seq-mean-token-sum-norm", {}, -1.0),
    ("constant", {"loss_scale": 4.0}, -1.5),
    ("seq-len-weighted", {}, -1.5),
]


@pytest.mark.parametrize("agg,kw,want", AGG, ids=lambda x: str(x))
def test_aggregations_by_hand(agg, kw, want):
    lp = torch.zeros(2, 3, dtype=D)  # on-policy: r = 1, per-token loss = -A
    loss, g, _ = _loss_and_grad(lp, None, t(AGG_ADV), t(AGG_MASK), LossConfig(loss_agg_mode=agg, **kw))
    assert loss == pytest.approx(want)
    assert torch.all(g[t(AGG_MASK) == 0] == 0)


@pytest.mark.parametrize(
    "kl_type,value,grad",
    [
        ("k1", -0.2, 1.0),
        ("k2", 0.02, -0.2),
        ("k3", math.exp(0.2) - 0.2 - 1.0, 1.0 - math.exp(0.2)),
    ],
)
def test_kl_estimators_by_hand(kl_type, value, grad):
    lp, ref = t([[0.1]]), t([[0.3]])
    cfg = LossConfig(kl_type=kl_type, kl_coef=0.5)
    loss, g, met = _loss_and_grad(lp, None, t([0.0]), None, cfg, ref_logprobs=ref)
    assert loss == pytest.approx(0.5 * value)
    assert float(g) == pytest.approx(0.5 * grad)
    assert float(met["kl"]) == pytest.approx(value, rel=1e-6)


ROLL = [[math.log(1 / 3), math.log(2.0)], [math.log(0.5), math.log(0.25)]]  # rho = [[3, .5], [2, 4]]
CORR = [
    ("tis-token", {}, -(2 + 0.5 + 2 + 2) / 4, 0.0),
    ("tis-seq", {}, -(1.5 * 2 + 2 * 2) / 4, 0.0),
    ("mask-token", {}, -1.0, 0.5),
    ("mask-seq", {}, -1.0, 0.5),
    ("mask-geo", {"correction_low": 0.9, "correction_high": 1.3}, -1.0, 0.5),
    ("icepop", {"icepop_beta": 2.5}, -(0 + 0.5 + 2 + 0) / 4, 0.0),
    (("tis-token", "mask-seq"), {}, -2.5 / 2, 0.5),
    ("none", {}, -1.0, 0.0),
]


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("corr,kw,want,masked", CORR, ids=lambda x: str(x))
def test_corrections_by_hand(corr, kw, want, masked, impl):
    lp = torch.zeros(2, 2, dtype=D)
    loss, g, met = _loss_and_grad(
        lp,
        torch.zeros(2, 2, dtype=D),
        t([1.0, 1.0]),
        None,
        LossConfig(correction=corr, **kw),
        rollout_logprobs=t(ROLL),
        impl=impl,
    )
    assert loss == pytest.approx(want)
    assert float(met["masked_frac"]) == pytest.approx(masked)
    assert float(met["mismatch_chi2_token"]) == pytest.approx((9 + 0.25 + 4 + 16) / 4 - 1)
    if corr != "none":
        assert "is_weight_mean" in met or masked > 0
    if corr == "icepop":  # rho = 3 and 4 leave [0.5, 2.5]: two of four tokens get a zero weight
        assert float(met["is_weight_zero_frac"]) == pytest.approx(0.5)


def test_entropy_bonus_by_hand():
    ent = t([[1.0, 2.0]]).requires_grad_(True)
    lp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    loss, met = policy_loss(lp, None, t([0.0]), None, LossConfig(entropy_coef=0.1), entropy=ent)
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent])
    assert float(loss.detach()) == pytest.approx(-0.15)
    assert g_ent[0].tolist() == pytest.approx([-0.05, -0.05])
    assert float(met["entropy"]) == pytest.approx(1.5)


def test_correction_weights_are_detached_and_is_weights_multiply():
    lp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    roll = t([[math.log(0.5), 0.0]]).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=D, requires_grad=True)
    loss, _ = policy_loss(lp, old, t([1.0]), None, LossConfig(correction="tis-token"), rollout_logprobs=roll)
    assert not torch.autograd.grad(loss, [lp], retain_graph=False)[0].isnan().any()
    loss2, _ = policy_loss(torch.zeros(1, 2, dtype=D), None, t([1.0]), None, is_weights=t([[2.0, 1.0]]))
    assert float(loss2) == pytest.approx(-1.5)


def test_registering_a_new_correction_is_one_function():
    @register_correction("reject-k3-seq-test")
    def _reject(log_rho, mask, cfg):
        k3 = torch.exp(-log_rho) - 1 + log_rho
        return CorrectionResult(keep=(seq_sum(k3, mask) <= 0.1).unsqueeze(-1).expand_as(mask))

    try:
        lp = torch.zeros(2, 2, dtype=D)
        cfg = LossConfig(correction="reject-k3-seq-test")
        loss, _ = policy_loss(lp, lp, t([1.0, 2.0]), None, cfg, rollout_logprobs=t([[0, 0], [1, 1]]))
        assert float(loss) == pytest.approx(-1.0)  # only the first sequence survives
    finally:
        del CORRECTIONS["reject-k3-seq-test"]


def test_nonfinite_inputs_raise_or_mask():
    lp = torch.zeros(2, 3)
    old = torch.zeros(2, 3)
    adv = torch.ones(2)
    mask = torch.ones(2, 3)
    bad = lp.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(bad, old, adv, mask)
    bad_old = old.clone()
    bad_old[1, 2] = float("inf")
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, bad_old, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, torch.tensor([1.0, float("nan")]), mask)
    # garbage at masked positions is fine, and never leaks into the loss or the gradient
    mask2 = mask.clone()
    mask2[0, 1] = 0
    x = bad.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask2, impl="torch")
    (g,) = torch.autograd.grad(loss, [x])
    assert torch.isfinite(loss) and torch.isfinite(g).all() and g[0, 1] == 0
    # mode "mask" drops the token
    x = bad.clone().requires_grad_(True)
    loss, met = policy_loss(x, old, adv, mask, LossConfig(nonfinite="mask"))
    (g,) = torch.autograd.grad(loss, [x])
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert float(met["nonfinite_frac"]) == pytest.approx(1 / 6)


def test_validation_errors_name_the_argument():
    lp = torch.zeros(2, 3)
    ok = dict(old_logprobs=torch.zeros(2, 3), advantages=torch.ones(2), mask=torch.ones(2, 3))
    cases = [
        (dict(old_logprobs=torch.zeros(3, 2)), "old_logprobs"),
        (dict(advantages=torch.ones(3)), "advantages"),
        (dict(advantages=torch.ones(2, 3, dtype=torch.int64)), "advantages"),
        (dict(mask=torch.ones(2, 2)), "mask"),
        (dict(loss_type="nope"), "loss_type"),
        (dict(loss_agg_mode="nope"), "loss_agg_mode"),
        (dict(correction="nope", rollout_logprobs=torch.zeros(2, 3)), "correction"),
        (dict(correction="tis-token"), "rollout_logprobs"),
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(ref_logprobs=torch.zeros(2, 3), kl_type="k9"), "kl_type"),
        (dict(entropy=torch.zeros(2)), "entropy"),
        (dict(clip_ratio_c=0.5), "clip_ratio_c"),
        (dict(nonfinite="ignore"), "nonfinite"),
        (dict(impl="gpu"), "impl"),
    ]
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    for over, name in cases:
        kw = dict(ok)
        kw.update(over)
        args = [kw.pop("old_logprobs"), kw.pop("advantages"), kw.pop("mask")]
        with pytest.raises(ValueError, match=name):
            config = LossConfig(**{k: kw.pop(k) for k in list(kw) if k in fields})
            policy_loss(lp, *args, config, **kw)
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(torch.zeros(3), None, torch.ones(3), None)


def _random_case(B, T, seed, dtype=torch.float32, adv_per_token=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=D) * 4
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.7
    if B > 1:
        mask[0] = False  # an all-masked sequence
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    roll = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    ent = torch.rand(B, T, generator=g, dtype=D) * 3
    cast = lambda x: x.to(dtype)
    return cast(lp), cast(old), cast(adv), mask, cast(ref), cast(roll), cast(ent)


def _full(lp, old, adv, mask, ref, roll, ent, impl, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    ent = ent.detach().clone().requires_grad_(True)
    loss, met = policy_loss(
        lp,
        old,
        adv,
        mask,
        LossConfig(kl_coef=0.05, entropy_coef=0.01, **kw),
        ref_logprobs=ref,
        entropy=ent,
        rollout_logprobs=roll,
        impl=impl,
    )
    g_lp, g_ent = torch.autograd.grad(loss, [lp, ent])
    return loss.detach(), g_lp, g_ent, met


LOSS_NAMES = sorted({fn.registry_name for fn in POLICY_LOSSES.values()})
AGG_BY_FN = {fn.__name__: name for name, fn in reversed(list(AGGREGATIONS.items()))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    loss_type=st.sampled_from(LOSS_NAMES),
    agg=st.sampled_from(sorted(AGG_BY_FN.values())),
    kl_type=st.sampled_from(["k1", "k2", "k3"]),
    corr=st.sampled_from(["none", "tis-token", "tis-seq", "mask-token", "mask-seq", "mask-geo", "icepop"]),
    B=st.integers(1, 4),
    T=st.integers(1, 5),
    per_token=st.booleans(),
    dual=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_every_loss_and_aggregation(loss_type, agg, kl_type, corr, B, T, per_token, dual, seed):
    case = _random_case(B, T, seed, dtype=D, adv_per_token=per_token)
    kw = dict(loss_type=loss_type, loss_agg_mode=agg, kl_type=kl_type, correction=corr)
    if dual:
        kw["clip_ratio_c"] = 3.0
    ref = _full(*case, "reference", **kw)
    got = _full(*case, "torch", **kw)
    for a, b in zip(got[:3], ref[:3]):
        assert torch.isfinite(a).all()
        assert_close(a, b, atol=1e-10, rtol=1e-10)
    # fp32 against the fp64 reference
    case32 = [x.float() if x.is_floating_point() else x for x in case]
    got32 = _full(*case32, "torch", **kw)
    for a, b in zip(got32[:3], ref[:3]):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    # masked positions get no gradient
    assert torch.all(got[1][~case[3]] == 0)
    for k in ("clipfrac", "ratio_mean", "kl", "masked_frac"):
        assert torch.isfinite(got[3][k])


def _naive_grpo_native(lp, old, adv, mask, eps=0.2):
    """The usual unfused GRPO loss written in the input dtype (the 'unfused same dtype' baseline)."""
    r = torch.exp(lp - old)
    a = adv.unsqueeze(-1)
    per = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
    m = mask.to(lp.dtype)
    return (per * m).sum() / m.sum()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_dtypes_as_accurate_as_unfused(dtype):
    lp, old, adv, mask, *_ = _random_case(8, 33, seed=5, dtype=dtype)
    ref_lp = lp.double().requires_grad_(True)
    ref = policy_loss(ref_lp, old.double(), adv.double(), mask, impl="reference")[0]
    (ref_g,) = torch.autograd.grad(ref, [ref_lp])
    x = lp.clone().requires_grad_(True)
    unf = _naive_grpo_native(x, old, adv, mask)
    (unf_g,) = torch.autograd.grad(unf, [x])
    for impl in ["torch", "reference"]:
        y = lp.clone().requires_grad_(True)
        got, _ = policy_loss(y, old, adv, mask, impl=impl)
        (got_g,) = torch.autograd.grad(got, [y])
        assert got.dtype == torch.float32 and got_g.dtype == dtype
        assert_as_accurate(got, unf, ref, atol=1e-6, rtol=1e-6, what=f"{dtype} loss")
        assert_as_accurate(got_g, unf_g, ref_g, atol=1e-6, rtol=1e-3, what=f"{dtype} grad")
        if dtype == torch.float32:
            assert_close(got, ref, atol=1e-6, rtol=1e-6)
            assert_close(got_g, ref_g, atol=1e-7, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo", "gspo"])
def test_triton_matches_torch(loss_type, monkeypatch):
    monkeypatch.setattr(pl_triton, "POLICY_BLOCK", 32)  # several programs, the last one ragged
    dev = triton_device()
    case = [x.to(dev) for x in _random_case(3, 37, seed=11)]
    for kl_type, corr, extra in [
        ("k1", "none", {"clip_ratio_c": 3.0}),
        ("k2", "tis-token", {"delta": 1.2}),
        ("k3", ["icepop", "mask-seq"], {}),
    ]:
        kw = dict(
            loss_type=loss_type,
            kl_type=kl_type,
            correction=corr,
            loss_agg_mode="seq-mean-token-mean",
            **extra,
        )
        a = _full(*case, "torch", **kw)
        b = _full(*case, "triton", **kw)
        for x, y in zip(a[:3], b[:3]):
            assert_close(y.cpu(), x.cpu(), atol=1e-6, rtol=1e-5)
        for k in a[3]:
            assert_close(b[3][k].cpu(), a[3][k].cpu(), atol=1e-6, rtol=1e-5, what=k)


@needs_triton
def test_triton_all_masked_and_on_policy():
    dev = triton_device()
    lp = torch.zeros(2, 3, device=dev, requires_grad=True)
    loss, met = policy_loss(lp, None, torch.ones(2, device=dev), torch.zeros(2, 3, device=dev), impl="triton")
    (g,) = torch.autograd.grad(loss, [lp])
    assert float(loss.detach()) == 0 and torch.all(g == 0)
    assert float(met["ratio_mean"]) == 1.0 and float(met["n_tokens"]) == 0


@pytest.mark.parametrize("agg", sorted(AGG_BY_FN.values()))
@pytest.mark.parametrize("loss_type", LOSS_NAMES)
def test_every_loss_type_and_aggregation(loss_type, agg):
    case = _random_case(3, 4, seed=3, dtype=D)
    kw = dict(loss_type=loss_type, loss_agg_mode=agg, correction=["tis-token", "mask-token"])
    ref = _full(*case, "reference", **kw)
    got = _full(*case, "torch", **kw)
    for a, b in zip(got[:3], ref[:3]):
        assert torch.isfinite(a).all()
        assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert torch.all(got[1][0] == 0)  # the all-masked first sequence gets no gradient


def test_wrong_device_names_the_argument():
    lp = torch.zeros(2, 3)
    meta = torch.zeros(2, 3, device="meta")
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, meta, torch.ones(2), None)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, None, torch.ones(2), meta)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(lp, lp, torch.ones(2), None, LossConfig(correction="tis"), rollout_logprobs=meta)


def test_loss_config_validates_each_field():
    for kw, name in [
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(delta=0.0), "delta"),
        (dict(sapo_tau_pos=0.0), "sapo_tau_pos"),
        (dict(sapo_tau_neg=-1.0), "sapo_tau_neg"),
        (dict(loss_scale=0.0), "loss_scale"),
        (dict(eps_low="wide"), "eps_low"),
        (dict(correction=("tis-token", "nope")), "correction"),
    ]:
        with pytest.raises(ValueError, match=name):
            LossConfig(**kw)
    with pytest.raises(TypeError, match="clip_eps_low"):
        LossConfig(clip_eps_low=0.2)
    with pytest.raises(TypeError, match="loss_type"):
        policy_loss(torch.zeros(1, 2), None, torch.ones(1), None, loss_type="grpo")
    cfg = LossConfig(eps_low=0.1, correction=["tis-token", "mask-seq"], clip_ratio_c=3)
    assert cfg.eps_high == 0.1 and cfg.corrections == ("tis-token", "mask-seq") and cfg.clip_ratio_c == 3.0


def test_the_fused_kernel_table_is_the_registry_declaration():
    declared = {fn.registry_name for fn in POLICY_LOSSES.values() if fn.fused}
    assert set(pl_triton.triton_losses()) == declared == {"grpo", "cispo", "sapo"}
    assert all(POLICY_LOSSES[name].token_level for name in declared)
    with pytest.raises(ValueError, match="token_level"):
        register_policy_loss("sequence-fused-test", fused=True)
    assert "sequence-fused-test" not in POLICY_LOSSES


@needs_triton
@pytest.mark.parametrize("loss_type", ["gspo", "token-loss-test"])
def test_a_loss_without_a_fused_kernel_falls_back_loudly(loss_type):
    """A loss registered without fused=True (a sequence-level one, or a new token-level one) asked for on
    Triton runs on the torch path, with one warning naming the loss and the path."""

    @register_policy_loss("token-loss-test", token_level=True)
    def _token_loss(lp, old, adv, mask, cfg, **_):
        return POLICY_LOSSES["grpo"](lp, old, adv, mask, cfg)

    try:
        dev = triton_device()
        case = [x.to(dev) for x in _random_case(2, 5, seed=1)]
        want = _full(*case, "torch", loss_type=loss_type)
        message = f"{loss_type!r} has no fused Triton kernel.*torch path"
        with pytest.warns(FusedFallbackWarning, match=message):
            got = _full(*case, "triton", loss_type=loss_type)
        for a, b in zip(got[:3], want[:3]):
            assert_close(a.cpu(), b.cpu(), atol=0, rtol=0)
    finally:
        del POLICY_LOSSES["token-loss-test"]
