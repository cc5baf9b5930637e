"""Study: QeRL on SmolLM2-135M-Instruct (the smollm2-qerl preset: LoRA rank 16 on a frozen 4-bit base shared
by trainer and rollout, AQN on both) against full-precision LoRA at the same rank and settings, paired by
seed: held-out greedy accuracy (before training and over the steps), reward, flat groups and the mismatch.

    python benchmarks/study_qerl.py --seeds 0 --steps 10 --out benchmarks/results/study_qerl_smollm2.json
    python benchmarks/study_qerl.py --arms lora-full qerl-nvfp4 --seeds 0 1     # a subset
    python benchmarks/study_qerl.py --arms qerl-nvfp4-gptq --seeds 0 1 --merge  # runs added to --out
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# arm -> overrides of the smollm2-qerl preset
ARMS = {
    "lora-full": ["model.lora.base_precision=full", "rollout.aqn_stages=0"],
    "qerl-nvfp4": [],
    "qerl-mxfp4": ["model.lora.base_precision=mxfp4"],
    "qerl-nvfp4-no-aqn": ["rollout.aqn_stages=0"],
    # the base GPTQ-rounded once, on the warm policy's own samples (64 prompts for nvfp4, 256 for mxfp4)
    "qerl-nvfp4-gptq": ["rollout.gptq=true"],
    "qerl-mxfp4-gptq": ["model.lora.base_precision=mxfp4", "rollout.gptq=true"],
}
KEYS = ("reward_mean", "flat_group_frac", "mismatch_k3_kl", "mismatch_max_abs_dp", "aqn_sigma", "step_time_s")


def run_one(arm: str, seed: int, steps: int, out: Path, extra: list[str] = ()) -> dict:
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run
    from bitrl.engine.train_cmd import preset_path
    from bitrl.kernels.bench_stats import machine

    name = f"{arm}-s{seed}"
    overrides = [f"name={name}", f"out_dir={out}", f"seed={seed}", f"steps={steps}", "eval_every=5"]
    overrides += [f"checkpoint_every={steps}", *ARMS[arm], *extra]
    start = time.perf_counter()
    cfg = load_config(preset_path("smollm2-qerl"), overrides)
    rows = run(cfg, log=lambda *_: None, force=True)
    return {
        "arm": arm,
        "seed": seed,
        "overrides": [*ARMS[arm], *extra],
        "wall_s": time.perf_counter() - start,
        "machine": machine(),
        "model_dtype": cfg.model.dtype,  # "auto" resolved on this machine: bf16 where the CPU has bf16 units
        "per_step": [{k: r.get(k) for k in KEYS} for r in rows if "reward_mean" in r],
        "accuracy": [(r["step"], r["accuracy"]) for r in rows if "accuracy" in r],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--runs", default="runs/study_qerl")
    p.add_argument("--out", default="runs/study_qerl.json")
    p.add_argument("--merge", action="store_true", help="add the runs to --out's (each keeps its machine)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides, every arm")
    args = p.parse_args(argv)
    from bitrl.kernels.bench_stats import machine

    command = " ".join(["python benchmarks/study_qerl.py", *(argv or sys.argv[1:])])
    if args.merge and Path(args.out).exists():
        out = json.loads(Path(args.out).read_text())
        done = {(r["arm"], r["seed"], tuple(r["overrides"])) for r in out["runs"]}
        if any((a, s, (*ARMS[a], *args.set)) in done for a in args.arms for s in args.seeds):
            raise SystemExit(f"{args.out} already holds one of these runs; leave it out of --arms/--seeds")
    else:
        out = {
            "study": "QeRL (LoRA on a shared 4-bit base, AQN on both) against full-precision LoRA, "
            "SmolLM2-135M",
            "command": command,
            "machine": machine(),
            "runs": [],
        }
    for seed in args.seeds:
        for arm in args.arms:
            result = run_one(arm, seed, args.steps, Path(args.runs), args.set)
            out["runs"].append({**result, "command": command})
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(arm, seed, json.dumps(out["runs"][-1]["accuracy"]), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
