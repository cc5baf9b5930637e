"""FP4 decode GEMV: ``x [M, K] (bf16) @ deq(W)[N, K].T -> [M, N] fp32`` for M <= 16, MXFP4 and NVFP4 weights.

The CUDA C++ kernel (``csrc/fp4_gemv.cu``) reads every weight byte once and dequantizes in registers; this
module holds its torch twin, which defines the semantics, and the ctypes binding.

Weight layout (that of ``bitrl.quant.QuantizedTensor``, restated here so that this module stands alone):

* ``packed`` [N, Kp/2] uint8: E2M1 codes two per byte, element 2i in the low nibble; a code is
  ``sign << 3 | exponent << 1 | mantissa`` with values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; Kp is K rounded up to
  the block length and the padding holds zero codes;
* ``scale`` [N, Kp/bw]: MXFP4 (bw = 32) an E8M0 byte b meaning 2^(b - 127) (``float8_e8m0fnu`` or uint8);
  NVFP4 (bw = 16) an E4M3 value (``float8_e4m3fn``), multiplied by the fp32 ``tensor_scale``.
"""

from __future__ import annotations

import torch

from ._common import check_tensor

__all__ = ["FORMATS", "fp4_gemv", "fp4_gemv_reference", "dequantize_fp4"]

FORMATS = {"mxfp4": 32, "nvfp4": 16}  # block length along K
MAX_ROWS = 16
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def aligned(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``t`` itself, or a copy of it at an address that is a multiple of ``alignment`` bytes (a view at an odd
    offset into a larger buffer is contiguous yet unaligned; a fresh allocation is aligned to 64 bytes or
    more)."""
    return t if t.data_ptr() % alignment == 0 else t.clone()


def _scale_values(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "mxfp4":
        b = scale.contiguous().view(torch.uint8).to(torch.int32)
        # 2^(b - 127) from the exponent bits; b = 0 is 2^-127, a float32 subnormal
        normal = (b.clamp(min=1) << 23).view(torch.float32)
        return torch.where(b == 0, torch.full_like(normal, 2.0**-127), normal)
    return scale.to(torch.float32)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, fmt: str, k: int, tensor_scale=None):
    """The weight as float32 [N, K] (exact: every product of an E2M1 value and a block scale is a float32)."""
    bw = FORMATS[fmt]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).reshape(packed.shape[0], -1)  # [N, Kp]
    vals = lut[codes].view(packed.shape[0], -1, bw) * _scale_values(scale, fmt).unsqueeze(-1)
    w = vals.reshape(packed.shape[0], -1)[:, :k]
    return w * tensor_scale.to(torch.float32) if tensor_scale is not None else w


def _check(x, packed, scale, fmt, k, tensor_scale):
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {sorted(FORMATS)}, got {fmt!r}")
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float32, torch.float16))
    m, kx = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x: the GEMV takes 1 to {MAX_ROWS} rows, got {m}")
    if kx != k:
        raise ValueError(f"x: expected {k} columns (k), got {kx}")
    bw = FORMATS[fmt]
    kp = -(-k // bw) * bw
    check_tensor("packed", packed, ndim=2, dtypes=(torch.uint8,), device=x.device)
    if packed.shape[1] * 2 != kp:
        raise ValueError(f"packed: expected {kp // 2} bytes per row for k={k} ({fmt}), got {packed.shape[1]}")
    # the kernel reads the scales as bytes: only the format's own scale dtypes mean what it decodes
    scale_dtypes = (torch.float8_e4m3fn,) if fmt == "nvfp4" else (torch.uint8, E8M0)
    check_tensor(
        "scale", scale, ndim=2, dtypes=tuple(d for d in scale_dtypes if d is not None), device=x.device
    )
    if tuple(scale.shape) != (packed.shape[0], kp // bw):
        raise ValueError(f"scale: expected shape {[packed.shape[0], kp // bw]}, got {list(scale.shape)}")
    if (fmt == "nvfp4") != (tensor_scale is not None):
        raise ValueError(f"tensor_scale: {'required' if fmt == 'nvfp4' else 'not used'} for {fmt}")
    return m, kp


def fp4_gemv_reference(x, packed, scale, fmt: str, *, k: int, tensor_scale=None) -> torch.Tensor:
    """The torch twin: ``x.float() @ dequantize_fp4(W).T`` in fp32, [M, N]."""
    _check(x, packed, scale, fmt, k, tensor_scale)
    return x.to(torch.float32) @ dequantize_fp4(packed, scale, fmt, k, tensor_scale).T


def fp4_gemv(x, packed, scale, fmt: str, *, k: int, tensor_scale=None, impl: str | None = None):
    """FP4 GEMV, ``[M, N]`` fp32: the CUDA C++ kernel on CUDA (bf16 ``x``), the torch twin elsewhere.

    Args:
        x: [M, K] activations, M <= 16 (bf16 for the CUDA kernel).
        packed, scale, tensor_scale: the weight as described in the module docstring.
        fmt: "mxfp4" or "nvfp4"; k: K, the unpadded reduction length.
        impl: "cuda" | "torch" (default: "cuda" for CUDA tensors).
    """
    m, kp = _check(x, packed, scale, fmt, k, tensor_scale)
    impl = impl or ("cuda" if x.is_cuda else "torch")
    if impl == "torch":
        return fp4_gemv_reference(x, packed, scale, fmt, k=k, tensor_scale=tensor_scale)
    if impl != "cuda":
        raise ValueError(f"impl: expected 'cuda' or 'torch', got {impl!r}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: the CUDA kernel takes bf16 activations, got {x.dtype}")
    from .cuda_ext import check_status, load_library, stream_handle

    lib = load_library()
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    x, packed = x.contiguous(), aligned(packed.contiguous(), 8)  # the kernel loads 8 packed bytes at once
    s = scale.contiguous().view(torch.uint8)
    stream = stream_handle(x.device)
    if fmt == "mxfp4":
        code = lib.bitrl_fp4_gemv_mxfp4(
            x.data_ptr(), packed.data_ptr(), s.data_ptr(), out.data_ptr(), m, n, k, kp, stream
        )
    else:
        ts = tensor_scale.reshape(1).to(device=x.device, dtype=torch.float32).contiguous()
        code = lib.bitrl_fp4_gemv_nvfp4(
            x.data_ptr(), packed.data_ptr(), s.data_ptr(), ts.data_ptr(), out.data_ptr(), m, n, k, kp, stream
        )
    check_status(code, f"bitrl_fp4_gemv_{fmt}")
    return out
