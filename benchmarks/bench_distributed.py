"""Data-parallel scale-out on CPU (gloo): 1 rank against 2 on the same global batch, and memory per rank.

    python benchmarks/bench_distributed.py curves [--steps 20] [--repeats 2] [--preset NAME] [--set k=v ...]
    python benchmarks/bench_distributed.py memory [--world-sizes 1 2 4]

`curves` trains the demo twice per repeat, on 1 rank (2 threads) and on 2 ranks (1 thread each), alternating,
and reports how far the per-step loss, reward and grad-norm curves are apart and the step-time ratio; on a
2-core machine that ratio is not a speedup claim. `memory` trains a 27M-parameter model a few steps at each
world size (4 ranks on 2 cores is oversubscribed, which only slows it) and reports each rank's peak resident
memory above what the process held before building the model, against the memory plan's per-rank total.
Results are written to benchmarks/results/bench_distributed_<mode>.json and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CURVE_KEYS = ("loss", "reward_mean", "grad_norm", "entropy")
# The memory model: hidden 512, 8 layers, SwiGLU 1536: 27M parameters, so the sharded part (weights,
# gradients, AdamW states: 16 bytes a parameter in fp32) is 430 MB at world size 1.
MEMORY_MODEL = [
    "model.hidden_size=512",
    "model.intermediate_size=1536",
    "model.num_layers=8",
    "model.num_heads=8",
    "model.num_kv_heads=4",
]
MEMORY_RUN = [
    "steps=2",
    "warmstart.steps=0",
    "task.n_eval=8",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
]


def train(nproc: int, threads: int, out_dir: Path, name: str, extra: list[str], preset=None) -> list[dict]:
    """`bitrl train` on `nproc` ranks (from `preset` when given); returns its metrics records."""
    args = [f"out_dir={out_dir}", f"name={name}", f"threads={threads}", *extra]
    cmd = [sys.executable, "-m", "bitrl", "train", "--nproc", str(nproc)]
    cmd += (["--preset", preset] if preset else []) + args
    subprocess.run(
        cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    return [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]


def curves(args) -> dict:
    every = args.eval_every or args.steps
    extra = [f"steps={args.steps}", f"eval_every={every}", f"checkpoint_every={args.steps}", *args.set]
    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for nproc in (1, 2):  # alternating, so that load on the machine hits both alike
                threads = 2 // nproc
                runs[nproc].append(train(nproc, threads, Path(tmp), f"n{nproc}-{repeat}", extra, args.preset))
    one, two = runs[1][0][1:], runs[2][0][1:]  # step 0 holds only the starting accuracy
    # Steps whose rewards agree exactly drew the same samples; rounding differences in the summed
    # gradients can flip one sampled token many steps later, and the runs part from there.
    same = [a["reward_mean"] == b["reward_mean"] for a, b in zip(one, two)]
    identical_steps = same.index(False) if False in same else len(same)
    gaps = {k: max(abs(a[k] - b[k]) for a, b in zip(one, two)) for k in CURVE_KEYS}
    scale = {k: max(abs(a[k]) for a in one) for k in CURVE_KEYS}
    step_time = {
        n: statistics.median(r["step_time_s"] for rec in runs[n] for r in rec[2:]) for n in runs
    }  # first step excluded (warm-up)
    evals = {n: {r["step"]: r["accuracy"] for r in runs[n][0] if "accuracy" in r} for n in runs}
    return {
        "preset": args.preset,
        "overrides": args.set,
        "steps": args.steps,
        "identical_reward_steps": identical_steps,
        "accuracy": evals,
        "repeats": args.repeats,
        "max_abs_gap": gaps,
        "max_abs_value": scale,
        "median_step_time_s": step_time,
        "step_time_ratio_2_over_1": step_time[2] / step_time[1],
        "curves": {n: [{k: r[k] for k in ("step", *CURVE_KEYS)} for r in runs[n][0][1:]] for n in runs},
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_worker(out: Path) -> None:
    """One rank of the memory benchmark (under torchrun)."""
    import torch
    import torch.distributed as dist

    from bitrl.engine.config import load_config
    from bitrl.engine.loop import model_config, run
    from bitrl.train.distributed import init_distributed
    from bitrl.train.memory import plan_memory

    cfg = load_config(None, [f"out_dir={out}", "name=memory", *MEMORY_MODEL, *MEMORY_RUN])
    ctx = init_distributed(torch.device("cpu"))
    config = model_config(cfg)  # imports the model's code before the baseline is taken
    baseline = rss_bytes()
    run(cfg, log=lambda *a, **k: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    peaks = [peak] * ctx.world_size
    if ctx.enabled:
        dist.all_gather_object(peaks, peak)
    if ctx.is_main:
        plan = plan_memory(cfg, config, ctx.world_size, device_bytes=float(2**40))
        parts = {k: v for k, v in plan.parts.items() if not k.startswith("_")}
        row = {
            "world_size": ctx.world_size,
            "peak_rss_above_baseline": peaks,
            "plan": parts,
            "plan_total": plan.total,
        }
        (out / "memory.json").write_text(json.dumps(row))
    if ctx.enabled:
        dist.destroy_process_group()


def memory(args) -> dict:
    rows = []
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
            cmd += [__file__, "_memory_worker", tmp]
            # Tensors above 64 KiB mmapped and returned to the system when freed: resident memory then follows
            # what is alive instead of glibc's cached heap (whose threshold otherwise grows with each free).
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
            subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
            rows.append(json.loads((Path(tmp) / "memory.json").read_text()))
    return {"model": MEMORY_MODEL, "run": MEMORY_RUN, "rows": rows}


def table(mode: str, result: dict) -> str:
    if mode == "curves":
        gap, top = result["max_abs_gap"], result["max_abs_value"]
        lines = ["| metric | max abs gap, 1 vs 2 ranks | max abs value |", "| --- | --- | --- |"]
        lines += [f"| {k} | {gap[k]:.2e} | {top[k]:.3f} |" for k in CURVE_KEYS]
        t = result["median_step_time_s"]
        lines.append(
            f"\nmedian step time: 1 rank {t[1]:.3f} s, 2 ranks {t[2]:.3f} s, "
            f"ratio {result['step_time_ratio_2_over_1']:.2f}; identical rewards for the first "
            f"{result['identical_reward_steps']} of {result['steps']} steps; "
            f"held-out accuracy {result['accuracy']}"
        )
        return "\n".join(lines)
    mib = 2**20
    lines = ["| world size | plan per rank (MiB) | measured peak per rank (MiB) |", "| --- | --- | --- |"]
    for row in result["rows"]:
        peaks = ", ".join(f"{p / mib:.0f}" for p in row["peak_rss_above_baseline"])
        lines.append(f"| {row['world_size']} | {row['plan_total'] / mib:.0f} | {peaks} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("curves")
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--preset", help="start every run from this preset (bitrl train --preset NAME)")
    c.add_argument("--eval-every", type=int, help="held-out evaluation period (default: only at the end)")
    c.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    m = sub.add_parser("memory")
    m.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    for mode in (c, m):
        mode.add_argument("--out", type=Path, help="the JSON (default: results/bench_distributed_MODE.json)")
    args = parser.parse_args(argv)
    result = curves(args) if args.mode == "curves" else memory(args)
    out = args.out or RESULTS / f"bench_distributed_{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(args.mode, result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_memory_worker":
        memory_worker(Path(sys.argv[2]))
    else:
        raise SystemExit(main())
