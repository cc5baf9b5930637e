"""`bitrl mismatch`: how far a rollout engine's log-probs are from the trainer's, on the same tokens.

Without training: sample responses with a rollout configuration (or read tokens and log-probs another engine
reported), score the same tokens with the trainer's model, and write a JSON summary and a PNG.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from bitrl.integrations.external import read_external, read_external_dump
from bitrl.rollout.batch import Rollout, left_pad
from bitrl.train.mismatch import mismatch_diagnostics

USAGE_EXAMPLES = """examples:
  bitrl mismatch --demo --rollout-precision mxfp4
  bitrl mismatch --demo --rollout-precision nvfp4 rollout.scale_mode=floor rollout.fp8_layers=4
  bitrl mismatch --model DIR --rollout-precision fp8 --prompts prompts.jsonl
  bitrl mismatch --model DIR --external vllm_logprobs.jsonl
  bitrl mismatch --model DIR --rollout-precision bf16 --trainer-dtype bfloat16 --prompts F rollout.aligned=1
external file: one JSON object per line, {"prompt_ids": [int], "response_ids": [int], "logprobs": [float]},
logprobs[i] being the engine's log-prob of response_ids[i] (after its temperature / top-k / top-p)."""


def rollout_from_rows(rows: list[dict], pad_id: int) -> Rollout:
    prompt_ids, prompt_mask = left_pad([r["prompt_ids"] for r in rows], pad_id)
    width = max(len(r["response_ids"]) for r in rows)
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r["response_ids"])
        response_ids[i, :n] = torch.tensor(r["response_ids"])
        response_mask[i, :n] = True
        logprobs[i, :n] = torch.tensor(r["logprobs"], dtype=torch.float32)
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, logprobs)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file of {"prompt": ...} objects, or a text file with one prompt per line."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'prompt' string") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompts")
    return prompts


def per_position(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Mean k3 divergence at each response position (NaN-free: positions without tokens are skipped)."""
    log_rho = (train_lp - rollout_lp).double()
    k3 = (torch.expm1(log_rho) - log_rho).masked_fill(~mask, 0.0)
    counts = mask.sum(0)
    return [float(k3[:, j].sum() / counts[j]) for j in range(mask.shape[1]) if counts[j] > 0]


def plot(train_lp, rollout_lp, by_position, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dlogp = (train_lp - rollout_lp).numpy()
    p = train_lp.exp().numpy()
    dp = p - rollout_lp.exp().numpy()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].hist(dlogp, bins=80, log=True)
    axes[0].set_title("Δ log p = log π_train − log π_rollout")
    axes[1].scatter(p, dp, s=2, alpha=0.3)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("π_train(y)")
    axes[1].set_title("Δp against p")
    axes[2].plot(range(len(by_position)), by_position, marker=".")
    axes[2].set_xlabel("response position")
    axes[2].set_title("k3 KL by position")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(train_lp, rollout_lp, mask, label: str) -> dict:
    """The report: bitrl's mismatch diagnostics over the unmasked tokens and the k3 divergence by position."""
    return {
        "comparison": label,
        "num_sequences": int(mask.shape[0]),
        "num_tokens": int(mask.sum()),
        **mismatch_diagnostics(train_lp, rollout_lp, mask),
        "k3_by_position": per_position(train_lp, rollout_lp, mask),
    }


def write_report(summary: dict, train_lp, rollout_lp, mask, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch.json").write_text(json.dumps(summary, indent=2))
    plot(
        train_lp[mask],
        rollout_lp[mask],
        summary["k3_by_position"],
        out / "mismatch.png",
        summary["comparison"],
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "k3_by_position"}, indent=2))
    print(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}")


