"""Decode-step time against its memory-traffic floor, for the rollout engine's precisions.

At batch 64 a decode step of a sub-billion-parameter model reads every weight once and the batch's K/V
cache once, and does little arithmetic per byte, so its floor is (weight bytes + KV bytes) / HBM bandwidth.
This measures the engine's step against that floor for a Qwen2-0.5B-shaped model (built from its config with
random weights: traffic does not depend on the values) in bf16, and for its FP8 (W8A8 `_scaled_mm`) and
NVFP4 / MXFP4 (W4A16 Triton) rollout copies.

    python benchmarks/bench_decode.py --out runs/bench_decode.json          # on a CUDA device
    python benchmarks/bench_decode.py --tiny --device cpu --out /tmp/d.json # the smoke test's size

Method: `generate` with EOS disabled, timed for 1 and for 1 + N new tokens (same prompts, same seed; medians
of interleaved repetitions); the step time is the difference over N, so prefill and the first token cancel.
Bytes per step: every linear weight as stored (packed data and scales for quantized layers), the LM head,
and the K/V of the whole slot cache (the compiled step attends over a fixed width, the cache's). Bandwidth:
a device-to-device copy of 2 GiB, read + write bytes over its time. Writes one JSON object: the settings,
the bandwidth, one row per precision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# Qwen2-0.5B's shape; TINY shrinks it for the CPU smoke test.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one forward of one token reads from the weights: linears as stored, plus the LM head."""
    from bitrl.quant import QuantLinear

    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            held = [module.qdata, module.qscale, module.qtensor_scale, module.bias]
            total += sum(t.numel() * t.element_size() for t in held if t is not None)
        elif isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings():
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    head = model.get_output_embeddings().weight
    return total + head.numel() * head.element_size()


def kv_bytes(config, rows: int, columns: int, dtype: torch.dtype) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    per_column = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return rows * columns * per_column * torch.tensor([], dtype=dtype).element_size()


def copy_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return 2 * src.numel() / min(seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(
    model, prompts, lengths: tuple[int, int], device, reps: int, options
) -> tuple[float, float]:
    """Median wall seconds of `RolloutEngine.generate` (EOS disabled, engine `options`) at each of two
    lengths, interleaved rep by rep so both see the same conditions, after one warm-up each (compilation,
    allocator, autotuning)."""
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling

    engines = {
        n: RolloutEngine(model, Sampling(max_new_tokens=n, eos_id=-1, pad_id=0), options) for n in lengths
    }

    def once(new_tokens):
        g = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        engines[new_tokens].generate(prompts, generator=g)
        _sync(device)
        return time.perf_counter() - start

    for n in lengths:
        once(n)
    times = [[once(n) for n in lengths] for _ in range(reps)]
    return tuple(statistics.median(t[i] for t in times) for i in range(2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (the smoke test)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--precisions", nargs="+", default=["full", "fp8", "nvfp4", "mxfp4"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from transformers import Qwen2ForCausalLM

    from bitrl.engine.models import architecture_config
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.rollout.settings import EngineOptions

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode: no CUDA device here (use --device cpu --tiny for the smoke test)")
    torch.manual_seed(0)
    config = architecture_config("qwen2-0.5b", **(TINY if args.tiny else {}))
    policy = Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, config.vocab_size, (args.rows, args.prompt_len), generator=g).tolist()
    bandwidth = copy_bandwidth(device, args.copy_gib)
    columns = args.prompt_len + args.new_tokens
    rows = []
    for precision in args.precisions:
        model = policy if precision == "full" else make_rollout_model(policy, precision)
        options = EngineOptions(max_batch_rows=args.rows)
        first, total = time_generate(model, prompts, (1, 1 + args.new_tokens), device, args.reps, options)
        if total <= first:
            raise SystemExit(f"{precision}: timing noise exceeds the decode time; raise --new-tokens")
        step_s = (total - first) / args.new_tokens
        w, kv = weight_bytes(model), kv_bytes(config, args.rows, columns, torch.bfloat16)
        floor_s = (w + kv) / bandwidth
        row = dict(
            precision=precision,
            step_ms=1e3 * step_s,
            weight_mib=w / 2**20,
            kv_mib=kv / 2**20,
            floor_ms=1e3 * floor_s,
            fraction_of_bandwidth=floor_s / step_s,
            tokens_per_s=args.rows / step_s,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        row["step_vs_full"] = row["step_ms"] / rows[0]["step_ms"] if rows[0]["precision"] == "full" else None
        result = dict(
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            model="tiny" if args.tiny else "Qwen2-0.5B shape, random weights",
            rows=args.rows,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            copy_bandwidth_gb_s=bandwidth / 1e9,
            results=rows,
        )
        # written after every precision: a run stopped by a time limit keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
