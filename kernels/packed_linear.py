"""Linear layers whose weights are laid out once in oneDNN's blocked format: a CPU decode step's products.

``pack_linear(weights, biases) -> PackedLinear`` stacks weights [O_i, K] along their output features and
packs them as one product; ``packed_linear(x [..., K], packed) -> [..., sum O_i]`` = x @ cat(weights).T
(+ cat(biases)), in x's dtype. ``use_packed_linear(dtype, device)`` says where this is the faster form.

Why: torch's CPU product ``x @ W.T`` (MKL in fp32, oneDNN in bf16) reads W in its plain row-major layout on
every call; packed once into the blocked layout of oneDNN's matmul kernels, the same product over a decode
step's few rows runs 1.3-2.6x faster. Measured on a 2-core AMD EPYC with AVX-512 BF16, SmolLM2-135M's
shapes at 64 rows (30 layers' gate and up projections; the LM head [49152, 576]): bf16 28.5 -> 22.3 ms and
13.8 -> 10.6 ms, fp32 70.3 -> 40.2 ms (the weight-major form `bitrl.kernels.weight_major`: 68.9) and
54.6 -> 21.0 ms. Stacking a layer's q, k and v into one product gains another 1.1x (one call instead of
three at 64 rows). An elementwise step can ride on the product (`silu`, `add`, `mul`: oneDNN post-ops on
the fp32 accumulator), which takes a decode step's MLP and residual adds out of the host loop; in a whole
SmolLM2 rollout that was as fast as stacking gate and up and calling the host's silu * up (4 runs each,
interleaved, bf16 and fp32), with fewer calls. The bits: bf16 the same as torch's product (both oneDNN, fp32
accumulation); fp32 those of oneDNN's kernel, not MKL's (another order of the same sums: differences of a
few ulps). The packed copy holds the weight's bytes once more, and no longer stands for the weight once
that changes (`PackedLinear.current`); the decoder packs once per rollout (`Decoder.packing`).

Where: CPUs with AVX-512 (fp32) or bf16 units (bf16; without them oneDNN emulates bf16). Measured on the
AVX-512 BF16 EPYC only: the Intel Xeons with AMX take it unmeasured (oneDNN's own target, AMX for bf16),
the AVX2-only CPUs keep the weight-major form in fp32 (`bitrl.kernels.weight_major`). No autograd: a
forward for generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PackedLinear",
    "can_pack",
    "pack_linear",
    "packed_linear",
    "packed_linear_reference",
    "use_packed_linear",
]


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this CPU packs products in `dtype`: fp32 wherever torch has oneDNN, bf16 where the CPU also
    has bf16 units (AVX-512 BF16 or AMX)."""
    if not _onednn():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def use_packed_linear(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether `packed_linear` is the faster form of a product in `dtype` on `device`: a CPU that packs it
    (`can_pack`), with AVX-512 for fp32 (measured faster there, unmeasured on AVX2-only CPUs)."""
    if torch.device(device).type != "cpu" or not can_pack(dtype):
        return False
    return dtype == torch.bfloat16 or torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _key(weights) -> tuple:
    # a weight synced in place bumps its version; one replaced has another address
    return tuple((w.data_ptr(), w._version, w.dtype) for w in weights)


@dataclass
class PackedLinear:
    """Weights [O_i, K] stacked and packed (oneDNN's blocked layout), their stacked bias or None, and the
    key of the weights they were packed from."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    key: tuple

    def current(self, weights) -> bool:
        """Whether these are still the packed form of `weights` (unchanged since they were packed)."""
        return self.key == _key(weights)


def pack_linear(weights, biases=None) -> PackedLinear:
    """Pack weights [O_i, K] (one dtype, fp32 or bf16, on the CPU) as one product; biases: one [O_i] or None
    per weight (all None: no bias)."""
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"pack_linear: {len(weights)} weights and {len(biases)} biases")
    k, dtype = weights[0].shape[-1], weights[0].dtype
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k or w.dtype != dtype or w.device.type != "cpu":
            raise ValueError(
                f"pack_linear: CPU weights [O_i, {k}] in {dtype} expected, got {list(w.shape)} {w.dtype} on "
                f"{w.device}"
            )
    if not can_pack(dtype):
        raise ValueError(f"pack_linear: this CPU has no packed {dtype} product (can_pack)")
    with torch.no_grad():
        stacked = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    (b.detach() if b is not None else torch.zeros(w.shape[0], dtype=dtype)).to(dtype)
                    for w, b in zip(weights, biases)
                ]
            )
        packed = torch.ops.mkldnn._reorder_linear_weight(stacked.contiguous(), None)
    return PackedLinear(packed, bias, stacked.shape[0], _key(weights))


def packed_linear(
    x: torch.Tensor,
    packed: PackedLinear,
    *,
    silu: bool = False,
    add: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x [..., K] @ the packed weights.T (+ bias) -> [..., sum O_i] in x's dtype (the weights'), with at
    most one elementwise step fused into the product (applied to its fp32 accumulator, rounded once):
    silu(y), y + add or y * mul (add, mul: [..., sum O_i] in x's dtype). A decode step's MLP is then
    down(up(h) * silu(gate(h))) + residual in three calls, the attention's o_proj(o) + residual in one."""
    if x.dtype != packed.weight.dtype:
        raise ValueError(f"packed_linear: x is {x.dtype}, the packed weights {packed.weight.dtype}")
    if x.shape[-1] != packed.weight.shape[1]:
        raise ValueError(f"packed_linear: x [..., {packed.weight.shape[1]}] expected, got {list(x.shape)}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("packed_linear: no autograd (a forward for generation)")
    if silu + (add is not None) + (mul is not None) > 1:
        raise ValueError("packed_linear: at most one of silu, add, mul")
    other, attr = (add, "add") if add is not None else (mul, "mul")
    if other is None:
        return torch.ops.mkldnn._linear_pointwise(
            x, packed.weight, packed.bias, "swish" if silu else "none", [], ""
        )
    shape = (*x.shape[:-1], packed.out_features)
    if other.shape != shape or other.dtype != x.dtype:
        raise ValueError(
            f"packed_linear: {attr} must be {list(shape)} {x.dtype}, got {list(other.shape)} {other.dtype}"
        )
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed.weight, packed.bias, attr)


def packed_linear_reference(x: torch.Tensor, weights, biases=None) -> torch.Tensor:
    """The product in fp64, each weight separately (the test's reference), returned in fp64."""
    out = []
    biases = list(biases) if biases is not None else [None] * len(weights)
    for w, b in zip(weights, biases):
        y = x.double() @ w.double().T
        out.append(y if b is None else y + b.double())
    return torch.cat(out, dim=-1)
