"""The fp32 GRPO loss op on CPU: time and peak memory of its one pass at several chunk sizes, and of its
two-pass tiles, at one shape. What a smaller working set costs in time.

Configurations: ``one-passK`` (chunks of K MiB of fp32 logits, as many active tokens as fit, across
sequences; 3 GEMMs per chunk; ``one-pass16`` is the default at V <= 32768) and ``tiles`` (every token
through the two-pass [256 x 1024] tiles, tokens outside; 4 GEMMs; the default beyond). Times: interleaved
in one process, the minimum of ``--reps`` rounds after a warm-up round. Memory: the growth of the peak RSS of
one forward + backward in a fresh process per configuration, after a warm-up call on tiny inputs (as in
bench_integrations.py, whose inputs and loss this uses).

    python benchmarks/bench_loss_chunks.py --shape 4096x32768

Results: benchmarks/results/bench_loss_chunks.json (merged by shape).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_integrations as bi  # noqa: E402

from bitrl.kernels.bench_stats import interleaved_times, machine, merge_json, rss_growth_mib  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_loss_chunks.json"
CONFIGS = {"one-pass32": 32, "one-pass16": 16, "one-pass8": 8, "tiles": None}

loss_mod = importlib.import_module("bitrl.kernels.policy_loss.fused_linear")
DEFAULT_MIN_TOKENS = loss_mod.ONE_PASS_MIN_TOKENS


def configure(name: str) -> int:
    """Select a configuration: one pass with chunks of K MiB (the memory budget), or the tiles alone
    (budget 0); returns the budget."""
    mib = CONFIGS[name]
    loss_mod.ONE_PASS_MIN_TOKENS = DEFAULT_MIN_TOKENS if mib is None else 1
    return 0 if mib is None else mib * 2**20


def peak_memory_child(N: int, V: int, name: str) -> float:
    fn = bi.variant_fn("grpo_loss", "bitrl", memory_budget=configure(name))
    fn(bi.make_inputs(64, 512, torch.float32))
    x = bi.make_inputs(N, V, torch.float32)
    return rss_growth_mib(lambda: fn(x))[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="4096x32768", help="tokens x vocabulary (H = 1024, 16 sequences)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        N, V, name = int(args._child[0]), int(args._child[1]), args._child[2]
        print(json.dumps(peak_memory_child(N, V, name)))
        return 0
    N, V = (int(v) for v in args.shape.split("x"))
    memory = {}
    for name in CONFIGS:
        cmd = [sys.executable, __file__, "--_child", str(N), str(V), name]
        memory[name] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    fns = {name: bi.variant_fn("grpo_loss", "bitrl", memory_budget=configure(name)) for name in CONFIGS}
    x = bi.make_inputs(N, V, torch.float32)
    times = interleaved_times(
        {name: (lambda fn=fns[name]: fn(x)) for name in CONFIGS},
        args.reps,
        setup=lambda name: (configure(name), bi.reset_grads(x)),
    )
    configure("one-pass16")
    one_pass = min(times["one-pass16"])
    rows = []
    for name in CONFIGS:
        t = min(times[name])
        rows.append(dict(config=name, time_s=t, time_vs_default=t / one_pass, peak_mib=memory[name]))
        print(f"{name:>10}: {t:6.1f} s ({t / one_pass:.2f}x), {memory[name]:.0f} MiB")
    floor = (V + N) * bi.H * 4 / 2**20  # the fp32 weight and hidden gradients themselves
    print(f"floor (dW + dh): {floor:.0f} MiB")
    merge_json(args.json, args.shape, dict(machine=machine(), reps=args.reps, floor_mib=floor, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
