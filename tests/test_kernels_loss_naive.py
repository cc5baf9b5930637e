"""The policy-loss family against a naive reference written from the formulas in DESIGN.md, token by token
with Python floats (no registry, no plan machinery): the torch and Triton paths in fp32, bf16 and fp16, with
masks and hostile values (NaN / inf at masked positions, log-ratios beyond the clamp, all-masked rows).

Conventions read from the public docs of ``policy_loss``: r_t = exp(clamp(lp - old, +-20)); the correction
weight rho_t = exp(old - rollout) multiplies the policy term only (detached); loss = sum_t w_t (policy term +
kl_coef KL - entropy_coef H) with w_t the aggregation weight of the token.
"""

import math
import os

import pytest
import torch

from bitrl.kernels import LossConfig, policy_loss

CLAMP = 20.0
interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
IMPLS = ["torch"] + (["triton"] if interpret or torch.cuda.is_available() else [])


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _clip_term(r, a, eps_low, eps_high, clip_c, delta):
    """PPO/GRPO clip with DAPO's asymmetric range, the two-sided cap delta and the dual clip."""
    r_u = min(r, delta) if delta is not None else r
    term = max(-a * r_u, -a * min(max(r, 1 - eps_low), 1 + eps_high))
    if clip_c is not None and a < 0:
        term = min(term, -a * clip_c)
    return term


