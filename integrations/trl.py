"""TRL: run a ``GRPOTrainer`` on bitrl's fused log-prob/entropy and policy-loss family.

One call after building the trainer, before ``train()``::

    from bitrl.integrations.trl import use_bitrl
    use_bitrl(trainer)                                  # same objective as TRL, bitrl's kernels
    use_bitrl(trainer, correction="icepop")             # plus a rollout correction TRL lacks

What it changes:

* The model's fused LM head (TRL's ``add_fused_lm_head``, backed by ``trl.kernels.ChunkedLogProbFunction``)
  is replaced by ``bitrl.kernels.fused_logprobs`` on the scored positions only: same per-token log-probs and
  entropy under the trainer's temperature, without the [N, V] logits. The reference model's head too.
* ``trainer._compute_loss`` computes TRL's loss types with ``bitrl.kernels.policy_loss``:
  grpo / sapo (sequence-mean of token-means), bnpo (token mean), dr_grpo (B * max_completion_length),
  dapo / cispo / vespo (TRL's ``num_items_in_batch`` normaliser), luspo (sum over tokens, mean over
  sequences); ``importance_sampling_level="sequence"`` is bitrl's ``gspo``. KL (beta, k3, optional bias
  correction), the static entropy bonus, the high-entropy token mask, the off-policy sequence mask, the tool
  mask and the MoE auxiliary loss keep TRL's definitions.
* ``correction=`` (any name in ``bitrl.kernels.CORRECTIONS``, or a list of them: icepop, tis-seq, mask-seq,
  mask-geo, reject-k3-seq-mean, ais, ...) reweights or masks tokens from the ratio rho = pi_old / pi_rollout
  that TRL forms from vLLM's sampling log-probs; it replaces TRL's ``vllm_importance_sampling_mode``.
  Without a bitrl correction, TRL's own importance-sampling ratio (when it computed one) multiplies the
  policy term exactly as in TRL.

Metrics keep TRL's names where they mean the same thing (``entropy``, ``kl``, ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``cispo_clip_ratio``, ``policy_loss``); bitrl's extra
diagnostics are logged as ``bitrl/<name>`` (mismatch_k1, mismatch_k3, is_ess, masked_frac, ...).
TRL features this module does not cover raise ``ValueError`` when ``use_bitrl`` is called.
"""

from __future__ import annotations

import functools
import json
import os
import types
from collections.abc import Sequence

import torch

from ..kernels import CORRECTIONS, LossConfig, fused_logprobs, policy_loss

__all__ = ["use_bitrl", "add_bitrl_lm_head", "TRL_LOSS_TYPES"]

