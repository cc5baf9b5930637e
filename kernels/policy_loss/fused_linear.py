"""LM head + log-prob + policy loss in one op, with the gradient computed in the forward pass.

``fused_linear_policy_loss(hidden [B, T, H], weight [V, H], targets [B, T], old_logprobs, advantages, mask)``
returns ``(loss, metrics)`` exactly like ``policy_loss`` applied to ``fused_logprobs`` but

* never builds the [B*T, V] logits: the batch is processed in chunks of whole sequences (so sequence-level
  losses such as GSPO/GMPO stay exact; token-level losses take runs of tokens across sequences on the torch
  backend), each chunk's logits are formed once, reduced to log-prob/entropy,
  the loss gradient w.r.t. the log-prob is taken right there, and d hidden / d weight are accumulated
  (fp32) in the same pass - 3 matmuls per chunk instead of 4 for forward + recomputing backward;
* the batch-wide parts (rollout corrections, masks, normalisers) come from ``policy_loss.build_plan``, so
  a chunked result equals the unchunked one.

On the torch backend (CPU), bf16 and fp16 weights take two passes over [tokens x vocabulary] tiles instead
(``TiledLinearSoftmax``: log-probs first, then the loss gradient for the whole batch, then d hidden / d weight
tile by tile) so that the low-precision weight gradient is written block by block without an fp32 [V, H]
accumulator beside it, and so do fp32 weights when the memory budget cannot hold a chunk of enough tokens'
logits. The tiles keep the products the budget holds for their second pass (all of them: 3 matmuls, none:
4); see ``_torch_path``.

``bitrl.integrations.liger.FusedLinearGRPOLoss`` wraps this op in an ``nn.Module`` with the arguments of
Liger-Kernel's ``LigerFusedLinearGRPOLoss``.
"""

from __future__ import annotations

import torch

from .._common import FLOAT_DTYPES, check_tensor, compute_dtype, resolve_impl
from ..fused_logprobs import (
    ChunkEngine,
    TiledLinearSoftmax,
    acc_dtype,
    check_linear_outputs,
    default_chunk_size,
    device_budget,
    kept_columns,
    resolve_memory_budget,
    validate_linear_inputs,
)
from ..fused_logprobs.op import CHUNK_BYTES
from ..fused_logprobs.tiled_cpu import tile_matmul_dtype
from .api import policy_loss
from .plan import build_plan, evaluate_rows, finalize_metrics, flat_plan, merge_parts
from .registry import POLICY_LOSSES, LossConfig
from .triton import evaluate_triton, triton_supported, warn_fallback

__all__ = ["fused_linear_policy_loss", "fused_linear_policy_loss_reference"]

# The fewest tokens a one-pass chunk of a token-level loss takes (fewer fit the memory budget: the two-pass
# tiles instead): a chunk of c tokens makes the weight-gradient matmul's inner dimension c, and below ~128 a
# 4th matmul costs less (N=4096 V=32768 H=1024 fp32 GRPO, 2-core CPU: 64-token chunks 1.16x the time of
# 128-token ones, the tiles 1.29x); see _torch_path.
ONE_PASS_MIN_TOKENS = 128


class FusedLinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        inv_t,
        plan,
        ignore_index,
        chunking,
        backend,
        need_ent,
        out,
        need_grad,
        unit_t,
        tiled,
        budget,
    ):
        B, T = plan.mask.shape
        acc = acc_dtype(hidden)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_grad = bool(need_grad and (need_h or need_w or need_b))
        valid = targets != ignore_index
        y = torch.where(valid, targets, torch.zeros_like(targets)).long()
        use_triton_loss = backend == "triton" and triton_supported(plan) is None
        ent_grad = need_grad and plan.cfg.entropy_coef != 0
        # only tokens that enter the loss are computed: padding, ignored and correction-masked tokens get no
        # logits and no matmul rows (their log-prob is never used)
        active = plan.mask.reshape(-1) > 0
        index = active.nonzero().squeeze(1)
        rows_per_chunk, tokens_per_chunk = chunking
        if tiled:
            dh, dw, db, total, parts_acc = _torch_backend(
                hidden,
                weight,
                bias,
                y,
                valid,
                inv_t,
                plan,
                index,
                rows_per_chunk,
                need_ent,
                need_grad,
                (need_h, need_w, need_b),
                unit_t,
                budget,
            )
            out["parts"] = parts_acc
            ctx.save_for_backward(dh, dw, db)
            return total
        eng = ChunkEngine(
            hidden,
            weight,
            bias,
            y,
            valid,
            inv_t,
            chunk=max(1, min(tokens_per_chunk or rows_per_chunk * T, index.numel())),
            backend=backend,
            need_ent=need_ent,
            unit_temperature=unit_t,
            index=index,
        )
        dh = torch.zeros_like(hidden) if need_grad and need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad and need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_grad and need_b else None
        total = torch.zeros((), dtype=plan.mask.dtype, device=hidden.device)
        parts_acc = None
        chunks, ev_plan = _one_pass_chunks(plan, index, rows_per_chunk, tokens_per_chunk)
        for k0, k1, s, region, shape in chunks:
            pos = index[k0:k1] - s  # active positions inside the chunk's region of the [B*T] tokens
            lp_rows = torch.zeros(shape[0] * shape[1], dtype=acc, device=hidden.device)
            ent_rows = torch.zeros_like(lp_rows) if need_ent else None
            if k1 > k0:
                lp_c, ent_c, _, _ = eng.forward(k0, k1)
                lp_rows[pos] = lp_c
                if need_ent:
                    ent_rows[pos] = ent_c
            lp_rows = lp_rows.view(shape)
            ent_rows = None if ent_rows is None else ent_rows.view(shape)
            loss_c, parts, g_lp, g_ent = _evaluate(
                lp_rows, ent_rows, ev_plan, region, use_triton_loss, need_grad, ent_grad
            )
            total = total + loss_c
            parts_acc = merge_parts(parts_acc, parts)
            if need_grad and k1 > k0:
                if g_lp is None:
                    g_lp_c = torch.zeros(k1 - k0, dtype=acc, device=hidden.device)
                else:
                    g_lp_c = g_lp.reshape(-1)[pos].to(acc)
                g_ent_c = g_ent.reshape(-1)[pos].to(acc) if (g_ent is not None and ent_grad) else None
                dz = eng.grad(g_lp_c, g_ent_c)
                eng.accumulate(dz, dh, dw, db)
        del eng
        out["parts"] = parts_acc
        ctx.save_for_backward(
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
        )
        return total

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw, db = ctx.saved_tensors
        # The precomputed gradients, scaled in place (a scaled [V, H] copy would cost as much as the whole
        # workspace). On a CPU, where looking costs nothing, the usual grad_out == 1 skips the pass; on a GPU
        # looking would be a device sync per call, so the multiply always runs.
        if grad_out.device.type == "cpu" and bool(torch.equal(grad_out, torch.ones_like(grad_out))):
            return (dh, dw, db) + (None,) * 12
        return tuple(None if g is None else g.mul_(grad_out.to(g.dtype)) for g in (dh, dw, db)) + (None,) * 12


