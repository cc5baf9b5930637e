"""`bitrl bench` smoke test at tiny sizes (the real figures come from `bitrl bench`, never from tests)."""

from __future__ import annotations

import json

import pytest

from bitrl.kernels import bench


def test_bench_cli_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--N", "32", "--H", "8", "--V", "50", "--B", "4", "--reps", "1", "--no-memory"]
    args += ["--json", str(out)]
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    import torch

    if not torch.cuda.is_available():
        assert "GPU section skipped: no CUDA device" in text
    rows = json.loads(out.read_text())
    names = {(r["op"], r["variant"]) for r in rows}
    assert {("grpo", "naive torch"), ("grpo", "bitrl"), ("logprobs", "bitrl")} <= names
    cpu = [r for r in rows if r["section"] == "cpu"]
    assert all((r["N"], r["H"], r["V"], r["dtype"]) == (32, 8, 50, "fp32") for r in cpu)
    for op in ("grpo", "logprobs"):
        naive = next(r for r in cpu if r["op"] == op and r["variant"] == "naive torch")
        assert naive["time_vs_naive"] == 1.0
        for r in (r for r in cpu if r["op"] == op):
            assert 0 < r["time_s"] < 60 and r["time_vs_naive"] == r["time_s"] / naive["time_s"]
            assert r["peak_mib"] is None  # --no-memory
    for r in cpu:  # every measured row is printed in the table
        assert any(r["variant"] in line and r["op"] in line for line in text.splitlines())


def test_peak_rss_is_measured_in_a_subprocess():
    shape = dict(N=256, H=16, V=8192, B=4)
    mib = bench.peak_rss_subprocess("grpo", "naive torch", shape, "fp32")
    logits_mib = shape["N"] * shape["V"] * 4 / 2**20  # the naive path holds the fp32 [N, V] logits at once
    assert mib is not None and logits_mib <= mib < 100 * logits_mib


def test_bench_rejects_bad_shapes():
    with pytest.raises(SystemExit):
        bench.main(["--N", "10", "--B", "3", "--no-memory"])


def test_import_without_triton():
    """`import bitrl.kernels` and the torch paths work where Triton is absent; forcing Triton says why not."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, bitrl.kernels as k\n"
        "assert not k.HAS_TRITON\n"
        "h, w, y = torch.randn(4, 3), torch.randn(7, 3), torch.randint(0, 7, (4,))\n"
        "lp, ent = k.fused_logprobs(h, w, y)\n"
        "loss, m = k.policy_loss(lp.view(2, 2), None, torch.ones(2), None)\n"
        "try:\n"
        "    k.fused_logprobs(h, w, y, impl='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
