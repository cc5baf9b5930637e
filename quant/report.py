"""``bitrl quant-report``: per-layer quantization error, its decomposition, and the effect of each correction.

    bitrl quant-report --demo --format mxfp4 [--out DIR]
    bitrl quant-report --model DIR --format nvfp4

For every quantized linear layer it prints the relative error ``||x̂ - x|| / ||x||``, the deadzone fraction
(entries flushed to zero) and the energy of each error part relative to ``||W||^2`` (see
:mod:`bitrl.quant.analysis`), then the same after macro-block scaling (targets scale bias) and outlier
fallback (targets deadzone). A final section measures AQN on the model's outputs: next-token entropy and KL
to the unquantized model at each stage's sigma. Numbers go to ``quant_report_<fmt>.json``, the plot to
``quant_report_<fmt>.png`` in ``--out``.

``--demo`` builds a small Qwen2-architecture model from a config (no download): random init with the usual
0.02 weight scale, plus synthetic outlier input channels and a few isolated outlier weights, as trained LLM
weights have.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
from torch import nn

from .analysis import error_decomposition, quantize_macroblock, quantize_outlier_fallback
from .aqn import AQN, AQNSchedule
from .formats import FORMATS
from .linear import _skipped, quantize_model
from .quantize import quantize

PARTS = ("scale_bias", "deadzone", "grid_noise")


def build_demo_model(
    hidden: int = 640,
    layers: int = 4,
    vocab: int = 4096,
    *,
    seed: int = 0,
    outliers: bool = True,
) -> nn.Module:
    """A real-shaped Qwen2 causal LM from a config, random init (std 0.02), with synthetic weight outliers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 64 // 5),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and not _skipped(name, ("lm_head",)):
                w = mod.weight
                if outliers:
                    k = w.shape[1]
                    cols = torch.randperm(k, generator=g)[: max(1, k // 200)]  # 0.5% outlier input channels
                    w[:, cols] *= 8 + 17 * torch.rand(len(cols), generator=g)
                    n = max(1, w.numel() // 10000)  # 0.01% isolated outliers
                    idx = torch.randint(0, w.numel(), (n,), generator=g)
                    w.view(-1)[idx] *= 10 + 20 * torch.rand(n, generator=g)
            elif type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape, generator=g))
        # a trained model's next-token distribution is peaked: scale the final norm so that the demo's
        # entropy is a few nats instead of log(vocab)
        model.model.norm.weight.mul_(8.0)
    return model


def load_model(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:  # transformers >= 5 names it `dtype`
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    except TypeError:
        return AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, local_files_only=True
        ).eval()


def short_name(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return f"L{parts[i + 1]}." + ".".join(parts[i + 2 :]).replace("self_attn.", "").replace("mlp.", "")
    return name


def analyse_weight(w: torch.Tensor, fmt: str, *, macro_block: int, tau: float, **kw) -> dict:
    """Base decomposition and the two weight corrections for one tensor."""
    out = {"base": error_decomposition(w, fmt, **kw).summary()}
    if FORMATS[fmt].is_mx:
        xm, info = quantize_macroblock(w, fmt, macro_block=macro_block, **kw)
        out["macro_block"] = error_decomposition(w, fmt, xhat=xm, **kw).summary()
        out["macro_block"]["overhead_bits"] = info["overhead_bits_per_element"]
    xo, mask, info = quantize_outlier_fallback(w, fmt, tau=tau, clip_tol=None, **kw)
    out["outlier_fallback"] = error_decomposition(w, fmt, xhat=xo, fallback=mask, **kw).summary()
    out["outlier_fallback"]["overhead_bits"] = info["overhead_bits_per_element"]
    out["numel"] = w.numel()
    out["norm2"] = float(w.double().pow(2).sum())
    return out


def aggregate(rows: list[dict], variant: str) -> dict:
    """Energy-weighted totals over layers (energies relative to the summed ||W||^2)."""
    tot = sum(r["norm2"] for r in rows) or 1.0
    n = sum(r["numel"] for r in rows) or 1
    rs = [r for r in rows if variant in r]
    agg = {f"E_{p}": sum(r[variant][f"E_{p}"] * r["norm2"] for r in rs) / tot for p in ("total", *PARTS)}
    agg["rel_error"] = math.sqrt(agg["E_total"])
    agg["deadzone_frac"] = sum(r[variant]["deadzone_frac"] * r["numel"] for r in rs) / n
    agg["fallback_frac"] = sum(r[variant]["fallback_frac"] * r["numel"] for r in rs) / n
    return agg


@torch.no_grad()
def output_effect(
    model: nn.Module,
    fmt: str,
    *,
    skip=("lm_head", "embed_tokens"),
    macro_block: int = 128,
    tau: float = 8.0,
    seed: int = 0,
    tokens: int = 64,
    **quant_kwargs,
) -> list[dict]:
    """KL(unquantized || quantized) and entropy of the next-token distribution with every linear weight
    replaced by its plain / macro-block / outlier-fallback reconstruction (the corrections' effect on the
    outputs)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
    ref_lp = torch.log_softmax(model(ids).logits.float(), -1)
    variants = {"plain": lambda w: quantize(w, fmt, **quant_kwargs).dequantize()}
    if FORMATS[fmt].is_mx:
        variants["macro_block"] = lambda w: quantize_macroblock(
            w, fmt, macro_block=macro_block, **quant_kwargs
        )[0]
    variants["outlier_fallback"] = lambda w: quantize_outlier_fallback(
        w, fmt, tau=tau, clip_tol=None, **quant_kwargs
    )[0]
    out = []
    for name, fn in variants.items():
        m = copy.deepcopy(model)
        for lname, mod in m.named_modules():
            if isinstance(mod, nn.Linear) and not _skipped(lname, skip):
                mod.weight.copy_(fn(mod.weight.detach().float()).to(mod.weight.dtype))
        lp = torch.log_softmax(m(ids).logits.float(), -1)
        kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
        out.append({"variant": name, "kl_to_ref": kl, "entropy": float(-(lp.exp() * lp).sum(-1).mean())})
        del m
    return out


@torch.no_grad()
def aqn_effect(
    model: nn.Module, fmt: str, stages: int, *, seed: int = 0, tokens: int = 64, **quant_kwargs
) -> list[dict]:
    """Entropy and KL(p_ref || p_rollout) of the next-token distribution at each AQN stage's sigma."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
    ref_lp = torch.log_softmax(model(ids).logits.float(), -1)
    qmodel = quantize_model(copy.deepcopy(model), fmt, act=None, **quant_kwargs)
    sched = AQNSchedule(total_steps=stages, num_stages=stages)
    aqn = AQN(sched, seed=seed)

    def kl(p_lp, q_lp):
        return float((p_lp.exp() * (p_lp - q_lp)).sum(-1).mean())

    def entropy(lp):
        return float(-(lp.exp() * lp).sum(-1).mean())

    noaqn_lp = torch.log_softmax(qmodel(ids).logits.float(), -1)
    out = [
        {"stage": "bf16", "sigma": 0.0, "entropy": entropy(ref_lp), "kl_to_ref": 0.0, "kl_to_no_aqn": None}
    ]
    for k in range(stages):
        sigma = aqn.apply_(qmodel, k)
        lp = torch.log_softmax(qmodel(ids).logits.float(), -1)
        out.append(
            {
                "stage": k,
                "sigma": sigma,
                "entropy": entropy(lp),
                "kl_to_ref": kl(ref_lp, lp),
                "kl_to_no_aqn": kl(noaqn_lp, lp),
            }
        )
    return out


def fmt_table(rows: list[dict], names: list[str], fmt: str) -> str:
    has_macro = any("macro_block" in r for r in rows)
    head = (
        f"{'layer':<18}{'shape':>12}{'rel_err':>9}{'dz%':>7}{'E_scale':>10}{'E_dead':>10}{'E_grid':>10}"
        + (f" |{'macro:E_scale':>14}{'rel_err':>9}" if has_macro else "")
        + f" |{'fallback:E_dead':>16}{'rel_err':>9}{'kept%':>7}"
    )
    lines = [head, "-" * len(head)]

    def row(label, shape, b, m, o):
        s = (
            f"{label:<18}{shape:>12}{b['rel_error']:>9.4f}{100 * b['deadzone_frac']:>7.2f}"
            f"{b['E_scale_bias']:>10.2e}{b['E_deadzone']:>10.2e}{b['E_grid_noise']:>10.2e}"
        )
        if has_macro:
            s += f" |{m['E_scale_bias']:>14.2e}{m['rel_error']:>9.4f}"
        s += f" |{o['E_deadzone']:>16.2e}{o['rel_error']:>9.4f}{100 * o['fallback_frac']:>7.2f}"
        return s

    for name, r in zip(names, rows):
        lines.append(
            row(short_name(name), r["shape"], r["base"], r.get("macro_block"), r["outlier_fallback"])
        )
    lines.append("-" * len(head))
    agg = {v: aggregate(rows, v) for v in ("base", "macro_block", "outlier_fallback")}
    lines.append(row("ALL (energy-wt)", "", agg["base"], agg["macro_block"], agg["outlier_fallback"]))
    return "\n".join(lines)


def plot(path: str, fmt: str, names: list[str], rows: list[dict], agg: dict, aqn: list[dict] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    labels = [short_name(n) for n in names]
    xs = range(len(rows))
    ax = axes[0][0]
    bottom = [0.0] * len(rows)
    for part, color in zip(PARTS, ("tab:red", "tab:blue", "tab:gray")):
        vals = [r["base"][f"E_{part}"] for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [r["base"]["E_total"] for r in rows], "k.", label="total (parts overlap)")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("energy / ||W||^2")
    ax.set_title(f"{fmt}: error parts per layer")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    for variant, style in (("base", "o-"), ("macro_block", "s-"), ("outlier_fallback", "^-")):
        if all(variant in r for r in rows):
            ax.plot(xs, [r[variant]["rel_error"] for r in rows], style, ms=3, label=variant)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("relative error")
    ax.set_title("relative error per layer, per correction")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    variants = [v for v in ("base", "macro_block", "outlier_fallback") if agg.get(v)]
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        vals = [agg[v][f"E_{p}"] for p in PARTS]
        ax.bar([j + i * width for j in range(3)], vals, width, label=v)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(3)], list(PARTS))
    ax.set_yscale("log")
    ax.set_ylabel("energy / ||W||^2 (all layers)")
    ax.set_title("each correction shrinks the part it targets")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    if aqn:
        st = [a for a in aqn if a["stage"] != "bf16"]
        ax.plot([a["stage"] for a in st], [a["entropy"] for a in st], "o-", label=f"{fmt} + AQN entropy")
        ax.axhline(aqn[0]["entropy"], color="k", ls="--", label="unquantized entropy")
        ax.set_xlabel("AQN stage")
        ax.set_ylabel("next-token entropy (nats)")
        ax2 = ax.twinx()
        ax2.semilogy(
            [a["stage"] for a in st], [max(a["kl_to_no_aqn"], 1e-12) for a in st], "r^-", label="KL to no-AQN"
        )
        ax2.set_ylabel("KL(rollout without AQN || with AQN)", color="r")
        ax.set_title("AQN: sigma " + ", ".join(f"{a['sigma']:.0e}" for a in st))
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_report(
    model: nn.Module,
    fmt: str,
    *,
    out_dir: str | None,
    skip=("lm_head", "embed_tokens"),
    macro_block: int = 128,
    tau: float = 8.0,
    aqn_stages: int = 5,
    scale_mode: str = "floor",
    max_layers: int | None = None,
    output_kl: bool = True,
    print_fn=print,
) -> dict:
    """Analyse every linear weight of ``model``; returns the report dict (also written to ``out_dir``)."""
    kw = {"scale_mode": scale_mode} if FORMATS[fmt].is_mx else {}
    names, rows = [], []
    t0 = time.perf_counter()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or _skipped(name, skip):
            continue
        if max_layers is not None and len(names) >= max_layers:
            break
        w = mod.weight.detach().float()
        r = analyse_weight(w, fmt, macro_block=macro_block, tau=tau, **kw)
        r["shape"] = "x".join(map(str, w.shape))
        names.append(name)
        rows.append(r)
    agg = {
        v: aggregate(rows, v)
        for v in ("base", "macro_block", "outlier_fallback")
        if any(v in r for r in rows)
    }
    print_fn(
        f"bitrl quant-report: {fmt}" + (f" (scale_mode={scale_mode})" if kw else "") + f", {len(rows)} layers"
    )
    print_fn(
        "energies are sum(part^2) / ||W||^2; scale bias and grid noise overlap, so parts need not add up"
    )
    print_fn(fmt_table(rows, names, fmt))
    b = agg["base"]
    print_fn("")
    print_fn("corrections (all layers, energy-weighted):")
    if "macro_block" in agg:
        m = agg["macro_block"]
        print_fn(
            f"  macro-block scaling ({macro_block}-element blocks, +{8 / macro_block:.3f} bit/elem): "
            f"scale-bias energy {b['E_scale_bias']:.3e} -> {m['E_scale_bias']:.3e} "
            f"({b['E_scale_bias'] / max(m['E_scale_bias'], 1e-30):.1f}x smaller), "
            f"rel. error {b['rel_error']:.4f} -> {m['rel_error']:.4f}"
        )
    o = agg["outlier_fallback"]
    bits = sum(r["outlier_fallback"]["overhead_bits"] * r["numel"] for r in rows) / sum(
        r["numel"] for r in rows
    )
    print_fn(
        f"  outlier fallback (|x| > {tau:g} x block median kept in bf16: {100 * o['fallback_frac']:.3f}% of "
        f"entries, +{bits:.3f} bit/elem): deadzone energy {b['E_deadzone']:.3e} -> {o['E_deadzone']:.3e} "
        f"({b['E_deadzone'] / max(o['E_deadzone'], 1e-30):.1f}x smaller), deadzone fraction "
        f"{100 * b['deadzone_frac']:.2f}% -> {100 * o['deadzone_frac']:.2f}%, "
        f"rel. error {b['rel_error']:.4f} -> {o['rel_error']:.4f}"
    )
    outputs = None
    if output_kl and hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        outputs = output_effect(model, fmt, skip=skip, macro_block=macro_block, tau=tau, **kw)
        print_fn("  effect on the model's next-token distribution (random tokens):")
        for o in outputs:
            print_fn(
                f"    {o['variant']:<17} KL(unquantized||quantized) {o['kl_to_ref']:.3e}  "
                f"entropy {o['entropy']:.4f} nats"
            )
    aqn = None
    if aqn_stages and hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        aqn = aqn_effect(model, fmt, aqn_stages, **kw)
        print_fn(
            "  AQN (noise on the rollout copy's RMSNorm weights; targets the entropy effect of grid noise, "
            "not its energy):"
        )
        for a in aqn:
            print_fn(
                f"    stage {a['stage']!s:>4}  sigma {a['sigma']:.1e}  entropy {a['entropy']:.4f} nats  "
                f"KL(unquantized||rollout) {a['kl_to_ref']:.3e}  KL(no AQN||AQN) "
                + ("-" if a["kl_to_no_aqn"] is None else f"{a['kl_to_no_aqn']:.3e}")
            )
    print_fn(f"({time.perf_counter() - t0:.1f} s)")
    report = {
        "format": fmt,
        "scale_mode": kw.get("scale_mode"),
        "layers": {n: r for n, r in zip(names, rows)},
        "aggregate": agg,
        "aqn": aqn,
        "outputs": outputs,
        "settings": {"macro_block": macro_block, "tau": tau, "aqn_stages": aqn_stages},
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        jpath = os.path.join(out_dir, f"quant_report_{fmt}.json")
        with open(jpath, "w") as f:
            json.dump(report, f, indent=1)
        ppath = os.path.join(out_dir, f"quant_report_{fmt}.png")
        plot(ppath, fmt, names, rows, agg, aqn)
        print_fn(f"wrote {ppath} and {jpath}")
        report["png"] = ppath
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bitrl quant-report", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a local Hugging Face causal LM directory")
    src.add_argument(
        "--demo", action="store_true", help="a small real-shaped Qwen2 model built from a config"
    )
    p.add_argument("--format", default="mxfp4", choices=sorted(FORMATS))
    p.add_argument("--scale-mode", default="floor", choices=("floor", "rceil"), help="MX scale rounding")
    p.add_argument("--out", default=os.path.join("runs", "quant-report"), help="output folder (PNG + JSON)")
    p.add_argument("--macro-block", type=int, default=128)
    p.add_argument("--tau", type=float, default=8.0, help="outlier threshold, in block medians")
    p.add_argument("--aqn-stages", type=int, default=5, help="0 disables the AQN section")
    p.add_argument("--max-layers", type=int, default=None)
    p.add_argument("--no-output-kl", action="store_true", help="skip the model-output comparison")
    p.add_argument("--hidden", type=int, default=640, help="--demo: hidden size")
    p.add_argument("--layers", type=int, default=4, help="--demo: number of layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="rank the linears by the mismatch each adds quantized alone (rollout.fp8_layers: the first N)",
    )
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.model:
        if not os.path.isdir(args.model):
            print(f"bitrl quant-report: --model {args.model!r} is not a directory", file=sys.stderr)
            return 2
        model = load_model(args.model)
    else:
        model = build_demo_model(args.hidden, args.layers, seed=args.seed)
    if args.sensitivity:
        return print_sensitivity(model, args)
    run_report(
        model,
        args.format,
        out_dir=args.out,
        macro_block=args.macro_block,
        tau=args.tau,
        aqn_stages=args.aqn_stages,
        output_kl=not args.no_output_kl,
        scale_mode=args.scale_mode,
        max_layers=args.max_layers,
    )
    return 0


def print_sensitivity(model: nn.Module, args) -> int:
    from .sensitivity import calibration_ids, layer_sensitivity

    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = calibration_ids(tokenizer, model.config.vocab_size, args.seed)
    kw = {"scale_mode": args.scale_mode} if FORMATS[args.format].is_mx else {}
    t0 = time.perf_counter()
    ranking = layer_sensitivity(model, args.format, ids, **kw)
    print(f"bitrl quant-report --sensitivity: {args.format}, {len(ranking)} layers, each quantized alone")
    print(f"{'rank':>4}  {'KL/token':>9}  layer")
    for i, (name, kl) in enumerate(ranking):
        print(f"{i + 1:>4}  {kl:9.2e}  {name}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sensitivity_{args.format}.json")
    with open(path, "w") as f:
        json.dump({"format": args.format, "ranking": ranking}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
