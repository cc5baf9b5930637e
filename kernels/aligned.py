"""Batch-invariant forms of a Llama-family model's operations: bitrl's matched-precision mode
(``rollout.aligned``), in which the rollout decoder (rows x 1 token per step over a KV cache) and the
trainer's forward (rows x sequence at once) give every token the same bits.

A kernel library reduces in an order that may depend on the shape it is handed: the number of rows picks
another GEMM kernel, a reduction over a short output is split across threads, an elementwise op takes its
scalar form on a tensor's tail. Each op below fixes what a token's result may depend on: its own row, and
nothing of the batch around it.

- ``aligned_linear(x [..., K], weight [N, K], bias) -> [..., N]`` in x's dtype. Defined as the product of
  ``BLOCK_ROWS``-row blocks (zero-padded): every product the mode issues has the same shape, so the same
  kernel and the same order over K. On the CPU one call at the batch's own row count is used instead where it
  was checked, on this process's first call at that shape, to give every row the bits of the block form
  (torch's CPU GEMMs do at most row counts, but fp32 with under 8 rows takes another kernel); the row
  counts are rounded up to a few buckets so that the checks stay few. On CUDA: the Triton GEMM of
  bitrl.kernels.batch_invariant_triton (fixed tiles, K in order, no split-K).
- ``aligned_rms_norm``, ``aligned_silu_mul``, ``aligned_logprobs``: row-wise kernels whose sums run in an
  order set by the row length alone (csrc/aligned_host.cc on the CPU, Triton on CUDA):
  RMSNorm ``w * round(x / sqrt(mean(x^2) + eps))``; the MLP's ``round(round(silu(g)) * u)``; and from logits
  rows ``u = z / T`` the log-prob of a target ``u[t] - logsumexp(u)`` and the entropy ``lse - sum p u``.
- ``aligned_attention``: bitrl.kernels.decode_attention (the host kernel on the CPU, the Triton kernel on
  CUDA): each query's reductions in ascending column order, masked columns adding exact zeros.
- ``aligned_token_logprobs(hidden [N, H], weight [V, H], targets [N])``: the trainer's side of the LM head,
  ``aligned_logprobs(aligned_linear(hidden, weight))`` over fixed chunks of rows, never holding more than one
  chunk's logits.

Elementwise adds, products and casts are correctly rounded in every kernel form, so the model code between
these ops (residual adds, the rotary embedding's products, casts) needs nothing more; the rotary tables are
built in fixed blocks of positions (bitrl.rollout.decoder).

Gradients: every op is differentiable; its backward is the plain torch formula in fp32 (only the forward's
bits need to agree between the two engines). fp32 and bf16 on the CPU; fp32, bf16 and fp16 on CUDA.
"""

from __future__ import annotations

import ctypes
import math

import torch

from .decode_attention import decode_attention
from .host_ext import load_host_library

__all__ = [
    "BLOCK_ROWS",
    "aligned_attention",
    "aligned_linear",
    "aligned_logprobs",
    "aligned_rms_norm",
    "aligned_silu_mul",
    "aligned_token_logprobs",
    "check_aligned_dtype",
    "column_rms_norm",
]

