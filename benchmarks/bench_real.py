"""Benchmark: RL on a real pretrained model (a preset, by default `smollm2-add`: SmolLM2-135M-Instruct on
addition word problems) for each rollout precision and mismatch correction, paired by seed.

    python benchmarks/bench_real.py                                   # the full sweep (hours on a CPU)
    python benchmarks/bench_real.py --precisions full --corrections none --seeds 0    # the preset alone
    python benchmarks/bench_real.py --steps 3 --n-eval 16 --precisions full fp8 nvfp4 mxfp4 \\
        --set rollout.prompts_per_step=4                              # a reduced sweep
    python benchmarks/bench_real.py --arms full:none nvfp4:none nvfp4:ais --seeds 0    # chosen pairs

Each run is a separate process (`--one`), so its peak RSS is its own. Writes --out (JSON): per run
the settings, wall time (model conversion included when the cache is cold), peak RSS, held-out greedy
accuracy before and after, and the rollout/trainer mismatch of every step (k3 per token, ESS, ...).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = ["full", "fp8", "nvfp4", "mxfp4"]
# Registered names (kernels/policy_loss/corrections.py, CORRECTIONS), each with its usual defaults.
CORRECTIONS = ["none", "tis", "seq-mis", "icepop", "ais"]
STEP_KEYS = [
    "mismatch_k3_kl",
    "mismatch_ess",
    "mismatch_chi2_token",
    "reward_mean",
    "flat_group_frac",
    "step_time_s",
]


def run_one(spec: dict) -> dict:
    """Train one configuration in this process; returns its summary."""
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run
    from bitrl.engine.train_cmd import preset_path
    from bitrl.kernels.bench_stats import machine

    t0 = time.perf_counter()
    cfg = load_config(preset_path(spec["preset"]), spec["overrides"])
    records = run(cfg, log=lambda msg: print(msg, file=sys.stderr))
    evals = [r for r in records if "accuracy" in r]
    return {
        **spec,
        "machine": machine(),
        "model_dtype": cfg.model.dtype,  # "auto" resolved on this machine: bf16 where the CPU has bf16 units
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "accuracy_start": evals[0]["accuracy"],
        "accuracy_end": evals[-1]["accuracy"],
        "accuracy_curve": [(r["step"], r["accuracy"]) for r in evals],
        "steps": [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}} for r in records[1:]],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="smollm2-add")
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--corrections", nargs="+", default=CORRECTIONS)
    parser.add_argument(
        "--arms", nargs="+", metavar="PRECISION:CORRECTION", help="run these pairs, not the product"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--n-eval", type=int, default=None, help="held-out problems; default: the preset's")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--out", default="benchmarks/results/bench_real.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a JSON run spec: run it here, print its summary
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_dir = Path("runs") / "bench_real"
    if args.arms:
        bad = [a for a in args.arms if a.count(":") != 1]
        if bad:
            parser.error(f"--arms takes PRECISION:CORRECTION pairs, got {bad}")
        arms = [tuple(a.split(":")) for a in args.arms]
    else:  # corrections only matter where rollout and trainer differ
        arms = [(p, c) for p in args.precisions for c in (args.corrections if p != "full" else ["none"])]
    # Runs already in --out with the same settings are kept, not rerun, so a sweep can be extended (more
    # seeds, more arms) or resumed after an interruption.
    results = json.loads(out.read_text()) if out.exists() else []
    done_overrides = [r["overrides"] for r in results]
    for seed in args.seeds:
        for precision, correction in arms:
            name = f"{precision}-{correction}-s{seed}"
            overrides = [
                f"seed={seed}",
                f"rollout.precision={precision}",
                f"train.loss.correction={correction}",
                f"name={name}",
                f"out_dir={runs_dir}",
                *([f"steps={args.steps}", f"eval_every={args.steps}"] if args.steps else []),
                *([f"task.n_eval={args.n_eval}"] if args.n_eval else []),
                *args.set,
            ]
            if overrides in done_overrides:
                print(f"{name}: already in {out}", flush=True)
                continue
            spec = {"preset": args.preset, "precision": precision, "correction": correction, "seed": seed}
            spec["command"] = "python benchmarks/bench_real.py " + " ".join(
                sys.argv[1:] if argv is None else argv
            )
            spec["overrides"] = overrides
            done = subprocess.run(
                [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True
            )
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            result = json.loads(done.stdout.strip().splitlines()[-1])
            k3 = [s.get("mismatch_k3_kl") for s in result["steps"]]
            print(
                f"{name}: accuracy {result['accuracy_start']:.3f} -> {result['accuracy_end']:.3f}, "
                f"k3/token {k3}, {result['wall_s']} s, peak RSS {result['peak_rss_mib']} MiB",
                flush=True,
            )
            results.append(result)
            out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
