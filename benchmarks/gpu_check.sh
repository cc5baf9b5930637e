#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run of at most 8 minutes on one H200 (the step limits add up to
# 420 s), most valuable first, each result written the moment it exists:
#   steps.jsonl           one line per step as it ends: name, limit, seconds, exit status, timed out
#   gpu.txt               the device and the versions used
#   prepare.json          the CUDA C++ kernels built once for this GPU into the kernel cache, which every later
#                         step (the test suite included) loads instead of building again
#   tests.jsonl           one line per GPU test as it ends (tests_*.log: pytest's output per group, each group
#                         under its own limit, most valuable first): compiled Triton
#                         kernels (no interpreter) against their references, the CUDA C++ kernels (fused
#                         sampler, FP4 GEMV) against their torch twins, attention over the fp8 KV cache and
#                         an fp8-cache rollout, the decoder's attention kernels, FP8 _scaled_mm, W4A16,
#                         native FP4 on Blackwell, the bf16-autocast end-to-end run; then tensors past 2**31
#                         elements through the kernels, FSDP2 over NCCL (one rank: 2 ranks need 2 GPUs),
#                         CUDA random state through a checkpoint, native FP4 inside a Llama (Blackwell)
#   bench_kernels/        fused GRPO loss at N=16384 H=4096 V=151936 bf16: TFLOP/s, fraction of the measured
#                         bf16 matmul roofline, ratio to Liger-Kernel (results.json, table.md)
#   quant/                quantize / dequantize / FP4 GEMV GB/s and fraction of HBM bandwidth, matmuls,
#                         requantize time (gpu_quant.json, gpu_quant.txt)
#   decode.json           the rollout engine's decode step against (weight + KV bytes) / HBM bandwidth for a
#                         Qwen2-0.5B-shaped bf16 model at batch 64, and its NVFP4 (W4A16) / FP8 (W8A8) copies
#   verify.jsonl          speculative-reuse verification cost of a 150M-parameter bf16 model, long responses
#                         (no warm start)
#   summary.json / .md    the README's GPU rows and the issues' GPU goals, read from the files above
# Not here: the AOT table of every Triton specialization (sm_90, sm_100). The CPU suite compiles it on every
# run (tests/test_gpu_compile.py; benchmarks/results/kernel_resources.json), and its 511 compiles would not fit
# a GPU minute beside the tests.
# Usage: benchmarks/gpu_check.sh OUTDIR   (PYTHON=... picks the interpreter.)
#   GPU_CHECK_DRY_RUN=1    print the steps with their limits; run nothing, write nothing.
#   GPU_CHECK_REHEARSAL=1  run every step here, on the CPU, at its smallest setting, under the same limits:
#                          proves that each starts and writes its JSON in time (CI runs it).
# A failed or timed-out step is recorded and the next one still runs; the exit status is the first failing
# test group's.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
py=${PYTHON:-python3}
dry=${GPU_CHECK_DRY_RUN:-0}
rehearsal=${GPU_CHECK_REHEARSAL:-0}
scratch=$(mktemp -d)  # warm-start cache and run folders: only the results above go to OUTDIR
trap 'rm -rf "$scratch"' EXIT
# PYTHONSAFEPATH: `python -m` must not put the checkout's kernels/ ahead of the kernels package transformers uses
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONSAFEPATH=1 BITRL_CACHE=${BITRL_CACHE:-$scratch/cache}
export BITRL_KERNEL_CACHE=${BITRL_KERNEL_CACHE:-$BITRL_CACHE/csrc}  # shared with the test suite's isolated caches
[ "$dry" = "0" ] && mkdir -p "$out"
budget=0
status=0

