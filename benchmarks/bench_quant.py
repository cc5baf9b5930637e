"""Quantize / dequantize throughput per format (bitrl vs a straightforward torch implementation, side by
side), a GPU section (fraction of HBM bandwidth; skipped on CPU), and requantize time per step for a
Qwen2-0.5B-shaped model.

    pytest benchmarks/bench_quant.py --benchmark-only                 # CPU, small sizes, 4 layers
    BITRL_BENCH_FULL=1 pytest benchmarks/bench_quant.py --benchmark-only   # 4096 x 4096 tensors, 24 layers
    python benchmarks/bench_quant.py [--full] [--threads N]           # one table with ratios (same run)
    python benchmarks/bench_quant.py --gpu-out DIR                     # GPU: exactness, GB/s, matmuls, JSON

"Straightforward torch" is what one writes without caring about passes: scales through ``log2``/``pow``,
elements rounded to the grid by an argmin over the distance to every grid value, codes packed with shifts;
FP8 through ``(x / s).clamp().to(float8)`` (already a good path: the ratio there shows bitrl's checking and
bookkeeping overhead). GB/s counts the bytes of the float32 input (quantize) or output (dequantize).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import pytest
import torch

from bitrl.quant import E2M1, FORMATS, quantize, quantize_model, requantize_

FULL = os.environ.get("BITRL_BENCH_FULL", "0") not in ("", "0")
SHAPE = (4096, 4096) if FULL else (1024, 2048)
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}

# ----------------------------------------------------------------------------------------------- naive torch

_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def naive_quantize(x: torch.Tensor, fmt: str):
    """The obvious torch implementation of each format (no bit tricks, argmin rounding for FP4)."""
    f = FORMATS[fmt]
    if f.scale_kind == "fp32":
        s = x.abs().amax() / f.element.max
        return (x / s).clamp(-f.element.max, f.element.max).to(f.element.torch_dtype), s
    bs = f.block_size
    xb = x.reshape(x.shape[0], -1, bs)
    amax = xb.abs().amax(-1, keepdim=True)
    if f.scale_kind == "e8m0":
        e = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - f.element.emax
        scale = torch.pow(2.0, e.clamp(-127, 127))
        ts = None
    else:
        ts = x.abs().amax() / (448.0 * 6.0)
        scale = (amax / 6.0 / ts).to(torch.float8_e4m3fn).float() * ts
    y = xb / scale
    if f.element is E2M1:
        a = y.abs().clamp(max=6.0)
        codes = (a.unsqueeze(-1) - _GRID).abs().argmin(-1).to(torch.uint8)
        codes = codes | ((y < 0).to(torch.uint8) << 3)
        codes = codes.reshape(x.shape[0], -1)
        return codes[:, 0::2] | (codes[:, 1::2] << 4), scale, ts
    return y.clamp(-448, 448).to(torch.float8_e4m3fn), scale, ts


def naive_dequantize(q, fmt: str, shape):
    f = FORMATS[fmt]
    if f.scale_kind == "fp32":
        return q[0].float() * q[1]
    data, scale = q[0], q[1]
    if f.element is E2M1:
        codes = torch.stack((data & 0xF, data >> 4), -1).reshape(shape[0], -1)
        vals = _GRID[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    else:
        vals = data.float()
    return (vals.reshape(shape[0], -1, f.block_size) * scale).reshape(shape)


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(0)
    return torch.randn(*SHAPE) * 0.02


def _gbps(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    mean = benchmark.stats.stats.mean if benchmark.stats else None
    if mean:
        benchmark.extra_info["GB/s"] = nbytes / mean / 1e9


@pytest.mark.parametrize("impl", ["bitrl", "naive torch"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantize_cpu(benchmark, x, fmt, impl):
    benchmark.group = f"quantize {fmt} cpu {SHAPE[0]}x{SHAPE[1]} fp32"
    fn = (lambda: quantize(x, fmt)) if impl == "bitrl" else (lambda: naive_quantize(x, fmt))
    benchmark.pedantic(fn, rounds=5, warmup_rounds=1, iterations=1)
    _gbps(benchmark, x.numel() * 4)


@pytest.mark.parametrize("impl", ["bitrl", "naive torch"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_cpu(benchmark, x, fmt, impl):
    benchmark.group = f"dequantize {fmt} cpu {SHAPE[0]}x{SHAPE[1]} fp32"
    if impl == "bitrl":
        q = quantize(x, fmt)
        fn = q.dequantize
    else:
        q = naive_quantize(x, fmt)
        fn = lambda: naive_dequantize(q, fmt, x.shape)  # noqa: E731
    benchmark.pedantic(fn, rounds=5, warmup_rounds=1, iterations=1)
    _gbps(benchmark, x.numel() * 4)


def test_naive_matches_bitrl(x):
    """The baseline computes the same thing (so the comparison is fair)."""
    for fmt in ("mxfp4", "mxfp8", "fp8_e4m3"):
        ref = quantize(x, fmt).dequantize()
        got = naive_dequantize(naive_quantize(x, fmt), fmt, x.shape)
        agree = (ref == got).float().mean().item()
        assert agree > 0.999, (fmt, agree)  # argmin breaks ties downwards, RNE to even: a few ties differ


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU section: needs a CUDA device (Triton kernels)")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("op", ["quantize", "dequantize"])
def test_gpu_triton_bandwidth(benchmark, fmt, op):  # pragma: no cover - needs CUDA
    xg = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    q = quantize(xg, fmt)
    fn = (
        (lambda: quantize(xg, fmt, check_finite=False))
        if op == "quantize"
        else (lambda: q.dequantize(torch.bfloat16))
    )
    benchmark.group = f"gpu {op} {fmt} 8192x8192 bf16"

    def run():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, warmup_rounds=3, iterations=1)
    moved = xg.numel() * 2 + q.nbytes
    benchmark.extra_info["GB/s"] = moved / benchmark.stats.stats.mean / 1e9
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    if peak:
        benchmark.extra_info["fraction_of_hbm"] = moved / benchmark.stats.stats.mean / peak


# ----------------------------------------------------------------------------------------------- requantize


def qwen05b_shaped(layers: int, vocab: int = 151936):
    """Qwen2-0.5B shapes (hidden 896, intermediate 4864, 14 heads / 2 KV heads) from a config, random init."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


