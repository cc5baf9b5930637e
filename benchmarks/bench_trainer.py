"""Trainer update throughput and peak memory at a real model size; the memory plan against the measured peak.

The model is SmolLM2-135M's architecture (Llama: hidden 576, 30 layers, 9 heads / 3 KV heads, vocabulary
49152, tied embeddings) built from its config with random weights: throughput and memory do not depend on the
weights. Each arm trains on the same synthetic rollout batch (rows x (prompt + response) tokens) with the real
PolicyTrainer (old-log-prob pass, then one update), in a fresh subprocess so that its peak RSS is its own. The
arms run round-robin, round after round, so that they share the machine's conditions.

    python benchmarks/bench_trainer.py --rows 4 --prompt 64 --response 64 --steps 2 --rounds 2 \
        --out benchmarks/results/bench_trainer.json

Arms: fp32; bf16 autocast with fp32 master weights; plain bf16 (weights and AdamW states in bf16); each with
and without gradient checkpointing; and LoRA rank 16 on a bf16 base.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    pad_token_id=2,
    bos_token_id=1,
    eos_token_id=2,
)

ARMS = {
    "fp32": ["model.dtype=float32", "train.autocast=none"],
    "fp32 + ckpt": ["model.dtype=float32", "train.autocast=none", "train.gradient_checkpointing=true"],
    "bf16 autocast, fp32 master": ["model.dtype=bfloat16", "train.master_weights=fp32"],
    "bf16 autocast, fp32 master + ckpt": [
        "model.dtype=bfloat16",
        "train.master_weights=fp32",
        "train.gradient_checkpointing=true",
    ],
    "bf16 plain": ["model.dtype=bfloat16", "train.master_weights=model"],
    "bf16 plain + ckpt": [
        "model.dtype=bfloat16",
        "train.master_weights=model",
        "train.gradient_checkpointing=true",
    ],
    "LoRA r16, bf16 base": ["model.dtype=bfloat16", "model.lora.rank=16", "model.lora.alpha=32"],
}
TRAINER_PARTS = ("weights", "gradients", "optimizer", "autocast_weights", "activations")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(arm: str, rows: int, prompt: int, response: int, steps: int) -> dict:
    """One arm in this process: build, train `steps` (+1 warm-up) steps, report throughput and memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bitrl.engine.config import load_config
    from bitrl.engine.models import DTYPES
    from bitrl.rollout.engine import Rollout
    from bitrl.train.lora import apply_lora
    from bitrl.train.memory import plan_memory
    from bitrl.train.trainer import PolicyTrainer

    overrides = [
        *ARMS[arm],
        "device=cpu",
        f"rollout.prompts_per_step={rows}",
        "rollout.group_size=1",
        f"rollout.max_new_tokens={response}",
        "train.updates_per_batch=1",
        "train.lr=1e-5",
    ]
    cfg = load_config(overrides=overrides)
    config = LlamaConfig(**SMOLLM2_135M)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=gen)
    response_mask = torch.arange(response)[None] < lengths[:, None]
    rollout = Rollout(
        prompt_ids=torch.randint(3, config.vocab_size, (rows, prompt), generator=gen),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(3, config.vocab_size, (rows, response), generator=gen),
        response_mask=response_mask,
        logprobs=-torch.rand(rows, response, generator=gen) * 5 * response_mask,
    )
    advantages = torch.randn(rows, generator=gen)
    baseline = rss_bytes()

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DTYPES[cfg.model.dtype])
    if cfg.model.lora.rank:
        model = apply_lora(model, cfg.model.lora)
    trainer = PolicyTrainer(model, cfg.train)
    times = []
    for step in range(steps + 1):
        metrics = trainer.step(rollout, advantages)
        if step:  # the first step warms up allocators and kernels
            times.append((metrics["old_logprobs_time_s"], metrics["update_time_s"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plan = plan_memory(cfg, config, device_bytes=1.0, prompt_tokens=prompt)
    tokens = rows * (prompt + response)
    old_s = statistics.median(t[0] for t in times)
    update_s = statistics.median(t[1] for t in times)
    return {
        "arm": arm,
        "tokens_per_update": tokens,
        "update_tokens_per_s": tokens / update_s,
        "old_logprobs_tokens_per_s": tokens / old_s,
        "update_s": update_s,
        "old_logprobs_s": old_s,
        "peak_rss_gib": peak / 2**30,
        "measured_trainer_gib": (peak - baseline) / 2**30,
        "planned_trainer_gib": sum(plan.parts.get(k, 0.0) for k in TRAINER_PARTS) / 2**30,
        "planned_parts_gib": {k: plan.parts[k] / 2**30 for k in TRAINER_PARTS if k in plan.parts},
        "trainable_params": trainer.trainable_parameters,
        "loss_finite": bool(metrics["loss"] == metrics["loss"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per arm and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--out", default="benchmarks/results/bench_trainer.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(worker(args.worker, args.rows, args.prompt, args.response, args.steps)))
        return 0
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    runs: list[dict] = []
    t0 = time.time()
    for round_ in range(args.rounds):
        for arm in args.arms:
            cmd = [sys.executable, __file__, "--worker", arm, "--rows", str(args.rows), "--prompt",
                   str(args.prompt), "--response", str(args.response), "--steps", str(args.steps),
                   "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"arm {arm!r} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": round_}
            runs.append(result)
            speed, peak = result["update_tokens_per_s"], result["peak_rss_gib"]
            print(f"[{time.time() - t0:6.0f}s] round {round_} {arm}: {speed:.0f} tok/s, peak {peak:.2f} GiB")
    summary = summarize(runs, args.arms)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("rows", "prompt", "response", "steps", "rounds", "threads")}
    out.write_text(json.dumps({"settings": meta, "summary": summary, "runs": runs}, indent=2))
    print(table(summary))
    return 0


def summarize(runs: list[dict], arms: list[str]) -> list[dict]:
    """Per arm: median throughput over rounds, its ratio to fp32 measured in the same round, peak memory."""
    by_round = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["arm"]] = r
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        same_round = [rd for rd in by_round.values() if "fp32" in rd and arm in rd]
        ratios = [rd[arm]["update_tokens_per_s"] / rd["fp32"]["update_tokens_per_s"] for rd in same_round]
        measured = statistics.median(r["measured_trainer_gib"] for r in mine)
        planned = mine[0]["planned_trainer_gib"]
        rows.append({
            "arm": arm,
            "update_tokens_per_s": statistics.median(r["update_tokens_per_s"] for r in mine),
            "old_logprobs_tokens_per_s": statistics.median(r["old_logprobs_tokens_per_s"] for r in mine),
            "speed_vs_fp32": statistics.median(ratios) if ratios else None,
            "peak_rss_gib": statistics.median(r["peak_rss_gib"] for r in mine),
            "measured_trainer_gib": measured,
            "planned_trainer_gib": planned,
            "plan_error": planned / measured - 1,
            "trainable_params": mine[0]["trainable_params"],
        })  # fmt: skip
    return rows


def table(summary: list[dict]) -> str:
    lines = [
        "| arm | update tok/s | vs fp32 (same round) | old-log-prob tok/s | peak RSS GiB "
        "| trainer GiB measured | planned | plan error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary:
        ratio = "-" if r["speed_vs_fp32"] is None else f"{r['speed_vs_fp32']:.2f}x"
        lines.append(
            f"| {r['arm']} | {r['update_tokens_per_s']:.0f} | {ratio} | "
            f"{r['old_logprobs_tokens_per_s']:.0f} | "
            f"{r['peak_rss_gib']:.2f} | {r['measured_trainer_gib']:.2f} | {r['planned_trainer_gib']:.2f} | "
            f"{100 * r['plan_error']:+.0f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
