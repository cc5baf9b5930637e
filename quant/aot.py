"""Ahead-of-time compilation of every Triton kernel specialization bitrl can launch, for GPUs not present.

The specializations are not listed by hand: :func:`collect_launches` drives the library's own dispatch code
(``policy_loss``, ``fused_logprobs``, ``fused_linear_policy_loss``, ``quantize``, ``dequantize``, the W4A16
and FP4 ``dot_scaled`` matmuls, ``decode_attention``, the batch-invariant matmul, RMSNorm, SiLU-mul and row
log-probs) over the options its registries offer (loss types, KL estimators, number formats, input dtypes,
and sizes that select every block configuration), with ``JITFunction.run`` replaced by a recorder. Each
recorded launch carries the exact signature, constexprs and alignment attributes Triton's own binder derives,
so compiling it with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` builds the same
cubin a GPU launch would.

:func:`compile_all` compiles every launch for sm_90 and sm_100 (and sm_80 where a kernel declares it) in a
process pool and reads registers, stack, local memory (where spills go) and shared memory from the cubin with
the ``cuobjdump`` that ships with Triton. ``python -m bitrl.kernels.aot OUT.json`` writes that table.

Two device-dependent choices of the dispatch code are taken as on a GPU while recording on CPU tensors: the
logits matmul runs in the input dtype (``matmul_dtype``), and the FP4 ``dot_scaled`` path is selected. Nothing
executes while recording, so the cases skip the checks that read outputs (``check_finite=False``).

This module lives in ``bitrl.quant`` because it drives the dispatch of both packages (kernels/ imports
nothing from quant/).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

TARGETS = (90, 100)
# Kernels whose spills fail the check: everything a training or rollout step launches.
COLD_KERNELS = {"_pack_kernel", "_unpack_kernel"}
RESOURCE_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Launch:
    """One specialization: kernel ``module:name``, signature, constexprs, attributes, launch options."""

    kernel: str
    signature: tuple  # ((name, type), ...)
    constexprs: tuple  # ((name, value), ...)
    attrs: tuple  # ((arg index, [[attr, value], ...]), ...)
    num_warps: int
    num_stages: int
    case: str  # the dispatch call that produced it (first one seen)

    @property
    def key(self) -> tuple:
        return (self.kernel, self.signature, self.constexprs, self.num_warps, self.num_stages)

    @property
    def label(self) -> str:
        sig = ",".join(t for _, t in self.signature if t != "constexpr")
        cex = ",".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel.split(':')[1]}[{sig}][{cex}]w{self.num_warps}s{self.num_stages}"


def sm_targets(kernel_name: str) -> tuple[int, ...]:
    """sm_90 and sm_100, unless the kernel's module narrows or widens that in ``KERNEL_TARGETS`` (e.g. a
    kernel dispatched on Blackwell only, or one that claims sm_80)."""
    mod, name = kernel_name.split(":")
    return getattr(importlib.import_module(mod), "KERNEL_TARGETS", {}).get(name, TARGETS)


# ------------------------------------------------------------------------------------------------ recording


@contextlib.contextmanager
def recording(out: list, case: list):
    """Replace ``JITFunction.run`` by a recorder appending :class:`Launch` to ``out`` (nothing executes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    flp = importlib.import_module("bitrl.kernels.fused_logprobs.chunked")  # ChunkEngine's matmul_dtype

    backend = make_backend(GPUTarget("cuda", 90, 32))

    def record(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
        out.append(
            Launch(
                kernel=f"{self.fn.__module__}:{self.fn.__name__}",
                signature=tuple(signature.items()),
                constexprs=tuple((self.arg_names[p[0]], _plain(v)) for p, v in constexprs.items()),
                attrs=tuple((p[0], [list(a) for a in v]) for p, v in attrs.items()),
                num_warps=options.num_warps,
                num_stages=options.num_stages,
                case=case[0],
            )
        )

    saved = (JITFunction.run, flp.matmul_dtype, os.environ.get("TRITON_INTERPRET"))
    JITFunction.run = record
    flp.matmul_dtype = lambda x: x.dtype  # the CUDA choice: the logits matmul in the input dtype
    os.environ["TRITON_INTERPRET"] = "1"  # the dispatch gates accept CPU tensors; the recorder runs nothing
    try:
        yield
    finally:
        JITFunction.run, flp.matmul_dtype = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[2]


def _plain(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _policy_cases():
    from bitrl.kernels import LossConfig, policy_loss
    from bitrl.kernels.policy_loss.triton import TRITON_KL, triton_losses

    B, T = 3, 7
    for dtype, loss, kl, corr, ent, dual, delta in itertools.product(
        DTYPES,
        triton_losses(),
        (None, *TRITON_KL),
        (False, True),
        (False, True),
        (False, True),
        (False, True),
    ):
        if (dual or delta) and loss != "grpo":
            continue  # only the clip loss reads them; other losses ignore the options
        g = torch.Generator().manual_seed(0)
        lp = (-torch.rand(B, T, generator=g)).to(dtype).requires_grad_(True)
        options = dict(loss_type=loss, clip_ratio_c=3.0 if dual else None, delta=4.0 if delta else None)
        tensors = {}
        if kl:
            options.update(kl_type=kl, kl_coef=0.1)
            tensors.update(ref_logprobs=lp.detach() - 0.1)
        if corr:
            options.update(correction="tis-token")
            tensors.update(rollout_logprobs=lp.detach().float() - 0.05)
        if ent:
            options.update(entropy_coef=0.01)
            tensors.update(entropy=torch.rand(B, T, generator=g).to(dtype))
        cfg = LossConfig(**options)
        name = f"policy_loss {loss} kl={kl} corr={corr} ent={ent} dual={dual} delta={delta} {dtype}"
        yield (
            name,
            lambda lp=lp, cfg=cfg, kw=tensors: policy_loss(
                lp, lp.detach() - 0.01, torch.randn(B), None, cfg, impl="triton", **kw
            ),
        )


def _logprob_cases():
    from bitrl.kernels import fused_linear_policy_loss
    from bitrl.kernels.fused_logprobs import fused_logprobs
    from bitrl.kernels.fused_logprobs.triton_rows import BLOCK_V_MAX, BLOCK_V_MIN

    H = 16
    # every BLOCK_V the dispatch can pick, and one vocabulary above the largest tile
    vocabs = [2**i for i in range(BLOCK_V_MIN.bit_length() - 1, BLOCK_V_MAX.bit_length() + 1)]
    # (fp64 inputs never reach the row kernels: they run on the torch path in fp64)
    for dtype, V in itertools.product(DTYPES, vocabs):

        def run(dtype=dtype, V=V):
            h = torch.randn(5, H, dtype=dtype, requires_grad=True)
            w = torch.randn(V, H, dtype=dtype, requires_grad=True)
            y = torch.randint(0, V, (5,))
            lp, ent = fused_logprobs(h, w, y, impl="triton", check_finite=False)
            (lp.sum() + ent.sum()).backward()  # backward with the entropy gradient
            lp, _ = fused_logprobs(h, w, y, impl="triton", return_entropy=False, check_finite=False)
            lp.sum().backward()  # backward without it

        yield f"fused_logprobs V={V} {dtype}", run
    for dtype in DTYPES:

        def run_linear(dtype=dtype):
            h = torch.randn(2, 3, H, dtype=dtype, requires_grad=True)
            w = torch.randn(64, H, dtype=dtype, requires_grad=True)
            y = torch.randint(0, 64, (2, 3))
            loss, _ = fused_linear_policy_loss(
                h, w, y, None, torch.randn(2), impl="triton", check_finite=False
            )
            loss.backward()

        yield f"fused_linear_policy_loss {dtype}", run_linear


def _quant_cases():
    from bitrl.kernels.quantize import _tiles, pack_fp4_triton, unpack_fp4_triton

    from .formats import FORMATS
    from .quantize import quantize

    for name, f in FORMATS.items():
        bw = (
            f.block_size or 128
        )  # FP8 on the Triton path: 1 x 128 blocks (per-row/tensor scales stay in torch)
        _, nb = _tiles(bw, f.packed, 1)
        modes = ("floor", "rceil") if f.is_mx else ("floor",)
        for dtype, mode, rounding in itertools.product(DTYPES, modes, ("nearest", "stochastic")):
            kw = dict(scale_mode=mode, rounding=rounding, seed=0, backend="triton")
            if f.block_size is None:
                kw["block_size"] = bw

            def run(name=name, kw=kw, dtype=dtype, nb=nb, bw=bw):
                x = torch.randn(2, nb * bw, dtype=dtype)
                qt = quantize(x, name, **kw)
                for out in DTYPES:
                    qt.dequantize(out, backend="triton")

            yield f"quantize {name} {mode} {rounding} {dtype}", run
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    yield "pack_fp4", lambda: unpack_fp4_triton(pack_fp4_triton(codes))


def _matmul_cases():
    from .linear import NATIVE_FP4, QuantLinear

    layers = [("w4a16_triton", (fmt, None)) for fmt in ("mxfp4", "nvfp4")]
    layers += [("fp4_native", pair) for pair in NATIVE_FP4]
    for (path, (fmt, act)), dtype in itertools.product(layers, DTYPES):

        def run(path=path, fmt=fmt, act=act, dtype=dtype):
            q = QuantLinear.from_linear(torch.nn.Linear(128, 64).to(dtype), fmt, act=act)
            q.impl = path
            q(torch.randn(3, 128, dtype=dtype))

        yield f"QuantLinear {path} {fmt} act={act} {dtype}", run


def _sampling_cases():
    try:
        from bitrl.kernels.sampling import fused_sample
    except ImportError:
        return  # the fused sampler is not part of this tree
    for dtype, (t, top_k, top_p), V in itertools.product(
        DTYPES, ((1.0, 0, 1.0), (0.7, 20, 1.0), (0.7, 0, 0.9), (0.7, 20, 0.9), (0.0, 0, 1.0)), (1000, 151936)
    ):
        logits = torch.randn(2, V).to(dtype)
        seeds, pos = torch.tensor([1, 2]), torch.tensor([3, 4])
        yield (
            f"fused_sample T={t} top_k={top_k} top_p={top_p} V={V} {dtype}",
            lambda a=(logits, seeds, pos, t, top_k, top_p): fused_sample(*a, impl="triton"),
        )


def _hadamard_cases():
    from bitrl.kernels.hadamard import TRITON_BLOCKS, block_hadamard, random_signs

    for dtype, block, transpose in itertools.product(DTYPES, TRITON_BLOCKS, (False, True)):
        args = (torch.randn(3, 2 * block).to(dtype), random_signs(2 * block, 0), block, transpose)
        yield (
            f"block_hadamard b={block} transpose={transpose} {dtype}",
            lambda a=args: block_hadamard(*a, impl="triton"),
        )


def _attention_cases():
    from bitrl.kernels.decode_attention import decode_attention

    # a compiled decode step (T = 1 over a power-of-two width) and a draft verification (T = 4, a ragged
    # width), GQA group 7 (Qwen2-0.5B), for both common head sizes, over fp8 and same-dtype caches
    for dtype, fp8, dim, (steps, width) in itertools.product(
        DTYPES, (True, False), (64, 128), ((1, 128), (4, 100))
    ):
        kv = torch.float8_e4m3fn if fp8 else dtype
        q = torch.randn(3, 2, 7 * steps, dim).to(dtype)
        k = torch.zeros(3, 2, 128, dim).to(kv)
        visible = torch.ones(3, 256, dtype=torch.bool)[:, None, :width].expand(3, steps, width)
        yield (
            f"decode_attention T={steps} d={dim} cache={kv} {dtype}",
            lambda a=(q, k, k, visible, dim**-0.5): decode_attention(*a, impl="triton"),
        )


def _batch_invariant_cases():
    from bitrl.kernels import batch_invariant_triton as bi

    # a decode step (M = 1: the row count is not specialized, so it is the binary of every M) over sizes
    # that divide by 16, as a model's do (Qwen2-0.5B: H 896, F 4864, V 151936), the norm weight in the
    # activations' dtype; then 7 rows of ragged sizes over strided rows (gate and up as the halves of one
    # projection) with an fp32 norm weight, which adds that weight's specialization
    shapes = ((1, 128, 256, 4096, None), (7, 100, 70, 3001, torch.float32))
    for dtype, (rows, k, n, vocab, norm_dtype) in itertools.product(DTYPES, shapes):
        x = torch.randn(rows, k).to(dtype)
        w, norm = torch.randn(n, k).to(dtype), torch.ones(k).to(norm_dtype or dtype)
        gate_up = torch.randn(rows, 2 * n).to(dtype)
        logits, targets = torch.randn(rows, vocab).to(dtype), torch.randint(0, vocab, (rows,))
        size = f"M={rows} K={k} N={n} V={vocab} {dtype}"
        yield f"invariant_matmul {size}", lambda a=(x, w): bi.invariant_matmul(*a)
        yield (
            f"invariant_rms_norm {size} weight={norm.dtype}",
            lambda a=(x, norm): bi.invariant_rms_norm(*a, 1e-6),
        )
        yield f"invariant_silu_mul {size}", lambda g=gate_up, n=n: bi.invariant_silu_mul(g[:, :n], g[:, n:])
        yield (
            f"invariant_row_logprobs {size}",
            lambda a=(logits, targets): bi.invariant_row_logprobs(*a, 0.7),
        )


def dispatch_cases():
    """(name, callable) for every option combination of the Triton-dispatching public ops."""
    yield from _attention_cases()
    yield from _batch_invariant_cases()
    yield from _hadamard_cases()
    yield from _sampling_cases()
    yield from _policy_cases()
    yield from _logprob_cases()
    yield from _quant_cases()
    yield from _matmul_cases()


def collect_launches(failures: list | None = None) -> list[Launch]:
    """Run every dispatch case under the recorder; returns the distinct specializations.

    A case may fail after its launches were recorded (nothing ran, so its outputs are garbage): that is
    harmless. A case that fails before launching anything is appended to ``failures`` (or raised)."""
    import pkgutil

    from triton.runtime.jit import JITFunction

    import bitrl.kernels

    for info in pkgutil.iter_modules(bitrl.kernels.__path__):  # decorate every kernel before the recorder
        importlib.import_module(f"bitrl.kernels.{info.name}")
    pl = importlib.import_module("bitrl.kernels.policy_loss.triton")

    if not isinstance(pl._policy_loss_kernel, JITFunction):
        raise RuntimeError("collect_launches needs compiled kernels: import bitrl without TRITON_INTERPRET=1")
    launches: list[Launch] = []
    case = [""]
    with recording(launches, case):
        for name, fn in dispatch_cases():
            case[0] = name
            before = len(launches)
            try:
                fn()
            except Exception as exc:
                if len(launches) > before:
                    continue
                if failures is None:
                    raise
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    seen: dict[tuple, Launch] = {}
    for lau in launches:
        seen.setdefault(lau.key, lau)
    return list(seen.values())


# ------------------------------------------------------------------------------------------------ compiling


def cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack, shared and local (spill) bytes per thread of a cubin's kernel, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    m = RESOURCE_RE.search(text)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource line:\n{text}")
    regs, stack, shared, local = map(int, m.groups())
    return {"registers": regs, "stack_bytes": stack, "static_shared_bytes": shared, "local_bytes": local}


PID_RE = re.compile(r"(%[\w.]+) = tt\.get_program_id (\w)")


def widened_program_ids(ttir: str) -> list[str]:
    """Grid axes whose program id the kernel extends to int64 before any offset arithmetic (so offsets of
    tensors beyond 2**31 elements cannot wrap)."""
    return sorted({ax for v, ax in PID_RE.findall(ttir) if f"arith.extsi {v} : i32 to i64" in ttir})


MMA_RE = re.compile(r"\b(tcgen05\.mma[\w.:]*|mma\.sync[\w.:]*|wgmma\.mma_async[\w.:]*)")


def compile_launch(lau: Launch, cc: int) -> dict:
    """Compile one specialization for ``sm_<cc>``; returns its resource row (with ``error`` on failure)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, name = lau.kernel.split(":")
    fn = getattr(importlib.import_module(mod), name)
    row = {"kernel": name, "module": mod, "label": lau.label, "case": lau.case, "sm": cc}
    row["hot"] = name not in COLD_KERNELS
    t0 = time.perf_counter()
    try:
        attrs = {(i,): [tuple(a) for a in v] for i, v in lau.attrs}
        src = ASTSource(fn, dict(lau.signature), dict(lau.constexprs), attrs)
        opts = {"num_warps": lau.num_warps, "num_stages": lau.num_stages}
        ck = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
        row.update(resource_usage(ck.asm["cubin"]))
        row["dynamic_shared_bytes"] = int(ck.metadata.shared)
        row["spills"] = row["local_bytes"] > 0 or row["stack_bytes"] > 0
        row["mma"] = sorted(set(MMA_RE.findall(ck.asm["ptx"])))
        row["int64_program_ids"] = widened_program_ids(ck.asm["ttir"])
    except Exception as exc:  # a compile error is a result: the test reports every one
        row["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _compile_task(args):
    return compile_launch(*args)


def compile_all(workers: int | None = None, only: str | None = None) -> dict:
    """Collect and compile every specialization for every target; returns the resource table.

    ``only``: compile just the kernels whose name contains this string (for development)."""
    t0 = time.perf_counter()
    failures: list[str] = []
    launches = [lau for lau in collect_launches(failures) if only is None or only in lau.kernel]
    tasks = [(lau, cc) for lau in launches for cc in sm_targets(lau.kernel)]
    workers = workers or os.cpu_count() or 1
    env = os.environ.pop("TRITON_INTERPRET", None)  # the workers must build real JIT functions
    try:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            rows = list(pool.map(_compile_task, tasks, chunksize=4))
    finally:
        if env is not None:
            os.environ["TRITON_INTERPRET"] = env
    import triton

    return {
        "triton": triton.__version__,
        "targets": sorted({cc for _, cc in tasks}),
        "n_specializations": len(launches),
        "n_compiles": len(rows),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "workers": workers,
        "case_failures": failures,
        "kernels": rows,
    }


def summary(table: dict) -> str:
    """Per kernel and target: specializations, max registers, max shared memory, spills, errors."""
    groups: dict[tuple, list] = {}
    for r in table["kernels"]:
        groups.setdefault((r["kernel"], r["sm"]), []).append(r)
    lines = [f"{'kernel':34} {'sm':>4} {'n':>4} {'max reg':>8} {'max smem':>9} {'spills':>7} {'errors':>7}"]
    for (k, sm), rs in sorted(groups.items()):
        ok = [r for r in rs if "error" not in r]
        reg = max((r["registers"] for r in ok), default=0)
        smem = max((r["static_shared_bytes"] + r["dynamic_shared_bytes"] for r in ok), default=0)
        spills = sum(r["spills"] for r in ok)
        lines.append(f"{k:34} {sm:>4} {len(rs):>4} {reg:>8} {smem:>9} {spills:>7} {len(rs) - len(ok):>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bitrl.quant.aot", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="benchmarks/results/kernel_resources.json")
    ap.add_argument("--only", help="compile only kernels whose name contains this")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out
    table = compile_all(args.workers, args.only)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    print(summary(table))
    print(
        f"{table['n_specializations']} specializations, {table['n_compiles']} compiles, "
        f"{table['wall_seconds']} s on {table['workers']} workers -> {out}"
    )
    for f in table["case_failures"]:
        print(f"dispatch case launched nothing: {f}")
    bad = [r for r in table["kernels"] if "error" in r or (r["hot"] and r["spills"])]
    return 1 if bad or table["case_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
