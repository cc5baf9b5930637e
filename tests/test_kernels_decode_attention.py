"""Attention over the KV cache in its stored dtype (`bitrl.kernels.decode_attention`): the Triton kernel
(interpreted on CPU, compiled on CUDA) against the fp64 reference for fp32/bf16/fp16 queries over fp8 and
same-dtype caches, grouped-query layouts, one and several new tokens, random and hostile inputs; the
reference against ``F.scaled_dot_product_attention`` on the dequantized cache; and, on a GPU, the compiled
kernel and an fp8-cache rollout that goes through it."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernels_helpers import needs_triton, triton_device

from bitrl.kernels.decode_attention import (
    BLOCK_M,
    HOST_DTYPES,
    decode_attention,
    decode_attention_reference,
)

FP8 = torch.float8_e4m3fn
QUERY_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# |kernel - fp64 reference| allowed on top of the output's own rounding: the kernel rounds p to bf16 / fp16
# before the product with V (as FlashAttention does), so about one ulp of the query dtype times max |v|
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _case(seed, q_dtype, kv_dtype, *, rows, kv_heads, group, steps, dim, width, columns, per_query_mask):
    """Inputs laid out as the decoder lays them out: q a [R, kv_heads, group * T, d] view of [R, T, heads,
    d] projections (not contiguous), K/V a cache wider than the attended width, the mask a view of a wider
    buffer."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(rows, steps, heads, dim, generator=g).transpose(1, 2).to(q_dtype)
    q = q.reshape(rows, kv_heads, group * steps, dim)
    k = (torch.randn(rows, kv_heads, columns, dim, generator=g) * 2).to(kv_dtype)
    v = (torch.randn(rows, kv_heads, columns, dim, generator=g) * 2).to(kv_dtype)
    mask_rows = group * steps if per_query_mask else steps
    keep = torch.rand(rows, mask_rows, columns + 3, generator=g) < torch.rand(1, generator=g) * 0.8 + 0.1
    visible = keep[:, :, :width]
    return q, k, v, visible


