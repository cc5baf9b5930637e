import pytest
import torch

from bitrl.kernels.packed_linear import (
    pack_linear,
    packed_linear,
    packed_linear_reference,
    use_packed_linear,
)

ONEDNN = torch.backends.mkldnn.is_available()
BF16_UNITS = ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="packed products need a torch built with oneDNN")


def _dtypes():
    yield torch.float32
    yield pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not BF16_UNITS, reason="oneDNN packs bf16 only on CPUs with bf16 units"),
    )


def _bound(x, weights, dtype):
    """|result - exact| allowed per output: K products summed in any order in fp32, the result rounded once
    to `dtype`."""
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    mass = torch.cat([x.double().abs() @ w.double().abs().T for w in weights], dim=-1)
    exact = packed_linear_reference(x, weights)
    return (x.shape[-1] + 1) * eps32 * mass + eps * exact.abs() + 1e-30


@needs_onednn
@pytest.mark.parametrize("dtype", list(_dtypes()))
@pytest.mark.parametrize("seed", range(4))
def test_packed_linear_matches_the_products_of_each_weight(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows, k = int(torch.randint(0, 70, (1,), generator=g)), int(torch.randint(1, 90, (1,), generator=g))
    outs = [int(torch.randint(1, 200, (1,), generator=g)) for _ in range(int(torch.randint(1, 4, (1,))))]
    x = torch.randn(rows, k, generator=g).to(dtype)
    weights = [(3 * torch.randn(o, k, generator=g)).to(dtype) for o in outs]
    biases = [torch.randn(o, generator=g).to(dtype) if i % 2 == 0 else None for i, o in enumerate(outs)]
    got = packed_linear(x, pack_linear(weights, biases))
    assert got.shape == (rows, sum(outs)) and got.dtype == dtype
    want = packed_linear_reference(x, weights, biases)
    bias_err = torch.finfo(dtype).eps * want.abs()
    err = (got.double() - want).abs()
    assert (err <= _bound(x, weights, dtype) + bias_err).all(), f"max error {err.max().item()}"


@needs_onednn
@pytest.mark.parametrize("dtype", list(_dtypes()))
def test_packed_linear_of_tokens_and_strided_rows(dtype):
    """[R, T, K] inputs and inputs whose rows are a slice of a wider buffer give the 2-D product's values."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(33, 20, generator=g).to(dtype)
    packed = pack_linear([weight])
    x = torch.randn(3, 5, 20, generator=g).to(dtype)
    torch.testing.assert_close(
        packed_linear(x, packed), packed_linear(x.reshape(15, 20), packed).view(3, 5, 33)
    )
    wide = torch.randn(7, 50, generator=g).to(dtype)
    torch.testing.assert_close(
        packed_linear(wide[:, 10:30], packed), packed_linear(wide[:, 10:30].contiguous(), packed)
    )


@needs_onednn
@pytest.mark.parametrize("dtype", list(_dtypes()))
def test_packed_linear_keeps_nan_and_inf_where_the_product_has_them(dtype):
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 8, generator=g).to(dtype), torch.randn(40, 8, generator=g).to(dtype)
    x[1, 3] = float("nan")
    weight[17, 2] = float("inf")
    x[3] = torch.finfo(dtype).max / 4  # huge: most of its products overflow the dtype
    got = packed_linear(x, pack_linear([weight]))
    exact = packed_linear_reference(x, [weight])
    assert got[1].isnan().all() and torch.equal(got.isnan(), exact.isnan())
    overflow = exact.abs() > torch.finfo(dtype).max
    assert overflow[3].any() and got[overflow].isinf().all()
    assert got[:, 17].isinf()[[0, 2, 4]].all()  # the inf weight's column, in the rows without NaN


@needs_onednn
@pytest.mark.parametrize("dtype", list(_dtypes()))
def test_the_steps_fused_into_the_product_are_those_of_its_result(dtype):
    """silu(y), y + add and y * mul on the product's accumulator, rounded once: within one rounding of the
    dtype (plus the sum's) of the formula on the exact product; a NaN in add or mul reaches the output."""
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(9, 24, generator=g).to(dtype), torch.randn(40, 24, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    other = torch.randn(9, 40, generator=g).to(dtype)
    other[2, 5] = float("nan")
    packed = pack_linear([weight], [bias])
    exact = packed_linear_reference(x, [weight], [bias])
    bound = _bound(x, [weight], dtype) + torch.finfo(dtype).eps * exact.abs()
    for got, want, scale in (
        (packed_linear(x, packed, silu=True), exact * torch.sigmoid(exact), 1.1),
        (packed_linear(x, packed, add=other), exact + other.double(), 1.0),
        (packed_linear(x, packed, mul=other), exact * other.double(), other.double().abs()),
    ):
        assert got.dtype == dtype and got.shape == (9, 40)
        err = (got.double() - want).abs()
        ok = (err <= scale * bound + torch.finfo(dtype).eps * want.abs()) | (got.isnan() & want.isnan())
        assert ok.all(), f"max error {err[~ok].max().item()}"
    assert (
        packed_linear(x, packed, add=other)[2, 5].isnan()
        and packed_linear(x, packed, mul=other)[2, 5].isnan()
    )
    with pytest.raises(ValueError, match="at most one of silu, add, mul"):
        packed_linear(x, packed, silu=True, add=other)
    with pytest.raises(ValueError, match="add must be \\[9, 40\\]"):
        packed_linear(x, packed, add=other[:, :3])


@needs_onednn
def test_packed_weights_say_when_they_are_stale():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    packed = pack_linear([weight])
    assert packed.current([weight])
    with torch.no_grad():
        weight.mul_(2)  # a sync in place: the packed copy no longer holds these values
    assert not packed.current([weight])
    assert not pack_linear([torch.randn(6, 4)]).current([weight])


@needs_onednn
def test_packed_linear_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="CPU weights \\[O_i, 4\\] in torch.float32"):
        pack_linear([torch.randn(6, 4), torch.randn(3, 5)])
    with pytest.raises(ValueError, match="no packed torch.float16 product"):
        pack_linear([torch.randn(6, 4).half()])
    with pytest.raises(ValueError, match="2 weights and 1 biases"):
        pack_linear([torch.randn(6, 4), torch.randn(3, 4)], [None])
    packed = pack_linear([torch.randn(6, 4)])
    with pytest.raises(ValueError, match="x is torch.float64"):
        packed_linear(torch.randn(2, 4, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="x \\[..., 4\\] expected"):
        packed_linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="no autograd"):
        packed_linear(torch.randn(2, 4, requires_grad=True), packed)


def test_packed_products_are_taken_only_where_measured_faster():
    assert not use_packed_linear(torch.float16)
    assert not use_packed_linear(torch.float32, "meta")
    capability = torch.backends.cpu.get_cpu_capability()
    assert use_packed_linear(torch.float32) == (ONEDNN and capability.startswith("AVX512"))
    assert use_packed_linear(torch.bfloat16) == BF16_UNITS
