"""Liger-Kernel compatibility: ``FusedLinearGRPOLoss``, an ``nn.Module`` whose constructor and forward accept
the arguments of Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (same meaning, same ``(loss, metrics_tuple)``
return), computed by ``bitrl.kernels.fused_linear_policy_loss``, plus bitrl's extras (rollout corrections,
KL estimator choice, entropy bonus, dual clip, implementation)::

    from bitrl.integrations.liger import FusedLinearGRPOLoss
    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo")   # in place of LigerFusedLinearGRPOLoss
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import LossConfig, fused_linear_policy_loss, fused_logprobs
from ..kernels._common import FLOAT_DTYPES, check_tensor

__all__ = ["FusedLinearGRPOLoss"]

# Liger loss_type -> (bitrl loss_type, aggregation)
_LIGER_LOSS_TYPES = {
    "grpo": ("grpo", "seq-mean-token-mean"),
    "bnpo": ("grpo", "token-mean"),
    "dr_grpo": ("grpo", "seq-mean-token-sum-norm"),
    "dapo": ("grpo", "token-mean"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "luspo": ("grpo", "seq-len-weighted"),
    "vespo": ("vespo", "token-mean"),
}


def _dapo_normalizer(mask: torch.Tensor, num_items_in_batch):
    """Tokens per process for dapo/cispo/vespo: num_items_in_batch / world, else all-reduced count / world."""
    world = 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if num_items_in_batch is not None:
        n = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
        return (n / world).clamp(min=1.0)
    n = mask.to(torch.float32).sum()
    if world > 1:
        n = n.clone()
        dist.all_reduce(n)
    return (n / world).clamp(min=1.0)


class FusedLinearGRPOLoss(torch.nn.Module):
    """Drop-in replacement for Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (a superset).

    Constructor arguments with Liger's meaning: beta (KL coefficient, k3 estimator), compiled (accepted,
    unused: nothing here needs torch.compile), use_ref_model, chunk_size (sequences per chunk; Liger's
    default of 1 is honoured only if given explicitly, otherwise a memory budget picks it), epsilon_low,
    epsilon_high, loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo),
    max_completion_length (dr_grpo), importance_sampling_level ("token" or "sequence" = GSPO),
    sapo_temperature_pos/neg, temperature, delta, use_bias_correction_kl, vespo_k_pos/lambda_pos/k_neg/
    lambda_neg. bitrl extras: clip_ratio_c (dual clip), kl_type, entropy_coef, correction (+ its keyword
    parameters via ``correction_kwargs``), impl.

    ``forward(_input [B, T, H], lin_weight [V, H], selected_token_ids [B, T], attention_mask [B, T],
    advantages [B], bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
    ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None, rollout_logprobs=None)``
    returns ``(loss, (kl_mean, clip_ratio))`` - ``kl_mean`` only when beta != 0, as in Liger. The full
    metrics dict of the last call is kept in ``self.last_metrics``.
    """

    def __init__(
        self,
        beta: float = 0.04,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        *,
        clip_ratio_c: float | None = None,
        kl_type: str = "k3",
        entropy_coef: float = 0.0,
        correction: str | Sequence[str] = "none",
        correction_kwargs: dict | None = None,
        impl: str | None = None,
    ):
        super().__init__()
        if loss_type not in _LIGER_LOSS_TYPES:
            raise ValueError(f"loss_type: unknown {loss_type!r}; choose one of {sorted(_LIGER_LOSS_TYPES)}")
        if importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                "importance_sampling_level: expected 'token' or 'sequence', "
                f"got {importance_sampling_level!r}"
            )
        if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(
                f"importance_sampling_level: 'sequence' is not supported for loss_type={loss_type!r}"
            )
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("max_completion_length: required for loss_type='dr_grpo'")
        if sapo_temperature_pos <= 0:
            raise ValueError(f"sapo_temperature_pos: must be positive, got {sapo_temperature_pos}")
        if sapo_temperature_neg <= 0:
            raise ValueError(f"sapo_temperature_neg: must be positive, got {sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta: must be positive, got {delta}")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.clip_ratio_c = clip_ratio_c
        self.kl_type = kl_type
        self.entropy_coef = entropy_coef
        self.correction = correction
        self.correction_kwargs = dict(correction_kwargs or {})
        self.impl = impl
        self.last_metrics: dict[str, torch.Tensor] = {}

    def forward(
        self,
        _input,
        lin_weight,
        selected_token_ids,
        attention_mask,
        advantages,
        bias=None,
        ref_per_token_logps=None,
        old_per_token_logps=None,
        ref_input=None,
        ref_weight=None,
        ref_bias=None,
        vllm_is_ratio=None,
        num_items_in_batch=None,
        rollout_logprobs=None,
    ):
        check_tensor("selected_token_ids", selected_token_ids, ndim=2, dtypes=(torch.int64, torch.int32))
        B, T = selected_token_ids.shape
        check_tensor("attention_mask", attention_mask, shape=(B, T), device=selected_token_ids.device)
        check_tensor("advantages", advantages, ndim=(1, 2), dtypes=FLOAT_DTYPES)
        loss_type, agg = _LIGER_LOSS_TYPES[self.loss_type]
        if self.importance_sampling_level == "sequence":
            loss_type = "gspo"
        ref = None
        if self.use_ref_model:
            if ref_per_token_logps is not None:
                ref = ref_per_token_logps
            elif ref_input is not None:
                if ref_weight is None:
                    raise ValueError("ref_weight: required with ref_input")
                with torch.no_grad():
                    ref, _ = fused_logprobs(
                        ref_input.reshape(B * T, ref_input.shape[-1]),
                        ref_weight,
                        selected_token_ids.reshape(-1),
                        temperature=self.temperature,
                        bias=ref_bias,
                        return_entropy=False,
                        impl=self.impl,
                    )
                ref = ref.view(B, T)
            elif self.beta != 0.0:
                raise ValueError(
                    "ref_per_token_logps: use_ref_model=True needs ref_per_token_logps or ref_input"
                )
        kw = dict(self.correction_kwargs)
        if self.loss_type in ("dapo", "cispo", "vespo"):
            kw["global_token_count"] = _dapo_normalizer(attention_mask, num_items_in_batch)
        elif self.loss_type == "dr_grpo":
            kw["loss_scale"] = float(B * self.max_completion_length)
        if self.loss_type == "cispo":
            kw["cispo_clip_max"] = self.epsilon_high
        config = LossConfig(
            loss_type=loss_type,
            loss_agg_mode=agg,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            clip_ratio_c=self.clip_ratio_c,
            delta=self.delta,
            kl_type=self.kl_type,
            kl_coef=self.beta if ref is not None else 0.0,
            kl_is_correction=self.use_bias_correction_kl,
            entropy_coef=self.entropy_coef,
            correction=self.correction,
            sapo_tau_pos=self.sapo_temperature_pos,
            sapo_tau_neg=self.sapo_temperature_neg,
            vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg,
            **kw,
        )
        loss, metrics = fused_linear_policy_loss(
            _input,
            lin_weight,
            selected_token_ids,
            old_per_token_logps,
            advantages,
            attention_mask,
            config,
            bias=bias,
            temperature=self.temperature,
            ref_logprobs=ref,
            rollout_logprobs=rollout_logprobs,
            is_weights=vllm_is_ratio,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
        self.last_metrics = metrics
        out = []
        n = attention_mask.to(torch.float32).sum().clamp(min=1.0)
        if self.beta != 0.0:
            kl = metrics.get("kl", torch.zeros((), device=loss.device))
            # Liger normalises by the attention-mask count; bitrl's "kl" is over the loss tokens
            out.append(kl * metrics["n_tokens"] / n)
        out.append(metrics["clipfrac"] * metrics["n_tokens"] / n)
        return loss, tuple(out)
