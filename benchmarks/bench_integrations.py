"""bitrl against the trainers' own kernels on CPU: log-prob + entropy and the full GRPO loss, and a real TRL
GRPOTrainer run with and without bitrl.

Kernel rows (forward + backward, temperature 0.7 for log-prob + entropy): bitrl (``fused_logprobs`` /
``fused_linear_policy_loss``), TRL's ``trl.kernels.ChunkedLogProbFunction`` (TRL's default vocabulary tile
of 32768 and 4096-token tiles; the GRPO row adds TRL's clipped loss on its log-probs), Liger-Kernel eager
(``LigerFusedLinearGRPOLoss``, GRPO row only: Liger's log-prob + entropy op is Triton-only) and the naive
torch path. Each row's variants are timed round-robin in ONE subprocess (machine noise hits them alike);
peak memory is the growth of the peak RSS of one forward + backward in a fresh subprocess per variant, after a
warm-up call on tiny inputs (so that code pages, thread pools and allocator arenas are not counted). Every
subprocess runs under an address-space limit (``--mem-cap-gb``), and a variant whose planned working set
exceeds the cap is recorded as "out of memory at X GB (planned)" instead of being run. With ``--reps 0`` each
variant instead runs one call in its own process, timed and measured together (for calls that take many
minutes, such as emulated bf16 GEMMs on a CPU without bf16 units).

    python benchmarks/bench_integrations.py --kernels --shapes 4096x32768 --dtypes fp32 bf16
    python benchmarks/bench_integrations.py --trainer          # TRL GRPOTrainer, tiny Qwen2, 3 steps each
    python benchmarks/bench_integrations.py --quick            # small shapes, seconds (smoke test)

Results are written to benchmarks/results/bench_integrations.json (merged by row key) and printed as a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bitrl.kernels.bench_stats import interleaved_times, machine, rss_growth_mib

RESULTS = Path(__file__).resolve().parent / "results" / "bench_integrations.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
H = 1024
TEMPERATURE = 0.7
OPS = ("logprob_entropy", "grpo_loss")
VARIANTS = {"logprob_entropy": ("bitrl", "trl", "naive"), "grpo_loss": ("bitrl", "trl", "liger", "naive")}


def make_inputs(N, V, dtype, B=16, Hd=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = N // B
    h = (torch.randn(B, T, Hd, generator=g) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(V, Hd, generator=g) / Hd**0.5).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (B, T), generator=g)
    old = -torch.log(torch.tensor(float(V))) + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    mask[::2, T - T // 4 :] = 0  # right padding on every second sequence
    return dict(h=h, w=w, y=y, old=old, adv=adv, mask=mask)


def clipped_token_mean(lp, old, adv, mask, eps=0.2):
    """TRL's / the naive path's clipped surrogate, token mean (bnpo)."""
    r = torch.exp(lp - old)
    a = adv.unsqueeze(-1)
    per = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
    return (per * mask).sum() / mask.sum()


def variant_fn(op: str, name: str, memory_budget: int | None = None):
    """fn(inputs) running one forward + backward of ``name`` on ``op``; ``memory_budget``: bitrl's (None:
    the op's default)."""

    def flat(x):
        return x["h"].reshape(-1, x["h"].shape[-1]), x["y"].reshape(-1)

    if name == "bitrl":
        from bitrl.kernels import fused_linear_policy_loss, fused_logprobs

        if op == "logprob_entropy":

            def fn(x):
                h, y = flat(x)
                lp, ent = fused_logprobs(
                    h, x["w"], y, temperature=TEMPERATURE, impl="torch", memory_budget=memory_budget
                )
                (lp.sum() + ent.sum()).backward()

            return fn

        def fn(x):
            loss, _ = fused_linear_policy_loss(
                x["h"],
                x["w"],
                x["y"],
                x["old"],
                x["adv"],
                x["mask"],
                impl="torch",
                memory_budget=memory_budget,
            )
            loss.backward()

        return fn
    if name == "trl":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

        def trl_logprobs(x, outputs, temperature):
            h, y = flat(x)
            return ChunkedLogProbFunction.apply(h, x["w"], None, y, temperature, chunk, None, 1.0, outputs)

        if op == "logprob_entropy":

            def fn(x):
                lp, ent, *_ = trl_logprobs(x, ("entropy",), TEMPERATURE)
                (lp.sum() + ent.sum()).backward()

            return fn

        def fn(x):
            lp, *_ = trl_logprobs(x, (), 1.0)
            clipped_token_mean(lp.view_as(x["old"]), x["old"], x["adv"], x["mask"]).backward()

        return fn
    if name == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", compiled=False)

        def fn(x):
            loss, _ = liger(x["h"], x["w"], x["y"], x["mask"], x["adv"], old_per_token_logps=x["old"])
            loss.backward()

        return fn
    if name == "naive":

        def fn(x):
            h, y = flat(x)
            logits = (h @ x["w"].t()).float()
            if op == "logprob_entropy":
                logp = torch.log_softmax(logits / TEMPERATURE, -1)
                lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
                ent = -(logp.exp() * logp).sum(-1)
                (lp.sum() + ent.sum()).backward()
            else:
                lp = torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
                clipped_token_mean(lp.view_as(x["old"]), x["old"], x["adv"], x["mask"]).backward()

        return fn
    raise ValueError(f"variant: unknown {name!r}")


