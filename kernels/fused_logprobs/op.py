"""The public op ``fused_logprobs``: input validation, chunk defaults, the memory budget, and the autograd
Function, which hands forward and backward to the one engine that runs ``impl``."""

from __future__ import annotations

from typing import Protocol

import torch

from .._common import FLOAT_DTYPES, all_finite, check_same_device, check_tensor, resolve_impl
from .chunked import ChunkedLogprobs
from .numerics import acc_dtype, device_budget, resolve_memory_budget
from .reference import fused_logprobs_reference
from .tiled_cpu import TiledLogprobs

# Bytes of fp32 logits one chunk may hold. On CPU, 128 MiB keeps the peak far below the unfused path while
# each chunk's matmuls run at full speed (1024 tokens at V = 32k measured ~3% faster than 512); on a GPU,
# chunks must be large enough to fill the machine.
CHUNK_BYTES = {"cpu": 128 * 2**20, "cuda": 1024 * 2**20}


def default_chunk_size(vocab: int, device: torch.device | str = "cpu", budget_bytes: int | None = None):
    """Tokens per chunk so that one fp32 [chunk, V] logits tile stays within the device's budget."""
    budget = budget_bytes if budget_bytes is not None else device_budget(CHUNK_BYTES, device)
    return max(16, min(65536, budget // (4 * max(int(vocab), 1))))


def validate_linear_inputs(hidden, weight, targets, bias, temperature, *, check_finite=True):
    """Validate (hidden [N, H], weight [V, H], targets [N], bias [V]?, temperature float | [N]).

    Returns (inv_t [N] in the accumulation dtype, valid-target predicate inputs unchanged).
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    N, H = hidden.shape
    check_tensor("weight", weight, shape=(None, H), dtypes=FLOAT_DTYPES)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected dtype {hidden.dtype} (the dtype of hidden), got {weight.dtype}")
    V = weight.shape[0]
    if V == 0:
        raise ValueError("weight: vocabulary size is 0")
    check_tensor("targets", targets, shape=(N,), dtypes=(torch.int64, torch.int32))
    check_same_device("hidden", hidden, weight=weight, targets=targets, bias=bias)
    if bias is not None:
        check_tensor("bias", bias, shape=(V,), dtypes=FLOAT_DTYPES)
    acc = acc_dtype(hidden)
    if isinstance(temperature, torch.Tensor):
        check_tensor("temperature", temperature, shape=(N,), dtypes=FLOAT_DTYPES, device=hidden.device)
        t = temperature.detach().to(acc)
        if check_finite and not bool(((t > 0) & torch.isfinite(t)).all()):
            raise ValueError("temperature: every per-token temperature must be finite and > 0")
        inv_t = 1.0 / t
    else:
        try:
            tf = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(
                f"temperature: expected a float or an [N] tensor, got {type(temperature).__name__}"
            ) from None
        if not (tf > 0 and tf != float("inf")):
            raise ValueError(f"temperature: must be finite and > 0, got {tf}")
        inv_t = torch.full((N,), 1.0 / tf, dtype=acc, device=hidden.device)
    return inv_t


def check_linear_outputs(outputs, hidden, weight, bias) -> None:
    """Raise ``ValueError`` naming the input when the op's outputs are not finite.

    Non-finite hidden states, LM-head weights or bias entries always reach the outputs (the log-sum-exp of a
    row sees every logit), so one check of the small outputs (one host sync) replaces scanning the [V, H]
    weight on every call; the inputs are scanned only to name the culprit once something is wrong.
    """
    if all(all_finite(o) for o in outputs if o is not None):
        return
    if not all_finite(hidden):
        raise ValueError("hidden: contains NaN or inf")
    if not all_finite(weight):
        raise ValueError("weight: contains NaN or inf")
    if bias is not None and bool((torch.isnan(bias) | (bias == float("inf"))).any()):
        raise ValueError("bias: contains NaN or +inf (-inf entries, which mask tokens, are allowed)")
    raise ValueError("the logits overflowed: hidden and weight are finite but their product is not")


class LogprobsEngine(Protocol):
    """What ``FusedLogprobsFunction`` asks of an engine. ``inputs``: (hidden [N, H], weight [V, H],
    bias [V] | None, y [N] int64 targets (0 where ignored), valid [N] bool, inv_t [N], index: the sorted
    active token ids, or None when every token is active)."""

    def forward(self, inputs, lp, ent, *, need_ent: bool, budget: int) -> tuple:
        """Write the active tokens' log-probs (and entropies) into lp, ent [N] (zeros); return the tensors the
        backward needs beside the inputs. ``budget``: bytes of [tokens x vocabulary] buffers the engine may
        hold (its tiles or chunk workspace, then logits kept for the backward); 0 without a gradient."""

    def backward(self, inputs, saved: tuple, g_lp, g_ent, needs: tuple) -> tuple:
        """(dh, dW, db), each None when not needed, from the [N] gradients (masked, in the accumulation
        dtype; ``g_ent`` None when the entropy is unused); ``needs``: which of hidden, weight, bias need
        one."""


def logprobs_engine(backend: str, *, chunk: int, unit_temperature: bool) -> LogprobsEngine:
    """The engine of ``impl=backend``: "torch" the tiled engine (tiled_cpu.py), "triton" the chunked one with
    the Triton row kernels (chunked.py, triton_rows.py)."""
    if backend == "torch":
        return TiledLogprobs(chunk=chunk, unit_temperature=unit_temperature)
    return ChunkedLogprobs(chunk=chunk, backend=backend, unit_temperature=unit_temperature)


class FusedLogprobsFunction(torch.autograd.Function):
    """Chunked hidden->log-prob/entropy; the backward recomputes the logits the forward did not keep.
    Returns (lp [N], entropy [N])."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, inv_t, ignore_index, need_ent, chunk, backend, unit_t, budget
    ):
        N, _ = hidden.shape
        acc = acc_dtype(hidden)
        valid = targets != ignore_index
        y = torch.where(valid, targets, torch.zeros_like(targets)).long()
        index = None if bool(valid.all()) else valid.nonzero().squeeze(1)  # skip ignored tokens entirely
        lp = torch.zeros(N, dtype=acc, device=hidden.device)
        ent = torch.zeros(N if need_ent else 0, dtype=acc, device=hidden.device)
        engine = logprobs_engine(backend, chunk=chunk, unit_temperature=unit_t)
        inputs = (hidden, weight, bias, y, valid, inv_t, index)
        saved = engine.forward(inputs, lp, ent, need_ent=need_ent, budget=budget)
        ctx.save_for_backward(*inputs, *saved)
        ctx.engine = engine  # settings only: the tensors are saved above
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, y, valid, inv_t, index, *saved = ctx.saved_tensors
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None,) * 11
        N, _ = hidden.shape
        acc = acc_dtype(hidden)
        vf = valid.to(acc)
        g_lp = torch.zeros(N, dtype=acc, device=hidden.device) if g_lp is None else g_lp.to(acc) * vf
        if g_ent is not None:
            g_ent = g_ent.to(acc) * vf
        inputs = (hidden, weight, bias, y, valid, inv_t, index)
        dh, dw, db = ctx.engine.backward(inputs, tuple(saved), g_lp, g_ent, ctx.needs_input_grad[:3])
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
        ) + (None,) * 8


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = True,
    impl: str | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    check_finite: bool = True,
):
    """Log-prob (and entropy) of ``targets`` under softmax((hidden @ weight.T + bias) / temperature).

    Args:
        hidden: [N, H] fp32 / bf16 / fp16 (fp64 accepted, computed in fp64).
        weight: [V, H], same dtype and device as ``hidden`` (the LM head).
        targets: [N] int64/int32 token ids; entries equal to ``ignore_index`` are ignored (output 0, no grad).
        temperature: a positive float, or an [N] tensor of per-token temperatures (no gradient).
        bias: optional [V] bias; ``-inf`` entries mask vocabulary items.
        return_entropy: also return the entropy of each row's distribution.
        impl: ``"triton" | "torch" | "reference"``; default from ``BITRL_KERNEL_IMPL`` or the device.
        chunk_size: tokens per chunk (default: about 128 MiB of fp32 logits on CPU, 1 GiB on CUDA).
        memory_budget: bytes of [tokens x vocabulary] buffers the op may hold at once, beyond its inputs,
            outputs and [N]-sized statistics; it picks time against memory. The tiles (``TILE_BYTES``,
            128 MiB on CPU, or the whole [n, V] at 8 + 2 bytes an element when less; n active tokens) or the
            Triton path's chunk come first; what is left keeps the products h W^T of the first vocabulary
            columns of every active token (n x k in the matmul dtype: 4 bytes for fp32 and fp16 inputs on
            CPU, 2 for bf16 where the CPU has bf16 units) for the backward, which reads them instead of
            multiplying again (the same values). All V columns kept: 3 products of N x H x V (the logits
            formed once); none: 4 (every tile recomputed), the least memory. Default (None):
            ``MEMORY_BUDGET`` of the device, 1 GiB on CPU, 0 on CUDA; the trainer passes what its memory
            plan has to spare. Nothing is kept when no input requires a gradient.
        check_finite: raise ``ValueError`` naming the input when hidden, weight or bias hold NaN/inf, found
            from the [N] outputs (one device sync per call; the [V, H] weight is not scanned); ``False``
            skips it.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32 or None)``. Gradients flow to hidden, weight and bias; the
        entropy gradient is only computed when the entropy is used by the loss.
    """
    inv_t = validate_linear_inputs(hidden, weight, targets, bias, temperature, check_finite=check_finite)
    impl = resolve_impl(impl, hidden.device, op="fused_logprobs", dtype=hidden.dtype)
    if impl == "reference":
        lp, ent = fused_logprobs_reference(
            hidden,
            weight,
            targets,
            temperature=temperature,
            bias=bias,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    else:
        if chunk_size:
            chunk = int(chunk_size)
        elif (
            impl == "torch"
        ):  # tiles are sized by TILE_BYTES["logprobs"]; a tile spans every token when it can
            chunk = max(1, hidden.shape[0])
        else:
            chunk = default_chunk_size(weight.shape[0], hidden.device)
        if chunk <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
        unit_t = not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0
        budget = resolve_memory_budget(memory_budget, hidden.device)
        grads = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        budget = budget if grads and torch.is_grad_enabled() else 0
        lp, ent = FusedLogprobsFunction.apply(
            hidden,
            weight,
            bias,
            targets,
            inv_t,
            int(ignore_index),
            bool(return_entropy),
            chunk,
            impl,
            unit_t,
            budget,
        )
        ent = ent if return_entropy else None
    if check_finite:
        check_linear_outputs((lp.detach(), None if ent is None else ent.detach()), hidden, weight, bias)
    return lp, ent
