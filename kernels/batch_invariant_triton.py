"""Batch-invariant Triton kernels for the matched-precision mode: a row's bits do not depend on its batch.

The rollout decoder (R rows x 1 token per step, a KV cache) and the trainer's forward (R rows x T tokens)
must give bit-identical per-token results. Each kernel here fixes every per-row reduction order by
construction: one program per output tile or row, the reduced axis walked in tiles of a size fixed per input
dtype (never chosen from the number of rows M, never autotuned), from index 0 upward, with no split of the
reduction across programs and no atomics. The row count is passed unspecialized (``do_not_specialize``), so
one compiled binary serves M = 1 and M = 10^5 alike. Offsets are int64.

``invariant_matmul(x [M, K], w [N, K]) -> [M, N]`` in x's dtype (fp32, bf16, fp16; w in the same dtype)::

    out[m, n] = round_to_dtype( sum_k fp32(x[m, k]) * fp32(w[n, k]) )

  accumulated in fp32 over K tiles of BLOCK_K from k = 0 upward, one program per BLOCK_M x BLOCK_N output
  tile. fp32 inputs use IEEE fp32 dots (FMA units: tf32 would round the operands); bf16/fp16 use the tensor
  cores (exact products, fp32 accumulation). No bias.

``invariant_rms_norm(x [N, H], weight [H], eps) -> [N, H]`` in x's dtype (weight any of the three dtypes)::

    xf = fp32(x);  ms = sum_h xf^2 / H;  r = 1 / sqrt(ms + eps)
    y = round_to_dtype(xf * r);  out = round_to_dtype(fp32(weight) * fp32(y))

  one program per row; the squares are added lane-wise over H chunks of BLOCK_H (lane j holds elements j,
  j + BLOCK_H, ...), then summed across lanes once. Division and square root are IEEE (``div_rn``,
  ``sqrt_rn``), not the GPU's approximate ones. The squares are fp32, as written: a row whose sum of squares
  passes fp32's range (|x| around 1e19 and up) has r = 0 and normalizes to 0; a NaN makes its row NaN.

``invariant_silu_mul(gate [N, F], up [N, F]) -> [N, F]`` in gate's dtype (up in the same dtype)::

    g = fp32(gate);  s = round_to_dtype(g / (1 + exp(-g)));  out = round_to_dtype(fp32(s) * fp32(up))

  elementwise (the formula of the CPU engine; the GPU's exp is its own fast exp, so the CPU and GPU bits may
  differ in the last place, the GPU's decode and train bits do not).

``invariant_row_logprobs(logits [N, V], targets [N] int64, temperature) -> (logprobs [N], entropy [N])``,
both fp32, logits fp32/bf16/fp16::

    u = fp32(logits) * fp32(1 / temperature)          (1 / temperature computed once on the host)
    m = max_v u;  lse = m + log(sum_v exp(u - m))
    logprob = u[target] - lse  (0 where target == -100)
    entropy = lse - sum_v p_v u_v,   p = exp(u - lse)

  one program per row, V walked in tiles of BLOCK_V with an online softmax (running max m, the sum
  s = sum exp(u - m) and t = sum exp(u - m) (u - m), both rescaled when m grows), in a fixed order. The
  outputs are formed from the shifted sums, which keeps large logits' precision: logprob = (u[target] - m)
  - log(s), entropy = log(s) - t / s (the same quantities). Conventions:

  - a NaN anywhere in a row makes that row's entropy and logprob NaN (an ignored target's logprob stays 0);
    the kernel never clamps (``maximum(x, -1e30)`` would turn NaN into a number), it compares;
  - -inf entries contribute nothing (p_v u_v taken as 0 there, its limit); a row of only -inf has no
    maximum to shift by (the formula's u - m is -inf - -inf): its lse, logprob and entropy are NaN;
  - a +inf entry makes the row NaN (inf - inf), as the formula does;
  - a target outside [0, V) other than -100 gives a NaN logprob (never a read out of bounds, no host sync).

Tile sizes (fixed; tables below): matmul fp32 64 x 64 x 32 (M x N x K), bf16/fp16 64 x 128 x 64; RMSNorm
BLOCK_H = 1024; SiLU-mul BLOCK_F = 1024; log-probs BLOCK_V = 1024 (fp32) / 2048 (bf16, fp16); the warp
counts are fixed with them, since they set the order of each in-tile reduction tree.

Each op takes CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. There bf16 dot operands are
multiplied as the fp32 values they hold (the interpreter's numpy dot has no bf16; the same exact products
summed in fp32), and fp32 is rounded to bf16 on its bits (the interpreter's cast truncates; the GPU's
conversion rounds to nearest even, as every round_to_dtype above does).

They are inference kernels: no autograd (an input that requires grad with grad enabled is an error; wrap
them in an ``autograd.Function`` with its own backward). ``*_reference``: the formulas above written out in
fp64 in plain torch, rounded where the formula rounds, for the tests.
"""

