"""The GPU-only code paths, checked as far as a CPU allows: the FP8 ``_scaled_mm`` call's dtype contract, the
LM-head finiteness check without a per-call scan of the weight, what the dequantize-and-cache path holds, the
native FP4 ``dot_scaled`` GEMM (interpreted on CPU for the MX recipes), and the GPU comparisons where a
device exists."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bitrl.kernels import fp4_gemm, qmatmul
from bitrl.quant import QuantLinear, fake_quantize, quantize

interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# ------------------------------------------------------------------------------------------ FP8 _scaled_mm


def strict_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype=None):
    """torch._scaled_mm's documented contract for row-wise scales, computed in fp32 on CPU: bf16 output
    only, and a bias of the output's dtype."""
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
    if rowwise and out_dtype != torch.bfloat16:
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
    if bias is not None and bias.dtype != out_dtype:
        raise RuntimeError(f"Bias must be {out_dtype} to compute output of type {out_dtype}")
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_scaled_mm_meets_the_row_wise_contract(monkeypatch, dtype, with_bias):
    monkeypatch.setattr(torch, "_scaled_mm", strict_scaled_mm)
    monkeypatch.setattr(qmatmul, "scaled_mm_unavailable_reason", lambda device: None)
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=with_bias).to(dtype)
    q = QuantLinear.from_linear(lin, "fp8_e4m3")
    x = torch.randn(5, 64).to(dtype)
    bias = None if q.bias is None else q.bias.to(dtype)
    out = qmatmul.fp8_scaled_mm(x, q.qdata, q.qscale, bias=bias, out_dtype=dtype)
    assert out.dtype == dtype
    xq = fake_quantize(x.float(), "fp8_e4m3", granularity="row")
    ref = F.linear(xq, q.dequantized_weight(torch.float32), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)  # the matmul rounds to bf16 once


def test_scaled_mm_output_keeps_an_fp32_bias_out_of_the_bf16_matmul():
    b = torch.randn(8)
    assert qmatmul.scaled_mm_output(torch.float32, b) == (torch.bfloat16, None)
    mm_dtype, fused = qmatmul.scaled_mm_output(torch.bfloat16, b)
    assert mm_dtype == torch.bfloat16 and fused.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or qmatmul.scaled_mm_unavailable_reason(torch.device("cuda")) is not None,
    reason="needs a CUDA device with FP8 tensor cores (compute capability >= 8.9)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_scaled_mm_on_gpu_with_fp32_model_and_bias(dtype):  # pragma: no cover - GPU only
    lin = nn.Linear(128, 64).cuda().to(dtype)
    q = QuantLinear.from_linear(lin, "fp8_e4m3")
    x = torch.randn(16, 128, device="cuda", dtype=dtype)
    assert q.execution_path(x) == "scaled_mm"
    ref = F.linear(fake_quantize(x, "fp8_e4m3", granularity="row"), q.dequantized_weight(), q.bias)
    torch.testing.assert_close(q(x), ref, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------ finiteness


def test_fused_logprobs_does_not_scan_the_lm_head_per_call(monkeypatch):
    import importlib

    flp = importlib.import_module("bitrl.kernels.fused_logprobs.op")  # where all_finite is called
    scanned = []
    real = flp.all_finite
    monkeypatch.setattr(flp, "all_finite", lambda t: scanned.append(t.numel()) or real(t))
    h, w = torch.randn(6, 16), torch.randn(300, 16)
    y = torch.randint(0, 300, (6,))
    flp.fused_logprobs(h, w, y, impl="torch")
    assert scanned and max(scanned) <= 6, scanned  # only the [N] outputs
    w_bad = w.clone()
    w_bad[123, 4] = float("inf")
    with pytest.raises(ValueError, match="weight"):
        flp.fused_logprobs(h, w_bad, y, impl="torch")
    h_bad = h.clone()
    h_bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match="hidden"):
        flp.fused_logprobs(h_bad, w, y, impl="torch")


# ------------------------------------------------------------------------------------------ memory


def test_dequantize_and_cache_path_holds_more_than_the_dense_layer():
    lin = nn.Linear(256, 128, bias=False)
    dense = lin.weight.numel() * lin.weight.element_size()
    for fmt in ("mxfp8", "mxfp4"):
        q = QuantLinear.from_linear(lin, fmt)
        assert q.resident_bytes() < dense  # packed only, before any forward
        q(torch.randn(2, 256))
        assert q.execution_path(torch.randn(2, 256)) == "dequant_matmul"
        assert q.resident_bytes() > dense, fmt  # + the cached fp32 copy: no memory saved


# ------------------------------------------------------------------------------------------ native FP4


def _emulated(recipe, x, w):
    w_fmt, a_fmt = {
        "mxfp4_mxfp4": ("mxfp4", "mxfp4"),
        "mxfp4_mxfp8": ("mxfp4", "mxfp8"),
        "nvfp4_nvfp4": ("nvfp4", "nvfp4"),
    }[recipe]
    qa, qw = quantize(x, a_fmt), quantize(w, w_fmt)
    return qa, qw, qa.dequantize() @ qw.dequantize().T


