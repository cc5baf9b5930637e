"""Readers for the rollout dumps other trainers write, feeding ``bitrl mismatch --external FILE``.

Formats (detected from the content):

* TRL, through ``use_bitrl(trainer, dump_dir=DIR)``: ``DIR/rollout_logprobs.jsonl``, one JSON object per
  sequence ``{"step", "old_logprobs": [...], "rollout_logprobs": [...]}`` (plus TRL's token-level
  ``importance_sampling_ratio`` when it computed one):
  the trainer's log-probs under the rollout weights and vLLM's sampling log-probs, i.e. the two sides of the
  importance-sampling ratio TRL computes. (TRL itself logs only batch aggregates of that ratio.)
* verl: the rollout batch verl dumps with ``skip.rollout`` (``.../<step>/gen_batch.dp``, a pickled
  ``DataProto``; unpickling needs verl installed and runs code from the file, so read only your own dumps).
  It holds the rollout engine's ``rollout_log_probs`` with ``prompts``/``responses``; where ``old_log_probs``
  is present too (a batch dumped after the trainer's forward) it is used directly, otherwise the tokens are
  rescored by ``--model DIR`` through bitrl mismatch's usual ``--external`` path.

``maybe_run_external(argv)`` is the hook ``bitrl mismatch`` calls first: it handles a dump that already holds
both sides (no model needed), converts a verl dump to the plain external format when ``--model`` is given,
and otherwise leaves the arguments alone.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["read_external_dump", "maybe_run_external", "mismatch_report"]


def _pad(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return values, mask


def _read_trl_jsonl(path: Path) -> dict:
    train, rollout = [], []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        for field in ("old_logprobs", "rollout_logprobs"):
            if not isinstance(row.get(field), list):
                raise ValueError(f"{where}: missing list field {field!r}")
        if len(row["old_logprobs"]) != len(row["rollout_logprobs"]):
            raise ValueError(f"{where}: old_logprobs and rollout_logprobs differ in length")
        if not row["old_logprobs"]:
            continue
        # vLLM leaves NaN where it could not score a token; TRL gives those tokens ratio 1: so do we
        pairs = [
            (o, r if isinstance(r, int | float) and math.isfinite(r) else o)
            for o, r in zip(row["old_logprobs"], row["rollout_logprobs"])
        ]
        train.append([o for o, _ in pairs])
        rollout.append([r for _, r in pairs])
    if not train:
        raise ValueError(f"{path}: no sequences with tokens")
    train_lp, mask = _pad(train)
    rollout_lp, _ = _pad(rollout)
    return {"source": "trl", "train_logprobs": train_lp, "rollout_logprobs": rollout_lp, "mask": mask}


def _read_verl_dataproto(path: Path) -> dict:
    try:
        import verl  # noqa: F401  (the pickle refers to verl's DataProto)
    except ImportError:
        raise ValueError(
            f"{path}: a verl rollout dump; reading it needs verl installed (make .venv-oldest/.installed)"
        ) from None
    with open(path, "rb") as f:
        data = pickle.load(f)
    batch = getattr(data, "batch", None)
    keys = set(batch.keys()) if batch is not None else set()  # TensorDict has no `in`
    if "rollout_log_probs" not in keys:
        raise ValueError(
            f"{path}: no 'rollout_log_probs' in the batch (verl's rollout must return log-probs)"
        )
    responses = batch["responses"]
    R = responses.shape[1]
    if "response_mask" in keys:
        mask = batch["response_mask"].bool()
    else:
        mask = batch["attention_mask"][:, -R:].bool()
    prompts = batch["prompts"]
    prompt_mask = batch["attention_mask"][:, : prompts.shape[1]].bool()
    out = {
        "source": "verl",
        "rollout_logprobs": batch["rollout_log_probs"].double(),
        "mask": mask,
        "prompt_ids": [p[m].tolist() for p, m in zip(prompts, prompt_mask)],
        "response_ids": [r[m].tolist() for r, m in zip(responses, mask)],
    }
    if "old_log_probs" in keys:
        out["train_logprobs"] = batch["old_log_probs"].double()
    return out


def read_external_dump(path: str | Path) -> dict | None:
    """Read a trainer's rollout dump: dict with rollout_logprobs [B, T], mask [B, T], and train_logprobs
    [B, T] when the dump holds the trainer's side too. ``None`` if the file is bitrl's plain external
    format (``prompt_ids`` / ``response_ids`` / ``logprobs`` lines) that ``bitrl mismatch --model`` reads."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--external: no such file {str(path)!r}")
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # pickle protocol 2+
        return _read_verl_dataproto(path)
    first = next((line for line in path.read_text().splitlines() if line.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        raise ValueError(f"{path}: neither a JSON-lines rollout dump nor a verl DataProto dump") from None
    if isinstance(row, dict) and "old_logprobs" in row:
        return _read_trl_jsonl(path)
    return None


def mismatch_report(dump: dict) -> dict:
    """bitrl's mismatch diagnostics (``bitrl.train.mismatch``) and the k3 divergence by position."""
    from bitrl.engine.mismatch_cmd import per_position
    from bitrl.train.mismatch import mismatch_diagnostics

    train, rollout, mask = dump["train_logprobs"], dump["rollout_logprobs"], dump["mask"]
    return {
        "comparison": f"{dump['source']} dump: trainer vs rollout log-probs",
        "num_sequences": int(mask.shape[0]),
        "num_tokens": int(mask.sum()),
        **mismatch_diagnostics(train, rollout, mask),
        "k3_by_position": per_position(train, rollout, mask),
    }


def maybe_run_external(argv: list[str]) -> int | None:
    """The ``bitrl mismatch`` hook: an exit code when the dump was handled here, else ``None``."""
    if "--external" not in argv:
        return None
    parser = argparse.ArgumentParser(prog="bitrl mismatch", add_help=False)
    parser.add_argument("--external")
    parser.add_argument("--model")
    parser.add_argument("--demo", action="store_true")
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
        summary = mismatch_report(dump)
    except ValueError as e:
        print(f"bitrl mismatch: {e}", file=sys.stderr)
        return 2
    from bitrl.engine.mismatch_cmd import plot

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch.json").write_text(json.dumps(summary, indent=2))
    m = dump["mask"]
    plot(
        dump["train_logprobs"][m],
        dump["rollout_logprobs"][m],
        summary["k3_by_position"],
        out / "mismatch.png",
        summary["comparison"],
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "k3_by_position"}, indent=2))
    print(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}")
    return 0
