"""The policy-loss family's vocabulary and registries, in one place.

``LossConfig`` holds every option of the loss under one name each (loss_type, loss_agg_mode, eps_low, ...),
with its validation; every entry point takes one.

Four registries, each filled by decorators; adding a variant is one function plus one decorator:

* ``POLICY_LOSSES``   ``@register_policy_loss("name", token_level=..., fused=...)``: the per-token
  policy-gradient term; ``fused=True`` declares that the Triton kernel implements it.
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
from dataclasses import Field, dataclass, field, fields

import torch

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "CorrectionResult",
    "LossConfig",
    "LossTerms",
    "PER_BATCH",
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


# The metadata of LossConfig's per-batch fields: set by the caller for each batch (normalisers shared by
# data-parallel ranks and gradient-accumulation micro-batches), not hyper-parameters a config file sets.
PER_BATCH = {"per_batch": True}
# ... and of the parameters of the rollout corrections (what an integration lets its caller set beside
# ``correction``)
OF_CORRECTION = {"of_correction": True}


@dataclass
class LossConfig:
    """Every option of the policy loss, each under one name: ``policy_loss``, ``fused_linear_policy_loss``,
    their references, ``build_plan`` and the trainer's ``train.loss`` section all take one LossConfig.

    Validated on construction (also by ``dataclasses.replace``): a bad value raises ValueError naming the
    field, an unknown field is a TypeError. Plain Python values, except the per-batch fields.
    """

    # the policy term, a name in POLICY_LOSSES: grpo/ppo/vanilla (clip), gspo, cispo, gmpo, sapo, vespo
    loss_type: str = "grpo"
    # clip range [1 - eps_low, 1 + eps_high] (gmpo: bounds of the log-ratio); eps_high None: eps_low
    # (DAPO's clip-higher is 0.28)
    eps_low: float = 0.2
    eps_high: float | None = None
    clip_ratio_c: float | None = None  # dual-clip constant (> 1, typically 3) for A < 0; None disables it
    delta: float | None = None  # two-sided clip: caps the unclipped ratio at delta (> 0)
    cispo_clip_max: float | None = None  # CISPO's ratio cap; None: 1 + eps_high
    sapo_tau_pos: float = 1.0  # SAPO's temperatures for A > 0 and A <= 0 (> 0)
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0  # VESPO's (k, lambda) for A >= 0 and A < 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    log_ratio_clamp: float = 20.0  # log r is clamped to +-this before exp
    # aggregation, a name in AGGREGATIONS: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    # seq-mean-token-sum-norm (= constant / dr_grpo: divides by loss_scale, default B * T), seq-len-weighted;
    # loss_scale is the constant of the constant normaliser (Dr.GRPO: B * max_len)
    loss_agg_mode: str = "token-mean"
    loss_scale: float | None = None
    # KL to the reference policy (needs ref_logprobs when kl_coef != 0), a name in KL_ESTIMATORS: k1, k2, k3
    kl_type: str = "k3"
    kl_coef: float = 0.0  # weight of the KL term in the loss
    kl_is_correction: bool = False  # multiply the KL by the ratio r (importance-sampled KL)
    entropy_coef: float = 0.0  # loss -= entropy_coef * aggregate(entropy)
    # rollout correction (needs rollout_logprobs), a name in CORRECTIONS or a tuple of them (weights
    # multiply, masks intersect): none, tis-token, tis-seq, mask-token, mask-seq, mask-geo, icepop, ais, ...
    correction: str | tuple[str, ...] = "none"
    # the corrections' parameters
    correction_cap: float = field(default=2.0, metadata=OF_CORRECTION)  # TIS's cap C (also AIS's)
    # masking bounds; None: each correction's own
    correction_low: float | None = field(default=None, metadata=OF_CORRECTION)
    correction_high: float | None = field(default=None, metadata=OF_CORRECTION)
    icepop_alpha: float = field(default=0.5, metadata=OF_CORRECTION)  # IcePop's window [alpha, beta]
    icepop_beta: float = field(default=5.0, metadata=OF_CORRECTION)
    # rejection by divergence; None: the divergence at rho = 2
    reject_threshold: float | None = field(default=None, metadata=OF_CORRECTION)
    # AIS: the k3 KL (nats/token) at which the severity reaches 1 - 1/e, and the ESS below which the tokens
    # with rho outside [1/C, C] are masked
    ais_kl_scale: float = field(default=0.01, metadata=OF_CORRECTION)
    ais_min_ess: float = field(default=0.5, metadata=OF_CORRECTION)
    # NaN/inf in the inputs at unmasked positions: "raise" (ValueError naming the argument) or "mask" (drop
    # those tokens); masked positions may hold anything
    nonfinite: str = "raise"
    # per batch: the token / sequence counts of the whole batch (all ranks, all micro-batches; a number or a
    # 0-dim tensor), and AIS's ``ais_moments`` of the whole batch when the loss sees a shard of it
    global_token_count: float | torch.Tensor | None = field(default=None, metadata=PER_BATCH)
    global_seq_count: float | torch.Tensor | None = field(default=None, metadata=PER_BATCH)
    ais_moments: torch.Tensor | None = field(default=None, metadata=PER_BATCH)

    def __post_init__(self):
        if self.eps_high is None:
            self.eps_high = self.eps_low
        for name in _NUMBERS:
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, float(value))
                except (TypeError, ValueError):
                    raise ValueError(f"{name}: expected a number, got {value!r}") from None
        if not isinstance(self.correction, str):
            self.correction = tuple(self.correction)
        get_policy_loss(self.loss_type)
        get_aggregation(self.loss_agg_mode)
        get_kl(self.kl_type)
        for name in self.corrections:
            get_correction(name)
        for name in ("eps_low", "eps_high"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c: the dual-clip constant must be > 1, got {self.clip_ratio_c}")
        for name in ("delta", "loss_scale", "sapo_tau_pos", "sapo_tau_neg"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if self.nonfinite not in ("raise", "mask"):
            raise ValueError(f"nonfinite: expected 'raise' or 'mask', got {self.nonfinite!r}")

    @property
    def corrections(self) -> tuple[str, ...]:
        """The rollout corrections as a tuple of names."""
        return (self.correction,) if isinstance(self.correction, str) else self.correction

    @classmethod
    def hyperparameters(cls) -> tuple[Field, ...]:
        """The fields a config file may set: all but the per-batch ones."""
        return tuple(f for f in fields(cls) if not f.metadata.get("per_batch"))

    @classmethod
    def correction_parameters(cls) -> tuple[str, ...]:
        """The names of the rollout corrections' parameters (correction_cap, icepop_alpha, ...)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("of_correction"))


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


