"""Trainer update throughput and peak memory at a real model size; the memory plan against the measured peak.

The model is SmolLM2-135M's architecture (Llama: hidden 576, 30 layers, 9 heads / 3 KV heads, vocabulary
49152, tied embeddings) built from its config with random weights: throughput and memory do not depend on the
weights. Each arm trains on the same synthetic rollout batch (rows x (prompt + response) tokens) with the real
PolicyTrainer (old-log-prob pass, then one update). Memory: each arm in a fresh subprocess, so that its peak
RSS is its own, compared with the memory plan's trainer parts. Throughput: all arms in one process, one step
each per round, the order rotated every round, so that they share the (busy, 2-core) machine's conditions.

    python benchmarks/bench_trainer.py --rows 4 --prompt 64 --response 64 --rounds 4 \
        --out benchmarks/results/bench_trainer.json

Arms: fp32; bf16 autocast with fp32 master weights; plain bf16 (weights and AdamW states in bf16); each with
and without gradient checkpointing; and LoRA rank 16 on a bf16 base.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 49152  # SmolLM2-135M's (bitrl.engine.models.ARCHITECTURES["smollm2-135m"])

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
    # the real-model preset's LoRA setting (model.dtype stays float32 there)
    "LoRA r16, fp32": [
        "model.dtype=float32",
        "train.autocast=none",
        "model.lora.rank=16",
        "model.lora.alpha=32",
    ],
}
TRAINER_PARTS = ("weights", "gradients", "optimizer", "autocast_weights", "activations")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def synthetic_rollout(rows: int, prompt: int, response: int, vocab: int):
    """A rollout batch of random tokens, responses of random lengths, and random advantages (seeded)."""
    import torch

    from bitrl.rollout.batch import Rollout

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=gen)
    response_mask = torch.arange(response)[None] < lengths[:, None]
    rollout = Rollout(
        prompt_ids=torch.randint(3, vocab, (rows, prompt), generator=gen),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        response_ids=torch.randint(3, vocab, (rows, response), generator=gen),
        response_mask=response_mask,
        logprobs=-torch.rand(rows, response, generator=gen) * 5 * response_mask,
    )
    return rollout, torch.randn(rows, generator=gen)


def arm_config(arm: str, rows: int, response: int):
    from bitrl.engine.config import load_config

    overrides = [
        *ARMS[arm],
        "device=cpu",
        f"rollout.prompts_per_step={rows}",
        "rollout.group_size=1",
        f"rollout.max_new_tokens={response}",
        "train.updates_per_batch=1",
        "train.lr=1e-5",
    ]
    return load_config(overrides=overrides)


def build_trainer(cfg):
    """SmolLM2-135M's architecture with random weights (seed 0), in cfg's dtype, LoRA as cfg says."""
    import torch
    from transformers import LlamaForCausalLM

    from bitrl.engine.models import DTYPES, architecture_config
    from bitrl.train.lora import apply_lora
    from bitrl.train.trainer import PolicyTrainer

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[cfg.model.dtype])  # built in its dtype: no fp32 copy in the peak
    try:
        model = LlamaForCausalLM(architecture_config("smollm2-135m"))
    finally:
        torch.set_default_dtype(default)
    if cfg.model.lora.rank:
        model = apply_lora(model, cfg.model.lora)
    return PolicyTrainer(model, cfg.train)


def worker(arm: str, rows: int, prompt: int, response: int, steps: int) -> dict:
    """One arm in this process: build, train `steps` (+1 warm-up) steps, report throughput and memory."""
    from bitrl.engine.models import architecture_config
    from bitrl.train.memory import pin_mmap_threshold, plan_memory

    cfg = arm_config(arm, rows, response)
    pin_mmap_threshold(cfg)  # as `bitrl train` does
    config = architecture_config("smollm2-135m")
    rollout, advantages = synthetic_rollout(rows, prompt, response, config.vocab_size)
    import peft  # noqa: F401  (code, not data: imported before the baseline)

    baseline = rss_bytes()
    trainer = build_trainer(cfg)
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
    }


def arm_products(arm: str, rows: int, prompt: int, response: int) -> tuple[list, str, bool]:
    """The matrix products an arm's step cannot avoid, its matmul dtype and whether the base weights train:
    ([(count, (M, K), (K, N), batch)], dtype, trains_base). Per decoder layer the seven projections and the
    causal half of attention's two batched products at rows x (prompt + response) tokens; the LM head at the
    response tokens. LoRA's own products (rank 16) are left out: the floor is a lower bound."""
    from bitrl.engine.models import architecture_config

    c = architecture_config("smollm2-135m")
    H, inter, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd, T = H // heads, prompt + response
    N = rows * T
    linears = [(H, H), (H, kv * hd), (H, kv * hd), (H, H), (H, inter), (H, inter), (inter, H)]
    products = [(L, (N, k), (k, n), 1) for k, n in linears] + [(1, (rows * response, H), (H, V), 1)]
    attention = [(L * 0.5, (T, hd), (hd, T), rows * heads), (L * 0.5, (T, T), (T, hd), rows * heads)]
    overrides = ARMS[arm.removesuffix(" + ckpt")]  # bf16 weights compute in bf16 (CPU autocast follows them)
    dtype = "bfloat16" if "model.dtype=bfloat16" in overrides else "float32"
    trains_base = not any(o.startswith("model.lora.rank=") for o in overrides)
    return products + [(count, a, b, -batch) for count, a, b, batch in attention], dtype, trains_base


