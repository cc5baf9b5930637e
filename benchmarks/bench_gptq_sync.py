"""Benchmark: the GPTQ refresh of a 4-bit rollout copy (`rollout.gptq`) at a weight sync, part by part.

    python benchmarks/bench_gptq_sync.py                     # SmolLM2-135M (the smollm2-add preset), MXFP4
    python benchmarks/bench_gptq_sync.py --precision nvfp4 --out runs/gptq_sync.json

At every sync a GPTQ copy re-rounds its FP4 linears from the policy's new weights: first the Hessians of
their inputs over the run's calibration sequences (a forward of the policy over them, X^T X per input),
then the column loop. The Hessians are timed at each `--batch-tokens` (padded tokens per forward; 1: one
sequence per forward; the library's own size is always among them), interleaved with whole syncs
(`sync_quantized_copy_` after every weight is marked updated), best of `--reps`: a sync less the
Hessians at the library's size is the column loop. Writes a JSON object with the
machine, the settings and the times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PRESET = Path(__file__).resolve().parent.parent / "engine" / "presets" / "smollm2-add.yaml"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("mxfp4", "nvfp4"), default="mxfp4")
    ap.add_argument("--demo", action="store_true", help="the embedded demo model, not SmolLM2")
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if min(args.batch_tokens) < 1:
        raise SystemExit(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import build, gptq_calibration
    from bitrl.kernels.bench_stats import machine
    from bitrl.quant import QuantLinear
    from bitrl.quant.formats import get_format
    from bitrl.quant.gptq import CALIBRATION_BATCH_TOKENS, collect_hessians
    from bitrl.quant.recipe import sync_quantized_copy_
    from bitrl.rollout.precision import make_rollout_model

    cfg = load_config(None if args.demo else PRESET, [f"rollout.precision={args.precision}", *args.set])
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    policy, tokenizer, task = build(cfg, log=log)
    t0 = time.perf_counter()
    calibration = gptq_calibration(policy, tokenizer, task, cfg, log=log)
    calibration_s = time.perf_counter() - t0
    recipe = cfg.rollout.quant_recipe(args.precision)
    if not recipe.gptq:
        raise SystemExit(f"rollout.gptq is off for {args.precision} with these settings: nothing to time")
    t0 = time.perf_counter()
    copy = make_rollout_model(policy, args.precision, recipe, calibration)
    build_s = time.perf_counter() - t0
    names = [
        m.source_name
        for m in copy.modules()
        if isinstance(m, QuantLinear) and m.source_name and get_format(m.fmt).packed
    ]
    hessian_s = dict.fromkeys(sorted({*args.batch_tokens, CALIBRATION_BATCH_TOKENS}), float("inf"))
    sync_s = float("inf")
    for _ in range(args.reps):
        for tokens in hessian_s:
            t0 = time.perf_counter()
            collect_hessians(policy, calibration, names, batch_tokens=tokens)
            hessian_s[tokens] = min(hessian_s[tokens], time.perf_counter() - t0)
        with torch.no_grad():  # as after an optimizer step: every weight's version moves (its bits do not)
            for p in policy.parameters():
                p.mul_(1.0)
        t0 = time.perf_counter()
        stats = sync_quantized_copy_(copy, policy, recipe)
        sync_s = min(sync_s, time.perf_counter() - t0)
        if stats.get("gptq_layers") != len(names):
            raise RuntimeError(f"the sync re-rounded {stats.get('gptq_layers')} of {len(names)} layers")
    result = {
        "benchmark": "bench_gptq_sync",
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/bench_gptq_sync.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": "demo" if args.demo else cfg.model.path,
        "model_dtype": cfg.model.dtype,
        "precision": args.precision,
        "calibration_sequences": len(calibration),
        "calibration_tokens": sum(len(s) for s in calibration),
        "gptq_layers": len(names),
        "calibration_rollout_s": calibration_s,
        "copy_build_s": build_s,
        "hessians_s": {str(k): v for k, v in hessian_s.items()},
        "library_batch_tokens": CALIBRATION_BATCH_TOKENS,
        "sync_s": sync_s,
        "column_loop_s": sync_s - hessian_s[CALIBRATION_BATCH_TOKENS],
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
