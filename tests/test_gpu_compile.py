"""Every Triton kernel, in every specialization the dispatch code can launch, compiled ahead of time for
Hopper (sm_90) and Blackwell (sm_100) on this GPU-less machine; registers, spills and shared memory read from
the cubins (``python -m bitrl.quant.aot`` writes the same table to benchmarks/results/kernel_resources.json).

The compilation runs once per session in a subprocess (kernels must be decorated without TRITON_INTERPRET)
with a process pool over the machine's cores."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nvidia_backend_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return "Triton's NVIDIA backend is absent"
    from bitrl.quant.aot import cuobjdump

    if not os.path.exists(cuobjdump()):
        return "Triton's NVIDIA backend ships no cuobjdump here"
    return None


pytestmark = pytest.mark.skipif(_nvidia_backend_reason() is not None, reason=str(_nvidia_backend_reason()))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "kernel_resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "bitrl.quant.aot", str(out)], env=env, capture_output=True, text=True, cwd=ROOT
    )
    if not out.exists():
        pytest.fail(f"the AOT compilation crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(proc.stdout)
    return json.loads(out.read_text())


def _launched_kernels() -> set[str]:
    """Every @triton.jit function of kernels/ and quant/ that is launched (``name[grid](...)``)."""
    names = set()
    for folder in ("kernels", "quant"):
        for path in (ROOT / folder).rglob("*.py"):
            src = path.read_text()
            for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\n\s*def (\w+)", src):
                if re.search(rf"\b{name}\[", src):
                    names.add(name)
    return names


def test_every_launched_kernel_is_compiled_for_hopper_and_blackwell(table):
    from bitrl.quant.aot import sm_targets

    kernels = _launched_kernels()
    assert {
        "_policy_loss_kernel",
        "_logprob_rows_fwd_kernel",
        "_w4a16_kernel",
        "_fp4_dot_scaled_kernel",
    } <= kernels
    compiled = {(r["kernel"], r["sm"]) for r in table["kernels"]}
    modules = {r["kernel"]: r["module"] for r in table["kernels"]}
    for name in kernels:
        assert name in modules, f"{name} is launched somewhere but no dispatch case reaches it"
        for sm in sm_targets(f"{modules[name]}:{name}"):
            assert (name, sm) in compiled, (name, sm)
    assert {sm for _, sm in compiled} == {90, 100}


def test_every_dispatch_case_launches(table):
    assert not table["case_failures"], "\n".join(table["case_failures"])


def test_no_compile_errors(table):
    errors = [f"{r['label']} sm_{r['sm']}: {r['error'][:500]}" for r in table["kernels"] if "error" in r]
    assert not errors, "\n".join(errors)


def test_no_spills_on_hot_paths(table):
    spills = [
        f"{r['label']} sm_{r['sm']}: {r['local_bytes']} B local, {r['stack_bytes']} B stack"
        for r in table["kernels"]
        if r.get("hot") and r.get("spills")
    ]
    assert not spills, "\n".join(spills)
    ok = [r for r in table["kernels"] if "error" not in r]
    assert all(0 < r["registers"] <= 255 for r in ok)
    assert all(r["static_shared_bytes"] + r["dynamic_shared_bytes"] <= 227 * 1024 for r in ok)


def test_offsets_are_int64(table):
    """Every kernel widens the program id of grid axis x (rows / element blocks) to int64 before computing
    offsets, so tensors beyond 2**31 elements (a [V, H] LM head, B * T tokens, R * K weights) do not wrap."""
    narrow = sorted(
        {r["label"] for r in table["kernels"] if "error" not in r and "x" not in r["int64_program_ids"]}
    )
    assert not narrow, "\n".join(narrow)


def test_every_input_dtype_and_branch_is_compiled(table):
    """The dispatch enumeration reaches bf16/fp16 inputs and every constexpr branch."""
    rows = [r for r in table["kernels"] if "error" not in r]

    def sigs(kernel):
        return {r["label"] for r in rows if r["kernel"] == kernel}

    for kernel, ptr in [
        ("_quantize_kernel", "*bf16"),
        ("_quantize_kernel", "*fp16"),
        ("_w4a16_kernel", "*bf16"),
    ]:
        assert any(f"[{ptr}," in s for s in sigs(kernel)), (kernel, ptr)
    # the backward of the log-prob rows writes d logits in the matmul dtype (bf16 / fp16 on a GPU)
    assert any(",*bf16," in s for s in sigs("_logprob_rows_bwd_kernel"))
    from bitrl.kernels.policy_loss.triton import TRITON_KL, triton_losses

    labels = sigs("_policy_loss_kernel")
    for loss in triton_losses().values():
        for kl in (0, *TRITON_KL.values()):
            assert any(f"LOSS={loss},KL={kl}," in s for s in labels), (loss, kl)
    from bitrl.kernels.fused_logprobs.triton_rows import BLOCK_V_MAX, BLOCK_V_MIN

    blocks = {int(re.search(r"BLOCK_V=(\d+)", s).group(1)) for s in sigs("_logprob_rows_fwd_kernel")}
    assert blocks == {2**i for i in range(BLOCK_V_MIN.bit_length() - 1, BLOCK_V_MAX.bit_length())}
    from bitrl.quant.formats import FORMATS

    kinds = {re.search(r"KIND=(\d)", s).group(1) for s in sigs("_quantize_kernel")}
    assert kinds == {"0", "1", "2"}, kinds  # fp32 (FP8), e8m0 (MX), e4m3 (NVFP4) scales
    assert len(FORMATS) == 5


def test_batch_invariant_kernels_compile_at_their_fixed_tiles_for_every_dtype(table):
    """Each batch-invariant kernel is compiled for fp32, bf16 and fp16 inputs at exactly the tile sizes and
    warps its module fixes per dtype, with the row count unspecialized (the decode step's M = 1 launch gives
    no M=1 constexpr), the GPU's own bf16 rounding (the rounding on the bits is the interpreter's), and the
    bf16/fp16 matmul on tensor cores (wgmma on sm_90, tcgen05 on sm_100)."""
    import torch

    from bitrl.kernels import batch_invariant_triton as bi

    rows = [r for r in table["kernels"] if r["module"] == bi.__name__ and "error" not in r]

    def matmul(d):
        bm, bn, bk, warps, stages = bi.MATMUL_BLOCKS[d]
        f32 = d == torch.float32
        return f"BLOCK_M={bm},BLOCK_N={bn},BLOCK_K={bk},F32_DOT={f32},RNE_BITS=False]w{warps}s{stages}"

    tiles = {
        "_invariant_matmul_kernel": matmul,
        "_invariant_rms_norm_kernel": lambda d: "BLOCK_H={},RNE_BITS=False]w{}".format(*bi.RMS_BLOCK_H[d]),
        "_invariant_silu_mul_kernel": lambda d: "BLOCK_F={},RNE_BITS=False]w{}".format(*bi.SILU_BLOCK_F[d]),
        "_invariant_row_logprobs_kernel": lambda d: "BLOCK_V={}]w{}".format(*bi.LOGPROBS_BLOCK_V[d]),
    }
    ptrs = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for kernel, tile in tiles.items():
        for sm in (90, 100):
            labels = {r["label"] for r in rows if r["kernel"] == kernel and r["sm"] == sm}
            for ptr, dtype in ptrs.items():
                found = any(s.startswith(f"{kernel}[*{ptr},") and tile(dtype) in s for s in labels)
                assert found, f"{kernel} sm_{sm} {ptr} {tile(dtype)}: {sorted(labels)}"
            assert not any(re.search(r"[\[,]M=1[,\]]", s) or "RNE_BITS=True" in s for s in labels), labels
    mma = {m for r in rows if "F32_DOT=False" in r["label"] for m in r["mma"]}
    assert any(m.startswith("wgmma") for m in mma) and any(m.startswith("tcgen05") for m in mma), mma


def test_fp4_dot_scaled_uses_block_scaled_tensor_cores_on_blackwell(table):
    rows = [r for r in table["kernels"] if r["kernel"] == "_fp4_dot_scaled_kernel"]
    assert {r["sm"] for r in rows} == {100}
    kinds = {m for r in rows for m in r["mma"]}
    assert "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32" in kinds  # MXFP4 x MXFP4
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in kinds  # MXFP8 x MXFP4
    assert "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16" in kinds  # NVFP4 x NVFP4
    assert all(any("block_scale" in m for m in r["mma"]) for r in rows)


def test_resource_table_is_complete(table):
    assert table["n_compiles"] == len(table["kernels"]) >= 2 * 100
    for r in table["kernels"]:
        if "error" not in r:
            assert {
                "registers",
                "stack_bytes",
                "static_shared_bytes",
                "local_bytes",
                "dynamic_shared_bytes",
            } <= set(r)