from __future__ import annotations

import math

import torch

from ._common import HAS_TRITON, check_same_device, check_tensor, triton_unavailable_reason

__all__ = [
    "DTYPES",
    "LOGPROBS_BLOCK_V",
    "MATMUL_BLOCKS",
    "RMS_BLOCK_H",
    "SILU_BLOCK_F",
    "invariant_matmul",
    "invariant_matmul_reference",
    "invariant_rms_norm",
    "invariant_rms_norm_reference",
    "invariant_row_logprobs",
    "invariant_row_logprobs_reference",
    "invariant_silu_mul",
    "invariant_silu_mul_reference",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IGNORE_INDEX = -100

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by input dtype. fp32's IEEE dot runs on FMA units, each thread
# holding whole operand rows: 8 warps keep its 64 x 64 tile at 96 registers (4 warps take 164); bf16/fp16
# take a tensor-core tile (wgmma m64n128 on sm_90, tcgen05 on sm_100). Never chosen from M: the K order of
# every output is the same at every M.
MATMUL_BLOCKS = {
    torch.float32: (64, 64, 32, 8, 3),
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
}
# (BLOCK_H, warps): lane-wise partial sums over H chunks, one cross-lane sum per row
RMS_BLOCK_H = {torch.float32: (1024, 4), torch.bfloat16: (1024, 4), torch.float16: (1024, 4)}
# (BLOCK_F, warps): elementwise, so only the launch shape
SILU_BLOCK_F = {torch.float32: (1024, 4), torch.bfloat16: (1024, 4), torch.float16: (1024, 4)}
# (BLOCK_V, warps): 4 KiB of logits per tile in every dtype
LOGPROBS_BLOCK_V = {torch.float32: (1024, 4), torch.bfloat16: (2048, 4), torch.float16: (2048, 4)}


# ------------------------------------------------------------------------------------------------ checks


def _check_runnable(op: str, *tensors) -> None:
    """The device can run the kernel, and no input expects a gradient the kernel cannot give."""
    reason = triton_unavailable_reason(tensors[0].device)
    if reason is not None:
        raise RuntimeError(f"{op}: {reason}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{op}: the kernel has no backward; call it under torch.no_grad() or from a Function"
        )


def _check_matmul(x, w):
    check_tensor("x", x, ndim=2, dtypes=DTYPES)
    check_tensor("w", w, ndim=2, dtypes=DTYPES)
    check_same_device("x", x, w=w)
    if w.dtype != x.dtype:
        raise ValueError(f"w: expected dtype {x.dtype} (the dtype of x), got {w.dtype}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected shape [N, {x.shape[1]}] (K of x), got {list(w.shape)}")


def _check_rms_norm(x, weight, eps):
    check_tensor("x", x, ndim=2, dtypes=DTYPES)
    check_tensor("weight", weight, shape=(x.shape[1],), dtypes=DTYPES, device=x.device)
    if not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")


def _check_silu_mul(gate, up):
    check_tensor("gate", gate, ndim=2, dtypes=DTYPES)
    check_tensor("up", up, shape=tuple(gate.shape), dtypes=(gate.dtype,), device=gate.device)


def _check_row_logprobs(logits, targets, temperature) -> float:
    check_tensor("logits", logits, ndim=2, dtypes=DTYPES)
    if logits.shape[1] == 0:
        raise ValueError("logits: vocabulary size is 0")
    check_tensor("targets", targets, shape=(logits.shape[0],), dtypes=(torch.int64,), device=logits.device)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: must be finite and > 0, got {temperature}")
    return 1.0 / float(temperature)


# ----------------------------------------------------------------------------------------- references


def invariant_matmul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp64, rounded once to x's dtype."""
    _check_matmul(x, w)
    return (x.double() @ w.double().T).to(x.dtype)


def invariant_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm formula in fp64, rounded to x's dtype where the formula rounds (y, then the output)."""
    _check_rms_norm(x, weight, eps)
    xf = x.double()
    ms = (xf * xf).sum(-1, keepdim=True) / x.shape[1]
    y = (xf * (1.0 / torch.sqrt(ms + eps))).to(x.dtype)
    return (weight.double() * y.double()).to(x.dtype)


def invariant_silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) rounded to gate's dtype, times up, in fp64, rounded again."""
    _check_silu_mul(gate, up)
    g = gate.double()
    s = (g / (1.0 + torch.exp(-g))).to(gate.dtype)
    return (s.double() * up.double()).to(gate.dtype)


