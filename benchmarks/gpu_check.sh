#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run of at most 8 minutes on one H200, with its results in OUTDIR:
#   gpu.txt               the device and the versions used
#   tests.log             the GPU test suite: compiled Triton kernels (no interpreter) against their references,
#                         the CUDA C++ kernels (fused sampler, FP4 GEMV) against their torch twins, FP8
#                         _scaled_mm, W4A16, native FP4 on Blackwell, the bf16-autocast end-to-end run
#   kernel_resources.json registers / spills / shared memory of every Triton specialization (sm_90, sm_100)
#   bench_kernels/        fused GRPO loss at N=16384 H=4096 V=151936 bf16: TFLOP/s, fraction of the measured
#                         bf16 matmul roofline, ratio to Liger-Kernel (results.json, table.md)
#   quant/                quantize / dequantize / FP4 GEMV GB/s and fraction of HBM bandwidth, matmuls,
#                         requantize time (gpu_quant.json, gpu_quant.txt)
#   summary.json / .md    the README's GPU rows and the GPU goals, read from the files above
#   decode.json           the rollout engine's decode step against (weight + KV bytes) / HBM bandwidth for a
#                         Qwen2-0.5B-shaped bf16 model at batch 64, and its NVFP4 (W4A16) / FP8 (W8A8) copies
#   verify.jsonl          speculative-reuse verification cost (`bitrl train` on CUDA runs in the test suite)
# Usage: benchmarks/gpu_check.sh OUTDIR   (PYTHON=... picks the interpreter; GPU_CHECK_DRY_RUN=1 prints the
# steps with their time limits and runs nothing. Each step's failure is logged and the next step still runs;
# the exit status is that of the test suite.) The step limits add up to 450 s.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
py=${PYTHON:-python3}
dry=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$out"
scratch=$(mktemp -d)  # warm-start cache and run folders: only the summaries above go to OUTDIR
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 BITRL_CACHE=${BITRL_CACHE:-$scratch/cache}
budget=0

# step SECONDS LOGFILE COMMAND...: run COMMAND under a time limit, its output appended to LOGFILE
step() {
  local limit=$1 log=$2
  shift 2
  budget=$((budget + limit))
  if [ "$dry" != "0" ]; then
    echo "step ${limit}s -> ${log#"$out"/}: $*"
    return 0
  fi
  timeout "$limit" "$@" >>"$log" 2>&1
}

if [ "$dry" = "0" ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| triton', triton.__version__, '| transformers', transformers.__version__)"
    command -v nvcc && nvcc --version | tail -n 1
  } >"$out/gpu.txt" 2>&1
  # The package itself, if this interpreter lacks it (its dependencies must be there: offline machines too).
  $py -c "import bitrl" 2>/dev/null || $py -m pip install -q --no-deps --no-build-isolation -e .
fi

# The GPU suite must not fall back to the interpreter.
unset TRITON_INTERPRET
gpu_tests=(
  tests/test_csrc.py tests/test_kernels_gpu_paths.py tests/test_quant_linear.py tests/test_quant_triton.py
  tests/test_kernels_fused_logprobs.py tests/test_kernels_fused_linear.py tests/test_kernels_policy_loss.py
  tests/test_kernels_loss_naive.py tests/test_kernels_helpers.py "tests/test_end_to_end.py::test_short_run_on_cuda"
)
step 180 "$out/tests.log" $py -m pytest -q "${gpu_tests[@]}" -p no:cacheprovider -rs
status=$?
[ "$dry" = "0" ] && cat "$out/tests.log"

# Every Triton specialization compiled for sm_90 and sm_100 (the CPU-side check, here on more cores).
step 45 "$out/compile.log" $py -m bitrl.quant.aot "$out/kernel_resources.json"

# Fused loss at the GPU target shape (the CPU section at its quick size only, to save time).
step 70 "$out/bench_kernels.log" $py -m bitrl.kernels.bench --quick --no-memory --ops grpo --reps 3 \
  --out "$out/bench_kernels"
step 55 "$out/quant.log" $py benchmarks/bench_quant.py --gpu-out "$out/quant"
# The rollout engine's decode step (CUDA graphs) against (weight + KV bytes) / HBM bandwidth, Qwen2-0.5B shape.
step 50 "$out/decode.log" $py benchmarks/bench_decode.py --precisions full nvfp4 fp8 --reps 1 --new-tokens 64 \
  --out "$out/decode.json"
step 5 "$out/summary.log" $py benchmarks/gpu_summary.py "$out"

# One JSON line per setting: the demo; long responses (untrained model) for 256 rows; and a
# 150M-parameter bf16 model with long responses, where decoding is bound by memory traffic, not arithmetic.
long="warmstart.steps=0 rollout.max_new_tokens=256"
big="model.hidden_size=1024 model.intermediate_size=2816 model.num_layers=12 model.num_heads=16"
big="$big model.num_kv_heads=4 model.dtype=bfloat16"
for setting in "" "$long" "$long $big"; do
  # shellcheck disable=SC2086  # each setting is a list of overrides
  step 15 "$scratch/verify.line" $py benchmarks/bench_reuse.py --verification-cost --set $setting
  if [ "$dry" = "0" ]; then
    tr -d '\n' <"$scratch/verify.line" >>"$out/verify.jsonl" && echo >>"$out/verify.jsonl"
    rm -f "$scratch/verify.line"
  fi
done

[ "$dry" != "0" ] && echo "total limit ${budget}s"
exit "$status"