def run_trainer_dump(argv: list[str]) -> int | None:
    """A TRL / verl rollout dump given to --external: an exit code when it holds both sides (reported here
    without a model), else ``None`` - after converting a verl dump to the plain external format in ``argv``,
    for --model to rescore."""
    if "--external" not in argv:
        return None
    parser = argparse.ArgumentParser(prog="bitrl mismatch", add_help=False)
    parser.add_argument("--external")
    parser.add_argument("--model")
    parser.add_argument("--out", default="runs/mismatch")
    args, _ = parser.parse_known_args(argv)
    try:
        dump = read_external_dump(args.external)
        if dump is None:
            return None  # bitrl's plain external format: the usual path
        if "train_logprobs" not in dump:
            if not args.model:
                raise ValueError(
                    f"{args.external}: holds the rollout side only; pass --model DIR to rescore it"
                )
            rows = [
                {"prompt_ids": p, "response_ids": r, "logprobs": lp[m].tolist()}
                for p, r, lp, m in zip(
                    dump["prompt_ids"], dump["response_ids"], dump["rollout_logprobs"], dump["mask"]
                )
            ]
            converted = Path(tempfile.mkdtemp()) / (Path(args.external).stem + ".jsonl")
            converted.write_text("".join(json.dumps(row) + "\n" for row in rows))
            argv[argv.index("--external") + 1] = str(converted)
            return None
        train, rollout, mask = dump["train_logprobs"], dump["rollout_logprobs"], dump["mask"]
        summary = summarize(train, rollout, mask, f"{dump['source']} dump: trainer vs rollout log-probs")
    except ValueError as e:
        print(f"bitrl mismatch: {e}", file=sys.stderr)
        return 2
    write_report(summary, train, rollout, mask, Path(args.out))
    return 0


