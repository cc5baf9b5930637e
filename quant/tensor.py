"""QuantizedTensor: packed elements plus scales in their real dtypes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import reference as ref
from .formats import ScaledFormat


@dataclass
class QuantizedTensor:
    """A tensor quantized along its last dimension.

    The tensor is viewed as a matrix ``(R, K)`` (all leading dims flattened into rows ``R``). Scales belong
    to blocks
    of ``block = (bh, bw)`` elements: ``(1, 32)`` for MX, ``(1, 16)`` for NVFP4, and for FP8 ``(R, K)``
    (per tensor),
    ``(1, K)`` (per row), ``(1, 128)`` or ``(128, 128)`` (DeepSeek-V3 blocks).

    Attributes:
        fmt: the scaled format.
        shape: the original shape.
        data: FP8 formats: ``torch.float8_e4m3fn`` / ``float8_e5m2`` of shape ``(R, Kp)``; FP4 formats:
        uint8 of
            shape ``(R, Kp // 2)`` holding two codes per byte (even element in the low nibble). ``Kp`` is
            ``K``
            rounded up to the block width; the padding holds zeros.
        scale: per-block scales, shape ``(ceil(R / bh), Kp // bw)``: float32 (FP8), ``float8_e8m0fnu`` (MX) or
            ``float8_e4m3fn`` (NVFP4).
        tensor_scale: NVFP4's float32 per-tensor scale (0-d), else None.
        block: ``(bh, bw)``.
        granularity: "tensor", "row" or "block".
        scale_mode: "floor" or "rceil" (MX), else "amax".
        dtype: dtype of the tensor that was quantized.
    """

    fmt: ScaledFormat
    shape: torch.Size
    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    block: tuple[int, int]
    granularity: str
    scale_mode: str
    dtype: torch.dtype

    # ------------------------------------------------------------------ views
    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        """K, the unpadded last dimension."""
        return self.shape[-1] if len(self.shape) else 1

    @property
    def padded_cols(self) -> int:
        return self.data.shape[1] * (2 if self.fmt.packed else 1)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        return n + (4 if self.tensor_scale is not None else 0)

    def codes(self) -> torch.Tensor:
        """Element codes as uint8 ``(R, Kp)`` (unpacked for FP4, the raw FP8 bytes otherwise)."""
        if self.fmt.packed:
            return ref.unpack_fp4(self.data)
        return self.data.view(torch.uint8)

    def element_values(self) -> torch.Tensor:
        """Unscaled element values as float32 ``(R, Kp)``."""
        if self.fmt.packed:
            return ref.decode_fp4_packed(self.data, self.fmt.element)
        if self.data.device.type == "cpu" and self.data.dtype == torch.float8_e4m3fn:
            return ref.decode_fp8(self.data)  # torch's CPU E4M3 -> float32 cast is slow; E5M2's is fast
        return self.data.to(torch.float32)

    def scale_fp32(self) -> torch.Tensor:
        """Block scales as float32 (for NVFP4 the E4M3 block scale only, without the tensor scale)."""
        if self.fmt.scale_kind == "e8m0":
            return ref.e8m0_from_storage(self.scale)
        return self.scale.to(torch.float32)

    def to(self, device) -> QuantizedTensor:
        ts = None if self.tensor_scale is None else self.tensor_scale.to(device)
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), tensor_scale=ts)

    # ------------------------------------------------------------------ dequantize
    def dequantize(self, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
        """Values as ``dtype`` with the original shape. Exact in float32 (every product is a power of two or
        has few enough significant bits), except NVFP4's final multiplication by the FP32 tensor scale."""
        if backend == "triton" or (backend == "auto" and self.data.is_cuda and self.fmt.scale_kind != "fp32"):
            if self.block[0] != 1:
                raise ValueError(f"backend: the Triton path supports 1-D blocks only, got {self.block}")
            from bitrl.kernels.quantize import dequantize_blocks_triton

            out = dequantize_blocks_triton(
                self.data,
                self.scale_fp32(),
                self.fmt.element,
                bw=self.block[1],
                cols=self.cols,
                tensor_scale=self.tensor_scale,
                out_dtype=dtype,
            )
        else:
            out = dequantize_reference(self)
        return out.to(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(fmt={self.fmt.name}, shape={tuple(self.shape)}, block={self.block}, "
            f"granularity={self.granularity}, scale_mode={self.scale_mode}, data={self.data.dtype}"
            f"{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)})"
        )


def expand_blocks(s: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Broadcast per-block values ``(nbr, nbc)`` to elements ``(rows, cols)`` (cols a multiple of bw)."""
    bh, bw = block
    nbr, nbc = s.shape
    if nbr == 1 and nbc == 1:
        return s.expand(rows, cols)
    e = s[:, None, :, None].expand(nbr, bh, nbc, bw).reshape(nbr * bh, nbc * bw)
    return e[:rows, :cols]


def dequantize_reference(qt: QuantizedTensor) -> torch.Tensor:
    """Torch reference dequantization: float32 of shape ``(R, K)`` (in-place scaling of its own temporary)."""
    vals = qt.element_values()
    r, kp = vals.shape
    if qt.fmt.scale_kind == "e4m3":
        vals.mul_(expand_blocks(qt.scale_fp32(), qt.block, r, kp)).mul_(qt.tensor_scale)
    elif qt.scale.numel() == 1:
        vals.mul_(qt.scale_fp32().reshape(()))
    elif qt.block[0] == 1:
        vals.view(r, -1, qt.block[1]).mul_(qt.scale_fp32()[:, :, None])
    else:
        vals.mul_(expand_blocks(qt.scale_fp32(), qt.block, r, kp))
    return vals[:, : qt.cols]
