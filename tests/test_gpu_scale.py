"""GPU paths no other test reaches, each small enough for seconds on one H200 (`benchmarks/gpu_check.sh`,
group `tests_scale`): the CUDA random state through a checkpoint, tensors past 2**31 elements through the
kernels whose offsets could wrap, FSDP2 over NCCL (one rank: NCCL refuses two ranks on one GPU, so the
2-rank NCCL run needs a machine with 2 GPUs), and QuantLinear's native FP4 path inside a model (Blackwell).
Every test is marked `gpu` and skips on a CPU with its reason.

The FSDP2 worker is this file run as a script (`python tests/test_gpu_scale.py fsdp_nccl OUT`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TRAIN_CFG, assert_same_adam_update

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INT32 = 2**31


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as integers (fp8 tensors have no equality kernel everywhere)."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


# ---------------------------------------------------------------------------------- CUDA random state


@needs_cuda
def test_cuda_random_state_comes_back_from_a_checkpoint(tmp_path):  # pragma: no cover - GPU only
    """The checkpoint's random state holds this process's GPU state (one tensor, not one per GPU), and
    restoring it from the file replays the same CUDA draws (dropout masks, sampling noise)."""
    from bitrl.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state

    torch.rand((), device="cuda")  # CUDA initialised, its generator advanced
    state = rng_state()
    assert isinstance(state["cuda"], torch.Tensor) and state["cuda"].device.type == "cpu"
    save_checkpoint(tmp_path, {"rng": state})
    want = (torch.rand(64, device="cuda"), torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5))
    torch.rand(1000, device="cuda")  # move on
    set_rng_state(load_checkpoint(tmp_path)["rng"])
    got = (torch.rand(64, device="cuda"), torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    old = dict(state, cuda=[state["cuda"]])  # checkpoints written with one state per GPU
    set_rng_state(old)
    assert torch.equal(torch.rand(64, device="cuda"), want[0])


# ---------------------------------------------------------------------------- past 2**31 elements


def _memory_reason(gib: float) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    free, _ = torch.cuda.mem_get_info()
    return None if free > gib * 2**30 else f"needs {gib:.0f} GiB of free GPU memory"


@pytest.mark.skipif(_memory_reason(20) is not None, reason=str(_memory_reason(20)))
def test_fused_logprobs_rows_past_2_31_logits():  # pragma: no cover - GPU only
    """One chunk of 14200 rows x V = 151936 (2.16e9 logits, fp32 workspace 8.6 GB): the row kernels' offsets
    of the last 66 rows pass 2**31. Log-probs, entropies and the hidden gradient equal those of the default
    chunking, whose chunks stay below 2**31 (only the GEMM's summation order may differ)."""
    from bitrl.kernels import fused_logprobs

    N, H, V = 14200, 64, 151936
    assert N * V > INT32 and (N - 1) * V > INT32 + 60 * V
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    outputs = []
    for chunk in (N, None):
        x = h.detach().clone().requires_grad_(True)
        lp, ent = fused_logprobs(x, w, y, chunk_size=chunk)
        (lp.sum() + 0.5 * ent.sum()).backward()
        outputs.append((lp.detach(), ent.detach(), x.grad))
        del lp, ent
        torch.cuda.empty_cache()
    (lp1, ent1, dh1), (lp2, ent2, dh2) = outputs
    torch.testing.assert_close(lp1, lp2, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ent1, ent2, atol=1e-3, rtol=1e-4)
    tail = slice(INT32 // V, N)  # the rows whose offsets pass 2**31
    torch.testing.assert_close(dh1[tail].float(), dh2[tail].float(), atol=2e-3, rtol=2e-2)
    assert torch.isfinite(lp1).all() and (lp1 <= 0).all()


@pytest.mark.skipif(_memory_reason(16) is not None, reason=str(_memory_reason(16)))
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_quantize_and_dequantize_past_2_31_elements(fmt):  # pragma: no cover - GPU only
    """A [65600, 32768] bf16 tensor (2.15e9 elements, 4.3 GB): the quantize and dequantize kernels give its
    last rows, whose offsets pass 2**31, the bits they give those rows alone."""
    from bitrl.quant import quantize

    rows, cols = 65600, 32768
    assert rows * cols > INT32
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    qt = quantize(x, fmt, backend="triton", check_finite=False)
    alone = quantize(x[-3:].clone(), fmt, backend="triton", check_finite=False)
    assert torch.equal(_bits(qt.data[-3:]), _bits(alone.data))
    assert torch.equal(_bits(qt.scale[-3:]), _bits(alone.scale))
    first = quantize(x[:3].clone(), fmt, backend="triton", check_finite=False)
    assert torch.equal(_bits(qt.data[:3]), _bits(first.data))
    del x
    out = qt.dequantize(torch.bfloat16, backend="triton")
    assert torch.equal(out[-3:], alone.dequantize(torch.bfloat16, backend="triton"))


@pytest.mark.skipif(_memory_reason(8) is not None, reason=str(_memory_reason(8)))
def test_decode_attention_over_a_cache_past_2_31_elements():  # pragma: no cover - GPU only
    """An fp8 KV cache [5, 2, 2**21, 128] (2.7e9 elements per buffer): the last cache row starts past 2**31
    elements; its attention over the first 64 columns is that of the same row copied out alone."""
    from bitrl.kernels.decode_attention import decode_attention, decode_attention_reference

    rows, kv_heads, columns, dim, width, group = 5, 2, 2**21, 128, 64, 7
    assert (rows - 1) * kv_heads * columns * dim > INT32
    fp8 = torch.float8_e4m3fn
    k, v = (
        torch.zeros(rows, kv_heads, columns, dim, dtype=torch.uint8, device="cuda").view(fp8) for _ in "kv"
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    k[:, :, :width] = torch.randn(rows, kv_heads, width, dim, device="cuda", generator=g).to(fp8)
    v[:, :, :width] = torch.randn(rows, kv_heads, width, dim, device="cuda", generator=g).to(fp8)
    q = torch.randn(rows, kv_heads, group, dim, device="cuda", generator=g).bfloat16()
    visible = torch.ones(rows, 1, width, dtype=torch.bool, device="cuda")
    out = decode_attention(q, k, v, visible, dim**-0.5)
    small = (k[-1:, :, :width].clone(), v[-1:, :, :width].clone())
    alone = decode_attention(q[-1:], *small, visible[-1:], dim**-0.5)
    torch.testing.assert_close(out[-1:], alone, atol=0, rtol=0)
    ref = decode_attention_reference(q[-1:], *small, visible[-1:], dim**-0.5)
    torch.testing.assert_close(out[-1:].float(), ref.float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------- FSDP2 over NCCL


def _on(rollout, device):
    from bitrl.rollout.batch import Rollout

    return Rollout(*(getattr(rollout, f).to(device) for f in Rollout.__dataclass_fields__))


def worker_fsdp_nccl(out: Path, backend: str = "nccl") -> None:
    """One rank in an NCCL process group: the trainer takes every data-parallel code path (FSDP2 sharding
    of each decoder layer, NCCL all-reduces of the counts and metrics, reduce-scatter of the gradients),
    with fsdp_mixed_precision none and bf16, then a sharded checkpoint round trip. Writes the gathered
    parameters and metrics to OUT/fsdp_nccl.pt. (backend="gloo" runs the same on the CPU.)"""
    import torch.distributed as dist
    from test_distributed import global_batch, tiny_policy

    import bitrl.train.distributed as distributed
    import bitrl.train.trainer as trainer_module
    from bitrl.engine.config import TrainConfig
    from bitrl.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from bitrl.train.distributed import full_tensor, is_sharded

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    assert dist.get_backend() == backend
    # The trainer shards only when there is more than one rank: here the one NCCL rank counts as one.
    for module in (distributed, trainer_module):
        module.is_distributed = dist.is_initialized
    rollout, advantages = global_batch(tiny_policy())
    rollout, advantages = _on(rollout, device), advantages.to(device)
    results = {}
    for mp in ("none", "bf16"):
        policy = tiny_policy().to(device)
        trainer = trainer_module.PolicyTrainer(policy, TrainConfig(**TRAIN_CFG, fsdp_mixed_precision=mp))
        assert is_sharded(policy)
        metrics = trainer.step(rollout, advantages)
        params = {n: full_tensor(p.detach()).cpu() for n, p in policy.named_parameters()}
        results[mp] = (params, metrics)

    def snapshot():
        states = [full_tensor(t).clone() for s in trainer.optimizer.state.values() for t in s.values()]
        return [full_tensor(p.detach()).clone() for p in policy.parameters()] + states

    save_sharded_checkpoint(out / "run", 1, policy, trainer.optimizer, {"rank": 0})
    saved = snapshot()
    trainer.step(rollout, advantages)
    assert load_sharded_checkpoint(out / "run", policy, trainer.optimizer) == {"rank": 0}
    assert all(torch.equal(a, b) for a, b in zip(saved, snapshot(), strict=True)), "checkpoint round trip"
    torch.save(results, out / "fsdp_nccl.pt")
    dist.destroy_process_group()


@needs_cuda
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
    reason="needs torch.distributed with NCCL",
)
def test_fsdp2_step_over_nccl_equals_the_unsharded_step(tmp_path):  # pragma: no cover - GPU only
    """FSDP2 over NCCL on one GPU (a 1-rank group: NCCL refuses two ranks on one device): the sharded step
    without mixed precision gives the unsharded parameters; with bf16 parameters for compute its loss and
    update stay close; the sharded checkpoint round trip over NCCL restores every state (in the worker)."""
    from test_distributed import global_batch, subprocess_env, tiny_policy

    from bitrl.engine.config import TrainConfig
    from bitrl.train.trainer import PolicyTrainer

    proc = subprocess.run(
        [sys.executable, __file__, "fsdp_nccl", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(tmp_path / "fsdp_nccl.pt")
    rollout, advantages = global_batch(tiny_policy())
    start = {n: p.detach().clone() for n, p in tiny_policy().named_parameters()}
    policy = tiny_policy().cuda()
    metrics = PolicyTrainer(policy, TrainConfig(**TRAIN_CFG)).step(_on(rollout, "cuda"), advantages.cuda())
    names = [n for n, _ in policy.named_parameters()]
    want = torch.cat([p.detach().cpu().flatten() for p in policy.parameters()])
    init = torch.cat([start[n].flatten() for n in names])
    for mp, (params, got_metrics) in results.items():
        got = torch.cat([params[n].flatten() for n in names])
        assert torch.isfinite(got).all(), mp
        if mp == "none":
            assert_same_adam_update(got, want, TRAIN_CFG["lr"], "fsdp2 nccl")
            assert got_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6)
        else:  # bf16 compute: the same update direction, the loss within bf16's rounding
            cos = torch.nn.functional.cosine_similarity(got - init, want - init, dim=0)
            assert float(cos) > 0.9, float(cos)
            assert got_metrics["loss"] == pytest.approx(metrics["loss"], rel=5e-2, abs=1e-3)


# ------------------------------------------------------------------------------ native FP4 in a model


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10,
    reason="needs a Blackwell GPU (compute capability >= 10.0): native FP4 tensor cores; Hopper emulates",
)
@pytest.mark.parametrize("fmt,act", [("mxfp4", "mxfp4"), ("mxfp4", "mxfp8"), ("nvfp4", "nvfp4")])
def test_quantlinear_native_fp4_inside_a_llama(monkeypatch, fmt, act):  # pragma: no cover - Blackwell
    """A small Llama built from its config, every linear but the LM head quantized: each layer takes the
    block-scaled tensor cores (fp4_gemm called once per layer), and the logits equal the emulated path's
    (fake-quantized activations times the dequantized weights) up to the GEMMs' summation order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import bitrl.kernels.fp4_gemm as fp4_gemm
    from bitrl.quant import QuantLinear, quantize_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = quantize_model(LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval(), fmt, act=act)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7
    ids = torch.randint(0, 512, (3, 20), device="cuda")
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    assert {q.execution_path(x) for q in layers} == {"fp4_native"}
    calls = []
    real = fp4_gemm.fp4_gemm
    monkeypatch.setattr(fp4_gemm, "fp4_gemm", lambda *a, **k: calls.append(k["recipe"]) or real(*a, **k))
    with torch.no_grad():
        native = model(ids).logits.float()
        assert len(calls) == len(layers)
        for q in layers:
            q.impl = "dequant_matmul"
        emulated = model(ids).logits.float()
    assert torch.isfinite(native).all()
    rel = float((native - emulated).norm() / emulated.norm())
    assert rel < 2e-2, rel


if __name__ == "__main__":
    {"fsdp_nccl": worker_fsdp_nccl}[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
