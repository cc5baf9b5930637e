"""verl: bitrl's policy losses in verl's policy-loss registry, and bitrl's fused log-prob head.

One call in the process that builds the actor (before training)::

    from bitrl.integrations.verl import register
    register()                       # then actor_rollout_ref.actor.policy_loss.loss_mode=bitrl_cispo

``register(correction=None, fused_kernels=False, **options)`` adds ``bitrl_<name>`` for every loss in
``bitrl.kernels.POLICY_LOSSES`` (bitrl_grpo, bitrl_gspo, bitrl_cispo, bitrl_sapo, bitrl_gmpo, bitrl_vespo) to
``verl.trainer.ppo.core_algos``'s registry. Each is called exactly as verl's actor calls a policy loss,
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``, and
returns ``(loss, metrics)``:

* Options read from verl's actor config: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
  ``clip_ratio_c`` (dual clip, 3.0 as in verl), ``loss_agg_mode`` and ``global_batch_info`` (dp_size,
  batch_num_tokens, global_batch_size, loss_scale_factor: the same global normalisers as verl's ``agg_loss``
  for token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm). A
  DictConfig actor config may also carry a ``bitrl`` mapping
  (``+actor_rollout_ref.actor.bitrl.correction=ais``) that overrides ``register``'s options; verl's typed
  ``ActorConfig`` is closed, so there the options come from ``register``.
* ``rollout_is_weights``: without a bitrl correction they multiply the policy term, as in verl. With one
  (``correction="icepop"``, ``"mask-geo"``, ``"reject-k3-seq-mean"``, ``"ais"``, ...), they are read as the
  raw per-token ratio rho = pi_old / pi_rollout (set verl's ``rollout_correction.rollout_is=token`` with a
  threshold high enough not to truncate) and bitrl's correction turns them into weights and masks.
* Metrics: verl's ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, plus bitrl's
  diagnostics as ``actor/bitrl/<name>``.

``fused_kernels=True`` also makes verl's fused-kernel model path (``use_fused_kernels`` with the torch
backend, ``verl.utils.experimental.torch_functional.FusedLinearForPPO``) compute its log-probs and entropy
with ``bitrl.kernels.fused_logprobs`` (same inputs and outputs).
"""

from __future__ import annotations

import torch

from ..kernels import POLICY_LOSSES, LossConfig, fused_logprobs, policy_loss

__all__ = ["register", "bitrl_policy_loss", "bitrl_fused_linear_for_ppo", "LOSS_NAMES", "aggregation_options"]

LOSS_NAMES = sorted({fn.registry_name for fn in POLICY_LOSSES.values()})
_OPTIONS: dict = {}


