"""Shared helpers for the fused ops: argument validation, implementation dispatch, optional Triton.

Every op in this package has up to three implementations:

``"triton"``     the Triton kernel (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1``);
``"torch"``      the chunked torch path, which is also the CPU execution path;
``"reference"``  the naive, obviously-correct torch formula used by the tests.

``impl=None`` (the default everywhere) reads ``BITRL_KERNEL_IMPL`` and otherwise picks ``"triton"`` for CUDA
tensors when Triton imports, and ``"torch"`` elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch


def cache_root() -> Path:
    """bitrl's cache folder: ``$BITRL_CACHE``, default ``~/.cache/bitrl`` (warm starts, converted models,
    compiled kernels)."""
    return Path(os.environ.get("BITRL_CACHE", Path.home() / ".cache" / "bitrl"))


def kernel_cache_root() -> Path:
    """Where compiled C++/CUDA libraries go: ``$BITRL_KERNEL_CACHE``, default ``cache_root() / "csrc"``.
    Each library's folder is named by the hash of its sources and flags, so one folder can serve runs with
    different caches (the GPU check builds once and its test suite, whose warm starts are isolated, reuses
    the build)."""
    return Path(os.environ.get("BITRL_KERNEL_CACHE") or cache_root() / "csrc")


try:  # Triton is optional: `import bitrl.kernels` must work without it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

IMPLS = ("triton", "torch", "reference")
ENV_IMPL = "BITRL_KERNEL_IMPL"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton path cannot run for tensors on ``device`` (``None`` when it can)."""
    if not HAS_TRITON:
        return f"triton is not importable ({TRITON_IMPORT_ERROR})"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpret():
        return None
    return f"triton kernels need CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 to interpret on CPU"


def resolve_impl(impl: str | None, device: torch.device, *, op: str, dtype: torch.dtype | None = None) -> str:
    """Pick the implementation for an op: explicit keyword, then ``BITRL_KERNEL_IMPL``, then by device.
    ``dtype``: the inputs' float dtype. The Triton kernels compute in fp32, so fp64 inputs take the torch path
    (computed in fp64) by default, and an explicit ``impl="triton"`` for them is an error."""
    explicit = impl is not None
    if impl is None:
        impl = os.environ.get(ENV_IMPL) or None
    if impl is None:
        if device.type == "cuda" and triton_unavailable_reason(device) is None and dtype != torch.float64:
            return "triton"
        return "torch"
    impl = str(impl).lower()
    if impl not in IMPLS:
        src = "impl" if explicit else ENV_IMPL
        raise ValueError(f"{src}: unknown implementation {impl!r} for {op}; choose one of {IMPLS}")
    if impl == "triton":
        if dtype == torch.float64:
            raise ValueError(f"{op}: impl='triton' computes in fp32; fp64 inputs run on impl='torch'")
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"{op}: impl='triton' was requested but {reason}")
    return impl


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | Iterable[int] | None = None,
    shape: tuple | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless ``t`` is a tensor with the given properties.

    ``shape`` entries may be ``None`` (any size).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(
                f"{name}: expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}"
            )
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{name}: expected device {ref.device} (the device of {ref_name}), got {t.device}"
            )


def compute_dtype(*tensors) -> torch.dtype:
    """fp64 when any input is fp64 (used by the fp64 references), else fp32."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` holds no NaN/inf; one reduction pass (aminmax propagates NaN), no temporaries."""
    if x.numel() == 0:
        return True
    if not x.is_floating_point():
        return True
    mn, mx = torch.aminmax(x)
    return bool(torch.isfinite(mn) & torch.isfinite(mx))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