@torch.no_grad()
def touch_all(model):
    """Stand-in for an optimizer step that changed every tensor (bumps each version counter)."""
    for p in model.parameters():
        p.mul_(1.0)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
def test_requantize_step(benchmark, fmt):
    layers = 24 if FULL else 2
    policy = qwen05b_shaped(layers, vocab=151936 if FULL else 1024)
    qmodel = quantize_model(copy.deepcopy(policy), fmt, source=policy)
    benchmark.group = f"requantize_ per step, Qwen2-0.5B shapes, {layers} layers"

    def setup():
        touch_all(policy)
        return (qmodel, policy), {}

    benchmark.pedantic(requantize_, setup=setup, rounds=2 if FULL else 3, warmup_rounds=0, iterations=1)
    benchmark.extra_info["layers"] = layers
    benchmark.extra_info["quantized_params"] = sum(
        m.in_features * m.out_features for m in qmodel.modules() if hasattr(m, "qdata")
    )


# ----------------------------------------------------------------------------------------------- CLI table


def _time(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ----------------------------------------------------------------------------------------------- GPU script


def gpu_report(out_dir: str, reps: int = 20) -> int:
    """One short GPU run: Triton vs torch reference bit-exactness, quantize/dequantize bandwidth (fraction of
    HBM), W4A16 and FP8 matmuls against bf16, requantize_ time. Writes gpu_quant.json and gpu_quant.txt."""
    import json

    import torch.nn.functional as F

    from bitrl.kernels.qmatmul import scaled_mm_unavailable_reason
    from bitrl.quant import QuantLinear

    os.makedirs(out_dir, exist_ok=True)
    if not torch.cuda.is_available():  # still a result file: the GPU check's rehearsal reads it
        reason = "no CUDA device; nothing measured"
        with open(os.path.join(out_dir, "gpu_quant.json"), "w") as f:
            json.dump({"device": None, "skipped": reason}, f)
        print(f"gpu: {reason}")
        return 0
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    res: dict = {"device": name, "exact": {}, "bandwidth": {}, "matmul": {}, "requantize": {}}
    lines = [f"device: {name}"]

    def cuda_time(fn, n=reps):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n / 1e3

    g = torch.Generator().manual_seed(0)
    for fmt in ("mxfp4", "mxfp8", "nvfp4"):
        for mode in ("floor", "rceil") if FORMATS[fmt].is_mx else ("floor",):
            x = (
                torch.randn(257, 1000, generator=g)
                * 10.0 ** torch.randint(-8, 8, (257, 1), generator=g).float()
            )
            a = quantize(x, fmt, scale_mode=mode, backend="torch")
            b = quantize(x.to(dev), fmt, scale_mode=mode, backend="triton")
            same = torch.equal(a.data.view(torch.uint8), b.data.cpu().view(torch.uint8)) and torch.equal(
                a.scale.view(torch.uint8), b.scale.cpu().view(torch.uint8)
            )
            deq = torch.equal(a.dequantize(), b.dequantize(backend="triton").cpu())
            res["exact"][f"{fmt}-{mode}"] = bool(same and deq)
            lines.append(f"bit-exact {fmt:<6} {mode:<6} quantize+dequantize: {same and deq}")
    xg = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for fmt in ("mxfp4", "nvfp4", "mxfp8"):
        q = quantize(xg, fmt)
        for op, fn in (
            ("quantize", lambda f=fmt: quantize(xg, f, check_finite=False)),
            ("dequantize", lambda q=q: q.dequantize(torch.bfloat16)),
        ):
            t = cuda_time(fn)
            moved = xg.numel() * 2 + q.nbytes
            gbs = moved / t / 1e9
            frac = moved / t / peak if peak else None
            res["bandwidth"][f"{fmt}-{op}"] = {"s": t, "GB/s": gbs, "fraction_of_hbm": frac}
            lines.append(
                f"{fmt:<6} {op:<10} {gbs:8.1f} GB/s" + (f"  ({100 * frac:.0f}% of HBM)" if frac else "")
            )
    for m, n, k in ((1, 4864, 896), (16, 4864, 896), (256, 896, 4864), (4096, 4864, 896)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        t_ref = cuda_time(lambda lin=lin, x=x: F.linear(x, lin.weight))
        for fmt in ("mxfp4", "nvfp4", "fp8_e4m3"):
            if fmt == "fp8_e4m3" and scaled_mm_unavailable_reason(dev):
                continue
            ql = QuantLinear.from_linear(lin, fmt)
            path = ql.execution_path(x)
            t = cuda_time(lambda ql=ql, x=x: ql(x))
            ref = F.linear(x.float(), ql.dequantized_weight(torch.float32))
            err = float((ql(x).float() - ref).norm() / ref.norm())
            res["matmul"][f"{fmt}-{m}x{n}x{k}"] = {
                "path": path,
                "s": t,
                "bf16_s": t_ref,
                "rel_err_vs_deq": err,
            }
            lines.append(
                f"matmul {fmt:<8} {path:<13} M={m:<5} N={n:<5} K={k:<5} {t * 1e6:8.1f} us vs bf16 "
                f"{t_ref * 1e6:8.1f} us ({t_ref / t:.2f}x), rel err vs dequantized {err:.1e}"
            )
    res["gemv"] = fp4_gemv_bandwidth(dev, peak, cuda_time, lines)
    policy = qwen05b_shaped(24).to(dev, torch.bfloat16)
    for fmt in ("mxfp4", "nvfp4", "fp8_e4m3"):
        qmodel = quantize_model(copy.deepcopy(policy), fmt, source=policy)
        ts = []
        for _ in range(5):
            touch_all(policy)
            torch.cuda.synchronize()
            t = time.perf_counter()
            requantize_(qmodel, policy)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        res["requantize"][fmt] = statistics.median(ts)
        lines.append(
            f"requantize_ {fmt:<8} Qwen2-0.5B shapes, 24 layers: {1e3 * statistics.median(ts):.1f} ms"
        )
        del qmodel
    with open(os.path.join(out_dir, "gpu_quant.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out_dir, "gpu_quant.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(res["exact"].values()) else 1


def fp4_gemv_bandwidth(dev, peak, cuda_time, lines) -> dict:  # pragma: no cover - needs CUDA
    """Decode GEMV (M = 1 and 16) with FP4 weights: the CUDA C++ kernel, the Triton W4A16 matmul and bf16
    ``F.linear``, side by side. GB/s counts the bytes that must move: packed weight + scales + x + out."""
    import torch.nn.functional as F

    from bitrl.kernels.cuda_ext import cuda_unavailable_reason
    from bitrl.kernels.fp4_gemv import fp4_gemv
    from bitrl.kernels.qmatmul import w4a16_matmul

    out = {}
    reason = cuda_unavailable_reason()
    for fmt in ("mxfp4", "nvfp4"):
        for m, n, k in ((1, 8192, 8192), (1, 151936, 4096), (16, 8192, 8192)):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            q = quantize(w, fmt)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            moved = q.nbytes + x.numel() * 2 + m * n * 4
            runs = {
                "bf16 F.linear": (lambda w=w, x=x: F.linear(x, w), w.numel() * 2 + x.numel() * 2 + m * n * 2),
                "triton w4a16": (
                    lambda q=q, x=x, n=n, k=k: w4a16_matmul(
                        x,
                        q.data,
                        q.scale_fp32(),
                        q.fmt.element,
                        bw=q.block[1],
                        n=n,
                        k=k,
                        tensor_scale=q.tensor_scale,
                    ),
                    moved,
                ),
            }
            if reason is None:
                runs["cuda fp4_gemv"] = (
                    lambda q=q, x=x, k=k: fp4_gemv(
                        x, q.data, q.scale, q.fmt.name, k=k, tensor_scale=q.tensor_scale
                    ),
                    moved,
                )
            for name, (fn, nbytes) in runs.items():
                t = cuda_time(fn)
                gbs = nbytes / t / 1e9
                frac = nbytes / t / peak if peak else None
                out[f"{fmt}-{name}-{m}x{n}x{k}"] = {"s": t, "GB/s": gbs, "fraction_of_hbm": frac}
                lines.append(
                    f"gemv {fmt:<6} {name:<14} M={m:<3} N={n:<6} K={k:<5} {t * 1e6:8.1f} us {gbs:8.1f} GB/s"
                    + (f" ({100 * frac:.0f}% of HBM)" if frac else "")
                )
            del w, q
    if reason:
        lines.append(f"gemv: CUDA C++ kernel not measured ({reason})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="bitrl quantization throughput, side by side")
    p.add_argument("--full", action="store_true", help="4096 x 4096 tensors and 24 requantize layers")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--requantize-layers", type=int, default=None)
    p.add_argument("--gpu-out", metavar="DIR", help="run the GPU script only, writing results into DIR")
    args = p.parse_args(argv)
    if args.gpu_out:
        return gpu_report(args.gpu_out)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = (4096, 4096) if args.full else SHAPE
    torch.manual_seed(0)
    xt = torch.randn(*shape) * 0.02
    nbytes = xt.numel() * 4
    print(f"CPU, {torch.get_num_threads()} threads, {shape[0]}x{shape[1]} fp32, median of {args.reps}")
    print(f"{'format':<10}{'op':<11}{'bitrl GB/s':>11}{'naive GB/s':>11}{'speedup':>9}")
    for fmt in sorted(FORMATS):
        q = quantize(xt, fmt)
        nq = naive_quantize(xt, fmt)
        for op, a, b in (
            ("quantize", lambda f=fmt: quantize(xt, f), lambda f=fmt: naive_quantize(xt, f)),
            ("dequantize", q.dequantize, lambda f=fmt, nq=nq: naive_dequantize(nq, f, xt.shape)),
        ):
            ta, tb = [], []
            a(), b()
            for _ in range(args.reps):  # interleaved, so that load from other processes hits both alike
                ta.append(_time(a, 1))
                tb.append(_time(b, 1))
            ga, gb = nbytes / statistics.median(ta) / 1e9, nbytes / statistics.median(tb) / 1e9
            print(f"{fmt:<10}{op:<11}{ga:>11.3f}{gb:>11.3f}{ga / gb:>8.2f}x")
    layers = args.requantize_layers or (24 if args.full else 2)
    policy = qwen05b_shaped(layers, vocab=151936 if args.full else 1024)
    nparams = sum(p.numel() for p in policy.parameters())
    print(
        f"\nrequantize_ per step, Qwen2-0.5B shapes, {layers} layers ({nparams / 1e6:.0f}M params, "
        "all changed)"
    )
    for fmt in ("mxfp4", "nvfp4", "fp8_e4m3"):
        qmodel = quantize_model(copy.deepcopy(policy), fmt, source=policy)
        cold, warm = [], []
        for _ in range(args.reps):
            touch_all(policy)
            st = requantize_(qmodel, policy)
            cold.append(st["seconds"])
            touch_all(policy)
            t = time.perf_counter()
            requantize_(qmodel, policy, warm=True)
            warm.append(time.perf_counter() - t)
        t = time.perf_counter()
        none = requantize_(qmodel, policy)
        t0 = time.perf_counter() - t
        print(
            f"  {fmt:<9} requantize median {statistics.median(cold):.2f} s (min {min(cold):.2f}; "
            f"{st['requantized']} linears, {st['copied']} copies), with CPU dequant-cache rebuild "
            f"{statistics.median(warm):.2f} s, nothing changed {t0 * 1e3:.2f} ms "
            f"({none['unchanged']} tensors)"
        )
        del qmodel
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
