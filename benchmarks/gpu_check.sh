#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run of at most 10 minutes, with its results in OUTDIR:
#   gpu.txt            the device and the versions used
#   tests.log          the whole test suite on the GPU: compiled Triton kernels instead of the interpreter,
#                      FP8 _scaled_mm, W4A16, and the CUDA end-to-end training run
#   bench.json/.log    the kernel and quantization benchmarks (pytest-benchmark), GPU sections included
#   verify_*.json      speculative reuse: a rollout whose drafts are all accepted against fresh generation,
#                      on the demo (short responses), and with long responses from an untrained model for
#                      256 and for 8 rows
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
timeout 270 $py -m pytest -q tests -p no:cacheprovider -rs 2>&1 | tee "$out/tests.log"
status=${PIPESTATUS[0]}

timeout 120 $py -m pytest -q benchmarks -p no:cacheprovider --benchmark-only \
  --benchmark-json "$out/bench.json" 2>&1 | tee "$out/bench.log"

timeout 45 $py benchmarks/bench_reuse.py --verification-cost >"$out/verify_demo.json" 2>&1
long="warmstart.steps=0 rollout.max_new_tokens=256"
timeout 60 $py benchmarks/bench_reuse.py --verification-cost --set $long >"$out/verify_long.json" 2>&1
timeout 30 $py benchmarks/bench_reuse.py --verification-cost --set $long rollout.prompts_per_step=1 \
  >"$out/verify_long_8rows.json" 2>&1

timeout 60 $py -m bitrl train steps=50 eval_every=25 "out_dir=$scratch/runs" 2>&1 | tail -n 30 >"$out/demo.log"
exit "$status"
