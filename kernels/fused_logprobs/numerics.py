"""Helpers shared by the engines: the matmul and accumulation dtypes, device budgets, the clamp for -inf
logits, exp via exp2."""

from __future__ import annotations

import torch

# Vocabulary columns per logits matmul on CPU: the blocks of a chunk's logits (ChunkEngine.logits) and the
# columns of the loss op's fp32 tiles (TiledLinearSoftmax.retile). Both engines read it here, at call time,
# so that one attribute sets both.
LOGITS_BLOCK = 1024


def device_budget(budgets: dict[str, int], device: torch.device | str) -> int:
    """The byte budget of ``device``'s type in a {"cpu": ..., "cuda": ...} table (others: the CPU's)."""
    return budgets.get(torch.device(device).type, budgets["cpu"])


# The default ``memory_budget`` of the fused ops (fused_logprobs, fused_linear_policy_loss) when neither the
# caller nor a memory plan gives one: bytes of [tokens x vocabulary] buffers (kept logits, tiles, chunks) an
# op may hold at once. On CPU, 1 GiB runs the 3-product form of both ops at N = 4096, V = 32768 in fp32 and
# bf16 (fused_logprobs keeps 512 MiB of fp32 / 256 MiB of bf16 logits beside its 128 MiB tiles; the loss op
# takes 128 MiB fp32 chunks, or keeps 224 MiB of bf16 logits beside its 32 MiB tiles). On a GPU the memory
# holds the model and its activations and the 4th product is cheap: 0, the two-pass (recomputing) form.
MEMORY_BUDGET = {"cpu": 1 * 2**30, "cuda": 0}


def resolve_memory_budget(memory_budget, device: torch.device | str) -> int:
    """``memory_budget`` as bytes: None is ``MEMORY_BUDGET`` of the device; else a whole number >= 0.

    Raises ``ValueError`` naming ``memory_budget`` for anything else (negative, fractional, non-finite,
    bool, a string)."""
    if memory_budget is None:
        return device_budget(MEMORY_BUDGET, device)
    ok = isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool)
    if ok and isinstance(memory_budget, float):
        ok = (
            memory_budget == memory_budget
            and abs(memory_budget) != float("inf")
            and memory_budget.is_integer()
        )
    if not ok or memory_budget < 0:
        raise ValueError(
            f"memory_budget: expected a whole number of bytes >= 0 or None, got {memory_budget!r}"
        )
    return int(memory_budget)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """Operand dtype of the Triton backend's logits matmul: native on CUDA (fp32 accumulation and output in
    cuBLAS), fp32 on CPU (the same products and sums as that fp32-output GEMM, for testing the GPU path)."""
    if x.dtype == torch.float64:
        return torch.float64
    if x.device.type == "cuda":
        return x.dtype
    return torch.float32


def _cpu_bf16_matmul_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX), else fp32: without those units torch
    emulates bf16 GEMMs, measured at ~15 GFLOP/s against 100-140 for fp32 on an AVX2 CPU."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        native = False
    return torch.bfloat16 if native else torch.float32


# The matmul dtype of bf16 inputs on CPU (see tile_matmul_dtype); a module attribute so that the tests run
# both paths on any machine.
CPU_BF16_MATMUL = _cpu_bf16_matmul_dtype()


def tile_matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """Operand dtype of the torch backend's matmuls: the input dtype, except on CPU
    * fp16: fp32 (CPU fp16 GEMMs run 3-300x slower than fp32 ones);
    * bf16: ``CPU_BF16_MATMUL``, bf16 where the CPU has bf16 units, else fp32 (an emulated bf16 GEMM runs
      ~7x slower than an fp32 one). A bf16 GEMM accumulates in fp32 and rounds its result to bf16; an fp32
      GEMM of the same bf16 operands forms the same exact products and sums and keeps the fp32 result.
    Outputs (log-probs, gradients) keep their dtypes either way."""
    if x.device.type == "cuda":
        return x.dtype
    if x.dtype == torch.float16:
        return torch.float32
    if x.dtype == torch.bfloat16:
        return CPU_BF16_MATMUL
    return x.dtype


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the sums, statistics and gradients: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# -inf logits are clamped to this value: exp() of it is exactly 0, and products with any gradient stay finite
NEG_LOGIT = -1.0e30
LOG2E = 1.4426950408889634


def exp_(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x) into ``out`` (default: in place), computed as 2^(x log2 e).

    On CPU torch's fp32 exp2 runs ~1.8x faster than its exp (2-core AVX2: 3.1 against 5.6 ms for a
    [3584, 1536] tile), enough to pay for the extra multiply pass. Rounding log2 e and x log2 e to fp32 adds
    a relative error under |x| 2^-23 to the result: the tiles exponentiate x = z - max <= 0, where p = e^x
    is negligible long before that matters (e^x |x| 2^-23 <= 4.4e-8)."""
    return torch.mul(x, LOG2E, out=x if out is None else out).exp2_()


def bmm_rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) for [c, V] tensors without a [c, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)
