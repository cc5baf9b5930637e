"""How close bitrl and naive torch come to the matrix products they cannot avoid, on CPU, fp32.

One forward + backward through an LM head does at least 3 products of N x H x V multiply-adds (the logits,
the hidden gradient, the weight gradient); an op that does not keep the [N, V] logits for its backward adds
a 4th for what it recomputes (bitrl's log-prob + entropy keeps up to ``KEEP_LOGITS_BYTES``, 512 MiB on CPU,
and recomputes the rest; "bitrl-recompute" keeps nothing). This times, interleaved in one process, one whole
[N x H] . [H x V] product (torch.mm, the fastest form of it on this machine) beside the log-prob + entropy
and GRPO rows of bench_integrations.py (same inputs and losses), and writes each time in units of that
product: what is left beyond the products is the rest of the op (softmax, loss, memory traffic).

    python benchmarks/bench_gemm_floor.py --shape 4096x32768

Results: benchmarks/results/bench_gemm_floor.json (merged by shape).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_integrations as bi  # noqa: E402
import bench_keep_logits  # noqa: E402

from bitrl.benchmarks.stats import interleaved_times, machine, merge_json  # noqa: E402
from bitrl.kernels.fused_logprobs import KEEP_LOGITS_BYTES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_gemm_floor.json"


def products(N: int, V: int) -> dict:
    """Products of N x H x V multiply-adds each variant runs: naive torch keeps the logits; bitrl's log-prob +
    entropy recomputes what it does not keep; its GRPO loss (one pass) forms the gradient in the forward."""
    kept = min(1.0, KEEP_LOGITS_BYTES["cpu"] / (4 * N * V))
    return {
        ("logprob_entropy", "naive"): 3,
        ("logprob_entropy", "bitrl"): 4 - kept,
        ("logprob_entropy", "bitrl-recompute"): 4,
        ("grpo_loss", "naive"): 3,
        ("grpo_loss", "bitrl"): 3,
    }


def measure(N: int, V: int, reps: int) -> dict:
    x = bi.make_inputs(N, V, torch.float32)
    h = x["h"].detach().reshape(N, -1)
    w = x["w"].detach()
    logits = torch.empty(N, V)
    runs = {"gemm": lambda: torch.mm(h, w.t(), out=logits)}
    for op, name in products(N, V):
        if name == "bitrl-recompute":  # keeping no logits: every tile recomputed in the backward
            runs[f"{op}/{name}"] = bench_keep_logits.bitrl(x, keep_bytes=0, entropy=True)
        else:
            fn = bi.variant_fn(op, name)
            runs[f"{op}/{name}"] = lambda fn=fn: fn(x)
    times = interleaved_times(runs, reps, setup=lambda _: bi.reset_grads(x))
    best = {k: min(v) for k, v in times.items()}
    gemm = best.pop("gemm")
    rows = {"gemm_s": gemm, "gemm_gflops": 2 * N * bi.H * V / gemm / 1e9}
    for (op, name), needed in products(N, V).items():
        t = best[f"{op}/{name}"]
        rows[f"{op}/{name}"] = {"time_s": t, "in_gemms": t / gemm, "gemms": needed}
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="4096x32768", help="NxV (H = 1024)")
    p.add_argument("--reps", type=int, default=2, help="timed rounds after a warm-up round (minimum taken)")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    N, V = (int(v) for v in args.shape.split("x"))
    result = dict(N=N, V=V, H=bi.H, reps=args.reps, cpu=machine()["cpu"], **measure(N, V, args.reps))
    print(
        f"one [{N} x {bi.H}] . [{bi.H} x {V}] fp32 product: {result['gemm_s']:.2f} s "
        f"({result['gemm_gflops']:.0f} GFLOP/s)"
    )
    for op, name in products(N, V):
        r = result[f"{op}/{name}"]
        t, units = r["time_s"], r["in_gemms"]
        print(f"{op:16s} {name:15s} {t:6.2f} s = {units:.2f} products (needs {r['gemms']:g})")
    merge_json(args.json, args.shape, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
