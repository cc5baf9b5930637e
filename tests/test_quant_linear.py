"""QuantLinear, quantize_model and requantize_ on a small Hugging Face model."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import count_host_syncs, make_qwen
from torch import nn

from bitrl.kernels import qmatmul
from bitrl.kernels._common import triton_unavailable_reason
from bitrl.quant import FORMATS, fake_quantize, quantize
from bitrl.quant.linear import QuantLinear, quantize_model, requantize_

transformers = pytest.importorskip("transformers")


def tiny_qwen(seed=0, tie=True):
    return make_qwen(
        seed,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantlinear_cpu_path_equals_dequantized_matmul(fmt):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = QuantLinear.from_linear(lin, fmt, act=None)
    x = torch.randn(3, 5, 64)
    assert q.execution_path(x) == "dequant_matmul"
    w = quantize(lin.weight.detach(), fmt, **q.quant_kwargs).dequantize()
    assert torch.equal(q(x), F.linear(x, w, lin.bias.detach()))
    assert q.qdata.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def test_dequantized_weight_is_cached_per_version():
    lin = nn.Linear(32, 16, bias=False)
    q = QuantLinear.from_linear(lin, "mxfp4")
    w1 = q.dequantized_weight()
    assert q.dequantized_weight() is w1
    w1_values = w1.clone()
    new = torch.randn(16, 32)
    q.set_weight(new)
    w2 = q.dequantized_weight()
    assert q.weight_version == 2 and w2 is w1  # refreshed in place
    assert not torch.equal(w2, w1_values) and torch.equal(w2, quantize(new, "mxfp4").dequantize())
    with pytest.raises(ValueError, match="weight"):
        q.set_weight(torch.randn(16, 31))
    with pytest.raises(ValueError, match="NaN"):
        q.set_weight(torch.full((16, 32), float("nan")))
    with pytest.raises(ValueError, match="act"):
        QuantLinear.from_linear(lin, "mxfp4", act="int8")


@pytest.mark.parametrize("fmt,act", [("fp8_e4m3", "auto"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")])
def test_activation_quantization(fmt, act):
    torch.manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    q = QuantLinear.from_linear(lin, fmt, act=act)
    x = torch.randn(4, 64)
    a_fmt = "fp8_e4m3" if act == "auto" else act
    kw = {"granularity": "row"} if a_fmt == "fp8_e4m3" else {}
    xq = fake_quantize(x, a_fmt, **kw)
    assert not torch.equal(xq, x)
    assert torch.equal(q(x), F.linear(xq, q.dequantized_weight()))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp4", "nvfp4"])
def test_a_quantized_activation_forward_reads_nothing_back_to_the_host(fmt):
    """W8A8 / W4A4 forwards quantize activations with check_finite=False: no host read of a value (each would
    be a device sync and a graph break per layer per decode step on a GPU)."""
    q = QuantLinear.from_linear(nn.Linear(64, 32, bias=False), fmt, act="auto" if fmt == "fp8_e4m3" else fmt)
    x = torch.randn(4, 64)
    with count_host_syncs() as syncs:
        q(x)
    assert syncs.count == 0, syncs.ops
    if fmt != "fp8_e4m3" and triton_unavailable_reason(x.device) is None:  # the Triton path (1-D blocks)
        with count_host_syncs() as syncs:
            quantize(x, fmt, backend="triton", check_finite=False)
        assert syncs.count == 0, syncs.ops
    with count_host_syncs() as syncs:  # the checked entry point reads one flag, and says so
        quantize(x, fmt)
    assert syncs.count == 1, syncs.ops


@pytest.mark.skipif(
    qmatmul.w4a16_unavailable_reason(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="fused W4A16 kernel: needs CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("k", [64, 80])
def test_w4a16_kernel_matches_dequantized_matmul(fmt, k):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(k)
    w = torch.randn(40, k, device=dev)
    qt = quantize(w, fmt)
    a = torch.randn(5, k, device=dev)
    out = qmatmul.w4a16_matmul(
        a, qt.data, qt.scale_fp32(), qt.fmt.element, bw=qt.block[1], n=40, k=k, tensor_scale=qt.tensor_scale
    )
    ref = a @ qt.dequantize().T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    qmatmul.w4a16_unavailable_reason(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="fused W4A16 kernel: needs CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("fmt,act", [("mxfp4", None), ("nvfp4", "nvfp4")])
def test_quantlinear_w4a16_path(fmt, act):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(2)
    lin = nn.Linear(96, 40).to(dev)
    q = QuantLinear.from_linear(lin, fmt, act=act)
    x = torch.randn(2, 3, 96, device=dev)
    q.impl = "dequant_matmul"
    ref = q(x)
    q.impl = "w4a16_triton"
    torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    qmatmul.scaled_mm_unavailable_reason(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    is not None,
    reason=str(
        qmatmul.scaled_mm_unavailable_reason(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    ),
)
def test_fp8_scaled_mm_path():  # pragma: no cover - GPU only
    lin = nn.Linear(128, 64, bias=False).cuda().to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, "fp8_e4m3")
    x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    assert q.execution_path(x) == "scaled_mm"
    ref = F.linear(fake_quantize(x, "fp8_e4m3", granularity="row"), q.dequantized_weight())
    torch.testing.assert_close(q(x), ref, rtol=2e-2, atol=2e-2)


def test_gpu_paths_are_skipped_with_reason_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    reason = qmatmul.scaled_mm_unavailable_reason(torch.device("cpu"))
    assert "CUDA" in reason
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert "CUDA" in qmatmul.w4a16_unavailable_reason(torch.device("cpu"))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
def test_quantize_model_and_generate(fmt):
    policy = tiny_qwen()
    qmodel = quantize_model(copy.deepcopy(policy), fmt, act=None)
    names = [n for n, m in qmodel.named_modules() if isinstance(m, QuantLinear)]
    assert len(names) == 2 * 7 and not any("lm_head" in n or "embed" in n for n in names)
    assert isinstance(qmodel.lm_head, nn.Linear)
    # the same model with plain Linear layers holding the dequantized weights
    fake = copy.deepcopy(policy)
    for n, m in fake.named_modules():
        if isinstance(m, nn.Linear) and n in names:
            m.weight.data = qmodel.get_submodule(n).dequantized_weight()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        assert torch.equal(qmodel(ids).logits, fake(ids).logits)
        rel = (qmodel(ids).logits - policy(ids).logits).norm() / policy(ids).logits.norm()
        assert rel < 0.5
    if fmt != "mxfp4":
        return
    with torch.no_grad():
        g1 = qmodel.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        g2 = fake.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(g1, g2)


def _train_step(model, opt, seed):
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (2, 8))
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def _assert_synced(qmodel, policy, fmt):
    ref = quantize_model(copy.deepcopy(policy), fmt, act=None)
    qs, rs = qmodel.state_dict(), ref.state_dict()
    assert qs.keys() == rs.keys()
    for k in qs:
        if qs[k] is None:
            continue
        assert torch.equal(
            qs[k].view(torch.uint8) if qs[k].element_size() == 1 else qs[k],
            rs[k].view(torch.uint8) if rs[k].element_size() == 1 else rs[k],
        ), k


@pytest.mark.parametrize("opt_kw", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_requantize_after_optimizer_steps(opt_kw):
    policy = tiny_qwen()
    qmodel = quantize_model(copy.deepcopy(policy), "mxfp4", act=None, source=policy)
    st = requantize_(qmodel, policy)
    assert st["requantized"] == 0 and st["copied"] == 0
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, **opt_kw)
    for step in range(2):
        _train_step(policy, opt, step)
        st = requantize_(qmodel, policy)
        assert st["requantized"] == 14, st
        assert st["copied"] >= 2 * 2 + 1  # norms, final norm, embedding (tied lm_head)
        _assert_synced(qmodel, policy, "mxfp4")
    assert requantize_(qmodel, policy)["requantized"] == 0


def test_requantize_only_what_changed_and_checksum_mode():
    policy = tiny_qwen(tie=False)
    qmodel = quantize_model(copy.deepcopy(policy), "nvfp4", act=None, source=policy)
    with torch.no_grad():
        policy.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        policy.model.norm.weight.add_(0.25)
    st = requantize_(qmodel, policy)
    assert (st["requantized"], st["copied"]) == (1, 1)
    _assert_synced(qmodel, policy, "nvfp4")
    # a write through .data bypasses the version counter: only the checksum mode sees it
    qsum = quantize_model(copy.deepcopy(policy), "nvfp4", act=None)
    assert requantize_(qsum, policy, check="checksum")["requantized"] == 14  # first call: no state yet
    assert requantize_(qsum, policy, check="checksum")["requantized"] == 0
    policy.model.layers[0].self_attn.o_proj.weight.data.mul_(2.0)
    assert requantize_(qmodel, policy)["requantized"] == 0
    assert requantize_(qsum, policy, check="checksum")["requantized"] == 1
    qmodel = qsum
    _assert_synced(qmodel, policy, "nvfp4")
    with pytest.raises(ValueError, match="check"):
        requantize_(qmodel, policy, check="hash")


def test_requantize_first_call_without_source_refreshes_everything():
    policy = tiny_qwen()
    qmodel = quantize_model(copy.deepcopy(policy), "mxfp8", act=None)
    st = requantize_(qmodel, policy, warm=True)
    assert st["requantized"] == 14
    _assert_synced(qmodel, policy, "mxfp8")


def test_requantize_from_wrapped_source():
    policy = tiny_qwen()
    qmodel = quantize_model(copy.deepcopy(policy), "mxfp4", act=None, source=policy)
    wrapped = nn.Module()
    wrapped.module = policy  # what DistributedDataParallel's parameter names look like
    with torch.no_grad():
        policy.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    st = requantize_(qmodel, wrapped)
    assert st["requantized"] == 1
    _assert_synced(qmodel, policy, "mxfp4")


def test_gpt2_conv1d_layers():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    policy = transformers.GPT2LMHeadModel(cfg).eval()
    qmodel = quantize_model(
        copy.deepcopy(policy), "mxfp4", act=None, skip=("lm_head", "wte", "wpe"), source=policy
    )
    n = sum(isinstance(m, QuantLinear) for m in qmodel.modules())
    assert n == 2 * 4
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        rel = (qmodel(ids).logits - policy(ids).logits).norm() / policy(ids).logits.norm()
        assert rel < 0.5
        policy.transformer.h[0].mlp.c_fc.weight.mul_(1.5)
    assert requantize_(qmodel, policy)["requantized"] == 1
    w = policy.transformer.h[0].mlp.c_fc.weight.detach().t()
    assert torch.equal(
        qmodel.transformer.h[0].mlp.c_fc.dequantized_weight(), quantize(w, "mxfp4").dequantize()
    )


def test_state_dict_roundtrip_invalidates_cache():
    a = QuantLinear.from_linear(nn.Linear(32, 16), "nvfp4")
    b = QuantLinear.from_linear(nn.Linear(32, 16), "nvfp4")
    x = torch.randn(3, 32)
    b(x)  # builds b's dequantized-weight cache
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), a(x))
