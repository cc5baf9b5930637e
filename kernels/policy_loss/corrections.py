"""The rollout corrections of the policy loss: rollout/trainer mismatch weights and keep-masks, each one
function registered by name with ``@register_correction`` (see ``registry``).

``fn(log_rho, mask, cfg) -> CorrectionResult`` with log_rho = log pi_train_old(y) - log pi_rollout(y)
(detached, [B, T]) and mask the 0/1 float token mask; formulas follow /DESIGN.md ("Mismatch correction").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .registry import _KL_CLAMP, CorrectionResult, LossConfig, register_correction, seq_mean, seq_sum

__all__ = ["ais_coefficients", "ais_moments"]

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
