"""Clipped-ratio policy losses and rollout corrections in plain torch, registered by name.

Inputs are token-level [B, T]: logprobs (with grad), old_logprobs and rollout_logprobs (no grad), mask (bool),
advantages [B] or [B, T]. Everything is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOSSES: dict[str, Callable[..., torch.Tensor]] = {}
CORRECTIONS: dict[str, Callable[..., torch.Tensor]] = {}
AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {}


def _register(table: dict, name: str):
    def wrap(fn):
        table[name] = fn
        return fn

    return wrap


@_register(LOSSES, "grpo")
def grpo_token_loss(ratio, advantages, clip_eps_low=0.2, clip_eps_high=0.2, **_):
    """PPO/GRPO clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), per token."""
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


@_register(CORRECTIONS, "none")
def no_correction(log_ratio, mask, **_):
    return torch.ones_like(log_ratio)


@_register(CORRECTIONS, "tis")
def token_tis(log_ratio, mask, cap=2.0, **_):
    """Truncated importance sampling per token: min(pi_train / pi_rollout, cap)."""
    return log_ratio.exp().clamp(max=cap)


@_register(AGGREGATIONS, "token-mean")
def token_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@_register(AGGREGATIONS, "seq-mean-token-mean")
def seq_mean_token_mean(per_token, mask):
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    has_tokens = mask.any(-1)
    return per_seq[has_tokens].sum() / has_tokens.sum().clamp(min=1)


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    loss_type="grpo",
    aggregation="token-mean",
    rollout_logprobs=None,
    correction="none",
    correction_kwargs=None,
    entropy=None,
    entropy_coef=0.0,
    **loss_kwargs,
):
    """Returns (scalar loss, dict of float metrics)."""
    for name, table, key in (
        ("loss_type", LOSSES, loss_type),
        ("correction", CORRECTIONS, correction),
        ("aggregation", AGGREGATIONS, aggregation),
    ):
        if key not in table:
            raise ValueError(f"unknown {name} {key!r}; choose from {sorted(table)}")
    mask = mask.bool()
    fmask = mask.float()
    lp, old = logprobs.float(), old_logprobs.float()
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(lp)
    ratio = torch.exp((lp - old).masked_fill(~mask, 0.0))
    per_token = LOSSES[loss_type](ratio, adv, **loss_kwargs)
    weight = torch.ones_like(lp)
    if rollout_logprobs is not None:
        log_rho = (old - rollout_logprobs.float()).masked_fill(~mask, 0.0)
        weight = CORRECTIONS[correction](log_rho, mask, **(correction_kwargs or {})).detach()
    per_token = per_token * weight
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy.float()
    loss = AGGREGATIONS[aggregation](per_token, fmask)
    with torch.no_grad():
        n = fmask.sum().clamp(min=1)
        eps_low = loss_kwargs.get("clip_eps_low", 0.2)
        eps_high = loss_kwargs.get("clip_eps_high", 0.2)
        clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        metrics = {
            "clip_frac": float((clipped & mask).sum() / n),
            "ratio_mean": float((ratio * fmask).sum() / n),
            "is_weight_mean": float((weight * fmask).sum() / n),
        }
    return loss, metrics
