"""bitrl.kernels: fused ops that never build the [N, V] logits, and the clipped-ratio policy-loss family.

Public API::

    fused_logprobs(hidden, weight, targets, *, temperature=1.0, bias=None, ignore_index=-100,
                   return_entropy=True, impl=None, chunk_size=None, memory_budget=None,
                   check_finite=True) -> (logprobs [N] fp32, entropy [N] fp32 | None)
    policy_loss(logprobs, old_logprobs, advantages, mask, config=LossConfig(...), *, ref_logprobs=None,
                entropy=None, rollout_logprobs=None, is_weights=None, impl=None) -> (loss, metrics)
    fused_linear_policy_loss(hidden, weight, targets, old_logprobs, advantages, mask=None, config=None, *,
                             bias=None, temperature=1.0, ignore_index=-100, ref_logprobs=None,
                             rollout_logprobs=None, is_weights=None, compute_entropy=False,
                             chunk_size=None, memory_budget=None, check_finite=True,
                             impl=None) -> (loss, metrics)

Every option of the loss (loss_type, loss_agg_mode, eps_low, eps_high, kl_coef, correction, ...) is a field of
``LossConfig``.

Registries (one function + one decorator per variant): POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS,
CORRECTIONS in ``bitrl.kernels.policy_loss``. Implementation choice: ``impl=`` or ``BITRL_KERNEL_IMPL``
(triton | torch | reference). Triton is optional; without it the torch paths run.
"""

from ._common import HAS_TRITON, IMPLS, resolve_impl
from .fused_logprobs import fused_logprobs, fused_logprobs_reference
from .policy_loss import (
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    FusedFallbackWarning,
    LossConfig,
    fused_linear_policy_loss,
    fused_linear_policy_loss_reference,
    policy_loss,
    policy_loss_reference,
    register_aggregation,
    register_correction,
    register_kl,
    register_policy_loss,
)

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "HAS_TRITON",
    "IMPLS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "FusedFallbackWarning",
    "LossConfig",
    "fused_linear_policy_loss",
    "fused_linear_policy_loss_reference",
    "fused_logprobs",
    "fused_logprobs_reference",
    "policy_loss",
    "policy_loss_reference",
    "register_aggregation",
    "register_correction",
    "register_kl",
    "register_policy_loss",
    "resolve_impl",
]
