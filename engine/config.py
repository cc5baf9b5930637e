"""Run configuration: typed, validated before any work, loadable from YAML/JSON plus key=value overrides.

Every field has a default; the defaults are the embedded demo (a small Qwen2-architecture model learning
two-digit addition). An unknown field or a bad value raises ConfigError naming the field.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from bitrl.kernels.policy_loss import LossConfig


class ConfigError(ValueError):
    pass


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    """LoRA adapters (peft) on the policy; the rollout copy receives the merged weights."""

    rank: int = Field(0, ge=0)  # 0: no LoRA, every parameter trains
    alpha: float = Field(32.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)
    # Module names (suffixes) that get adapters; "all-linear" is every linear layer but the LM head.
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # QeRL-style frozen base: "full" keeps it in model.dtype; fp8/mxfp4/nvfp4 store it quantized once,
    # shared by the trainer and the rollout copy so that both see bit-identical base weights.
    base_precision: Literal["full", "fp8", "mxfp4", "nvfp4"] = "full"

    @model_validator(mode="after")
    def _targets(self):
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("model.lora.target_modules must name at least one module, or be 'all-linear'")
        if self.base_precision != "full" and not self.rank:
            raise ValueError("model.lora.base_precision needs LoRA: set model.lora.rank > 0")
        return self


class ModelConfig(Section):
    # A Hugging Face model directory, a .gguf file (converted once into the cache), or package:NAME (the
    # .gguf file an installed Python distribution ships); None builds the demo model below.
    path: str | None = None
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    tie_embeddings: bool = True
    # Storage dtype of the loaded weights. With bfloat16/float16 the trainable parameters are still kept in
    # fp32 (train.master_weights) and only the frozen ones (a LoRA base) stay in this dtype. "auto": the
    # machine decides (auto_model_dtype), resolved when the run's config is validated.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig = LoraConfig()
    _dtype_reason: str = PrivateAttr("")  # why model.dtype is what it is, when "auto" chose it

    @property
    def dtype_line(self) -> str:
        """model.dtype as the run's first lines state it."""
        return f"model.dtype {self.dtype}" + (f" ({self._dtype_reason})" if self._dtype_reason else "")

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("model.hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


class TaskConfig(Section):
    # arithmetic: '47+86=' for the demo model; words: the same sums as English word problems, for
    # pretrained models; jsonl: {"prompt", "answer"} objects from task.path.
    kind: Literal["arithmetic", "words", "jsonl"] = "arithmetic"
    path: str | None = None  # the JSONL file for kind=jsonl
    digits: int = Field(2, ge=1, le=6)
    ops: str = "+"  # "+-" adds subtraction (negative answers); harder for the demo model
    n_eval: int = Field(400, ge=1)
    reward: str = "exact"  # a name in bitrl.engine.tasks.REWARDS
    prompt_template: str = "{prompt}"  # applied to each prompt first (inside the chat turn, if any)
    # "auto": the tokenizer's chat template when it has one (a user turn, then the assistant's header);
    # "none": the prompt text as it is.
    chat_template: Literal["auto", "none"] = "auto"
    system_prompt: str | None = None  # a system turn before the prompt; None keeps the template's default
    # words only: ask for the worked steps before "The answer is N." (long responses, to benchmark rollouts
    # of long responses); the `math` reward and greedy evaluation read the final answer.
    show_work: bool = False

    @model_validator(mode="after")
    def _check(self):
        from bitrl.engine.tasks import REWARDS

        if self.reward not in REWARDS:
            raise ValueError(f"task.reward must be one of {sorted(REWARDS)}, got {self.reward!r}")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.kind is 'jsonl'")
        if self.show_work and self.kind != "words":
            raise ValueError(f"task.show_work needs task.kind 'words', got {self.kind!r}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain '{prompt}'")
        return self


class WarmStartConfig(Section):
    steps: int = Field(1500, ge=0)  # the most supervised steps; 0 skips the warm start
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    target_accuracy: float | None = Field(0.25, gt=0, le=1)  # stop early at this validation accuracy
    eval_every: int = Field(25, ge=1)
    val_size: int = Field(200, ge=1)
    cache: bool = True  # reuse a finished warm start with the same model/task/warm-start settings


class ReuseConfig(Section):
    """Speculative rollout reuse (bitrl.rollout.reuse): last epoch's responses are drafts to verify."""

    enabled: bool = False
    # A draft token is accepted if u <= min(1, lenience * pi_new / pi_old); 1 is plain speculative acceptance.
    lenience: float = Field(1.0, gt=0, allow_inf_nan=False)
    # "exact": resample the first rejected position from the residual norm(max(0, pi_new - pi_old)), plain
    # speculative sampling (needs the old distribution: its top `exact_topk` tokens are cached, 12 bytes
    # each); "spec-rl": sample it from pi_new (SPEC-RL; biased, 2 points less accuracy on the demo).
    mode: Literal["spec-rl", "exact"] = "exact"
    cache_tokens: int = Field(4_000_000, ge=1)  # cap on cached response tokens, least recently used out
    exact_topk: int = Field(64, ge=0)  # old-distribution entries kept per token in "exact" mode
    # Drop the drafts of a group whose samples all got the same reward: reused, they would repeat a group
    # without learning signal; sampled afresh, they may find one (with it, exact reuse matches fresh
    # sampling's accuracy on the demo; without, it loses 2 points).
    refresh_flat: bool = True


class RolloutConfig(Section):
    # Weights of the rollout copy: "full" (the policy's dtype), fp32/bf16/fp16, or fp8/mxfp8/mxfp4/nvfp4.
    precision: Literal["full", "fp32", "bf16", "fp16", "fp8", "mxfp8", "mxfp4", "nvfp4"] = "full"
    # Activations of quantized rollouts: "auto" (fp8 -> W8A8 per-token, 4-bit -> weights only), None,
    # "fp8", or "mxfp4"/"nvfp4"/"mxfp8" (simulated W4A4). See bitrl.quant.QuantLinear.
    act_quant: Literal["auto", "fp8", "mxfp8", "mxfp4", "nvfp4"] | None = "auto"
    # The 4-bit (and MX) recipe, re-applied at every weight sync (bitrl.quant.recipe; measured on SmolLM2 in
    # docs/low_precision.md). Block scales: "floor" (amax; OCP floor for MX, whose maxima saturate), "rceil"
    # (MX: nothing saturates; halves the demo's MXFP4 mismatch against floor), "mse" (each block's scale
    # chosen by squared error; free at run time); "auto" is mse for mx/nvfp formats.
    scale_mode: Literal["auto", "floor", "rceil", "mse"] = "auto"
    # Outlier fallback: weights above this many block medians stay in bf16 beside the packed ones (None: off;
    # "auto": 8 for mxfp4, where 0.05% of the weights cut the mismatch 3x, off for the others).
    outlier_tau: float | Literal["auto"] | None = "auto"
    # Hadamard rotation before quantizing: "residual" (folded into the weights, the MLP input online),
    # "inputs" (every linear's input online), "none". On SmolLM2 weight-only it raises the mismatch.
    rotation: Literal["none", "residual", "inputs"] = "none"
    rotation_block: int = Field(32, ge=2)
    # Keep the N linears most sensitive to the format in fp8 (ranked once per model: bitrl.quant.sensitivity).
    fp8_layers: int = Field(0, ge=0)
    # GPTQ rounding of the FP4 weights (bitrl.quant.gptq): each column's rounding error moved onto the columns
    # not yet rounded, weighted by the layer's input Hessian, collected on the policy over gptq_prompts
    # training prompts and the policy's own responses to them; re-run at every sync, free at run time. "auto":
    # on for mxfp4/nvfp4 copies of a full fine-tune (SmolLM2's k3 2.7-4x lower), off with LoRA or DDP. In
    # a QeRL run (model.lora.base_precision) true rounds the shared base instead, once, before training.
    gptq: bool | Literal["auto"] = "auto"
    # "auto": 64, and 256 for mxfp4 (its k3 0.203 -> 0.161 on SmolLM2; nvfp4 meets its goal at 64). The
    # calibration is one batch of rollouts from the policy per sync: cheap on a GPU, not on a CPU.
    gptq_prompts: int | Literal["auto"] = "auto"
    # Hessian damping, a fraction of its mean diagonal: on SmolLM2 0.1 beat the usual 0.01 (nvfp4 k3 0.069
    # against 0.091, mxfp4 0.203 against 0.220): the calibration set is small, a firmer prior generalizes.
    gptq_damp: float = Field(0.1, gt=0, lt=1)
    # Adaptive quantization noise: K stages over the run (sigma 0, then 1e-2 -> 1e-4); 0 disables it.
    aqn_stages: int = Field(0, ge=0)
    # Where the noise goes: the rollout copy alone (an exploration perturbation the correction sees as
    # mismatch), or, QeRL's form, the policy too (its frozen RMSNorm weights, LoRA runs only) so that the
    # trainer scores the very model that sampled: the same noise in both, no mismatch from it.
    aqn_target: Literal["rollout", "policy"] = "rollout"
    prompts_per_step: int = Field(32, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(6, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Draw each step's prompts from a fixed pool of this many training problems, epoch by epoch (None: fresh
    # problems every step). Speculative reuse needs prompts to come back.
    fixed_prompts: int | None = Field(None, ge=1)
    reuse: ReuseConfig = ReuseConfig()
    # Rollout engine (bitrl.rollout.generation): rows decoding at once (continuous batching), the KV cache's
    # dtype ("auto": the rollout copy's; "fp8": E4M3) and torch.compile of the decode step ("auto": on CUDA).
    max_batch_rows: int = Field(256, ge=1)
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    compile: Literal["auto", True, False] = "auto"
    # Matched precision, bit for bit: the rollout and the trainer's forward run batch-invariant kernels
    # (bitrl.kernels.aligned), so a bf16 rollout's log-probs are the bf16 trainer's and the mismatch is 0.
    aligned: bool = False

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and "mx_scale_mode" in data:
            raise ValueError("rollout.mx_scale_mode was renamed rollout.scale_mode")
        return data

    @model_validator(mode="after")
    def _aqn(self):
        if self.aqn_stages == 1:
            raise ValueError("rollout.aqn_stages must be 0 (off) or >= 2 (the first stage has no noise)")
        if isinstance(self.outlier_tau, float) and not self.outlier_tau > 0:
            raise ValueError(f"rollout.outlier_tau must be > 0, 'auto' or null, got {self.outlier_tau}")
        if self.rotation_block & (self.rotation_block - 1):
            raise ValueError(f"rollout.rotation_block must be a power of two, got {self.rotation_block}")
        if self.aligned:
            self._check_aligned()
        return self

    def _check_aligned(self) -> None:
        refusals = {
            "matched precision has no quantized rollout; use full or bf16": self.precision
            not in ("full", "fp32", "bf16", "fp16"),
            "the trainer scores the whole distribution; set top_k=0, top_p=1": self.top_k or self.top_p < 1,
            "the trainer holds no fp8 K/V; set rollout.kv_cache_dtype=auto": self.kv_cache_dtype != "auto",
            "the aligned decode step is not compiled; set rollout.compile=auto": self.compile is True,
            "not with rollout.reuse (its verifier is not aligned yet)": self.reuse.enabled,
            "not with AQN; set rollout.aqn_stages=0": self.aqn_stages,
        }
        for reason, refused in refusals.items():
            if refused:
                raise ValueError(f"rollout.aligned: {reason}")

    @field_validator("gptq_prompts")
    @classmethod
    def _positive_prompts(cls, v):
        if v != "auto" and v < 1:
            raise ValueError(f"rollout.gptq_prompts must be >= 1 or auto, got {v}")
        return v

    def gptq_prompt_count(self, precision: str | None = None) -> int:
        """rollout.gptq_prompts with "auto" resolved for the rounded weights' precision (default:
        rollout.precision; a QeRL run passes model.lora.base_precision)."""
        if self.gptq_prompts != "auto":
            return self.gptq_prompts
        return 256 if (precision or self.precision) == "mxfp4" else 64

    def _gptq(self, fmt: str, rotation, possible: bool) -> bool:
        if self.gptq == "auto":
            return possible and fmt in ("mxfp4", "nvfp4") and rotation is None
        if self.gptq and not possible:
            raise ValueError(
                "rollout.gptq: not with data-parallel runs, nor with LoRA on a full-precision base "
                "(their syncs do not calibrate)"
            )
        return self.gptq

    def quant_recipe(self, fmt: str, fp8_layers: tuple[str, ...] = (), gptq_possible: bool = True):
        """The bitrl.quant.QuantRecipe of a rollout copy in weight format `fmt`, every "auto" resolved.

        gptq_possible: False where the run cannot calibrate the copy (LoRA, data-parallel): "auto" is off
        there, an explicit rollout.gptq=true an error."""
        from bitrl.quant.recipe import recipe_for
        from bitrl.quant.rotation import Rotation

        rotation = None if self.rotation == "none" else Rotation(self.rotation, self.rotation_block)
        return recipe_for(
            fmt,
            act=self.act_quant,
            scale_mode=self.scale_mode,
            outlier_tau=self.outlier_tau,
            rotation=rotation,
            fp8_layers=fp8_layers,
            gptq=self._gptq(fmt, rotation, gptq_possible),
            gptq_damp=self.gptq_damp,
        )


def _loss_fields() -> dict:
    """LossConfig's hyper-parameters as pydantic fields: the same names, types and defaults."""
    hints = typing.get_type_hints(LossConfig)
    return {f.name: (hints[f.name], f.default) for f in LossConfig.hyperparameters()}


class TrainLossConfig(create_model("LossFields", __base__=Section, **_loss_fields())):
    """train.loss: the policy loss's options, the fields of bitrl.kernels.LossConfig by the same names (its
    comments give their meaning), which the trainer takes as they are (`loss_config`). LossConfig validates
    them; the trainer's defaults differ in eps_high (DAPO's clip-higher), and it bounds eps_low below 1 and
    entropy_coef at 0 (a bonus, never a penalty). Example: train.loss.correction=icepop,
    train.loss.icepop_beta=5."""

    eps_low: float = Field(0.2, ge=0, lt=1)
    eps_high: float | None = Field(0.28, ge=0)
    entropy_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _valid(self):
        try:
            self.loss_config()
        except ValueError as e:
            raise ValueError(f"train.loss.{e}") from None
        if self.kl_coef:
            raise ValueError("train.loss.kl_coef: the trainer has no reference model; it must be 0")
        return self

    def loss_config(self) -> LossConfig:
        """The LossConfig of these fields."""
        return LossConfig(**self.model_dump())


# TrainConfig fields that moved into train.loss under LossConfig's names: a config that still sets one is
# refused with the new name.
MOVED_TRAIN_FIELDS = {
    "loss_type": "loss.loss_type",
    "aggregation": "loss.loss_agg_mode",
    "clip_eps_low": "loss.eps_low",
    "clip_eps_high": "loss.eps_high",
    "clip_ratio_c": "loss.clip_ratio_c",
    "entropy_coef": "loss.entropy_coef",
    "correction": "loss.correction",
    "correction_args": "loss.<name> (each parameter by its name, e.g. train.loss.icepop_alpha)",
}


SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
LORA_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value
MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)


def parse_size(value, words: str) -> int:
    """A whole number of bytes >= 0 from bytes or a size with a unit ("512MiB", "2GiB", "4MB"); the error
    names what else the field takes (`words`)."""
    text = value.strip() if isinstance(value, str) else None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text) if text is not None else None
    if match and match.group(2).lower() in SIZE_UNITS:
        value = float(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    if not ok or value != int(value):
        raise ValueError(f"expected {words}, bytes >= 0 or a size such as '512MiB', got {value!r}")
    return int(value)


class TrainConfig(Section):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    # Trainer forward precision on top of model.dtype weights: fp16 adds dynamic loss scaling; "auto" is bf16
    # on a GPU and none (the weights' own dtype) on a CPU.
    autocast: Literal["auto", "none", "bf16", "fp16"] = "auto"
    updates_per_batch: int = Field(2, ge=1)  # optimizer passes over each rollout batch (PPO epochs)
    minibatches: int = Field(1, ge=1)  # optimizer steps per pass
    advantage: str = "grpo"
    # The policy loss: loss type, clip range, aggregation, entropy bonus, rollout correction (LossConfig).
    loss: TrainLossConfig = TrainLossConfig()
    # Trainable parameters and AdamW states in fp32 ("fp32"; the forward runs under autocast in model.dtype)
    # or in model.dtype ("model": plain bf16, half the memory, but updates below bf16's 2^-8 relative
    # resolution are rounded away; RL learning rates of 1e-6..1e-5 are mostly below it).
    master_weights: Literal["fp32", "model"] = "fp32"
    # Recompute each decoder layer in the backward pass instead of storing its activations.
    gradient_checkpointing: bool = False
    # Token budget of one micro-batch (rows x padded length) for the old-log-prob pass and the update;
    # gradients accumulate over a minibatch's micro-batches, so the update equals the one-batch update.
    # 0: one micro-batch per minibatch.
    micro_batch_tokens: int = Field(0, ge=0)
    # Data-parallel training under torchrun (`bitrl train --nproc N`): how the policy is sharded, and FSDP2's
    # mixed precision ("auto": bf16 parameters, fp32 gradient reduction on GPUs; the weights' dtype on CPUs).
    distributed: Literal["fsdp2"] = "fsdp2"
    fsdp_mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    # Bytes of [tokens x vocabulary] buffers the fused LM-head ops (old log-probs, loss) may hold: time
    # against memory. A budget that holds the 3-product form's working set (kept logits, one-pass chunks)
    # runs it, a smaller one the two-pass tiles (4 products, the least memory). "auto": what the memory plan
    # has to spare (95% of the device minus the plan); bytes, or a size such as "512MiB" / "2GiB"; 0: tight.
    loss_memory_budget: int | Literal["auto"] = "auto"
    # CPU runs: glibc's mmap threshold, the size above which a freed tensor goes back to the OS (time against
    # memory: docs/trainer.md, memory plan). "auto": pinned at 128 KiB for a LoRA run, whose short-lived
    # adapter tensors otherwise leave resident heap holes (peak near the plan; the step up to 2x slower at 64
    # rows), glibc's own for the rest; "glibc": never pinned (fastest, the highest peak); or a size in
    # between such as "4MiB" / "16MiB".
    mmap_threshold: int | Literal["auto", "glibc"] = "auto"

    # Each "auto" is resolved here, once: the trainer and the memory plan both ask.
    def resolved_autocast(self, device_type: str, model_dtype) -> Literal["none", "bf16", "fp16"]:
        """train.autocast for weights loaded in `model_dtype` (a torch dtype or a model.dtype name) on
        `device_type`: "auto" is bf16 on a GPU, and on a CPU the weights' own dtype (bf16 / fp16 for half
        weights, else none)."""
        if self.autocast != "auto":
            return self.autocast
        if device_type == "cuda":
            return "bf16"
        return {"bfloat16": "bf16", "float16": "fp16"}.get(str(model_dtype).removeprefix("torch."), "none")

    def resolved_loss_memory_budget(self, spare: float | None) -> int | None:
        """train.loss_memory_budget in bytes: "auto" is ``spare`` (what the run's memory plan has to spare;
        None without a plan: the ops' own per-device default)."""
        if self.loss_memory_budget != "auto":
            return self.loss_memory_budget
        return None if spare is None else max(0, int(spare))

    def resolved_fsdp_mixed_precision(self, device_type: str) -> Literal["none", "bf16"]:
        """train.fsdp_mixed_precision on `device_type`: "auto" is bf16 on a GPU, none on a CPU."""
        if self.fsdp_mixed_precision != "auto":
            return self.fsdp_mixed_precision
        return "bf16" if device_type == "cuda" else "none"

    def resolved_mmap_threshold(self, device_type: str, lora: bool) -> int | None:
        """train.mmap_threshold in bytes, or None: leave glibc's own. "auto" pins 128 KiB for a LoRA run on a
        CPU and leaves every other run alone; a size applies to any CPU run; nothing applies on a GPU."""
        if device_type != "cpu" or self.mmap_threshold == "glibc":
            return None
        if self.mmap_threshold == "auto":
            return LORA_MMAP_THRESHOLD if lora else None
        return self.mmap_threshold

    @field_validator("loss_memory_budget", mode="before")
    @classmethod
    def _budget(cls, value):
        """ "auto", a whole number of bytes >= 0, or a size with a unit (KiB, MiB, GiB, KB, MB, GB)."""
        return value if value == "auto" else parse_size(value, "'auto'")

    @field_validator("mmap_threshold", mode="before")
    @classmethod
    def _mmap_threshold(cls, value):
        if value in ("auto", "glibc"):
            return value
        size = parse_size(value, "'auto', 'glibc'")
        if not 0 < size <= MAX_MMAP_THRESHOLD:
            raise ValueError(f"a threshold in (0, 32MiB] (glibc's largest), got {value!r}")
        return size

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict):
            for old in data:
                if old in MOVED_TRAIN_FIELDS:
                    raise ValueError(f"train.{old} was renamed train.{MOVED_TRAIN_FIELDS[old]}")
        return data

    @model_validator(mode="after")
    def _names(self):
        from bitrl.train.advantages import ADVANTAGES

        if self.advantage not in ADVANTAGES:
            raise ValueError(f"train.advantage must be one of {sorted(ADVANTAGES)}, got {self.advantage!r}")
        return self


def auto_model_dtype(device_type: str) -> tuple[str, str]:
    """What model.dtype "auto" means on `device_type` ("cpu" or "cuda"): (dtype name, the reason, for the
    run's first lines). bf16 where the device multiplies it natively (a GPU with bf16, a CPU with AMX-BF16 or
    AVX-512 BF16), fp32 elsewhere: torch emulates bf16 matmuls on an AVX2-only CPU several times slower."""
    import torch

    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU multiplies bf16 natively"
        return "float32", "this GPU has no native bf16"
    from bitrl.kernels.bench_stats import machine

    units = machine()["native_bf16"]
    if units:
        return "bfloat16", f"this CPU has bf16 units ({', '.join(units)})"
    return "float32", "this CPU has no bf16 units (AMX-BF16, AVX-512 BF16): bf16 would run emulated, slower"


class Config(Section):
    name: str = "demo"
    seed: int = 0
    steps: int = Field(200, ge=1)
    eval_every: int = Field(20, ge=1)
    checkpoint_every: int = Field(20, ge=1)
    out_dir: str = "runs"
    threads: int = Field(0, ge=0)  # torch intra-op threads; 0 keeps torch's default
    device: str = "auto"  # "auto" (cuda when present, else cpu), "cpu", "cuda" or "cuda:N"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _resolve_model_dtype(self):
        # Once, here: the run, its saved config.json and a resume on another machine all see one dtype.
        if self.model.dtype == "auto":
            self.model.dtype, why = auto_model_dtype(self.torch_device.type)
            self.model._dtype_reason = f"auto: {why}"
        return self

    @model_validator(mode="after")
    def _aqn_on_the_policy(self):
        # In a full fine-tune the RMSNorm weights train: noise on them would be trained into the policy.
        if self.rollout.aqn_target == "policy" and not self.model.lora.rank:
            raise ValueError(
                "rollout.aqn_target=policy: needs LoRA (frozen RMSNorm weights); set model.lora.rank"
            )
        return self

    @model_validator(mode="after")
    def _gptq_rounds_fp4(self):
        fp4 = ("mxfp4", "nvfp4")
        if self.rollout.gptq is True and not (
            self.rollout.precision in fp4 or (self.model.lora.rank and self.model.lora.base_precision in fp4)
        ):
            raise ValueError(
                "rollout.gptq rounds FP4 weights: set rollout.precision (or, with LoRA, "
                f"model.lora.base_precision) to mxfp4 or nvfp4, not {self.rollout.precision}"
            )
        return self

    @model_validator(mode="after")
    def _aligned_runs(self):
        if self.rollout.aligned:
            if self.model.lora.base_precision != "full":
                raise ValueError("rollout.aligned: a quantized LoRA base is not matched precision")
            if self.model.lora.rank and self.model.lora.dropout:
                raise ValueError(
                    "rollout.aligned: merged LoRA weights take no dropout; set model.lora.dropout=0"
                )
            if self.train.gradient_checkpointing:
                raise ValueError("rollout.aligned: not with train.gradient_checkpointing yet")
        return self

    @model_validator(mode="after")
    def _no_warmstart_for_pretrained(self):
        # A pretrained model starts RL as it is; the supervised warm start exists for the random demo model.
        if self.model.path and "steps" not in self.warmstart.model_fields_set:
            self.warmstart.steps = 0
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        import torch

        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        if value.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"{value!r} asked for, but this torch build sees no CUDA device")
        return value

    @property
    def torch_device(self):
        """The torch.device to run on ("auto": cuda when present, else cpu)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(tree: dict, key: str, value) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config field {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{field}: {msg}")
    return "invalid config: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML/JSON file <- `section.key=value` overrides (values parsed as JSON when they parse)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        tree = yaml.safe_load(path.read_text()) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(value))
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
