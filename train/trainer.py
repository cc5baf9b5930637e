"""One RL training step: old log-probs recomputed by the trainer, then several clipped-ratio updates.

Sized for real models: micro-batches by token budget with gradient accumulation (the loss normalisers and the
rollout-correction weights are those of the whole minibatch, so the accumulated gradient is the one-batch
gradient), gradient checkpointing, fp32 master weights under a bf16/fp16 forward, and an optimizer over the
trainable parameters only (the LoRA adapters when there are some).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from bitrl.kernels import fused_linear_policy_loss, policy_loss
from bitrl.kernels.policy_loss import LossConfig, ais_coefficients, ais_moments, get_correction
from bitrl.rollout.batch import Rollout
from bitrl.train.distributed import (
    call_as_forward,
    full_tensor,
    gather_rows,
    global_counts,
    is_distributed,
    reduce_metrics,
    shard_policy,
    sum_over_ranks,
)
from bitrl.train.logprobs import (
    aligned_token_logprobs_of,
    lm_head_operands,
    response_hidden_states,
    token_logprobs,
)
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


# Metrics combined over micro-batches by max / min instead of a token-weighted mean.
_MAX_METRICS, _MIN_METRICS = ("ratio_max", "is_weight_max"), ("is_weight_min",)


def rollout_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    return Rollout(*(getattr(rollout, f)[rows] for f in Rollout.__dataclass_fields__))


def micro_batches(rows: torch.Tensor, seq_len: int, token_budget: int) -> list[torch.Tensor]:
    """Split row indices into micro-batches of at most `token_budget` padded tokens (at least one row each);
    token_budget 0 keeps them whole."""
    if not token_budget:
        return [rows]
    return list(rows.split(max(1, token_budget // seq_len)))


def correction_config(cfg: LossConfig, log_rho, mask) -> LossConfig:
    """The LossConfig the corrections see: AIS's batch statistics are the global batch's (all ranks)."""
    if "ais" in cfg.corrections and is_distributed():
        return dataclasses.replace(cfg, ais_moments=sum_over_ranks(ais_moments(log_rho, mask, cfg)))
    return cfg


def correction_weights(old, rollout_logprobs, mask, cfg: LossConfig):
    """The rollout correction ``cfg.correction`` of a whole minibatch, from the old (trainer) and rollout
    log-probs: (weights [B, T] fp32 or None, keep [B, T] bool); several corrections multiply their weights and
    intersect their masks. Computed once per minibatch so that batch-level corrections (AIS) and token counts
    after masking do not depend on how the minibatch is split into micro-batches."""
    m = mask.float()
    log_rho = (old.float() - rollout_logprobs.float()) * m
    cfg = correction_config(cfg, log_rho, m)
    weight, keep = None, mask
    for name in cfg.corrections:
        result = get_correction(name)(log_rho, m, cfg)
        if result.keep is not None:
            keep = keep & result.keep
        if result.weight is not None:
            w = result.weight.detach().float()
            weight = w if weight is None else weight * w
    return weight, keep


class PolicyTrainer:
    """Owns the policy's optimizer and applies one RL update per rollout batch.

    cfg: the run's train section, a bitrl.engine.config.TrainConfig (tests build one from the schema too);
    its "auto" settings are resolved by the config itself (resolved_autocast, resolved_fsdp_mixed_precision,
    resolved_loss_memory_budget). spare_bytes: what the run's memory plan has to spare (MemoryPlan.spare),
    the fused LM-head ops' memory budget under train.loss_memory_budget=auto; None: the ops' own default.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        cfg,
        temperature: float = 1.0,
        spare_bytes: float | None = None,
        aligned: bool = False,
    ):
        self.policy, self.cfg, self.temperature, self.aligned = policy, cfg, temperature, aligned
        self.memory_budget = cfg.resolved_loss_memory_budget(spare_bytes)  # bytes, or None
        self.loss = cfg.loss.loss_config()  # train.loss: LossConfig's fields by their names
        self.micro_batch_tokens = cfg.micro_batch_tokens
        self.trainable = [p for p in policy.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the policy has no trainable parameters")
        # The dtype the weights were loaded in; with fp32 master weights only the trainable ones are upcast
        # (a frozen LoRA base keeps its storage dtype) and the forward runs under autocast in this dtype.
        self.model_dtype = next(policy.parameters()).dtype
        device_type = self.trainable[0].device.type
        if cfg.master_weights == "fp32":
            for p in self.trainable:
                p.data = p.data.float()
        if is_distributed():  # data-parallel: parameters, gradients, optimizer states sharded (FSDP2)
            shard_policy(policy, cfg.resolved_fsdp_mixed_precision(device_type))
            self.trainable = [p for p in policy.parameters() if p.requires_grad]
        # The fused AdamW is one vectorised pass per tensor: 8x faster than the per-tensor loop on a CPU,
        # where the optimizer step dominates a full fine-tuning update of a 135M model.
        fused = self.trainable[0].device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused
        )
        if cfg.gradient_checkpointing:
            # non-reentrant: gradients reach LoRA adapters even though the layer inputs need no gradient
            kwargs = {"use_reentrant": False}
            if hasattr(policy, "activation_checkpointing_enable"):  # the newer transformers name
                policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # Mixed precision: the forward runs under autocast; fp16 also scales the loss so that small gradients
        # do not flush to zero.
        self.device_type = device_type
        self.autocast = cfg.resolved_autocast(device_type, self.model_dtype)  # "none", "bf16" or "fp16"
        if self.autocast == "fp16" and is_distributed():
            raise ValueError("train.autocast=fp16 runs on one rank only (no sharded loss scaling); use bf16")
        # A disabled GradScaler passes everything through, so fp32/bf16 take the same code path.
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=self.autocast == "fp16")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward's products: the autocast dtype, else the weights'."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.autocast, self.model_dtype)

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def precision(self):
        """The trainer's forward precision: autocast to bf16/fp16, or a no-op."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.autocast)
        return torch.autocast(self.device_type, dtype=dtype, enabled=dtype is not None)

    def forward(self, rollout: Rollout, with_entropy: bool = True):
        """(logprobs, entropy) of the rollout's tokens under the policy, in the trainer's precision."""
        if self.aligned:  # the rollout decoder's batch-invariant forward: the rollout's bits
            with self.precision():
                return self.aligned_logprobs(rollout)
        with self.precision():
            fn = partial(
                token_logprobs,
                self.policy,
                rollout,
                self.temperature,
                with_entropy,
                memory_budget=self.memory_budget,
            )
            return call_as_forward(self.policy, fn)

    def aligned_logprobs(self, rollout: Rollout):
        """The aligned forward's (logprobs, entropy) [B, R] fp32; sharded, run as the root's forward, each
        decoder layer as its own."""
        fn = partial(aligned_token_logprobs_of, self.policy, rollout, self.temperature, call_as_forward)
        return call_as_forward(self.policy, fn)

    def micro_batches(self, rows: torch.Tensor, rollout: Rollout) -> list[torch.Tensor]:
        seq_len = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
        return micro_batches(rows, seq_len, self.micro_batch_tokens)

    @torch.no_grad()
    def old_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs of the sampled tokens under the current weights, before any update: [B, R] fp32."""
        rows = torch.arange(rollout.response_ids.shape[0], device=rollout.response_ids.device)
        parts = [self.forward(rollout_rows(rollout, r), False)[0] for r in self.micro_batches(rows, rollout)]
        return torch.cat(parts)

    def backward(self, rollout: Rollout, old: torch.Tensor, advantages: torch.Tensor):
        """Accumulate into .grad the gradient of the minibatch loss, one micro-batch at a time.

        rollout: the minibatch; old, advantages: its [B, R] old log-probs and [B] advantages. Every
        micro-batch loss is normalised by the minibatch's token and sequence counts, so the micro-batch
        gradients add up to the one-batch gradient. Returns (loss, metrics) of the whole minibatch as floats.
        """
        weights, keep = correction_weights(old, rollout.logprobs, rollout.response_mask, self.loss)
        n_tokens, n_seqs = global_counts(keep)  # over all ranks when data-parallel
        # the loss sees the correction as weights and a mask (the rollout log-probs only feed its mismatch
        # metrics), and the minibatch's counts as normalisers
        loss_cfg = dataclasses.replace(
            self.loss, correction="none", global_token_count=n_tokens, global_seq_count=n_seqs
        )
        # Sums stay on the device and are read once after the last micro-batch: a read per metric per
        # micro-batch would be a device sync each.
        zero = torch.zeros((), device=old.device)
        loss_sum, n_sum, sums, finite = zero, zero, {}, torch.ones((), dtype=torch.bool, device=old.device)
        for rows in self.micro_batches(torch.arange(len(old), device=old.device), rollout):
            part = rollout_rows(rollout, rows)
            # LM head, log-probs, entropy and loss in one op: no [tokens, vocab] logits, and the gradient is
            # formed in the forward pass (one matmul fewer than log-probs then loss).
            # Sharded (FSDP2): run as the root's forward; the root (embeddings, final norm, LM head) then
            # stays gathered through this micro-batch's loss and backward: one gather of the head.
            if self.aligned:  # the old-log-prob pass's forward, differentiable: ratio 1 on-policy
                with self.precision():
                    lp, entropy = self.aligned_logprobs(part)
                loss, metrics = policy_loss(
                    lp,
                    old[rows],
                    advantages[rows],
                    keep[rows],
                    loss_cfg,
                    entropy=entropy,
                    rollout_logprobs=part.logprobs,
                    is_weights=None if weights is None else weights[rows],
                )
            else:
                with self.precision():
                    hidden = call_as_forward(self.policy, partial(response_hidden_states, self.policy, part))
                    # the LM head in the forward's precision, as the old-log-prob pass ran it
                    hidden, weight, bias = lm_head_operands(hidden, self.policy.get_output_embeddings())
                loss, metrics = fused_linear_policy_loss(
                    hidden,
                    weight,
                    part.response_ids,
                    old[rows],
                    advantages[rows],
                    keep[rows],
                    loss_cfg,
                    bias=bias,
                    temperature=self.temperature,
                    compute_entropy=True,
                    memory_budget=self.memory_budget,
                    rollout_logprobs=part.logprobs,
                    is_weights=None if weights is None else weights[rows],
                )
            # A non-finite loss is an error, found after the loop: the step it would poison never happens.
            finite = torch.isfinite(loss) & finite
            self.scaler.scale(loss).backward()  # fp16: an overflowing step is skipped and the scale lowered
            loss_sum = loss_sum + loss.detach().float()
            n = keep[rows].sum().float()
            n_sum = n_sum + n
            for k, v in metrics.items():
                if k not in LOGGED_LOSS_METRICS:
                    continue
                v = torch.as_tensor(v, device=n.device).float()
                if k in _MAX_METRICS:
                    sums[k] = torch.maximum(sums.get(k, v), v)
                elif k in _MIN_METRICS:
                    sums[k] = torch.minimum(sums.get(k, v), v)
                else:
                    sums[k] = sums.get(k, zero) + v * n
        responses, _ = global_counts(rollout.response_mask)
        read = torch.stack([finite.float(), loss_sum, n_sum, n_tokens, responses, *sums.values()]).tolist()
        finite, loss_sum, n_sum, n_tokens, responses = read[:5]
        if not finite:
            raise FloatingPointError(f"non-finite policy loss {loss_sum}")
        sums = dict(zip(sums, read[5:]))
        out = {k: v if k in _MAX_METRICS + _MIN_METRICS else v / max(n_sum, 1.0) for k, v in sums.items()}
        # the global minibatch's metrics (token means over all ranks), so that every minibatch counts alike
        # in the step's average whatever the world size
        out = reduce_metrics(out | {"loss": loss_sum}, weight=n_sum)
        out["masked_frac"] = 1.0 - n_tokens / max(responses, 1.0)
        return out.pop("loss"), out

    def step(self, rollout: Rollout, advantages: torch.Tensor) -> dict[str, float]:
        """advantages: [B] fp32, one per response. Returns averaged metrics of the update, with its time split
        (old_logprobs_time_s, update_time_s)."""
        cfg = self.cfg
        self.policy.train()
        t0 = time.perf_counter()
        old = self.old_logprobs(rollout)
        t_old = time.perf_counter() - t0
        mask = rollout.response_mask
        batch = mask.shape[0]
        sums: dict[str, float] = {}
        n_updates = 0
        if is_distributed() and batch % cfg.minibatches:
            raise ValueError(f"train.minibatches ({cfg.minibatches}) must divide this rank's {batch} rows")
        # Minibatch k is every minibatches-th row. Each rank holds a contiguous block of the global batch, so
        # (with blocks that divide by minibatches) the ranks' k-th minibatches together are the one-process
        # k-th minibatch, and a data-parallel step equals the single-process step.
        minibatches = [
            torch.arange(k, batch, cfg.minibatches, device=mask.device) for k in range(cfg.minibatches)
        ]
        for _ in range(cfg.updates_per_batch):
            for rows in filter(len, minibatches):
                self.optimizer.zero_grad(set_to_none=True)
                loss, metrics = self.backward(rollout_rows(rollout, rows), old[rows], advantages[rows])
                self.scaler.unscale_(self.optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                metrics |= {"loss": loss, "grad_norm": float(full_tensor(grad_norm))}
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_updates += 1
        out = {k: v / n_updates for k, v in sums.items()}
        out.update(mismatch_diagnostics(*gather_rows(old, rollout.logprobs, mask)))  # over all ranks
        # AIS: log the batch coefficient the correction applied (old weights, before the updates)
        if "ais" in self.loss.corrections:
            log_rho = old - rollout.logprobs
            coef = ais_coefficients(log_rho, mask, correction_config(self.loss, log_rho, mask))
            out.update({f"ais_{k}": float(v) for k, v in coef.items()})
        out["old_logprobs_time_s"] = t_old
        out["update_time_s"] = time.perf_counter() - t0 - t_old
        return out
