#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run of at most 10 minutes, with its results in OUTDIR:
#   gpu.txt            the device and the versions used
#   tests.log          the whole test suite on the GPU: compiled Triton kernels instead of the interpreter,
#                      FP8 _scaled_mm, W4A16, and the CUDA end-to-end training run
#   bench.json/.log    the kernel and quantization benchmarks (pytest-benchmark), GPU sections included
#   verify.jsonl       speculative reuse: a rollout whose drafts are all accepted against fresh generation,
#                      on the demo, with long responses for 256 and 8 rows, and with a 150M bf16 model
#   demo.log           `bitrl train` for 50 steps on the GPU (bf16 autocast)
# Usage: benchmarks/gpu_check.sh OUTDIR   (PYTHON=... picks the interpreter; each step's failure is logged
# and the next step still runs; the exit status is that of the test suite.)
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
py=${PYTHON:-python3}
mkdir -p "$out"
scratch=$(mktemp -d)  # warm-start cache and run folders: only the summaries above go to OUTDIR
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 BITRL_CACHE=${BITRL_CACHE:-$scratch/cache}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| triton', triton.__version__, '| transformers', transformers.__version__)"
} >"$out/gpu.txt" 2>&1

# The package itself, if this interpreter lacks it (its dependencies must be there: offline machines too).
$py -c "import bitrl" 2>/dev/null || $py -m pip install -q --no-deps --no-build-isolation -e .

# The GPU suite must not fall back to the interpreter.
unset TRITON_INTERPRET
timeout 240 $py -m pytest -q tests -p no:cacheprovider -rs 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}

timeout 90 $py -m pytest -q benchmarks -p no:cacheprovider --benchmark-only \
  --benchmark-json "$out/bench.json" 2>&1 | tee "$out/bench.log"

# One JSON line per setting: the demo; long responses (untrained model) for 256 and for 8 rows; and a
# 150M-parameter bf16 model with long responses, where decoding is bound by memory traffic, not arithmetic.
long="warmstart.steps=0 rollout.max_new_tokens=256"
big="model.hidden_size=1024 model.intermediate_size=2816 model.num_layers=12 model.num_heads=16"
big="$big model.num_kv_heads=4 model.dtype=bfloat16"
for setting in "" "$long" "$long rollout.prompts_per_step=1" "$long $big"; do
  # shellcheck disable=SC2086  # each setting is a list of overrides
  timeout 50 $py benchmarks/bench_reuse.py --verification-cost --set $setting 2>&1 | tr -d '\n' >>"$out/verify.jsonl"
  echo >>"$out/verify.jsonl"
done

timeout 45 $py -m bitrl train steps=50 eval_every=25 "out_dir=$scratch/runs" 2>&1 | tail -n 30 >"$out/demo.log"
exit "$status"
