"""Shared helpers for the kernel tests (imported by tests/test_kernels_*.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bitrl.kernels._common import triton_unavailable_reason

LOW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

needs_triton = pytest.mark.skipif(
    triton_unavailable_reason(torch.device("cpu")) is not None
    and not (torch.cuda.is_available() and triton_unavailable_reason(torch.device("cuda")) is None),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (and triton installed)",
)


def triton_device() -> torch.device:
    if torch.cuda.is_available() and triton_unavailable_reason(torch.device("cuda")) is None:
        return torch.device("cuda")
    return torch.device("cpu")


def max_err(x, ref) -> float:
    if x is None and ref is None:
        return 0.0
    return float((x.detach().double() - ref.detach().double()).abs().max()) if ref.numel() else 0.0


def assert_as_accurate(fused, unfused, ref64, *, atol: float, rtol: float = 0.0, what: str = ""):
    """The numerics contract: |fused - ref64| <= |unfused - ref64| + tol (max-abs over the tensor)."""
    if ref64 is None:
        return
    scale = float(ref64.detach().double().abs().max()) if ref64.numel() else 0.0
    tol = atol + rtol * scale
    ef, eu = max_err(fused, ref64), max_err(unfused, ref64)
    assert ef <= eu + tol, f"{what}: fused error {ef:.3e} > unfused error {eu:.3e} + tol {tol:.3e}"


def assert_close(x, ref, *, atol: float, rtol: float = 0.0, what: str = ""):
    scale = float(ref.detach().double().abs().max()) if ref.numel() else 0.0
    e = max_err(x, ref)
    assert e <= atol + rtol * scale, f"{what}: error {e:.3e} > {atol + rtol * scale:.3e}"


class LargeFp32Storages(TorchDispatchMode):
    """Records the distinct storages of more than ``limit`` bytes behind the fp32 tensors any aten op
    returns (allocations, views and in-place results alike)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.sizes = limit, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                st = t.untyped_storage()
                if st.nbytes() > self.limit:
                    self.sizes[st.data_ptr()] = st.nbytes()
        return out


class LargestFp32Tensor(TorchDispatchMode):
    """Records the largest fp32 tensor any aten op returns (allocations included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out
