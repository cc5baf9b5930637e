"""GPTQ for the block-scaled FP4 formats: round each weight column knowing what the next columns can absorb.

Round-to-nearest quantizes every weight alone. GPTQ (Frantar et al., 2022) quantizes the columns of a linear's
weight one at a time, in input order, and after each column moves its rounding error onto the columns not yet
quantized, weighted by the inverse Hessian of the layer's squared output error, ``H = X^T X`` over calibration
inputs X [tokens, in]. The output error ``||X W^T - X Q^T||`` it leaves is what the rollout copy's tokens see;
the weight error itself grows. For MXFP4 / NVFP4 the block scales are chosen when the quantizer reaches a
block's first column, from the block's weights as the earlier errors have moved them (the block-scaled form
of GPTQ that MR-GPTQ, Egiazarian et al. 2025, uses for FP4), by the layer's own scale rule (``scale_mode``).
The result is an ordinary QuantizedTensor: the format, the scales and the run-time cost are unchanged.

    hessians = collect_hessians(policy, calibration_sequences)           # name -> [in, in] fp32
    qt = gptq_quantize(linear.weight, hessians[name], "nvfp4", scale_mode="mse")
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from . import reference as ref
from .formats import get_format
from .quantize import global_amax, quantize_reference, resolve_spec, round_e2m1
from .tensor import QuantizedTensor

__all__ = [
    "collect_hessians",
    "gptq_quantize",
    "gptq_quantize_batched",
    "gptq_requantize_",
]

# Columns updated together (the paper's lazy batch): the error of a batch reaches the later columns in one
# product, which keeps the loop's cost in matrix products rather than in per-column updates.
LAZY_COLUMNS = 128
# The most weight elements one batched loop holds (gptq_requantize_): its working set is ~5 float32 copies.
BATCH_ELEMENTS = 64 * 2**20
# Padded tokens per calibration forward (collect_hessians): rows enough for the products to run at full
# speed, activations of a few MB each on a small model.
CALIBRATION_BATCH_TOKENS = 2048


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and module.weight.dim() == 2)


@torch.no_grad()
def collect_hessians(
    model: nn.Module,
    sequences: Iterable[torch.Tensor],
    names: Iterable[str] | None = None,
    batch_tokens: int = CALIBRATION_BATCH_TOKENS,
) -> dict[str, torch.Tensor]:
    """``X^T X / tokens`` (float32 [in, in]) of the input X of each linear (``nn.Linear`` or transformers
    ``Conv1D``) of ``model`` (a causal LM) over ``sequences`` (int64 token ids [T] each).

    The sequences run in right-padded batches of up to ``batch_tokens`` padded tokens, like lengths
    together: under the causal mask no real token sees a pad, and the pads' rows stay out of the sums. Where
    the LM head is not among the linears collected and the model's forward takes ``logits_to_keep``, only
    the last position's logits are formed (the head is the largest product of a small model's forward).

    names: the linears to collect (default: every one); a name the model lacks is a ValueError. Linears that
    read the same tensor (q/k/v, gate/up) get the same Hessian object."""
    modules = dict(model.named_modules())
    wanted = [n for n, m in modules.items() if _is_linear(m)] if names is None else list(names)
    missing = [n for n in wanted if n not in modules or not _is_linear(modules[n])]
    if missing:
        raise ValueError(f"collect_hessians: the model has no linear {missing[0]!r}")
    sequences = list(sequences)
    for seq in sequences:
        if seq.dim() != 1 or seq.numel() == 0 or seq.dtype != torch.int64:
            raise ValueError(
                f"sequences: each must be a non-empty 1-D int64 tensor of ids, got {seq.dtype} "
                f"{tuple(seq.shape)}"
            )
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(wanted, 0)
    # Linears that read one tensor (q/k/v, gate/up) share one sum, found on the first batch: the input
    # each linear reads, by identity, and the first reader of each (the inputs held, so that no id is reused).
    first_reader: dict[int, tuple[torch.Tensor, str]] = {}
    shares: dict[str, str] = {}
    real = torch.zeros(0, dtype=torch.bool)  # the batch's real (not pad) tokens, [B * T]

    def hook(name):
        def accumulate(module, args):
            width = args[0].shape[-1]
            if name not in sums:
                owner = first_reader.setdefault(id(args[0]), (args[0], name))[1]
                if owner != name:
                    shares[name] = owner
                    sums[name] = sums[owner]
                    counts[name] = None  # counted by its owner
                    return
                sums[name] = args[0].new_zeros(width, width, dtype=torch.float32)
            elif name in shares:
                return
            x = args[0].detach().reshape(-1, width)[real].to(torch.float32)
            counts[name] += x.shape[0]
            sums[name].addmm_(x.t(), x)

        return accumulate

    device = next(model.parameters()).device
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kwargs = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters and not any(
        modules[n] is head for n in wanted
    ):
        kwargs["logits_to_keep"] = 1
    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in wanted]
    try:
        for batch in _length_batches(sequences, batch_tokens):
            ids = pad_sequence(batch, batch_first=True)  # right-padded with id 0
            lengths = torch.tensor([len(s) for s in batch])
            mask = (torch.arange(ids.shape[1]) < lengths[:, None]).to(device)
            real = mask.reshape(-1)
            model(ids.to(device), attention_mask=mask.long(), **kwargs)
            first_reader.clear()
    finally:
        for h in handles:
            h.remove()
    counts = {n: counts[shares.get(n, n)] for n in wanted}
    unreached = [n for n in wanted if not counts[n]]
    if unreached:
        raise ValueError(f"collect_hessians: no input reached {unreached[0]!r} (no sequence given?)")
    means = {n: sums[n] / counts[n] for n in wanted if n not in shares}
    return {n: means[shares.get(n, n)] for n in wanted}


def _length_batches(sequences: list[torch.Tensor], batch_tokens: int) -> list[list[torch.Tensor]]:
    """The sequences by ascending length, in batches of at most ``batch_tokens`` padded tokens (one
    sequence longer than that runs alone)."""
    batches: list[list[torch.Tensor]] = []
    for seq in sorted(sequences, key=len):  # stable: equal lengths keep their order
        if batches and (len(batches[-1]) + 1) * len(seq) <= batch_tokens:
            batches[-1].append(seq)
        else:
            batches.append([seq])
    return batches


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1, float32 [B, in, in] from H [B, in, in].

    A dead input (no calibration token reached it) gets a unit diagonal: its weights round alone (they are
    kept, not zeroed: the rollout's inputs may reach it)."""
    h = hessian.to(torch.float64).clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag <= 0, 1.0)
    diag.add_(damp * diag.mean(-1, keepdim=True))
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32)


