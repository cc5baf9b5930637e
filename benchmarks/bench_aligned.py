"""The matched-precision mode's price and what it buys, on SmolLM2-135M-Instruct (rollout.aligned).

For each dtype (fp32: fp32 rollout copy and trainer; bf16: bf16 rollout copy, trainer with fp32 master
weights under bf16 autocast, as the real runs), the default path and the aligned one, side by side in one
process and alternated, best of --repeats:
- the mismatch of the rollout's log-probs against the trainer's old-log-prob pass on the same tokens (k3,
  max |d log p|), 16 word-problem chat prompts x 4 samples, --new-tokens tokens, T 0.7, EOS off;
- the rollout's time, the trainer's old-log-prob pass and its update (forward + backward + AdamW at lr 1e-12,
  so the weights stay put between rounds).

    python benchmarks/bench_aligned.py --out benchmarks/results/bench_aligned.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def measure(policy, tokenizer, cfg, prompts, dtype: str, aligned: bool, new_tokens: int) -> dict:
    from bitrl.engine.config import TrainConfig
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.rollout.settings import EngineOptions, Sampling
    from bitrl.train.mismatch import mismatch_diagnostics
    from bitrl.train.trainer import PolicyTrainer

    copy = make_rollout_model(policy, "bf16" if dtype == "bf16" else "full")
    # EOS off: every row decodes the whole budget, so both paths run the same steps
    sampling = Sampling(max_new_tokens=new_tokens, eos_id=-1, pad_id=tokenizer.pad_token_id, temperature=0.7)
    engine = RolloutEngine(copy, sampling, EngineOptions(max_batch_rows=64, aligned=aligned))
    start = time.perf_counter()
    rollout = engine.generate(prompts, generator=torch.Generator().manual_seed(0))
    rollout_s = time.perf_counter() - start
    train_cfg = TrainConfig(
        lr=1e-12, updates_per_batch=1, minibatches=1, autocast="bf16" if dtype == "bf16" else "none"
    )
    trainer = PolicyTrainer(policy, train_cfg, temperature=0.7, aligned=aligned)
    start = time.perf_counter()
    old = trainer.old_logprobs(rollout)
    old_s = time.perf_counter() - start
    metrics = trainer.step(rollout, torch.linspace(-1, 1, len(prompts)))
    mism = mismatch_diagnostics(old, rollout.logprobs, rollout.response_mask)
    return {
        "dtype": dtype,
        "aligned": aligned,
        "tokens": int(rollout.response_mask.sum()),
        "rollout_s": rollout_s,
        "old_logprobs_s": old_s,
        "update_s": metrics["update_time_s"],
        "k3": mism["mismatch_k3_kl"],
        "max_abs_dlogp": float((old - rollout.logprobs)[rollout.response_mask].abs().max()),
        "ess": mism["mismatch_ess"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/bench_aligned.json")
    args = p.parse_args(argv)
    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build
    from bitrl.kernels.bench_stats import machine

    cfg = load_config(Path(__file__).resolve().parent.parent / "engine" / "presets" / "smollm2-add.yaml")
    policy, tokenizer, task = build(cfg)
    policy.eval()
    rng = random.Random(0)
    prompts = encode_prompts(tokenizer, [task.sample(rng) for _ in range(16)], cfg.task)
    prompts = [p for p in prompts for _ in range(4)]
    out = {
        "benchmark": "rollout.aligned on SmolLM2-135M-Instruct: mismatch and time, default against aligned",
        "command": "python benchmarks/bench_aligned.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": f"16 prompts x 4 samples, {args.new_tokens} new tokens, T 0.7, EOS off, 64 rows",
        "runs": [],
        "summary": {},
    }
    for dtype in args.dtypes:
        for _ in range(args.repeats):
            for aligned in (False, True):
                row = measure(policy, tokenizer, cfg, prompts, dtype, aligned, args.new_tokens)
                print(json.dumps(row), flush=True)
                out["runs"].append(row)
        for aligned in (False, True):
            rows = [r for r in out["runs"] if r["dtype"] == dtype and r["aligned"] == aligned]
            best = {k: min(r[k] for r in rows) for k in ("rollout_s", "old_logprobs_s", "update_s")}
            out["summary"][f"{dtype}-{'aligned' if aligned else 'default'}"] = best | {
                "k3": rows[-1]["k3"],
                "max_abs_dlogp": rows[-1]["max_abs_dlogp"],
            }
        base, mode = out["summary"][f"{dtype}-default"], out["summary"][f"{dtype}-aligned"]
        out["summary"][f"{dtype}-price"] = {
            "rollout": mode["rollout_s"] / base["rollout_s"],
            "trainer": (mode["old_logprobs_s"] + mode["update_s"])
            / (base["old_logprobs_s"] + base["update_s"]),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