# TRL loss_type -> (bitrl loss at token level, bitrl aggregation); sequence level swaps the clip loss for gspo
TRL_LOSS_TYPES = {
    "grpo": ("grpo", "seq-mean-token-mean"),
    "bnpo": ("grpo", "token-mean"),
    "dr_grpo": ("grpo", "seq-mean-token-sum-norm"),
    "dapo": ("grpo", "token-mean"),
    "luspo": ("grpo", "seq-mean-token-sum"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "vespo": ("vespo", "token-mean"),
}
_CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# bitrl metric -> TRL metric of the same meaning
_TRL_METRIC_NAMES = {
    "clipfrac_low": "clip_ratio/low_mean",
    "clipfrac_high": "clip_ratio/high_mean",
    "clipfrac": "clip_ratio/region_mean",
    "kl": "kl",
}


def _logit_scale(config) -> float:
    """The multiplier some architectures apply to the logits before the softmax (1.0 for most)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def add_bitrl_lm_head(model, temperature: float = 1.0, outputs: Sequence[str] = ("log_probs",), impl=None):
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return TRL's ``FusedCausalLMOutput`` computed by
    ``bitrl.kernels.fused_logprobs``: log-probs [B, L-1] (and entropy) of the next-token labels, zero where
    the label is -100, under softmax(logits / temperature). Only the labelled positions go through the LM
    head. Without ``fused_lm_head=True`` the forward is the one the model had (generation is unchanged)."""
    from trl.trainer.utils import FusedCausalLMOutput

    text_config = model.config.get_text_config()
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        raise ValueError(
            "final_logit_softcapping: bitrl's fused LM head has no logit soft-capping; use TRL's own head"
        )
    if getattr(text_config, "output_router_logits", False):
        raise ValueError("output_router_logits: MoE router losses are not supported by bitrl's LM head")
    scale = _logit_scale(text_config)
    if not scale > 0:
        raise ValueError(f"logit scale: bitrl's fused LM head needs a positive logit scale, got {scale}")
    bad = sorted(set(outputs) - {"log_probs", "entropy"})
    if bad:
        raise ValueError(f"outputs: bitrl's fused LM head computes log_probs and entropy, not {bad}")
    with_entropy = "entropy" in outputs
    effective_temperature = float(temperature) / scale  # logits * scale / T
    previous_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw
    ):
        if not fused_lm_head:
            passed = {
                "labels": labels,
                "shift_labels": shift_labels,
                "num_items_in_batch": num_items_in_batch,
            }
            return previous_forward(*args, **{k: v for k, v in passed.items() if v is not None}, **kw)
        kw["use_cache"] = False
        hidden = self.base_model(*args, **kw).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        mask = labels.to(weight.device) != -100
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype
        if weight.is_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        with torch.autocast(weight.device.type, enabled=False):
            lp, ent = fused_logprobs(
                hidden.to(weight.device)[mask].to(dtype),
                weight.to(dtype),
                labels.to(weight.device)[mask],
                temperature=effective_temperature,
                bias=None if bias is None else bias.to(dtype),
                return_entropy=with_entropy,
                impl=impl,
            )
        # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero)
        log_probs = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
        entropy = None if ent is None else ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    model.forward = types.MethodType(forward, model)
    return model