def planned_gb(op: str, name: str, N: int, V: int, dtype: str) -> float:
    """Working set beyond the inputs, from the shapes (checked before running anything)."""
    nv = N * V * 4 / 2**30  # one fp32 [N, V] tensor
    if name == "naive":  # logits (+ native copy), log-softmax, p / p log p, and their gradients
        return nv * (7 if op == "logprob_entropy" else 5) + (nv / 2 if dtype == "bf16" else 0)
    if name == "trl":  # 4096-token x 32768-column tiles and their torch temporaries
        return min(N, 4096) * min(V, 32768) * 4 / 2**30 * 6
    if name == "liger":  # chunks of one sequence (N / 16 tokens): a few [T, V] fp32 tensors at a time
        return (N // 16) * V * 4 / 2**30 * 4
    # bitrl: <= 128 MiB fp32 tiles (two with entropy), and the log-prob op's kept logits (512 MiB on CPU)
    return 0.5 + (0.5 if op == "logprob_entropy" else 0.0)


def limit_memory(cap_gb: float):
    cap = int(cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def child(spec: dict) -> dict:
    """Runs in a subprocess: timing (round-robin over spec['names']) or the peak memory of one variant."""
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec.get("bf16_gemms"):  # bitrl's path for a CPU with bf16 units, on any CPU (emulated GEMMs here)
        importlib.import_module("bitrl.kernels.fused_logprobs.numerics").CPU_BF16_MATMUL = torch.bfloat16
    if spec.get("fp32_gemms"):  # bitrl's path for a CPU without bf16 units, on any CPU
        importlib.import_module("bitrl.kernels.fused_logprobs.numerics").CPU_BF16_MATMUL = torch.float32
    x = make_inputs(spec["N"], spec["V"], DTYPES[spec["dtype"]])
    budget = spec.get("memory_budget")  # bitrl's, when given
    fns = {n: variant_fn(spec["op"], n, memory_budget=budget) for n in spec["names"]}
    if spec["mode"] in ("memory", "once"):
        (name,) = spec["names"]
        # a warm-up call on tiny inputs first: the library code it pages in, thread pools and allocator
        # arenas are the process's, not the working set of the measured call (~15 MiB on CPU)
        fns[name](make_inputs(64, 512, DTYPES[spec["dtype"]]))
        peak, seconds = rss_growth_mib(lambda: fns[name](x))
        timed = {"time_s": {name: seconds}} if spec["mode"] == "once" else {}
        return {"peak_mib": peak, **timed}
    runs = {n: (lambda fn=fn: fn(x)) for n, fn in fns.items()}
    times = interleaved_times(runs, spec["reps"], setup=lambda _: reset_grads(x))
    return {"time_s": {n: statistics.median(v) for n, v in times.items()}}


def reset_grads(x: dict) -> None:
    x["h"].grad = x["w"].grad = None


def run_child(spec: dict, cap_gb: float, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--_child", json.dumps(spec), "--mem-cap-gb", str(cap_gb)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or ["?"]
        oom = "memory" in tail[0].lower() or "alloc" in tail[0].lower()
        return {"error": f"out of memory at {cap_gb:g} GB (cap)" if oom else f"failed: {tail[0][:120]}"}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}


def kernel_rows(shapes, dtypes, ops, reps, cap_gb, timeout) -> list[dict]:
    rows = []
    for N, V in shapes:
        for dtype in dtypes:
            for op in ops:
                names = list(VARIANTS[op])
                skipped = {}
                for n in names:
                    plan = planned_gb(op, n, N, V, dtype) + N * H * 4 * 3 / 2**30 + V * H * 4 * 3 / 2**30
                    if plan > cap_gb - 1.5:  # ~1.5 GB for the interpreter, torch and the inputs
                        skipped[n] = f"out of memory at {plan:.1f} GB (planned; cap {cap_gb:g} GB)"
                run = [n for n in names if n not in skipped]
                base = dict(op=op, N=N, V=V, H=H, dtype=dtype)
                print(f"{op} N={N} V={V} {dtype}: timing {run} ...", flush=True)
                if reps:
                    timing = run_child(dict(base, mode="time", names=run, reps=reps), cap_gb, timeout)
                for n in names:
                    row = dict(base, variant=n, reps=reps)
                    if n in skipped:
                        row["status"] = skipped[n]
                    elif not reps:  # one call, timed and measured in its own process
                        once = run_child(dict(base, mode="once", names=[n]), cap_gb, timeout)
                        ok = "error" not in once
                        row.update(
                            dict(time_s=once["time_s"][n], peak_mib=once["peak_mib"])
                            if ok
                            else {"status": once["error"]}
                        )
                    elif "error" in timing:
                        row["status"] = timing["error"]
                    else:
                        row["time_s"] = timing["time_s"][n]
                        mem = run_child(dict(base, mode="memory", names=[n]), cap_gb, timeout)
                        row.update(mem if "error" not in mem else {"status": mem["error"]})
                    rows.append(row)
                    print("   ", row, flush=True)
                _compare(rows[-len(names) :])
    return rows


def _compare(rows):
    """time / memory of bitrl relative to the best peer that ran, on bitrl's row."""
    ours = next((r for r in rows if r["variant"] == "bitrl" and "time_s" in r), None)
    peers = [r for r in rows if r["variant"] != "bitrl" and "time_s" in r]
    if ours and peers:
        ours["time_vs_best_peer"] = ours["time_s"] / min(r["time_s"] for r in peers)
        mems = [r["peak_mib"] for r in peers if r.get("peak_mib")]
        if mems and ours.get("peak_mib") is not None:
            ours["mem_vs_best_peer"] = ours["peak_mib"] / min(mems)


# ----------------------------------------------------------------------------------------------------------
# a real TRL GRPOTrainer, with and without bitrl
# ----------------------------------------------------------------------------------------------------------

TRAINER_MODEL = dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
TRAINER_MODEL.update(num_attention_heads=4, num_key_value_heads=2)  # a 2-layer Qwen2 with GQA


def trainer_child(spec: dict) -> dict:
    import tempfile

    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    V = spec["model"]["vocab_size"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, V)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**spec["model"], pad_token_id=0, bos_token_id=1, eos_token_id=2))
    prompts = [" ".join(f"t{(7 * i + j) % (V - 4) + 4}" for j in range(spec["prompt_len"])) for i in range(8)]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=spec["completion_len"],
            max_steps=spec["steps"],
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            bf16=False,
            disable_tqdm=True,
            num_iterations=2,
            loss_type="grpo",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [len(c) / 100 for c in completions],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
        )
        if spec["bitrl"]:
            from bitrl.integrations.trl import use_bitrl

            use_bitrl(trainer)
        peak, _ = rss_growth_mib(trainer.train)
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    return {
        "step_time_s": statistics.median(steps[1:] or steps),
        "peak_mib": peak,
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


def trainer_rows(cap_gb, timeout, quick=False) -> list[dict]:
    model = (
        dict(TRAINER_MODEL, vocab_size=4096, hidden_size=64, intermediate_size=128)
        if quick
        else TRAINER_MODEL
    )
    spec = dict(model=model, prompt_len=32, completion_len=16 if quick else 64, steps=2 if quick else 4)
    rows = []
    for with_bitrl in (False, True):
        print(f"TRL GRPOTrainer, bitrl={with_bitrl} ...", flush=True)
        res = run_child(dict(spec, mode="trainer", bitrl=with_bitrl), cap_gb, timeout)
        rows.append(
            dict(op="trl_grpo_trainer", variant="trl + bitrl" if with_bitrl else "trl", **spec, **res)
        )
        print("   ", rows[-1], flush=True)
    return rows


def dtype_label(r: dict) -> str:
    """The row's dtype; bf16 rows are told apart by whether their CPU multiplies bf16 natively (without bf16
    units every bf16 GEMM is emulated, and bitrl multiplies bf16 tiles in fp32 there)."""
    if r.get("dtype") == "bf16" and not r.get("native_bf16"):
        return "bf16, no bf16 units"
    return r.get("dtype")


def merge(rows: list[dict], path: Path = RESULTS):
    key = lambda r: json.dumps(
        {**{k: r.get(k) for k in ("op", "variant", "N", "V", "model")}, "dtype": dtype_label(r)},
        sort_keys=True,
    )
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    merged = {key(r): r for r in old}
    # the machine of each row: bf16 rows in particular depend on whether the CPU multiplies bf16 natively
    here = machine()
    stamped = [{**r, "cpu": here["cpu"], "native_bf16": here["native_bf16"]} for r in rows]
    merged.update({key(r): r for r in stamped})
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{os.cpu_count()}-core CPU, shared", "torch": torch.__version__}
    path.write_text(json.dumps({"meta": meta, "rows": list(merged.values())}, indent=1) + "\n")


def markdown_table(rows: list[dict]) -> str:
    """One line per (op, N, V, dtype): each variant's time and peak memory; bitrl against the best peer."""
    groups: dict = {}
    for r in rows:
        if r.get("op") in OPS:
            groups.setdefault((r["op"], r["N"], r["V"], dtype_label(r)), {})[r["variant"]] = r

    def cell(r):
        if r is None:
            return "–"
        if "time_s" not in r or r.get("peak_mib") is None:
            return r.get("status", "not measured")
        return f"{r['time_s']:.1f} s, {r['peak_mib']:.0f} MiB"

    lines = [
        "| workload | N | V | dtype | bitrl | TRL kernel | Liger-Kernel | naive torch "
        "| bitrl vs best peer: time, memory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (op, N, V, dtype), g in sorted(groups.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1:])):
        ours = g.get("bitrl", {})
        ratio = "–"
        if "time_vs_best_peer" in ours:
            ratio = f"{ours['time_vs_best_peer']:.2f}×, {ours.get('mem_vs_best_peer', float('nan')):.2f}×"
        name = "log-prob + entropy" if op == "logprob_entropy" else "GRPO loss"
        liger = g.get("liger") if op == "grpo_loss" else {"status": "no CPU op"}
        lines.append(
            f"| {name} | {N} | {V} | {dtype} | {cell(g.get('bitrl'))} | {cell(g.get('trl'))} | "
            f"{cell(liger)} | {cell(g.get('naive'))} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes, a few seconds")
    p.add_argument("--shapes", nargs="*", default=["4096x32768", "8192x32768", "4096x151936", "8192x151936"])
    p.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"])
    p.add_argument("--ops", nargs="*", default=list(OPS))
    p.add_argument(
        "--reps",
        type=int,
        default=2,
        help="timed rounds after one warm-up round; 0: one call per variant, timed and measured in its own "
        "process (for shapes where one call takes many minutes, e.g. bf16 peers on a CPU without bf16 units)",
    )
    p.add_argument("--mem-cap-gb", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=RESULTS)
    p.add_argument("--table", action="store_true", help="print the README table from --json")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        limit_memory(args.mem_cap_gb)
        spec = json.loads(args._child)
        print(json.dumps(trainer_child(spec) if spec["mode"] == "trainer" else child(spec)))
        return 0
    if args.table:
        print(markdown_table(json.loads(args.json.read_text())["rows"]))
        return 0
    if args.quick:
        rows = kernel_rows([(256, 2048)], ["fp32"], OPS, 1, args.mem_cap_gb, args.timeout)
        rows += trainer_rows(args.mem_cap_gb, args.timeout, quick=True)
        print(json.dumps(rows, indent=1))
        return 0
    if args.kernels:  # merged shape by shape, so an interrupted run keeps what it measured
        for shape in args.shapes:
            for dtype in args.dtypes:
                N, V = (int(v) for v in shape.split("x"))
                merge(
                    kernel_rows([(N, V)], [dtype], args.ops, args.reps, args.mem_cap_gb, args.timeout),
                    args.json,
                )
    if args.trainer:
        merge(trainer_rows(args.mem_cap_gb, args.timeout), args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