BLOCK_ROWS = 64  # rows of every product in the block form: the decode step's batch at its best
LOGIT_CHUNK_ROWS = 512  # rows of logits held at once by aligned_token_logprobs (512 x 151936 fp32: 311 MB)
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_aligned_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Raise if the matched-precision mode has no kernels for `dtype` on `device`."""
    device = torch.device(device)
    allowed = {"cpu": CPU_DTYPES, "cuda": CUDA_DTYPES}.get(device.type)
    if allowed is None or dtype not in allowed:
        raise ValueError(
            f"rollout.aligned: runs {[str(d) for d in allowed or ()]} on {device.type}; got {dtype}"
        )
    if device.type == "cpu" and load_host_library() is None:
        raise RuntimeError("rollout.aligned: the CPU kernels need the host C++ library (a C++ compiler)")


def _host():
    lib = load_host_library()
    if lib is None:
        raise RuntimeError("rollout.aligned: the CPU kernels need the host C++ library (a C++ compiler)")
    return lib


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _triton():
    from . import batch_invariant_triton

    return batch_invariant_triton


# --------------------------------------------------------------------------- linear


def _bucket(rows: int) -> int:
    """Rows padded to one of a few counts: up to BLOCK_ROWS as they are, then whole blocks rounded up to
    8 steps per octave (at most 1/8 padding), so a run meets few distinct shapes to check."""
    if rows <= BLOCK_ROWS:
        return rows
    blocks = -(-rows // BLOCK_ROWS)
    step = 1 << max(0, blocks.bit_length() - 4)
    return -(-blocks // step) * step * BLOCK_ROWS


def _block_product(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ wt [K, N] as BLOCK_ROWS-row products, the last block zero-padded."""
    rows = x.shape[0]
    padded = -(-rows // BLOCK_ROWS) * BLOCK_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = x.new_empty(padded, wt.shape[1])
    for start in range(0, padded, BLOCK_ROWS):
        torch.mm(x[start : start + BLOCK_ROWS], wt, out=out[start : start + BLOCK_ROWS])
    return out[:rows]


# (rows, K, N, dtype, threads) -> whether one torch.mm at that shape gives every row the block form's bits
_ONE_CALL_OK: dict[tuple, bool] = {}


def _product_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    wt = weight.t()
    bucket = _bucket(rows)
    key = (bucket, x.shape[1], weight.shape[0], x.dtype, torch.get_num_threads())
    known = _ONE_CALL_OK.get(key)
    if known is False:
        return _block_product(x, wt)
    padded = x if bucket == rows else torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
    out = torch.mm(padded, wt)
    if known is None:  # first call at this shape: the check is this call's own block form
        blocks = _block_product(padded, wt)
        _ONE_CALL_OK[key] = ok = torch.equal(out, blocks) or bool(
            (out.isnan() == blocks.isnan()).all() and torch.equal(out.nan_to_num(), blocks.nan_to_num())
        )
        if not ok:
            out = blocks
    return out[:rows]


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return _triton().invariant_matmul(x, weight)
    return _product_cpu(x, weight)


class _AlignedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _product(x, weight)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], all in one dtype; each row's bits are its own
    (module docstring). Differentiable."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"aligned_linear: x {x.dtype}, weight {weight.dtype}: one dtype expected")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"aligned_linear: weight {list(weight.shape)} does not take x {list(x.shape)}")
    lead = x.shape[:-1]
    with torch.autocast(x.device.type, enabled=False):
        out = _AlignedLinear.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
    return out.view(*lead, weight.shape[0])


# --------------------------------------------------------------------------- RMSNorm and the gated SiLU


def _rms_norm_forward(x2, weight, eps):
    if x2.device.type == "cuda":
        return _triton().invariant_rms_norm(x2, weight, eps)
    out = torch.empty_like(x2)
    _host().bitrl_aligned_rms_norm(
        x2.data_ptr(), weight.data_ptr(), out.data_ptr(), x2.shape[0], x2.shape[1], ctypes.c_float(eps),
        int(x2.dtype == torch.bfloat16),
    )  # fmt: skip
    return out


