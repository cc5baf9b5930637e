"""Hidden states -> per-token log-prob and entropy of the target token, without the [N, V] logits.

``fused_logprobs(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N] fp32, entropy [N] fp32 | None)``

Files, by implementation (``impl=``, or ``BITRL_KERNEL_IMPL``):

* op.py - the public op: input validation, chunk defaults, the memory budget, and the autograd Function,
  which hands forward and backward to one engine per call (``logprobs_engine``).
* reference.py - ``"reference"``: the naive unfused torch formula (``linear -> /T -> log_softmax -> gather``)
  in the input dtype. The tests run it in fp64 as ground truth and in the native dtype as the "unfused"
  baseline.
* tiled_cpu.py - ``"torch"``, the CPU path (``TiledLinearSoftmax``): the logits are visited in
  [tokens x vocabulary] tiles sized by ``TILE_BYTES`` - an online log-sum-exp over the vocabulary blocks gives
  log-prob, entropy, log-sum-exp and lse - E_p[z] per token; the backward revisits the tiles, forms
  dz = g_lp (onehot - p) - g_H p (z - E_p[z]) and writes dW block by block (no forward recomputation, no
  [V, H] buffer beside the gradient). The entropy term is only formed when the entropy received a gradient.
  host_tiles.py: its bf16 tiles' softmax passes in the host C++ library (csrc/softmax_tile_host.cc).
* chunked.py + triton_rows.py - ``"triton"``, the GPU path: chunked over tokens (``ChunkEngine``), each
  chunk's logits are reduced by the Triton row kernels of triton_rows.py (per-row online log-sum-exp tiled
  over the vocabulary) and dropped; backward recomputes them and the in-place gradient kernel forms dz;
  matmuls stay on cuBLAS with fp32 accumulation, dW accumulates in fp32. ``ChunkEngine`` with torch row math
  (``TorchRows``) is the loss op's one-pass CPU path.
* numerics.py - what the engines share: matmul and accumulation dtypes, ``NEG_LOGIT``, ``exp_``.

Both engines recompute each tile's logits in the backward, except those the forward kept: what the
``memory_budget`` leaves beside the tiles or chunk (``numerics.MEMORY_BUDGET``: 1 GiB on CPU, where keeping
all of them saves one product of the four, ~20% of the op's time; 0 on CUDA). Kept or recomputed, they are
the same products h W^T.

Numerics: log-sum-exp, entropy and dW accumulate in fp32 (fp64 when the inputs are fp64). On the torch
backend, bf16 inputs multiply in bf16 where the CPU has bf16 units (fp32 accumulation inside the GEMM, logits
rounded to bf16 once, as in the unfused bf16 path, then fp32 for everything else; see ``TiledLinearSoftmax``)
and in fp32 where it has not (``numerics.CPU_BF16_MATMUL``); fp16 inputs on CPU multiply in fp32. ``-inf``
logits (for instance from a ``-inf`` bias entry masking part of the vocabulary) are clamped to -1e30 so that
p = 0 there exactly and no NaN appears (a target on such an entry gets log-prob about -1e30). Non-finite
hidden/weight values, NaN or +inf in the bias, and non-positive temperatures raise ``ValueError``. Rows
whose target is ``ignore_index`` get log-prob 0 and entropy 0 and no gradient.

Tunables (``BLOCK_V_MAX``, ``TILE_MIN_VOCAB``, ``LOGITS_BLOCK``, ``CPU_BF16_MATMUL``, ...) are read in the
module that defines them: set them there, not on this package.
"""

from .chunked import ChunkEngine, addmm_acc_, mm_acc_
from .host_tiles import host_tile_grad, host_tile_stats
from .numerics import MEMORY_BUDGET, NEG_LOGIT, acc_dtype, device_budget, exp_, resolve_memory_budget
from .op import (
    FusedLogprobsFunction,
    check_linear_outputs,
    default_chunk_size,
    fused_logprobs,
    validate_linear_inputs,
)
from .reference import fused_logprobs_reference
from .tiled_cpu import TILE_BYTES, TiledLinearSoftmax, kept_columns, tile_bytes
from .triton_rows import BLOCK_V_MAX, BLOCK_V_MIN, row_grad_triton, row_stats_triton

__all__ = [
    "BLOCK_V_MAX",
    "BLOCK_V_MIN",
    "MEMORY_BUDGET",
    "NEG_LOGIT",
    "TILE_BYTES",
    "ChunkEngine",
    "FusedLogprobsFunction",
    "TiledLinearSoftmax",
    "acc_dtype",
    "addmm_acc_",
    "check_linear_outputs",
    "default_chunk_size",
    "device_budget",
    "exp_",
    "fused_logprobs",
    "fused_logprobs_reference",
    "kept_columns",
    "host_tile_grad",
    "host_tile_stats",
    "mm_acc_",
    "resolve_memory_budget",
    "row_grad_triton",
    "row_stats_triton",
    "tile_bytes",
    "validate_linear_inputs",
]