def _check_supported(trainer, correction_names):
    """Refuse, with one clear line, what the bitrl path would otherwise silently compute differently."""
    args = trainer.args
    if trainer.loss_type not in TRL_LOSS_TYPES:
        raise ValueError(
            f"loss_type: TRL's {trainer.loss_type!r} has no bitrl equivalent; use one of "
            f"{sorted(TRL_LOSS_TYPES)}"
        )
    if getattr(trainer, "use_adaptive_entropy", False):
        raise ValueError(
            "use_adaptive_entropy: the adaptive entropy controller is not supported with bitrl; "
            "use a static entropy_coef"
        )
    if trainer.importance_sampling_level == "sequence" and trainer.loss_type not in _CLIP_FAMILY:
        raise ValueError(
            f"importance_sampling_level='sequence': bitrl maps it to gspo, which has no "
            f"{trainer.loss_type!r} variant"
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("use_liger_kernel: choose Liger-Kernel or bitrl for the loss, not both")
    unknown = [n for n in correction_names if n not in CORRECTIONS]
    if unknown:
        raise ValueError(f"correction: unknown {unknown}; choose from {sorted(CORRECTIONS)}")
    if trainer.loss_type == "vespo" and any(n != "none" for n in correction_names):
        raise ValueError(
            "correction: vespo folds TRL's own importance-sampling ratio into its weights; "
            "use vllm_importance_sampling_mode instead of a bitrl correction"
        )


def use_bitrl(
    trainer,
    *,
    correction: str | Sequence[str] = "none",
    impl: str | None = None,
    dump_dir: str | None = None,
    **correction_options,
):
    """Switch a ``trl.GRPOTrainer`` to bitrl's fused log-prob/entropy and policy loss. Returns the trainer.

    Args:
        trainer: a constructed ``GRPOTrainer`` (before ``train()``).
        correction: a bitrl rollout correction (``bitrl.kernels.CORRECTIONS``) or a list of them; needs the
            rollout log-probs TRL receives from vLLM (``use_vllm=True``). "none" keeps TRL's own
            ``vllm_importance_sampling_correction``.
        impl: kernel implementation for both ops ("triton" | "torch" | "reference"; default by device).
        dump_dir: write one JSON line per loss call with the per-token trainer (old) and rollout log-probs
            and the mask to ``dump_dir/rollout_logprobs.jsonl``, for ``bitrl mismatch --external``.
        **correction_options: bitrl's correction parameters: correction_cap, correction_low, correction_high,
            icepop_alpha, icepop_beta, reject_threshold, ais_kl_scale, ais_min_ess.
    """
    names = [correction] if isinstance(correction, str) else list(correction)
    _check_supported(trainer, names)
    allowed = set(LossConfig.correction_parameters())
    extra = sorted(set(correction_options) - allowed)
    if extra:
        raise TypeError(
            f"use_bitrl() got unexpected option(s) {extra}; correction options are {sorted(allowed)}"
        )
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_bitrl_lm_head(base, trainer.temperature, outputs=("log_probs", "entropy"), impl=impl)
    if getattr(trainer, "ref_model", None) is not None:
        add_bitrl_lm_head(trainer.ref_model, trainer.temperature, impl=impl)
    trainer._bitrl = {"correction": names, "impl": impl, "options": correction_options, "dump_dir": dump_dir}
    trainer._compute_loss = types.MethodType(_compute_loss, trainer)
    return trainer


def _loss_options(trainer, mask, inputs, mode):
    """bitrl LossConfig fields reproducing TRL's loss type, clip and normaliser, and the loss's scale."""
    args = trainer.args
    loss_type, agg = TRL_LOSS_TYPES[trainer.loss_type]
    if trainer.importance_sampling_level == "sequence":
        loss_type = "gspo"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    opts = {
        "loss_type": loss_type,
        "loss_agg_mode": agg,
        "eps_low": trainer.epsilon_low,
        "eps_high": trainer.epsilon_high,
        "delta": args.delta,
    }
    scale = 1.0 / accumulation
    if trainer.loss_type == "dr_grpo":
        opts["loss_scale"] = mask.shape[0] * trainer.max_completion_length
    elif trainer.loss_type in ("dapo", "cispo", "vespo"):
        count = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            count = count * accumulation / args.steps_per_generation
        opts["global_token_count"] = count
        scale = 1.0  # the normaliser already spans the accumulation window
    if trainer.loss_type == "cispo":
        opts["cispo_clip_max"] = trainer.epsilon_high  # TRL's CISPO caps the ratio at epsilon_high itself
    if trainer.loss_type == "sapo":
        opts["sapo_tau_pos"], opts["sapo_tau_neg"] = args.sapo_temperature_pos, args.sapo_temperature_neg
    if trainer.loss_type == "vespo":
        opts.update(
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )
    return opts, scale


def _compute_loss(self, model, inputs):
    """TRL's ``GRPOTrainer._compute_loss`` with the log-probs from bitrl's head and the loss from bitrl."""
    cfg = self._bitrl
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    multimodal = (
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    )
    lp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=self.aux_loss_enabled,
        **{k: inputs.get(k) for k in multimodal},
    )
    mode = "train" if self.model.training else "eval"
    advantages = inputs["advantages"]
    old = inputs.get("old_per_token_logps")
    rollout = inputs.get("sampling_per_token_logps")

    # per-token weights TRL multiplies into the policy term: entropy mask, off-policy mask, vLLM IS ratio
    weights = []
    if self.top_entropy_quantile < 1.0:
        weights.append(self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).float())
    if self.off_policy_mask_threshold is not None:
        sampling = rollout if rollout is not None else (old if old is not None else lp.detach())
        adv2 = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
        weights.append(self.get_off_policy_mask(adv2, lp, sampling, mask, self.off_policy_mask_threshold))
    corrected = any(n != "none" for n in cfg["correction"])
    if not corrected and "importance_sampling_ratio" in inputs:
        weights.append(inputs["importance_sampling_ratio"])
    is_weights = None
    for w in weights:
        w = w.to(torch.float32).expand_as(mask)
        is_weights = w if is_weights is None else is_weights * w

    extra, tensors = {}, {"is_weights": is_weights}
    if corrected:
        if rollout is None or old is None:
            raise ValueError(
                f"correction={cfg['correction']}: needs the rollout log-probs TRL receives from vLLM "
                "(use_vllm=True with vllm_importance_sampling_correction=True); this batch has none"
            )
        # vLLM leaves NaN where it could not score a token: no correction there (ratio 1), as in TRL
        tensors["rollout_logprobs"] = torch.where(torch.isnan(rollout), old, rollout)
        extra["correction"] = cfg["correction"]
        extra.update(cfg["options"])
    if self.beta != 0.0:
        tensors["ref_logprobs"] = inputs["ref_per_token_logps"]
        extra.update(kl_type="k3", kl_coef=self.beta, kl_is_correction=bool(self.args.use_bias_correction_kl))
    opts, scale = _loss_options(self, mask, inputs, mode)
    config = LossConfig(**opts, **extra)
    loss, metrics = policy_loss(lp, old, advantages, mask, config, impl=cfg["impl"], **tensors)
    loss = loss * scale
    policy_part = metrics["pg_loss"] + (self.beta * metrics["kl_loss"] if self.beta != 0.0 else 0.0)

    if self._entropy_bonus_enabled:  # TRL's definition: token mean over the effective mask, whatever the loss
        effective = mask if not weights or self.top_entropy_quantile >= 1.0 else mask * weights[0]
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
        loss = loss - self.entropy_coef * entropy_loss
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_part).nanmean().item())
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
    if self.aux_loss_enabled:
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

    _log_metrics(self, mode, metrics, entropies, mask)
    if cfg["dump_dir"] and old is not None and rollout is not None:
        _dump(
            cfg["dump_dir"],
            self.state.global_step,
            old,
            rollout,
            mask,
            inputs.get("importance_sampling_ratio"),
        )
    return loss