def main(argv: list[str]) -> int:
    argv = list(argv)
    handled = run_trainer_dump(argv)
    if handled is not None:
        return handled
    parser = argparse.ArgumentParser(
        prog="bitrl mismatch",
        description="rollout vs trainer log-probs on the same tokens",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--demo", action="store_true", help="the warm-started demo model and task")
    source.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory (the trainer)")
    parser.add_argument(
        "--rollout-precision", default="bf16", help="full|fp32|bf16|fp16|fp8|mxfp8|mxfp4|nvfp4"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="rollout.KEY=VALUE",
        help="the rollout copy's recipe, as in bitrl train (scale_mode, outlier_tau, rotation, fp8_layers)",
    )
    parser.add_argument("--prompts", metavar="FILE", help="JSONL {'prompt': ...} or one prompt per line")
    parser.add_argument(
        "--external", metavar="FILE", help="token ids and log-probs reported by another engine"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 6 for --demo, else 128")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--chat-template", default="auto", choices=["auto", "none"], help="as task.chat_template (--model)"
    )
    parser.add_argument("--system-prompt", default=None, help="as task.system_prompt (--model)")
    parser.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/mismatch", help="output folder for mismatch.json and .png")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"bitrl mismatch: {e}", file=sys.stderr)
        return 2


def check_aligned_pair(rollout_model, policy, args) -> None:
    """rollout.aligned=true: a float rollout copy in the trainer's dtype, sampling the whole distribution."""
    from bitrl.rollout.precision import QUANT_FORMATS

    if args.rollout_precision in QUANT_FORMATS:
        raise ValueError(f"rollout.aligned: matched precision has no {args.rollout_precision} rollout")
    if args.top_k or args.top_p < 1:
        raise ValueError("rollout.aligned: the trainer scores the whole distribution; --top-k 0 --top-p 1")
    ours, theirs = next(rollout_model.parameters()).dtype, next(policy.parameters()).dtype
    if ours != theirs:
        raise ValueError(
            f"rollout.aligned: the rollout copy is {ours} and the trainer {theirs}: pass --rollout-precision "
            "and --trainer-dtype of one dtype"
        )


def recipe_label(recipe) -> str:
    """e.g. "mse scales, outliers > 8 medians in bf16, 4 layers fp8"."""
    parts = [f"{recipe.scale_mode} scales"]
    if recipe.outlier_tau is not None:
        parts.append(f"outliers > {recipe.outlier_tau:g} medians in bf16")
    if recipe.rotation is not None:
        parts.append(f"{recipe.rotation.mode} rotation b{recipe.rotation.block}")
    if recipe.fp8_layers:
        parts.append(f"{len(recipe.fp8_layers)} layers fp8")
    if recipe.gptq:
        parts.append("GPTQ rounding")
    return ", ".join(parts)


def gptq_calibration(policy, tokenizer, args, recipe_cfg, all_prompts, max_new, log) -> list:
    """rollout.gptq's calibration: the prompts after the measured ones, with the policy's own responses (the
    measured prompts themselves, said so, when there are no others)."""
    from bitrl.engine.config import TaskConfig
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import policy_sequences
    from bitrl.engine.tasks import Problem

    count = recipe_cfg.rollout.gptq_prompt_count()
    texts = all_prompts[args.num_prompts :][:count]
    if not texts:
        log("rollout.gptq: no prompts beyond the measured ones; calibrating on the measured prompts")
        texts = all_prompts[:count]
    chat = TaskConfig(chat_template=args.chat_template, system_prompt=args.system_prompt)
    ids = encode_prompts(tokenizer, [Problem(str(i), p, "") for i, p in enumerate(texts)], chat)
    return policy_sequences(policy, tokenizer, ids, max_new, args.temperature, args.seed, log)


def run(args) -> int:
    from bitrl.engine.config import TaskConfig, load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build, sensitive_layers
    from bitrl.engine.models import load_pretrained
    from bitrl.engine.tasks import Problem
    from bitrl.engine.warmstart import warm_start
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.precision import PRECISIONS, QUANT_FORMATS, make_rollout_model
    from bitrl.rollout.settings import EngineOptions, Sampling
    from bitrl.train.logprobs import aligned_token_logprobs_of, token_logprobs

    if args.rollout_precision not in PRECISIONS:
        raise ValueError(f"--rollout-precision must be one of {PRECISIONS}, got {args.rollout_precision!r}")
    outside = [o for o in args.overrides if not o.startswith("rollout.")]
    if outside:
        raise ValueError(f"{outside[0]}: bitrl mismatch takes rollout.KEY=VALUE settings only")
    recipe_cfg = load_config(
        None, [f"seed={args.seed}", f"rollout.precision={args.rollout_precision}", *args.overrides]
    )
    torch.manual_seed(args.seed)
    if args.demo:
        cfg = load_config(None, [f"seed={args.seed}", f"model.dtype={args.trainer_dtype}"])
        policy, tokenizer, task = build(cfg)
        warm_start(policy, tokenizer, task, cfg, log=lambda msg: print(msg, file=sys.stderr))
        rng = random.Random(args.seed)
        # the measured prompts, then as many more for rollout.gptq's calibration
        extra = recipe_cfg.rollout.gptq_prompt_count() if recipe_cfg.rollout.gptq else 0
        prompts = [task.sample(rng).prompt for _ in range(args.num_prompts + extra)]
        max_new = args.max_new_tokens or cfg.rollout.max_new_tokens
    else:
        policy, tokenizer = load_pretrained(args.model, args.trainer_dtype)
        prompts, max_new = None, args.max_new_tokens or 128
    policy.eval()
    all_prompts, prompts = prompts, prompts and prompts[: args.num_prompts]
    if args.prompts:
        all_prompts = read_prompts(args.prompts)
        prompts = all_prompts[: args.num_prompts]

    if args.external:
        rollout = rollout_from_rows(
            read_external(args.external, policy.config.vocab_size), tokenizer.pad_token_id
        )
        label = f"external: {Path(args.external).name}"
    else:
        if not prompts:
            raise ValueError("--model needs --prompts FILE (or --external FILE)")
        recipe = None
        if args.rollout_precision in QUANT_FORMATS:
            fmt = QUANT_FORMATS[args.rollout_precision]
            log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
            recipe = recipe_cfg.rollout.quant_recipe(
                fmt, sensitive_layers(policy, tokenizer, fmt, recipe_cfg, log)
            )
        calibration = None
        if recipe is not None and recipe.gptq:
            calibration = gptq_calibration(policy, tokenizer, args, recipe_cfg, all_prompts, max_new, log)
        rollout_model = make_rollout_model(policy, args.rollout_precision, recipe, calibration)
        aligned = recipe_cfg.rollout.aligned
        if aligned:
            check_aligned_pair(rollout_model, policy, args)
        chat = TaskConfig(chat_template=args.chat_template, system_prompt=args.system_prompt)
        prompt_ids = encode_prompts(tokenizer, [Problem(str(i), p, "") for i, p in enumerate(prompts)], chat)
        sampling = Sampling(
            max_new_tokens=max_new,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        )
        options = EngineOptions(aligned=aligned)
        rollout = RolloutEngine(rollout_model, sampling, options).generate(
            [ids for ids in prompt_ids for _ in range(args.samples_per_prompt)],
            generator=torch.Generator().manual_seed(args.seed),
        )
        scales = f" ({recipe_label(recipe)})" if recipe is not None else ""
        label = f"rollout {args.rollout_precision}{scales} vs trainer {args.trainer_dtype}"
        label += " (aligned)" if aligned else ""
    with torch.no_grad():
        if not args.external and recipe_cfg.rollout.aligned:
            train_lp, _ = aligned_token_logprobs_of(policy, rollout, args.temperature)
        else:
            train_lp, _ = token_logprobs(policy, rollout, args.temperature, with_entropy=False)
    mask = rollout.response_mask
    write_report(
        summarize(train_lp, rollout.logprobs, mask, label), train_lp, rollout.logprobs, mask, Path(args.out)
    )
    return 0
