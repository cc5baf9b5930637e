"""The public op: ``policy_loss(logprobs, old_logprobs, advantages, mask, ...)`` and its autograd Function."""

from __future__ import annotations

import torch

from .._common import FLOAT_DTYPES, check_tensor, compute_dtype, resolve_impl
from .plan import build_plan, evaluate_rows, finalize_metrics
from .registry import LossConfig
from .triton import evaluate_triton, triton_supported, warn_fallback

__all__ = ["policy_loss", "policy_loss_reference", "PolicyLossFunction"]

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


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    config: LossConfig | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    impl: str | None = None,
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
            needed by ``config.correction``; rho_t = exp(old_logprobs - rollout_logprobs) (detached).
        is_weights: optional precomputed, detached correction weights [B], [B, 1] or [B, T] (e.g. a vLLM
            importance ratio) multiplied into the policy term together with the correction's weights.

    config: the loss's options, a ``LossConfig`` (default ``LossConfig()``: GRPO clip 0.2, token mean):
        loss type, clip range, aggregation, KL and entropy coefficients, rollout correction and their
        parameters, non-finite handling, and the batch-wide normalisers ``global_token_count`` /
        ``global_seq_count`` shared across data-parallel ranks and gradient-accumulation micro-batches.
    impl: "triton" | "torch" | "reference" (default: ``BITRL_KERNEL_IMPL`` or by device). A loss that the
        Triton kernel does not implement runs on the torch path, with a ``FusedFallbackWarning``.

    Returns:
        ``(loss, metrics)``: loss is a 0-dim fp32 tensor (fp64 for fp64 inputs); metrics maps names to
        detached 0-dim fp32 tensors: pg_loss, clipfrac_low/high/dual, clipfrac, ratio_mean/min/max, n_tokens,
        kl / kl_loss (with ref), entropy / entropy_loss (with entropy), masked_frac, nonfinite_frac,
        is_weight_mean/min/max/zero_frac, is_ess and mismatch_k1/k3/chi2_token/chi2_seq (with
        rollout_logprobs).
        All reductions run in fp32; correction weights are detached.
    """
    cfg = LossConfig() if config is None else config
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"config: expected a LossConfig, got {type(cfg).__name__}")
    check_tensor("logprobs", logprobs, ndim=2, dtypes=FLOAT_DTYPES)
    B, T = logprobs.shape
    dev = logprobs.device
    if entropy is not None:
        check_tensor("entropy", entropy, shape=(B, T), dtypes=FLOAT_DTYPES, device=dev)
    dtype = compute_dtype(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs)
    plan = build_plan(
        old_logprobs,
        advantages,
        mask,
        B=B,
        T=T,
        device=dev,
        dtype=dtype,
        config=cfg,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        logprobs_for_checks=logprobs,
        is_weights=is_weights,
    )
    if entropy is not None:
        bad = ~torch.isfinite(entropy.detach()) & (plan.mask > 0)
        if bool(bad.any()):
            raise ValueError("entropy: non-finite value(s) at unmasked positions")
    fp64 = any(t is not None and t.dtype == torch.float64 for t in (logprobs, old_logprobs, advantages))
    impl = resolve_impl(impl, dev, op="policy_loss", dtype=torch.float64 if fp64 else logprobs.dtype)
    if impl == "triton":
        reason = triton_supported(plan)
        if reason is not None:
            warn_fallback("policy_loss", reason, "the torch path")
            impl = "torch"
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