def floor_seconds(products: list, dtype: str, trains_base: bool, backward: bool) -> float:
    """Seconds of torch.mm / torch.bmm alone over `products` (arm_products) in `dtype`: the forward's, and
    with `backward` also the input gradient of every product and the weight gradient of the trained ones
    (batch < 0 marks attention, whose both operands are activations and take gradients)."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for count, (m, k), (_, n), batch in products:
        lead = (abs(batch),) if batch < 0 else ()
        mul = torch.bmm if batch < 0 else torch.mm
        a, w, grad = (torch.randn(*lead, *s, generator=gen).to(dt) for s in ((m, k), (k, n), (m, n)))
        pairs = [(a, w)]
        if backward:
            pairs.append((grad, w.transpose(-1, -2)))  # d input
            if batch < 0 or trains_base:
                pairs.append((a.transpose(-1, -2), grad))  # d weight (or attention's other operand)
        for x, y in pairs:  # the faster of two calls: the first may pay for the kernel's setup
            seconds = []
            for _ in range(2):
                start = time.perf_counter()
                mul(x, y)
                seconds.append(time.perf_counter() - start)
            total += count * min(seconds)
    return total


def set_checkpointing(model, on: bool) -> None:
    if on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()


def interleaved(arms: list[str], rows: int, prompt: int, response: int, rounds: int) -> list[dict]:
    """Throughput of every arm in one process, one step per arm per round with the order rotated every
    round, so that the arms share the machine's conditions step by step. Arms that differ only in gradient
    checkpointing share one model (switched per step). Returns one record per arm and measured round."""
    rollout, advantages = synthetic_rollout(rows, prompt, response, VOCAB)
    trainers = {}
    for arm in arms:
        base = arm.removesuffix(" + ckpt")
        if base not in trainers:
            trainers[base] = build_trainer(arm_config(base, rows, response))
    tokens = rows * (prompt + response)
    records = []
    for round_ in range(rounds + 1):  # round 0 warms every arm up
        shift = round_ % len(arms)
        floors = {}  # (dtype, trains_base) -> (old-log-prob floor s, update floor s), timed in this round
        for arm in arms[shift:] + arms[:shift]:
            trainer = trainers[arm.removesuffix(" + ckpt")]
            set_checkpointing(trainer.policy, arm.endswith(" + ckpt"))
            metrics = trainer.step(rollout, advantages)
            products, dtype, trains_base = arm_products(arm, rows, prompt, response)
            if (dtype, trains_base) not in floors:
                floors[dtype, trains_base] = tuple(
                    floor_seconds(products, dtype, trains_base, backward) for backward in (False, True)
                )
            old_floor, update_floor = floors[dtype, trains_base]
            if round_:
                speed = tokens / metrics["update_time_s"]
                records.append(
                    {
                        "arm": arm,
                        "round": round_,
                        "update_tokens_per_s": speed,
                        "update_s": metrics["update_time_s"],
                        "old_logprobs_s": metrics["old_logprobs_time_s"],
                        "update_floor_s": update_floor,
                        "old_logprobs_floor_s": old_floor,
                    }
                )
                print(
                    f"interleaved round {round_} {arm}: {speed:.0f} tok/s, "
                    f"{update_floor / metrics['update_time_s']:.2f} of the update floor, "
                    f"{old_floor / metrics['old_logprobs_time_s']:.2f} of the old-log-prob floor",
                    flush=True,
                )
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1, help="measured steps of each memory run")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved throughput rounds")
    parser.add_argument("--threads", type=int, default=1)
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
    for arm in args.arms:  # memory: one fresh process per arm, so that its peak RSS is its own
        cmd = [sys.executable, __file__, "--worker", arm, "--rows", str(args.rows), "--prompt",
               str(args.prompt), "--response", str(args.response), "--steps", str(args.steps),
               "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"arm {arm!r} failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"[{time.time() - t0:6.0f}s] {arm}: peak {runs[-1]['peak_rss_gib']:.2f} GiB", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    speeds = interleaved(args.arms, args.rows, args.prompt, args.response, args.rounds)
    summary = summarize(runs, speeds, args.arms)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("rows", "prompt", "response", "steps", "rounds", "threads")}
    from bitrl.kernels.bench_stats import machine

    result = {
        "command": shlex.join(["python", "benchmarks/bench_trainer.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "settings": meta,
        "summary": summary,
        "memory_runs": runs,
        "interleaved_steps": speeds,
    }
    out.write_text(json.dumps(result, indent=2))
    print(table(summary))
    return 0


def fractions_of_floor(records: list[dict]) -> dict:
    """Median over rounds of floor seconds / measured seconds, for the update and the old-log-prob pass."""
    if not records or "update_floor_s" not in records[0]:
        return {}
    return {
        "update_fraction_of_floor": statistics.median(r["update_floor_s"] / r["update_s"] for r in records),
        "old_logprobs_fraction_of_floor": statistics.median(
            r["old_logprobs_floor_s"] / r["old_logprobs_s"] for r in records
        ),
        "update_floor_s": statistics.median(r["update_floor_s"] for r in records),
        "old_logprobs_floor_s": statistics.median(r["old_logprobs_floor_s"] for r in records),
    }


def summarize(runs: list[dict], speeds: list[dict], arms: list[str]) -> list[dict]:
    """Per arm: median interleaved throughput, the median over rounds of its ratio to fp32 in the same
    round, and the peak memory of its own process against the memory plan."""
    by_round: dict = {}
    for r in speeds:
        by_round.setdefault(r["round"], {})[r["arm"]] = r["update_tokens_per_s"]
    rows = []
    for arm in arms:
        mem = next(r for r in runs if r["arm"] == arm)
        ratios = [rd[arm] / rd["fp32"] for rd in by_round.values() if "fp32" in rd and arm in rd]
        rows.append(
            {
                "arm": arm,
                "update_tokens_per_s": statistics.median(rd[arm] for rd in by_round.values() if arm in rd),
                "speed_vs_fp32": statistics.median(ratios) if ratios else None,
                "speed_vs_fp32_range": [min(ratios), max(ratios)] if ratios else None,
                **fractions_of_floor([r for r in speeds if r["arm"] == arm]),
                "peak_rss_gib": mem["peak_rss_gib"],
                "measured_trainer_gib": mem["measured_trainer_gib"],
                "planned_trainer_gib": mem["planned_trainer_gib"],
                "plan_error": mem["planned_trainer_gib"] / mem["measured_trainer_gib"] - 1,
                "trainable_params": mem["trainable_params"],
            }
        )
    return rows


def table(summary: list[dict]) -> str:
    lines = [
        "| arm | update tok/s | vs fp32 (median, range over rounds) | peak RSS GiB "
        "| trainer GiB measured | planned | plan error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary:
        lo, hi = r["speed_vs_fp32_range"] or (0, 0)
        ratio = "-" if r["speed_vs_fp32"] is None else f"{r['speed_vs_fp32']:.2f}x ({lo:.2f}-{hi:.2f})"
        lines.append(
            f"| {r['arm']} | {r['update_tokens_per_s']:.0f} | {ratio} | "
            f"{r['peak_rss_gib']:.2f} | {r['measured_trainer_gib']:.2f} | {r['planned_trainer_gib']:.2f} | "
            f"{100 * r['plan_error']:+.0f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