def _check(weight: torch.Tensor, hessian: torch.Tensor, keep: torch.Tensor | None) -> None:
    if weight.dim() != 2 or tuple(hessian.shape) != (weight.shape[1],) * 2:
        raise ValueError(
            f"weight must be [out, in] and hessian [in, in]; got {tuple(weight.shape)} and "
            f"{tuple(hessian.shape)}"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian contains NaN or inf: the calibration forward produced non-finite inputs")
    if keep is not None and (tuple(keep.shape) != tuple(weight.shape) or keep.dtype != torch.bool):
        raise ValueError(f"keep must be a bool tensor of shape {tuple(weight.shape)}")


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: str,
    *,
    keep: torch.Tensor | None = None,
    damp: float = 0.1,
    **quant_kwargs,
) -> tuple[QuantizedTensor, torch.Tensor]:
    """GPTQ-quantize ``weight`` [out, in] (float) to the FP4 format ``fmt`` ("mxfp4" or "nvfp4").

    hessian: [in, in] ``X^T X`` of the layer's inputs (:func:`collect_hessians`). keep: bool [out, in], the
    weights held outside the format (the outlier fallback): they take no part in the block scales, are held
    at their error-corrected value in bf16 (its rounding moves on like the others') and their codes are zero.
    damp: the fraction of the mean diagonal added to H (conditioning). quant_kwargs: ``scale_mode`` /
    ``block_size`` as for :func:`bitrl.quant.quantize`.

    Returns (QuantizedTensor, float32 [out, in] final weights: the dequantized codes, and the kept weights'
    values at the positions of ``keep``).
    """
    return gptq_quantize_batched([[weight]], hessian[None], fmt, keeps=[[keep]], damp=damp, **quant_kwargs)[
        0
    ][0]


