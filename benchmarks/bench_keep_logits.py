"""What keeping logits for the backward buys on CPU: fp32 log-prob (with and without entropy) keeping several
amounts of logits (a ``memory_budget`` of the tiles plus that much), against naive torch, forward + backward,
interleaved in one process.

The backward of ``fused_logprobs`` needs each tile's logits again; what the forward kept it reads, the rest it
recomputes (one product of N x H x V multiply-adds for all of it). The op's ``memory_budget`` makes this
trade-off: time against the memory the kept logits take (N x V x 4 bytes for all of them).

    python benchmarks/bench_keep_logits.py --shape 8192x32768 --keep-mib 0 512 1024

Results: benchmarks/results/bench_keep_logits.json (merged by shape).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_integrations as bi  # noqa: E402

from bitrl.kernels import fused_logprobs  # noqa: E402
from bitrl.kernels.bench_stats import interleaved_times, machine, merge_json  # noqa: E402
from bitrl.kernels.fused_logprobs import tile_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_keep_logits.json"


def bitrl(x: dict, keep_bytes: int, entropy: bool):
    """fused_logprobs with a memory budget of its tiles plus ``keep_bytes`` of kept products."""
    h, y = x["h"].reshape(-1, bi.H), x["y"].reshape(-1)
    budget = tile_bytes(h.shape[0], x["w"].shape[0], h, "logprobs") + keep_bytes

    def run():
        lp, ent = fused_logprobs(
            h,
            x["w"],
            y,
            temperature=bi.TEMPERATURE,
            impl="torch",
            memory_budget=budget,
            return_entropy=entropy,
        )
        (lp.sum() + (ent.sum() if entropy else 0.0)).backward()

    return run


def naive(x: dict, entropy: bool):
    h, y = x["h"].reshape(-1, bi.H), x["y"].reshape(-1)

    def run():
        logp = torch.log_softmax(h @ x["w"].t() / bi.TEMPERATURE, -1)
        objective = logp.gather(-1, y.unsqueeze(-1)).sum()
        if entropy:
            objective = objective - (logp.exp() * logp).sum()
        objective.backward()

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8192x32768", help="NxV (H = 1024)")
    p.add_argument("--keep-mib", type=int, nargs="+", default=[0, 512, 1024])
    p.add_argument("--reps", type=int, default=2, help="timed rounds after a warm-up round (median taken)")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    N, V = (int(v) for v in args.shape.split("x"))
    x = bi.make_inputs(N, V, torch.float32)
    runs = {}
    for entropy in (False, True):
        op = "logprob_entropy" if entropy else "logprob"
        runs[f"{op}/naive"] = naive(x, entropy)
        for mib in args.keep_mib:
            runs[f"{op}/keep {mib} MiB"] = bitrl(x, mib * 2**20, entropy)
    times = interleaved_times(runs, args.reps, setup=lambda _: bi.reset_grads(x))
    logits_mib = N * V * 4 / 2**20
    rows = {}
    for name, t in times.items():
        op = name.split("/")[0]
        rows[name] = {
            "time_s": statistics.median(t),
            "vs_naive": statistics.median(t) / statistics.median(times[f"{op}/naive"]),
        }
        print(f"{name:32s} {rows[name]['time_s']:6.2f} s  {rows[name]['vs_naive']:.2f}x naive")
    result = dict(N=N, V=V, H=bi.H, reps=args.reps, logits_mib=logits_mib, cpu=machine()["cpu"], rows=rows)
    merge_json(args.json, args.shape, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
