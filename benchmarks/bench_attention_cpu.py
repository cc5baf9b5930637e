"""Benchmark: the CPU decode step's attention (csrc/attention_host.cc through `decode_attention`) at a model's
decode shape, with its cache read from memory and with one cache resident in the last-level cache.

    python benchmarks/bench_attention_cpu.py                      # SmolLM2-135M's shape, 64 rows, 106 columns
    python benchmarks/bench_attention_cpu.py --rows 64 --width 192 --out runs/attention.json

One decode step attends once per layer: `--layers` calls over as many distinct caches (the cache comes from
memory, as in a rollout) against the same number of calls over a single cache (it stays in L3 where it
fits: what the kernel's arithmetic costs without the wait). The gap between the two is the memory stall;
the bytes read per step over the first time is the bandwidth reached. Best of `--reps` interleaved
repetitions. Writes a JSON object with the machine, the settings and both times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bitrl.kernels.bench_stats import machine
from bitrl.kernels.decode_attention import decode_attention


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--width", type=int, default=106, help="attended columns (prompt + tokens so far)")
    ap.add_argument("--columns", type=int, default=176, help="the cache's capacity per row")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.width > args.columns:
        raise SystemExit(f"--width {args.width} exceeds --columns {args.columns}")
    shape = (args.rows, args.kv_heads, args.columns, args.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(args.layers)]
    q = torch.randn(args.rows, args.kv_heads, args.group, args.head_dim)
    visible = torch.ones(args.rows, 1, args.width, dtype=torch.bool)
    scale = args.head_dim**-0.5
    forms = {"from memory": caches, "resident": [caches[0]] * args.layers}
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(args.reps + 1):  # the first round warms up
        for name, layers in forms.items():
            start = time.perf_counter()
            for k, v in layers:
                decode_attention(q, k, v, visible, scale)
            best[name] = min(best[name], time.perf_counter() - start)
    kv_bytes = args.layers * args.rows * args.kv_heads * args.width * args.head_dim * 4 * 2
    result = {
        "benchmark": "bench_attention_cpu",
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "ms_per_step": {name: 1e3 * t for name, t in best.items()},
        "kv_bytes_per_step": kv_bytes,
        "gb_per_s_from_memory": kv_bytes / best["from memory"] / 1e9,
    }
    for name, t in best.items():
        print(f"{name:>12}: {1e3 * t:6.2f} ms per step ({kv_bytes / t / 1e9:.1f} GB/s of cache)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