def naive_loss(
    lp,
    old,
    adv,
    mask,
    *,
    loss_type,
    agg,
    eps_low=0.2,
    eps_high=0.2,
    clip_c=None,
    delta=None,
    ref=None,
    kl_type="k3",
    kl_coef=0.0,
    ent=None,
    ent_coef=0.0,
    rollout=None,
    correction="none",
):
    """Python floats in, (loss, [[d loss / d lp]]) out; derivative by central differences of the loss."""
    B, T = len(lp), len(lp[0])

    def loss_of(lp):
        m = [[1.0 if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
        corr = [[1.0] * T for _ in range(B)]
        if rollout is not None:
            for b in range(B):
                log_rho = [old[b][t] - rollout[b][t] for t in range(T)]
                for t in range(T):
                    if not m[b][t]:
                        continue
                    rho = math.exp(log_rho[t])
                    if correction == "tis-token":
                        corr[b][t] = min(rho, 2.0)
                    elif correction == "icepop":
                        corr[b][t] = rho if 0.5 <= rho <= 5.0 else 0.0
                    elif correction == "mask-token" and not 0.5 <= rho <= 2.0:
                        m[b][t] = 0.0
                if correction == "tis-seq":
                    s = math.exp(sum(log_rho[t] for t in range(T) if m[b][t]))
                    corr[b] = [min(s, 2.0)] * T
        # per-token policy term
        term = [[0.0] * T for _ in range(B)]
        for b in range(B):
            toks = [t for t in range(T) if m[b][t]]
            lr = {t: max(-CLAMP, min(CLAMP, lp[b][t] - old[b][t])) for t in toks}
            for t in toks:
                a = adv[b][t]
                r = math.exp(lr[t])
                if loss_type == "grpo":
                    term[b][t] = _clip_term(r, a, eps_low, eps_high, clip_c, delta)
                elif loss_type == "cispo":  # -sg(min(r, 1 + eps_high)) A lp: the weight is a constant
                    w_c = min(math.exp(max(-CLAMP, min(CLAMP, LP0[b][t] - old[b][t]))), 1 + eps_high)
                    term[b][t] = -w_c * a * lp[b][t]
                elif loss_type == "sapo":
                    tau = 1.0 if a > 0 else 1.05
                    term[b][t] = -_sigmoid(tau * (r - 1)) * 4 / tau * a
                elif loss_type == "gspo":  # sequence ratio exp(mean_t log r_t)
                    s = math.exp(sum(lr.values()) / len(toks))
                    term[b][t] = _clip_term(s, a, eps_low, eps_high, clip_c, delta)
                elif loss_type == "gmpo":  # -A_seq exp(mean_t log r_t clipped pessimistically in log space)
                    a_seq = sum(adv[b][u] for u in toks) / len(toks)
                    sg = (a_seq > 0) - (a_seq < 0)
                    mean = sum(sg * min(sg * x, sg * max(-eps_low, min(eps_high, x))) for x in lr.values())
                    term[b][t] = -a_seq * math.exp(mean / len(toks))
                term[b][t] *= corr[b][t]
                if ref is not None:
                    d = lp[b][t] - ref[b][t]
                    kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[kl_type]
                    term[b][t] += kl_coef * kl
                if ent is not None:
                    term[b][t] -= ent_coef * ent[b][t]
        # aggregation
        n_tok = sum(map(sum, m))
        total = 0.0
        for b in range(B):
            row = sum(term[b][t] for t in range(T) if m[b][t])
            n_row = sum(m[b])
            if agg == "token-mean":
                total += row / max(n_tok, 1.0)
            elif agg == "seq-mean-token-mean":
                total += row / max(n_row, 1.0) / B
            elif agg == "seq-mean-token-sum":
                total += row / B
            elif agg == "seq-mean-token-sum-norm":
                total += row / (B * T)
        return total

    LP0 = lp
    loss = loss_of(lp)
    grad = [[0.0] * T for _ in range(B)]
    h = 1e-6
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            up = [row[:] for row in lp]
            dn = [row[:] for row in lp]
            up[b][t] += h
            dn[b][t] -= h
            grad[b][t] = (loss_of(up) - loss_of(dn)) / (2 * h)
    return loss, grad


def _case(seed, B=4, T=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + torch.randn(B, T, generator=g) * 0.3
    old[0, 1] = lp[0, 1] - 30.0  # log-ratio beyond the clamp
    adv = torch.randn(B, generator=g)
    adv[0] = abs(adv[0]) + 0.5  # > 0: row 0's beyond-the-clamp ratio is clipped, the loss stays O(1)
    adv[1] = -abs(adv[1]) - 1.0  # a clearly negative advantage: dual clip territory
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    mask[0, 1] = True  # the beyond-the-clamp token counts
    mask[3] = False  # an all-masked row
    ref = lp + torch.randn(B, T, generator=g) * 0.2
    ent = torch.rand(B, T, generator=g) * 2
    rollout = old + torch.randn(B, T, generator=g) * 0.4
    # hostile values at masked positions: they must not leak
    for t in (lp, old, ref, ent, rollout):
        t[~mask] = float("nan")
    lp[3, 0], old[3, 1] = float("inf"), float("-inf")
    lp = lp.to(dtype)
    return lp, old, adv, mask, ref, ent, rollout


def _floats(x):
    return x.double().tolist()


CASES = [
    dict(loss_type="grpo", agg="token-mean"),
    dict(loss_type="grpo", agg="seq-mean-token-mean", eps_high=0.28, clip_c=3.0),
    dict(loss_type="grpo", agg="seq-mean-token-sum", delta=1.5, kl_type="k3", kl_coef=0.1),
    dict(
        loss_type="grpo", agg="token-mean", correction="tis-token", kl_type="k1", kl_coef=0.05, ent_coef=0.01
    ),
    dict(loss_type="grpo", agg="seq-mean-token-sum-norm", correction="icepop", kl_type="k2", kl_coef=0.2),
    dict(loss_type="grpo", agg="token-mean", correction="mask-token"),
    dict(loss_type="grpo", agg="token-mean", correction="tis-seq"),
    dict(loss_type="cispo", agg="token-mean", eps_high=0.28),
    dict(loss_type="sapo", agg="seq-mean-token-mean", ent_coef=0.02),
    dict(loss_type="gspo", agg="seq-mean-token-mean", eps_low=3e-4, eps_high=4e-4),
    dict(loss_type="gmpo", agg="token-mean", eps_low=0.4, eps_high=0.4),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_loss_family_matches_naive_reference(impl, dtype, case):
    opts = dict(CASES[case])
    lp, old, adv, mask, ref, ent, rollout = _case(case, dtype=dtype)
    cfg = dict(
        loss_type=opts["loss_type"],
        loss_agg_mode=opts["agg"],
        eps_low=opts.get("eps_low", 0.2),
        eps_high=opts.get("eps_high", 0.2),
        clip_ratio_c=opts.get("clip_c"),
        delta=opts.get("delta"),
    )
    kw = dict(impl=impl)
    naive_kw = dict(
        loss_type=opts["loss_type"],
        agg=opts["agg"],
        eps_low=cfg["eps_low"],
        eps_high=cfg["eps_high"],
        clip_c=cfg["clip_ratio_c"],
        delta=cfg["delta"],
    )
    if "kl_coef" in opts:
        kw.update(ref_logprobs=ref)
        cfg.update(kl_type=opts["kl_type"], kl_coef=opts["kl_coef"])
        naive_kw.update(ref=_floats(ref), kl_type=opts["kl_type"], kl_coef=opts["kl_coef"])
    if "ent_coef" in opts:
        kw.update(entropy=ent)
        cfg.update(entropy_coef=opts["ent_coef"])
        naive_kw.update(ent=_floats(ent), ent_coef=opts["ent_coef"])
    if "correction" in opts:
        kw.update(rollout_logprobs=rollout)
        cfg.update(correction=opts["correction"])
        naive_kw.update(rollout=_floats(rollout), correction=opts["correction"])
    dev = "cuda" if impl == "triton" and not interpret else "cpu"
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    lp_leaf = lp.to(dev).requires_grad_(True)
    loss, _ = policy_loss(lp_leaf, old.to(dev), adv.to(dev), mask.to(dev), LossConfig(**cfg), **kw)
    loss.backward()
    adv_bt = adv.unsqueeze(-1).expand_as(old)
    want, want_grad = naive_loss(_floats(lp), _floats(old), _floats(adv_bt), mask.tolist(), **naive_kw)
    assert math.isfinite(loss.item())
    assert abs(loss.item() - want) <= 1e-5 * max(1.0, abs(want)), (loss.item(), want)
    grad = lp_leaf.grad.double().cpu()
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=tol, atol=tol * 1e-1)
