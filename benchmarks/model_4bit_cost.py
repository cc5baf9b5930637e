"""Model: what each 4-bit rollout remedy costs on a GPU, per decode step and per weight sync, without a GPU.

Decode is bound by reading memory: a step reads every linear weight at its stored width, the LM head and the
KV cache. A remedy that stores more (kept outliers, FP8 layers) costs its extra bytes; one that adds kernels
(the unfused outlier gather, an online rotation) costs their launches; error-chosen scales and GPTQ store
the format's own codes and scales, so they cost nothing per step. GPTQ costs at every sync instead: the
calibration rollouts of the policy, the Hessians X^T X of every layer's inputs, and its column loop (one
column at a time, ~12 eager kernels each, every block of the model batched into one loop).

The bits per weight of each remedy are the study's measured ones (study_4bit_smollm2.json); the shapes are
the preset's model. The device is an H100 SXM by its data sheet (HBM 3.35 TB/s, FP32 67 TFLOP/s), 5 µs per
eager kernel launch and 2 µs per kernel of a CUDA-graph decode step, whose ~12 kernels per layer set a floor
under a small model's step (SmolLM2's weights alone would read in 35 µs).

    python benchmarks/model_4bit_cost.py --out benchmarks/results/model_4bit_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "engine" / "presets" / "smollm2-add.yaml"
STUDY = ROOT / "benchmarks" / "results" / "study_4bit_smollm2.json"
GPU = {
    "name": "H100 SXM (data sheet)",
    "hbm_bytes_s": 3.35e12,
    "fp32_flop_s": 67e12,
    "launch_s": 5e-6,
    "graph_kernel_s": 2e-6,
}
DECODE_KERNELS_PER_LAYER = 12  # norms, projections, rope, attention, activation, residual adds
LAUNCHES_PER_GPTQ_COLUMN = 12  # the column step of bitrl.quant.gptq: round, error, rank-1 update, stores

# remedy -> (study row with it, study row without it, extra kernel launches per linear per decode step)
REMEDIES = {
    "nvfp4: error-chosen scales": ("nvfp4-mse", "nvfp4-legacy", 0),
    "nvfp4: GPTQ": ("nvfp4-gptq-damp0.1", "nvfp4-mse", 0),
    "nvfp4: outliers > 4 medians in bf16 (unfused)": ("nvfp4-tau4", "nvfp4-mse", 2),
    "nvfp4: 30 linears in FP8": ("nvfp4-fp8x30", "nvfp4-mse", 0),
    "nvfp4: online Hadamard rotation of every input": ("nvfp4-rot-inputs", "nvfp4-mse", 1),
    "mxfp4: error-chosen scales": ("mxfp4-mse", "mxfp4-legacy", 0),
    "mxfp4: outliers > 8 medians in bf16 (unfused)": ("mxfp4-tau8", "mxfp4-mse", 2),
    "mxfp4: GPTQ, 256 prompts": ("mxfp4-tau8-gptq-damp0.1-256", "mxfp4-tau8", 0),
    "mxfp4: 10 linears in FP8": ("mxfp4-fp8x10", "mxfp4-tau8", 0),
}


def gptq_sync_seconds(
    shape, prompts: int, tokens_per_seq: int, decode_steps: int, step_s: float, gpu
) -> dict:
    """GPTQ's cost at one sync: calibration rollouts (``decode_steps`` policy steps of ``step_s`` each),
    Hessians, column loop (seconds each), and their total."""
    per_layer = shape.linear_shapes()
    inputs = [per_layer["q_proj"][0], per_layer["o_proj"][0], per_layer["gate_proj"][0]]
    inputs.append(per_layer["down_proj"][0])  # q/k/v and gate/up read one input each: one Hessian
    tokens = prompts * tokens_per_seq
    hessian_flops = 2 * tokens * shape.layers * sum(n * n for n in inputs)
    columns = sum(inputs)  # every block's like problems share one loop
    parts = {
        "calibration_rollout_s": decode_steps * step_s,  # all prompts in one batch, prefill included
        "hessian_s": hessian_flops / gpu["fp32_flop_s"],
        "column_loop_s": columns * LAUNCHES_PER_GPTQ_COLUMN * gpu["launch_s"],
    }
    return {
        "calibration_tokens": tokens,
        "hessian_tflop": hessian_flops / 1e12,
        "column_steps": columns,
        **parts,
        "total_s": sum(parts.values()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/model_4bit_cost.json")
    p.add_argument("--batch", type=int, default=64, help="decode rows (the preset: 8 prompts x 8 samples)")
    p.add_argument("--context", type=int, default=96, help="tokens in the KV cache per row")
    args = p.parse_args(argv)
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import model_config
    from bitrl.train.memory import ModelShape

    cfg = load_config(PRESET, [])
    shape = ModelShape.from_config(model_config(cfg))
    rows = {r["recipe"]: r for r in json.loads(STUDY.read_text())["rows"]}
    linears = 7 * shape.layers
    head_bytes = 2 * shape.vocab * shape.hidden  # the LM head in bf16
    kv_bytes = args.batch * args.context * 2 * shape.layers * shape.kv_heads * shape.head_dim * 2

    def step_bytes(bits: float) -> float:
        return shape.linear_params * bits / 8 + head_bytes + kv_bytes

    def decode_s(bits: float) -> float:
        floor = DECODE_KERNELS_PER_LAYER * shape.layers * GPU["graph_kernel_s"]
        return max(step_bytes(bits) / GPU["hbm_bytes_s"], floor)

    out_rows = []
    for remedy, (with_, without, launches) in REMEDIES.items():
        bits, base_bits = rows[with_]["weight_bits"], rows[without]["weight_bits"]
        step = decode_s(base_bits)
        extra = decode_s(bits) - step + launches * linears * GPU["graph_kernel_s"]
        if "rotation" in remedy:  # read and write the rotated activation of every linear, bf16
            inputs = sum(i for i, _ in shape.linear_shapes().values()) * shape.layers
            extra += 4 * args.batch * inputs / GPU["hbm_bytes_s"]
        out_rows.append(
            {
                "remedy": remedy,
                "study_rows": [with_, without],
                "bits_per_weight": [bits, base_bits],
                "decode_step_s": step,
                "extra_per_decode_step_s": extra,
                "extra_fraction": extra / step,
                # where the weights' bytes bound the step (a large model): the extra bytes' share
                "extra_bytes_fraction": step_bytes(bits) / step_bytes(base_bits) - 1,
                "k3": [rows[with_]["k3_per_token"], rows[without]["k3_per_token"]],
            }
        )
    tokens_per_seq = 64 + cfg.rollout.max_new_tokens  # the preset's prompts are ~60 tokens with the template
    steps = 1 + cfg.rollout.max_new_tokens
    sync = {  # rollout.gptq_prompts: nvfp4's default, mxfp4's
        str(n): gptq_sync_seconds(shape, n, tokens_per_seq, steps, decode_s(16), GPU) for n in (64, 256)
    }
    rollout_step_s = steps * decode_s(4.5)
    result = {
        "model": "SmolLM2-135M-Instruct (preset smollm2-add)",
        "gpu": GPU,
        "batch": args.batch,
        "context": args.context,
        "remedies": out_rows,
        "gptq_per_sync": sync,
        "preset_rollout_decode_s": rollout_step_s,
        "command": "python benchmarks/model_4bit_cost.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
