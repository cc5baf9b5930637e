"""The clipped-ratio policy-loss family as one op: ``policy_loss(logprobs, old_logprobs, advantages, mask)``.

The op runs in two stages so that the same code serves ``policy_loss`` and ``fused_linear_policy_loss``:

1. ``build_plan`` (global, detached): validates and sanitises the inputs, computes the rollout-correction
   weights and keep-masks, the effective token mask, and the aggregation weights w [B, T] such that
   loss = sum(w * per_token_loss). Everything that needs the whole batch happens here.
2. ``evaluate_rows`` (differentiable, row-chunkable): per-token policy term x correction weight, plus
   kl_coef * KL - entropy_coef * entropy, weighted by w and summed; plus metric partial sums.

Implementations (``impl=``, or ``BITRL_KERNEL_IMPL``):

* ``"reference"`` - stage 2 through plain autograd (keeps the autograd graph of every elementwise op).
* ``"torch"``     - stage 2 inside an autograd Function that computes d loss / d logprobs (and / d entropy)
  in the forward and saves only those [B, T] gradients; backward is one multiply.
* ``"triton"``    - stage 2 as one elementwise-plus-reduction Triton kernel producing the loss, the metric
  sums and the gradients in one pass, for the token-level losses (grpo/ppo/vanilla, cispo, sapo) with
  KL k1/k2/k3; the sequence-level losses (gspo, gmpo, vespo) and ``kl_is_correction`` use the torch path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check_tensor, compute_dtype, resolve_impl
from .core_algos import (
    CorrectionResult,
    LossConfig,
    get_aggregation,
    get_correction,
    get_kl,
    get_policy_loss,
    seq_sum,
)

__all__ = ["policy_loss", "policy_loss_reference", "build_plan", "evaluate_rows", "finalize_metrics", "Plan"]

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
    loss_type: str
    kl_type: str
    kl_coef: float
    entropy_coef: float
    kl_is_correction: bool
    on_policy: bool  # old_logprobs was None: old := logprobs.detach()
    nonfinite: str
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
    loss_type: str,
    loss_agg_mode: str,
    cfg: LossConfig,
    ref_logprobs=None,
    rollout_logprobs=None,
    correction: str | Sequence[str] = "none",
    kl_type: str = "k3",
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    kl_is_correction: bool = False,
    nonfinite: str = "raise",
    logprobs_for_checks: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> Plan:
    """Stage 1: validation, correction weights, effective mask and aggregation weights (all detached)."""
    loss_fn = get_policy_loss(loss_type)
    agg_fn = get_aggregation(loss_agg_mode)
    if ref_logprobs is not None or kl_coef:
        get_kl(kl_type)
    names = [correction] if isinstance(correction, str) else list(correction)
    corr_fns = [get_correction(n) for n in names]
    if nonfinite not in ("raise", "mask"):
        raise ValueError(f"nonfinite: expected 'raise' or 'mask', got {nonfinite!r}")
    if kl_coef and ref_logprobs is None:
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
        loss_type=loss_fn.registry_name if hasattr(loss_fn, "registry_name") else loss_type,
        kl_type=kl_type,
        kl_coef=float(kl_coef),
        entropy_coef=float(entropy_coef),
        kl_is_correction=bool(kl_is_correction),
        on_policy=on_policy,
        nonfinite=nonfinite,
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
    if getattr(fn, "uses_is_weight", False):
        kwargs["is_weight"] = corr
    terms = fn(lp, old, adv, m, plan.cfg, **kwargs)
    pg = terms.loss
    if corr is not None and not getattr(fn, "uses_is_weight", False):
        pg = pg * corr
    pg_sum = (w * pg).sum()
    loss = pg_sum
    parts: dict[str, torch.Tensor] = {}
    parts["pg"] = pg_sum.detach()
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    parts["kl_term"] = zero
    parts["kl_sum"] = zero
    if plan.ref is not None:
        kl = get_kl(plan.kl_type)(lp, plan.ref[sl])
        if plan.kl_is_correction:
            log_r = terms.log_ratio if terms.log_ratio is not None else (lp - old).clamp(-20.0, 20.0)
            kl = kl * torch.exp(log_r)
        kl_term = (w * kl).sum()
        if plan.kl_coef:
            loss = loss + plan.kl_coef * kl_term
        parts["kl_term"] = kl_term.detach()
        parts["kl_sum"] = (m * kl.detach()).sum()
    parts["ent_term"] = zero
    parts["ent_sum"] = zero
    if ent is not None:
        ent = torch.where(m > 0, ent.to(m.dtype), torch.zeros((), dtype=m.dtype, device=m.device))
        ent_term = (w * ent).sum()
        if plan.entropy_coef:
            loss = loss - plan.entropy_coef * ent_term
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


# ----------------------------------------------------------------------------------------------------------
# Triton: token-level loss + metrics + gradients in one elementwise-plus-reduction pass
# ----------------------------------------------------------------------------------------------------------

_TRITON_LOSSES = {"grpo": 0, "cispo": 1, "sapo": 2}
_TRITON_KL = {"k1": 1, "k2": 2, "k3": 3}
# partial sums per program: pg, kl_term, ent_term, n, clip_low, clip_high, clip_dual, ratio_sum, kl_sum,
# ent_sum, ratio_min, ratio_max
_NPART = 12
POLICY_BLOCK = 1024  # elements per program of the policy-loss kernel (tests lower it)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _policy_loss_kernel(
        LP,
        OLD,
        ADV,
        M,
        W,
        CORR,
        REF,
        ENT,
        DLP,
        DENT,
        PART,
        n_elem,
        eps_low,
        eps_high,
        clip_c,
        delta,
        rmax_cispo,
        tau_pos,
        tau_neg,
        lr_clamp,
        kl_coef,
        ent_coef,
        LOSS: tl.constexpr,
        KL: tl.constexpr,
        HAS_CORR: tl.constexpr,
        HAS_ENT: tl.constexpr,
        HAS_DUAL: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # int64 offsets: B * T may exceed 2**31
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n_elem
        m = tl.load(M + offs, mask=inb, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=inb, other=0.0).to(tl.float32)
        lp = tl.load(LP + offs, mask=inb, other=0.0).to(tl.float32)
        lp = tl.where(m > 0, lp, 0.0)
        old = tl.load(OLD + offs, mask=inb, other=0.0).to(tl.float32)
        adv = tl.load(ADV + offs, mask=inb, other=0.0).to(tl.float32)
        d = lp - old
        in_clamp = (d >= -lr_clamp) & (d <= lr_clamp)
        log_r = tl.minimum(tl.maximum(d, -lr_clamp), lr_clamp)
        r = tl.exp(log_r)
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        clip_lo = zero
        clip_hi = zero
        clip_du = zero
        if LOSS == 0:
            lo = 1.0 - eps_low
            hi = 1.0 + eps_high
            r_u = r
            dr_u = r
            if HAS_DELTA:
                r_u = tl.minimum(r, delta)
                dr_u = tl.where(r < delta, r, 0.0)
            r_c = tl.minimum(tl.maximum(r, lo), hi)
            dr_c = tl.where((r >= lo) & (r <= hi), r, 0.0)
            s1 = -adv * r_u
            s2 = -adv * r_c
            use1 = s1 >= s2
            pg = tl.where(use1, s1, s2)
            dpg = tl.where(use1, -adv * dr_u, -adv * dr_c)
            clip_lo = tl.where((r < lo) & (adv < 0), 1.0, 0.0)
            clip_hi = tl.where((r > hi) & (adv > 0), 1.0, 0.0)
            if HAS_DUAL:
                s3 = -adv * clip_c
                dual = (adv < 0) & (pg > s3)
                pg = tl.where(dual, s3, pg)
                dpg = tl.where(dual, 0.0, dpg)
                clip_du = tl.where(dual, 1.0, 0.0)
        elif LOSS == 1:
            wc = tl.minimum(r, rmax_cispo)
            pg = -wc * adv * lp
            dpg = -wc * adv
            clip_hi = tl.where((r > rmax_cispo) & (adv > 0), 1.0, 0.0)
        else:
            tau = tl.where(adv > 0, tau_pos, tau_neg)
            sg = tl.sigmoid(tau * (r - 1.0))
            pg = -sg * (4.0 / tau) * adv
            dpg = -4.0 * adv * sg * (1.0 - sg) * r
        if LOSS != 1:
            dpg = tl.where(in_clamp, dpg, 0.0)
        if HAS_CORR:
            c = tl.load(CORR + offs, mask=inb, other=0.0).to(tl.float32)
            pg = pg * c
            dpg = dpg * c
        dl = dpg
        kl = zero
        if KL != 0:
            ref = tl.load(REF + offs, mask=inb, other=0.0).to(tl.float32)
            if KL == 1:
                kl = lp - ref
                dkl = zero + 1.0
            elif KL == 2:
                kl = 0.5 * (lp - ref) * (lp - ref)
                dkl = lp - ref
            else:
                dd = ref - lp
                inside = (dd >= -20.0) & (dd <= 20.0)
                dd = tl.minimum(tl.maximum(dd, -20.0), 20.0)
                kl = tl.exp(dd) - dd - 1.0
                dkl = tl.where(inside, 1.0 - tl.exp(dd), 0.0)
            dl += kl_coef * dkl
        ent = zero
        if HAS_ENT:
            ent = tl.load(ENT + offs, mask=inb, other=0.0).to(tl.float32)
            ent = tl.where(m > 0, ent, 0.0)
            tl.store(DENT + offs, -ent_coef * w, mask=inb)
        tl.store(DLP + offs, w * dl, mask=inb)
        base = PART + pid * 12
        tl.store(base + 0, tl.sum(w * pg, axis=0))
        tl.store(base + 1, tl.sum(w * kl, axis=0))
        tl.store(base + 2, tl.sum(w * ent, axis=0))
        tl.store(base + 3, tl.sum(m, axis=0))
        tl.store(base + 4, tl.sum(m * clip_lo, axis=0))
        tl.store(base + 5, tl.sum(m * clip_hi, axis=0))
        tl.store(base + 6, tl.sum(m * clip_du, axis=0))
        tl.store(base + 7, tl.sum(m * r, axis=0))
        tl.store(base + 8, tl.sum(m * kl, axis=0))
        tl.store(base + 9, tl.sum(m * ent, axis=0))
        tl.store(base + 10, tl.min(tl.where(m > 0, r, 3.0e38), axis=0))
        tl.store(base + 11, tl.max(tl.where(m > 0, r, -3.0e38), axis=0))


def triton_supported(plan: Plan) -> str | None:
    """Why the Triton kernel cannot evaluate this plan (None when it can)."""
    if plan.loss_type not in _TRITON_LOSSES:
        return f"loss_type {plan.loss_type!r} is sequence-level"
    if plan.kl_is_correction:
        return "kl_is_correction"
    if plan.ref is not None and plan.kl_type not in _TRITON_KL:
        return f"kl_type {plan.kl_type!r}"
    if plan.mask.dtype == torch.float64:
        return "fp64 inputs"
    return None


def evaluate_triton(lp: torch.Tensor, ent: torch.Tensor | None, plan: Plan, rows: slice | None = None):
    """Triton stage 2 on a block of rows: (loss, parts, dlp [b, T] fp32, dent [b, T] fp32 | None)."""
    cfg = plan.cfg
    sl = rows if rows is not None else slice(None)
    mask = plan.mask[sl]
    B, T = mask.shape
    n = B * T
    dev = mask.device
    f32 = torch.float32

    def flat(x):
        return x[sl].reshape(-1).to(f32).contiguous()

    lp_f = lp.detach().reshape(-1).to(f32).contiguous()
    old_f = lp_f if plan.old is None else flat(plan.old)
    BLOCK = POLICY_BLOCK
    nblk = max(1, triton.cdiv(n, BLOCK))
    part = torch.empty(nblk, _NPART, dtype=f32, device=dev)
    dlp = torch.empty(n, dtype=f32, device=dev)
    dent = torch.empty(n, dtype=f32, device=dev) if ent is not None else dlp
    dummy = lp_f
    if n:
        _policy_loss_kernel[(nblk,)](
            lp_f,
            old_f,
            flat(plan.adv),
            flat(plan.mask),
            flat(plan.weight),
            flat(plan.corr) if plan.corr is not None else dummy,
            flat(plan.ref) if plan.ref is not None else dummy,
            ent.detach().reshape(-1).to(f32).contiguous() if ent is not None else dummy,
            dlp,
            dent,
            part,
            n,
            float(cfg.eps_low),
            float(cfg.eps_high),
            float(cfg.clip_ratio_c or 0.0),
            float(cfg.delta or 0.0),
            float(cfg.cispo_clip_max if cfg.cispo_clip_max is not None else 1.0 + cfg.eps_high),
            float(cfg.sapo_tau_pos),
            float(cfg.sapo_tau_neg),
            float(cfg.log_ratio_clamp),
            float(plan.kl_coef),
            float(plan.entropy_coef),
            LOSS=_TRITON_LOSSES[plan.loss_type],
            KL=_TRITON_KL[plan.kl_type] if plan.ref is not None else 0,
            HAS_CORR=plan.corr is not None,
            HAS_ENT=ent is not None,
            HAS_DUAL=cfg.clip_ratio_c is not None,
            HAS_DELTA=cfg.delta is not None,
            BLOCK=BLOCK,
        )
        s = part.sum(0)
        rmin, rmax = part[:, 10].amin(), part[:, 11].amax()
    else:
        s = torch.zeros(_NPART, dtype=f32, device=dev)
        rmin = torch.tensor(3.0e38, device=dev)
        rmax = torch.tensor(-3.0e38, device=dev)
    parts = {k: s[i] for i, k in enumerate(_SUM_KEYS)}
    parts["ratio_min"], parts["ratio_max"] = rmin, rmax
    loss = parts["pg"]
    if plan.ref is not None and plan.kl_coef:
        loss = loss + plan.kl_coef * parts["kl_term"]
    if ent is not None and plan.entropy_coef:
        loss = loss - plan.entropy_coef * parts["ent_term"]
    return loss, parts, dlp.view(B, T), (dent.view(B, T) if ent is not None else None)


# ----------------------------------------------------------------------------------------------------------
# autograd Function: gradients computed in the forward, saved as [B, T]
# ----------------------------------------------------------------------------------------------------------


class PolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lp, ent, plan, backend, out):
        if backend == "triton":
            loss, parts, g_lp, g_ent = evaluate_triton(lp, ent, plan)
        else:
            with torch.enable_grad():
                lp_ = lp.detach().to(plan.mask.dtype).requires_grad_(True)
                ent_ = None
                if ent is not None:
                    ent_ = ent.detach().to(plan.mask.dtype).requires_grad_(True)
                loss, parts = evaluate_rows(lp_, ent_, plan)
                leaves = [lp_] + ([ent_] if ent_ is not None else [])
                if loss.requires_grad:
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                else:
                    grads = [None] * len(leaves)
                g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp_)
                g_ent = None
                if ent_ is not None:
                    g_ent = grads[1] if grads[1] is not None else torch.zeros_like(ent_)
            loss = loss.detach()
        out["parts"] = parts
        ctx.save_for_backward(g_lp, g_ent)
        ctx.lp_dtype = lp.dtype
        ctx.ent_dtype = None if ent is None else ent.dtype
        return loss.to(plan.mask.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        g_lp, g_ent = ctx.saved_tensors
        d_lp = (g_lp * grad_out).to(ctx.lp_dtype) if ctx.needs_input_grad[0] else None
        d_ent = None
        if ctx.needs_input_grad[1] and g_ent is not None:
            d_ent = (g_ent * grad_out).to(ctx.ent_dtype)
        return d_lp, d_ent, None, None, None


# ----------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------


def make_config(
    *,
    eps_low=0.2,
    eps_high=None,
    clip_ratio_c=None,
    delta=None,
    cispo_clip_max=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    global_token_count=None,
    global_seq_count=None,
    loss_scale=None,
    correction_cap=2.0,
    correction_low=None,
    correction_high=None,
    icepop_alpha=0.5,
    icepop_beta=5.0,
    **extra,
) -> LossConfig:
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError("eps_low/eps_high: must be >= 0")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c: the dual-clip constant must be > 1, got {clip_ratio_c}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta: must be > 0, got {delta}")
    fields = LossConfig.__dataclass_fields__
    known = {k: v for k, v in extra.items() if k in fields}
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise TypeError(f"policy_loss() got unexpected keyword argument(s): {', '.join(unknown)}")
    return LossConfig(
        eps_low=float(eps_low),
        eps_high=float(eps_high),
        clip_ratio_c=clip_ratio_c,
        delta=delta,
        cispo_clip_max=cispo_clip_max,
        sapo_tau_pos=float(sapo_tau_pos),
        sapo_tau_neg=float(sapo_tau_neg),
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale=loss_scale,
        correction_cap=float(correction_cap),
        correction_low=correction_low,
        correction_high=correction_high,
        icepop_alpha=float(icepop_alpha),
        icepop_beta=float(icepop_beta),
        **known,
    )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    loss_type: str = "grpo",
    loss_agg_mode: str = "token-mean",
    eps_low: float = 0.2,
    eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    delta: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_type: str = "k3",
    kl_coef: float = 0.0,
    kl_is_correction: bool = False,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    correction: str | Sequence[str] = "none",
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    loss_scale: float | None = None,
    is_weights: torch.Tensor | None = None,
    nonfinite: str = "raise",
    impl: str | None = None,
    **kwargs,
):
    """The clipped-ratio policy loss with KL, entropy bonus and rollout correction, aggregated.

    Shapes and dtypes:
        logprobs: [B, T] fp32/bf16/fp16 (fp64 accepted), log pi_theta(y_t); differentiable.
        old_logprobs: [B, T] log pi_old(y_t) from the trainer (behaviour policy), or ``None`` for the
            on-policy case (old := logprobs.detach(), ratio 1, gradient of the surrogate = A).
        advantages: [B] (one per sequence) or [B, T].
        mask: [B, T] bool/0-1 (1 = response token in the loss), or ``None`` for all ones.
        ref_logprobs: [B, T] reference log-probs for the KL term / metric.
        entropy: [B, T] per-token entropy (e.g. from ``fused_logprobs``) for the bonus / metric.
        rollout_logprobs: [B, T] fp32 log-probs of the rollout engine (the distribution sampled from),
            needed by ``correction``; rho_t = exp(old_logprobs - rollout_logprobs) (detached).

    Options:
        loss_type: a name in ``POLICY_LOSSES``: grpo/ppo/vanilla (clip), gspo, cispo, gmpo, sapo, vespo.
        loss_agg_mode: a name in ``AGGREGATIONS``: token-mean, seq-mean-token-mean, seq-mean-token-sum,
            seq-mean-token-sum-norm (= constant / dr_grpo: divides by ``loss_scale`` or B*T),
            seq-len-weighted.
        eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] (eps_high defaults to eps_low; DAPO: 0.28).
        clip_ratio_c: dual-clip constant (> 1, typically 3) for A < 0; None disables it.
        delta: two-sided clip, caps the unclipped ratio at delta.
        cispo_clip_max, sapo_tau_pos, sapo_tau_neg: CISPO / SAPO parameters (keyword).
        kl_type: k1 | k2 | k3 (``KL_ESTIMATORS``); kl_coef: weight of the KL term in the loss.
        kl_is_correction: multiply the KL by the ratio r (importance-sampled KL).
        entropy_coef: loss -= entropy_coef * aggregate(entropy).
        correction: a name in ``CORRECTIONS`` or a list of them (weights multiply, masks intersect):
            none, tis-token, tis-seq, mask-token, mask-seq, mask-geo, icepop. Parameters (keyword):
            correction_cap (TIS C, 2.0), correction_low/high (masking bounds), icepop_alpha/beta (0.5, 5.0).
        global_token_count / global_seq_count: normalisers shared across data-parallel ranks and
            gradient-accumulation micro-batches (token-mean / sequence means).
        is_weights: optional precomputed, detached correction weights [B], [B, 1] or [B, T] (e.g. a vLLM
            importance ratio) multiplied into the policy term together with ``correction``'s weights.
        loss_scale: the constant of the constant-normaliser aggregation (Dr.GRPO: B * max_len).
        nonfinite: "raise" (ValueError naming the argument) or "mask" (drop those tokens) for NaN/inf in
            the inputs at unmasked positions. Masked positions may hold anything.
        impl: "triton" | "torch" | "reference" (default: ``BITRL_KERNEL_IMPL`` or by device).

    Returns:
        ``(loss, metrics)``: loss is a 0-dim fp32 tensor (fp64 for fp64 inputs); metrics maps names to
        detached 0-dim fp32 tensors: pg_loss, clipfrac_low/high/dual, clipfrac, ratio_mean/min/max, n_tokens,
        kl / kl_loss (with ref), entropy / entropy_loss (with entropy), masked_frac, nonfinite_frac,
        is_weight_mean/min/max/zero_frac, is_ess and mismatch_k1/k3/chi2_token/chi2_seq (with
        rollout_logprobs).
        All reductions run in fp32; correction weights are detached.
    """
    check_tensor("logprobs", logprobs, ndim=2, dtypes=FLOAT_DTYPES)
    B, T = logprobs.shape
    dev = logprobs.device
    if entropy is not None:
        check_tensor("entropy", entropy, shape=(B, T), dtypes=FLOAT_DTYPES, device=dev)
    cfg = make_config(
        eps_low=eps_low,
        eps_high=eps_high,
        clip_ratio_c=clip_ratio_c,
        delta=delta,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale=loss_scale,
        **kwargs,
    )
    dtype = compute_dtype(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs)
    plan = build_plan(
        old_logprobs,
        advantages,
        mask,
        B=B,
        T=T,
        device=dev,
        dtype=dtype,
        loss_type=loss_type,
        loss_agg_mode=loss_agg_mode,
        cfg=cfg,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        correction=correction,
        kl_type=kl_type,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        kl_is_correction=kl_is_correction,
        nonfinite=nonfinite,
        logprobs_for_checks=logprobs,
        is_weights=is_weights,
    )
    if entropy is not None:
        bad = ~torch.isfinite(entropy.detach()) & (plan.mask > 0)
        if bool(bad.any()):
            raise ValueError("entropy: non-finite value(s) at unmasked positions")
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (logprobs, old_logprobs, advantages))
    impl = resolve_impl(impl, dev, op="policy_loss", dtype=torch.float64 if fp64 else logprobs.dtype)
    if impl == "triton" and triton_supported(plan) is not None:
        impl = "torch"  # documented fallback for sequence-level losses
    if impl == "reference":
        loss, parts = evaluate_rows(logprobs, entropy, plan)
    else:
        out: dict = {}
        loss = PolicyLossFunction.apply(logprobs, entropy, plan, impl, out)
        parts = out["parts"]
    return loss, finalize_metrics(parts, plan, has_entropy=entropy is not None)


def policy_loss_reference(*args, **kwargs):
    """``policy_loss`` through plain autograd (``impl="reference"``)."""
    kwargs["impl"] = "reference"
    return policy_loss(*args, **kwargs)