# Triton's interpreter reads every dot_scaled scale byte as E8M0, so it cannot run the NVFP4 recipe (E4M3
# block scales): that one is compiled in tests/test_gpu_compile.py and compared on Blackwell below.
@pytest.mark.skipif(not interpret, reason="interprets the dot_scaled kernel on CPU (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("recipe", ["mxfp4_mxfp4", "mxfp4_mxfp8"])
@pytest.mark.parametrize("m,n,k", [(3, 20, 128), (130, 129, 256)])
def test_fp4_dot_scaled_interpreted_matches_emulated(recipe, m, n, k):
    torch.manual_seed(m + n)
    qa, qw, ref = _emulated(recipe, torch.randn(m, k), torch.randn(n, k))
    out = fp4_gemm.fp4_gemm(qa.data, qa.scale, qw.data, qw.scale, recipe=recipe, k=k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_fp4_native_path_is_blackwell_only():
    assert interpret or "CUDA" in fp4_gemm.native_unavailable_reason(torch.device("cpu"))
    q = QuantLinear.from_linear(nn.Linear(64, 32), "mxfp4", act="mxfp4")
    assert q.execution_path(torch.randn(1, 64)) == "dequant_matmul"  # emulated off Blackwell
    with pytest.raises(ValueError, match="recipe"):
        fp4_gemm.fp4_gemm(q.qdata, q.qscale, q.qdata, q.qscale, recipe="int4", k=64)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10,
    reason="needs a Blackwell GPU (compute capability >= 10.0) for block-scaled FP4 tensor cores",
)
@pytest.mark.parametrize("recipe", sorted(fp4_gemm.RECIPES))
def test_fp4_native_on_blackwell_matches_emulated(recipe):  # pragma: no cover - GPU only
    torch.manual_seed(0)
    qa, qw, ref = _emulated(
        recipe, torch.randn(300, 512, device="cuda"), torch.randn(260, 512, device="cuda")
    )
    ts = None if qa.tensor_scale is None else (qa.tensor_scale * qw.tensor_scale).reshape(1)
    out = fp4_gemm.fp4_gemm(qa.data, qa.scale, qw.data, qw.scale, recipe=recipe, k=512, tensor_scale=ts)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (> 2**31-element tensors)")
def test_pack_beyond_int32_offsets_on_gpu():  # pragma: no cover - GPU only
    from bitrl.kernels.quantize import pack_fp4_triton

    n = 2**31 + 64
    codes = torch.zeros(n, dtype=torch.uint8, device="cuda")
    codes[-2:] = torch.tensor([3, 5], dtype=torch.uint8, device="cuda")
    packed = pack_fp4_triton(codes)
    assert int(packed[-1]) == 3 | (5 << 4) and int(packed[:-1].max()) == 0


# ------------------------------------------------------------------------------------------ bf16 loss memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fp32-output GEMMs)")
def test_bf16_loss_keeps_one_fp32_weight_gradient():  # pragma: no cover - GPU only
    """bf16 GRPO loss over 8 token chunks: the weight gradient accumulates in one fp32 [V, H] buffer by
    GEMMs that add into it, and the logits come out of the GEMM in fp32 (no fresh fp32 [V, H] product per
    chunk, no copy of each chunk's logits). Peak: that accumulator, the bf16 result, the chunk workspace."""
    from bitrl.kernels import fused_linear_policy_loss

    N, H, V, chunk = 2048, 4096, 32768, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(1, N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, V, (1, N), device="cuda", generator=g)
    old = torch.full((1, N), -10.0, device="cuda")
    adv = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, _ = fused_linear_policy_loss(h, w, y, old, adv, chunk_size=chunk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    fp32_vh, bf16_vh, dh = V * H * 4, V * H * 2, N * H * 2
    workspace = 4 * chunk * V * 4  # logits, their bf16 gradient, slack
    # 976 MiB; a fresh fp32 product per chunk would add 512 MiB on top of the accumulator
    assert extra <= fp32_vh + bf16_vh + dh + workspace + 64 * 2**20, extra / 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton row kernels)")
def test_fused_logprobs_at_a_real_vocabulary_on_cuda():  # pragma: no cover - GPU only
    """Qwen's vocabulary (V = 151936: 38 tiles of the row kernels, a ragged last one) in bf16, against the
    fp64 formula from the same bf16 inputs: log-probs, entropies and both gradients."""
    from bitrl.kernels import fused_logprobs

    N, H, V = 256, 896, 151936
    g = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    lp, ent = fused_logprobs(h, w, y, temperature=0.7)
    (lp.sum() + 0.5 * ent.sum()).backward()
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ w64.T / 0.7, -1)
    lp64, ent64 = logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    # bf16 logits (one rounding of |z| <= ~10 / T, u = 2^-8) bound every output to a few 1e-2
    torch.testing.assert_close(lp.double(), lp64, atol=0.1, rtol=0.02)
    torch.testing.assert_close(ent.double(), ent64, atol=0.1, rtol=0.02)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 0.02, rel
