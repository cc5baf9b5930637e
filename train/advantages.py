"""Advantage estimators, registered by name. Each maps per-response rewards to per-response advantages.

rewards: [n_groups, G] fp32, one row per prompt, G sampled responses each. Returns [n_groups, G] fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn

    return wrap


def compute_advantages(name: str, rewards: torch.Tensor, **kwargs) -> torch.Tensor:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    return ADVANTAGES[name](rewards.float(), **kwargs)


@register_advantage("grpo")
def grpo_advantage(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps), std unbiased as in GRPO."""
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """r - group mean, no std division (Dr.GRPO: the std term biases toward easy and hard prompts)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """r - mean of the other G-1 rewards in the group (leave-one-out baseline)."""
    g = rewards.shape[1]
    if g < 2:
        raise ValueError("rloo needs a group size of at least 2")
    return (rewards - rewards.mean(dim=1, keepdim=True)) * g / (g - 1)


@register_advantage("reinforce_pp")
def reinforce_pp_advantage(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ style: subtract the group mean, then normalise by the whole batch's std."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (centred.std() + eps) if centred.numel() > 1 else centred