class _AlignedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):
        ctx.save_for_backward(x2, weight)
        ctx.eps = eps
        return _rms_norm_forward(x2, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        xf, g = x2.float(), grad.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        y = xf * inv
        dy = g * weight.float()
        grad_x = inv * (dy - y * (dy * y).mean(-1, keepdim=True))
        grad_w = (g * y).sum(0)
        return grad_x.to(x2.dtype), grad_w.to(weight.dtype), None


def aligned_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * round(x / sqrt(mean(x^2) + eps)) over the last dim of x [..., H] (weight [H], cast to x's dtype),
    the mean and the product in fp32. Returns x's shape and dtype. Differentiable."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"aligned_rms_norm: weight {list(weight.shape)} for x {list(x.shape)}")
    x2, w = x.reshape(-1, x.shape[-1]).contiguous(), weight.to(x.dtype).contiguous()
    if not _needs_grad(x, weight):  # a decode step: no autograd node, no autocast switch (~60 us on a CPU)
        return _rms_norm_forward(x2, w, float(eps)).view(x.shape)
    with torch.autocast(x.device.type, enabled=False):
        out = _AlignedRMSNorm.apply(x2, w, float(eps))
    return out.view(x.shape)


def column_rms_norm(x_t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`aligned_rms_norm` of every column of x_t [H, N] (a token per column: the weight-major decode step's
    feature-major activations), weight [H]: the bits of aligned_rms_norm(x_t.T).T without the transposes
    (on the CPU one host pass vectorized across tokens, each token's sum in the row kernel's order). Returns
    [H, N] contiguous in x_t's dtype (fp32 or bf16). No autograd: a decode step's."""
    if x_t.dim() != 2 or weight.shape != x_t.shape[:1]:
        raise ValueError(
            f"column_rms_norm: x_t [H, N] and weight [H], got {list(x_t.shape)} and {list(weight.shape)}"
        )
    if x_t.dtype not in (CPU_DTYPES if x_t.device.type == "cpu" else CUDA_DTYPES):
        raise ValueError(f"column_rms_norm: no kernel for {x_t.dtype} on {x_t.device.type}")
    w = weight.to(x_t.dtype).contiguous()
    if x_t.device.type != "cpu":
        return _rms_norm_forward(x_t.t().contiguous(), w, float(eps)).t().contiguous()
    x_t = x_t.contiguous()
    out = torch.empty_like(x_t)
    _host().bitrl_rms_norm_columns(
        x_t.data_ptr(), w.data_ptr(), out.data_ptr(), x_t.shape[0], x_t.shape[1], ctypes.c_float(eps),
        int(x_t.dtype == torch.bfloat16),
    )  # fmt: skip
    return out


def _silu_mul_forward(gate, up):
    if gate.device.type == "cuda":
        return _triton().invariant_silu_mul(gate, up)
    out = torch.empty_like(gate)
    _host().bitrl_aligned_silu_mul(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), int(gate.dtype == torch.bfloat16)
    )
    return out


class _AlignedSiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, u, go = gate.float(), up.float(), grad.float()
        s = torch.sigmoid(g)
        silu = g * s
        grad_gate = go * u * s * (1 + g * (1 - s))
        return grad_gate.to(gate.dtype), (go * silu).to(up.dtype)


def aligned_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """round(round(silu(gate)) * up), elementwise in fp32, for gate and up of one shape and dtype (the Llama
    MLP's act_fn(gate_proj(x)) * up_proj(x)). Differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"aligned_silu_mul: gate {list(gate.shape)} {gate.dtype}, up {list(up.shape)} {up.dtype}"
        )
    shape = gate.shape
    gate2, up2 = gate.reshape(-1, shape[-1]).contiguous(), up.reshape(-1, shape[-1]).contiguous()
    if not _needs_grad(gate, up):
        return _silu_mul_forward(gate2, up2).view(shape)
    with torch.autocast(gate.device.type, enabled=False):
        return _AlignedSiluMul.apply(gate2, up2).view(shape)


# --------------------------------------------------------------------------- log-softmax of logits rows


def aligned_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logprobs [N] fp32, entropy [N] fp32) of logits [N, V] (fp32/bf16; fp16 on CUDA) at `temperature`:
    u = z * (1 / T), logprob = u[target] - logsumexp(u) (0 where target < 0), entropy = lse - sum p u. A
    row with a NaN, or with no finite entry, gives NaN. No gradient (the rollout's side)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or targets.dtype != torch.long:
        raise ValueError(
            f"aligned_logprobs: logits [N, V] and targets [N] int64 expected, got {list(logits.shape)} and "
            f"{list(targets.shape)} {targets.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"aligned_logprobs: temperature must be > 0, got {temperature}")
    inv_t = 1.0 / float(temperature)
    if logits.device.type == "cuda":
        return _triton().invariant_row_logprobs(logits, targets, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    rows, vocab = logits.shape
    lp = torch.empty(rows, dtype=torch.float32)
    entropy = torch.empty(rows, dtype=torch.float32)
    _host().bitrl_aligned_logprobs(
        logits.data_ptr(), targets.data_ptr(), rows, vocab, logits.stride(0), ctypes.c_float(inv_t),
        lp.data_ptr(), entropy.data_ptr(), int(logits.dtype == torch.bfloat16),
    )  # fmt: skip
    return lp, entropy


class _AlignedTokenLogprobs(torch.autograd.Function):
    """LM head + log-softmax over LOGIT_CHUNK_ROWS rows at a time; the backward recomputes each chunk's
    logits (the forward's bits) and forms d logits in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t):
        lps, ents = [], []
        for start in range(0, hidden.shape[0], LOGIT_CHUNK_ROWS):
            logits = _chunk_logits(hidden[start : start + LOGIT_CHUNK_ROWS], weight, bias)
            lp, ent = aligned_logprobs(logits, targets[start : start + LOGIT_CHUNK_ROWS], 1.0 / inv_t)
            lps.append(lp)
            ents.append(ent)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.inv_t = inv_t
        return torch.cat(lps), torch.cat(ents)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        inv_t = ctx.inv_t
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], LOGIT_CHUNK_ROWS):
            part = slice(start, start + LOGIT_CHUNK_ROWS)
            h = hidden[part]
            u = _chunk_logits(h, weight, bias).float() * inv_t
            logp = torch.log_softmax(u, dim=-1)
            p = logp.exp()
            # d lp / d u = onehot - p (0 for a row without a target); d entropy / d u = -p (u - E_p u)
            t = targets[part]
            has = t >= 0
            g_lp = grad_lp[part].float() * has
            du = -p * g_lp[:, None]
            du[has.nonzero().squeeze(-1), t[has]] += g_lp[has]
            mean_u = (p * torch.where(p > 0, u, 0.0)).sum(-1, keepdim=True)
            du -= grad_ent[part, None].float() * p * (torch.where(p > 0, u, 0.0) - mean_u)
            dz = (du * inv_t).to(hidden.dtype)
            if grad_h is not None:
                grad_h[part] = dz @ weight
            grad_w += (dz.t() @ h).float()
            grad_b += dz.float().sum(0)
        need_b = bias is not None and ctx.needs_input_grad[2]
        return grad_h, grad_w.to(weight.dtype), grad_b.to(bias.dtype) if need_b else None, None, None


def _chunk_logits(h, weight, bias):
    z = _product(h, weight)
    return z if bias is None else z + bias


def aligned_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
):
    """(logprobs [N] fp32, entropy [N] fp32) of targets [N] int64 (< 0: no target, log-prob 0) under the LM
    head: logits = aligned_linear(hidden [N, H], weight [V, H], bias [V]) in their dtype, then
    aligned_logprobs at `temperature`. The same bits as the rollout's aligned_logprobs on the same hidden
    rows. Differentiable in hidden, weight and bias."""
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"aligned_token_logprobs: hidden {list(hidden.shape)}, weight {list(weight.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"aligned_token_logprobs: hidden {hidden.dtype}, weight {weight.dtype}: one dtype")
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"aligned_token_logprobs: temperature must be finite and > 0, got {temperature}")
    with torch.autocast(hidden.device.type, enabled=False):
        return _AlignedTokenLogprobs.apply(
            hidden.contiguous(), weight, bias, targets.reshape(-1), 1.0 / float(temperature)
        )


# --------------------------------------------------------------------------- attention


class _AlignedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        return decode_attention(q, k, v, visible, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible = ctx.saved_tensors
        rows, heads, queries, _ = q.shape
        tm, width = visible.shape[1], visible.shape[2]
        see = visible[:, torch.arange(queries, device=q.device) % tm][:, None]  # [R, 1, M, W]
        qf, kf, vf, go = q.float(), k[:, :, :width].float(), v[:, :, :width].float(), grad.float()
        s = (qf @ kf.transpose(-1, -2)) * ctx.scale
        s = s.masked_fill(~see, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query that sees nothing: p = 0, output 0
        dv = p.transpose(-1, -2) @ go
        dp = go @ vf.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale
        dq = ds @ kf
        dk = ds.transpose(-1, -2) @ qf

        def full(t, like):
            if t.shape[2] == like.shape[2]:
                return t.to(like.dtype)
            out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
            out[:, :, :width] = t
            return out

        return dq.to(q.dtype), full(dk, k), full(dv, v), None, None


def aligned_attention(q, k, v, visible, scale: float) -> torch.Tensor:
    """`decode_attention` (q [R, kv_heads, M, d], k, v [R, kv_heads, C, d], visible [R, Tm, W]) with a
    gradient: each query's bits depend on its own vector and the columns it sees only. Differentiable in q,
    k and v."""
    with torch.autocast(q.device.type, enabled=False):
        return _AlignedAttention.apply(q, k, v, visible, float(scale))