def _assert_close_to_reference(out, q, k, v, visible, scale):
    ref = decode_attention_reference(q, k, v, visible, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    vmax = float(v[:, :, : visible.shape[-1]].float().nan_to_num(0.0).abs().max())
    atol = ULP[q.dtype] * vmax + 1e-6
    torch.testing.assert_close(out[finite].double(), ref[finite].double(), atol=atol, rtol=ULP[q.dtype])


SHAPES = [  # rows, kv_heads, group, steps (T), head_dim, width, columns
    (1, 1, 1, 1, 16, 1, 1),
    (3, 2, 1, 1, 32, 70, 80),  # three key tiles, a ragged last one
    (2, 1, 3, 1, 24, 37, 64),  # GQA group 3, head_dim not a power of two
    (2, 2, 3, 4, 16, 50, 50),  # T = 4 new tokens (a draft being verified)
    (1, 1, 3, 7, 16, 40, 41),  # 21 query rows: two query blocks
]


@needs_triton
@pytest.mark.parametrize("q_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("fp8_cache", [True, False], ids=["fp8-cache", "same-dtype-cache"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}h{}g{}T{}d{}W{}".format(*s[:6]))
def test_kernel_matches_the_reference(q_dtype, fp8_cache, shape):
    _check_shape_against_the_reference(q_dtype, fp8_cache, shape, triton_device(), "triton")


def _check_shape_against_the_reference(q_dtype, fp8_cache, shape, device, impl):
    """decode_attention(impl=impl) on `device` against the reference, per-token and per-query masks."""
    rows, kv_heads, group, steps, dim, width, columns = shape
    for per_query_mask in (False, True) if group > 1 else (False,):
        q, k, v, visible = _case(
            sum(shape) + per_query_mask,
            q_dtype,
            FP8 if fp8_cache else q_dtype,
            rows=rows,
            kv_heads=kv_heads,
            group=group,
            steps=steps,
            dim=dim,
            width=width,
            columns=columns,
            per_query_mask=per_query_mask,
        )
        q, k, v, visible = (t.to(device) for t in (q, k, v, visible))
        scale = dim**-0.5
        out = decode_attention(q, k, v, visible, scale, impl=impl)
        _assert_close_to_reference(out.cpu(), q.cpu(), k.cpu(), v.cpu(), visible.cpu(), scale)


@needs_triton
@pytest.mark.parametrize("q_dtype", QUERY_DTYPES)
def test_hostile_values_show_or_stay_finite_as_the_reference_says(q_dtype):
    """NaN in a query row, in a visible key and in a value column; huge scores (a one-hot softmax); rows that
    see nothing (0, never NaN). The kernel's NaN pattern is the reference's, the rest matches it."""
    dev = triton_device()
    rows, kv_heads, group, steps, dim, width = 4, 1, 3, 2, 16, 40
    q, k, v, visible = _case(
        7,
        torch.float32,
        torch.float32,
        rows=rows,
        kv_heads=kv_heads,
        group=group,
        steps=steps,
        dim=dim,
        width=width,
        columns=width,
        per_query_mask=False,
    )
    visible = visible.clone()
    visible[:, :, 0] = True
    q[0, 0, 1] = math.nan  # one query row of row 0
    k[1, 0, 5] = math.nan  # a key of row 1: the query rows that see column 5
    visible[1, 0, 5], visible[1, 1, 5] = True, False
    v[2, 0, 9] = math.nan  # a value of row 2: every row multiplies it (0 * NaN included)
    visible[3, 1] = False  # token 1 of row 3 sees nothing: its three query rows give 0
    q[3] *= 3e3  # scores ~1e5 with keys at the fp8 maximum: a one-hot softmax
    k[3, 0] = torch.sign(k[3, 0]) * 448
    q, k, v = q.to(q_dtype), k.to(FP8), v.to(FP8)
    q, k, v, visible = (t.to(dev) for t in (q, k, v, visible))
    out = decode_attention(q, k, v, visible, dim**-0.5, impl="triton").cpu()
    q, k, v, visible = (t.cpu() for t in (q, k, v, visible))
    nan = out.isnan().any(-1)  # [R, 1, M]
    assert nan[0, 0].tolist() == [False, True, False, False, False, False]  # query row 1 only
    assert nan[1, 0].tolist() == [True, False] * 3  # token 0 sees the NaN key, token 1 does not
    assert nan[2].all() and not nan[3].any()
    assert (out[3, 0, 1::2] == 0).all()  # rows that see nothing
    assert torch.isfinite(out[3]).all()
    _assert_close_to_reference(out, q, k, v, visible, dim**-0.5)


@needs_triton
def test_a_rows_output_depends_neither_on_its_batch_nor_on_masked_columns():
    """Key tiles in a fixed order from column 0, one program per (row, KV head): a row's output has the same
    bits alone or among other rows, for one or several new tokens of other rows, and with more (masked)
    columns behind it."""
    dev = triton_device()
    q, k, v, visible = _case(
        3,
        torch.bfloat16,
        FP8,
        rows=3,
        kv_heads=2,
        group=3,
        steps=1,
        dim=32,
        width=60,
        columns=200,
        per_query_mask=False,
    )
    q, k, v, visible = (t.to(dev) for t in (q, k, v, visible))
    scale = 32**-0.5
    batch = decode_attention(q, k, v, visible, scale, impl="triton")
    alone = decode_attention(q[1:2], k[1:2], v[1:2], visible[1:2], scale, impl="triton")
    wider = torch.zeros(3, 1, 200, dtype=torch.bool, device=dev)
    wider[:, :, :60] = visible
    more_columns = decode_attention(q, k, v, wider, scale, impl="triton")
    assert torch.equal(batch[1], alone[0]) and torch.equal(batch, more_columns)


def _needs_host():
    from bitrl.kernels.host_ext import load_host_library

    if load_host_library() is None:
        pytest.skip("no C++ compiler here (or BITRL_HOST_EXT=0): the CPU path is SDPA")


HOST_SHAPES = [s for s in SHAPES if s[4] % 16 == 0] + [(2, 1, 3, 1, 64, 37, 64)]


@pytest.mark.parametrize("q_dtype", HOST_DTYPES)
@pytest.mark.parametrize("fp8_cache", [True, False], ids=["fp8-cache", "same-dtype-cache"])
@pytest.mark.parametrize("shape", HOST_SHAPES, ids=lambda s: "R{}h{}g{}T{}d{}W{}".format(*s[:6]))
def test_host_kernel_matches_the_reference(q_dtype, fp8_cache, shape):
    """The CPU path (csrc/attention_host.cc) against the fp64 reference."""
    _needs_host()
    _check_shape_against_the_reference(q_dtype, fp8_cache, shape, "cpu", "torch")


@pytest.mark.parametrize("q_dtype", HOST_DTYPES)
def test_host_kernel_shows_nan_and_gives_zero_where_nothing_is_seen(q_dtype):
    _needs_host()
    q, k, v, visible = _case(
        5,
        torch.float32,
        torch.float32,
        rows=4,
        kv_heads=1,
        group=3,
        steps=2,
        dim=16,
        width=40,
        columns=40,
        per_query_mask=False,
    )
    visible = visible.clone()
    visible[:, :, 0] = True
    q[0, 0, 1] = math.nan
    k[1, 0, 5] = math.nan
    visible[1, 0, 5], visible[1, 1, 5] = True, False
    v[2, 0, 9] = math.nan
    visible[3, 1] = False
    q[3] *= 3e3  # a one-hot softmax
    q, k, v = q.to(q_dtype), k.to(q_dtype), v.to(q_dtype)
    out = decode_attention(q, k, v, visible, 0.25, impl="torch")
    nan = out.isnan().any(-1)
    assert nan[0, 0].tolist() == [False, True, False, False, False, False]
    assert nan[1, 0].tolist() == [True, False] * 3
    assert nan[2].all() and not nan[3].any()
    assert (out[3, 0, 1::2] == 0).all()
    _assert_close_to_reference(out, q, k, v, visible, 0.25)


@pytest.mark.parametrize("q_dtype", HOST_DTYPES)
def test_host_kernel_bits_depend_only_on_the_query_and_what_it_sees(q_dtype):
    """A query's output has the same bits alone or among other rows, as one of several new tokens or as the
    only one, and with more (masked) columns behind it: the property a batch-invariant decoder needs."""
    _needs_host()
    q, k, v, visible = _case(
        9,
        q_dtype,
        q_dtype,
        rows=5,
        kv_heads=2,
        group=3,
        steps=4,
        dim=32,
        width=60,
        columns=90,
        per_query_mask=False,
    )
    scale = 32**-0.5
    batch = decode_attention(q, k, v, visible, scale, impl="torch")
    alone = decode_attention(q[2:3], k[2:3], v[2:3], visible[2:3], scale, impl="torch")
    wider = torch.zeros(5, 4, 90, dtype=torch.bool)
    wider[:, :, :60] = visible
    more_columns = decode_attention(q, k, v, wider, scale, impl="torch")
    assert torch.equal(batch[2], alone[0]) and torch.equal(batch, more_columns)
    # token t of 4 (query rows g * 4 + t) against token t fed alone (query rows g)
    per_token = q.view(5, 2, 3, 4, 32)
    for t in range(4):
        one = decode_attention(per_token[:, :, :, t].contiguous(), k, v, visible[:, t : t + 1], scale)
        assert torch.equal(one, batch.view(5, 2, 3, 4, 32)[:, :, :, t])


@pytest.mark.parametrize("q_dtype", [torch.float64, torch.float32])
def test_reference_equals_sdpa_on_the_dequantized_cache(q_dtype):
    """The reference (written out elementwise) against torch's SDPA on the cache cast to fp64, the GQA
    layout expanded to one head per query head, rows that see nothing included (0 in both)."""
    rows, kv_heads, group, steps, dim, width = 3, 2, 3, 2, 16, 45
    q, k, v, visible = _case(
        11,
        q_dtype,
        FP8,
        rows=rows,
        kv_heads=kv_heads,
        group=group,
        steps=steps,
        dim=dim,
        width=width,
        columns=50,
        per_query_mask=False,
    )
    visible = visible.clone()
    visible[0, 1] = False
    scale = 0.3
    ref = decode_attention_reference(q, k, v, visible, scale)
    # query head h = j * group + g, token t: [R, heads, T, d] against [R, heads, W, d] K/V
    qh = q.double().reshape(rows, kv_heads * group, steps, dim)
    kh = k[:, :, :width].double().repeat_interleave(group, dim=1)
    vh = v[:, :, :width].double().repeat_interleave(group, dim=1)
    sdpa = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[:, None], scale=scale)
    torch.testing.assert_close(ref.double().reshape_as(sdpa), sdpa, atol=1e-6, rtol=1e-6)
    assert (ref[0, :, 1::2] == 0).all()  # token 1 of row 0 sees nothing: 0 in both
    torch_path = decode_attention(q, k, v, visible, scale, impl="torch")
    torch.testing.assert_close(torch_path, ref, atol=1e-5, rtol=1e-5)


