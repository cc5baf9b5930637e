"""`bitrl bench`: side-by-side kernel benchmarks (time ratio and peak memory) with a readable table.

CPU section: fused_logprobs and the full GRPO loss (LM head + log-softmax + gather + clipped loss),
forward + backward, bitrl vs the naive torch path vs Liger-Kernel (eager) where installed. Variants are
timed round-robin in one process (so machine noise hits them alike); peak memory is measured per variant in
a fresh subprocess as the growth of the peak resident set size (VmHWM in /proc/self/status, reset through
/proc/self/clear_refs after the inputs are built) - torch's CPU allocator has no peak counter of its own.

GPU section (CUDA only; skipped with a message elsewhere): bf16, time, TFLOP/s and fraction of the measured
bf16 matmul roofline, against Liger-Kernel and cut-cross-entropy where installed; peak memory from
torch.cuda.max_memory_allocated.

    bitrl bench                      # CPU target size: fp32, N=8192, H=1024, V=32768
    bitrl bench --quick              # small sizes, a few seconds
    bitrl bench --json out.json      # also write the results
    bitrl bench --out DIR            # results.json + table.md in DIR

On a GPU machine, one short run covers the kernel checks:
    TRITON_INTERPRET=0 pytest tests/test_kernels_*.py -q && bitrl bench --quick --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

from bitrl.kernels.bench_stats import interleaved_times, rss_growth_mib

CPU_TARGET = dict(N=8192, H=1024, V=32768, B=16)
CPU_QUICK = dict(N=1024, H=256, V=4096, B=8)
GPU_TARGET = dict(N=16384, H=4096, V=151936, B=16)

LIGER = "liger-kernel (eager)"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------------------


def make_inputs(N, H, V, B, dtype=torch.float32, device="cpu", seed=0, pad=0.125):
    """Deterministic GRPO inputs: hidden [B, T, H], weight [V, H], targets/old/mask [B, T], advantages [B].

    ``pad``: fraction of all tokens that are right padding (mask 0), put on every second sequence.
    """
    T = N // B
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 0.5).to(device=device, dtype=dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    y = torch.randint(0, V, (B, T), generator=g).to(device)
    old = (-torch.log(torch.tensor(float(V))) + 0.1 * torch.randn(B, T, generator=g)).to(device)
    adv = torch.randn(B, generator=g).to(device)
    mask = torch.ones(B, T, device=device)
    n_pad = min(T, int(round(2 * pad * T)))
    if n_pad:
        mask[::2, T - n_pad :] = 0  # right padding on every second sequence
    return dict(h=h, w=w, y=y, old=old, adv=adv, mask=mask)


def naive_logprobs(h, w, y):
    logits = (h.reshape(-1, h.shape[-1]) @ w.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, y.reshape(-1, 1)).squeeze(-1)


def naive_grpo(h, w, y, old, adv, mask, eps=0.2):
    """The unfused path: logits -> log_softmax -> gather -> clipped loss (token-mean)."""
    lp = naive_logprobs(h, w, y).view_as(old)
    r = torch.exp(lp - old)
    a = adv.unsqueeze(-1)
    per = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
    return (per * mask).sum() / mask.sum()


def variants(op: str, impl: str | None = None, peers: bool = True) -> dict:
    """name -> fn(inputs) running forward + backward once."""
    from bitrl.kernels import fused_linear_policy_loss, fused_logprobs

    def zero_grads(x):
        x["h"].grad = None
        x["w"].grad = None

    out = {}
    if op == "logprobs":

        def naive(x):
            zero_grads(x)
            naive_logprobs(x["h"], x["w"], x["y"]).sum().backward()

        def fused(x):
            zero_grads(x)
            h = x["h"].reshape(-1, x["h"].shape[-1])
            lp, _ = fused_logprobs(h, x["w"], x["y"].reshape(-1), return_entropy=False, impl=impl)
            lp.sum().backward()

        out["naive torch"] = naive
        out["bitrl"] = fused
        return out

    def naive(x):
        zero_grads(x)
        naive_grpo(x["h"], x["w"], x["y"], x["old"], x["adv"], x["mask"]).backward()

    def fused(x):
        zero_grads(x)
        loss, _ = fused_linear_policy_loss(x["h"], x["w"], x["y"], x["old"], x["adv"], x["mask"], impl=impl)
        loss.backward()

    out["naive torch"] = naive
    out["bitrl"] = fused
    if peers and have("liger_kernel"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", compiled=False)

        def liger_fn(x):
            zero_grads(x)
            loss, _ = liger(x["h"], x["w"], x["y"], x["mask"], x["adv"], old_per_token_logps=x["old"])
            loss.backward()

        out[LIGER] = liger_fn
    return out


# ----------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------


def time_round_robin(fns: dict, x: dict, reps: int, device: str = "cpu") -> dict:
    """Median seconds per call of each fn(x), the variants interleaved so that machine noise affects all of
    them alike (one warm-up round first)."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    times = interleaved_times({k: partial(fn, x) for k, fn in fns.items()}, reps, sync=sync)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_peak_rss_here(op: str, name: str, shape: dict, dtype: str) -> float:
    """Peak RSS growth (MiB) of one forward+backward, in this process (call in a fresh subprocess)."""
    x = make_inputs(**shape, dtype=DTYPES[dtype])
    x["h"].requires_grad_(True)
    x["w"].requires_grad_(True)
    fn = variants(op)[name]
    return rss_growth_mib(lambda: fn(x))[0]


