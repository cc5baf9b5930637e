"""QuantLinear, quantize_model and requantize_: the quantized rollout copy of a policy.

Typical trainer use::

    rollout_model = quantize_model(copy.deepcopy(policy), "mxfp4", source=policy)
    for step in ...:
        ...  # optimizer.step() on `policy`
        requantize_(rollout_model, policy)   # re-quantizes only the tensors that changed

Change detection costs nothing per tensor: a tensor counts as changed when its identity, storage, autograd
version counter (bumped by every in-place op: ``copy_``, ``load_state_dict``, foreach optimizers) or its
count of ``torch.optim`` steps (a global post-step hook; fused optimizers do not bump the version counter)
differs from the last sync. Updates made through ``param.data`` by custom code bypass all of these; pass
``check="checksum"`` (one integer sum over each tensor's bits) or ``check="always"`` in that case.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .formats import get_format
from .quantize import fake_quantize, quantize
from .tensor import QuantizedTensor

__all__ = ["QuantLinear", "quantize_model", "requantize_"]

_FP8_ACT = ("fp8", "fp8_e4m3")
# (weight format, activation format) -> the native block-scaled recipe of bitrl.kernels.fp4_gemm
NATIVE_FP4 = {
    ("mxfp4", "mxfp4"): "mxfp4_mxfp4",
    ("mxfp4", "mxfp8"): "mxfp4_mxfp8",
    ("nvfp4", "nvfp4"): "nvfp4_nvfp4",
}


class QuantLinear(nn.Module):
    """A linear layer with a packed quantized weight.

    Execution paths (chosen per call from the input's device):

    * CPU (and any device without a faster path): the weight is dequantized once per weight version into the
      activation dtype and cached; ``F.linear`` does the rest.
    * CUDA, FP8 weights with ``act="fp8"``: W8A8 through ``torch._scaled_mm`` (activations quantized per
      token, weights per output row) where the device supports FP8 (compute capability >= 8.9).
    * CUDA, MXFP4 / NVFP4 weights: the Triton dequantize-fused W4A16 matmul (``bitrl.kernels.qmatmul``).
    * CUDA compute capability >= 10 (Blackwell), W4A4 / W4A8 (weights mxfp4 with ``act`` "mxfp4" or "mxfp8",
      nvfp4 with "nvfp4"): activations quantized for real and both operands fed to block-scaled FP4 tensor
      cores (``bitrl.kernels.fp4_gemm``). Elsewhere these run emulated: fake-quantized activations times the
      dequantized weight, the same numbers up to accumulation order.

    Memory: the dequantize-and-cache path keeps a full-precision copy of the weight next to the packed one, so
    it saves no memory over an unquantized layer (it reproduces the numerics only). On CUDA this is the path
    of MXFP8 weights (no fused MXFP8 kernel), of FP8 weights on GPUs below compute capability 8.9 or without
    ``act="fp8"``, and of 2-D FP8 blocks; :meth:`resident_bytes` reports what a layer actually holds.

    Activation quantization (``act``): None (weight-only), "fp8" (per-token dynamic E4M3: W8A8), or a block
    format name ("mxfp4", "nvfp4", "mxfp8") for fake quantization of the activations (W4A4 numerics,
    simulated). ``act="auto"`` means "fp8" for FP8 weights and None otherwise.

    Outlier fallback (``outlier_tau``): the weights above ``outlier_tau`` times the median magnitude of their
    block are kept in bf16 beside the packed weight (a flat int32 index and a bf16 value each: 48 bits) and
    left out of the block's scale, so one large weight no longer crushes the rest of its block to zero. The
    dequantized weight holds them in place; the fused paths add them as one gather and index_add.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        fmt: str = "mxfp4",
        act: str | None = "auto",
        quant_kwargs: dict | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        cache_dequantized: bool = True,
        outlier_tau: float | None = None,
    ):
        super().__init__()
        f = get_format(fmt)
        self.in_features, self.out_features = in_features, out_features
        self.fmt = f.name
        if act == "auto":
            act = "fp8" if f.scale_kind == "fp32" else None
        if act is not None and act not in (*_FP8_ACT, "mxfp4", "nvfp4", "mxfp8"):
            raise ValueError(f"act must be None, 'auto', 'fp8', 'mxfp4', 'nvfp4' or 'mxfp8', got {act!r}")
        self.act = act
        if outlier_tau is not None and not outlier_tau > 0:
            raise ValueError(f"outlier_tau must be > 0 (or None: off), got {outlier_tau!r}")
        self.outlier_tau = outlier_tau
        qk = dict(quant_kwargs or {})
        if f.scale_kind == "fp32" and "granularity" not in qk and "block_size" not in qk:
            qk["granularity"] = "row"  # per output channel: what torch._scaled_mm's row-wise mode takes
        self.quant_kwargs = qk
        self.compute_dtype = dtype
        self.cache_dequantized = cache_dequantized
        self.source_name: str | None = None
        self.source_transposed = False
        self.impl: str | None = None  # force "dequant_matmul", "w4a16_triton" or "scaled_mm" (tests)
        self.weight_version = 0
        self._meta: dict | None = None
        self._deq: torch.Tensor | None = None
        self._deq_key: tuple | None = None
        self.register_buffer("qdata", torch.empty(0, dtype=torch.uint8, device=device))
        self.register_buffer("qscale", torch.empty(0, dtype=torch.float32, device=device))
        self.register_buffer("qtensor_scale", None)
        self.register_buffer("outlier_index", None)  # int32 [n] flat indices into the (out, in) weight
        self.register_buffer("outlier_value", None)  # bf16 [n]
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    # ------------------------------------------------------------------ construction / refresh
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str,
        *,
        act: str | None = "auto",
        outlier_tau: float | None = None,
        **quant_kwargs,
    ) -> QuantLinear:
        w = linear.weight
        conv1d = _is_conv1d(linear)  # transformers' Conv1D (GPT-2 family): weight is (in, out)
        n_in, n_out = (w.shape[0], w.shape[1]) if conv1d else (linear.in_features, linear.out_features)
        q = cls(
            n_in,
            n_out,
            linear.bias is not None,
            fmt=fmt,
            act=act,
            quant_kwargs=quant_kwargs,
            dtype=w.dtype,
            device=w.device,
            outlier_tau=outlier_tau,
        )
        q.source_transposed = conv1d
        q.set_weight(w.detach())
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    @torch.no_grad()
    def set_weight(
        self, weight: torch.Tensor, hessian: torch.Tensor | None = None, damp: float = 0.01
    ) -> None:
        """Quantize ``weight`` (out_features, in_features) into the packed buffers; bumps
        ``weight_version``. A layer made from a transformers ``Conv1D`` takes that layer's (in, out)
        weight.

        hessian: float32 [in, in] ``X^T X`` of the layer's inputs: GPTQ rounding (bitrl.quant.gptq, FP4
        formats; ``damp`` its conditioning) in place of round-to-nearest. The stored format is the same."""
        weight = self.oriented(weight)
        keep = self.outlier_keep(weight)
        if hessian is None:
            qt = quantize(
                weight if keep is None else weight.masked_fill(keep, 0.0), self.fmt, **self.quant_kwargs
            )
            self.set_rounded(qt, weight, keep)
        else:
            from .gptq import gptq_quantize

            qt, values = gptq_quantize(weight, hessian, self.fmt, keep=keep, damp=damp, **self.quant_kwargs)
            self.set_rounded(qt, values, keep)

    def oriented(self, weight: torch.Tensor) -> torch.Tensor:
        """The source layer's weight as (out_features, in_features) (a Conv1D's is transposed); checked."""
        if self.source_transposed:
            weight = weight.t()
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must have shape {(self.out_features, self.in_features)}, got {tuple(weight.shape)}"
            )
        return weight

    def outlier_keep(self, weight: torch.Tensor) -> torch.Tensor | None:
        """bool [out, in]: the weights the outlier fallback holds in bf16 (None when it is off)."""
        if self.outlier_tau is None:
            return None
        from .analysis import outlier_mask
        from .quantize import resolve_spec

        spec = resolve_spec(self.fmt, **self.quant_kwargs)
        return outlier_mask(weight.float(), spec.block(*weight.shape), self.outlier_tau)

    def set_rounded(self, qt: QuantizedTensor, values: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Hold ``qt`` as the weight, and the kept weights (``keep``, from :meth:`outlier_keep`) at their
        ``values`` [out, in] in bf16; bumps ``weight_version``."""
        if tuple(qt.shape) != (self.out_features, self.in_features) or qt.fmt.name != self.fmt:
            raise ValueError(
                f"qt must be {self.fmt} of shape {(self.out_features, self.in_features)}, "
                f"got {qt.fmt.name} {tuple(qt.shape)}"
            )
        if (keep is None) != (self.outlier_tau is None):
            raise ValueError("keep must be given exactly when the layer has outlier_tau set")
        if keep is not None:
            index = keep.reshape(-1).nonzero().squeeze(1)  # a host sync, once per weight sync
            self.outlier_index = index.to(torch.int32)
            self.outlier_value = values.reshape(-1)[index].to(torch.bfloat16)
        self._store(qt)

    def _store(self, qt: QuantizedTensor) -> None:
        for name, t in (("qdata", qt.data), ("qscale", qt.scale), ("qtensor_scale", qt.tensor_scale)):
            cur = getattr(self, name)
            if cur is not None and t is not None and cur.shape == t.shape and cur.dtype == t.dtype:
                cur.copy_(t)  # keep storage: no reallocation per step, views stay valid
            else:
                setattr(self, name, t)
        self._meta = dict(
            shape=qt.shape,
            block=qt.block,
            granularity=qt.granularity,
            scale_mode=qt.scale_mode,
            dtype=qt.dtype,
        )
        self.weight_version += 1
        self._deq_key = None  # the cached dequantized weight is stale; its storage is reused

    @property
    def qweight(self) -> QuantizedTensor:
        m = self._meta
        if m is None:
            raise RuntimeError("QuantLinear has no weight yet: call set_weight() or from_linear()")
        return QuantizedTensor(
            fmt=get_format(self.fmt),
            shape=m["shape"],
            data=self.qdata,
            scale=self.qscale,
            tensor_scale=self.qtensor_scale,
            block=m["block"],
            granularity=m["granularity"],
            scale_mode=m["scale_mode"],
            dtype=m["dtype"],
        )

    def resident_bytes(self) -> int:
        """Bytes this layer holds for its weight: packed data, scales and, after a forward on the
        dequantize-and-cache path, the cached full-precision copy (which makes it larger than the dense
        layer it replaced)."""
        held = [self.qdata, self.qscale, self.qtensor_scale, self._deq]
        held += [self.outlier_index, self.outlier_value]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as ``dtype`` (default: the compute dtype), cached per weight version."""
        dtype = dtype or self.compute_dtype
        # buffer versions too: load_state_dict / copy_ into the buffers must invalidate the cache
        key = (self.weight_version, self.qdata._version, self.qscale._version, dtype, self.qdata.device)
        if self._deq is not None and self._deq_key == key:
            return self._deq
        w = self.qweight.dequantize(dtype)
        if self.outlier_index is not None:
            w.view(-1).index_copy_(0, self.outlier_index.long(), self.outlier_value.to(dtype))
        if not self.cache_dequantized:
            return w
        old = self._deq
        if old is not None and old.shape == w.shape and old.dtype == w.dtype and old.device == w.device:
            old.copy_(w)  # refresh in place: no new allocation per step, references stay valid
            w = old
        self._deq, self._deq_key = w, key
        return w

    # ------------------------------------------------------------------ forward
    def _quantize_act(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return x
        if self.act in _FP8_ACT:
            return fake_quantize(x, "fp8_e4m3", granularity="row", check_finite=False)
        return fake_quantize(x, self.act, check_finite=False)

    def execution_path(self, x: torch.Tensor) -> str:
        """The matmul used for an input like ``x``: "scaled_mm", "fp4_native", "w4a16_triton" or
        "dequant_matmul"."""
        if self.impl is not None:
            return self.impl
        if x.device.type == "cuda":
            from bitrl.kernels.fp4_gemm import native_unavailable_reason
            from bitrl.kernels.qmatmul import scaled_mm_unavailable_reason

            f = get_format(self.fmt)
            if (
                (f.name, self.act) in NATIVE_FP4
                and self._meta["block"][0] == 1
                and native_unavailable_reason(x.device) is None
            ):
                return "fp4_native"
            if (
                f.name == "fp8_e4m3"
                and self.act in _FP8_ACT
                and self._meta["granularity"] in ("row", "tensor")
                and self.in_features % 16 == 0
                and self.out_features % 16 == 0
                and scaled_mm_unavailable_reason(x.device) is None
            ):
                return "scaled_mm"
            if f.packed and self._meta["block"][0] == 1:
                return "w4a16_triton"
        return "dequant_matmul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.execution_path(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if path == "dequant_matmul":
            return F.linear(self._quantize_act(x), self.dequantized_weight(x.dtype), bias)
        if path == "scaled_mm":
            from bitrl.kernels.qmatmul import fp8_scaled_mm

            out = fp8_scaled_mm(x, self.qdata, self.qscale, bias=bias, out_dtype=x.dtype)
            return self._add_outliers(x, out)
        if path == "fp4_native":
            out = self._add_outliers(x, self._fp4_native(x))
            return out if bias is None else out + bias
        x = self._quantize_act(x)
        if path == "w4a16_triton":
            from bitrl.kernels.qmatmul import w4a16_matmul

            qt = self.qweight
            out = w4a16_matmul(
                x,
                qt.data,
                qt.scale_fp32(),
                qt.fmt.element,
                bw=qt.block[1],
                n=self.out_features,
                k=self.in_features,
                tensor_scale=qt.tensor_scale,
                out_dtype=x.dtype,
            )
            out = self._add_outliers(x, out)
            return out if bias is None else out + bias
        raise ValueError(f"unknown execution path {path!r}")

    def _add_outliers(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + x @ W_outliers^T, W_outliers the kept bf16 weights (zero elsewhere)."""
        if self.outlier_index is None:
            return out
        index = self.outlier_index.long()
        rows, cols = index // self.in_features, index % self.in_features
        x2 = x.reshape(-1, self.in_features)
        out2 = out.reshape(-1, self.out_features)
        return out2.index_add(1, rows, x2[:, cols] * self.outlier_value.to(x.dtype)).view(out.shape)

    def _fp4_native(self, x: torch.Tensor) -> torch.Tensor:
        """W4A4 / W4A8 on block-scaled tensor cores: the activations are quantized for real, per token."""
        from bitrl.kernels.fp4_gemm import fp4_gemm

        qw = self.qweight
        x2 = x.reshape(-1, self.in_features)
        qa = quantize(x2, self.act, check_finite=False)
        ts = None
        if qw.tensor_scale is not None:
            ts = (qa.tensor_scale * qw.tensor_scale).reshape(1)
        out = fp4_gemm(
            qa.data,
            qa.scale,
            qw.data,
            qw.scale,
            recipe=NATIVE_FP4[(self.fmt, self.act)],
            k=qw.padded_cols,
            tensor_scale=ts,
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"act={self.act}, bias={self.bias is not None}"
            + (f", outlier_tau={self.outlier_tau}" if self.outlier_tau is not None else "")
        )


# ----------------------------------------------------------------------------------------------- models


def _skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts or name.endswith("." + s) for s in skip)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    fmt: str,
    skip: Iterable[str] = ("lm_head", "embed_tokens"),
    *,
    act: str | None = "auto",
    source: nn.Module | None = None,
    **quant_kwargs,
) -> nn.Module:
    """Replace every ``nn.Linear`` (and transformers ``Conv1D``) of ``model``, in place, by a
    :class:`QuantLinear`; returns ``model``.

    Args:
        model: any module, e.g. a Hugging Face causal LM (quantize a ``copy.deepcopy`` to keep the original).
        fmt: weight format ("fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4").
        skip: module names (or name components) left in high precision.
        act: activation quantization, see :class:`QuantLinear`.
        source: the model this one was copied from; when given, its current tensor versions are recorded so
            that the first :func:`requantize_` only refreshes what changed after this call.
        quant_kwargs: passed to :func:`bitrl.quant.quantize` (``block_size``, ``scale_mode``, ...).
    """
    get_format(fmt)
    _ensure_step_hook()
    skip = tuple(skip)
    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) or _is_conv1d(module)) or _skipped(name, skip):
            continue
        q = QuantLinear.from_linear(module, fmt, act=act, **quant_kwargs)
        q.source_name = name
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, q)
    model._bitrl_quant = dict(fmt=fmt, skip=skip, act=act, quant_kwargs=quant_kwargs)
    if source is not None:
        model._bitrl_sync_state = {name: _signature(t, "version") for name, t in _named_tensors(source)}
    return model


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _canon(name: str) -> str:
    """Strip the prefixes that DDP, torch.compile and FSDP wrappers add to parameter names."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p) :], True
            name = name.replace("." + p, ".")
    return name


def _named_tensors(model: nn.Module):
    for name, t in model.named_parameters(remove_duplicate=False):
        yield _canon(name), t
    for name, t in model.named_buffers(remove_duplicate=False):
        yield _canon(name), t


# Fused optimizers (e.g. AdamW(fused=True)) update parameters without bumping their autograd version counter,
# so every torch.optim step is also counted here, per parameter, by a global post-step hook.
_OPT_STEPS: dict[int, int] = {}
_HOOK = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                _OPT_STEPS[id(p)] = _OPT_STEPS.get(id(p), 0) + 1


def _ensure_step_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK = register_optimizer_step_post_hook(_count_optimizer_step)


def _signature(t: torch.Tensor, check: str):
    if check == "checksum":
        flat = t.detach().reshape(-1)
        if flat.is_floating_point():
            flat = flat.view({1: torch.int8, 2: torch.int16}.get(flat.element_size(), torch.int32))
        return (t.data_ptr(), int(flat.sum(dtype=torch.int64)))
    return (id(t), t._version, t.data_ptr(), _OPT_STEPS.get(id(t), 0))


@torch.no_grad()
def requantize_(
    qmodel: nn.Module, source_model: nn.Module, *, check: str = "version", warm: bool = False
) -> dict:
    """Refresh ``qmodel`` (from :func:`quantize_model`) from ``source_model`` after a training step.

    Quantized layers whose source weight changed are re-quantized; every other changed parameter or buffer
    (norms, embeddings, the skipped ``lm_head`` ...) is copied. Unchanged tensors are not touched.

    Args:
        check: "version" (default; free: tensor identity + autograd version counter), "checksum" (an integer
            checksum of each tensor's bits: catches updates made through ``.data``), or "always".
        warm: also rebuild the dequantized-weight caches of the CPU path now instead of at the next forward.

    Returns:
        ``{"requantized": n, "copied": n, "unchanged": n, "seconds": t}``.
    """
    if check not in ("version", "checksum", "always"):
        raise ValueError(f"check must be 'version', 'checksum' or 'always', got {check!r}")
    _ensure_step_hook()
    t0 = time.perf_counter()
    state = getattr(qmodel, "_bitrl_sync_state", None)
    if state is None or getattr(qmodel, "_bitrl_sync_check", check) != check:
        state = {}
    qlinears = {
        _canon(m.source_name): m for m in qmodel.modules() if isinstance(m, QuantLinear) and m.source_name
    }
    targets = dict(_named_tensors(qmodel))
    stats = {"requantized": 0, "copied": 0, "unchanged": 0}
    done: set[int] = set()
    for name, src in _named_tensors(source_model):
        sig = None if check == "always" else _signature(src, check)
        if sig is not None and state.get(name) == sig:
            stats["unchanged"] += 1
            continue
        mod_name, _, pname = name.rpartition(".")
        ql = qlinears.get(mod_name)
        if ql is not None and pname == "weight":
            ql.set_weight(src.detach())
            if warm:
                ql.dequantized_weight()
            stats["requantized"] += 1
        elif name in targets:
            dst = targets[name]
            if id(dst) not in done:
                if dst.shape != src.shape:
                    raise ValueError(
                        f"source_model: {name} has shape {tuple(src.shape)}, qmodel has {tuple(dst.shape)}"
                    )
                dst.copy_(src.detach())
                done.add(id(dst))
            stats["copied"] += 1
        else:
            raise ValueError(
                f"source_model has {name!r}, which qmodel lacks: is it the model qmodel was copied from?"
            )
        state[name] = sig if sig is not None else _signature(src, "version")
    qmodel._bitrl_sync_state = state
    qmodel._bitrl_sync_check = check
    stats["seconds"] = time.perf_counter() - t0
    return stats
