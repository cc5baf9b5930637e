"""The Triton quantize/dequantize kernels against the torch reference, bit for bit (TRITON_INTERPRET=1
on CPU)."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitrl.kernels import quantize as kq
from bitrl.quant import FORMATS, quantize

needs_triton = pytest.mark.skipif(
    not kq.HAS_TRITON
    or (os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available()),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
pytestmark = needs_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    ("mxfp4", {}),
    ("mxfp4", {"scale_mode": "rceil"}),
    ("mxfp8", {}),
    ("mxfp8", {"scale_mode": "rceil"}),
    ("nvfp4", {}),
    ("fp8_e4m3", {"block_size": 128}),
    ("fp8_e5m2", {"block_size": 32}),
    ("mxfp4", {"block_size": 64}),
]


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same(a, b):
    assert torch.equal(_raw(a.data), _raw(b.data))
    assert torch.equal(_raw(a.scale), _raw(b.scale))
    if a.tensor_scale is not None:
        assert torch.equal(a.tensor_scale, b.tensor_scale)


def _special(cols):
    """Rows that hit the edge cases: zero row, tiny and huge amax, exact ties, saturation, mixed scales."""
    rows = [
        torch.zeros(cols),
        torch.full((cols,), 1e-40),
        torch.linspace(-1.0, 1.0, cols) * 3.0e38,
        torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * (cols // 8 + 1))[:cols],
        torch.tensor([448.0, 464.0, 2.0**-10, -17.0] * (cols // 4 + 1))[:cols],
        torch.randn(cols) * 10.0 ** torch.randint(-20, 20, (cols,)).float(),
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("fmt,kw", CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in CASES])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("cols", [7, 64, 133])
def test_quantize_bit_exact(fmt, kw, rounding, cols):
    torch.manual_seed(cols)
    x = torch.cat([torch.randn(3, cols) * 4, _special(cols)]).to(DEV)
    a = quantize(x, fmt, rounding=rounding, seed=3, backend="torch", **kw)
    b = quantize(x, fmt, rounding=rounding, seed=3, backend="triton", **kw)
    _assert_same(a, b)
    assert torch.equal(a.dequantize(backend="torch"), a.dequantize(backend="triton"))
    # bf16 output is the kernel's store conversion; the CPU interpreter does not round float32 -> bf16 like
    # torch at the ends of the range (subnormals, ~3e38), so compare to one bf16 ulp in the normal range
    ref16, tri16 = (
        a.dequantize(torch.bfloat16, backend="torch"),
        a.dequantize(torch.bfloat16, backend="triton"),
    )
    normal = a.dequantize(backend="torch").abs() >= 2.0**-126
    torch.testing.assert_close(tri16[normal].float(), ref16[normal].float(), rtol=2.0**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input(dtype):
    x = (torch.randn(4, 96) * 3).to(dtype).to(DEV)
    for fmt in ("mxfp4", "nvfp4", "mxfp8"):
        _assert_same(quantize(x, fmt, backend="torch"), quantize(x, fmt, backend="triton"))


def test_3d_input_and_rejects_2d_blocks():
    x = torch.randn(2, 3, 40, device=DEV)
    a, b = quantize(x, "mxfp4", backend="torch"), quantize(x, "mxfp4", backend="triton")
    _assert_same(a, b)
    assert b.dequantize(backend="triton").shape == x.shape
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.randn(4, 8), "fp8_e4m3", block_size=(2, 4), backend="triton")


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    fmt=st.sampled_from(["mxfp4", "mxfp8", "nvfp4"]),
    rows=st.integers(1, 3),
    cols=st.integers(1, 70),
    log_scale=st.integers(-40, 40),
    seed=st.integers(0, 1000),
)
def test_bit_exact_property(fmt, rows, cols, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 2.0**log_scale).to(DEV)
    a, b = quantize(x, fmt, backend="torch"), quantize(x, fmt, backend="triton")
    _assert_same(a, b)
    assert torch.equal(a.dequantize(backend="torch"), b.dequantize(backend="triton"))


def test_formats_cover_all():
    assert {f for f, _ in CASES} == set(FORMATS)


def test_pack_unpack_kernels():
    from bitrl.quant import reference as ref

    codes = torch.randint(0, 16, (3, 5, 70), dtype=torch.uint8, device=DEV)
    packed = kq.pack_fp4_triton(codes)
    assert torch.equal(packed.cpu(), ref.pack_fp4(codes.cpu()))
    assert torch.equal(kq.unpack_fp4_triton(packed), codes)
    with pytest.raises(ValueError, match="codes"):
        kq.pack_fp4_triton(codes[..., :3])
