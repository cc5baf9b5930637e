"""Study: how much of an fp32 RL run's learning a bf16 copy of its weights can see.

Loads a finished run (its config.json and checkpoint.pt, e.g. the fp32 arm of study_aligned.py) and the
model it started from, then measures, per kind of parameter (linear, embedding, norm): the fraction of the
weights whose bf16 value changed over the run, and the norm of the bf16-visible change against the fp32
change; and the held-out greedy accuracy of the start and of the trained weights in fp32 and rounded to bf16
(a bf16 rollout copy of them, computing in bf16).

    python benchmarks/study_bf16_view.py runs/study_aligned/float32-default-s0 \\
        --out benchmarks/results/study_bf16_view_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def kind_of(name: str) -> str:
    return "norm" if "norm" in name else "embedding" if "embed" in name else "linear"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a finished fp32 run directory (config.json, checkpoint.pt)")
    p.add_argument("--out", default="runs/study_bf16_view.json")
    args = p.parse_args(argv)
    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import accuracy
    from bitrl.engine.loop import build
    from bitrl.kernels.bench_stats import machine
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.train.checkpoint import load_checkpoint, load_policy_state

    run = Path(args.run)
    cfg = load_config(run / "config.json")
    if cfg.model.dtype != "float32" or cfg.model.lora.rank:
        raise SystemExit(f"{run}: needs a full fine-tuning run in float32, got {cfg.model.dtype}")
    policy, tokenizer, task = build(cfg, log=lambda *a: None)
    start = {n: t.detach().clone() for n, t in policy.state_dict().items()}
    state = load_checkpoint(run)
    load_policy_state(policy, state["policy"])
    kinds: dict = {}
    for name, w1 in policy.named_parameters():
        w0, w1 = start[name], w1.detach()
        b0, b1 = w0.bfloat16().float(), w1.bfloat16().float()
        k = kinds.setdefault(kind_of(name), {"weights": 0, "bf16_changed": 0, "fp32_sq": 0.0, "bf16_sq": 0.0})
        k["weights"] += w0.numel()
        k["bf16_changed"] += int((b0 != b1).sum())
        k["fp32_sq"] += float(((w1 - w0).double() ** 2).sum())
        k["bf16_sq"] += float(((b1 - b0).double() ** 2).sum())
    rows = {
        kind: {
            "weights": k["weights"],
            "bf16_changed_fraction": k["bf16_changed"] / k["weights"],
            "bf16_change_norm_over_fp32": (k["bf16_sq"] / k["fp32_sq"]) ** 0.5,
        }
        for kind, k in kinds.items()
    }
    all_w = sum(k["weights"] for k in kinds.values())
    rows["all"] = {
        "weights": all_w,
        "bf16_changed_fraction": sum(k["bf16_changed"] for k in kinds.values()) / all_w,
        "bf16_change_norm_over_fp32": (
            sum(k["bf16_sq"] for k in kinds.values()) / sum(k["fp32_sq"] for k in kinds.values())
        )
        ** 0.5,
    }
    problems = task.eval_problems
    acc = {"trained_fp32": accuracy(policy, tokenizer, problems, cfg)}
    acc["trained_bf16"] = accuracy(make_rollout_model(policy, "bf16"), tokenizer, problems, cfg)
    load_policy_state(policy, {n: start[n] for n in state["policy"]})
    acc["start_fp32"] = accuracy(policy, tokenizer, problems, cfg)
    acc["start_bf16"] = accuracy(make_rollout_model(policy, "bf16"), tokenizer, problems, cfg)
    out = {
        "study": "the bf16 view of an fp32 RL run's weights: what changed, and its held-out accuracy",
        "command": " ".join(["python benchmarks/study_bf16_view.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "run": str(run),
        "steps": state["step"],
        "parameters": rows,
        "accuracy": acc,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"parameters": rows, "accuracy": acc}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
