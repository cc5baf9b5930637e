"""The registries of the policy-loss family, in one place.

Four registries, each filled by decorators; adding a variant is one function plus one decorator:

* ``POLICY_LOSSES``   ``@register_policy_loss("name")``: the per-token policy-gradient term.
* ``AGGREGATIONS``    ``@register_aggregation("name")``: per-token weights w with loss = sum(w * l).
* ``KL_ESTIMATORS``   ``@register_kl("name")``: per-token KL(pi || pi_ref) estimate.
* ``CORRECTIONS``     ``@register_correction("name")``: rollout/trainer mismatch weights and masks.

Conventions. Every function works on [B, T] tensors in the compute dtype (fp32, or fp64 for the fp64
references): ``lp`` (current log-probs, differentiable), ``old`` (log-probs of the behaviour policy under the
trainer), ``adv`` (advantages broadcast to [B, T]), ``mask`` (0/1 float; padding and masked tokens are 0 and
their inputs are already replaced by finite values). Sequence-level quantities are reductions over the masked
tokens of a row and are broadcast back to [B, T], so every aggregation applies unchanged.

Formulas follow /DESIGN.md ("Policy losses", "Mismatch correction"); r = exp(lp - old).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "CorrectionResult",
    "LossConfig",
    "LossTerms",
    "get_aggregation",
    "get_correction",
    "get_kl",
    "get_policy_loss",
    "register_aggregation",
    "register_correction",
    "register_kl",
    "register_policy_loss",
    "seq_mean",
    "seq_sum",
]


@dataclass
class LossConfig:
    """Hyper-parameters of the loss family (plain Python numbers; see ``policy_loss`` for the meaning)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_ratio_c: float | None = None
    delta: float | None = None
    cispo_clip_max: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    log_ratio_clamp: float = 20.0
    # aggregation
    global_token_count: float | torch.Tensor | None = None
    global_seq_count: float | torch.Tensor | None = None
    loss_scale: float | None = None
    # corrections
    correction_cap: float = 2.0
    correction_low: float | None = None
    correction_high: float | None = None
    icepop_alpha: float = 0.5
    icepop_beta: float = 5.0
    reject_threshold: float | None = None  # rejection by divergence; None: the divergence at rho = 2
    ais_kl_scale: float = 0.01  # AIS: k3 KL (nats/token) at which the severity reaches 1 - 1/e
    ais_min_ess: float = 0.5  # AIS: below this ESS, tokens with rho outside [1/C, C] are masked
    ais_moments: torch.Tensor | None = None  # AIS: the whole batch's `ais_moments` when given a shard of it
    extra: dict = field(default_factory=dict)


@dataclass
class LossTerms:
    """What a policy-loss function returns: the per-token loss and per-token diagnostics (detached)."""

    loss: torch.Tensor  # [B, T] per-token loss (differentiable w.r.t. lp)
    ratio: torch.Tensor  # [B, T] ratio used for the metrics (token or broadcast sequence ratio)
    clipped_low: torch.Tensor | None = None  # [B, T] bool: the lower clip is the active branch
    clipped_high: torch.Tensor | None = None  # [B, T] bool: the upper clip is the active branch
    clipped_dual: torch.Tensor | None = None  # [B, T] bool: the dual clip (A < 0) is the active branch
    log_ratio: torch.Tensor | None = None  # [B, T] differentiable log-ratio the loss used (token or sequence)


@dataclass
class CorrectionResult:
    """Rollout-correction output: a detached weight for the policy term and/or a keep-mask."""

    weight: torch.Tensor | None = None  # [B, T] multiplies the policy-gradient term (detached)
    keep: torch.Tensor | None = None  # [B, T] bool; False removes the token from the loss and its normaliser


POLICY_LOSSES: dict[str, Callable] = {}
AGGREGATIONS: dict[str, Callable] = {}
KL_ESTIMATORS: dict[str, Callable] = {}
CORRECTIONS: dict[str, Callable] = {}


def _registrar(table: dict, kind: str):
    def register(name: str, *aliases: str, **attrs):
        def deco(fn):
            for key in (name, *aliases):
                if key in table:
                    raise ValueError(f"{kind} {key!r} is already registered")
                table[key] = fn
            for k, v in attrs.items():
                setattr(fn, k, v)
            fn.registry_name = name
            return fn

        return deco

    def get(name: str, arg: str):
        try:
            return table[name]
        except (KeyError, TypeError):
            raise ValueError(f"{arg}: unknown {kind} {name!r}; choose one of {sorted(table)}") from None

    return register, get


register_policy_loss, _get_policy_loss = _registrar(POLICY_LOSSES, "policy loss")
register_aggregation, _get_aggregation = _registrar(AGGREGATIONS, "aggregation")
register_kl, _get_kl = _registrar(KL_ESTIMATORS, "KL estimator")
register_correction, _get_correction = _registrar(CORRECTIONS, "rollout correction")


