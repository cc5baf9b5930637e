"""The benchmark tables of the docs pages, generated from the results in benchmarks/results/.

    python benchmarks/tables.py            # rewrite every table between its markers in docs/*.md
    python benchmarks/tables.py --check    # exit 1, naming each table whose page differs from the results
    python benchmarks/tables.py --plots    # also draw docs/img/*.png from the results (matplotlib, Agg)

A table lives in its page between two markers::

    <!-- table:NAME begin -->
    ...generated, do not edit by hand...
    <!-- table:NAME end -->

Each table ends with the line of its source: the results file(s) it reads, and the CPU, torch build and
command those files record. A file that does not record one of them says "not recorded": nothing here fills
a gap from memory. Reads JSON only (the standard library), so the check runs anywhere in a second.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
IMG = DOCS / "img"

MARKER = re.compile(r"<!-- table:([\w-]+) begin -->\n(.*?)<!-- table:\1 end -->", re.S)

# two-sided 95% Student t quantiles by degrees of freedom (2.0 above 15), as benchmarks use
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
_T95 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student t interval) of two or more values."""
    return statistics.fmean(values), _T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / len(
        values
    ) ** 0.5


def load(name: str):
    return json.loads((RESULTS / name).read_text())


# ------------------------------------------------------------------------------------------- provenance


def _walk(obj, key: str) -> list[tuple[dict, object]]:
    """Every (dict, value) pair in obj where the dict holds `key`."""
    found = []
    if isinstance(obj, dict):
        if key in obj:
            found.append((obj, obj[key]))
        for v in obj.values():
            found += _walk(v, key)
    elif isinstance(obj, list):
        for v in obj:
            found += _walk(v, key)
    return found


def recorded_cpu(obj) -> str:
    """The CPU(s) a results file records (model, bf16 units, cores), or "not recorded"."""
    seen = []
    for holder, cpu in _walk(obj, "cpu"):
        units = holder.get("native_bf16")
        text = str(cpu)
        if text.startswith("not recorded"):
            text = "not recorded"
        if units:
            text += f" ({', '.join(units)})"
        elif units == [] or holder.get("avx512") is False:
            text += " (no bf16 units)"
        if text not in seen:
            seen.append(text)
    if not seen:
        cores = {v for _, v in _walk(obj, "cpus")}
        return "not recorded" + (f" ({'/'.join(map(str, sorted(cores)))} cores)" if cores else "")
    return "; ".join(seen)


def recorded_torch(obj) -> str:
    builds = list(dict.fromkeys(str(v) for _, v in _walk(obj, "torch")))
    return ", ".join(builds) if builds else "not recorded"


def recorded_command(obj) -> str:
    for key in ("command", "argv", "cmd"):
        cmds = list(dict.fromkeys(str(v) for _, v in _walk(obj, key)))
        if cmds:
            return "; ".join(f"`{c}`" for c in cmds)
    return "not recorded"


def source(*names: str) -> str:
    """The source line under a table: each file with what it records of CPU, torch build and command."""
    parts = []
    for name in names:
        obj = load(name)
        parts.append(
            f"[`{name}`](../benchmarks/results/{name}): CPU {recorded_cpu(obj)}; "
            f"torch {recorded_torch(obj)}; command {recorded_command(obj)}"
        )
    return "\n\nSource: " + ". ".join(parts) + "."


def md(head: list[str], rows: list[list], align: str | None = None, drop_empty: bool = False) -> str:
    """A markdown table; align: one letter per column, "l" or "r" (default: all left); drop_empty: leave
    out the columns no row fills ("–" or "")."""
    align = align or "l" * len(head)
    if drop_empty:
        keep = [i for i in range(len(head)) if any(str(r[i]) not in ("–", "") for r in rows)]
        head, align = [head[i] for i in keep], "".join(align[i] for i in keep)
        rows = [[r[i] for i in keep] for r in rows]
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------------- rollout


ROLLOUT_ENGINES = ("old", "new", "new-compiled", "new-unpacked", "hf", "hf-static")


def _rollout_rows(name: str) -> list[list]:
    d = load(name)
    rows = []
    for s in d["summary"]:
        tps = {e: s.get(f"{e}_tokens_per_s") for e in ROLLOUT_ENGINES}
        # the file's own ratios (medians of per-repetition ratios where it ran several)
        over_hf = [v for k, v in s.items() if k.startswith("new_over_hf")]
        rows.append(
            [
                recorded_cpu(d["meta"]),
                f"{d['meta']['prompts']} × {d['meta']['new_tokens']} {s['workload']}",
                s["dtype"],
                d["meta"].get("reps", "–"),
                *(f"{v:.1f}" if v else "–" for v in tps.values()),
                *(
                    f"{s[f'new_over_{e}']:.2f}×" if f"new_over_{e}" in s else "–"
                    for e in ("old", "new-unpacked")
                ),
                f"{min(over_hf):.2f}×" if over_hf else "–",
                *(
                    f"{s[f'{e}_fraction_of_floor']:.2f}" if f"{e}_fraction_of_floor" in s else "–"
                    for e in ("new", "hf")
                ),
                f"{s['new_fraction_of_floor_kv']:.2f}" if "new_fraction_of_floor_kv" in s else "–",
            ]
        )
    return rows


ROLLOUT_FILES = (
    "bench_rollout_floor_64x128.json",
    "bench_rollout_packed_ab_64x128.json",
    "bench_rollout_floor_avx2_fp32_64x128.json",
)


def table_rollout() -> str:
    rows = [r for n in ROLLOUT_FILES for r in _rollout_rows(n)]
    head = ["CPU", "workload", "dtype", "reps", *ROLLOUT_ENGINES, "new / old", "new / unpacked"]
    head += ["new / best hf", "new / floor", "hf / floor", "new / floor+kv"]
    return md(head, rows, "llll" + "r" * 12) + source(*ROLLOUT_FILES)


HEAD_FILES = ("bench_head.json", "bench_head_avx512_bf16.json")


def table_head_forms() -> str:
    """bench_head.py: the LM head at a decode step's rows, torch's product against the weight-major blocks,
    on each CPU kind."""
    rows = [
        [
            recorded_cpu(d),
            r["dtype"],
            r["rows"],
            f"{r['torch_ms']:.1f} ms ({r['torch_gflops']:.0f} GFLOP/s)",
            f"{r['weight_major_ms']:.1f} ms ({r['weight_major_gflops']:.0f} GFLOP/s)",
            f"{r['speedup']:.2f}×",
            "yes" if r["same_bits"] else "no",
            "weight-major" if r["decoder_takes_weight_major"] else "torch",
        ]
        for d in map(load, HEAD_FILES)
        for r in d["rows"]
    ]
    head = [
        "CPU",
        "dtype",
        "rows",
        "torch x @ W.T",
        "weight-major blocks",
        "speed-up",
        "same bits",
        "decoder's form",
    ]
    return md(head, rows, "llrrrrll") + source(*HEAD_FILES)


# --------------------------------------------------------------------------------------------- reuse


