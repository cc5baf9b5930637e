"""Study: RL on SmolLM2-135M-Instruct in bf16 (the smollm2-add preset, model.dtype=bfloat16: a bf16 rollout
copy, the trainer's fp32 master weights under bf16 autocast) with rollout.aligned off and on, paired by seed,
under TIS: the mismatch every step, the correction's weights, reward and held-out accuracy. With
`--dtype float32 --arms off` the same runs in fp32, the baseline bf16 is measured against.

    python benchmarks/study_aligned.py --seeds 0 1 --steps 10 --out benchmarks/results/study_aligned.json
    python benchmarks/study_aligned.py --seeds 0 1 --steps 10 --dtype float32 --arms off \\
        --out benchmarks/results/study_fp32_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("reward_mean", "flat_group_frac", "mismatch_k3_kl", "mismatch_max_abs_dp")
KEYS += ("is_weight_min", "is_weight_max")


def run_one(seed: int, aligned: bool, steps: int, out: Path, dtype: str) -> dict:
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run
    from bitrl.engine.train_cmd import preset_path

    name = f"{dtype}-{'aligned' if aligned else 'default'}-s{seed}"
    overrides = [f"name={name}", f"out_dir={out}", f"seed={seed}", f"steps={steps}", "eval_every=5"]
    overrides += [f"checkpoint_every={steps}", f"model.dtype={dtype}", "train.loss.correction=tis"]
    overrides += [f"rollout.aligned={str(aligned).lower()}"]
    rows = run(load_config(preset_path("smollm2-add"), overrides), log=lambda *_: None, force=True)
    steps_rows = [r for r in rows if "reward_mean" in r]
    evals = [(r["step"], r["accuracy"]) for r in rows if "accuracy" in r]
    return {
        "seed": seed,
        "dtype": dtype,
        "aligned": aligned,
        "per_step": [{k: r.get(k) for k in KEYS} for r in steps_rows],
        "accuracy": evals,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--arms", nargs="*", default=["off", "on"], choices=["off", "on"], help="rollout.aligned")
    p.add_argument("--runs", default="runs/study_aligned")
    p.add_argument("--out", default="runs/study_aligned.json")
    args = p.parse_args(argv)
    from bitrl.kernels.bench_stats import machine

    out = {
        "study": f"rollout.aligned {' and '.join(args.arms)}, SmolLM2-135M-Instruct {args.dtype}, "
        "smollm2-add preset, TIS",
        "command": " ".join(["python benchmarks/study_aligned.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "runs": [],
    }
    for seed in args.seeds:
        for arm in args.arms:
            out["runs"].append(run_one(seed, arm == "on", args.steps, Path(args.runs), args.dtype))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(json.dumps(out["runs"][-1]["accuracy"]), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
