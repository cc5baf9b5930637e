"""The two stages of the policy loss, shared by ``policy_loss`` and ``fused_linear_policy_loss``.

1. ``build_plan`` (global, detached): validates and sanitises the inputs, computes the rollout-correction
   weights and keep-masks, the effective token mask, and the aggregation weights w [B, T] such that
   loss = sum(w * per_token_loss). Everything that needs the whole batch happens here.
2. ``evaluate_rows`` (differentiable, row-chunkable): per-token policy term x correction weight, plus
   kl_coef * KL - entropy_coef * entropy, weighted by w and summed; plus metric partial sums, which
   ``merge_parts`` adds over chunks and ``finalize_metrics`` turns into the metrics dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._common import FLOAT_DTYPES, check_tensor
from .registry import (
    CorrectionResult,
    LossConfig,
    get_aggregation,
    get_correction,
    get_kl,
    get_policy_loss,
    seq_sum,
)

__all__ = ["Plan", "build_plan", "evaluate_rows", "finalize_metrics", "flat_plan", "merge_parts"]

_MASK_DTYPES = (
    torch.bool,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
)


@dataclass
class Plan:
    """Stage-1 output: detached [B, T] tensors in the compute dtype plus the configuration."""

    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor  # effective 0/1 mask (valid & finite & kept by the corrections)
    weight: torch.Tensor  # aggregation weights (zero outside the mask)
    corr: torch.Tensor | None  # correction weight for the policy term
    ref: torch.Tensor | None
    cfg: LossConfig
    loss_type: str  # the registered name of cfg.loss_type (aliases resolved)
    on_policy: bool  # old_logprobs was None: old := logprobs.detach()
    metrics: dict  # metrics known after stage 1 (corrections, masking)


def _as_bt(name: str, t, B: int, T: int, device, allow_b: bool = False):
    if allow_b and isinstance(t, torch.Tensor) and t.dim() == 1:
        check_tensor(name, t, shape=(B,), dtypes=FLOAT_DTYPES, device=device)
        return t.unsqueeze(-1).expand(B, T)
    check_tensor(name, t, shape=(B, T), dtypes=FLOAT_DTYPES, device=device)
    return t


def _nonfinite(name: str, x: torch.Tensor, valid: torch.Tensor, mode: str):
    """Bool [B, T] of non-finite entries at valid positions; raises in mode 'raise'."""
    bad = ~torch.isfinite(x) & valid
    if mode == "raise" and bool(bad.any()):
        raise ValueError(f"{name}: {int(bad.sum())} non-finite value(s) at unmasked positions")
    return bad


def build_plan(
    old_logprobs,
    advantages,
    mask,
    *,
    B: int,
    T: int,
    device,
    dtype: torch.dtype,
    config: LossConfig,
    ref_logprobs=None,
    rollout_logprobs=None,
    logprobs_for_checks: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> Plan:
    """Stage 1: validation, correction weights, effective mask and aggregation weights (all detached)."""
    cfg = config
    loss_fn = get_policy_loss(cfg.loss_type)
    agg_fn = get_aggregation(cfg.loss_agg_mode)
    names = cfg.corrections
    corr_fns = [get_correction(n) for n in names]
    nonfinite = cfg.nonfinite
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef != 0")

    if mask is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
    else:
        check_tensor("mask", mask, shape=(B, T), dtypes=_MASK_DTYPES, device=device)
        valid = mask.bool() if mask.dtype == torch.bool else mask != 0
    adv = _as_bt("advantages", advantages, B, T, device, allow_b=True)
    on_policy = old_logprobs is None
    old = None if on_policy else _as_bt("old_logprobs", old_logprobs, B, T, device)
    ref = None if ref_logprobs is None else _as_bt("ref_logprobs", ref_logprobs, B, T, device)
    roll = None if rollout_logprobs is None else _as_bt("rollout_logprobs", rollout_logprobs, B, T, device)
    if any(n != "none" for n in names) and roll is None:
        raise ValueError("rollout_logprobs: required when correction != 'none'")

    named = [
        (name, x)
        for name, x in (
            ("logprobs", logprobs_for_checks),
            ("old_logprobs", old),
            ("advantages", adv),
            ("ref_logprobs", ref),
            ("rollout_logprobs", roll),
        )
        if x is not None
    ]
    bads = [~torch.isfinite(x.detach()) & valid for _, x in named]
    bad = torch.zeros(B, T, dtype=torch.bool, device=device)
    for b in bads:
        bad |= b
    if nonfinite == "raise" and bads:
        counts = torch.stack([b.sum() for b in bads]).tolist()  # one device sync for all inputs
        for (name, _), n in zip(named, counts):
            if n:
                raise ValueError(f"{name}: {int(n)} non-finite value(s) at unmasked positions")
    finite_valid = valid & ~bad

    def clean(x):
        if x is None:
            return None
        x = x.detach().to(dtype)
        return torch.where(finite_valid, x, torch.zeros((), dtype=dtype, device=device))

    adv_c, old_c, ref_c, roll_c = clean(adv), clean(old), clean(ref), clean(roll)
    m = finite_valid.to(dtype)
    metrics: dict[str, torch.Tensor] = {}
    n_valid = valid.to(dtype).sum().clamp(min=1.0)

    corr_w = None
    keep = finite_valid
    if roll_c is not None and old_c is None and any(n != "none" for n in names):
        if logprobs_for_checks is None:
            raise ValueError(
                "old_logprobs: required with a rollout correction when the current log-probs are unknown"
            )
        old_for_rho = torch.where(finite_valid, logprobs_for_checks.detach().to(dtype), 0.0)
    else:
        old_for_rho = old_c
    if roll_c is not None and old_for_rho is not None:
        log_rho = (old_for_rho - roll_c) * m
        for fn in corr_fns:
            res: CorrectionResult = fn(log_rho, m, cfg)
            if res.weight is not None:
                w_ = res.weight.detach().to(dtype)
                corr_w = w_ if corr_w is None else corr_w * w_
            if res.keep is not None:
                keep = keep & res.keep
        # mismatch diagnostics over the valid finite tokens
        nf = m.sum().clamp(min=1.0)
        rho = torch.exp(log_rho.clamp(-20.0, 20.0))
        metrics["mismatch_k1"] = (-(log_rho) * m).sum() / nf
        metrics["mismatch_k3"] = ((rho - 1.0 - log_rho) * m).sum() / nf
        metrics["mismatch_chi2_token"] = (rho.square() * m).sum() / nf - 1.0
        rho_seq = torch.exp(seq_sum(log_rho, m).clamp(-20.0, 20.0))
        has = (m.sum(-1) > 0).to(dtype)
        metrics["mismatch_chi2_seq"] = (rho_seq.square() * has).sum() / has.sum().clamp(min=1.0) - 1.0
    if is_weights is not None:
        if is_weights.dim() == 1:
            check_tensor("is_weights", is_weights, shape=(B,), dtypes=FLOAT_DTYPES, device=device)
            is_weights = is_weights.unsqueeze(-1)
        check_tensor("is_weights", is_weights, shape=(B, None), dtypes=FLOAT_DTYPES, device=device)
        if is_weights.shape[1] not in (1, T):
            raise ValueError(
                f"is_weights: expected shape [{B}], [{B}, 1] or [{B}, {T}], got {list(is_weights.shape)}"
            )
        iw = is_weights.detach().to(dtype).expand(B, T)
        _nonfinite("is_weights", iw, finite_valid, nonfinite)
        iw = torch.where(finite_valid & torch.isfinite(iw), iw, torch.zeros((), dtype=dtype, device=device))
        corr_w = iw if corr_w is None else corr_w * iw
    m_eff = keep.to(dtype) * m
    weight = agg_fn(m_eff, cfg).to(dtype) * m_eff
    if corr_w is not None:
        corr_w = corr_w * m_eff
        ne = m_eff.sum().clamp(min=1.0)
        metrics["is_weight_mean"] = corr_w.sum() / ne
        big = torch.finfo(dtype).max
        metrics["is_weight_min"] = (
            torch.where(m_eff > 0, corr_w, big).amin() if corr_w.numel() else corr_w.sum()
        )
        metrics["is_weight_max"] = (
            torch.where(m_eff > 0, corr_w, -big).amax() if corr_w.numel() else corr_w.sum()
        )
        # IcePop-style corrections drop a token from the gradient by a zero weight rather than a mask
        metrics["is_weight_zero_frac"] = ((corr_w == 0) & (m_eff > 0)).to(dtype).sum() / ne
        wn = corr_w / (metrics["is_weight_mean"].clamp(min=1e-30))
        metrics["is_ess"] = 1.0 / ((wn.square() * m_eff).sum() / ne).clamp(min=1e-30)
    metrics["masked_frac"] = (valid.to(dtype).sum() - m_eff.sum()) / n_valid
    metrics["nonfinite_frac"] = bad.to(dtype).sum() / n_valid

    return Plan(
        old=old_c,
        adv=adv_c,
        mask=m_eff,
        weight=weight,
        corr=corr_w,
        ref=ref_c,
        cfg=cfg,
        loss_type=loss_fn.registry_name,
        on_policy=on_policy,
        metrics=metrics,
    )


_SUM_KEYS = (
    "pg",
    "kl_term",
    "ent_term",
    "n",
    "clip_low",
    "clip_high",
    "clip_dual",
    "ratio_sum",
    "kl_sum",
    "ent_sum",
)


def flat_plan(plan: Plan) -> Plan:
    """The plan with each [B, T] tensor viewed as one [1, B*T] row, so that a token-level loss can be
    evaluated on runs of tokens that cross sequence boundaries (``evaluate_rows(..., rows=(slice(None),
    slice(s, e)))``); everything batch-wide in it was computed from the whole batch already."""

    bt = plan.mask.shape
    tensors = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    return dataclasses.replace(
        plan,
        **{k: t.reshape(1, -1) for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.shape == bt},
    )


def evaluate_rows(lp: torch.Tensor, ent: torch.Tensor | None, plan: Plan, rows: slice | None = None):
    """Stage 2 on a block of rows: returns (loss contribution, metric partials dict). Differentiable."""
    sl = rows if rows is not None else slice(None)
    m = plan.mask[sl]
    w = plan.weight[sl]
    lp = torch.where(m > 0, lp.to(m.dtype), torch.zeros((), dtype=m.dtype, device=m.device))
    old = lp.detach() if plan.old is None else plan.old[sl]
    adv = plan.adv[sl]
    corr = None if plan.corr is None else plan.corr[sl]
    fn = get_policy_loss(plan.loss_type)
    kwargs = {}
    if fn.uses_is_weight:
        kwargs["is_weight"] = corr
    terms = fn(lp, old, adv, m, plan.cfg, **kwargs)
    pg = terms.loss
    if corr is not None and not fn.uses_is_weight:
        pg = pg * corr
    pg_sum = (w * pg).sum()
    loss = pg_sum
    parts: dict[str, torch.Tensor] = {}
    parts["pg"] = pg_sum.detach()
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    parts["kl_term"] = zero
    parts["kl_sum"] = zero
    if plan.ref is not None:
        kl = get_kl(plan.cfg.kl_type)(lp, plan.ref[sl])
        if plan.cfg.kl_is_correction:
            log_r = terms.log_ratio if terms.log_ratio is not None else (lp - old).clamp(-20.0, 20.0)
            kl = kl * torch.exp(log_r)
        kl_term = (w * kl).sum()
        if plan.cfg.kl_coef:
            loss = loss + plan.cfg.kl_coef * kl_term
        parts["kl_term"] = kl_term.detach()
        parts["kl_sum"] = (m * kl.detach()).sum()
    parts["ent_term"] = zero
    parts["ent_sum"] = zero
    if ent is not None:
        ent = torch.where(m > 0, ent.to(m.dtype), torch.zeros((), dtype=m.dtype, device=m.device))
        ent_term = (w * ent).sum()
        if plan.cfg.entropy_coef:
            loss = loss - plan.cfg.entropy_coef * ent_term
        parts["ent_term"] = ent_term.detach()
        parts["ent_sum"] = (m * ent.detach()).sum()
    parts["n"] = m.sum()
    for key, flag in (
        ("clip_low", terms.clipped_low),
        ("clip_high", terms.clipped_high),
        ("clip_dual", terms.clipped_dual),
    ):
        parts[key] = zero if flag is None else (m * flag.to(m.dtype)).sum()
    r = terms.ratio.detach()
    parts["ratio_sum"] = (m * r).sum()
    big = torch.finfo(m.dtype).max
    parts["ratio_min"] = torch.where(m > 0, r, big).amin() if r.numel() else zero + big
    parts["ratio_max"] = torch.where(m > 0, r, -big).amax() if r.numel() else zero - big
    return loss, parts


def merge_parts(acc: dict | None, parts: dict) -> dict:
    if acc is None:
        return dict(parts)
    out = {}
    for k, v in parts.items():
        if k == "ratio_min":
            out[k] = torch.minimum(acc[k], v)
        elif k == "ratio_max":
            out[k] = torch.maximum(acc[k], v)
        else:
            out[k] = acc[k] + v
    return out


def finalize_metrics(parts: dict, plan: Plan, has_entropy: bool = False) -> dict[str, torch.Tensor]:
    """Turn the summed partials into the metrics dict (0-dim fp32 tensors, detached)."""
    n = parts["n"].clamp(min=1.0)
    has = parts["n"] > 0
    out = {
        "pg_loss": parts["pg"],
        "clipfrac_low": parts["clip_low"] / n,
        "clipfrac_high": parts["clip_high"] / n,
        "clipfrac": (parts["clip_low"] + parts["clip_high"]) / n,
        "clipfrac_dual": parts["clip_dual"] / n,
        "ratio_mean": torch.where(has, parts["ratio_sum"] / n, torch.ones_like(n)),
        "ratio_min": torch.where(has, parts["ratio_min"], torch.ones_like(n)),
        "ratio_max": torch.where(has, parts["ratio_max"], torch.ones_like(n)),
        "n_tokens": parts["n"],
    }
    if plan.ref is not None:
        out["kl"] = parts["kl_sum"] / n
        out["kl_loss"] = parts["kl_term"]
    if has_entropy:
        out["entropy"] = parts["ent_sum"] / n
        out["entropy_loss"] = parts["ent_term"]
    out.update(plan.metrics)
    return {k: v.detach().to(torch.float32) for k, v in out.items()}
