"""The memory plan of a run, before any work: what the weights, gradients, optimizer states, rollout copy, KV
cache and activations will take, per rank, against the device's memory.

`plan_memory` is a pure function of (run config, model config, world size, device memory): no model is built.
Weights, gradients and optimizer states are sharded over `world_size` ranks as FSDP2 (`fully_shard`) does;
the rollout copy, its KV cache and the activations are per rank (each rank generates and trains its share of
the prompt groups).

Activations are counted from what autograd keeps for one Llama/Qwen2 decoder layer (per token, in elements):
two RMSNorms (input and normalised output, kept in fp32 by the Hugging Face implementation), q/k/v and their
rotary outputs, the attention output and its log-sum-exp (SDPA keeps no [T, T] matrix), and the SwiGLU's
gate, activation, up and product. With gradient checkpointing only each layer's input is kept, plus one
layer's activations while it is recomputed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from dataclasses import dataclass, field

import torch

from bitrl.kernels.packed_linear import use_packed_linear
from bitrl.rollout.decode_loop import compiled_width

GiB = 1024**3
REFUSE_FRACTION = 0.95
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of the quantized formats, scales included: FP8 with a per-row scale, MXFP4 = 4 bits + one
# E8M0 byte per 32, NVFP4 = 4 bits + one E4M3 byte per 16.
QUANT_BYTES = {"fp8": 1.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fused log-prob/loss op materialises the LM head's logits one chunk at a time (the least it holds; what
# its memory budget allows beyond this comes out of the plan's spare memory, MemoryPlan.spare).
LOSS_CHUNK_BYTES = {"cpu": 128 * 2**20, "cuda": 1 * GiB}


def _targets(targets) -> list[str]:
    """The decoder-layer linears that model.lora.target_modules adapts."""
    return list(LINEAR_NAMES) if targets == "all-linear" else [n for n in LINEAR_NAMES if n in set(targets)]


@dataclass
class ModelShape:
    """The sizes of a decoder-only transformer that the plan needs (from a Hugging Face config)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=getattr(config, "model_type", "") == "qwen2"
            or bool(getattr(config, "attention_bias", 0)),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params(self) -> int:
        """Weights of all decoder-layer linears (what LoRA adapts and a quantized base stores)."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return embed + self.linear_params + self.layers * (2 * self.hidden + bias) + self.hidden

    def lora_params(self, rank: int, targets) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in _targets(targets))

    def adapter_input_elems(self, targets) -> int:
        """Per token and layer: the input widths of the LoRA-adapted modules."""
        return sum(self.linear_shapes()[n][0] for n in _targets(targets))

    def layer_activation_elems(self) -> tuple[int, int]:
        """(elements kept in the compute dtype, elements kept in fp32) per token for one decoder layer."""
        q, kv, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        compute = (q + 2 * kv) + (q + kv) + q + 4 * i  # q,k,v; rotary q,k; attention output; SwiGLU
        fp32 = 2 * 2 * self.hidden + self.heads  # two RMSNorms (input and normalised), attention LSE
        return compute, fp32


@dataclass
class MemoryPlan:
    """Bytes per rank of each part of a run, and the device memory it is planned against."""

    parts: dict[str, float]
    device_bytes: float
    device_name: str
    world_size: int = 1
    settings: dict[str, str] = field(default_factory=dict)  # part -> the config settings that shrink it

    @property
    def total(self) -> float:
        return sum(v for k, v in self.parts.items() if not k.startswith("_"))

    @property
    def fraction(self) -> float:
        return self.total / max(self.device_bytes, 1.0)

    @property
    def spare(self) -> float:
        """Bytes the run has to spare: the refusal limit (95% of the device) minus the plan, at least 0. The
        fused LM-head ops' default memory budget (train.loss_memory_budget=auto): what it buys is time (the
        3-product form), within memory the plan leaves unused."""
        return max(0.0, REFUSE_FRACTION * self.device_bytes - self.total)

    def line(self) -> str:
        """One line starting `memory plan:` with every part and the share of the device."""
        parts = ", ".join(f"{k} {_size(v)}" for k, v in self.parts.items() if not k.startswith("_"))
        ranks = f" per rank of {self.world_size}" if self.world_size > 1 else ""
        return (
            f"memory plan: {_size(self.total)}{ranks} of {_size(self.device_bytes)} {self.device_name} "
            f"({100 * self.fraction:.1f}%) = {parts}; activations per micro-batch without checkpointing "
            f"{_size(self.parts['_activations_plain'])}, "
            f"with {_size(self.parts['_activations_checkpointed'])}"
        )

    def refusal(self) -> str | None:
        """None when the plan fits under 95% of the device, else a message naming the settings to change."""
        if self.fraction <= REFUSE_FRACTION:
            return None
        biggest = sorted(((v, k) for k, v in self.parts.items() if k in self.settings), reverse=True)
        advice = "; ".join(f"{k} ({_size(v)}): {self.settings[k]}" for v, k in biggest[:3])
        return (
            f"the run needs {_size(self.total)}, {100 * self.fraction:.0f}% of the "
            f"{_size(self.device_bytes)} {self.device_name} (limit {100 * REFUSE_FRACTION:.0f}%). "
            f"Largest parts: {advice}. Or pass --force to run anyway."
        )


def _size(n: float) -> str:
    for unit, name in ((GiB, "GiB"), (2**20, "MiB")):
        if n >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n / 1024:.1f} KiB"


def plan_memory(
    cfg, model_config, world_size: int = 1, device_bytes: float | None = None, prompt_tokens: int = 64
) -> MemoryPlan:
    """The memory plan of run config `cfg` (bitrl.engine.config.Config) for a model with Hugging Face config
    `model_config`, per rank of `world_size`, against `device_bytes` (default: what `device_memory` reports
    for cfg's device). prompt_tokens: the longest prompt, in tokens."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shape = ModelShape.from_config(model_config)
    device_type = cfg.torch_device.type
    if device_bytes is None:
        device_bytes = device_memory(cfg.torch_device)
    lora, train, rollout = cfg.model.lora, cfg.train, cfg.rollout
    model_bytes = DTYPE_BYTES[cfg.model.dtype]
    master_bytes = 4 if train.master_weights == "fp32" else model_bytes
    half_compute = model_bytes == 2 or train.resolved_autocast(device_type, cfg.model.dtype) != "none"
    compute_bytes = 2 if half_compute else 4

    # Weights: the trainable ones in the master dtype; a LoRA base in the model dtype or quantized.
    if lora.rank:
        trainable = shape.lora_params(lora.rank, lora.target_modules)
        frozen = shape.params * model_bytes
        if lora.base_precision != "full":
            frozen -= shape.linear_params * (model_bytes - QUANT_BYTES[lora.base_precision])
            if device_type == "cpu":  # the CPU path keeps one dequantized copy of each base weight
                frozen += shape.linear_params * compute_bytes
        weights = frozen + trainable * master_bytes
    else:
        trainable = shape.params
        weights = trainable * master_bytes
    shard = 1 / world_size
    parts = {
        "weights": weights * shard,
        "gradients": trainable * master_bytes * shard,
        "optimizer": 2 * trainable * master_bytes * shard,  # AdamW: first and second moments
    }
    # A forward under autocast keeps a half-precision copy of every fp32 weight it casts until the backward.
    fp32_params = (trainable if master_bytes == 4 else 0) + (
        shape.params if lora.rank and model_bytes == 4 else 0
    )
    if compute_bytes == 2 and fp32_params:
        parts["autocast_weights"] = fp32_params * compute_bytes

    # The rollout copy: merged weights in its precision (shares the base in QeRL mode), and its KV cache.
    precision = rollout.precision
    float_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}
    rollout_bytes = float_bytes.get(precision, model_bytes)
    if lora.rank and lora.base_precision != "full":
        parts["rollout_copy"] = trainable * master_bytes
    elif precision in QUANT_BYTES:
        other = shape.params - shape.linear_params
        cached = shape.linear_params * model_bytes if device_type == "cpu" else 0  # dequantized on CPU
        parts["rollout_copy"] = other * model_bytes + shape.linear_params * QUANT_BYTES[precision] + cached
    else:
        parts["rollout_copy"] = shape.params * rollout_bytes
    # An eager CPU decoder that packs its products (bitrl.kernels.packed_linear) holds every float linear
    # weight of the copy, the LM head's included, a second time in the blocked layout while it rolls out.
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(precision, cfg.model.dtype)
    rollout_float = precision not in QUANT_BYTES and not (lora.rank and lora.base_precision != "full")
    compiled = rollout.compile is True or (rollout.compile == "auto" and device_type == "cuda")
    if device_type == "cpu" and rollout_float and not compiled and use_packed_linear(getattr(torch, name)):
        parts["rollout_packed"] = (shape.linear_params + shape.vocab * shape.hidden) * rollout_bytes
    rows = math.ceil(rollout.prompts_per_step * rollout.group_size / world_size)
    seq = prompt_tokens + rollout.max_new_tokens
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * rollout_bytes
    # The decoding slots: a compiled step keeps max_batch_rows of them at a power-of-two width (one graph
    # per shape), an eager one at most that many, as wide as needed.
    slots = rollout.max_batch_rows if compiled else min(rows, rollout.max_batch_rows)
    slot_seq = compiled_width(seq) if compiled else seq
    # plus each distinct prompt prefilled once, and each row's fp32 logits and sampling probabilities at one
    # position
    prompts = math.ceil(rollout.prompts_per_step / world_size)
    parts["kv_cache"] = (prompts * prompt_tokens + slots * slot_seq) * kv_per_token + rows * shape.vocab * 8

    # Activations of one micro-batch of the update.
    minibatch_rows = math.ceil(rows / train.minibatches)
    tokens = minibatch_rows * seq
    if train.micro_batch_tokens:
        tokens = min(tokens, max(train.micro_batch_tokens // seq, 1) * seq)
    compute, fp32 = shape.layer_activation_elems()
    if lora.rank and compute_bytes < master_bytes:
        # fp32 adapters under a half-precision forward: each adapted module keeps a half copy of its input
        compute += shape.adapter_input_elems(lora.target_modules)
    per_layer = tokens * (compute * compute_bytes + fp32 * 4)
    residual = tokens * shape.hidden * 4  # each layer's input (the residual stream stays fp32 in HF models)
    head = min(tokens * shape.vocab * 4, LOSS_CHUNK_BYTES.get(device_type, GiB)) + tokens * shape.hidden * 8
    # an explicit train.loss_memory_budget may be held on top (kept logits, one-pass chunks; at most about
    # the whole [tokens, V] in fp32); "auto" takes only what the plan has to spare, so it is not counted
    if train.loss_memory_budget != "auto":
        head += min(train.loss_memory_budget, tokens * shape.vocab * 4)
    # The fused LM-head op also holds [V, H] fp32 buffers: the weight's gradient when the head trains, and on
    # a CPU its fp32 matmul operand (after a cast to the compute dtype when the head weight is fp32).
    head_matrix = shape.vocab * shape.hidden
    head_fp32 = model_bytes == 4 or (not lora.rank and master_bytes == 4)
    head += 0 if lora.rank else head_matrix * 4
    if device_type == "cpu" and compute_bytes == 2:
        head += head_matrix * (4 + (2 if head_fp32 else 0))
    plain = shape.layers * (per_layer + residual) + head
    checkpointed = shape.layers * residual + per_layer + head
    parts["activations"] = checkpointed if train.gradient_checkpointing else plain
    parts["_activations_plain"], parts["_activations_checkpointed"] = plain, checkpointed
    parts["_trainable_params"] = trainable
    settings = {
        "weights": "model.lora.rank > 0 with model.dtype=bfloat16, or model.lora.base_precision=nvfp4",
        "gradients": "model.lora.rank > 0",
        "optimizer": "model.lora.rank > 0, or train.master_weights=model",
        "autocast_weights": "model.dtype=float32 with train.autocast=none, or model.lora.rank > 0",
        "rollout_copy": "rollout.precision=bf16 or a quantized one (fp8, mxfp4, nvfp4)",
        "rollout_packed": "a quantized rollout.precision (not packed), or rollout.compile=true",
        "kv_cache": "a lower rollout.prompts_per_step, rollout.group_size or rollout.max_new_tokens",
        "activations": "a lower train.micro_batch_tokens or train.loss_memory_budget"
        + ("" if train.gradient_checkpointing else ", or train.gradient_checkpointing=true"),
    }
    name = "free HBM" if device_type == "cuda" else "available RAM"
    return MemoryPlan(parts, float(device_bytes), name, world_size, settings)


# glibc's mallopt parameter for the size above which an allocation gets its own mapping (malloc.h).
M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(cfg) -> int | None:
    """Pin glibc's mmap threshold where train.mmap_threshold asks (cfg: engine Config); the bytes pinned, or
    None where nothing was (a GPU run, glibc's own chosen, or not glibc).

    glibc raises the threshold each time a mapped block is freed (up to 32 MiB), after which activation-sized
    tensors come from the heap. peft's LoRA forward makes two short-lived [tokens, out] tensors per adapted
    layer (B·A·x and its scaled copy) between the ones autograd keeps, and the heap holes they leave stay
    resident, by an amount that varies from run to run: on SmolLM2-135M in fp32 the trainer's peak RSS (model
    included) was 6.5 GiB at 32 rows x 80 tokens (plan 3.95, pinned 3.85) and 2.3 or 3.6 GiB in two identical
    runs at 16 rows (pinned 2.1). Pinned, every large tensor is mapped afresh, which costs page faults: 10% of
    the step at 16 rows, 2x at 64 rows (docs/trainer.md), hence the choice. A full fine-tune keeps few
    short-lived tensors and stays near its plan unpinned, so "auto" leaves it alone."""
    threshold = cfg.train.resolved_mmap_threshold(cfg.torch_device.type, bool(cfg.model.lora.rank))
    if threshold is None:
        return None
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no such knob
        mallopt = None
    return threshold if mallopt and mallopt(M_MMAP_THRESHOLD, threshold) else None


def device_memory(device: torch.device) -> float:
    """Bytes free for this run: free HBM on a CUDA device, available RAM (MemAvailable) on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
