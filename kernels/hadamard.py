"""Block-diagonal random Hadamard rotation of the last dimension: ``y = x R`` (or ``x R^T``).

    R = blockdiag_k( diag(s_k) H_b / sqrt(b) ),   H_b the Sylvester Hadamard matrix of order b (a power of 2)

s is a vector of +-1 signs (one per column of x) and b the block size; R is orthogonal, so ``x R R^T = x``.
Rotating a linear's input, y = x W^T = (x R)(W R)^T, spreads a weight row's outliers evenly over each block
before it is quantized (bitrl.quant.rotation uses it for 4-bit rollouts).

Three ways to compute it, each checked against the others in tests/test_quant_rotation.py:
- ``block_hadamard_reference``: the dense [N, N] matrix R in float64, built by Kronecker products.
- the CPU path of ``block_hadamard``: one [b, b] product per block with a cached H_b (BLAS does the work;
  2b flops per element, which beats the log2(b) butterfly's memory passes at b <= 128).
- the Triton kernel: H_b built in registers from bit parities (H[i, j] = (-1)^popcount(i & j)), one
  tensor-core product per [rows, b] tile, accumulated in fp32 and rounded once to the input dtype.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ._common import HAS_TRITON, resolve_impl

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["TRITON_BLOCKS", "block_hadamard", "block_hadamard_reference", "check_rotation", "random_signs"]

TRITON_BLOCKS = (16, 32, 64, 128)  # tl.dot needs >= 16; a 128 x 128 fp32 H tile is the register budget


def random_signs(dim: int, seed: int, device=None) -> torch.Tensor:
    """[dim] float32 tensor of +-1, drawn from a generator seeded with ``seed`` (the same on every device)."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (dim,), generator=g) * 2 - 1).to(torch.float32).to(device)


def check_rotation(x: torch.Tensor, signs: torch.Tensor, block: int) -> None:
    """Raise a ValueError naming what is wrong with a rotation of x's last dimension."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block: a Hadamard block must be a power of two, got {block}")
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"block: {block} does not divide the rotated dimension {n}")
    if signs.shape != (n,):
        raise ValueError(f"signs: expected shape ({n},), got {tuple(signs.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")


def block_hadamard_reference(
    x: torch.Tensor, signs: torch.Tensor, block: int, transpose: bool = False
) -> torch.Tensor:
    """x R (or x R^T) with R as a dense float64 matrix; x [..., N], signs [N]. Returns x's dtype."""
    check_rotation(x, signs, block)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    n = x.shape[-1]
    rotation = torch.kron(torch.eye(n // block, dtype=torch.float64), h / math.sqrt(block))
    rotation = signs.to("cpu", torch.float64)[:, None] * rotation
    if transpose:
        rotation = rotation.T
    y = x.detach().to("cpu", torch.float64) @ rotation
    return y.to(x.device, x.dtype)


@lru_cache(maxsize=16)
def _sylvester(block: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def _block_hadamard_torch(x, signs, block, transpose):
    shape = x.shape
    z = x.float().reshape(-1, shape[-1] // block, block)
    s = signs.reshape(-1, block)
    if not transpose:
        z = z * s
    z = (z @ _sylvester(block, x.device)) * (1.0 / math.sqrt(block))
    if transpose:
        z = z * s
    return z.reshape(shape).to(x.dtype)


def block_hadamard(
    x: torch.Tensor, signs: torch.Tensor, block: int, transpose: bool = False, *, impl: str | None = None
) -> torch.Tensor:
    """y = x R, or x R^T with transpose=True, over x's last dimension.

    x: [..., N] fp32, bf16 or fp16 (fp64 runs the torch path); signs: [N] +-1 (float, on x's device); block:
    a power of two dividing N (the Triton kernel takes 16-128; other blocks run the torch path). Computed in
    fp32 and rounded once to x's dtype; a NaN or inf in a block spreads over that block's outputs (as the
    product does), never hidden. impl: "reference", "torch" or "triton" (default: by device, see
    ``resolve_impl``). The Triton path is inference-only (no autograd).
    """
    check_rotation(x, signs, block)
    impl = resolve_impl(impl, x.device, op="block_hadamard", dtype=x.dtype)
    if impl == "triton" and block not in TRITON_BLOCKS:
        impl = "torch"  # outside the kernel's tile sizes (documented above)
    if impl == "reference":
        return block_hadamard_reference(x, signs, block, transpose)
    if impl == "triton":
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("block_hadamard: impl='triton' has no backward; use impl='torch' for training")
        return _block_hadamard_triton(x, signs, block, transpose)
    return _block_hadamard_torch(x, signs, block, transpose)


if HAS_TRITON:

    @triton.jit
    def _block_hadamard_kernel(
        x_ptr,
        s_ptr,
        y_ptr,
        M,
        stride_xm,
        stride_ym,
        inv_sqrt_b,
        BLOCK_M: tl.constexpr,
        B: tl.constexpr,
        SIGN_FIRST: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # program (m, k): rows [m * BLOCK_M, +BLOCK_M) of Hadamard block k
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # offsets past 2^31 elements
        cols = tl.program_id(1) * B + tl.arange(0, B)
        in_rows = rows[:, None] < M
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=in_rows, other=0.0)
        x = x.to(tl.float32)
        s = tl.load(s_ptr + cols)
        if SIGN_FIRST:
            x = x * s[None, :]  # a sign flip: exact
        # H[i, j] = (-1)^popcount(i & j); the parity folds the bits of i & j (b <= 128: 7 bits)
        p = tl.arange(0, B)[:, None] & tl.arange(0, B)[None, :]
        p = p ^ (p >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        h = 1.0 - 2.0 * (p & 1).to(tl.float32)
        # bf16 / fp16 inputs hold at most 11 significant bits, which tf32 keeps: its products with +-1 are
        # exact and the sums are fp32, as with ieee (fp32 inputs need ieee: tf32 would round them)
        if IEEE:
            y = tl.dot(x, h, input_precision="ieee")
        else:
            y = tl.dot(x, h, input_precision="tf32")
        y = y * inv_sqrt_b
        if not SIGN_FIRST:
            y = y * s[None, :]
        out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=in_rows)


def _block_hadamard_triton(x, signs, block, transpose):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    # rows per program: a [block_m, b] tile and the [b, b] H in registers. At b = 128, fp32 (ieee: FMA, not
    # tensor cores) spills to the stack with 32 rows and 4 or 8 warps; 16 rows and 8 warps do not (sm_90/100)
    block_m, warps = ((16 if x.dtype == torch.float32 else 32), 8) if block == 128 else (64, 4)
    grid = (triton.cdiv(m, block_m), shape[-1] // block)
    _block_hadamard_kernel[grid](
        x2,
        signs.to(torch.float32).contiguous(),
        y,
        m,
        x2.stride(0),
        y.stride(0),
        1.0 / math.sqrt(block),
        BLOCK_M=block_m,
        B=block,
        SIGN_FIRST=not transpose,
        IEEE=x.dtype == torch.float32,  # tf32 would round x to 10 mantissa bits
        num_warps=warps,
    )
    return y.reshape(shape)
