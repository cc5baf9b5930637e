"""How close bitrl and naive torch come to the matrix products they cannot avoid, on CPU, fp32.

One forward + backward through an LM head does at least 3 products of N x H x V multiply-adds (the logits,
the hidden gradient, the weight gradient); an op that does not keep the [N, V] logits for its backward adds
a 4th for what it recomputes (bitrl's log-prob + entropy keeps what its ``memory_budget`` holds beside its
tiles, 1 GiB on CPU by default, and recomputes the rest; "bitrl-recompute" keeps nothing).
This times, interleaved in one process, one whole
[N x H] . [H x V] product (torch.mm, the fastest form of it on this machine) beside the log-prob + entropy
and GRPO rows of bench_integrations.py (same inputs and losses), and writes each time in units of that
product: what is left beyond the products is the rest of the op (softmax, loss, memory traffic).

    python benchmarks/bench_gemm_floor.py --shape 4096x32768

``--bf16`` measures the bf16 path of a CPU with bf16 units (bf16 GEMMs) on any CPU: for each variant, the
multiply-adds its products run (counted, in units of N x H x V) and its time outside them. Where torch
emulates bf16 GEMMs their time is not the real one, but the rest is; a bf16 product of time G then predicts
each variant's time as products x G + rest, and so its ratio to naive torch for any G.

    python benchmarks/bench_gemm_floor.py --bf16 --shape 1024x32768

``--memory`` adds the peak memory of bitrl's two ops on that path, each in its own process with real bf16
GEMMs (emulated where the CPU has no bf16 units: minutes per call at N = 4096).

``--forms`` measures both forms the ops' ``memory_budget`` chooses between, in fp32 and bf16 with the
CPU's own GEMMs: the default budget (``MEMORY_BUDGET``, 1 GiB on CPU: the 3-product form at this shape) and
the tight one (0: the two-pass tiles, 4 products), interleaved with naive torch and one whole product of
the same dtype (the floor unit), each as a fraction of the floor (the 3 products the workload cannot avoid
over the time taken) and as a ratio to naive torch; with ``--memory`` also every variant's peak memory and
the peers' (TRL, Liger-Kernel), each call in its own process. ``--cpu-bf16-matmul fp32`` runs bitrl's bf16
tiles as on a CPU without bf16 units (fp32 GEMMs of the bf16 operands; naive torch keeps its bf16 GEMMs).

    python benchmarks/bench_gemm_floor.py --forms --memory --shape 4096x32768

Results: benchmarks/results/bench_gemm_floor.json (merged by shape; the --bf16 split under "bf16/<shape>").
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_integrations as bi  # noqa: E402
import bench_keep_logits  # noqa: E402

from bitrl.kernels.bench_stats import interleaved_times, machine, merge_json  # noqa: E402
from bitrl.kernels.fused_logprobs import tile_bytes  # noqa: E402
from bitrl.kernels.fused_logprobs.numerics import MEMORY_BUDGET  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_gemm_floor.json"
OPS = ("grpo_loss", "logprob_entropy")
NAMES = ("bitrl", "naive")  # the --bf16 split's variants


def products(N: int, V: int) -> dict:
    """Products of N x H x V multiply-adds each variant runs: naive torch keeps the logits; bitrl's log-prob +
    entropy recomputes what it does not keep; its GRPO loss (one pass) forms the gradient in the forward."""
    h = torch.empty(N, bi.H)
    kept = min(1.0, max(0, MEMORY_BUDGET["cpu"] - tile_bytes(N, V, h, "logprobs")) / (4 * N * V))
    return {
        ("logprob_entropy", "naive"): 3,
        ("logprob_entropy", "bitrl"): 4 - kept,
        ("logprob_entropy", "bitrl-recompute"): 4,
        ("grpo_loss", "naive"): 3,
        ("grpo_loss", "bitrl"): 3,
    }


def measure(N: int, V: int, reps: int) -> dict:
    x = bi.make_inputs(N, V, torch.float32)
    h = x["h"].detach().reshape(N, -1)
    w = x["w"].detach()
    logits = torch.empty(N, V)
    runs = {"gemm": lambda: torch.mm(h, w.t(), out=logits)}
    for op, name in products(N, V):
        if name == "bitrl-recompute":  # keeping no logits: every tile recomputed in the backward
            runs[f"{op}/{name}"] = bench_keep_logits.bitrl(x, keep_bytes=0, entropy=True)
        else:
            fn = bi.variant_fn(op, name)
            runs[f"{op}/{name}"] = lambda fn=fn: fn(x)
    times = interleaved_times(runs, reps, setup=lambda _: bi.reset_grads(x))
    best = {k: min(v) for k, v in times.items()}
    gemm = best.pop("gemm")
    rows = {"gemm_s": gemm, "gemm_gflops": 2 * N * bi.H * V / gemm / 1e9}
    for (op, name), needed in products(N, V).items():
        t = best[f"{op}/{name}"]
        rows[f"{op}/{name}"] = {"time_s": t, "in_gemms": t / gemm, "gemms": needed}
    return rows


class GemmMeter(TorchDispatchMode):
    """The multiply-adds of the matrix products run inside the context, and the seconds spent in them.

    bf16 products run as fp32 products of the same operands, rounded once to bf16: the sums a bf16 GEMM
    forms (fp32 accumulation, one rounding), at fp32 speed where torch would emulate bf16 GEMMs. Only their
    count is used, never their time, so what runs between them is measured as it would run beside bf16
    units."""

    PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}

    def __init__(self):
        super().__init__()
        self.madds = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in self.PRODUCTS:
            return func(*args, **kwargs)
        start = time.perf_counter()
        a, b = args[-2:]
        self.madds += a.numel() * b.shape[-1]
        if a.dtype != torch.bfloat16:
            out = func(*args, **kwargs)
        else:
            up = [x.float() for x in args]
            scale = {k: v for k, v in kwargs.items() if k in ("alpha", "beta")}
            product = torch.mm(*up) if func.overloadpacket == torch.ops.aten.mm else torch.addmm(*up, **scale)
            dest = kwargs.get("out", args[0] if func.overloadpacket == torch.ops.aten.addmm_ else None)
            out = product.to(a.dtype) if dest is None else dest.copy_(product)
        self.seconds += time.perf_counter() - start
        return out


def bf16_split(N: int, V: int, reps: int) -> dict:
    """Per variant: products run (multiply-adds / N H V) and seconds outside them (the least of ``reps``
    rounds after a warm-up one, the variants and one fp32 product interleaved), bf16 inputs multiplied in
    bf16 as on a CPU with bf16 units."""
    fl = importlib.import_module("bitrl.kernels.fused_logprobs.numerics")  # where CPU_BF16_MATMUL is read
    native, fl.CPU_BF16_MATMUL = fl.CPU_BF16_MATMUL, torch.bfloat16
    inputs = bi.make_inputs(N, V, torch.bfloat16)
    madds, rests = {}, {}

    def metered(key, fn):
        def run():
            meter = GemmMeter()
            start = time.perf_counter()
            with meter:
                fn(inputs)
            rests.setdefault(key, []).append(time.perf_counter() - start - meter.seconds)
            madds[key] = meter.madds

        return run

    runs = {f"{op}/{name}": metered(f"{op}/{name}", bi.variant_fn(op, name)) for op in OPS for name in NAMES}
    # one fp32 product of the same shape, the anchor for bf16 ones (bf16 units run them 2-16x faster)
    h, w = torch.randn(N, bi.H), torch.randn(V, bi.H)
    runs["fp32 product"] = lambda: torch.mm(h, w.t())
    try:
        times = interleaved_times(runs, max(1, reps), setup=lambda _: bi.reset_grads(inputs))
    finally:
        fl.CPU_BF16_MATMUL = native
    rows = {key: {"products": madds[key] / (N * bi.H * V), "rest_s": min(r[1:])} for key, r in rests.items()}
    rows["fp32_product_s"] = fp32 = min(times["fp32 product"])
    for op in OPS:
        b, n = rows[f"{op}/bitrl"], rows[f"{op}/naive"]
        rows[f"{op}/ratio_at"] = {
            f"fp32/{k}": (b["products"] * fp32 / k + b["rest_s"]) / (n["products"] * fp32 / k + n["rest_s"])
            for k in (1, 2, 4, 8, 16)
        }
    return rows


FORMS = {"default": None, "tight": 0}  # memory_budget of each form: the op's default, and none to spare
PEERS = {"logprob_entropy": ("trl",), "grpo_loss": ("trl", "liger")}


class MultiplyAdds(TorchDispatchMode):
    """Counts the multiply-adds of the matrix products run inside the context (nothing else changes)."""

    def __init__(self):
        super().__init__()
        self.madds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in GemmMeter.PRODUCTS:
            a, b = args[-2:]
            self.madds += a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))


def forms(N: int, V: int, reps: int, dtype: str, memory: bool, cpu_bf16_matmul: str | None = None) -> dict:
    """Both forms of bitrl's two ops (default and tight budget) beside naive torch and one whole product, in
    ``dtype`` with the CPU's own GEMMs, interleaved in one process; each variant's time, its products (its
    multiply-adds / N H V, counted on an untimed call), its time in units of the product ("in_gemms"), the
    fraction of the floor (3 products / in_gemms) and its ratio to naive torch; with ``memory`` each
    variant's and each peer's peak memory, one call per process."""
    dt = bi.DTYPES[dtype]
    fl = importlib.import_module("bitrl.kernels.fused_logprobs.numerics")
    native = fl.CPU_BF16_MATMUL
    if cpu_bf16_matmul:
        fl.CPU_BF16_MATMUL = {"fp32": torch.float32, "bf16": torch.bfloat16}[cpu_bf16_matmul]
    try:
        x = bi.make_inputs(N, V, dt)
        h, w = x["h"].detach().reshape(N, -1), x["w"].detach()
        logits = torch.empty(N, V, dtype=dt)
        runs = {"gemm": lambda: torch.mm(h, w.t(), out=logits)}
        fns = {f"{op}/naive": bi.variant_fn(op, "naive") for op in OPS}
        for op in OPS:
            for form, budget in FORMS.items():
                fns[f"{op}/bitrl-{form}"] = bi.variant_fn(op, "bitrl", budget)
        runs.update({key: (lambda fn=fn: fn(x)) for key, fn in fns.items()})
        madds = {}
        for key, run in runs.items():  # counted once, untimed
            if key != "gemm":
                meter = MultiplyAdds()
                with meter:
                    run()
                bi.reset_grads(x)
                madds[key] = meter.madds / (N * bi.H * V)
        times = interleaved_times(runs, reps, setup=lambda _: bi.reset_grads(x))
    finally:
        fl.CPU_BF16_MATMUL = native
    best = {k: min(v) for k, v in times.items()}
    gemm = best.pop("gemm")
    rows = {"gemm_s": gemm, "gemm_gflops": 2 * N * bi.H * V / gemm / 1e9}
    for key, t in best.items():
        op = key.split("/")[0]
        rows[key] = {
            "time_s": t,
            "products": madds[key],
            "in_gemms": t / gemm,
            "floor_fraction": 3 * gemm / t,
            "vs_naive": t / best[f"{op}/naive"],
        }
    if memory:
        base = dict(mode="memory", N=N, V=V, dtype=dtype, bf16_gemms=cpu_bf16_matmul == "bf16")
        for op in OPS:
            variants = [("naive", "naive", None)] + [(f"bitrl-{f}", "bitrl", b) for f, b in FORMS.items()]
            variants += [(peer, peer, None) for peer in PEERS[op]]
            for key, name, budget in variants:
                spec = dict(
                    base, op=op, names=[name], memory_budget=budget, fp32_gemms=cpu_bf16_matmul == "fp32"
                )
                peak = bi.run_child(spec, cap_gb=16.0, timeout=1800.0)
                rows.setdefault(f"{op}/{key}", {})["peak_mib"] = peak.get("peak_mib", peak.get("error"))
                print(f"{op:16s} {key:14s} peak {rows[f'{op}/{key}']['peak_mib']} MiB", flush=True)
            peers = [rows[f"{op}/{p}"]["peak_mib"] for p in PEERS[op] + ("naive",)]
            best_peer = min(p for p in peers if isinstance(p, float))
            for form in FORMS:
                r = rows[f"{op}/bitrl-{form}"]
                if isinstance(r["peak_mib"], float):
                    r["mem_vs_best_peer"] = r["peak_mib"] / best_peer
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="4096x32768", help="NxV (H = 1024)")
    p.add_argument("--reps", type=int, default=2, help="timed rounds after a warm-up round (minimum taken)")
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--bf16", action="store_true", help="the bf16-GEMM split (see the module docstring)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="with --bf16: also the peak memory of bitrl's ops on that path, real (emulated) bf16 GEMMs; "
        "with --forms: every variant's and peer's peak memory",
    )
    p.add_argument("--forms", action="store_true", help="both memory-budget forms, fp32 and bf16 (see above)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], help="with --forms")
    p.add_argument(
        "--cpu-bf16-matmul",
        choices=["fp32", "bf16"],
        default=None,
        help="with --forms: bitrl's bf16 GEMM dtype (fp32: as on a CPU without bf16 units)",
    )
    args = p.parse_args(argv)
    N, V = (int(v) for v in args.shape.split("x"))
    if args.forms:
        command = "python benchmarks/bench_gemm_floor.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        for dtype in args.dtypes:
            rows = forms(N, V, args.reps, dtype, args.memory, args.cpu_bf16_matmul)
            print(f"{dtype}: one [{N} x {bi.H}] . [{bi.H} x {V}] product {rows['gemm_s']:.2f} s")
            for key, r in rows.items():
                if isinstance(r, dict) and "time_s" in r:
                    mem = f", {r['peak_mib']:.0f} MiB" if isinstance(r.get("peak_mib"), float) else ""
                    print(
                        f"  {key:28s} {r['time_s']:6.2f} s, {r['products']:.2f} products, "
                        f"{r['floor_fraction']:.2f} of the floor, {r['vs_naive']:.2f}x naive{mem}"
                    )
            suffix = f"/cpu_bf16_matmul={args.cpu_bf16_matmul}" if args.cpu_bf16_matmul else ""
            merge_json(
                args.json,
                f"forms/{dtype}/{args.shape}{suffix}",
                dict(
                    N=N,
                    V=V,
                    H=bi.H,
                    dtype=dtype,
                    reps=args.reps,
                    machine=machine(),
                    torch=torch.__version__,
                    threads=torch.get_num_threads(),
                    command=command,
                    memory_budget={k: (MEMORY_BUDGET["cpu"] if v is None else v) for k, v in FORMS.items()},
                    **rows,
                ),
            )
        return 0
    if args.bf16:
        rows = bf16_split(N, V, args.reps)
        if args.memory:
            for op in OPS:
                spec = dict(mode="memory", op=op, names=["bitrl"], N=N, V=V, dtype="bf16", bf16_gemms=True)
                peak = bi.run_child(spec, cap_gb=10.0, timeout=3600.0)
                rows[f"{op}/bitrl"]["peak_mib"] = peak.get("peak_mib", peak.get("error"))
                print(f"{op:16s} bitrl peak memory with bf16 GEMMs: {rows[f'{op}/bitrl']['peak_mib']} MiB")
        print(f"one fp32 product: {rows['fp32_product_s']:.2f} s")
        for op in OPS:
            for name in NAMES:
                r = rows[f"{op}/{name}"]
                print(f"{op:16s} {name:6s} {r['products']:.2f} products, {r['rest_s']:.2f} s outside them")
            ratios = ", ".join(f"{k}: {v:.2f}x" for k, v in rows[f"{op}/ratio_at"].items())
            print(f"{op:16s} bitrl / naive torch at a bf16 product time of {ratios}")
        merge_json(
            args.json,
            f"bf16/{args.shape}",
            dict(N=N, V=V, H=bi.H, reps=args.reps, cpu=machine()["cpu"], **rows),
        )
        return 0
    result = dict(N=N, V=V, H=bi.H, reps=args.reps, cpu=machine()["cpu"], **measure(N, V, args.reps))
    print(
        f"one [{N} x {bi.H}] . [{bi.H} x {V}] fp32 product: {result['gemm_s']:.2f} s "
        f"({result['gemm_gflops']:.0f} GFLOP/s)"
    )
    for op, name in products(N, V):
        r = result[f"{op}/{name}"]
        t, units = r["time_s"], r["in_gemms"]
        print(f"{op:16s} {name:15s} {t:6.2f} s = {units:.2f} products (needs {r['gemms']:g})")
    merge_json(args.json, args.shape, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