def invariant_row_logprobs_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the targets and entropies of the rows, written out in fp64 (module docstring)."""
    inv_t = _check_row_logprobs(logits, targets, temperature)
    u = logits.double() * inv_t
    m = u.amax(-1, keepdim=True)  # NaN when the row holds one
    lse = m + torch.log(torch.exp(u - m).sum(-1, keepdim=True))  # an all -inf row: NaN (-inf - -inf)
    p = torch.exp(u - lse)
    pu = torch.where(u == -math.inf, 0.0, p * u)  # the limit p u -> 0 of a -inf entry
    entropy = (lse - pu.sum(-1, keepdim=True))[:, 0]
    vocab = logits.shape[1]
    ignored = targets == IGNORE_INDEX
    in_range = (targets >= 0) & (targets < vocab)
    picked = u.gather(1, torch.where(in_range, targets, 0)[:, None])[:, 0]
    logprob = torch.where(in_range, picked - lse[:, 0], math.nan)
    logprob = torch.where(ignored, 0.0, logprob)
    return logprob.float(), entropy.float()


# -------------------------------------------------------------------------------------------- kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _round(x, ty: tl.constexpr, RNE_BITS: tl.constexpr):
        """fp32 x rounded to ty, to nearest even. The interpreter truncates fp32 to bf16 (its cast drops the
        low bits), so there (RNE_BITS) the rounding is done on the bits as the GPU's conversion does it."""
        if RNE_BITS:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
        return x.to(ty)

    # The row count is not specialized: the binary that runs M = 1 is the one that runs every M.
    @triton.jit(do_not_specialize=["M"])
    def _invariant_matmul_kernel(
        x_ptr,
        w_ptr,
        o_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        F32_DOT: tl.constexpr,
        RNE_BITS: tl.constexpr,
    ):
        # program (i, j): output rows [i * BLOCK_M, +BLOCK_M) and columns [j * BLOCK_N, +BLOCK_N)
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # offsets past 2^31 elements
        rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm[:, None] * stride_xm
        w_rows = w_ptr + rn[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):  # fixed K tiles, from 0 upward; masked columns add exact zeros
            k = k0 + rk
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if F32_DOT:  # fp32 (and interpreted bf16): IEEE fp32 products and sums, tf32 would round
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        out = o_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, _round(acc, o_ptr.dtype.element_ty, RNE_BITS), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _invariant_rms_norm_kernel(
        x_ptr,
        w_ptr,
        o_ptr,
        H,
        stride_xn,
        stride_on,
        eps,
        BLOCK_H: tl.constexpr,
        RNE_BITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xn
        o_row = o_ptr + row * stride_on
        cols = tl.arange(0, BLOCK_H)
        out_ty = o_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_H,), tl.float32)  # lane j: elements j, j + BLOCK_H, ... in that order
        for start in range(0, H, BLOCK_H):
            c = start + cols
            xf = tl.load(x_row + c, mask=c < H, other=0.0).to(tl.float32)
            acc += xf * xf
        h = tl.zeros((), tl.float32) + H  # (H may arrive as the constexpr 1)
        ms = tl.div_rn(tl.sum(acc, axis=0), h)
        r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        for start in range(0, H, BLOCK_H):
            c = start + cols
            ok = c < H
            xf = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
            y = _round(xf * r, out_ty, RNE_BITS).to(tl.float32)
            w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_row + c, _round(w * y, out_ty, RNE_BITS), mask=ok)

    @triton.jit
    def _invariant_silu_mul_kernel(
        g_ptr,
        u_ptr,
        o_ptr,
        F,
        stride_gn,
        stride_un,
        stride_on,
        BLOCK_F: tl.constexpr,
        RNE_BITS: tl.constexpr,
    ):
        # program (row, j): columns [j * BLOCK_F, +BLOCK_F) of one row
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = c < F
        out_ty = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * stride_gn + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(u_ptr + row * stride_un + c, mask=ok, other=0.0).to(tl.float32)
        s = _round(tl.div_rn(g, 1.0 + tl.exp(-g)), out_ty, RNE_BITS).to(tl.float32)
        tl.store(o_ptr + row * stride_on + c, _round(s * up, out_ty, RNE_BITS), mask=ok)

    @triton.jit
    def _invariant_row_logprobs_kernel(
        x_ptr,
        t_ptr,
        lp_ptr,
        ent_ptr,
        V,
        stride_xn,
        inv_t,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xn
        cols = tl.arange(0, BLOCK_V)
        neg_inf = float("-inf")
        m = tl.full((), neg_inf, tl.float32)  # running max of u
        s = tl.zeros((), tl.float32)  # sum exp(u - m)
        t = tl.zeros((), tl.float32)  # sum exp(u - m) * (u - m)
        for start in range(0, V, BLOCK_V):  # fixed tiles of the vocabulary, in order
            c = start + cols
            ok = c < V
            u = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32) * inv_t
            u = tl.where(ok, u, neg_inf)
            m_new = tl.maximum(m, tl.max(u, axis=0))
            # comparisons, not clamps: NaN stays NaN; -inf (nothing seen yet) shifts by 0
            m_sub = tl.where(m_new == neg_inf, 0.0, m_new)
            alpha = tl.exp(m - m_sub)
            d = u - m_sub
            p = tl.exp(d)
            pd = p * tl.where(u == neg_inf, 0.0, d)  # a -inf entry adds 0 * 0, not 0 * -inf
            # sum e^(u - m_new) (u - m_new) = alpha * (t + (m - m_new) * s); nothing seen yet: s = 0, adds 0
            shift = tl.where(m == neg_inf, 0.0, m - m_sub) * s
            t = alpha * (t + shift) + tl.sum(pd, axis=0)
            s = s * alpha + tl.sum(p, axis=0)
            m = m_new
        log_s = tl.log(s)
        # an all -inf row has no maximum to shift by: NaN, as the formula's -inf - -inf
        nothing = m == neg_inf
        ent = tl.where(nothing, float("nan"), log_s - tl.div_rn(t, s))
        target = tl.load(t_ptr + row)
        in_range = (target >= 0) & (target < V)
        u_t = tl.load(x_row + tl.where(in_range, target, 0)).to(tl.float32) * inv_t
        lp = tl.where(nothing | ~in_range, float("nan"), (u_t - m) - log_s)
        lp = tl.where(target == -100, 0.0, lp)
        tl.store(lp_ptr + row, lp)
        tl.store(ent_ptr + row, ent)

    def _interpreted() -> bool:
        # the interpreter stores bf16 as uint16 and its numpy dot multiplies those integers: bf16 operands
        # are multiplied there as the fp32 values they hold (exact products, fp32 sums, as on tensor cores)
        return not isinstance(_invariant_matmul_kernel, triton.runtime.JITFunction)


