"""The public op: ``policy_loss(logprobs, old_logprobs, advantages, mask, ...)`` and its autograd Function."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._common import FLOAT_DTYPES, check_tensor, compute_dtype, resolve_impl
from .plan import build_plan, evaluate_rows, finalize_metrics
from .registry import LossConfig
from .triton import evaluate_triton, triton_supported

__all__ = ["policy_loss", "policy_loss_reference", "make_config", "PolicyLossFunction"]

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