def _log_metrics(trainer, mode, metrics, entropies, mask):
    def global_mean(value, count):
        totals = trainer.accelerator.reduce(torch.stack([value * count, count]).float(), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    n = metrics["n_tokens"]
    store = trainer._metrics[mode]
    store["entropy"].append(
        global_mean((entropies.detach() * mask).sum() / mask.sum().clamp(min=1), mask.sum())
    )
    names = dict(_TRL_METRIC_NAMES)
    if trainer.loss_type == "cispo":
        names = {"clipfrac_high": "cispo_clip_ratio"}
    elif trainer.loss_type not in _CLIP_FAMILY or trainer.importance_sampling_level == "sequence":
        names = {"kl": "kl"}  # TRL counts sequence-level clipping per sequence, bitrl per token
    for key, value in metrics.items():
        if key in names:
            store[names[key]].append(global_mean(value, n))
        elif key not in ("pg_loss", "kl_loss", "entropy", "entropy_loss", "n_tokens"):
            store[f"bitrl/{key}"].append(global_mean(value, n))


def _dump(directory, step, old, rollout, mask, ratio):
    """One JSON line per sequence: its trainer (old) and rollout log-probs at the unmasked tokens."""
    os.makedirs(directory, exist_ok=True)
    rows = []
    for b in range(mask.shape[0]):
        keep = mask[b].bool()
        rows.append(
            {
                "step": int(step),
                "old_logprobs": old[b][keep].tolist(),
                "rollout_logprobs": rollout[b][keep].tolist(),
            }
        )
        if ratio is not None and ratio.shape[-1] == mask.shape[-1]:
            rows[-1]["importance_sampling_ratio"] = ratio[b][keep].tolist()
    with open(os.path.join(directory, "rollout_logprobs.jsonl"), "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
