"""Speculative rollout reuse: rollout cost and held-out accuracy with reuse versus without.

Every arm trains the demo (warm-started, cached under $BITRL_CACHE), or the run of a shipped preset
(`--preset NAME`, e.g. the real model on long worked answers), for the same number of epochs over the same
fixed prompt set, with the same seeds; arms differ only in `rollout.reuse`. Arms run one after another in one
process, seed by seed, so their timings share the machine's conditions.

    python benchmarks/bench_reuse.py --epochs 6 --seeds 0 1 --out runs/bench_reuse
    python benchmarks/bench_reuse.py --preset smollm2-add-work --epochs 4 --prompts 8 --prompts-per-step 4 \
        --arms "no reuse" "exact l=1" --set rollout.group_size=4 task.n_eval=32 --out runs/reuse_long

writes results.json and table.md into --out (its smoke test: tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bitrl.kernels.bench_stats import mean_ci95


def _reuse(mode: str, lenience: float, refresh_flat: bool = True) -> list[str]:
    return [
        "rollout.reuse.enabled=true",
        f"rollout.reuse.mode={mode}",
        f"rollout.reuse.lenience={lenience}",
        f"rollout.reuse.refresh_flat={str(refresh_flat).lower()}",
    ]


# arm name -> config overrides. Every arm prefills each distinct prompt once and drops finished rows from
# the decode batch (the engine always does), so the arms differ only in what the drafts save. Reuse arms
# refresh signal-free groups (the default) unless they say "no refresh". Exact mode with lenience < 1
# accepts less of each draft: it stays exact and trades speed for fresher samples.
ARMS = {
    "no reuse": ["rollout.reuse.enabled=false"],
    "exact l=1": _reuse("exact", 1.0),
    "spec-rl l=1": _reuse("spec-rl", 1.0),
    "exact l=1, no refresh": _reuse("exact", 1.0, refresh_flat=False),
    "spec-rl l=1, no refresh": _reuse("spec-rl", 1.0, refresh_flat=False),
    "exact l=0.8": _reuse("exact", 0.8),
    "exact l=0.5": _reuse("exact", 0.5),
    "spec-rl l=e^0.5": _reuse("spec-rl", math.exp(0.5)),
    "spec-rl l=2": _reuse("spec-rl", 2.0),
    "spec-rl l=4": _reuse("spec-rl", 4.0),
}


@contextlib.contextmanager
def counting_forwards(model):
    """Counts the model's passes and the tokens they carry (padding included) while the block runs: yields
    a dict {"forwards": n, "tokens": n}. Counted at the token embedding, where every pass of the rollout
    engine (prefill, verification, decode step) starts."""
    count = {"forwards": 0, "tokens": 0}

    def hook(module, args, output):
        count["forwards"] += 1
        count["tokens"] += args[0].numel()

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


class RolloutClock:
    """Wall and thread CPU time of every rollout call of the loop. With threads=1 the CPU time of the calling
    thread is the rollout's compute, whatever else runs on the machine; it is the figure to compare."""

    def __init__(self):
        self.calls: list[tuple[float, float]] = []
        self.forwards: list[int] = []  # sequential model calls per rollout (what bounds latency on a GPU)
        self.tokens: list[int] = []  # tokens through the model per rollout (what bounds a CPU's time)
        self.generated: list[int] = []  # response tokens sampled afresh (the rest are accepted drafts)
        self.returned: list[int] = []  # response tokens returned
        self.rows: list[int] = []

    def wrap(self, fn):
        """`fn` (RolloutEngine.generate or SpeculativeReuse.generate), timed and counted."""
        from bitrl.rollout.generation import RolloutEngine

        def timed(*a, **k):
            engine = next(x for x in a if isinstance(x, RolloutEngine))
            w, c = time.perf_counter(), time.thread_time()
            with counting_forwards(engine.model) as count:
                out = fn(*a, **k)
            self.calls.append((time.perf_counter() - w, time.thread_time() - c))
            self.forwards.append(count["forwards"])
            self.tokens.append(count["tokens"])
            # SpeculativeReuse.generate returns (rollout, its metrics); plain generation samples every token
            rollout, metrics = out if isinstance(out, tuple) else (out, {})
            returned = int(rollout.response_mask.sum())
            self.returned.append(returned)
            self.generated.append(metrics.get("reuse_tokens_generated", returned))
            self.rows.append(rollout.response_mask.shape[0])
            return out

        return timed