def peak_rss_subprocess(op: str, name: str, shape: dict, dtype: str) -> float | None:
    cmd = [
        sys.executable,
        "-m",
        "bitrl.kernels.bench",
        "--_peak",
        json.dumps(dict(op=op, name=name, shape=shape, dtype=dtype)),
    ]
    env = dict(os.environ)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=True)
        return float(res.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        print(f"  (peak memory of {name!r} not measured: {exc})", file=sys.stderr)
        return None


def cpu_section(shape: dict, dtype: str, reps: int, ops, memory: bool, peers: bool = True) -> list[dict]:
    rows = []
    for op in ops:
        x = make_inputs(**shape, dtype=DTYPES[dtype])
        x["h"].requires_grad_(True)
        x["w"].requires_grad_(True)
        fns = variants(op, peers=peers)
        print(f"  timing {op}: {', '.join(fns)} ...", flush=True)
        times = time_round_robin(fns, x, reps=reps)
        del x
        base_t = times["naive torch"]
        if memory:
            print(f"  peak memory {op}: one fresh subprocess per variant ...", flush=True)
        mems = {k: (peak_rss_subprocess(op, k, shape, dtype) if memory else None) for k in fns}
        base_m = mems.get("naive torch")
        for k in fns:
            m = mems[k]
            rows.append(
                dict(
                    section="cpu",
                    op=op,
                    variant=k,
                    dtype=dtype,
                    **shape,
                    time_s=times[k],
                    time_vs_naive=times[k] / base_t,
                    time_vs_liger=(times[k] / times["liger-kernel (eager)"])
                    if "liger-kernel (eager)" in times
                    else None,
                    peak_mib=m,
                    mem_vs_naive=(m / base_m) if (m is not None and base_m) else None,
                )
            )
    return rows


def gpu_section(shape: dict, reps: int) -> list[dict]:  # pragma: no cover - needs CUDA
    dev = "cuda"
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    roofline = 10 * 2 * 8192**3 / (time.perf_counter() - t0)
    del a, b
    N, H, V = shape["N"], shape["H"], shape["V"]
    flops = 3 * 2 * N * H * V  # forward logits + d hidden + d weight
    x = make_inputs(**shape, dtype=torch.bfloat16, device=dev)
    x["h"].requires_grad_(True)
    x["w"].requires_grad_(True)
    fns = variants("grpo")
    if have("cut_cross_entropy"):
        from cut_cross_entropy import linear_cross_entropy

        def cce(x):
            x["h"].grad = None
            x["w"].grad = None
            linear_cross_entropy(x["h"], x["w"], x["y"]).backward()

        fns["cut-cross-entropy (CE only)"] = cce
    times = time_round_robin(fns, x, reps=reps, device=dev)
    rows = []
    for k, fn in fns.items():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append(
            dict(
                section="gpu",
                op="grpo",
                variant=k,
                dtype="bf16",
                **shape,
                time_s=times[k],
                time_vs_naive=times[k] / times["naive torch"],
                tflops=flops / times[k] / 1e12,
                roofline_frac=flops / times[k] / roofline,
                peak_mib=peak,
            )
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = [
        "section",
        "op",
        "variant",
        "dtype",
        "N",
        "H",
        "V",
        "pad",
        "time s",
        "x naive",
        "x liger",
        "peak MiB",
        "mem x naive",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    for r in rows:
        cells = [
            r["section"],
            r["op"],
            r["variant"],
            r["dtype"],
            str(r["N"]),
            str(r["H"]),
            str(r["V"]),
            f(r.get("pad"), ".3f"),
            f(r.get("time_s"), ".3f"),
            f(r.get("time_vs_naive"), ".2f"),
            f(r.get("time_vs_liger"), ".2f"),
            f(r.get("peak_mib"), ".0f"),
            f(r.get("mem_vs_naive"), ".3f"),
        ]
        if r["section"] == "gpu":
            cells[-1] = f"{r['tflops']:.1f} TFLOP/s, {100 * r['roofline_frac']:.0f}% roofline"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bitrl bench", description="side-by-side kernel benchmarks")
    p.add_argument("--quick", action="store_true", help="small CPU sizes (seconds instead of minutes)")
    p.add_argument("--N", type=int, help="tokens (default 8192; quick 1024)")
    p.add_argument("--H", type=int, help="hidden size (default 1024; quick 256)")
    p.add_argument("--V", type=int, help="vocabulary (default 32768; quick 4096)")
    p.add_argument("--B", type=int, help="sequences (default 16)")
    p.add_argument("--pad", type=float, default=0.125, help="fraction of tokens that are padding (0.125)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per variant (median)")
    p.add_argument("--ops", default="grpo,logprobs", help="comma list: grpo, logprobs")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    p.add_argument("--no-peers", action="store_true", help="skip Liger-Kernel / cut-cross-entropy")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--out", help="write results.json and table.md into this folder (e.g. on a GPU machine)")
    p.add_argument("--_peak", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._peak:
        spec = json.loads(args._peak)
        print(measure_peak_rss_here(spec["op"], spec["name"], spec["shape"], spec["dtype"]))
        return 0

    shape = dict(CPU_QUICK if args.quick else CPU_TARGET)
    for k in ("N", "H", "V", "B"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    shape["pad"] = args.pad
    if shape["N"] % shape["B"]:
        p.error("--N must be a multiple of --B")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    print(
        f"bitrl bench: CPU {shape} {args.dtype}, {torch.get_num_threads()} threads, reps={args.reps}; "
        f"liger-kernel {'installed' if have('liger_kernel') else 'not installed'}",
        flush=True,
    )
    rows = cpu_section(shape, args.dtype, args.reps, ops, memory=not args.no_memory, peers=not args.no_peers)
    if args.no_gpu:
        print("GPU section skipped (--no-gpu).")
    elif not torch.cuda.is_available():
        print("GPU section skipped: no CUDA device on this machine (GPU rows: not measured).")
    else:  # pragma: no cover - needs CUDA
        rows += gpu_section(dict(GPU_TARGET), args.reps)
    note = (
        "time: median of round-robin repetitions, forward+backward; peak MiB: growth of the peak RSS (VmHWM) "
        "in a fresh subprocess (CPU) or torch.cuda.max_memory_allocated (GPU)."
    )
    table = format_table(rows)
    print(table)
    print(note)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(rows, f, indent=2)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(table + "\n\n" + note + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
