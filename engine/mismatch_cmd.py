"""`bitrl mismatch`: how far a rollout engine's log-probs are from the trainer's, on the same tokens.

Without training: sample responses with a rollout configuration (or read tokens and log-probs another engine
reported), score the same tokens with the trainer's model, and write a JSON summary and a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

from bitrl.rollout.engine import Rollout, left_pad

USAGE_EXAMPLES = """examples:
  bitrl mismatch --demo --rollout-precision mxfp4
  bitrl mismatch --model DIR --rollout-precision fp8 --prompts prompts.jsonl
  bitrl mismatch --model DIR --external vllm_logprobs.jsonl
external file: one JSON object per line, {"prompt_ids": [int], "response_ids": [int], "logprobs": [float]},
logprobs[i] being the engine's log-prob of response_ids[i] (after its temperature / top-k / top-p)."""


def read_external(path: str | Path, vocab_size: int | None = None) -> list[dict]:
    """Parse and validate an external log-prob file; errors name the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--external: no such file {str(path)!r}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with prompt_ids, response_ids and logprobs")
        for field in ("prompt_ids", "response_ids", "logprobs"):
            if field not in row:
                raise ValueError(f"{where}: missing field {field!r}")
            if not isinstance(row[field], list) or not row[field]:
                raise ValueError(f"{where}: field {field!r} must be a non-empty list")
        for field in ("prompt_ids", "response_ids"):
            bad = [
                x for x in row[field] if not isinstance(x, int) or x < 0 or (vocab_size and x >= vocab_size)
            ]
            if bad:
                raise ValueError(
                    f"{where}: field {field!r} holds {bad[0]!r}, not a token id in [0, {vocab_size})"
                )
        if len(row["logprobs"]) != len(row["response_ids"]):
            raise ValueError(
                f"{where}: field 'logprobs' has {len(row['logprobs'])} values for "
                f"{len(row['response_ids'])} response tokens"
            )
        for x in row["logprobs"]:
            if not isinstance(x, int | float) or not math.isfinite(x) or x > 1e-6:
                raise ValueError(f"{where}: field 'logprobs' holds {x!r}, not a finite log-probability <= 0")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


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


def main(argv: list[str]) -> int:
    from bitrl.integrations.external import maybe_run_external  # TRL / verl rollout dumps

    argv = list(argv)
    handled = maybe_run_external(argv)
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
        "--mx-scale-mode",
        default="rceil",
        choices=["rceil", "floor"],
        help="E8M0 block scales of mxfp8/mxfp4",
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


def run(args) -> int:
    from bitrl.engine.config import TaskConfig, load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build
    from bitrl.engine.models import load_pretrained
    from bitrl.engine.tasks import Problem
    from bitrl.engine.warmstart import warm_start
    from bitrl.rollout.engine import generate
    from bitrl.rollout.precision import PRECISIONS, make_rollout_model
    from bitrl.train.logprobs import token_logprobs
    from bitrl.train.mismatch import mismatch_diagnostics

    if args.rollout_precision not in PRECISIONS:
        raise ValueError(f"--rollout-precision must be one of {PRECISIONS}, got {args.rollout_precision!r}")
    torch.manual_seed(args.seed)
    if args.demo:
        cfg = load_config(None, [f"seed={args.seed}", f"model.dtype={args.trainer_dtype}"])
        policy, tokenizer, task = build(cfg)
        warm_start(policy, tokenizer, task, cfg, log=lambda msg: print(msg, file=sys.stderr))
        rng = random.Random(args.seed)
        prompts = [task.sample(rng).prompt for _ in range(args.num_prompts)]
        max_new = args.max_new_tokens or cfg.rollout.max_new_tokens
    else:
        policy, tokenizer = load_pretrained(args.model, args.trainer_dtype)
        prompts, max_new = None, args.max_new_tokens or 128
    policy.eval()
    if args.prompts:
        prompts = read_prompts(args.prompts)[: args.num_prompts]

    if args.external:
        rollout = rollout_from_rows(
            read_external(args.external, policy.config.vocab_size), tokenizer.pad_token_id
        )
        label = f"external: {Path(args.external).name}"
    else:
        if not prompts:
            raise ValueError("--model needs --prompts FILE (or --external FILE)")
        rollout_model = make_rollout_model(policy, args.rollout_precision, mx_scale_mode=args.mx_scale_mode)
        chat = TaskConfig(chat_template=args.chat_template, system_prompt=args.system_prompt)
        prompt_ids = encode_prompts(tokenizer, [Problem(str(i), p, "") for i, p in enumerate(prompts)], chat)
        rollout = generate(
            rollout_model,
            [ids for ids in prompt_ids for _ in range(args.samples_per_prompt)],
            max_new_tokens=max_new,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=torch.Generator().manual_seed(args.seed),
        )
        scales = f" ({args.mx_scale_mode} scales)" if args.rollout_precision.startswith("mx") else ""
        label = f"rollout {args.rollout_precision}{scales} vs trainer {args.trainer_dtype}"
    with torch.no_grad():
        train_lp, _ = token_logprobs(policy, rollout, args.temperature, with_entropy=False)
    mask = rollout.response_mask
    summary = {
        "comparison": label,
        "num_sequences": int(mask.shape[0]),
        "num_tokens": int(mask.sum()),
        **mismatch_diagnostics(train_lp, rollout.logprobs, mask),
        "k3_by_position": per_position(train_lp, rollout.logprobs, mask),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch.json").write_text(json.dumps(summary, indent=2))
    plot(train_lp[mask], rollout.logprobs[mask], summary["k3_by_position"], out / "mismatch.png", label)
    print(json.dumps({k: v for k, v in summary.items() if k != "k3_by_position"}, indent=2))
    print(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}")
    return 0