@torch.no_grad()
def gptq_quantize_batched(
    groups: list[list[torch.Tensor]],
    hessians: torch.Tensor,
    fmt: str,
    *,
    keeps: list[list[torch.Tensor | None] | None] | None = None,
    damp: float = 0.1,
    **quant_kwargs,
) -> list[list[tuple[QuantizedTensor, torch.Tensor]]]:
    """GPTQ of B independent problems in one column loop: ``groups[b]`` the weights [out_i, in] that read
    the input whose Hessian is ``hessians[b]`` ([B, in, in]); every group has the same stacked row count
    (e.g. one transformer block's q/k/v each). The loop's cost is per column, so rounding every block of a
    model at once costs what one block did. Returns, per group, (QuantizedTensor, final) per weight."""
    f = get_format(fmt)
    if not (f.packed and f.scale_kind != "fp32"):
        raise ValueError(f"gptq_quantize takes the block-scaled FP4 formats (mxfp4, nvfp4), got {f.name}")
    keeps = keeps or [None] * len(groups)
    keeps = [k or [None] * len(g) for g, k in zip(groups, keeps)]
    for group, group_keep, h in zip(groups, keeps, hessians):
        for w, k in zip(group, group_keep):
            _check(w, h, k)
    spec = resolve_spec(f, **quant_kwargs)
    bw = spec.block_size
    count, cols = len(groups), hessians.shape[-1]
    rows = sum(w.shape[0] for w in groups[0])
    if any(sum(w.shape[0] for w in g) != rows for g in groups):
        raise ValueError("gptq_quantize_batched: every group must stack the same number of rows")
    kp = -(-cols // bw) * bw
    device = hessians.device
    w = torch.zeros(count, rows, kp, dtype=torch.float32, device=device)
    kept = torch.zeros(count, rows, kp, dtype=torch.bool, device=device)
    gmax = torch.ones(count, rows, 1, dtype=torch.float32, device=device)
    for b, (group, group_keep) in enumerate(zip(groups, keeps)):
        r = 0
        for weight, keep in zip(group, group_keep):
            n = weight.shape[0]
            w[b, r : r + n, :cols] = weight.to(torch.float32)
            if keep is not None:
                kept[b, r : r + n, :cols] = keep
            # each weight's tensor scale (NVFP4) is the plain quantizer's: from the weight without its kept
            # entries
            gmax[b, r : r + n] = global_amax(
                w[b, r : r + n].masked_fill(kept[b, r : r + n], 0.0), name="weight"
            )
            r += n
    h = torch.zeros(count, kp, kp, dtype=torch.float32, device=device)
    h[:, :cols, :cols] = hessians.to(torch.float32)
    upper = _inverse_cholesky(h, damp)
    any_kept = bool(kept.any())
    grid = torch.zeros_like(w)  # the codes' values (x / scale)
    final = torch.zeros_like(w)
    scales, tensor_scale = [], None
    flat_gmax = gmax.reshape(-1, 1)
    for start in range(0, kp, LAZY_COLUMNS):
        stop = min(start + LAZY_COLUMNS, kp)
        block = w[:, :, start:stop].clone()
        errors = torch.zeros_like(block)
        hinv = upper[:, start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if col % bw == 0:  # a scale block begins: its scale from the weights as they stand now
                group = block[:, :, i : i + bw].masked_fill(kept[:, :, col : col + bw], 0.0).reshape(-1, bw)
                stored, tensor_scale = _block_scales(group, spec, flat_gmax)
                scales.append(stored.reshape(count, rows, 1))
                scale = ref.e8m0_from_storage(stored) if f.scale_kind == "e8m0" else stored.float()
                scale = scale.reshape(count, rows)
                ts = None if tensor_scale is None else tensor_scale.reshape(count, rows)
                value = scale if ts is None else scale * ts
                safe = torch.where(value > 0, value, torch.ones_like(value))
                no_code = value <= 0
            x = block[:, :, i]
            g = round_e2m1((x / safe).abs_()).copysign_(x)
            g.masked_fill_(no_code | kept[:, :, col] if any_kept else no_code, 0.0)
            q = g * scale if ts is None else g * scale * ts  # dequantize's order of products
            if any_kept:
                q = torch.where(kept[:, :, col], x.to(torch.bfloat16).float(), q)
            grid[:, :, col], final[:, :, col] = g, q
            err = (x - q).div_(hinv[:, i, i, None])
            block[:, :, i:].baddbmm_(err[:, :, None], hinv[:, i : i + 1, i:], alpha=-1.0)
            errors[:, :, i] = err
        w[:, :, stop:].baddbmm_(errors, upper[:, start:stop, stop:], alpha=-1.0)
    codes = ref.pack_fp4(ref.encode_e2m1_nearest(grid.reshape(count * rows, kp))).reshape(count, rows, -1)
    stored_scales = torch.cat(scales, dim=2)
    out = []
    for b, group in enumerate(groups):
        r, results = 0, []
        for weight in group:
            n = weight.shape[0]
            qt = QuantizedTensor(
                fmt=f,
                shape=weight.shape,
                data=codes[b, r : r + n].contiguous(),
                scale=stored_scales[b, r : r + n].contiguous(),
                tensor_scale=None if tensor_scale is None else ref.nvfp4_tensor_scale(gmax[b, r, 0]),
                block=(1, bw),
                granularity="block",
                scale_mode=spec.scale_mode,
                dtype=weight.dtype,
            )
            results.append((qt, final[b, r : r + n, :cols].clone()))
            r += n
        out.append(results)
    return out


def _block_scales(group: torch.Tensor, spec, gmax: torch.Tensor):
    """(stored scales [rows, 1], tensor scales [rows, 1] or None) of one 1 x bw block per row of ``group``
    [rows, bw], each row's tensor scale from its weight's amax ``gmax`` [rows, 1] (the plain quantizer's rule,
    bitrl.quant.quantize_reference)."""
    if (
        group.shape[0] == 1
    ):  # quantize_reference reads a one-block tensor's gmax as its amax: give it two rows
        stored, ts = _block_scales(torch.cat([group, torch.zeros_like(group)]), spec, gmax.expand(2, 1))
        return stored[:1], None if ts is None else ts[:1]
    _, stored, ts = quantize_reference(group, spec, (1, group.shape[1]), None, gmax)
    return stored, ts


@torch.no_grad()
def gptq_requantize_(
    qmodel: nn.Module, source: nn.Module, sequences: list[torch.Tensor], damp: float = 0.1
) -> dict:
    """Re-round every FP4 QuantLinear of ``qmodel`` (bitrl.quant.quantize_model of a copy of ``source``)
    from ``source``'s current weights by GPTQ, on Hessians of ``source``'s own inputs over ``sequences``
    (int64 ids [T] each). Layers in other formats (e.g. the fp8 ones of a recipe) are left as they are.

    The layers that read one input (q/k/v, gate/up) are rounded as one matrix, and the like problems of
    every transformer block in one batched loop (bounded by BATCH_ELEMENTS).

    Returns ``{"gptq_layers": n, "calibration_tokens": n, "seconds": t}``."""
    from .linear import QuantLinear

    t0 = time.perf_counter()
    layers = {
        m.source_name: m
        for m in qmodel.modules()
        if isinstance(m, QuantLinear) and m.source_name and get_format(m.fmt).packed
    }
    was_training = source.training
    source.eval()
    try:
        hessians = collect_hessians(source, sequences, names=list(layers))
    finally:
        source.train(was_training)
    modules = dict(source.named_modules())
    # one problem per input: collect_hessians gives the layers that read one tensor the same Hessian
    problems: list[tuple[torch.Tensor, list[str]]] = []
    for name in layers:
        h = hessians[name]
        same = next((p for p in problems if p[0] is h), None)
        if same is None:
            problems.append((h, [name]))
        else:
            same[1].append(name)
    # like problems batched: same layer formats and kwargs, same shapes
    batches: dict[tuple, list[tuple[torch.Tensor, list[str]]]] = {}
    for h, names in problems:
        key = tuple((layers[n].fmt, repr(layers[n].quant_kwargs), layers[n].out_features) for n in names)
        batches.setdefault((h.shape[0], key), []).append((h, names))
    for (cols, key), members in batches.items():
        rows = sum(k[2] for k in key)
        step = max(1, BATCH_ELEMENTS // (rows * cols))
        for at in range(0, len(members), step):
            chunk = members[at : at + step]
            weights, keeps = [], []
            for _, names in chunk:
                ws = [layers[n].oriented(modules[n].weight.detach()) for n in names]
                weights.append(ws)
                keeps.append([layers[n].outlier_keep(w) for n, w in zip(names, ws)])
            first = layers[chunk[0][1][0]]
            results = gptq_quantize_batched(
                weights,
                torch.stack([h for h, _ in chunk]),
                first.fmt,
                keeps=keeps,
                damp=damp,
                **first.quant_kwargs,
            )
            for (_, names), group_keep, group_results in zip(chunk, keeps, results):
                for name, keep, (qt, values) in zip(names, group_keep, group_results):
                    layers[name].set_rounded(qt, values, keep)
    return {
        "gptq_layers": len(layers),
        "calibration_tokens": sum(int(s.numel()) for s in sequences),
        "seconds": time.perf_counter() - t0,
    }