# step NAME SECONDS COMMAND...: COMMAND under a time limit, its output in NAME.log; one line in steps.jsonl.
step() {
  local name=$1 limit=$2
  shift 2
  budget=$((budget + limit))
  if [ "$dry" != "0" ]; then
    echo "step ${limit}s ${name}: $*"
    return 0
  fi
  local t0=$EPOCHREALTIME rc
  timeout "$limit" "$@" >>"$out/$name.log" 2>&1
  rc=$?
  awk -v n="$name" -v l="$limit" -v s="$(awk "BEGIN {print $EPOCHREALTIME - $t0}")" -v rc="$rc" 'BEGIN {
    printf "{\"step\": \"%s\", \"limit_s\": %d, \"seconds\": %.1f, \"rc\": %d, \"timed_out\": %s}\n",
      n, l, s, rc, (rc == 124 ? "true" : "false") }' >>"$out/steps.jsonl"
  return $rc
}

# The settings that differ in a rehearsal: the same entry points at their smallest sizes, on the CPU.
if [ "$rehearsal" != "0" ]; then
  test_select=(-m gpu)                     # every GPU test starts (and skips with its reason)
  decode=(--tiny --device cpu --reps 1 --new-tokens 32 --precisions full --copy-gib 0.05)
  tiny_demo="model.hidden_size=32 model.intermediate_size=64 model.num_layers=1 rollout.prompts_per_step=4"
  verify_reps=2
else
  test_select=()
  decode=(--precisions full nvfp4 fp8 --reps 1 --new-tokens 64)
  tiny_demo=""
  verify_reps=20
fi

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

step prepare 35 $py -m bitrl.kernels.cuda_ext "$out/prepare.json"

# The GPU suite must not fall back to the interpreter.
unset TRITON_INTERPRET
# The GPU tests in groups by value, each under its own limit; every test appends its line to tests.jsonl.
tests() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" env BITRL_TEST_JSONL="$out/tests.jsonl" $py -m pytest -q "$@" "${test_select[@]}" \
    -p no:cacheprovider -rs || status=$?
}
tests tests_kernels 55 tests/test_kernels_fused_logprobs.py tests/test_kernels_fused_linear.py \
  tests/test_kernels_policy_loss.py tests/test_kernels_loss_naive.py tests/test_kernels_helpers.py
tests tests_sampler 30 tests/test_csrc.py tests/test_sampling.py
tests tests_attention 30 tests/test_kernels_decode_attention.py
tests tests_rollout 30 tests/test_rollout.py
tests tests_quant 30 tests/test_kernels_gpu_paths.py tests/test_quant_linear.py tests/test_quant_triton.py
tests tests_loop 25 "tests/test_end_to_end.py::test_short_run_on_cuda"
# random state, > 2**31 elements (about 20 GiB), FSDP2 over NCCL, native FP4 in a model
tests tests_scale 30 tests/test_gpu_scale.py

# Fused loss at the GPU target shape (the CPU section at its quick size only, to save time).
step bench_kernels 50 $py -m bitrl.kernels.bench --quick --no-memory --ops grpo --reps 3 --out "$out/bench_kernels"
step quant 45 $py benchmarks/bench_quant.py --gpu-out "$out/quant"
# The rollout engine's decode step against (weight + KV bytes) / HBM bandwidth, Qwen2-0.5B shape.
step decode 40 $py benchmarks/bench_decode.py "${decode[@]}" --out "$out/decode.json"

# One JSON line, no warm start: a 150M-parameter bf16 model with long responses, where decoding is bound by
# memory traffic, not arithmetic (the demo model's settings gave way to the GPU tests above).
long="rollout.max_new_tokens=256"
big="model.hidden_size=1024 model.intermediate_size=2816 model.num_layers=12 model.num_heads=16"
big="$big model.num_kv_heads=4 model.dtype=bfloat16"
settings=("$long $big")
[ "$rehearsal" != "0" ] && settings=("rollout.max_new_tokens=8 $tiny_demo")  # one setting proves the step
for setting in "${settings[@]}"; do
  # shellcheck disable=SC2086  # each setting is a list of overrides
  step verify 15 $py benchmarks/bench_reuse.py --verification-cost --reps "$verify_reps" \
    --json-line "$out/verify.jsonl" --set warmstart.steps=0 $setting
done

step summary 4 $py benchmarks/gpu_summary.py "$out"

[ "$dry" != "0" ] && echo "total limit ${budget}s"
exit "$status"