def run_arm(name, arm, seed, args, out: Path) -> dict:
    import bitrl.engine.loop as loop
    from bitrl.engine.config import load_config
    from bitrl.engine.train_cmd import preset_path
    from bitrl.rollout.reuse import SpeculativeReuse

    clock = RolloutClock()
    plain, reuse_generate = loop.RolloutEngine, SpeculativeReuse.generate

    class TimedEngine(plain):  # the loop's rollouts (its evaluation builds an engine of its own)
        generate = clock.wrap(plain.generate)

    loop.RolloutEngine = TimedEngine
    SpeculativeReuse.generate = clock.wrap(reuse_generate)

    steps_per_epoch = args.prompts // args.prompts_per_step
    overrides = [
        f"seed={seed}",
        f"steps={steps_per_epoch * args.epochs}",
        f"eval_every={steps_per_epoch}",
        f"checkpoint_every={steps_per_epoch * args.epochs}",
        f"threads={args.threads}",
        f"rollout.fixed_prompts={args.prompts}",
        f"rollout.prompts_per_step={args.prompts_per_step}",
        f"out_dir={json.dumps(str(out / 'runs'))}",
        f"name=s{seed}-{name.replace(' ', '_').replace('^', '')}",
        *arm,
        *args.set,
    ]
    cfg = load_config(preset_path(args.preset) if args.preset else None, overrides)
    t0 = time.perf_counter()
    try:
        records = loop.run(cfg, log=lambda *a: None)
    finally:
        loop.RolloutEngine, SpeculativeReuse.generate = plain, reuse_generate
    wall = time.perf_counter() - t0
    steps = [r for r in records if r["step"] > 0]
    assert len(clock.calls) == len(steps)
    cpu = [c for _, c in clock.calls]
    first, later = cpu[:steps_per_epoch], cpu[steps_per_epoch:]
    wall_later = [w for w, _ in clock.calls[steps_per_epoch:]]
    later_calls = slice(steps_per_epoch, None)
    evals = [r["accuracy"] for r in records if "accuracy" in r]
    out_row = {
        "arm": name,
        "seed": seed,
        "rollout_s_epoch1": sum(first),
        "rollout_s_later_per_epoch": sum(later) / max(1, args.epochs - 1),
        "rollout_wall_s_later_per_epoch": sum(wall_later) / max(1, args.epochs - 1),
        "forwards_per_rollout_later": statistics.fmean(clock.forwards[steps_per_epoch:]),
        "model_tokens_per_rollout_later": statistics.fmean(clock.tokens[steps_per_epoch:]),
        "generated_per_rollout_later": statistics.fmean(clock.generated[later_calls]),
        "returned_per_rollout_later": statistics.fmean(clock.returned[later_calls]),
        "rollout_wall_s_per_rollout_later": statistics.fmean(wall_later),
        "rollout_cpu_s_per_rollout_later": statistics.fmean(later),
        # mean response length over every rollout, the first epoch's fresh samples included
        "response_tokens_mean": sum(clock.returned) / sum(clock.rows),
        "response_tokens_mean_epoch1": sum(clock.returned[:steps_per_epoch])
        / sum(clock.rows[:steps_per_epoch]),
        "rows_per_rollout": clock.rows[0],
        "accuracy_start": evals[0],
        "accuracy_end": evals[-1],
        "accuracy_per_epoch": evals,
        "reward_later": statistics.fmean(r["reward_mean"] for r in steps[steps_per_epoch:]),
        "flat_groups_later": statistics.fmean(r["flat_group_frac"] for r in steps[steps_per_epoch:]),
        "wall_s": wall,
    }
    if "reuse_hit_rate" in steps[-1]:
        later_recs = steps[steps_per_epoch:]
        out_row |= {
            "accept_len_mean": statistics.fmean(r.get("reuse_accept_len_mean", 0.0) for r in later_recs),
            "full_reuse_frac": statistics.fmean(r["reuse_full_frac"] for r in later_recs),
            "generated_over_returned": sum(r["reuse_tokens_generated"] for r in later_recs)
            / max(1, sum(r["reuse_tokens_returned"] for r in later_recs)),
            "verify_s_later_per_epoch": sum(r["reuse_verify_time_s"] for r in later_recs)
            / max(1, args.epochs - 1),
            "decode_steps_later_mean": statistics.fmean(r["reuse_decode_steps"] for r in later_recs),
        }
    return out_row