def _torch_path(
    impl: str,
    hidden: torch.Tensor,
    B: int,
    T: int,
    V: int,
    chunk_size: int | None,
    token_level: bool = False,
    budget: int = 0,
    need_ent: bool = False,
) -> tuple[bool, tuple[int, int | None]]:
    """(tiled, (sequences per chunk, tokens per chunk | None)): which form the loss takes within ``budget``
    bytes of [tokens x vocabulary] buffers; both produce the gradient inside the forward.

    No per-token loss coefficient needs a statistics pass over the logits: everything batch-wide (rollout
    corrections such as AIS's lambda, keep-masks, normalisers) comes from ``build_plan`` before any logits.
    A chunk's loss gradient is therefore known as soon as its log-probs are, when the chunk holds whole
    sequences, or any run of tokens for a token-level loss (``token_level``: GRPO/PPO, CISPO, SAPO; not
    GSPO, GMPO or VESPO, whose terms depend on the whole sequence).

    * ONE pass, 3 matmuls per chunk (``ChunkEngine``): logits, then d hidden, and d W accumulated in place in
      the fp32 gradient itself; a chunk's workspace is its fp32 (fp64) logits, twice with the entropy. For
      fp32 (fp64) weights on the torch backend, when it fits the budget: a token-level loss takes chunks of
      as many active tokens as fit in min(budget, ``CHUNK_BYTES``) (128 MiB on CPU: 1024 tokens at
      V = 32768), across sequence boundaries, when that is at least ``ONE_PASS_MIN_TOKENS`` (or every token);
      other losses take chunks of as many whole sequences as fit, or of one while its logits fit the budget.
      ``chunk_size`` sequences when given; on CUDA always (chunks of ``CHUNK_BYTES``; the budget does not
      apply there).
    * TWO passes over [tokens x vocabulary] tiles (``TiledLinearSoftmax``: statistics, then the loss
      gradient for the whole batch, then d hidden / d W tile by tile) on the torch backend, keeping for the
      second pass the products h W^T that the budget holds beside the tiles (``kept_columns``): 3 matmuls
      when it holds them all, 4 when it holds none:
      - for bf16 weights on a CPU with bf16 units, so that dW is written block by block in its own dtype
        (each block one bf16 matmul over every token). One pass would accumulate dW across token chunks: an
        fp32 [V, H] buffer beside the bf16 gradient (128 MiB at V=32768, H=1024, where the two passes peak
        at 141 MiB in all at N=4096), and CPU bf16 matmuls only write bf16, so each chunk's partial dW would
        be rounded before its fp32 sum. Keeping the bf16 products instead costs n x V x 2 bytes (224 MiB for
        the 3584 active tokens of N=4096, V=32768);
      - for fp16 weights, and bf16 on a CPU without bf16 units (fp32 GEMMs of the low-precision operands),
        when the budget does not also hold the one pass's fp32 copy of the weight and fp32 weight gradient
        (2 x V x H x 4 bytes, 256 MiB at V=32768, H=1024) beside its chunk: then each dW block is summed in
        a one-block fp32 buffer and rounded once;
      - for fp32 when the budget holds fewer than ``ONE_PASS_MIN_TOKENS`` tokens' logits (token-level
        losses) or less than one sequence's (other losses; V = 151936: 148 MiB at T = 256, 1.2 GiB at
        T = 2048): the tiles then split the vocabulary. Fewer tokens per chunk make the weight-gradient
        matmul (its inner dimension) slower than a 4th matmul: on CPU, N=4096 V=32768, 128-token chunks
        cost 10% more than 256-token ones, 64-token 30%."""
    low = hidden.dtype != acc_dtype(hidden)
    if chunk_size is not None:
        return impl == "torch" and low, (int(chunk_size), None)
    if impl != "torch":
        return False, (max(1, default_chunk_size(V, hidden.device) // max(T, 1)), None)
    tiles = True, (max(1, B), None)  # sized by TILE_BYTES["loss"]; they hold every sequence when they can
    if low:
        if tile_matmul_dtype(hidden) != acc_dtype(hidden):  # bf16 GEMMs: the tiles, products kept
            return tiles
        # fp32 GEMMs of low-precision operands (fp16; bf16 without bf16 units): the one pass also holds the
        # weight's fp32 copy and its fp32 gradient, rounded once at the end
        budget -= 2 * V * hidden.shape[1] * acc_dtype(hidden).itemsize
        if budget < 0:
            return tiles
    row_bytes = acc_dtype(hidden).itemsize * V * (2 if need_ent else 1)
    chunk_bytes = min(budget, device_budget(CHUNK_BYTES, hidden.device))
    if token_level:
        tokens = chunk_bytes // row_bytes
        fits = tokens >= min(ONE_PASS_MIN_TOKENS, B * T)
        return (False, (max(1, B), max(1, tokens))) if fits else tiles
    if T * row_bytes > budget:
        return tiles
    return False, (max(1, chunk_bytes // max(T * row_bytes, 1)), None)


def _one_pass_chunks(plan, index, rows_per_chunk, tokens_per_chunk):
    """The one pass's chunks, as (k0, k1, s, region, shape): the active tokens index[k0:k1] lie in
    ``region`` (an index of the evaluated plan's tensors, of ``shape``, whose first token is flat token s).
    Returns (chunks, the plan to evaluate them on).

    ``tokens_per_chunk`` None: blocks of ``rows_per_chunk`` whole sequences of the [B, T] plan. Else runs
    of that many active tokens, across sequence boundaries, on the plan viewed as one [1, B*T] row: only
    for token-level losses, whose per-token terms do not depend on the rest of their sequence."""
    B, T = plan.mask.shape
    n = index.numel()
    if tokens_per_chunk is None or n == 0:
        starts = torch.arange(0, B + rows_per_chunk, rows_per_chunk, device=index.device).clamp(max=B) * T
        bounds = torch.searchsorted(index, starts).tolist()
        chunks = []
        for j, r0 in enumerate(range(0, B, rows_per_chunk)):
            r1 = min(B, r0 + rows_per_chunk)
            chunks.append((bounds[j], bounds[j + 1], r0 * T, slice(r0, r1), (r1 - r0, T)))
        return chunks, plan
    k0s = list(range(0, n, tokens_per_chunk))
    k1s = [min(n, k0 + tokens_per_chunk) for k0 in k0s]
    firsts = index[k0s].tolist()
    lasts = index[[k1 - 1 for k1 in k1s]].tolist()
    chunks = [
        (k0, k1, a, (slice(None), slice(a, b + 1)), (1, b + 1 - a))
        for k0, k1, a, b in zip(k0s, k1s, firsts, lasts)
    ]
    return chunks, flat_plan(plan)


def _evaluate(lp_rows, ent_rows, plan, rows, use_triton_loss, need_grad, ent_grad):
    """Loss of the sequences ``rows`` from their [r, T] log-probs (and entropies), with d loss / d lp (and
    d loss / d entropy when ``ent_grad``): (loss, parts, g_lp | None, g_ent | None)."""
    if use_triton_loss:
        return evaluate_triton(lp_rows, ent_rows, plan, rows)
    with torch.enable_grad():
        lp_ = lp_rows.detach().to(plan.mask.dtype).requires_grad_(need_grad)
        ent_ = None
        if ent_rows is not None:
            ent_ = ent_rows.detach().to(plan.mask.dtype).requires_grad_(ent_grad)
        loss_c, parts = evaluate_rows(lp_, ent_, plan, rows)
        g_lp = g_ent = None
        if need_grad and loss_c.requires_grad:
            leaves = [lp_] + ([ent_] if ent_ is not None and ent_.requires_grad else [])
            grads = torch.autograd.grad(loss_c, leaves, allow_unused=True)
            g_lp = grads[0]
            g_ent = grads[1] if len(grads) > 1 else None
    return loss_c.detach(), parts, g_lp, g_ent


def _torch_backend(
    hidden,
    weight,
    bias,
    y,
    valid,
    inv_t,
    plan,
    index,
    rows_per_chunk,
    need_ent,
    need_grad,
    needs,
    unit_t,
    budget,
):
    """The torch backend: log-probs of every active token over [tokens x vocabulary] tiles, the loss and its
    gradient w.r.t. them for the whole batch at once ([B, T] work), then one gradient pass over the tiles,
    which reads the products the statistics pass kept within ``budget`` (``kept_columns``) instead of
    multiplying again. Returns (dh, dW, db in the inputs' dtypes or None, loss, parts)."""
    B, T = plan.mask.shape
    acc = acc_dtype(hidden)
    need_h, need_w, need_b = needs
    ent_grad = need_grad and plan.cfg.entropy_coef != 0
    n, V = index.numel(), weight.shape[0]
    k = kept_columns(n, V, hidden, "loss", budget) if need_grad else 0
    kept = torch.empty(n, k, dtype=tile_matmul_dtype(hidden), device=hidden.device) if k else None
    eng = TiledLinearSoftmax(
        hidden,
        weight,
        bias,
        y,
        valid,
        inv_t,
        chunk=max(1, rows_per_chunk * T),
        need_ent=need_ent,
        unit_temperature=unit_t,
        op="loss",
        index=index,
        kept=kept,
    )
    lp_a, ent_a, lse, gap = eng.stats()
    lp = torch.zeros(B * T, dtype=acc, device=hidden.device)
    lp[index] = lp_a
    ent = None
    if need_ent:
        ent = torch.zeros_like(lp)
        ent[index] = ent_a
    total, parts, g_lp, g_ent = _evaluate(
        lp.view(B, T), None if ent is None else ent.view(B, T), plan, slice(0, B), False, need_grad, ent_grad
    )
    dh = dw = db = None
    if need_grad and index.numel():
        g_lp = torch.zeros(B * T, dtype=acc, device=hidden.device) if g_lp is None else g_lp
        g_lp = g_lp.reshape(-1)[index].to(acc)
        g_ent = g_ent.reshape(-1)[index].to(acc) if (g_ent is not None and ent_grad) else None
        eng.retile(need_ent=g_ent is not None)  # the gradient pass: no entropy buffer if unused
        dh, dw, db = eng.grad(g_lp, g_ent, lse, gap, need_h=need_h, need_w=need_w, need_b=need_b)
    elif need_grad:
        dh = torch.zeros_like(hidden) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    db = None if db is None else db.to(bias.dtype)  # dh and dW come in the inputs' dtypes
    return dh, dw, db, total.to(plan.mask.dtype), parts


def _flatten_hidden(hidden, B, T):
    if hidden.dim() == 3:
        check_tensor("hidden", hidden, shape=(B, T, None), dtypes=FLOAT_DTYPES)
        return hidden.reshape(B * T, hidden.shape[-1])
    check_tensor("hidden", hidden, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    if hidden.shape[0] != B * T:
        raise ValueError(f"hidden: expected [{B}, {T}, H] or [{B * T}, H], got {list(hidden.shape)}")
    return hidden


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    config: LossConfig | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    check_finite: bool = True,
    impl: str | None = None,
):
    """``policy_loss(fused_logprobs(hidden, weight, targets), ...)`` without logits and with one matmul fewer.

    Shapes and dtypes:
        hidden: [B, T, H] (or [B*T, H]) fp32/bf16/fp16, the last hidden states aligned with ``targets``.
        weight: [V, H] LM head (same dtype/device); bias: optional [V].
        targets: [B, T] int64 token ids (``ignore_index`` entries are excluded from the loss).
        old_logprobs, advantages, mask, ref_logprobs, rollout_logprobs, is_weights: as in ``policy_loss``
            (mask defaults to ``targets != ignore_index``; it is and-ed with that).
        temperature: float or [B, T] / [B*T] per-token tensor.

    ``config`` is the ``LossConfig`` of ``policy_loss``. ``compute_entropy`` adds the entropy metric (it is
    computed anyway when ``config.entropy_coef != 0``). ``chunk_size`` is the number of *sequences* per chunk
    (default: about 1 GiB of fp32 logits per chunk on CUDA; on the torch backend, from the memory budget).

    ``memory_budget``: bytes of [tokens x vocabulary] buffers the op may hold at once beyond its inputs,
    outputs and [B*T]-sized terms; it picks time against memory on the torch backend (``_torch_path``):
    the form that runs 3 products of N x H x V when its working set fits, else the two-pass tiles (4).
    * fp32 (fp64) weights: one pass over chunks of active tokens (token-level losses, at least
      ``ONE_PASS_MIN_TOKENS``) or whole sequences, c tokens' fp32 logits (twice with the entropy) per chunk,
      as many as fit in min(budget, 128 MiB on CPU); when even the fewest do not fit, the tiles.
    * bf16 weights on a CPU with bf16 units: the tiles (``TILE_BYTES["loss"]``, 32 MiB on CPU, or the whole
      [n, V] at 8 + 2 bytes an element when less; n active tokens) and, with what is left, the products
      h W^T of the first vocabulary columns of every active token (n x k bf16), read back by the gradient
      pass: k = V runs 3 products, k = 0 four.
    * fp16 weights, and bf16 on a CPU without bf16 units (fp32 GEMMs): the one pass as for fp32 when the
      budget also holds the fp32 copy of the weight and its fp32 gradient (2 x V x H x 4 bytes), else the
      tiles as above, their products kept in fp32 (n x k x 4).
    Default (None): ``MEMORY_BUDGET`` of the device, 1 GiB on CPU; the trainer passes what its memory plan
    has to spare (``train.loss_memory_budget``). The Triton (CUDA) path always runs one pass. Returns
    ``(loss, metrics)`` like ``policy_loss``.
    """
    cfg = LossConfig() if config is None else config
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"config: expected a LossConfig, got {type(cfg).__name__}")
    check_tensor("targets", targets, ndim=2, dtypes=(torch.int64, torch.int32))
    B, T = targets.shape
    h2 = _flatten_hidden(hidden, B, T)
    y = targets.reshape(-1)
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 2:
        check_tensor("temperature", temperature, shape=(B, T), dtypes=FLOAT_DTYPES, device=h2.device)
        temperature = temperature.reshape(-1)
    inv_t = validate_linear_inputs(h2, weight, y, bias, temperature, check_finite=check_finite)
    tmask = targets != ignore_index
    if mask is None:
        mask = tmask
    else:
        check_tensor("mask", mask, shape=(B, T), device=h2.device)
        mask = (mask != 0) & tmask
    impl = resolve_impl(impl, h2.device, op="fused_linear_policy_loss", dtype=h2.dtype)
    tensors = dict(ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, is_weights=is_weights)
    if impl == "reference":
        return fused_linear_policy_loss_reference(
            hidden,
            weight,
            targets,
            old_logprobs,
            advantages,
            mask,
            cfg,
            bias=bias,
            temperature=temperature,
            ignore_index=ignore_index,
            compute_entropy=compute_entropy,
            **tensors,
        )
    dtype = compute_dtype(h2, old_logprobs, advantages)
    plan = build_plan(
        old_logprobs, advantages, mask, B=B, T=T, device=h2.device, dtype=dtype, config=cfg, **tensors
    )
    if old_logprobs is None and rollout_logprobs is not None and any(n != "none" for n in cfg.corrections):
        raise ValueError("old_logprobs: required for a rollout correction in fused_linear_policy_loss")
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    budget = resolve_memory_budget(memory_budget, h2.device)
    if impl == "triton":
        reason = triton_supported(plan)
        if reason is not None:
            warn_fallback("fused_linear_policy_loss", reason, "its loss terms on the torch path")
    token_level = POLICY_LOSSES[plan.loss_type].token_level
    need_ent = bool(compute_entropy or cfg.entropy_coef)
    tiled, chunking = _torch_path(impl, h2, B, T, weight.shape[0], chunk_size, token_level, budget, need_ent)
    out: dict = {}
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h2, weight, bias))
    unit_t = not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0
    loss = FusedLinearPolicyLossFunction.apply(
        h2,
        weight,
        bias,
        y,
        inv_t,
        plan,
        int(ignore_index),
        chunking,
        impl,
        need_ent,
        out,
        need_grad,
        unit_t,
        tiled,
        budget,
    )
    if check_finite:
        check_linear_outputs((loss.detach(),), h2, weight, bias)
    return loss, finalize_metrics(out["parts"], plan, has_entropy=need_ent)


def fused_linear_policy_loss_reference(
    hidden,
    weight,
    targets,
    old_logprobs,
    advantages,
    mask=None,
    config: LossConfig | None = None,
    *,
    bias=None,
    temperature=1.0,
    ignore_index=-100,
    ref_logprobs=None,
    rollout_logprobs=None,
    is_weights=None,
    compute_entropy=False,
    chunk_size=None,
    memory_budget=None,
    check_finite=True,
    impl=None,
):
    """The unfused path: full logits -> log_softmax -> gather -> ``policy_loss`` (impl="reference").
    Takes the arguments of ``fused_linear_policy_loss``; chunk_size, memory_budget, check_finite and impl
    do not apply."""
    from ..fused_logprobs import fused_logprobs_reference

    cfg = LossConfig() if config is None else config
    B, T = targets.shape
    h2 = hidden.reshape(B * T, hidden.shape[-1])
    need_ent = bool(compute_entropy or cfg.entropy_coef)
    lp, ent = fused_logprobs_reference(
        h2,
        weight,
        targets.reshape(-1),
        temperature=temperature,
        bias=bias,
        ignore_index=ignore_index,
        return_entropy=need_ent,
    )
    tmask = targets != ignore_index
    mask = tmask if mask is None else (mask != 0) & tmask
    return policy_loss(
        lp.view(B, T),
        old_logprobs,
        advantages,
        mask,
        cfg,
        ref_logprobs=ref_logprobs,
        entropy=None if ent is None else ent.view(B, T),
        rollout_logprobs=rollout_logprobs,
        is_weights=is_weights,
        impl="reference",
    )