def _rne_bits(dtype: torch.dtype) -> bool:
    """Round to bf16 on the bits: only under the interpreter, whose fp32 -> bf16 cast truncates."""
    return dtype == torch.bfloat16 and _interpreted()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ------------------------------------------------------------------------------------------ public ops


def invariant_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out = x @ w.T for x [M, K] and w [N, K] (fp32, bf16 or fp16, the same dtype; any row strides), as
    [M, N] in x's dtype: fp32 accumulation over fixed K tiles from 0 upward, so a row's bits do not depend on
    M, on the other rows, or on where the row or column sits in its tile (module docstring)."""
    _check_matmul(x, w)
    _check_runnable("invariant_matmul", x, w)
    x, w = _unit_last(x), _unit_last(w)
    (M, K), N = x.shape, w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_m, block_n, block_k, warps, stages = MATMUL_BLOCKS[x.dtype]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _invariant_matmul_kernel[grid](
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        F32_DOT=x.dtype == torch.float32 or _rne_bits(x.dtype),
        RNE_BITS=_rne_bits(x.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [N, H] (fp32, bf16 or fp16; any row stride) with weight [H] (any of the
    three dtypes) and eps >= 0, as [N, H] in x's dtype: y = round(x / sqrt(mean(x^2) + eps)) in fp32, then
    round(weight * y) (module docstring)."""
    _check_rms_norm(x, weight, eps)
    _check_runnable("invariant_rms_norm", x, weight)
    x, weight = _unit_last(x), weight.contiguous()
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_h, warps = RMS_BLOCK_H[x.dtype]
    _invariant_rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        hidden,
        x.stride(0),
        out.stride(0),
        float(eps),
        BLOCK_H=block_h,
        RNE_BITS=_rne_bits(x.dtype),
        num_warps=warps,
    )
    return out