# the hyper-parameters held as Python floats (ints given are converted)
_NUMBERS = tuple(f.name for f in LossConfig.hyperparameters() if f.type in ("float", "float | None"))

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


_register_policy_loss, _get_policy_loss = _registrar(POLICY_LOSSES, "policy loss")
register_aggregation, _get_aggregation = _registrar(AGGREGATIONS, "aggregation")
register_kl, _get_kl = _registrar(KL_ESTIMATORS, "KL estimator")
register_correction, _get_correction = _registrar(CORRECTIONS, "rollout correction")


def register_policy_loss(
    name: str, *aliases: str, token_level: bool = False, fused: bool = False, uses_is_weight: bool = False
):
    """``@register_policy_loss("name", *aliases, ...)``: a policy loss ``fn(lp, old, adv, mask, cfg, *,
    is_weight=None) -> LossTerms``, with what the dispatch needs to know about it:

    token_level: each token's terms depend on no other token of its sequence (chunks may cross sequences).
    fused: the fused Triton kernel implements it (a branch of ``triton._policy_loss_kernel``); a loss
        without one runs on the torch path, with a warning where the fused path was asked for or picked.
    uses_is_weight: it takes the correction weight itself (``is_weight=``) instead of being multiplied by it.
    """
    if fused and not token_level:
        raise ValueError(f"policy loss {name!r}: fused=True needs token_level=True (the kernel is per token)")
    return _register_policy_loss(
        name, *aliases, token_level=token_level, fused=fused, uses_is_weight=uses_is_weight
    )


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


@register_policy_loss("grpo", "ppo", "vanilla", token_level=True, fused=True)
def clip_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """PPO/GRPO clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

    ``eps_high > eps_low`` is DAPO's clip-higher; ``clip_ratio_c`` adds the dual clip for A < 0
    (loss <= -A c); ``delta`` caps the unclipped ratio (two-sided clip, r <= delta).
    """
    return _clipped_surrogate(_log_ratio(lp, old, cfg), adv, cfg)


@register_policy_loss("gspo")
def gspo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log r_t), broadcast to the tokens.

    The gradient reaches every token through the mean (1/|y| each). Typical eps are 3e-4 / 4e-4.
    """
    log_s = seq_mean(_log_ratio(lp, old, cfg), mask).unsqueeze(-1).expand_as(lp)
    return _clipped_surrogate(log_s, adv, cfg)


@register_policy_loss("cispo", token_level=True, fused=True)
def cispo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """CISPO: -sg(min(r, r_max)) A lp, r_max = ``cispo_clip_max`` (default 1 + eps_high)."""
    r = torch.exp(_log_ratio(lp, old, cfg)).detach()
    r_max = cfg.cispo_clip_max if cfg.cispo_clip_max is not None else 1.0 + cfg.eps_high
    w = r.clamp(max=r_max)
    return LossTerms(-w * adv * lp, r, torch.zeros_like(r, dtype=torch.bool), (r > r_max) & (adv > 0))


@register_policy_loss("sapo", token_level=True, fused=True)
def sapo_loss(lp, old, adv, mask, cfg: LossConfig, **_) -> LossTerms:
    """SAPO: -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_tau_pos for A > 0 else sapo_tau_neg."""
    r = torch.exp(_log_ratio(lp, old, cfg))
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(r.dtype)
    loss = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
    return LossTerms(loss, r.detach())


@register_policy_loss("gmpo")
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


@register_policy_loss("vespo", uses_is_weight=True)
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
    if cfg.loss_scale is not None:  # > 0 (LossConfig checks)
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