def _late(row: dict) -> float:
    """Mean held-out accuracy over the evaluations of the second half of training (bench_reuse.py)."""
    evals = row["accuracy_per_epoch"]
    return statistics.fmean(evals[len(evals) // 2 + 1 :] or evals[-1:])


def _gap(values: list[float]) -> str:
    return "{:+.1f} ± {:.1f}".format(*mean_ci95(values)) if len(values) >= 2 else "–"


def _reuse_table(name: str) -> str:
    rows = load(name)["rows"]
    base = {r["seed"]: r for r in rows if r["arm"] == "no reuse"}
    cpu = "rollout_s_later_per_epoch"
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm and r["seed"] in base]
        other = arm != "no reuse"
        speed = statistics.fmean(base[r["seed"]][cpu] / r[cpu] for r in rs)
        has = "generated_over_returned" in rs[0]
        tokens = "model_tokens_per_rollout_later"
        out.append(
            [
                arm,
                len(rs),
                f"{statistics.fmean(r[cpu] for r in rs):.2f}",
                f"{speed:.2f}×",
                f"{statistics.fmean(r['forwards_per_rollout_later'] for r in rs):.1f}",
                f"{statistics.fmean(r[tokens] for r in rs):.0f}" if tokens in rs[0] else "–",
                f"{statistics.fmean(_late(r) for r in rs):.3f}",
                _gap([100 * (_late(r) - _late(base[r["seed"]])) for r in rs]) if other else "–",
                _gap([100 * (r["accuracy_end"] - base[r["seed"]]["accuracy_end"]) for r in rs])
                if other
                else "–",
                f"{statistics.fmean(r['flat_groups_later'] for r in rs):.2f}",
                f"{statistics.fmean(r['generated_over_returned'] for r in rs):.2f}" if has else "1",
                f"{statistics.fmean(r['full_reuse_frac'] for r in rs):.2f}" if has else "–",
            ]
        )
    head = [
        "arm",
        "seeds",
        "rollout CPU s / epoch",
        "speedup",
        "sequential forwards / rollout",
        "model tokens / rollout",
        "held-out accuracy, late mean",
        "gap to no reuse, late mean (points, 95% CI)",
        "gap, final evaluation",
        "groups without signal",
        "generated / returned tokens",
        "drafts fully reused",
    ]
    return md(head, out, "lrrrrrrrrrrr", drop_empty=True) + source(name)


def table_reuse_12seeds() -> str:
    return _reuse_table("bench_reuse_12seeds.json")


def table_reuse_lenience() -> str:
    return _reuse_table("bench_reuse_lenience_6seeds.json")


def table_reuse_16epochs() -> str:
    return _reuse_table("bench_reuse_16epochs_12seeds.json")


def table_reuse_long() -> str:
    name = "bench_reuse_long_smollm2_4seeds.json"
    rows = load(name)["rows"]
    base = {r["seed"]: r for r in rows if r["arm"] == "no reuse"}

    def ratio(field, rs):
        b, v = [base[r["seed"]][field] for r in rs], [r[field] for r in rs]
        if all(x > 0 for x in v):
            m, h = mean_ci95([x / y for x, y in zip(b, v)])
            return f"{m:.2f} ± {h:.2f}×"
        return f"{sum(b) / sum(v):.2f}× (seed totals)" if sum(v) else "∞"

    def per_seed(field, rs, digits):
        v = [r[field] for r in rs]
        mean = f"{statistics.fmean(v):.{digits}f}"
        return mean if len(set(v)) == 1 or min(v) > 0 else f"{mean} ({', '.join(f'{x:g}' for x in v)})"

    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
        other = arm != "no reuse"
        out.append(
            [
                arm,
                len(rs),
                f"{statistics.fmean(r['response_tokens_mean'] for r in rs):.1f}",
                per_seed("forwards_per_rollout_later", rs, 1),
                ratio("forwards_per_rollout_later", rs) if other else "1.00×",
                f"{statistics.fmean(r['generated_per_rollout_later'] for r in rs):.0f}",
                ratio("generated_per_rollout_later", rs) if other else "1.00×",
                f"{statistics.fmean(r['model_tokens_per_rollout_later'] for r in rs):.0f}",
                f"{statistics.fmean(r['rollout_cpu_s_per_rollout_later'] for r in rs):.1f}",
                ratio("rollout_cpu_s_per_rollout_later", rs) if other else "1.00×",
                f"{statistics.fmean(r['rollout_wall_s_per_rollout_later'] for r in rs):.1f}",
                f"{statistics.fmean(r['flat_groups_later'] for r in rs):.2f}",
                f"{statistics.fmean(r['full_reuse_frac'] for r in rs):.2f}" if other else "–",
                f"{statistics.fmean(_late(r) for r in rs):.3f}",
                _gap([100 * (_late(r) - _late(base[r["seed"]])) for r in rs]) if other else "–",
            ]
        )
    head = [
        "arm",
        "seeds",
        "response tokens",
        "sequential forwards",
        "fewer forwards",
        "generated tokens",
        "fewer generated",
        "model tokens",
        "CPU s",
        "CPU speedup",
        "wall s",
        "groups without signal",
        "drafts fully reused",
        "held-out acc",
        "gap (points, 95% CI)",
    ]
    return md(head, out, "lrrrrrrrrrrrrrr") + source(name)


# ------------------------------------------------------------------------------------------- trainer


TRAINER_FILES = ("bench_trainer.json", "bench_trainer_avx2_fp32.json")


def table_trainer() -> str:
    rows, notes = [], []
    for name in TRAINER_FILES:
        d = load(name)
        cpu = recorded_cpu(d["machine"])
        rows += [
            [
                cpu,
                s["arm"],
                f"{s['update_tokens_per_s']:.0f}",
                "{:.2f}× ({:.2f}–{:.2f})".format(s["speed_vs_fp32"], *s["speed_vs_fp32_range"]),
                f"{s['peak_rss_gib']:.2f}",
                f"{s['measured_trainer_gib']:.2f}",
                f"{s['planned_trainer_gib']:.2f}",
                f"{100 * s['plan_error']:+.0f}%",
                f"{s['trainable_params'] / 1e6:.1f}M",
                f"{s['update_fraction_of_floor']:.2f}" if "update_fraction_of_floor" in s else "–",
                f"{s['old_logprobs_fraction_of_floor']:.2f}"
                if "old_logprobs_fraction_of_floor" in s
                else "–",
            ]
            for s in d["summary"]
        ]
        st = d["settings"]
        notes.append(
            f"{cpu}: {st['rows']} rows × ({st['prompt']} + {st['response']}) tokens, {st['steps']} step per "
            f"arm per round, {st['rounds']} rounds, {st['threads']} thread"
        )
    head = [
        "CPU",
        "arm",
        "update tok/s",
        "vs fp32 (median, range over rounds)",
        "peak RSS GiB",
        "trainer GiB measured",
        "planned",
        "plan error",
        "trainable",
        "update / floor",
        "old-log-prob pass / floor",
    ]
    note = "\n\nSettings recorded: " + "; ".join(notes) + "."
    return md(head, rows, "llrrrrrrrrr", drop_empty=True) + note + source(*TRAINER_FILES)


# ---------------------------------------------------------------------------------------- scale-out


def _curves_table(name: str) -> str:
    d = load(name)
    one, two = d["curves"]["1"], d["curves"]["2"]
    same = d.get("identical_reward_steps", d["steps"])
    rows = []
    acc = d.get("accuracy")
    if acc:
        steps = list(acc["1"])
        rows.append(
            [
                f"held-out accuracy at steps {' / '.join(steps)}",
                " / ".join(f"{100 * acc['1'][s]:g}%" for s in steps),
                " / ".join(f"{100 * acc['2'][s]:g}%" for s in steps),
                "",
            ]
        )
    else:
        end = d["accuracy_end"]
        rows.append(
            [
                f"held-out accuracy after {d['steps']} steps",
                f"{100 * end['1']:g}%",
                f"{100 * end['2']:g}%",
                "",
            ]
        )
    rows.append(["steps drawing identical samples (equal rewards)", f"{same} of {d['steps']}", "", ""])
    for key in ("reward_mean", "loss", "grad_norm", "entropy"):
        gap = max(abs(a[key] - b[key]) for a, b in zip(one[:same], two[:same]))
        top = max(abs(r[key]) for r in one[:same] + two[:same])
        if d["steps"] <= 4:
            cells = [", ".join(f"{r[key]:.6g}" for r in c) for c in (one, two)]
        else:
            cells = ["", ""]
        rows.append([f"{key}{' per step' if d['steps'] <= 4 else ''}", *cells, f"{gap:.2g} (of {top:.3g})"])
    t = d["median_step_time_s"]
    rows.append(["median step time", f"{t['1']:.2f} s", f"{t['2']:.2f} s", f"ratio {t['2'] / t['1']:.2f}"])
    head = ["", "1 rank", "2 ranks", f"largest gap over the {same} identical steps (of the largest value)"]
    what = f"preset {d['preset']}" if d.get("preset") else "the demo"
    sets = " ".join(d.get("overrides") or []) or "none"
    note = f"\n\nRecorded: {what}, {d['steps']} steps, {d['repeats']} repeat(s), overrides `{sets}`."
    return md(head, rows) + note + source(name)


def table_distributed_curves() -> str:
    return _curves_table("bench_distributed_curves.json")


def table_distributed_demo() -> str:
    return _curves_table("bench_distributed_demo.json")


def table_distributed_smollm2() -> str:
    return _curves_table("bench_distributed_smollm2.json")


def table_distributed_memory() -> str:
    name = "bench_distributed_memory.json"
    d = load(name)
    rows = []
    for r in d["rows"]:
        p = r["plan"]
        state = p["weights"] + p["gradients"] + p["optimizer"] + p["rollout_copy"]
        rows.append(
            [
                r["world_size"],
                mib(state),
                mib(r["plan_total"]),
                ", ".join(mib(b).removesuffix(" MiB") for b in r["peak_rss_above_baseline"]) + " MiB",
            ]
        )
    head = [
        "world size",
        "plan: weights + gradients + AdamW + rollout copy",
        "plan: total (activations included)",
        "measured peak per rank",
    ]
    note = f"\n\nRecorded: model `{' '.join(d['model'])}`, run `{' '.join(d['run'])}`."
    return md(head, rows, "rrrr") + note + source(name)


# ------------------------------------------------------------------------------------------- kernels

PEERS = (("bitrl", "bitrl"), ("trl", "TRL kernel"), ("liger", "Liger-Kernel"), ("naive", "naive torch"))
OPS = {"logprob_entropy": "log-prob + entropy", "grpo_loss": "GRPO loss"}


def table_kernels_peers() -> str:
    name = "bench_integrations.json"
    rows = [r for r in load(name)["rows"] if r["op"] in OPS]
    cases = {}
    for r in rows:
        units = ", ".join(r.get("native_bf16") or []) or "none"
        cpu = "not recorded" if str(r["cpu"]).startswith("not recorded") else r["cpu"]
        key = (r["dtype"] != "fp32", units != "none", r["op"] != "logprob_entropy", r["N"], r["V"])
        cases.setdefault(key, {"r": r, "cpu": f"{cpu} (bf16 units: {units})"})[r["variant"]] = r
    out = []
    for key in sorted(cases):
        c = cases[key]
        r, cells = c["r"], []
        for variant, _ in PEERS:
            v = c.get(variant)
            if v is None:
                cells.append("no CPU op" if variant == "liger" and r["op"] == "logprob_entropy" else "–")
            elif "status" in v:
                cells.append(v["status"])
            else:
                cells.append(f"{v['time_s']:.1f} s, {v['peak_mib']:.0f} MiB")
        b = c["bitrl"]
        reps = b.get("reps", "not recorded")
        out.append(
            [
                OPS[r["op"]],
                r["N"],
                r["V"],
                r["dtype"],
                c["cpu"],
                reps,
                *cells,
                f"{b['time_vs_best_peer']:.2f}×, {b['mem_vs_best_peer']:.2f}×",
            ]
        )
    head = [
        "workload",
        "N",
        "V",
        "dtype",
        "CPU",
        "reps",
        *(p for _, p in PEERS),
        "bitrl vs best peer: time, memory",
    ]
    return md(head, out, "lrrlllllllr") + source(name)


def table_trl_trainer() -> str:
    name = "bench_integrations.json"
    rows = [r for r in load(name)["rows"] if r["op"] == "trl_grpo_trainer"]
    base = next(r for r in rows if r["variant"] == "trl")
    out = []
    for r in rows:
        rel = "" if r is base else f" ({r['step_time_s'] / base['step_time_s']:.2f}×)"
        mem = "" if r is base else f" ({r['peak_mib'] / base['peak_mib']:.2f}×)"
        out.append(
            [
                r["variant"],
                f"{r['step_time_s']:.2f} s{rel}",
                f"{r['peak_mib']:.0f} MiB{mem}",
                ", ".join(f"{x:.5g}" for x in r["loss"]),
            ]
        )
    m = base["model"]
    note = (
        f"\n\nRecorded: model {json.dumps(m)}, prompts of {base['prompt_len']} tokens, completions of up to "
        f"{base['completion_len']}, {base['steps']} steps."
    )
    return md(["", "step time (median)", "peak RSS growth", "losses per step"], out) + note + source(name)


def table_keep_logits() -> str:
    name = "bench_keep_logits.json"
    d = load(name)
    out = []
    for op in ("logprob", "logprob_entropy"):
        for shape in sorted(d, key=lambda s: d[s]["N"]):
            rows = d[shape]["rows"]
            keeps = [k.split("/", 1)[1] for k in rows if k.startswith(op + "/keep")]
            out.append(
                [f"{'log-prob' if op == 'logprob' else 'log-prob + entropy'}, N = {d[shape]['N']}"]
                + [f"{rows[f'{op}/{k}']['vs_naive']:.2f}×" for k in keeps]
                + [f"{d[shape]['logits_mib']:.0f} MiB", d[shape]["reps"]]
            )
    head = ["op (time vs naive torch)", *keeps, "all the logits", "reps"]
    return md(head, out, "lrrrrr") + source(name)


CHUNK_LABELS = {
    "one-pass32": "one pass, 32 MiB chunks (256 tokens)",
    "one-pass16": "one pass, 16 MiB chunks (128 tokens; default)",
    "one-pass8": "one pass, 8 MiB chunks (64 tokens)",
    "tiles": "two-pass tiles, 256 × 1024",
}


def table_loss_chunks() -> str:
    name = "bench_loss_chunks.json"
    d = load(name)
    out = []
    for shape, v in d.items():
        for r in v["rows"]:
            out.append(
                [
                    shape,
                    CHUNK_LABELS.get(r["config"], r["config"]),
                    f"{r['time_s']:.1f} s ({r['time_vs_default']:.2f}×)",
                    f"{r['peak_mib']:.0f} MiB",
                    f"{v['floor_mib']:.0f} MiB",
                ]
            )
    return md(["N × V", "path", "time", "peak memory", "floor"], out, "llrrr") + source(name)


FLOOR_LABELS = {
    "logprob_entropy/bitrl": "log-prob + entropy, bitrl (logits kept)",
    "logprob_entropy/bitrl-recompute": "log-prob + entropy, bitrl, `memory_budget=0`",
    "logprob_entropy/naive": "log-prob + entropy, naive torch",
    "grpo_loss/bitrl": "GRPO loss, bitrl (one pass)",
    "grpo_loss/naive": "GRPO loss, naive torch",
}


def table_gemm_floor() -> str:
    name = "bench_gemm_floor.json"
    d = load(name)
    shapes = [s for s in d if not s.startswith(("bf16/", "forms/"))]
    out = []
    for key, label in FLOOR_LABELS.items():
        gemms = {d[s][key]["gemms"] for s in shapes}
        out.append(
            [label, " / ".join(f"{g:g}" for g in sorted(gemms))]
            + [f"{d[s][key]['in_gemms']:.2f} ({d[s][key]['time_s']:.2f} s)" for s in shapes]
        )
    head = ["op", "products needed"] + [f"N = {d[s]['N']} (one: {d[s]['gemm_s']:.2f} s)" for s in shapes]
    return md(head, out, "lr" + "r" * len(shapes)) + source(name)


def table_gemm_floor_bf16() -> str:
    name = "bench_gemm_floor.json"
    d = load(name)
    out = []
    for shape in (s for s in d if s.startswith("bf16/")):
        v = d[shape]
        for op, label in (("grpo_loss", "GRPO loss"), ("logprob_entropy", "log-prob + entropy")):
            b, n = v[f"{op}/bitrl"], v[f"{op}/naive"]
            ratio = v[f"{op}/ratio_at"]
            out.append(
                [
                    f"{label}, {v['N']} × {v['V']}",
                    f"{b['products']:.3g}, {b['rest_s']:.2f} s",
                    f"{n['products']:.3g}, {n['rest_s']:.2f} s",
                    f"{v['fp32_product_s']:.2f} s",
                    *(f"{ratio[f'fp32/{k}']:.2f}×" for k in (2, 4)),
                    f"{b['peak_mib']:.0f} MiB" if "peak_mib" in b else "–",
                ]
            )
    head = [
        "op, N × V",
        "bitrl: products, rest",
        "naive torch: products, rest",
        "one fp32 product",
        "bitrl / naive, G = fp32 / 2",
        "G = fp32 / 4",
        "bitrl peak",
    ]
    return md(head, out, "lllrrrr") + source(name)


FORM_LABELS = {
    "naive": "naive torch",
    "bitrl-default": "bitrl, default budget",
    "bitrl-tight": "bitrl, budget 0",
}


GEMM_FLOOR_FILES = ("bench_gemm_floor.json", "bench_gemm_floor_avx2.json")


def table_gemm_floor_forms() -> str:
    """bench_gemm_floor.py --forms: both memory-budget forms against the floor and naive torch."""
    out = []
    for name in GEMM_FLOOR_FILES:
        d = load(name)
        out += _gemm_floor_forms_rows(d)
    head = [
        "CPU",
        "op, dtype, N × V",
        "variant",
        "products",
        "time",
        "fraction of the floor",
        "vs naive torch",
        "peak memory",
        "vs best peer's memory",
    ]
    return md(head, out, "lllrrrrrr") + source(*GEMM_FLOOR_FILES)


def _gemm_floor_forms_rows(d: dict) -> list[list]:
    out = []
    for key in (k for k in d if k.startswith("forms/")):
        v = d[key]
        mm = key.split("/cpu_bf16_matmul=")[1] if "/cpu_bf16_matmul=" in key else None
        dtype = v["dtype"] + (f" (bitrl's GEMMs in {mm})" if mm else "")
        for op, label in (("grpo_loss", "GRPO loss"), ("logprob_entropy", "log-prob + entropy")):
            for variant, vlabel in FORM_LABELS.items():
                r = v[f"{op}/{variant}"]
                peak = r.get("peak_mib")
                peak_text = f"{peak:.0f} MiB" if isinstance(peak, float) else "–"
                vs_peer = f"{r['mem_vs_best_peer']:.2f}×" if "mem_vs_best_peer" in r else "–"
                out.append(
                    [
                        recorded_cpu(v["machine"]),
                        f"{label}, {dtype}, {v['N']} × {v['V']}",
                        vlabel,
                        f"{r['products']:.3g}",
                        f"{r['time_s']:.2f} s",
                        f"{r['floor_fraction']:.2f}",
                        f"{r['vs_naive']:.2f}×",
                        peak_text,
                        vs_peer,
                    ]
                )
    return out


# ----------------------------------------------------------------------------------------------- GPU


def table_kernel_resources() -> str:
    name = "kernel_resources.json"
    d = load(name)
    kernels = {}
    for r in d["kernels"]:
        k = kernels.setdefault(r["kernel"], {"labels": set(), "sm": set(), "reg": 0, "smem": 0, "spill": 0})
        k["hot"] = r.get("hot", True)
        if "error" in r:
            continue
        k["labels"].add(r["label"])
        k["sm"].add(r["sm"])
        k["reg"] = max(k["reg"], r["registers"])
        k["smem"] = max(k["smem"], r["static_shared_bytes"] + r["dynamic_shared_bytes"])
        k["spill"] += bool(r["spills"])
    out = [
        [
            f"`{name_}`" + ("" if k["hot"] else " (not on a hot path)"),
            len(k["labels"]),
            ", ".join(f"sm_{s}" for s in sorted(k["sm"])),
            k["reg"],
            f"{k['smem'] / 1024:.1f} KiB",
            k["spill"],
        ]
        for name_, k in kernels.items()
    ]
    errors = sum("error" in r for r in d["kernels"]) + len(d.get("case_failures") or [])
    total = sum(len(k["labels"]) for k in kernels.values())
    out.append(
        [
            "all",
            f"{total} ({d['n_compiles']} compiles)",
            "",
            "",
            "",
            f"{sum(k['spill'] for k in kernels.values())}; {errors} compile errors",
        ]
    )
    head = ["kernel", "specializations", "targets", "max registers", "max shared memory", "spills"]
    note = f"\n\nRecorded: Triton {d['triton']}, {d['workers']} workers, {d['wall_seconds']:.0f} s wall."
    return md(head, out, "lrlrrr") + note + source(name)


GPU_WORKLOADS = (
    (
        "GRPO loss with LM head, fwd+bwd, N=16384 H=4096 V=151936 bf16",
        "≥ 60% of bf16 roofline, ≥ 1.2× Liger-Kernel",
    ),
    ("quantize / dequantize, 8192×8192 bf16 (MXFP4, NVFP4, MXFP8)", "≥ 70% of HBM bandwidth"),
    ("FP4 GEMV (CUDA C++), M = 1", "≥ 60% of HBM bandwidth"),
    (
        "rollout decode step, Qwen2-0.5B shape bf16, batch 64 (`benchmarks/bench_decode.py`)",
        "≥ 50% of (weight + KV bytes) / HBM bandwidth",
    ),
)


def table_gpu() -> str:
    """The GPU check's summary where benchmarks/results/gpu/summary.json exists, else the goals unmeasured."""
    path = RESULTS / "gpu" / "summary.json"
    if not path.is_file():
        rows = [[what, "not measured", goal] for what, goal in GPU_WORKLOADS]
        return (
            md(["workload", "figure", "goal"], rows)
            + "\n\nSource: no `benchmarks/results/gpu/summary.json` (no GPU run recorded)."
        )
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_summary

    summary = json.loads(path.read_text())
    return (
        gpu_summary.to_markdown(summary).rstrip()
        + "\n\nSource: [`gpu/summary.json`](../benchmarks/results/gpu/summary.json)."
    )


# ------------------------------------------------------------------------------------- low precision

PRECISION_ORDER = ("full", "fp8", "mxfp4", "nvfp4", "mxfp4-floor")
CORRECTION_ORDER = ("none", "tis", "icepop", "ais", "seq-tis", "seq-mis")


def _cell_key(cell):
    p, c = cell
    return (
        PRECISION_ORDER.index(p) if p in PRECISION_ORDER else 99,
        CORRECTION_ORDER.index(c) if c in CORRECTION_ORDER else 99,
        c,
    )


def _seeds(seeds) -> str:
    seeds = sorted(seeds)
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def table_study_mismatch() -> str:
    name = "study_mismatch_200steps.json"
    runs = load(name)
    base = {r["seed"]: r for r in runs if (r["precision"], r["correction"]) == ("full", "none")}
    out = []
    for cell in sorted(dict.fromkeys((r["precision"], r["correction"]) for r in runs), key=_cell_key):
        rs = [r for r in runs if (r["precision"], r["correction"]) == cell and r["seed"] in base]
        k3 = f"{statistics.fmean(r['mismatch_k3_kl'] for r in rs):.1e}"
        if cell == ("full", "none"):
            late = [100 * r["accuracy_late"] for r in rs]
            out.append(
                [
                    *cell,
                    _seeds(r["seed"] for r in rs),
                    f"{statistics.fmean(late):.1f}% ± {statistics.stdev(late):.1f} sd (itself)",
                    "",
                    k3,
                ]
            )
            continue
        out.append(
            [
                *cell,
                _seeds(r["seed"] for r in rs),
                _gap([100 * (r["accuracy_late"] - base[r["seed"]]["accuracy_late"]) for r in rs]),
                _gap([100 * (r["accuracy_end"] - base[r["seed"]]["accuracy_end"]) for r in rs]),
                k3,
            ]
        )
    head = [
        "rollout",
        "correction",
        "seeds",
        "gap to full precision, late mean (points, 95% CI)",
        "gap, final evaluation",
        "mean k3 per token",
    ]
    start = statistics.fmean(100 * r["accuracy_start"] for r in base.values())
    steps = sorted({r["steps"] for r in runs})
    note = (
        f"\n\n{'/'.join(map(str, steps))} RL steps per run; warm start {start:.1f}% (mean over the "
        f'{len(base)} seeds). "mxfp4" has rceil scales (the default), "mxfp4-floor" OCP floor scales.'
    )
    return md(head, out, "lllrrr") + note + source(name)


def _real_runs():
    runs = load("bench_real.json")
    for r in runs:
        s = r["steps"]
        r["k3"] = statistics.fmean(t["mismatch_k3_kl"] for t in s)
        r["ess"] = statistics.fmean(t["mismatch_ess"] for t in s)
        r["reward"] = statistics.fmean(t["reward_mean"] for t in s)
    return runs


def table_real_paired() -> str:
    runs = _real_runs()
    base = {r["seed"]: r for r in runs if r["precision"] == "full"}
    out = []
    for cell in sorted(dict.fromkeys((r["precision"], r["correction"]) for r in runs), key=_cell_key):
        rs = sorted((r for r in runs if (r["precision"], r["correction"]) == cell), key=lambda r: r["seed"])
        if len(rs) < 2:
            continue
        full = cell[0] == "full"
        gaps = [100 * (r["accuracy_end"] - base[r["seed"]]["accuracy_end"]) for r in rs]
        k3 = [r["k3"] for r in rs]
        rew = [100 * r["reward"] for r in rs]
        out.append(
            [
                *cell,
                _seeds(r["seed"] for r in rs),
                " / ".join(f"{100 * r['accuracy_start']:.0f}→{100 * r['accuracy_end']:.0f}" for r in rs)
                + f" (mean {statistics.fmean(100 * r['accuracy_end'] for r in rs):.1f}%)",
                "" if full else " / ".join(f"{g:+.0f}" for g in gaps),
                "" if full else f"{statistics.fmean(gaps):+.1f} points",
                f"{min(k3):#.2g}–{max(k3):#.2g}",
                f"{min(rew):.1f}–{max(rew):.1f}%",
            ]
        )
    head = [
        "rollout",
        "correction",
        "seeds",
        "held-out accuracy, step 0 → 5, per seed",
        "gap to full per seed",
        "mean gap",
        "k3 per token",
        "reward mean, steps 1-5",
    ]
    return md(head, out, "lllllrrr") + source("bench_real.json")


def table_real_runs() -> str:
    runs = _real_runs()
    base = {r["seed"]: r for r in runs if r["precision"] == "full"}
    out = []
    for r in sorted(runs, key=lambda r: (r["seed"], _cell_key((r["precision"], r["correction"])))):
        full = r["precision"] == "full"
        out.append(
            [
                r["seed"],
                r["precision"],
                r["correction"],
                f"{r['k3']:#.2g}",
                f"{r['ess']:.2f}",
                f"{100 * r['reward']:.1f}%",
                f"{100 * r['accuracy_start']:.0f}% → {100 * r['accuracy_end']:.0f}%",
                "" if full else f"{100 * (r['accuracy_end'] - base[r['seed']]['accuracy_end']):+.0f}",
                f"{r['peak_rss_mib'] / 1024:.2f} GiB",
                f"{r['wall_s']:.0f} s",
            ]
        )
    head = [
        "seed",
        "rollout",
        "correction",
        "k3 per token, steps 1-5",
        "ESS",
        "reward mean, steps 1-5",
        "held-out accuracy, step 0 → 5",
        "gap to full (points)",
        "peak RSS",
        "wall (shared machine)",
    ]
    return md(head, out, "lllrrrrrrr") + source("bench_real.json")


def table_study_4bit(name: str = "study_4bit_smollm2.json") -> str:
    """4-bit rollout recipes before training (benchmarks/study_4bit.py): SmolLM2, or the demo."""
    rows = load(name)["rows"]
    full = next(r for r in rows if r["recipe"] == "full")
    out = []
    for r in rows:
        settings = " ".join(f"`{o}`" for o in r["overrides"]) or "defaults"
        bits = "–" if r["weight_bits"] is None else f"{r['weight_bits']:.2f}"
        out.append(
            [
                f"`{r['precision']}`",
                settings,
                f"{r['k3_per_token']:#.3g}",
                f"{r['ess']:.3f}",
                f"{100 * r['greedy_accuracy']:.1f}%",
                f"{100 * (r['greedy_accuracy'] - full['greedy_accuracy']):+.1f}",
                bits,
                f"{r['build_seconds']:.0f}",
            ]
        )
    head = [
        "rollout.precision",
        "rollout.* settings",
        "k3 / token",
        "ESS",
        "greedy accuracy",
        "vs full",
        "bits / weight",
        "copy built in (s)",
    ]
    return md(head, out, "llrrrrrr") + source(name)


def table_cost_4bit() -> str:
    """Each 4-bit remedy's modelled GPU cost (benchmarks/model_4bit_cost.py)."""
    name = "model_4bit_cost.json"
    obj = load(name)
    out = []
    for r in obj["remedies"]:
        out.append(
            [
                r["remedy"],
                f"{r['bits_per_weight'][1]:.2f} → {r['bits_per_weight'][0]:.2f}",
                f"{r['k3'][1]:.3f} → {r['k3'][0]:.3f}",
                f"{1e6 * r['extra_per_decode_step_s']:.0f} µs ({100 * r['extra_fraction']:.0f}%)",
                f"{100 * r['extra_bytes_fraction']:+.1f}%",
            ]
        )
    head = [
        "remedy",
        "bits / weight",
        "k3 / token",
        "extra per decode step (of SmolLM2's)",
        "extra bytes per step (weight-bound models)",
    ]
    sync = obj["gptq_per_sync"]
    lines = [
        f"GPTQ per sync with {n} calibration prompts: calibration rollout "
        f"{1e3 * g['calibration_rollout_s']:.0f} ms, "
        f"Hessians {g['hessian_tflop']:.1f} TFLOP ({1e3 * g['hessian_s']:.0f} ms), column loop "
        f"{g['column_steps']} steps ({1e3 * g['column_loop_s']:.0f} ms): {1e3 * g['total_s']:.0f} ms"
        for n, g in sync.items()
    ]
    note = (
        f"\n\nModelled for {obj['gpu']['name']}, {obj['batch']} rows × {obj['context']} tokens of context; "
        "the "
        f"preset's whole rollout decodes in {1e3 * obj['preset_rollout_decode_s']:.0f} ms. "
        + "; ".join(lines)
        + "."
    )
    return md(head, out, "lrrrr") + note + source(name)


DTYPE_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def _run_dtype(run: dict) -> str:
    """The model dtype a bench_real / study_qerl run trained in: recorded, else its ``model.dtype=``
    override, else float32, model.dtype's default, which the smollm2 presets keep (runs written before the
    dtype was recorded set none: they trained in fp32 on every CPU)."""
    if "model_dtype" in run:
        return run["model_dtype"]
    set_dtype = [o.split("=", 1)[1] for o in run.get("overrides") or [] if o.startswith("model.dtype=")]
    return set_dtype[-1] if set_dtype else "float32"


def _same_run(run: dict) -> tuple:
    """What makes two runs the same experiment: settings and dtype, the model.dtype override aside."""
    overrides = tuple(o for o in run.get("overrides") or [] if not o.startswith("model.dtype="))
    return run.get("arm") or (run["precision"], run["correction"]), run["seed"], _run_dtype(run), overrides


def _once(runs: list[dict]) -> list[tuple[dict, int]]:
    """(run, n) per experiment run n times with the same result (held-out accuracy and every step's reward:
    fp32 runs on CPUs of different kinds sample the same tokens), the first run standing for all; a repeat
    that ended otherwise stays a run of its own."""
    seen: dict[tuple, list] = {}
    out = []
    for r in runs:
        steps = r.get("steps") or r.get("per_step") or []
        result = (str(r.get("accuracy_end", r.get("accuracy"))), tuple(t["reward_mean"] for t in steps))
        key = (*_same_run(r), result)
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [r, 1]
            out.append(seen[key])
    return [tuple(x) for x in out]


def table_real_gptq() -> str:
    """RL on SmolLM2 with the default 4-bit recipes (GPTQ) against full precision, paired by seed and by
    the dtype both trained in; a run repeated with the same result (on the other CPU kind) counts once."""
    name = "bench_real_gptq_10steps.json"
    runs = _once(load(name))

    def pair(r):
        return r["seed"], _run_dtype(r)

    def mean_reward(r):
        return statistics.fmean(t["reward_mean"] for t in r["steps"])

    base = {pair(r): r for r, _ in runs if r["precision"] == "full"}
    out = []
    for cell in sorted(dict.fromkeys((r["precision"], r["correction"]) for r, _ in runs), key=_cell_key):
        rn = sorted(
            ((r, n) for r, n in runs if (r["precision"], r["correction"]) == cell and pair(r) in base),
            key=lambda rn: (_run_dtype(rn[0]) != "bfloat16", rn[0]["seed"]),
        )
        rs = [r for r, _ in rn]
        full = cell[0] == "full"
        gaps = [100 * (r["accuracy_end"] - base[pair(r)]["accuracy_end"]) for r in rs]
        rewards = [mean_reward(r) for r in rs]
        ratio = sum(rewards) / sum(mean_reward(base[pair(r)]) for r in rs)
        flat = [statistics.fmean(t["flat_group_frac"] for t in r["steps"]) for r in rs]
        k3 = [statistics.fmean(t["mismatch_k3_kl"] for t in r["steps"]) for r in rs]
        se = f" ± {statistics.stdev(gaps) / len(gaps) ** 0.5:.1f}" if len(gaps) > 1 else ""
        out.append(
            [
                *cell,
                ", ".join(
                    f"{r['seed']} {DTYPE_SHORT[_run_dtype(r)]}" + (f" ×{n}" if n > 1 else "") for r, n in rn
                ),
                " / ".join(f"{100 * r['accuracy_start']:.0f}→{100 * r['accuracy_end']:.0f}" for r in rs),
                ""
                if full
                else " / ".join(f"{g:+.0f}" for g in gaps) + f" (mean {statistics.fmean(gaps):+.1f}{se})",
                " / ".join(f"{100 * w:.1f}%" for w in rewards) + ("" if full else f" ({ratio:.2f}× full)"),
                " / ".join(f"{f:.2f}" for f in flat),
                " / ".join(f"{k:#.2g}" for k in k3),
            ]
        )
    head = [
        "rollout",
        "correction",
        "seed, dtype (×n: n runs, same result)",
        "held-out accuracy, step 0 → 10, per seed",
        "gap to full per seed (mean ± s.e.)",
        "reward, mean of steps 1-10 (sum against full's)",
        "flat groups",
        "k3 per token",
    ]
    return md(head, out, "llllllll") + source(name)


def _curve(accuracy: list) -> str:
    """Held-out accuracy over a run's evaluations, as "11% -> 30% -> 54%"."""
    return " -> ".join(f"{100 * a:.0f}%" for _, a in accuracy)


def _late_reward(steps: list[dict]) -> str:
    """Mean reward over the second half of a run's steps."""
    late = steps[len(steps) // 2 :]
    return f"{100 * sum(x['reward_mean'] for x in late) / len(late):.0f}%"


def table_aligned_price() -> str:
    """rollout.aligned against the default path on SmolLM2: time (best of the repeats) and mismatch."""
    runs = load("bench_aligned.json")["runs"]
    best = {}
    for r in runs:
        key = (r["dtype"], r["aligned"])
        b = best.setdefault(key, dict(r))
        for k in ("rollout_s", "old_logprobs_s", "update_s"):
            b[k] = min(b[k], r[k])
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        base = best[(dtype, False)]
        for aligned in (False, True):
            r = best[(dtype, aligned)]
            trainer = (r["old_logprobs_s"] + r["update_s"]) / (base["old_logprobs_s"] + base["update_s"])
            k3 = "**0**" if r["k3"] == 0 else f"{r['k3']:.2g}"
            dp = "**0**" if r["max_abs_dlogp"] == 0 else f"{r['max_abs_dlogp']:.2g}"
            out.append(
                [
                    dtype,
                    "aligned" if aligned else "default",
                    f"{r['rollout_s']:.2f} s ({r['rollout_s'] / base['rollout_s']:.2f}x)",
                    f"{r['old_logprobs_s']:.2f} s",
                    f"{r['update_s']:.1f} s",
                    f"{trainer:.2f}x",
                    k3,
                    dp,
                ]
            )
    head = ["dtype", "path", "rollout", "old-log-prob pass", "update", "trainer vs default", "k3 / token"]
    head += ["max \\|d log p\\|"]
    return md(head, out, "llrrrrrr") + source("bench_aligned.json")


def table_aligned_study() -> str:
    """RL on SmolLM2 in bf16 with rollout.aligned off and on, paired by seed (benchmarks/study_aligned.py)."""
    runs = load("study_aligned.json")["runs"]
    out = []
    for r in runs:
        steps = r["per_step"]
        k3 = [s["mismatch_k3_kl"] for s in steps]
        w_lo = min(s["is_weight_min"] for s in steps)
        w_hi = max(s["is_weight_max"] for s in steps)
        acc = _curve(r["accuracy"])
        out.append(
            [
                r["seed"],
                "on" if r["aligned"] else "off",
                len(steps),
                "0 every step" if max(k3) == 0 else f"{min(k3):.4f}-{max(k3):.4f}",
                f"{w_lo:.2f}-{w_hi:.2f}",
                f"{100 * sum(s['reward_mean'] for s in steps) / len(steps):.1f}%",
                acc,
            ]
        )
    head = ["seed", "rollout.aligned", "steps", "k3 / token", "TIS weights", "mean reward"]
    head += ["held-out accuracy"]
    return md(head, out, "rlrlllr") + source("study_aligned.json")


def table_dtype_study() -> str:
    """RL on SmolLM2 in fp32 against bf16 (rollout.aligned off and on), paired by seed."""
    runs = load("study_fp32_smollm2.json")["runs"] + load("study_aligned.json")["runs"]
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        for r in [r for r in runs if r["seed"] == seed]:
            steps = r["per_step"]
            dtype = r.get("dtype", "bfloat16")
            out.append(
                [
                    seed,
                    ("fp32" if dtype == "float32" else "bf16") + (", aligned" if r["aligned"] else ""),
                    _curve(r["accuracy"]),
                    _late_reward(steps),
                    f"{max(x['mismatch_k3_kl'] for x in steps):.2g}",
                ]
            )
    head = ["seed", "model.dtype", "held-out accuracy, steps 0 -> 5 -> 10", "reward, steps 6-10", "k3 max"]
    return md(head, out, "rllrr") + source("study_fp32_smollm2.json", "study_aligned.json")


def table_qerl_study() -> str:
    """QeRL on SmolLM2 against full-precision LoRA at the same rank, paired by seed (study_qerl.py)."""
    study = load("study_qerl_smollm2.json")
    # runs before per-run records trained on the file's machine; pairs share a seed and a dtype
    runs = _once([{"machine": study["machine"], **r} for r in study["runs"]])
    full = {(r["seed"], _run_dtype(r)): r for r, _ in runs if r["arm"] == "lora-full"}
    out = []
    order = {"bfloat16": 0, "float32": 1}
    for r, n in sorted(
        runs,
        key=lambda rn: (order[_run_dtype(rn[0])], rn[0]["seed"], rn[0]["arm"] != "lora-full", rn[0]["arm"]),
    ):
        steps = r["per_step"]
        final = r["accuracy"][-1][1]
        base = full.get((r["seed"], _run_dtype(r)))
        gap = "–" if base is None or base is r else f"{100 * (final - base['accuracy'][-1][1]):+.0f}"
        out.append(
            [
                r["seed"],
                DTYPE_SHORT[_run_dtype(r)] + (f" ×{n}" if n > 1 else ""),
                f"`{r['arm']}`",
                _curve(r["accuracy"]),
                gap,
                _late_reward(steps),
                f"{100 * sum(x['flat_group_frac'] for x in steps) / len(steps):.0f}%",
                f"{max(x['mismatch_k3_kl'] for x in steps):.1g}",
                f"{statistics.median(x['step_time_s'] for x in steps):.0f} s",
            ]
        )
    head = [
        "seed",
        "dtype (×n: n runs, same result)",
        "arm",
        "held-out accuracy, steps 0 -> 5 -> 10",
        "vs LoRA (points)",
    ]
    head += ["reward, steps 6-10", "flat groups", "k3 max", "step time"]
    return md(head, out, "rlllrrrrr") + source("study_qerl_smollm2.json")


# ------------------------------------------------------------------------------------------- index

DESCRIPTIONS = {
    "bench_aligned.json": "rollout.aligned against the default path on SmolLM2: time and mismatch",
    "study_bf16_view_smollm2.json": "an fp32 SmolLM2 run's trained weights seen in bf16: changes, accuracy",
    "study_qerl_smollm2.json": "QeRL on SmolLM2 (LoRA on a shared 4-bit base, AQN on both) against LoRA",
    "study_fp32_smollm2.json": "RL on SmolLM2 in fp32, the baseline of the bf16 runs, paired seeds",
    "study_aligned.json": "RL on SmolLM2 in bf16 with rollout.aligned off and on, paired seeds",
    "bench_distributed_curves.json": "1 rank against 2 ranks, demo model on one-digit sums",
    "bench_distributed_demo.json": "1 rank against 2 ranks, the demo as shipped",
    "bench_distributed_memory.json": "memory plan and peak per rank at 1, 2 and 4 ranks",
    "bench_distributed_smollm2.json": "1 rank against 2 ranks, the smollm2-add preset",
    "bench_gemm_floor.json": "fused ops in units of one whole GEMM; the bf16 path's parts",
    "bench_gemm_floor_avx2.json": "both forms of the fused ops against the floor on a CPU without bf16 units",
    "bench_integrations.json": "bitrl against TRL's kernel, Liger-Kernel and naive torch; TRL GRPOTrainer",
    "bench_keep_logits.json": "kept-logits budget of fused_logprobs against naive torch",
    "bench_loss_chunks.json": "chunk size of the loss op's one pass, against the two-pass tiles",
    "bench_real.json": "SmolLM2-135M trained with low-precision rollouts and corrections",
    "bench_reuse_12seeds.json": "speculative reuse on the demo, 12 seeds",
    "bench_reuse_16epochs_12seeds.json": "speculative reuse on the demo, 16 epochs",
    "bench_reuse_lenience_6seeds.json": "speculative reuse, lenience above and below 1",
    "bench_reuse_long_smollm2_4seeds.json": "speculative reuse on SmolLM2's long responses",
    "bench_rollout_cpu_64x128.json": "rollout throughput, an earlier engine (superseded; no table)",
    "bench_rollout_cpu_8x24.json": "rollout throughput, 8 × 24, an earlier engine (superseded; no table)",
    "bench_rollout_cpu_bf16_64x128.json": "rollout throughput, bf16 emulated (no bf16 units), before the "
    "row compaction (superseded; no table)",
    "bench_rollout_cpu_bf16_longtail_64x128.json": "rollout throughput, bf16 long tail, emulated "
    "(superseded; no table)",
    "bench_rollout_cpu_fp32_64x128.json": "rollout throughput, fp32, before the floor column (superseded; no "
    "table)",
    "bench_rollout_floor_64x128.json": "rollout throughput of the engine and model.generate against the "
    "floor of their products, SmolLM2-135M, bf16 and fp32",
    "bench_rollout_floor_avx2_fp32_64x128.json": "the same in fp32 on a CPU without bf16 units (AVX2 only)",
    "bench_rollout_floor_packed_2reps_64x128.json": "the rollout table's run with 2 repetitions, before it",
    "bench_rollout_packed_ab_64x128.json": "the engine with and without packed products, interleaved",
    "bench_rollout_floor_unpacked_64x128.json": "the same on the same CPU kind, the engine before packed "
    "products (commit e40343b)",
    "bench_head.json": "the LM head at a decode step's rows: torch's product against the weight-major blocks",
    "bench_head_avx512_bf16.json": "the same on a CPU with bf16 units (AVX-512 BF16)",
    "bench_trainer.json": "update throughput and memory at SmolLM2-135M's size",
    "bench_trainer_avx2_fp32.json": "the same in fp32 on a CPU without bf16 units, with checkpointing",
    "kernel_resources.json": "every Triton specialization compiled for sm_90 / sm_100",
    "study_mismatch_200steps.json": "low-precision rollouts and corrections on the demo, 200 steps",
    "study_4bit_smollm2.json": "4-bit rollout recipes on SmolLM2-135M before training: mismatch, accuracy",
    "study_4bit_demo.json": "the same on the demo's model",
    "model_4bit_cost.json": "each 4-bit remedy's GPU cost, modelled from the study's bits and the shapes",
    "bench_real_gptq_10steps.json": "RL on SmolLM2-135M with the default (GPTQ) 4-bit recipes, 10 steps",
    "bench_gptq_sync_smollm2.json": "a GPTQ copy's sync on SmolLM2-135M: the Hessians' forward by batch "
    "size, the column loop",
}


def table_index() -> str:
    users = {}
    for table, (page, _, names) in TABLES.items():
        for n in names:
            users.setdefault(n, []).append(f"[{table}]({page})")
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        obj = json.loads(path.read_text())
        out.append(
            [
                f"[`{path.name}`](../benchmarks/results/{path.name})",
                DESCRIPTIONS.get(path.name, "not described"),
                ", ".join(users.get(path.name, [])) or "none",
                recorded_cpu(obj),
                recorded_torch(obj),
                recorded_command(obj),
            ]
        )
    return md(["file", "holds", "tables", "CPU", "torch", "command"], out)


# ------------------------------------------------------------------------------------------- registry

# name -> (page, renderer, results files read)
TABLES: dict[str, tuple[str, Callable[[], str], tuple[str, ...]]] = {
    "rollout": ("rollout.md", table_rollout, ROLLOUT_FILES),
    "head-forms": ("rollout.md", table_head_forms, HEAD_FILES),
    "reuse-12seeds": ("rollout.md", table_reuse_12seeds, ("bench_reuse_12seeds.json",)),
    "reuse-lenience": ("rollout.md", table_reuse_lenience, ("bench_reuse_lenience_6seeds.json",)),
    "reuse-16epochs": ("rollout.md", table_reuse_16epochs, ("bench_reuse_16epochs_12seeds.json",)),
    "reuse-long": ("rollout.md", table_reuse_long, ("bench_reuse_long_smollm2_4seeds.json",)),
    "trainer": ("trainer.md", table_trainer, TRAINER_FILES),
    "study-4bit": ("low_precision.md", table_study_4bit, ("study_4bit_smollm2.json",)),
    "study-4bit-demo": (
        "low_precision.md",
        lambda: table_study_4bit("study_4bit_demo.json"),
        ("study_4bit_demo.json",),
    ),
    "real-gptq": ("low_precision.md", table_real_gptq, ("bench_real_gptq_10steps.json",)),
    "cost-4bit": ("low_precision.md", table_cost_4bit, ("model_4bit_cost.json",)),
    "distributed-curves": ("scale_out.md", table_distributed_curves, ("bench_distributed_curves.json",)),
    "distributed-demo": ("scale_out.md", table_distributed_demo, ("bench_distributed_demo.json",)),
    "distributed-smollm2": ("scale_out.md", table_distributed_smollm2, ("bench_distributed_smollm2.json",)),
    "distributed-memory": ("scale_out.md", table_distributed_memory, ("bench_distributed_memory.json",)),
    "kernels-peers": ("kernels.md", table_kernels_peers, ("bench_integrations.json",)),
    "trl-trainer": ("kernels.md", table_trl_trainer, ("bench_integrations.json",)),
    "keep-logits": ("kernels.md", table_keep_logits, ("bench_keep_logits.json",)),
    "loss-chunks": ("kernels.md", table_loss_chunks, ("bench_loss_chunks.json",)),
    "gemm-floor": ("kernels.md", table_gemm_floor, ("bench_gemm_floor.json",)),
    "gemm-floor-bf16": ("kernels.md", table_gemm_floor_bf16, ("bench_gemm_floor.json",)),
    "gemm-floor-forms": ("kernels.md", table_gemm_floor_forms, GEMM_FLOOR_FILES),
    "kernel-resources": ("gpu.md", table_kernel_resources, ("kernel_resources.json",)),
    "gpu": ("gpu.md", table_gpu, ()),
    "study-mismatch": ("low_precision.md", table_study_mismatch, ("study_mismatch_200steps.json",)),
    "real-paired": ("low_precision.md", table_real_paired, ("bench_real.json",)),
    "real-runs": ("low_precision.md", table_real_runs, ("bench_real.json",)),
    "aligned-price": ("low_precision.md", table_aligned_price, ("bench_aligned.json",)),
    "aligned-study": ("low_precision.md", table_aligned_study, ("study_aligned.json",)),
    "qerl-study": ("low_precision.md", table_qerl_study, ("study_qerl_smollm2.json",)),
    "dtype-study": ("trainer.md", table_dtype_study, ("study_fp32_smollm2.json", "study_aligned.json")),
    "index": ("benchmarks.md", table_index, ()),
}


# --------------------------------------------------------------------------------------------- plots


def plots() -> list[Path]:
    """docs/img/*.png from the results: the studies' accuracy curves, mismatch against precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    written = []

    # 1. demo study: mean held-out accuracy over training per cell, seeds shared by every cell shown
    runs = load("study_mismatch_200steps.json")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    panels = (
        ("12 seeds", [("full", "none"), ("mxfp4", "none"), ("mxfp4", "ais"), ("nvfp4", "none")]),
        ("seeds 0-5", [("full", "none"), ("mxfp4-floor", "none"), ("mxfp4-floor", "ais"), ("nvfp4", "tis")]),
    )
    for ax, (title, cells) in zip(axes, panels):
        seeds = set.intersection(
            *({r["seed"] for r in runs if (r["precision"], r["correction"]) == c} for c in cells)
        )
        for cell in cells:
            rs = [r for r in runs if (r["precision"], r["correction"]) == cell and r["seed"] in seeds]
            steps = [s for s, _ in rs[0]["curve"]]
            mean = [100 * statistics.fmean(r["curve"][i][1] for r in rs) for i in range(len(steps))]
            ax.plot(steps, mean, marker=".", label=f"{cell[0]}, {cell[1]}")
        ax.set_title(f"demo, held-out accuracy (mean of {title})")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out accuracy (%)")
    fig.tight_layout()
    written.append(IMG / "study_accuracy.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)

    # 2. mismatch against precision: k3 (demo study and SmolLM2) and ESS (SmolLM2), uncorrected rollouts
    real = _real_runs()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    order = ("full", "fp8", "nvfp4", "mxfp4", "mxfp4-floor")
    for label, rows, key in (
        ("demo (study, 200 steps)", runs, "mismatch_k3_kl"),
        ("SmolLM2-135M (5 steps)", real, "k3"),
    ):
        ys = []  # nan where an arm was not run: the line breaks there instead of bridging it
        for p in order:
            v = [r[key] for r in rows if r["precision"] == p and r["correction"] == "none"]
            ys.append(statistics.fmean(v) if v else float("nan"))
        ax1.plot(range(len(order)), ys, marker="o", label=label)
    ax1.set_xticks(range(len(order)), order)
    ax1.set_yscale("log")
    ax1.set_ylabel("k3 KL per token (rollout vs trainer)")
    ax1.set_title("mismatch by rollout precision (no correction)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    xs, ys = [], []
    for p in ("full", "fp8", "nvfp4", "mxfp4"):
        v = [r["ess"] for r in real if r["precision"] == p and r["correction"] == "none"]
        if v:
            xs.append(p)
            ys.append(statistics.fmean(v))
    ax2.bar(xs, ys, color="tab:orange")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("ESS (fraction of tokens)")
    ax2.set_title("SmolLM2-135M: ESS (no correction)")
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    written.append(IMG / "mismatch_precision.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)

    # 3. SmolLM2: gap to full precision against mismatch, every arm and seed
    base = {r["seed"]: r for r in real if r["precision"] == "full"}
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for p, colour in (("fp8", "tab:green"), ("nvfp4", "tab:blue"), ("mxfp4", "tab:red")):
        rs = [r for r in real if r["precision"] == p]
        ax.scatter(
            [r["k3"] for r in rs],
            [100 * (r["accuracy_end"] - base[r["seed"]]["accuracy_end"]) for r in rs],
            color=colour,
            label=p if p != "mxfp4" else "mxfp4 (none, tis, icepop, ais, seq-mis)",
        )
        for r in rs if p != "mxfp4" else ():  # the mxfp4 arms overlap: the legend names them
            ax.annotate(
                f"{r['correction']} s{r['seed']}",
                (r["k3"], 100 * (r["accuracy_end"] - base[r["seed"]]["accuracy_end"])),
                fontsize=6,
            )
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(-3, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("k3 KL per token, mean of steps 1-5")
    ax.set_ylabel("held-out accuracy gap to full (points)")
    ax.set_title("SmolLM2-135M, 5 steps: accuracy gap against mismatch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(IMG / "real_gap_vs_k3.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)
    return written


# ------------------------------------------------------------------------------------------- pages


def render(name: str) -> str:
    return TABLES[name][1]().rstrip() + "\n"


def update(check: bool) -> list[str]:
    """Rewrite (or, with check, compare) every table in its page. Returns the problems found."""
    problems = []
    pages = {}
    for name, (page, _, _) in TABLES.items():
        pages.setdefault(page, []).append(name)
    for path in sorted(DOCS.glob("*.md")):
        for found in MARKER.finditer(path.read_text()):
            if found.group(1) not in TABLES:
                problems.append(f"{path.name}: table:{found.group(1)} is no table this script knows")
            elif TABLES[found.group(1)][0] != path.name:
                problems.append(f"{path.name}: table:{found.group(1)} belongs in {TABLES[found.group(1)][0]}")
    for page, names in pages.items():
        path = DOCS / page
        text = path.read_text() if path.is_file() else ""
        new = text
        for name in names:
            block = re.compile(
                rf"(<!-- table:{re.escape(name)} begin -->\n)(.*?)(<!-- table:{re.escape(name)} end -->)",
                re.S,
            )
            m = block.search(new)
            if m is None:
                problems.append(f"{page}: no markers for table:{name}")
                continue
            body = render(name)
            if m.group(2) != body:
                if check:
                    problems.append(f"{page}: table:{name} is stale (run python benchmarks/tables.py)")
                new = new[: m.start(2)] + body + new[m.end(2) :]
        if not check and new != text:
            path.write_text(new)
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming each stale table")
    p.add_argument("--plots", action="store_true", help="also draw docs/img/*.png")
    args = p.parse_args(argv)
    problems = update(check=args.check)
    for line in problems:
        print(line, file=sys.stderr)
    if args.plots and not args.check:
        for path in plots():
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