def invariant_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """round(silu(gate)) * up for gate, up [N, F] (fp32, bf16 or fp16, the same dtype; any row strides,
    e.g. the two halves of one gate-up projection), as [N, F] in gate's dtype (module docstring)."""
    _check_silu_mul(gate, up)
    _check_runnable("invariant_silu_mul", gate, up)
    gate, up = _unit_last(gate), _unit_last(up)
    rows, width = gate.shape
    out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block_f, warps = SILU_BLOCK_F[gate.dtype]
    grid = (rows, triton.cdiv(width, block_f))
    _invariant_silu_mul_kernel[grid](
        gate,
        up,
        out,
        width,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        BLOCK_F=block_f,
        RNE_BITS=_rne_bits(gate.dtype),
        num_warps=warps,
    )
    return out


def invariant_row_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-probability of the target and entropy of softmax(logits / temperature) for logits
    [N, V] (fp32, bf16 or fp16; any row stride), targets [N] int64 (-100: ignored, logprob 0) and a finite
    temperature > 0. Returns (logprobs [N] fp32, entropy [N] fp32); NaN and -inf conventions in the module
    docstring. No host sync."""
    inv_t = _check_row_logprobs(logits, targets, temperature)
    _check_runnable("invariant_row_logprobs", logits)
    logits, targets = _unit_last(logits), targets.contiguous()
    rows, vocab = logits.shape
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return logprobs, entropy
    block_v, warps = LOGPROBS_BLOCK_V[logits.dtype]
    _invariant_row_logprobs_kernel[(rows,)](
        logits, targets, logprobs, entropy, vocab, logits.stride(0), inv_t, BLOCK_V=block_v, num_warps=warps
    )
    return logprobs, entropy
