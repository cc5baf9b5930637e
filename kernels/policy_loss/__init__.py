"""The clipped-ratio policy-loss family as one op: ``policy_loss(logprobs, old_logprobs, advantages, mask,
config)``, and with the LM head fused in, ``fused_linear_policy_loss(hidden, weight, targets, old_logprobs,
advantages, mask, config)``. Every option of the loss is a field of one ``LossConfig``, by one name.

Modules:

* ``registry``     LossConfig, the registries (POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, CORRECTIONS) and
  the registered losses, aggregations and KL estimators; ``corrections`` the registered rollout corrections.
* ``plan``         the two stages: ``build_plan`` (global, detached) and ``evaluate_rows`` (row-chunkable).
* ``triton``       the Triton kernel of stage 2 for the token-level losses.
* ``api``          ``policy_loss`` and ``policy_loss_reference``.
* ``fused_linear`` ``fused_linear_policy_loss`` and ``fused_linear_policy_loss_reference``.

Implementations (``impl=``, or ``BITRL_KERNEL_IMPL``):

* ``"reference"`` - stage 2 through plain autograd (keeps the autograd graph of every elementwise op).
* ``"torch"``     - stage 2 inside an autograd Function that computes d loss / d logprobs (and / d entropy)
  in the forward and saves only those [B, T] gradients; backward is one multiply.
* ``"triton"``    - stage 2 as one elementwise-plus-reduction Triton kernel producing the loss, the metric
  sums and the gradients in one pass, for the losses registered with ``fused=True`` (grpo/ppo/vanilla, cispo,
  sapo) with KL k1/k2/k3; the others (gspo, gmpo, vespo, a newly registered loss) and ``kl_is_correction``
  run on the torch path, with one ``FusedFallbackWarning`` naming the loss.
"""

from .api import policy_loss, policy_loss_reference
from .corrections import ais_coefficients, ais_moments  # (importing it registers the rollout corrections)
from .fused_linear import fused_linear_policy_loss, fused_linear_policy_loss_reference
from .plan import Plan, build_plan, evaluate_rows, finalize_metrics
from .registry import (
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    CorrectionResult,
    LossConfig,
    LossTerms,
    get_aggregation,
    get_correction,
    get_kl,
    get_policy_loss,
    register_aggregation,
    register_correction,
    register_kl,
    register_policy_loss,
    seq_mean,
    seq_sum,
)
from .triton import FusedFallbackWarning

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "CorrectionResult",
    "FusedFallbackWarning",
    "LossConfig",
    "LossTerms",
    "Plan",
    "ais_coefficients",
    "ais_moments",
    "build_plan",
    "evaluate_rows",
    "finalize_metrics",
    "fused_linear_policy_loss",
    "fused_linear_policy_loss_reference",
    "get_aggregation",
    "get_correction",
    "get_kl",
    "get_policy_loss",
    "policy_loss",
    "policy_loss_reference",
    "register_aggregation",
    "register_correction",
    "register_kl",
    "register_policy_loss",
    "seq_mean",
    "seq_sum",
]
