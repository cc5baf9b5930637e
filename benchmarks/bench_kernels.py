"""pytest-benchmark: fused kernels vs the naive torch path (and Liger-Kernel eager where installed).

    pytest benchmarks/bench_kernels.py --benchmark-only                       # small CPU sizes
    BITRL_BENCH_FULL=1 pytest benchmarks/bench_kernels.py --benchmark-only    # N=8192, H=1024, V=32768
    BITRL_BENCH_MEMORY=1 ...                                                  # also peak RSS per variant

Compare rows of the same group side by side (pytest-benchmark groups by op). The CLI `bitrl bench` prints the
same comparison as a table with ratios; see bitrl/kernels/bench.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from bitrl.kernels.bench import CPU_QUICK, CPU_TARGET, GPU_TARGET, make_inputs, peak_rss_subprocess, variants

FULL = os.environ.get("BITRL_BENCH_FULL", "0") not in ("", "0")
MEMORY = os.environ.get("BITRL_BENCH_MEMORY", "0") not in ("", "0")
SHAPE = dict(CPU_TARGET if FULL else CPU_QUICK, pad=0.125)

CASES = [(op, name) for op in ("grpo", "logprobs") for name in variants(op)]


@pytest.fixture(scope="module")
def inputs():
    x = make_inputs(**SHAPE)
    x["h"].requires_grad_(True)
    x["w"].requires_grad_(True)
    return x


@pytest.mark.parametrize("op,name", CASES, ids=[f"{o}-{n}" for o, n in CASES])
def test_cpu_fwd_bwd(benchmark, inputs, op, name):
    benchmark.group = f"{op} fwd+bwd cpu fp32 N={SHAPE['N']} H={SHAPE['H']} V={SHAPE['V']}"
    fn = variants(op)[name]
    benchmark.extra_info.update(SHAPE)
    if MEMORY:
        benchmark.extra_info["peak_rss_mib"] = peak_rss_subprocess(op, name, SHAPE, "fp32")
    benchmark.pedantic(fn, args=(inputs,), rounds=3 if FULL else 5, warmup_rounds=1, iterations=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU benchmark: needs a CUDA device")
@pytest.mark.parametrize("name", ["naive torch", "bitrl"])
def test_gpu_grpo_bf16(benchmark, name):  # pragma: no cover - needs CUDA
    x = make_inputs(**GPU_TARGET, dtype=torch.bfloat16, device="cuda")
    x["h"].requires_grad_(True)
    x["w"].requires_grad_(True)
    fn = variants("grpo")[name]
    benchmark.group = "grpo fwd+bwd gpu bf16"

    def run():
        fn(x)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
