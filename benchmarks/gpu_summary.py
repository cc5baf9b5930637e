"""The README's GPU rows, read from the files ``benchmarks/gpu_check.sh`` writes into its output folder.

    python benchmarks/gpu_summary.py OUTDIR     # -> OUTDIR/summary.json and OUTDIR/summary.md

Each row names the file it comes from; a missing file gives "not measured" rows rather than an error, so a
partial run still summarises what it did. The goals are the issue's: fused GRPO loss >= 60% of the bf16
roofline and >= 1.2x Liger-Kernel; quantize / dequantize >= 70% of HBM bandwidth; FP4 GEMV >= 60% at M = 1;
the bf16 decode step >= 50% of its memory-traffic floor (weights + KV cache over the measured copy bandwidth).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

GOALS = {"loss_roofline": 0.60, "loss_vs_liger": 1.2, "quant_hbm": 0.70, "gemv_hbm": 0.60, "decode_hbm": 0.50}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_counts(log: Path) -> dict | None:
    """passed / failed / skipped / errors: from ``tests.jsonl`` beside ``log`` where the run wrote one (a
    line per test as it ended, so a group cut short still counts), else the last pytest summary of ``log``."""
    lines_path = log.with_suffix(".jsonl")
    if lines_path.is_file():
        counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        for line in lines_path.read_text().splitlines():
            t = json.loads(line)
            key = {"passed": "passed", "skipped": "skipped"}.get(t["outcome"], "failed")
            counts["errors" if key == "failed" and t["when"] != "call" else key] += 1
        return counts
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        found = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", line))
        if found:
            found["errors"] = found.pop("error", 0) + found.pop("errors", 0)
            return {k: found.get(k, 0) for k in ("passed", "failed", "skipped", "errors")}
    return None


def loss_rows(results) -> list[dict]:
    gpu = [r for r in results or [] if r.get("section") == "gpu" and r.get("op") == "grpo"]
    by = {r["variant"]: r for r in gpu}
    rows = []
    for name, r in by.items():
        row = {
            "what": f"GRPO loss with LM head, fwd+bwd, {name}",
            "shape": f"N={r['N']} H={r['H']} V={r['V']} bf16",
            "TFLOP/s": r["tflops"],
            "fraction_of_bf16_roofline": r["roofline_frac"],
            "time_s": r["time_s"],
        }
        liger = by.get("liger-kernel (eager)")
        if liger and name == "bitrl":
            row["speedup_vs_liger"] = liger["time_s"] / r["time_s"]
        rows.append(row)
    return rows


def bandwidth_rows(quant) -> list[dict]:
    rows = []
    for key, v in ((quant or {}).get("bandwidth") or {}).items():
        fmt, op = key.split("-", 1)
        rows.append(
            {
                "what": f"{op} {fmt}",
                "shape": "8192x8192 bf16",
                "GB/s": v["GB/s"],
                "fraction_of_hbm": v["fraction_of_hbm"],
            }
        )
    for key, v in ((quant or {}).get("gemv") or {}).items():
        fmt, impl, shape = key.split("-", 2)
        rows.append(
            {
                "what": f"FP4 GEMV {fmt}, {impl}",
                "shape": f"MxNxK={shape}",
                "GB/s": v["GB/s"],
                "fraction_of_hbm": v["fraction_of_hbm"],
            }
        )
    return rows


def decode_rows(decode) -> list[dict]:
    shape = (
        ""
        if decode is None
        else f"{decode['model']}, batch {decode['rows']}, context {decode['prompt_len']}+"
    )
    return [
        {
            "what": f"decode step, {r['precision']}",
            "shape": shape + str(decode["new_tokens"]),
            "step_ms": r["step_ms"],
            "tokens_per_s": r["tokens_per_s"],
            "fraction_of_hbm": r["fraction_of_bandwidth"],
            "step_vs_full": r.get("step_vs_full"),
        }
        for r in (decode or {}).get("results", [])
    ]


def goals(loss: list[dict], bw: list[dict], decode: list[dict] = ()) -> dict:
    """Each goal: the best measured value and whether it is met (None: not measured)."""

    def best(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    bitrl = [r for r in loss if r["what"].endswith(", bitrl")]
    measured = {
        "loss_roofline": best(r["fraction_of_bf16_roofline"] for r in bitrl),
        "loss_vs_liger": best(r.get("speedup_vs_liger") for r in bitrl),
        "quant_hbm": best(
            r["fraction_of_hbm"] for r in bw if r["what"].split()[0] in ("quantize", "dequantize")
        ),
        "gemv_hbm": best(
            r["fraction_of_hbm"]
            for r in bw
            if "cuda fp4_gemv" in r["what"] and r["shape"].startswith("MxNxK=1x")
        ),
        "decode_hbm": best(r["fraction_of_hbm"] for r in decode if r["what"] == "decode step, full"),
    }
    return {
        k: {"target": GOALS[k], "measured": v, "met": None if v is None else v >= GOALS[k]}
        for k, v in measured.items()
    }


def summarize(out: Path) -> dict:
    results = _load(out / "bench_kernels" / "results.json")
    quant = _load(out / "quant" / "gpu_quant.json")
    resources = _load(out / "kernel_resources.json")
    loss, bw = loss_rows(results), bandwidth_rows(quant)
    decode = decode_rows(_load(out / "decode.json"))
    device = (quant or {}).get("device")
    if device is None and (out / "gpu.txt").exists():
        device = ((out / "gpu.txt").read_text().splitlines() or [None])[-1]
    summary = {
        "device": device,
        "tests": test_counts(out / "tests.log"),
        "compiled_specializations": None if resources is None else resources["n_compiles"],
        "compile_errors": None if resources is None else sum("error" in r for r in resources["kernels"]),
        "hot_spills": None
        if resources is None
        else sum(bool(r.get("hot") and r.get("spills")) for r in resources["kernels"]),
        "fused_loss": loss or "not measured",
        "bandwidth": bw or "not measured",
        "decode": decode or "not measured",
        "exact_triton_vs_torch": (quant or {}).get("exact") or "not measured",
        "goals": goals(loss, bw, decode),
    }
    return summary


def to_markdown(s: dict) -> str:
    def pct(v):
        return "not measured" if v is None else f"{100 * v:.0f}%"

    lines = [f"device: {s['device']}", f"tests: {s['tests']}", ""]
    lines += [
        "| kernel | shape | TFLOP/s or GB/s | fraction of roofline / HBM | vs Liger |",
        "|---|---|---|---|---|",
    ]
    for r in s["fused_loss"] if isinstance(s["fused_loss"], list) else []:
        vs = r.get("speedup_vs_liger")
        lines.append(
            f"| {r['what']} | {r['shape']} | {r['TFLOP/s']:.0f} TFLOP/s | "
            f"{pct(r['fraction_of_bf16_roofline'])} | {'' if vs is None else f'{vs:.2f}x'} |"
        )
    for r in s["bandwidth"] if isinstance(s["bandwidth"], list) else []:
        lines.append(f"| {r['what']} | {r['shape']} | {r['GB/s']:.0f} GB/s | {pct(r['fraction_of_hbm'])} | |")
    for r in s["decode"] if isinstance(s["decode"], list) else []:
        vs = r["step_vs_full"]
        lines.append(
            f"| {r['what']} | {r['shape']} | {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s | "
            f"{pct(r['fraction_of_hbm'])} | {'' if vs is None else f'{vs:.2f}x the bf16 step'} |"
        )
    lines += ["", "| goal | target | measured | met |", "|---|---|---|---|"]
    for k, g in s["goals"].items():
        m = g["measured"]
        lines.append(f"| {k} | {g['target']} | {'not measured' if m is None else f'{m:.2f}'} | {g['met']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_summary.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    s = summarize(out)
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    md = to_markdown(s)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