def get_policy_loss(name: str) -> Callable:
    return _get_policy_loss(name, "loss_type")


def get_aggregation(name: str) -> Callable:
    return _get_aggregation(name, "loss_agg_mode")


def get_kl(name: str) -> Callable:
    return _get_kl(name, "kl_type")


def get_correction(name: str) -> Callable:
    return _get_correction(name, "correction")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sum over the masked tokens of each row."""
    return (x * mask).sum(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over the masked tokens of each row (0 for an all-masked row)."""
    return seq_sum(x, mask) / mask.sum(-1).clamp(min=1.0)


def _log_ratio(lp, old, cfg: LossConfig):
    c = cfg.log_ratio_clamp
    return (lp - old).clamp(-c, c)


# ----------------------------------------------------------------------------------------------------------
# policy losses: fn(lp, old, adv, mask, cfg, *, is_weight=None) -> LossTerms
# ----------------------------------------------------------------------------------------------------------


def _clipped_surrogate(log_r, adv, cfg: LossConfig) -> LossTerms:
    r = torch.exp(log_r)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    r_unclipped = r.clamp(max=cfg.delta) if cfg.delta is not None else r
    surr1 = -adv * r_unclipped
    surr2 = -adv * r.clamp(lo, hi)
    loss = torch.maximum(surr1, surr2)
    rd = r.detach()
    neg = adv < 0
    clipped_low = (rd < lo) & neg
    clipped_high = (rd > hi) & (adv > 0)
    clipped_dual = None
    if cfg.clip_ratio_c is not None:
        surr3 = -adv * cfg.clip_ratio_c
        clipped_dual = neg & (loss.detach() > surr3)
        loss = torch.where(neg, torch.minimum(loss, surr3), loss)
    return LossTerms(loss, rd, clipped_low, clipped_high, clipped_dual, log_r)


@register_policy_loss("grpo", "ppo", "vanilla", token_level=True)
def clip_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """PPO/GRPO clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    ``eps_high > eps_low`` is DAPO's clip-higher; ``clip_ratio_c`` adds the dual clip for A < 0
    (loss <= -A c); ``delta`` caps the unclipped ratio (two-sided clip, r <= delta).
    """
    return _clipped_surrogate(_log_ratio(lp, old, cfg), adv, cfg)


