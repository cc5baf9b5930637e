"""Study: held-out accuracy and rollout/trainer mismatch on the demo task, for each rollout precision and
mismatch correction, over several seeds.

    python benchmarks/study_mismatch.py --steps 100 --seeds 0 1 2 --out runs/study
    # or split over processes, then one table:
    python benchmarks/study_mismatch.py --precisions full fp8 --threads 1 --out runs/study/a &
    python benchmarks/study_mismatch.py --precisions mxfp4 nvfp4 --threads 1 --out runs/study/b
    python benchmarks/study_mismatch.py --merge runs/study/a runs/study/b --out runs/study

Writes <out>/study.json (every run's summary) and <out>/study.md (the table for the README). Every run of
a seed starts from the same cached warm start, so the columns differ only in rollout precision and correction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# Correction presets: name -> (registered correction, its parameters). Defaults from the papers (DESIGN.md).
PRESETS = {
    "none": ("none", {}),
    "tis": ("tis-token", {"correction_cap": 2.0}),
    "seq-mis": ("mask-seq", {"correction_low": 0.5, "correction_high": 2.0}),
    "icepop": ("icepop", {"icepop_alpha": 0.5, "icepop_beta": 5.0}),
    "ais": ("ais", {}),
}


def run_one(precision: str, correction: str, seed: int, steps: int, out: Path, threads: int) -> dict:
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run

    name, args = PRESETS[correction]
    cfg = load_config(
        None,
        [
            f"name={precision}-{correction}-s{seed}",
            f"out_dir={out}",
            f"seed={seed}",
            f"steps={steps}",
            f"eval_every={steps}",
            f"checkpoint_every={steps}",
            f"threads={threads}",
            f"rollout.precision={precision}",
            f"train.correction={name}",
            f"train.correction_args={json.dumps(args)}",
        ],
    )
    t0 = time.perf_counter()
    records = run(cfg, log=lambda *_: None)
    steps_only = [r for r in records if "mismatch_k3_kl" in r]
    return {
        "precision": precision,
        "correction": correction,
        "seed": seed,
        "accuracy_start": records[0]["accuracy"],
        "accuracy_end": records[-1]["accuracy"],
        "mismatch_k3_kl": statistics.mean(r["mismatch_k3_kl"] for r in steps_only),
        "mismatch_chi2_token": statistics.mean(r["mismatch_chi2_token"] for r in steps_only),
        "wall_time_s": time.perf_counter() - t0,
    }


def table(results: list[dict], precisions, corrections) -> str:
    def cell(p, c):
        runs = [r for r in results if r["precision"] == p and r["correction"] == c]
        if not runs:
            return "—"
        acc = [100 * r["accuracy_end"] for r in runs]
        spread = f" ± {statistics.stdev(acc):.1f}" if len(acc) > 1 else ""
        k3 = statistics.mean(r["mismatch_k3_kl"] for r in runs)
        return f"{statistics.mean(acc):.1f}{spread} (k3 {k3:.1e})"

    lines = [
        "| rollout \\ correction | " + " | ".join(corrections) + " |",
        "|---" * (len(corrections) + 1) + "|",
    ]
    for p in precisions:
        lines.append(f"| {p} | " + " | ".join(cell(p, c) for c in corrections) + " |")
    start = statistics.mean(100 * r["accuracy_start"] for r in results)
    lines.append(f"\nHeld-out accuracy (%) after RL, mean ± std over seeds; warm start {start:.1f}%. ")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precisions", nargs="+", default=["full", "fp8", "mxfp4", "nvfp4"])
    parser.add_argument("--corrections", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
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
    from bitrl.kernels import CORRECTIONS

    corrections = [c for c in args.corrections if PRESETS[c][0] in CORRECTIONS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "study.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["precision"], r["correction"], r["seed"]) for r in results}
    for seed in args.seeds:
        for precision in args.precisions:
            for correction in corrections:
                if (precision, correction, seed) in done:
                    continue
                result = run_one(precision, correction, seed, args.steps, out, args.threads)
                print(json.dumps(result), flush=True)
                results.append(result)
                results_path.write_text(json.dumps(results, indent=1))  # resumable: finished runs are kept
    (out / "study.md").write_text(table(results, args.precisions, corrections) + "\n")
    print(table(results, args.precisions, corrections))


if __name__ == "__main__":
    main()