def test_arguments_are_checked():
    q = torch.randn(2, 1, 3, 16)
    k = torch.zeros(2, 1, 8, 16, dtype=FP8)
    visible = torch.ones(2, 3, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="k_cache"):
        decode_attention(q, k.to(torch.bfloat16), k, visible, 1.0, impl="torch")
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q, k, k.float(), visible, 1.0, impl="torch")
    with pytest.raises(ValueError, match="visible"):
        decode_attention(q, k, k, torch.ones(2, 2, 8, dtype=torch.bool), 1.0, impl="torch")
    with pytest.raises(ValueError, match="columns"):
        decode_attention(q, k, k, torch.ones(2, 3, 9, dtype=torch.bool), 1.0, impl="torch")
    with pytest.raises(ValueError, match="fp32"):
        decode_attention(q.double(), k, k, visible, 1.0, impl="triton")
    assert BLOCK_M == 16


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled Triton kernel)")
@pytest.mark.parametrize(
    "q_dtype,steps", [(torch.bfloat16, 1), (torch.bfloat16, 4), (torch.float16, 1), (torch.float32, 4)]
)
def test_compiled_kernel_matches_the_reference_on_cuda(q_dtype, steps):  # pragma: no cover - GPU only
    """Qwen2-0.5B's attention shape (2 KV heads, group 7, head_dim 64) and a 128-wide head, over an fp8
    cache of 300 attended columns in a wider buffer, one and four new tokens (8 compiles: the GPU check
    gives this file 30 s)."""
    for kv_heads, group, dim in ((2, 7, 64), (1, 4, 128)):
        q, k, v, visible = _case(
            steps + dim,
            q_dtype,
            FP8,
            rows=5,
            kv_heads=kv_heads,
            group=group,
            steps=steps,
            dim=dim,
            width=300,
            columns=512,
            per_query_mask=False,
        )
        visible[:, :, 0] = True
        q, k, v, visible = (t.cuda() for t in (q, k, v, visible))
        out = decode_attention(q, k, v, visible, dim**-0.5)  # the default on CUDA: the kernel
        _assert_close_to_reference(out.cpu(), q.cpu(), k.cpu(), v.cpu(), visible.cpu(), dim**-0.5)
        q[0, 0, 0] = math.nan
        assert decode_attention(q, k, v, visible, dim**-0.5)[0, 0, 0].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (an fp8-cache rollout)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_fp8_cache_rollout_on_cuda_reads_the_cache_in_the_kernel(tiny_qwen, monkeypatch, compiled):
    """kv_cache_dtype="fp8" on CUDA: every layer's attention goes through the kernel (eager and in the
    compiled step), and the samples' log-probs stay close to the bf16 policy's (GPU only)."""
    import bitrl.rollout.decoder as decoder
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import EngineOptions, Sampling
    from bitrl.train.logprobs import token_logprobs

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].dtype)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(decoder, "decode_attention", spy)
    torch._dynamo.reset()
    policy = tiny_qwen.cuda().to(torch.bfloat16)
    options = EngineOptions(kv_cache_dtype="fp8", compile=compiled)
    sampling = Sampling(max_new_tokens=8, eos_id=2, pad_id=0)
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]] * 4
    r = RolloutEngine(policy, sampling, options).generate(prompts, generator=torch.Generator())
    assert calls and set(calls) == {FP8}
    m = r.response_mask
    assert m.any() and torch.isfinite(r.logprobs[m]).all()
    with torch.no_grad():
        train, _ = token_logprobs(policy, r)
    k3 = (train - r.logprobs).exp() - (train - r.logprobs) - 1
    assert float(k3[m].mean()) < 0.5, float(k3[m].mean())