@register_policy_loss("gspo", token_level=False)
def gspo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log r_t), broadcast to the tokens.

    The gradient reaches every token through the mean (1/|y| each). Typical eps are 3e-4 / 4e-4.
    """
    log_s = seq_mean(_log_ratio(lp, old, cfg), mask).unsqueeze(-1).expand_as(lp)
    return _clipped_surrogate(log_s, adv, cfg)


@register_policy_loss("cispo", token_level=True)
def cispo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """CISPO: -sg(min(r, r_max)) A lp, r_max = ``cispo_clip_max`` (default 1 + eps_high)."""
    r = torch.exp(_log_ratio(lp, old, cfg)).detach()
    r_max = cfg.cispo_clip_max if cfg.cispo_clip_max is not None else 1.0 + cfg.eps_high
    w = r.clamp(max=r_max)
    return LossTerms(-w * adv * lp, r, torch.zeros_like(r, dtype=torch.bool), (r > r_max) & (adv > 0))


@register_policy_loss("sapo", token_level=True)
def sapo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """SAPO: -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_tau_pos for A > 0 else sapo_tau_neg."""
    if cfg.sapo_tau_pos <= 0 or cfg.sapo_tau_neg <= 0:
        raise ValueError("sapo_tau_pos/sapo_tau_neg: must be > 0")
    r = torch.exp(_log_ratio(lp, old, cfg))
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(r.dtype)
    loss = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
    return LossTerms(loss, r.detach())


@register_policy_loss("gmpo", token_level=False)
def gmpo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """GMPO: -A_seq exp(mean_t clip_A(log r_t)), the geometric mean of token ratios clipped in log space.

    Here ``eps_low``/``eps_high`` bound log r (the paper uses 0.4 each); for A < 0 the clip is mirrored
    (the pessimistic branch is taken in sign(A) log r). A_seq is the masked mean advantage of the row.
    """
    log_r = _log_ratio(lp, old, cfg)
    adv_seq = seq_mean(adv, mask)
    sgn = torch.sign(adv_seq).unsqueeze(-1)
    clamped = log_r.clamp(-cfg.eps_low, cfg.eps_high)
    pess = torch.minimum(sgn * log_r, sgn * clamped) * sgn
    ratio_seq = torch.exp(seq_mean(pess, mask))
    loss = (-adv_seq * ratio_seq).unsqueeze(-1).expand_as(lp)
    lrd = log_r.detach()
    clipped_low = (lrd < -cfg.eps_low) & (sgn < 0)
    clipped_high = (lrd > cfg.eps_high) & (sgn > 0)
    return LossTerms(loss, torch.exp(lrd), clipped_low, clipped_high)


@register_policy_loss("vespo", token_level=False, uses_is_weight=True)
def vespo_loss(lp, old, adv, mask, cfg: LossConfig, *, is_weight=None, **_) -> LossTerms:
    """VESPO: -sg(phi(w_seq)) A lp with phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1).

    w_seq = exp(sum_t log r_t) (times the rollout-correction weight, folded in log space), with (k, lambda)
    chosen by the sign of A. Computed in log space and detached.
    """
    with torch.no_grad():
        lo = math.log(1e-8)
        log_w = seq_sum(_log_ratio(lp, old, cfg), mask)
        if is_weight is not None:
            log_is = torch.log(is_weight.clamp(min=1e-30)).clamp(lo, 20.0)
            log_w = log_w + seq_sum(log_is, mask)
        log_w = log_w.clamp(lo, 20.0)
        pos = seq_mean(adv, mask) >= 0
        k = torch.where(pos, cfg.vespo_k_pos, cfg.vespo_k_neg).to(lp.dtype)
        lam = torch.where(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).to(lp.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)
        phi = phi.unsqueeze(-1)
        ratio = torch.exp(log_w).unsqueeze(-1).expand_as(lp)
    return LossTerms(-phi * adv * lp, ratio)


# ----------------------------------------------------------------------------------------------------------
# aggregations: fn(mask, cfg) -> per-token weights w [B, T]; loss = sum(w * l)
# ----------------------------------------------------------------------------------------------------------


def _count(value, default: torch.Tensor) -> torch.Tensor:
    if value is None:
        return default.clamp(min=1.0)
    if isinstance(value, torch.Tensor):
        return value.to(device=default.device, dtype=default.dtype).clamp(min=1.0)
    return torch.as_tensor(float(value), device=default.device, dtype=default.dtype).clamp(min=1.0)


@register_aggregation("token-mean", "bnpo", "dapo")
def agg_token_mean(mask, cfg: LossConfig):
    """sum(m l) / number of tokens (``global_token_count`` for DP / gradient accumulation)."""
    return mask / _count(cfg.global_token_count, mask.sum())


def _n_seq(mask, cfg):
    return _count(
        cfg.global_seq_count, torch.as_tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device)
    )


@register_aggregation("seq-mean-token-mean", "grpo")
def agg_seq_mean_token_mean(mask, cfg: LossConfig):
    """mean over sequences of (sum_t m l / |y|); divides by B (or ``global_seq_count``)."""
    return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / _n_seq(mask, cfg)


@register_aggregation("seq-mean-token-sum")
def agg_seq_mean_token_sum(mask, cfg: LossConfig):
    """mean over sequences of sum_t m l."""
    return mask / _n_seq(mask, cfg)


@register_aggregation("seq-mean-token-sum-norm", "constant", "dr_grpo")
def agg_constant(mask, cfg: LossConfig):
    """Dr.GRPO: sum(m l) / constant, constant = ``loss_scale`` (default B * T, i.e. B * max_len)."""
    if cfg.loss_scale is not None:
        if not cfg.loss_scale > 0:
            raise ValueError(f"loss_scale: must be > 0, got {cfg.loss_scale}")
        return mask / float(cfg.loss_scale)
    return mask / _n_seq(mask, cfg) / float(mask.shape[1])


@register_aggregation("seq-len-weighted", "luspo")
def agg_length_weighted(mask, cfg: LossConfig):
    """LUSPO: sum_b |y_b| sum_t m l / (B * T) (sequence-length-weighted)."""
    return mask * mask.sum(-1, keepdim=True) / (_n_seq(mask, cfg) * float(mask.shape[1]))


# ----------------------------------------------------------------------------------------------------------
# KL estimators: fn(lp, ref) -> [B, T] estimate of KL(pi || pi_ref) at the sampled token
# ----------------------------------------------------------------------------------------------------------

_KL_CLAMP = 20.0


@register_kl("k1")
def kl_k1(lp, ref):
    """k1 = log pi - log pi_ref (unbiased, high variance, can be negative)."""
    return lp - ref


@register_kl("k2")
def kl_k2(lp, ref):
    """k2 = 1/2 (log pi - log pi_ref)^2."""
    return 0.5 * (lp - ref).square()


@register_kl("k3", "low_var_kl")
def kl_k3(lp, ref):
    """k3 = exp(ref - lp) - (ref - lp) - 1 (non-negative, low variance); the log-ratio is clamped to +-20."""
    d = (ref - lp).clamp(-_KL_CLAMP, _KL_CLAMP)
    return torch.exp(d) - d - 1.0
