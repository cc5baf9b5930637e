"""The LM head of a CPU decode step in its two forms: torch's x @ W.T against bitrl's weight-major blocks.

`bitrl.kernels.weight_major` computes logits [R, V] = x [R, H] @ W [V, H].T block by block of W's rows as
W[s:e] @ x.T; the decoder takes that form where `use_weight_major` says so (CPU, fp32, 16 <= R <= 256). This
times both forms interleaved in one process (best of --reps rounds after a warm-up round), at SmolLM2-135M's
head (H 576, V 49152) by default, for each row count and dtype, and records whether their bits agree and the
CPU:

    python benchmarks/bench_head.py --rows 1 16 64 128 256 512 --dtypes fp32 bf16 \
        --out benchmarks/results/bench_head.json

bf16 is meaningful only on a CPU with bf16 units (elsewhere torch emulates it); the file records which.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

from bitrl.kernels.bench_stats import interleaved_times, machine
from bitrl.kernels.weight_major import use_weight_major, weight_major_linear

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/bench_head.json")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        weight = torch.randn(args.vocab, args.hidden, generator=g).to(dtype)
        for rows in args.rows:
            x = torch.randn(rows, args.hidden, generator=g).to(dtype)
            with torch.no_grad():
                runs = {
                    "torch": partial(torch.mm, x, weight.T),
                    "blocks": partial(weight_major_linear, x, weight),
                }
                plain, blocks = (min(t) for t in interleaved_times(runs, args.reps).values())
                same_bits = torch.equal(x @ weight.T, weight_major_linear(x, weight))
                taken = use_weight_major(x, weight)
            flops = 2 * rows * args.hidden * args.vocab
            row = dict(
                dtype=dtype_name,
                rows=rows,
                torch_ms=1e3 * plain,
                weight_major_ms=1e3 * blocks,
                speedup=plain / blocks,
                torch_gflops=flops / plain / 1e9,
                weight_major_gflops=flops / blocks / 1e9,
                same_bits=same_bits,
                decoder_takes_weight_major=taken,
            )
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    command = "python benchmarks/bench_head.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(
        command=command.strip().replace(f"{REPO}/", ""),  # relative to the checkout
        machine=machine(),
        threads=torch.get_num_threads(),
        hidden=args.hidden,
        vocab=args.vocab,
        reps=args.reps,
        rows=rows_out,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} (the head-forms table: python benchmarks/tables.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
