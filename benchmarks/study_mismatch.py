"""Study: held-out accuracy and rollout/trainer mismatch on the demo task, for each rollout precision and
mismatch correction, over several seeds, paired by seed against full precision.

    python benchmarks/study_mismatch.py --steps 100 --seeds 0 1 2 --out runs/study
    # or split over processes, then one table:
    python benchmarks/study_mismatch.py --precisions full fp8 --threads 1 --out runs/study/a &
    python benchmarks/study_mismatch.py --precisions mxfp4 nvfp4 --threads 1 --out runs/study/b
    python benchmarks/study_mismatch.py --merge runs/study/a runs/study/b --out runs/study

A precision "mxfp4-floor" (or "mxfp8-floor") runs MX rollouts with OCP floor block scales instead of the
default rceil. Writes <out>/study.json (every run's summary, with its evaluation curve) and <out>/study.md:
the mean accuracy over the evaluations in the second half of training per cell, and each cell's gap to
full precision with a 95% confidence interval over the seeds. Every run of a seed starts from the same
cached warm start and draws the same prompts, so a gap differs only in rollout precision and correction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bitrl.kernels.bench_stats import mean_ci95

# Corrections compared, by their registered names: each carries the usual defaults from the papers
# (kernels/policy_loss/registry.py LossConfig: TIS cap 2, sequence MIS bounds 0.5-2, IcePop 0.5-5, AIS).
CORRECTIONS = ["none", "tis", "seq-mis", "icepop", "ais"]


def run_one(
    precision: str, correction: str, seed: int, steps: int, out: Path, threads: int, eval_every: int
) -> dict:
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run

    # "mxfp4-floor": MX rollouts with OCP floor scales instead of the default rceil
    fmt, _, scale_mode = precision.partition("-")
    cfg = load_config(
        None,
        [
            f"name={precision}-{correction}-s{seed}",
            *([f"rollout.scale_mode={scale_mode}"] if scale_mode else []),
            f"out_dir={out}",
            f"seed={seed}",
            f"steps={steps}",
            f"eval_every={eval_every}",
            f"checkpoint_every={steps}",
            f"threads={threads}",
            f"rollout.precision={fmt}",
            f"train.loss.correction={correction}",
        ],
    )
    t0 = time.perf_counter()
    records = run(cfg, log=lambda *_: None)
    steps_only = [r for r in records if "mismatch_k3_kl" in r]
    curve = [(r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    # The late-training mean (evaluations in the second half) damps the run-to-run chaos of one evaluation.
    late = [a for s, a in curve if s > steps // 2]
    return {
        "precision": precision,
        "correction": correction,
        "seed": seed,
        "steps": steps,
        "accuracy_start": curve[0][1],
        "accuracy_end": curve[-1][1],
        "accuracy_late": statistics.mean(late),
        "curve": curve,
        "mismatch_k3_kl": statistics.mean(r["mismatch_k3_kl"] for r in steps_only),
        "mismatch_chi2_token": statistics.mean(r["mismatch_chi2_token"] for r in steps_only),
        "wall_time_s": time.perf_counter() - t0,
    }


def paired_gaps(results: list[dict], key: str, baseline=("full", "none")) -> list[tuple]:
    """Per (precision, correction): mean and 95% CI of (cell - baseline) over the seeds both ran, in points.
    Pairing by seed removes the shared warm start and data order from the comparison."""
    base = {r["seed"]: r[key] for r in results if (r["precision"], r["correction"]) == baseline}
    cells = dict.fromkeys((r["precision"], r["correction"]) for r in results)
    rows = []
    for cell in cells:
        if cell == baseline:
            continue
        gaps = [
            100 * (r[key] - base[r["seed"]])
            for r in results
            if (r["precision"], r["correction"]) == cell and r["seed"] in base
        ]
        if len(gaps) >= 2:
            rows.append((*cell, len(gaps), *mean_ci95(gaps)))
    return rows


def table(results: list[dict], precisions, corrections) -> str:
    def cell(p, c):
        runs = [r for r in results if r["precision"] == p and r["correction"] == c]
        if not runs:
            return "—"
        acc = [100 * r["accuracy_late"] for r in runs]
        spread = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
        k3 = statistics.mean(r["mismatch_k3_kl"] for r in runs)
        return f"{statistics.mean(acc):.1f}{spread} (k3 {k3:.1e})"

    seeds = sorted({r["seed"] for r in results})
    steps = sorted({r["steps"] for r in results})
    lines = [
        "| rollout \\ correction | " + " | ".join(corrections) + " |",
        "|---" * (len(corrections) + 1) + "|",
    ]
    for p in precisions:
        lines.append(f"| {p} | " + " | ".join(cell(p, c) for c in corrections) + " |")
    start = statistics.mean(100 * r["accuracy_start"] for r in results)
    lines.append(
        f"\nHeld-out accuracy (%), mean of the evaluations in the second half of {steps} RL steps, mean ± std"
        f" over seeds {seeds}; warm start {start:.1f}%; k3: mean per-token mismatch.\n"
    )
    lines += [
        "| rollout | correction | seeds | gap to full precision, late mean (points, 95% CI) |"
        " gap, final evaluation |",
        "|---|---|---|---|---|",
    ]
    final = {(p, c): (m, h) for p, c, _, m, h in paired_gaps(results, "accuracy_end")}
    for p, c, n, mean, half in paired_gaps(results, "accuracy_late"):
        fm, fh = final[(p, c)]
        lines.append(f"| {p} | {c} | {n} | {mean:+.1f} ± {half:.1f} | {fm:+.1f} ± {fh:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precisions", nargs="+", default=["full", "fp8", "mxfp4", "nvfp4"])
    parser.add_argument("--corrections", nargs="+", default=CORRECTIONS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="runs/study")
    parser.add_argument(
        "--merge", nargs="+", metavar="DIR", help="only tabulate the study.json of these folders"
    )
    args = parser.parse_args()
    if args.merge:
        results = [r for d in args.merge for r in json.loads((Path(d) / "study.json").read_text())]
        precisions = list(dict.fromkeys(r["precision"] for r in results))
        corrections = list(dict.fromkeys(r["correction"] for r in results))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "study.json").write_text(json.dumps(results, indent=1))
        (Path(args.out) / "study.md").write_text(table(results, precisions, corrections) + "\n")
        print(table(results, precisions, corrections))
        return
    from bitrl.kernels import CORRECTIONS as registered

    unknown = set(args.corrections) - set(registered)
    if unknown:
        parser.error(f"unknown corrections {sorted(unknown)}; choose from {sorted(registered)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "study.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["precision"], r["correction"], r["seed"]) for r in results}
    for seed in args.seeds:
        for precision in args.precisions:
            for correction in args.corrections:
                if (precision, correction, seed) in done:
                    continue
                result = run_one(precision, correction, seed, args.steps, out, args.threads, args.eval_every)
                print(json.dumps(result), flush=True)
                results.append(result)
                results_path.write_text(json.dumps(results, indent=1))  # resumable: finished runs are kept
    (out / "study.md").write_text(table(results, args.precisions, args.corrections) + "\n")
    print(table(results, args.precisions, args.corrections))


if __name__ == "__main__":
    main()
