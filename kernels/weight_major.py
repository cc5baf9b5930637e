"""A wide linear layer over a few rows on the CPU, by blocks of its weight's rows: a decode step's LM head.

``weight_major_linear(x [R, K], weight [N, K], block=WEIGHT_MAJOR_BLOCK) -> [R, N]`` = ``x @ weight.T``, in
x's dtype, computed block by block of `block` weight rows as ``weight[s:e] @ x.T`` (a [e - s, R] block that
stays in cache) and written transposed into the row-major output.

Why: for a decode step's head (R = 16-256 rows, K = 576, N = 49152, fp32) MKL's ``x @ weight.T`` runs at
70-100 GFLOP/s on a 2-core AVX2 EPYC, the same product with the weight as the left operand at 110-125
(1.1-1.9x faster, the largest gain at 16-64 rows), and the bits are the same there: the dot products are
summed in the same order (not at 2-8 rows, where neither form is faster). bf16 without bf16 units
(emulated) is the other way round (5-10x slower, other bits), so the decoder takes this form for fp32 only
(`use_weight_major`); a bf16 CPU with AMX is unmeasured (`benchmarks/bench_head.py` measures it).

The layers' products gain the same way (SmolLM2's 210 at 64 rows: 111 ms against 145 as x @ weight.T,
same bits; 1.2-1.6x from 16 to 256 rows, slower at 2-8), but there the transposes would cost what the
form saves, so the decoder's CPU decode step keeps its activations feature-major instead (x_t [features,
tokens]: each product is weight @ x_t, whose output is the next product's input; see
`bitrl.rollout.decoder.Decoder.weight_major_layers`), in the same range of rows.
"""

from __future__ import annotations

import torch

__all__ = [
    "WEIGHT_MAJOR_BLOCK",
    "WEIGHT_MAJOR_MAX_ROWS",
    "WEIGHT_MAJOR_MIN_ROWS",
    "use_weight_major",
    "weight_major_linear",
]

WEIGHT_MAJOR_BLOCK = 2048  # weight rows per product: a [2048, R] fp32 block is 0.5 MiB at R 64 (in L2)
# Rows where it was measured faster, with the same bits (bench_head.py): below 16 at most 1.08x and other bits
# at 2-8 rows, above 256 even
WEIGHT_MAJOR_MIN_ROWS, WEIGHT_MAJOR_MAX_ROWS = 16, 256


def use_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `weight_major_linear` is the faster form of x @ weight.T here: a CPU fp32 product without
    autograd, WEIGHT_MAJOR_MIN_ROWS to WEIGHT_MAJOR_MAX_ROWS rows, and a weight wider than one block."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and WEIGHT_MAJOR_MIN_ROWS <= x.shape[0] <= WEIGHT_MAJOR_MAX_ROWS
        and weight.shape[0] > WEIGHT_MAJOR_BLOCK
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def weight_major_linear(
    x: torch.Tensor, weight: torch.Tensor, block: int = WEIGHT_MAJOR_BLOCK
) -> torch.Tensor:
    """x [R, K] @ weight [N, K].T -> [R, N] contiguous, by blocks of `block` weight rows (see module doc).
    No autograd: a forward for generation."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"weight_major_linear: x [R, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"weight_major_linear: x is {x.dtype}, weight {weight.dtype}")
    if block < 1:
        raise ValueError(f"weight_major_linear: block must be >= 1, got {block}")
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        x_t = x.t().contiguous()  # [K, R]: the right operand of every block, read from cache
        part = torch.empty((min(block, n), rows), dtype=x.dtype, device=x.device)
        for start in range(0, n, block):
            end = min(n, start + block)
            p = part[: end - start]
            torch.mm(weight[start:end], x_t, out=p)
            out[:, start:end].copy_(p.t())
    return out