def _get(config, key, default=None):
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def aggregation_options(loss_agg_mode: str, mask: torch.Tensor, config) -> dict:
    """bitrl ``LossConfig`` aggregation fields equal to verl's
    ``agg_loss(loss_agg_mode, **global_batch_info)``.

    verl scales every mode by dp_size so that the data-parallel gradient average yields the global-batch
    normaliser; bitrl's counts are per rank, hence the division by dp_size here.
    """
    info = dict(_get(config, "global_batch_info", {}) or {})
    dp = float(info.get("dp_size") or 1)
    tokens, seqs, factor = (
        info.get("batch_num_tokens"),
        info.get("global_batch_size"),
        info.get("loss_scale_factor"),
    )
    if dp > 1 and (
        (loss_agg_mode == "token-mean" and tokens is None)
        or (loss_agg_mode.startswith("seq") and seqs is None)
    ):
        raise ValueError(
            f"global_batch_info: verl needs the global batch size/token count when dp_size > 1 "
            f"(loss_agg_mode={loss_agg_mode!r})"
        )
    nonempty = (mask.sum(-1) > 0).sum().clamp(min=1).to(torch.float32)
    n_seq = (float(seqs) if seqs is not None else nonempty) / dp
    if loss_agg_mode == "token-mean":
        count = float(tokens) / dp if tokens is not None else mask.sum().clamp(min=1).to(torch.float32)
        return {"loss_agg_mode": "token-mean", "global_token_count": count}
    if loss_agg_mode == "token-sum":
        return {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale": 1.0 / dp}
    if loss_agg_mode == "seq-mean-token-mean":
        return {"loss_agg_mode": "seq-mean-token-mean", "global_seq_count": n_seq}
    if loss_agg_mode == "seq-mean-token-sum":
        return {"loss_agg_mode": "seq-mean-token-sum", "global_seq_count": n_seq}
    if loss_agg_mode == "seq-mean-token-sum-norm":
        horizon = float(factor) if factor is not None else float(mask.shape[-1])
        return {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale": float(n_seq) * horizon}
    raise ValueError(f"loss_agg_mode: verl's {loss_agg_mode!r} has no bitrl equivalent")


def bitrl_policy_loss(
    loss_type: str,
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """One of bitrl's policy losses with verl's arguments, aggregation and metric names -> (loss, metrics)."""
    options = dict(_OPTIONS)
    extra = _get(config, "bitrl", None)
    if extra:
        options.update(dict(extra))
    correction = options.pop("correction", None) or "none"
    clip = _get(config, "clip_ratio", 0.2)
    kwargs = {
        "eps_low": _get(config, "clip_ratio_low", clip),
        "eps_high": _get(config, "clip_ratio_high", clip),
    }
    if loss_type == "grpo":
        kwargs["clip_ratio_c"] = _get(config, "clip_ratio_c", 3.0)
    mask = response_mask.bool()
    kwargs.update(aggregation_options(loss_agg_mode, mask, config))
    tensors = {}
    names = [correction] if isinstance(correction, str) else list(correction)
    if any(n != "none" for n in names):
        if rollout_is_weights is None:
            raise ValueError(
                f"correction={correction!r}: needs verl's per-token rollout ratio; set "
                "algorithm.rollout_correction.rollout_is=token with a threshold that does not truncate"
            )
        acc = torch.promote_types(old_log_prob.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        log_rho = torch.log(rollout_is_weights.detach().to(acc).clamp(min=1e-30))
        tensors["rollout_logprobs"] = old_log_prob.detach().to(acc) - log_rho
        kwargs["correction"] = names
    elif rollout_is_weights is not None:
        tensors["is_weights"] = rollout_is_weights
    kwargs.update(options)
    loss_config = LossConfig(loss_type=loss_type, **kwargs)
    loss, m = policy_loss(log_prob, old_log_prob, advantages, mask, loss_config, **tensors)
    with torch.no_grad():
        log_ratio = (log_prob.detach() - old_log_prob).clamp(-20.0, 20.0)
        ppo_kl = (-log_ratio * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": m["clipfrac"].item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": m["clipfrac_dual"].item(),
    }
    for key, value in m.items():
        if key not in ("clipfrac", "clipfrac_dual", "pg_loss"):
            metrics[f"actor/bitrl/{key}"] = value.item()
    return loss, metrics


def _make_loss(loss_type: str):
    def loss_fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return bitrl_policy_loss(
            loss_type,
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
        )

    loss_fn.__name__ = f"bitrl_{loss_type}"
    loss_fn.__doc__ = f"bitrl's {loss_type!r} policy loss, called as a verl policy loss."
    return loss_fn


def bitrl_fused_linear_for_ppo(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
    """``FusedLinearForPPO.forward`` on bitrl's fused op: (log_probs, entropy), each shaped like input_ids."""
    shape = input_ids.shape
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    weight = vocab_weights if vocab_weights.dtype == hidden.dtype else vocab_weights.to(hidden.dtype)
    lp, ent = fused_logprobs(hidden, weight, input_ids.reshape(-1).to(torch.int64), temperature=temperature)
    return lp.reshape(shape), ent.reshape(shape)


def register(correction=None, fused_kernels: bool = False, **options):
    """Register ``bitrl_<loss>`` for every bitrl loss in verl's policy-loss registry. Returns the names.

    correction: a bitrl correction name or list (``bitrl.kernels.CORRECTIONS``); options: other fields of
    ``bitrl.kernels.LossConfig`` (correction_cap, icepop_alpha, reject_threshold, cispo_clip_max, ...).
    fused_kernels: also route verl's torch fused-kernel LM head through ``bitrl.kernels.fused_logprobs``.
    """
    from verl.trainer.ppo import core_algos

    _OPTIONS.clear()
    _OPTIONS.update(options, correction=correction)
    names = []
    for loss_type in LOSS_NAMES:
        name = f"bitrl_{loss_type}"
        core_algos.register_policy_loss(name)(_make_loss(loss_type))
        names.append(name)
    if fused_kernels:
        from verl.utils.experimental import torch_functional

        torch_functional.FusedLinearForPPO.forward = bitrl_fused_linear_for_ppo
    return names
