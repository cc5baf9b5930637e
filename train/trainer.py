"""One RL training step: old log-probs recomputed by the trainer, then several clipped-ratio updates."""

from __future__ import annotations

import torch

from bitrl.kernels import fused_linear_policy_loss
from bitrl.kernels.core_algos import LossConfig, ais_coefficients
from bitrl.rollout.engine import Rollout
from bitrl.train.distributed import call_as_forward, full_tensor, gather_rows, global_counts, reduce_metrics
from bitrl.train.logprobs import response_hidden_states, token_logprobs
from bitrl.train.mismatch import mismatch_diagnostics

# Loss metrics worth a column in metrics.jsonl; rollout/trainer mismatch is logged once per batch below.
LOGGED_LOSS_METRICS = (
    "clipfrac",
    "clipfrac_low",
    "clipfrac_high",
    "ratio_mean",
    "ratio_max",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "is_weight_zero_frac",
    "masked_frac",
    "entropy",
)


def rollout_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    return Rollout(*(getattr(rollout, f)[rows] for f in Rollout.__dataclass_fields__))


class PolicyTrainer:
    """Owns the policy's optimizer and applies one RL update per rollout batch.

    cfg: a bitrl.engine.config.TrainConfig (any object with the same fields works).
    """

    def __init__(self, policy: torch.nn.Module, cfg, temperature: float = 1.0):
        self.policy, self.cfg, self.temperature = policy, cfg, temperature
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        # Mixed precision: the weights and the optimizer stay in the model's dtype, the forward runs under
        # autocast; fp16 also scales the loss so that small gradients do not flush to zero.
        self.device_type = next(policy.parameters()).device.type
        self.autocast = getattr(cfg, "autocast", "none")
        if self.autocast == "auto":
            self.autocast = "bf16" if self.device_type == "cuda" else "none"
        # A disabled GradScaler passes everything through, so fp32/bf16 take the same code path.
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=self.autocast == "fp16")

    def precision(self):
        """The trainer's forward precision: autocast to bf16/fp16, or a no-op."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.autocast)
        return torch.autocast(self.device_type, dtype=dtype, enabled=dtype is not None)

    def forward(self, rollout: Rollout, with_entropy: bool = True):
        """(logprobs, entropy) of the rollout's tokens under the policy, in the trainer's precision."""
        with self.precision():
            return call_as_forward(
                self.policy, lambda: token_logprobs(self.policy, rollout, self.temperature, with_entropy)
            )

    @torch.no_grad()
    def old_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs of the sampled tokens under the current weights, before any update: [B, R] fp32."""
        return self.forward(rollout, with_entropy=False)[0]

    def step(self, rollout: Rollout, advantages: torch.Tensor) -> dict[str, float]:
        """advantages: [B] fp32, one per response. Returns averaged metrics of the update."""
        cfg = self.cfg
        self.policy.train()
        old = self.old_logprobs(rollout)
        mask = rollout.response_mask
        batch = mask.shape[0]
        sums: dict[str, float] = {}
        n_updates = 0
        for _ in range(cfg.updates_per_batch):
            for rows in torch.arange(batch, device=mask.device).chunk(cfg.minibatches):
                part = rollout_rows(rollout, rows)
                # LM head, log-probs, entropy and loss in one op: no [tokens, vocab] logits, and the
                # gradient is formed in the forward pass (one matmul fewer than log-probs then loss).
                # Sharded (FSDP2): run as the root's forward; the root (embeddings, final norm, LM head)
                # then stays gathered through this micro-batch's loss and backward: one gather of the head.
                with self.precision():
                    hidden = call_as_forward(self.policy, lambda: response_hidden_states(self.policy, part))
                # Data-parallel: normalise by the counts over all ranks (None: this batch's own counts).
                tokens, seqs = global_counts(part.response_mask)
                head = self.policy.get_output_embeddings()
                bias = getattr(head, "bias", None)
                loss, metrics = fused_linear_policy_loss(
                    hidden,
                    head.weight.to(hidden.dtype),
                    part.response_ids,
                    old[rows],
                    advantages[rows],
                    part.response_mask,
                    bias=None if bias is None else bias.to(hidden.dtype),
                    temperature=self.temperature,
                    compute_entropy=True,
                    loss_type=cfg.loss_type,
                    loss_agg_mode=cfg.aggregation,
                    eps_low=cfg.clip_eps_low,
                    eps_high=cfg.clip_eps_high,
                    clip_ratio_c=cfg.clip_ratio_c,
                    rollout_logprobs=part.logprobs,
                    correction=cfg.correction,
                    **cfg.correction_args,
                    entropy_coef=cfg.entropy_coef,
                    global_token_count=tokens,
                    global_seq_count=seqs,
                )
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite policy loss {loss.item()} at update {n_updates}")
                self.optimizer.zero_grad(set_to_none=True)
                # fp16: an overflowing step is skipped and the scale lowered
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                metrics = {k: float(v) for k, v in metrics.items() if k in LOGGED_LOSS_METRICS} | {
                    "loss": loss.item(),
                    "grad_norm": float(full_tensor(grad_norm)),
                }
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_updates += 1
        out = reduce_metrics({k: v / n_updates for k, v in sums.items()}, weight=float(mask.sum()))
        out.update(mismatch_diagnostics(*gather_rows(old, rollout.logprobs, mask)))  # over all ranks
        # AIS: log the batch coefficient the correction applied (old weights, before the updates)
        if cfg.correction == "ais":
            coef = ais_coefficients(old - rollout.logprobs, mask, LossConfig(**cfg.correction_args))
            out.update({f"ais_{k}": float(v) for k, v in coef.items()})
        return out