CPU, WALL, TOKENS = (
    "rollout_s_later_per_epoch",
    "rollout_wall_s_later_per_epoch",
    "model_tokens_per_rollout_later",
)


def late_accuracy(row: dict) -> float:
    """Mean held-out accuracy over the evaluations of the second half of training (one per epoch, the first
    before any RL): it damps the run-to-run chaos of a single evaluation, so arms are compared on it."""
    evals = row["accuracy_per_epoch"]
    return statistics.fmean(evals[len(evals) // 2 + 1 :] or evals[-1:])


def table(rows: list[dict]) -> str:
    """One line per arm: means ± std over seeds, and the held-out accuracy gap to no reuse paired by seed."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    base = {r["seed"]: r for r in rows if r["arm"] == "no reuse"}

    def fmt(values, digits=2):
        values = list(values)
        mean = statistics.fmean(values)
        spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
        return f"{mean:.{digits}f}{spread}"

    lines = [
        "| arm | seeds | rollout CPU s / epoch, epochs 2+ | CPU speedup | wall speedup "
        "| sequential forwards / rollout | model tokens / rollout | held-out acc, late mean "
        "| gap to no reuse (points, 95% CI) | groups without signal | generated / returned tokens "
        "| fully reused drafts | mean accepted len |",
        "|---" * 13 + "|",
    ]
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        paired = [r for r in rs if r["seed"] in base]
        speed = [base[r["seed"]][CPU] / r[CPU] for r in paired]
        wall_speed = [base[r["seed"]][WALL] / r[WALL] for r in paired]
        gaps = [100 * (late_accuracy(r) - late_accuracy(base[r["seed"]])) for r in paired]
        gap = "–"
        if arm != "no reuse" and len(gaps) >= 2:
            gap = "{:+.1f} ± {:.1f}".format(*mean_ci95(gaps))
        extra = ["–", "–", "–"]
        if "accept_len_mean" in rs[0]:
            extra = [
                fmt(r["generated_over_returned"] for r in rs),
                fmt(r["full_reuse_frac"] for r in rs),
                fmt(r["accept_len_mean"] for r in rs),
            ]
        lines.append(
            f"| {arm} | {len(rs)} | {fmt(r['rollout_s_later_per_epoch'] for r in rs)} | "
            f"{fmt(speed) if speed else '–'}x | {fmt(wall_speed) if wall_speed else '–'}x | "
            f"{fmt([r['forwards_per_rollout_later'] for r in rs], 1)} | "
            f"{fmt((r[TOKENS] for r in rs), 0) if all(TOKENS in r for r in rs) else '–'} | "
            f"{fmt(map(late_accuracy, rs), 3)} | {gap} | "
            f"{fmt(r['flat_groups_later'] for r in rs)} | " + " | ".join(extra) + " |"
        )
    return "\n".join(lines)


PER_ROLLOUT = (  # (field, column) of the per-rollout table, epochs 2+; "fewer" columns are base / arm
    ("forwards_per_rollout_later", "sequential forwards"),
    ("generated_per_rollout_later", "generated tokens"),
    ("rollout_wall_s_per_rollout_later", "wall s"),
    ("rollout_cpu_s_per_rollout_later", "CPU s"),
)


def per_rollout_table(rows: list[dict]) -> str:
    """One line per arm, per rollout after the first epoch: sequential decode forwards, generated tokens and
    rollout time (mean ± sd over seeds), each with its ratio no-reuse / arm paired by seed (mean ± the
    half-width of its 95% CI over seeds, when there are two or more), plus the mean response length, the
    held-out accuracy (mean ± sd) and its gap to no reuse (mean ± 95% CI)."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    base = {r["seed"]: r for r in rows if r["arm"] == "no reuse"}

    def ci(values, digits=2, unit="", spread=mean_ci95):
        if len(values) < 2:
            return f"{statistics.fmean(values):.{digits}f}{unit}" if values else "–"
        mean, half = spread(values)
        return f"{mean:.{digits}f}{unit} ± {half:.{digits}f}"

    def sd(values, digits):
        return ci(values, digits, spread=lambda v: (statistics.fmean(v), statistics.stdev(v)))

    def ratio(base_values, arm_values):
        """no reuse / arm per seed; where an arm needed none of it (every draft accepted: no decode step, no
        generated token), the seeds' totals instead, as the per-seed ratio is infinite there."""
        if all(v > 0 for v in arm_values):
            return ci([b / v for b, v in zip(base_values, arm_values)], 2, "x")
        none = sum(v == 0 for v in arm_values)
        total = f"{sum(base_values) / sum(arm_values):.2f}x" if sum(arm_values) else "∞"
        return f"{total} (seed totals; ∞ in {none} of {len(arm_values)} seeds)"

    head = ["arm", "seeds", "response tokens, mean"]
    for _, column in PER_ROLLOUT:
        head += [f"{column} / rollout", f"{column}: no reuse / arm"]
    head += ["held-out acc, late mean", "gap to no reuse (points, 95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        paired = [r for r in rs if r["seed"] in base]
        cells = [arm, str(len(rs)), f"{statistics.fmean(r['response_tokens_mean'] for r in rs):.1f}"]
        for field, _ in PER_ROLLOUT:
            digits = 1 if "forwards" in field else 0 if "generated" in field else 2
            cells.append(sd([r[field] for r in rs], digits))
            cells.append(ratio([base[r["seed"]][field] for r in paired], [r[field] for r in paired]))
        gaps = [100 * (late_accuracy(r) - late_accuracy(base[r["seed"]])) for r in paired]
        cells.append(sd([late_accuracy(r) for r in rs], 3))
        cells.append("–" if arm == "no reuse" else ci(gaps, 1))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(rows: list[dict]) -> str:
    """The main table, and the per-rollout one where the rows have its fields (results of older versions of
    this benchmark do not)."""
    text = table(rows)
    if all("generated_per_rollout_later" in r for r in rows):
        text += "\n\nPer rollout, epochs 2+:\n\n" + per_rollout_table(rows)
    return text


def verification_cost(threads: int = 1, overrides: list[str] = (), reps: int = 20) -> dict:
    """The floor of reuse on this machine: rollout time when every draft is accepted (drafts sampled by the
    same policy, so nothing is left to decode), against fresh generation and against the shared prompt
    prefill alone. Demo model after its warm start, prompts_per_step x group_size rows (config `overrides`
    change them: `warmstart.steps=0 rollout.max_new_tokens=64` gives long responses from an untrained
    model). Returns milliseconds per rollout: CPU time of the calling thread on a CPU, synchronised wall time
    on a GPU; and the sequential model forwards and the tokens through the model per rollout."""
    import random

    import torch

    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build
    from bitrl.engine.warmstart import warm_start
    from bitrl.rollout.batch import distinct_prompts
    from bitrl.rollout.decoder import prefill
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.reuse import generate_with_drafts
    from bitrl.rollout.settings import Sampling

    torch.set_num_threads(threads)
    cfg = load_config(None, list(overrides))
    policy, tokenizer, task = build(cfg)
    warm_start(policy, tokenizer, task, cfg, log=lambda *a: None)
    policy.eval()
    device = next(policy.parameters()).device
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(cfg.rollout.prompts_per_step)]
    prompts = encode_prompts(
        tokenizer, [p for p in problems for _ in range(cfg.rollout.group_size)], cfg.task
    )
    sampling = Sampling(
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    engine = RolloutEngine(policy, sampling)
    generator = torch.Generator(device).manual_seed(0)
    _, _, drafts = generate_with_drafts(engine, prompts, [None] * len(prompts), generator=generator)
    cuda = device.type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.thread_time()

    def measure(fn) -> tuple[float, dict]:
        fn()  # warm-up
        with counting_forwards(policy) as count:
            t = clock()
            for _ in range(reps):
                fn()
            elapsed = clock() - t
        return 1e3 * elapsed / reps, {k: v // reps for k, v in count.items()}

    fresh_ms, fresh = measure(lambda: engine.generate(prompts, generator=generator))
    reuse_ms, reuse = measure(lambda: generate_with_drafts(engine, prompts, drafts, generator=generator))

    def prompt_prefill():  # what generate runs before its first token: each distinct prompt once
        ids, mask, _ = distinct_prompts(prompts, tokenizer.pad_token_id, device)
        options = engine.options
        distinct = [p[m].tolist() for p, m in zip(ids, mask)]
        prefill(engine.decoder, distinct, options.max_batch_rows, options.kv_cache_dtype)

    prefill_ms, _ = measure(prompt_prefill)
    return {
        "device": str(device),
        "rows": len(prompts),
        "mean_response_tokens": sum(d.num_tokens for d in drafts) / len(drafts),
        "max_response_tokens": max(d.num_tokens for d in drafts),
        "fresh_generation_ms": fresh_ms,
        "all_drafts_accepted_ms": reuse_ms,
        "prompt_prefill_ms": prefill_ms,
        "speedup_all_accepted": fresh_ms / reuse_ms,
        "forwards_fresh": fresh["forwards"],
        "forwards_all_accepted": reuse["forwards"],
        "model_tokens_fresh": fresh["tokens"],
        "model_tokens_all_accepted": reuse["tokens"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=128, help="size of the fixed prompt set")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--preset", help="run this shipped preset (engine/presets/NAME.yaml) instead of the demo"
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides, section.key=value")
    parser.add_argument("--out", default="runs/bench_reuse")
    parser.add_argument(
        "--verification-cost", action="store_true", help="only time a rollout whose drafts are all accepted"
    )
    parser.add_argument("--reps", type=int, default=20, help="with --verification-cost: timed rollouts")
    parser.add_argument(
        "--json-line", metavar="PATH", help="with --verification-cost: also append it to PATH as one line"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="PATH",
        help="only tabulate these results.json files (or the results.json of these folders) into --out",
    )
    args = parser.parse_args(argv)
    if args.verification_cost:
        result = verification_cost(args.threads, args.set, args.reps)
        print(json.dumps(result, indent=1))
        if args.json_line:
            with open(args.json_line, "a") as f:
                f.write(json.dumps(result) + "\n")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        paths = [Path(d) / "results.json" if Path(d).is_dir() else Path(d) for d in args.merge]
        runs = [json.loads(path.read_text()) for path in paths]
        # one row per (arm, seed): a later folder's run replaces an earlier one's
        rows = list({(row["arm"], row["seed"]): row for r in runs for row in r["rows"]}.values())
        (out / "results.json").write_text(json.dumps({"merged": args.merge, "rows": rows}, indent=1))
        (out / "table.md").write_text(tables(rows) + "\n")
        print(tables(rows))
        return 0
    rows = []
    for seed in args.seeds:
        for name in args.arms:
            row = run_arm(name, ARMS[name], seed, args, out)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    text = tables(rows)
    header = (
        f"{f'preset {args.preset}' if args.preset else 'demo task'}, fixed set of {args.prompts} prompts, "
        f"{args.prompts_per_step} prompts x {rows[0]['rows_per_rollout'] // args.prompts_per_step} samples "
        "per step, "
        f"{args.epochs} epochs ({args.prompts // args.prompts_per_step * args.epochs} steps), "
        f"seeds {args.seeds}, threads={args.threads}, overrides {args.set}\n\n"
    )
    (out / "table.md").write_text(header + text + "\n")
    print(header + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
