"""benchmarks/gpu_check.sh and benchmarks/gpu_summary.py without a GPU: the script parses, its dry run lists
every step within the 8-minute budget, and the summary reads the files the GPU steps write (here written by
the test in those tools' formats) into the README rows and the goals."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_summary  # noqa: E402


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_lists_every_step_within_eight_minutes(tmp_path):
    env = {"GPU_CHECK_DRY_RUN": "1", "PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    total = int(re.search(r"total limit (\d+)s", proc.stdout).group(1))
    assert total == sum(int(re.match(r"step (\d+)s", s).group(1)) for s in steps)
    assert total <= 7 * 60  # 8 minutes with one to spare (start-up, the version probe)
    text = "\n".join(steps)
    for needed in (
        "bitrl.kernels.bench",
        "bench_quant.py --gpu-out",
        "bench_decode.py",
        "gpu_summary.py",
        "bitrl.kernels.cuda_ext",  # the CUDA C++ kernels built once, before anything uses them
        "warmstart.steps=0",
        "test_csrc.py",
        "test_kernels_gpu_paths.py",
        "test_quant_linear.py",
        "test_short_run_on_cuda",
        "test_kernels_decode_attention.py",  # the fp8 KV cache read in registers
        "test_gpu_scale.py",  # > 2**31 elements, FSDP2 over NCCL, CUDA random state, native FP4 in a model
    ):
        assert needed in text, needed
    assert "bitrl.quant.aot" not in text  # the CPU suite's (511 compiles would not fit beside the tests)
    for path in re.findall(r"(tests/\S+?\.py)", text):  # every test file the suite step names exists
        assert (ROOT / path).exists(), path
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_rehearsal_starts_every_step_and_writes_its_json_in_time(tmp_path):
    """Every step of the GPU check, run here on the CPU at its smallest setting under its own limit: each
    starts, ends in time with status 0 and leaves its results as parseable JSON, written as it ends."""
    env = {
        "GPU_CHECK_REHEARSAL": "1",
        "PATH": "/usr/bin:/bin",
        "PYTHON": sys.executable,
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=ROOT
    )
    out = tmp_path / "out"
    assert proc.returncode == 0, proc.stderr + (out / "steps.jsonl").read_text()
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    groups = ["kernels", "sampler", "attention", "rollout", "quant", "loop", "scale"]
    assert [s["step"] for s in steps] == [
        "prepare", *(f"tests_{g}" for g in groups), "bench_kernels", "quant", "decode", "verify", "summary"
    ]  # fmt: skip
    for s in steps:
        log = (out / f"{s['step']}.log").read_text()[-2000:]
        assert s["rc"] == 0 and not s["timed_out"] and s["seconds"] <= s["limit_s"], (s, log)
    assert json.loads((out / "prepare.json").read_text())["reason"]  # no CUDA here, and it says so
    tests = [json.loads(line) for line in (out / "tests.jsonl").read_text().splitlines()]
    assert tests and all(t["outcome"] == "skipped" and t["why"] for t in tests)  # every GPU test, with why
    assert json.loads((out / "bench_kernels" / "results.json").read_text())
    assert json.loads((out / "quant" / "gpu_quant.json").read_text())["skipped"]
    assert json.loads((out / "decode.json").read_text())["results"]
    verify = [json.loads(line) for line in (out / "verify.jsonl").read_text().splitlines()]
    assert len(verify) == 1 and verify[0]["fresh_generation_ms"] > 0
    assert json.loads((out / "summary.json").read_text())["goals"]


def _write_outputs(out: Path):
    (out / "bench_kernels").mkdir(parents=True)
    shape = dict(N=16384, H=4096, V=151936, B=16, pad=0.125)
    rows = [dict(section="cpu", op="grpo", variant="bitrl", time_s=1.0, **shape)]
    for variant, t in (("naive torch", 0.30), ("bitrl", 0.12), ("liger-kernel (eager)", 0.18)):
        tflops = 3 * 2 * 16384 * 4096 * 151936 / t / 1e12
        rows.append(
            dict(
                section="gpu",
                op="grpo",
                variant=variant,
                dtype="bf16",
                time_s=t,
                tflops=tflops,
                roofline_frac=tflops / 800.0,
                **shape,
            )
        )
    (out / "bench_kernels" / "results.json").write_text(json.dumps(rows))
    (out / "quant").mkdir()
    quant = {
        "device": "NVIDIA H200",
        "exact": {"mxfp4-floor": True},
        "bandwidth": {
            "mxfp4-quantize": {"s": 1e-4, "GB/s": 3500.0, "fraction_of_hbm": 0.73},
            "nvfp4-dequantize": {"s": 1e-4, "GB/s": 3000.0, "fraction_of_hbm": 0.62},
        },
        "gemv": {
            "mxfp4-cuda fp4_gemv-1x8192x8192": {"s": 1e-5, "GB/s": 3100.0, "fraction_of_hbm": 0.65},
            "mxfp4-cuda fp4_gemv-16x8192x8192": {"s": 1e-5, "GB/s": 3400.0, "fraction_of_hbm": 0.71},
            "mxfp4-triton w4a16-1x8192x8192": {"s": 1e-5, "GB/s": 1000.0, "fraction_of_hbm": 0.2},
        },
    }
    (out / "quant" / "gpu_quant.json").write_text(json.dumps(quant))
    (out / "tests.log").write_text("....s\nSKIPPED [1] x\n40 passed, 2 skipped, 1 failed in 50.1s\n")
    res = {
        "n_compiles": 3,
        "kernels": [
            {"hot": True, "spills": False},
            {"hot": False, "spills": True},
            {"error": "CompilationError"},
        ],
    }
    (out / "kernel_resources.json").write_text(json.dumps(res))
    decode = dict(model="Qwen2-0.5B shape, random weights", rows=64, prompt_len=256, new_tokens=64)
    decode["results"] = [
        dict(
            precision="full", step_ms=2.0, tokens_per_s=32000.0, fraction_of_bandwidth=0.55, step_vs_full=1.0
        ),
        dict(
            precision="nvfp4", step_ms=1.2, tokens_per_s=53333.0, fraction_of_bandwidth=0.4, step_vs_full=0.6
        ),
    ]
    (out / "decode.json").write_text(json.dumps(decode))


def test_summary_reads_the_gpu_outputs(tmp_path):
    _write_outputs(tmp_path)
    assert gpu_summary.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["device"] == "NVIDIA H200"
    assert s["tests"] == {"passed": 40, "failed": 1, "skipped": 2, "errors": 0}
    assert (s["compiled_specializations"], s["compile_errors"], s["hot_spills"]) == (3, 1, 0)
    bitrl = next(r for r in s["fused_loss"] if r["what"].endswith(", bitrl"))
    assert abs(bitrl["speedup_vs_liger"] - 1.5) < 1e-12
    g = s["goals"]
    assert g["loss_vs_liger"]["met"] is True and abs(g["loss_vs_liger"]["measured"] - 1.5) < 1e-12
    assert g["loss_roofline"]["met"] is True  # 510 TFLOP/s of an 800 TFLOP/s roofline
    assert g["quant_hbm"] == {"target": 0.7, "measured": 0.73, "met": True}
    assert g["gemv_hbm"] == {"target": 0.6, "measured": 0.65, "met": True}  # M = 1 only, CUDA kernel only
    assert g["decode_hbm"] == {"target": 0.5, "measured": 0.55, "met": True}  # the bf16 step's
    assert (
        "| decode step, nvfp4 | Qwen2-0.5B shape, random weights, batch 64, context 256+64 | 1.20 ms/step"
        in (tmp_path / "summary.md").read_text()
    )
    md = (tmp_path / "summary.md").read_text()
    row = "| GRPO loss with LM head, fwd+bwd, bitrl | N=16384 H=4096 V=151936 bf16 | 510 TFLOP/s | 64% "
    row += "| 1.50x |"
    assert row in md


def test_summary_of_an_empty_run_says_not_measured(tmp_path):
    assert gpu_summary.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["fused_loss"] == "not measured" and s["bandwidth"] == "not measured" and s["tests"] is None
    assert s["decode"] == "not measured"
    assert all(g["measured"] is None and g["met"] is None for g in s["goals"].values())
