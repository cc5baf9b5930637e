"""Adaptive quantization noise (AQN, after QeRL): Gaussian noise on the RMSNorm weights of the rollout copy.

Quantization noise is a fixed perturbation of the rollout policy; AQN adds a controlled, decaying,
channel-wise perturbation on top of it (noise on an RMSNorm weight scales the input channels of the next
linear layers, i.e. it acts like multiplicative weight noise ``W diag(1 + eps / w)``), which raises the
rollout policy's entropy early in training (exploration) and vanishes later.

Schedule: training is split into ``num_stages`` (K) equal stages; sigma is 0 in the first stage and decays
geometrically from ``sigma_start`` (1e-2) in the second stage to ``sigma_end`` (1e-4) in the last:
``sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))`` for ``k = 1 .. K-1``.

Use::

    aqn = AQN(AQNSchedule(total_steps=1000, num_stages=5), seed=0)
    for step in range(1000):
        ...  # optimizer step on the policy
        requantize_(rollout_model, policy)
        aqn.apply_(rollout_model, step)      # noise on the rollout copy only; returns sigma

The noise is re-drawn at every call (seeded by ``(seed, step)``) and always added to the clean weight: if
something else writes the norm weight between calls (``requantize_`` copying the trainer's new weight), that
write becomes the new clean weight; otherwise the clean copy kept here is used, so noise never accumulates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["AQN", "AQNSchedule", "is_rmsnorm"]


@dataclass(frozen=True)
class AQNSchedule:
    """Stage-wise geometric sigma schedule (see module doc)."""

    total_steps: int
    num_stages: int = 5
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2 (the first stage has no noise), got {self.num_stages}")
        if not (self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError("sigma_start and sigma_end must be positive")

    def stage(self, step: int) -> int:
        return min(self.num_stages - 1, max(0, step) * self.num_stages // self.total_steps)

    def stage_sigma(self, k: int) -> float:
        if k <= 0:
            return 0.0
        if self.num_stages == 2:
            return self.sigma_start
        t = (k - 1) / (self.num_stages - 2)
        return float(self.sigma_start * (self.sigma_end / self.sigma_start) ** t)

    def sigma(self, step: int) -> float:
        return self.stage_sigma(self.stage(step))

    def sigmas(self) -> list[float]:
        return [self.stage_sigma(k) for k in range(self.num_stages)]


def is_rmsnorm(name: str, module: nn.Module) -> bool:
    """RMSNorm layers of Hugging Face models (Qwen2RMSNorm, LlamaRMSNorm, ...) and torch.nn.RMSNorm."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and (
        isinstance(module, getattr(nn, "RMSNorm", ())) or type(module).__name__.endswith("RMSNorm")
    )


class AQN:
    """Applies the schedule's noise to the RMSNorm weights of a (rollout) model."""

    def __init__(
        self,
        schedule: AQNSchedule,
        *,
        seed: int = 0,
        select: Callable[[str, nn.Module], bool] = is_rmsnorm,
    ):
        self.schedule = schedule
        self.seed = seed
        self.select = select
        self._clean: dict[int, torch.Tensor] = {}
        self._written_version: dict[int, int] = {}

    @torch.no_grad()
    def apply_(self, model: nn.Module, step: int) -> float:
        """Set every selected weight to ``clean + N(0, sigma(step)^2)``; returns sigma."""
        sigma = self.schedule.sigma(step)
        gen = torch.Generator().manual_seed(hash((self.seed, int(step))) & 0x7FFFFFFF)
        for name, module in model.named_modules():
            if not self.select(name, module):
                continue
            w = module.weight
            key = id(w)
            if key not in self._clean or self._written_version.get(key) != w._version:
                self._clean[key] = w.detach().clone()  # first call, or someone else wrote the weight
            clean = self._clean[key]
            if sigma > 0:
                noise = torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.device, w.dtype)
                w.copy_(clean + sigma * noise)
            else:
                w.copy_(clean)
            self._written_version[key] = w._version
        return sigma

    @torch.no_grad()
    def remove_(self, model: nn.Module) -> None:
        """Restore the clean weights."""
        for _, module in model.named_modules():
            w = getattr(module, "weight", None)
            if w is not None and id(w) in self._clean and self._written_version.get(id(w)) == w._version:
                w.copy_(self._clean[id(w)])
                self._written_version[id(w)] = w._version
