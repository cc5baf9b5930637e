import pytest
import torch

from bitrl.kernels.weight_major import (
    WEIGHT_MAJOR_BLOCK,
    WEIGHT_MAJOR_MAX_ROWS,
    WEIGHT_MAJOR_MIN_ROWS,
    use_weight_major,
    weight_major_linear,
)


def _product_fp64(x, weight):
    """x @ weight.T term by term in fp64 (broadcast products, then one sum per output)."""
    return (x.double()[:, None, :] * weight.double()[None, :, :]).sum(-1)


def _bound(x, weight):
    """|fp32 or lower result - exact| allowed per output: K products summed in any order, each operand's
    dtype rounding once at the end (first order)."""
    eps = torch.finfo(x.dtype).eps
    mass = x.double().abs() @ weight.double().abs().T
    return (x.shape[1] + 1) * eps * mass + eps * _product_fp64(x, weight).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_weight_major_linear_matches_the_product(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 70, (1,), generator=g))
    k = int(torch.randint(1, 90, (1,), generator=g))
    n = int(torch.randint(1, 400, (1,), generator=g))
    block = int(torch.randint(1, 130, (1,), generator=g))  # blocks that do not divide n
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = (3 * torch.randn(n, k, generator=g)).to(dtype)
    got = weight_major_linear(x, weight, block=block)
    assert got.shape == (rows, n) and got.dtype == dtype and got.is_contiguous()
    err = (got.double() - _product_fp64(x, weight)).abs()
    assert (err <= _bound(x, weight)).all(), f"max error {err.max().item()}"


def test_weight_major_linear_keeps_nan_and_inf_where_the_product_has_them():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 8, generator=g), torch.randn(300, 8, generator=g)
    x[1, 3] = float("nan")
    weight[17, 2] = float("inf")
    x[3] = 1e30  # huge: overflows to inf in fp32
    got = weight_major_linear(x, weight, block=64)
    want = x @ weight.T
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().all()
    assert torch.equal(got.isinf(), want.isinf()) and got.isinf().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)  # sums in another order


def test_weight_major_linear_of_no_rows_and_bad_operands():
    assert weight_major_linear(torch.empty(0, 4), torch.randn(9, 4), block=4).shape == (0, 9)
    with pytest.raises(ValueError, match="x \\[R, K\\] and weight \\[N, K\\]"):
        weight_major_linear(torch.randn(2, 4), torch.randn(9, 5))
    with pytest.raises(ValueError, match="x is torch.float32, weight torch.bfloat16"):
        weight_major_linear(torch.randn(2, 4), torch.randn(9, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block must be >= 1"):
        weight_major_linear(torch.randn(2, 4), torch.randn(9, 4), block=0)


def test_the_form_is_taken_for_a_cpu_fp32_head_without_autograd_only():
    head = torch.randn(WEIGHT_MAJOR_BLOCK + 1, 8)
    x = torch.randn(WEIGHT_MAJOR_MIN_ROWS, 8)
    assert use_weight_major(x, head)
    assert not use_weight_major(x[:-1], head)  # a few rows: not faster
    assert not use_weight_major(x.bfloat16(), head.bfloat16())  # emulated bf16: slower there
    assert not use_weight_major(x, head[:WEIGHT_MAJOR_BLOCK])  # one block: nothing to gain
    assert not use_weight_major(torch.randn(WEIGHT_MAJOR_MAX_ROWS + 1, 8), head)
    assert not use_weight_major(x[None], head)
    assert not use_weight_major(x.requires_grad_(), head)
    with torch.no_grad():
        assert use_weight_major(x, head)


def test_the_decoders_head_takes_the_form_and_gives_the_modules_logits():
    from conftest import TINY_QWEN, make_qwen

    from bitrl.rollout.decoder import Decoder

    model = make_qwen(**{**TINY_QWEN, "vocab_size": WEIGHT_MAJOR_BLOCK + 300})
    hidden = torch.randn(WEIGHT_MAJOR_MIN_ROWS + 3, 32)
    with torch.no_grad():
        assert use_weight_major(hidden, model.lm_head.weight)
        got = Decoder(model).logits(hidden)
        want = model.lm_head(hidden)
    err = (got.double() - _product_fp64(hidden, model.lm_head.weight)).abs()
    assert (err <= _bound(hidden, model.lm_head.weight)).all()
    torch.testing.assert_close(got, want)
