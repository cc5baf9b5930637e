"""The two settings of a `RolloutEngine` (bitrl.rollout.generation): what it samples (`Sampling`) and how it
runs (`EngineOptions`).

Sampling distributions have one definition, bitrl.kernels.sampling (temperature, sort-free tie-robust top-k /
top-p, counter-based Gumbel-max draw). Log-probs are those of the distribution actually sampled from (the
kept support, renormalised), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitrl.kernels.sampling import check_sampling_settings, filter_logits, fused_sample
from bitrl.rollout.decoder import KV_CACHE_DTYPES


def filtered_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Log-probabilities of the sampling distribution. logits: [..., V], any float dtype. Returns [..., V]
    fp32, -inf outside the kept support. temperature must be > 0 (greedy is the caller's)."""
    return torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)


@dataclass
class Sampling:
    """What a rollout samples: up to `max_new_tokens` tokens after each prompt, a row stopping at `eos_id`
    (responses right-padded with `pad_id`), each token drawn from softmax(logits / temperature) restricted
    to the top_k most likely tokens (0: all) and to the smallest set holding top_p of the mass (1: all).
    temperature 0 is greedy (log-prob 0)."""

    max_new_tokens: int
    eos_id: int
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling_settings(self.temperature, self.top_k, self.top_p)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)

    def draw(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
        """One token per row of logits [B, V] with row seeds [B] at counters `positions` [B]. Returns
        (tokens [B] int64, logprobs [B] fp32)."""
        return fused_sample(logits, seeds, positions, self.temperature, self.top_k, self.top_p)

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """`filtered_logprobs` of logits [..., V] under these settings (temperature > 0)."""
        return filtered_logprobs(logits, self.temperature, self.top_k, self.top_p)

    def top(self, logits: torch.Tensor, k: int):
        """(ids [B, K] int64, log-probs [B, K] fp32) of the sampling distribution's K = min(k, V) most likely
        tokens (speculative reuse's exact mode keeps them with its drafts)."""
        logp = self.logprobs(logits)
        values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        return ids, values


@dataclass
class EngineOptions:
    """How a `RolloutEngine` runs (bitrl.engine.config.RolloutConfig holds the same fields).

    max_batch_rows: rows decoding at once; kv_cache_dtype: "auto" (the model's dtype) or "fp8" (E4M3, values
    clamped to +-448); compile: torch.compile the decode step ("auto": on CUDA only: on the 2-core CPU the
    compiled step ran at 0.94x the eager one, SmolLM2-135M bf16 at 64 rows, see README; a compiled step keeps
    max_batch_rows slots at a power-of-two width, so rollouts of any size share its graphs, finished slots
    are recycled and the batch never shrinks); sync_every: decode steps between host looks at the finished
    rows (None: 1 on CPU, where a look costs nothing, 8 on CUDA); aligned: the matched-precision mode
    (bitrl.kernels.aligned: every op batch-invariant, the log-probs those the aligned trainer computes; not
    compiled, and the KV cache in the model's dtype)."""

    max_batch_rows: int = 256
    kv_cache_dtype: str = "auto"
    compile: bool | str = "auto"
    sync_every: int | None = None
    aligned: bool = False

    def __post_init__(self):
        if not (isinstance(self.max_batch_rows, int) and self.max_batch_rows >= 1):
            raise ValueError(f"max_batch_rows: must be an int >= 1, got {self.max_batch_rows!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile: must be true, false or 'auto', got {self.compile!r}")
        if self.sync_every is not None and not (isinstance(self.sync_every, int) and self.sync_every >= 1):
            raise ValueError(f"sync_every: must be an int >= 1 or None, got {self.sync_every!r}")
        if self.aligned and self.compile is True:
            raise ValueError("aligned: the aligned decode step is not compiled; set compile false or 'auto'")
        if self.aligned and self.kv_cache_dtype != "auto":
            raise ValueError("aligned: the trainer holds no fp8 K/V; set kv_cache_dtype to 'auto'")

    @classmethod
    def from_config(cls, rollout_cfg) -> EngineOptions:
        """From a bitrl.engine.config.RolloutConfig."""
        return cls(
            max_batch_rows=rollout_cfg.max_batch_rows,
            kv_cache_dtype=rollout_cfg.kv_cache_dtype,
            compile=rollout_cfg.compile,
            aligned=rollout_cfg.aligned,
        )
