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


# ----------------------------------------------------------------------------------------------------------
# rollout corrections: fn(log_rho, mask, cfg) -> CorrectionResult
#   log_rho = log pi_train_old(y) - log pi_rollout(y) (detached), mask as above.
#   Each variant is one function: return keep=... and/or weight=... from log_rho and mask.
# ----------------------------------------------------------------------------------------------------------


def _bounds(cfg: LossConfig, lo: float, hi: float):
    return (cfg.correction_low if cfg.correction_low is not None else lo), (
        cfg.correction_high if cfg.correction_high is not None else hi
    )


@register_correction("none")
def corr_none(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    return CorrectionResult()


@register_correction("tis-token", "tis")
def corr_tis_token(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Truncated IS per token: w_t = min(rho_t, C), C = ``correction_cap`` (default 2)."""
    return CorrectionResult(weight=torch.exp(log_rho.clamp(max=_KL_CLAMP)).clamp(max=cfg.correction_cap))


@register_correction("tis-seq", "seq-tis")
def corr_tis_seq(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Truncated IS per sequence: w = min(prod_t rho_t, C), broadcast to the tokens."""
    log_seq = seq_sum(log_rho, mask).clamp(max=_KL_CLAMP)
    return CorrectionResult(
        weight=torch.exp(log_seq).clamp(max=cfg.correction_cap).unsqueeze(-1).expand_as(mask)
    )


@register_correction("mask-token", "token-mis")
def corr_mask_token(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Drop tokens whose rho_t leaves [low, high] (default 0.5 - 2.0)."""
    lo, hi = _bounds(cfg, 0.5, 2.0)
    rho = torch.exp(log_rho.clamp(-_KL_CLAMP, _KL_CLAMP))
    return CorrectionResult(keep=(rho >= lo) & (rho <= hi))


@register_correction("mask-seq", "seq-mis")
def corr_mask_seq(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Drop sequences whose prod_t rho_t leaves [low, high] (default 0.5 - 2.0)."""
    lo, hi = _bounds(cfg, 0.5, 2.0)
    log_seq = seq_sum(log_rho, mask)
    keep = (log_seq >= math.log(lo)) & (log_seq <= math.log(hi))
    return CorrectionResult(keep=keep.unsqueeze(-1).expand_as(mask))


@register_correction("mask-geo", "geo-mis")
def corr_mask_geo(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Drop sequences whose geometric-mean ratio exp(mean_t log rho_t) leaves [low, high] (0.999 - 1.001)."""
    lo, hi = _bounds(cfg, 0.999, 1.001)
    log_geo = seq_mean(log_rho, mask)
    keep = (log_geo >= math.log(lo)) & (log_geo <= math.log(hi))
    return CorrectionResult(keep=keep.unsqueeze(-1).expand_as(mask))


@register_correction("icepop")
def corr_icepop(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """IcePop: weight rho_t where rho_t in [alpha, beta] (0.5, 5.0), else 0 (token kept in the normaliser)."""
    rho = torch.exp(log_rho.clamp(-_KL_CLAMP, _KL_CLAMP))
    inside = (rho >= cfg.icepop_alpha) & (rho <= cfg.icepop_beta)
    return CorrectionResult(weight=torch.where(inside, rho, torch.zeros_like(rho)))


# Rejection by divergence: drop tokens, or whole sequences, whose divergence between the trainer and the
# rollout policy exceeds ``reject_threshold``. Per-token divergences, log rho = log pi_train - log pi_rollout:
#   k1 = -log rho (signed; compared by absolute value), k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho.
# Levels: token; seq-sum, seq-mean, seq-max (aggregate over the sequence's tokens, then keep or drop it all).
# The default threshold is each divergence at rho = 2 (k1 0.69, k2 0.24, k3 0.31).

_DIVERGENCES = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr * lr,
    "k3": lambda lr: torch.expm1(lr) - lr,
}
_REJECT_DEFAULT = {"k1": math.log(2.0), "k2": 0.5 * math.log(2.0) ** 2, "k3": 1.0 - math.log(2.0)}


def _rejection(kind: str, level: str) -> Callable:
    def correction(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
        threshold = cfg.reject_threshold if cfg.reject_threshold is not None else _REJECT_DEFAULT[kind]
        inside = mask.bool()
        d = _DIVERGENCES[kind](log_rho.clamp(-_KL_CLAMP, _KL_CLAMP)).masked_fill(~inside, 0.0)
        if level == "token":
            return CorrectionResult(keep=d.abs() <= threshold)
        if level == "seq-sum":
            per_seq = seq_sum(d, inside.to(d.dtype))
        elif level == "seq-mean":
            per_seq = seq_mean(d, inside.to(d.dtype))
        else:  # seq-max
            per_seq = d.abs().amax(-1)
        return CorrectionResult(keep=(per_seq.abs() <= threshold).unsqueeze(-1).expand_as(inside))

    correction.__doc__ = f"Rejection by {kind} divergence at {level} level (threshold ``reject_threshold``)."
    return correction


for _kind in _DIVERGENCES:
    for _level in ("token", "seq-sum", "seq-mean", "seq-max"):
        register_correction(f"reject-{_kind}-{_level}")(_rejection(_kind, _level))


# Adaptive importance sampling (AIS): one coefficient lambda in [0, 1] per batch interpolates between the
# uncorrected gradient (lambda = 0, w = 1) and the fully corrected one (lambda = 1, w = min(rho, C)):
#   w_t = (1 - lambda) + lambda * min(rho_t, C).
# lambda combines three batch diagnostics over the unmasked tokens:
#   severity      S = 1 - exp(-KL3 / kappa), KL3 = mean(rho - 1 - log rho): how much correction is needed
#                     (kappa = ``ais_kl_scale``, 0.01 nats/token by default);
#   reliability   R = ESS = mean(rho)^2 / mean(rho^2) in (0, 1]: how much to trust the raw weights;
#   amplification V = mean(min(rho, C)^2) / mean(min(rho, C))^2 - 1 >= 0: the variance the truncated
#                     weights add to the gradient.
#   lambda = clamp(S * (1 + V) / (1 + V * R), 0, 1)
# Identical policies give S = 0, so lambda = 0 (no correction). A small, well-behaved mismatch (R ~ 1, V ~ 0)
# gives lambda = S. Wild ratios give S -> 1 and a low R, so lambda -> 1, and when R falls below
# ``ais_min_ess`` (0.5) the tokens whose rho leaves [1/C, C] are also masked: the weights are then too
# unreliable to reweight those tokens at all.


def ais_moments(log_rho, mask, cfg: LossConfig) -> torch.Tensor:
    """[6] fp32 sums over the unmasked tokens of a batch: count, k3 = rho - 1 - log rho, rho, rho^2,
    min(rho, C), min(rho, C)^2. Sums add over the shards of a batch (data-parallel ranks), means do not."""
    m = mask.bool()
    lr = log_rho.float().clamp(-_KL_CLAMP, _KL_CLAMP)[m]
    rho = lr.exp()
    truncated = rho.clamp(max=cfg.correction_cap)
    terms = (torch.ones_like(lr), torch.expm1(lr) - lr, rho, rho * rho, truncated, truncated * truncated)
    return torch.stack([t.sum() for t in terms])


def ais_coefficients(log_rho, mask, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The AIS diagnostics and lambda of a batch (0-dim fp32 tensors): severity, reliability, amplification,
    lambda. log_rho, mask: [B, T]. With cfg.ais_moments set (the `ais_moments` of the whole batch, e.g.
    summed over data-parallel ranks) they are those of that batch rather than of the shard given."""
    moments = cfg.ais_moments if cfg.ais_moments is not None else ais_moments(log_rho, mask, cfg)
    count, kl3, rho, rho2, trunc, trunc2 = moments.to(device=log_rho.device, dtype=torch.float32) / max(
        float(moments[0]), 1.0
    )
    if count == 0:
        zero = torch.zeros((), device=log_rho.device)
        return {"severity": zero, "reliability": zero + 1, "amplification": zero, "lambda": zero}
    severity = 1 - torch.exp(-kl3 / cfg.ais_kl_scale)
    reliability = rho**2 / rho2
    amplification = (trunc2 / trunc**2 - 1).clamp(min=0)
    lam = (severity * (1 + amplification) / (1 + amplification * reliability)).clamp(0, 1)
    return {"severity": severity, "reliability": reliability, "amplification": amplification, "lambda": lam}


@register_correction("ais")
def corr_ais(log_rho, mask, cfg: LossConfig) -> CorrectionResult:
    """Adaptive IS: w_t = (1 - lambda) + lambda * min(rho_t, C), lambda from ``ais_coefficients``."""
    coef = ais_coefficients(log_rho, mask, cfg)
    rho = torch.exp(log_rho.float().clamp(-_KL_CLAMP, _KL_CLAMP))
    weight = (1 - coef["lambda"]) + coef["lambda"] * rho.clamp(max=cfg.correction_cap)
    keep = None
    if coef["reliability"] < cfg.ais_min_ess:
        keep = (rho >= 1 / cfg.correction_cap) & (rho <= cfg.correction_cap)
    return CorrectionResult(weight=weight, keep=keep)
