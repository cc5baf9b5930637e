"""Number formats as data.

An :class:`ElementFormat` describes one small floating-point element type (E2M1, E4M3, E5M2, E8M0) by its bit
layout; every other quantity (largest value, smallest normal, the full grid of representable values) is
derived
from the layout, so the tables in the tests can be checked against the arithmetic here.

A :class:`ScaledFormat` is an element format plus how it is scaled: the block size along the last dimension,
the kind of scale stored per block, and whether a second FP32 per-tensor scale exists (NVFP4).

Conventions used throughout ``bitrl.quant``:

* Quantization blocks run along the **last** dimension (the reduction dimension of ``x @ W.T``).
* FP4 codes are packed two per byte, **element 2i in the low nibble, element 2i+1 in the high nibble**
  (the OCP / PTX ``e2m1x2`` order); a code is ``sign << 3 | exponent << 1 | mantissa``.
* E8M0 scales are stored as ``torch.float8_e8m0fnu`` (bias 127, byte 0xFF is NaN and never produced);
  the byte ``b`` means ``2 ** (b - 127)``. NVFP4 block scales are stored as ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "ElementFormat",
    "ScaledFormat",
    "get_format",
]

E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
"""torch dtype used to store E8M0 scales (None on a torch without it; then uint8 with bias 127 is used)."""


@dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude minifloat: ``bits = 1 + ebits + mbits`` (E8M0 has no sign and no mantissa).

    Attributes:
        name: short name ("e2m1", "e4m3", ...).
        ebits / mbits: exponent and mantissa field widths.
        bias: exponent bias; a normal value is ``2**(E - bias) * (1 + M / 2**mbits)`` for field E >= 1 and a
            subnormal (E == 0) is ``2**(1 - bias) * M / 2**mbits``.
        max: the largest finite value (after removing the codes used for NaN / inf).
        signed: whether a sign bit exists.
        torch_dtype: the matching torch dtype, if torch has one.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    signed: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value (2 for E2M1, 8 for E4M3, 15 for E5M2): OCP's ``emax_elem``."""
        return math.floor(math.log2(self.max))

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @cached_property
    def grid(self) -> torch.Tensor:
        """All non-negative finite values, ascending, as float32 (E2M1: 0, .5, 1, 1.5, 2, 3, 4, 6)."""
        vals = {0.0}
        for e_field in range(0, 2**self.ebits):
            for m in range(0, 2**self.mbits):
                if e_field == 0:
                    v = self.min_subnormal * m
                else:
                    v = 2.0 ** (e_field - self.bias) * (1 + m / 2**self.mbits)
                if v <= self.max:
                    vals.add(v)
        return torch.tensor(sorted(vals), dtype=torch.float32)

    def decode_table(self) -> torch.Tensor:
        """float32 value of every code ``0 .. 2**bits - 1`` (codes beyond ``max`` map to NaN)."""
        out = []
        for code in range(2**self.bits):
            sign = -1.0 if (self.signed and code >> (self.ebits + self.mbits)) else 1.0
            e_field = (code >> self.mbits) & ((1 << self.ebits) - 1)
            m = code & ((1 << self.mbits) - 1)
            if e_field == 0:
                v = self.min_subnormal * m
            else:
                v = 2.0 ** (e_field - self.bias) * (1 + m / 2**self.mbits)
            out.append(sign * v if v <= self.max else float("nan"))
        return torch.tensor(out, dtype=torch.float32)


E2M1 = ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max=6.0, torch_dtype=None)
E4M3 = ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max=57344.0, torch_dtype=torch.float8_e5m2)
E8M0 = ElementFormat("e8m0", ebits=8, mbits=0, bias=127, max=2.0**127, signed=False, torch_dtype=E8M0_DTYPE)

SCALE_KINDS = ("fp32", "e8m0", "e4m3")
GRANULARITIES = ("tensor", "row", "block")


@dataclass(frozen=True)
class ScaledFormat:
    """An element format with its scaling scheme.

    Attributes:
        name: the ``fmt`` string accepted by :func:`bitrl.quant.quantize`.
        element: the element format.
        block_size: default block length along the last dim (None: FP8 whose default granularity is per
        tensor).
        scale_kind: "fp32" (FP8: amax / max), "e8m0" (MX: power of two) or "e4m3" (NVFP4 block scale).
        tensor_scale: whether an extra FP32 per-tensor scale exists (NVFP4: amax / (448 * 6)).
        default_granularity: "tensor" for FP8, "block" for MX/NV.
    """

    name: str
    element: ElementFormat
    block_size: int | None
    scale_kind: str
    tensor_scale: bool = False
    default_granularity: str = "block"

    @property
    def packed(self) -> bool:
        """Whether two codes share a byte (4-bit elements)."""
        return self.element.bits == 4

    @property
    def is_mx(self) -> bool:
        return self.scale_kind == "e8m0"

    @property
    def bits_per_element(self) -> float:
        """Storage cost including scales, for the default block size."""
        scale_bits = {"fp32": 0.0, "e8m0": 8.0, "e4m3": 8.0}[self.scale_kind]
        return self.element.bits + (scale_bits / self.block_size if self.block_size else 0.0)


FORMATS: dict[str, ScaledFormat] = {
    "fp8_e4m3": ScaledFormat("fp8_e4m3", E4M3, None, "fp32", default_granularity="tensor"),
    "fp8_e5m2": ScaledFormat("fp8_e5m2", E5M2, None, "fp32", default_granularity="tensor"),
    "mxfp8": ScaledFormat("mxfp8", E4M3, 32, "e8m0"),
    "mxfp4": ScaledFormat("mxfp4", E2M1, 32, "e8m0"),
    "nvfp4": ScaledFormat("nvfp4", E2M1, 16, "e4m3", tensor_scale=True),
}


def get_format(fmt: str | ScaledFormat) -> ScaledFormat:
    """Look a format up by name; raises ValueError naming ``fmt`` for an unknown one."""
    if isinstance(fmt, ScaledFormat):
        return fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]
