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

* bitrl's plain format, for any other engine: one JSON object per line, ``{"prompt_ids": [int],
  "response_ids": [int], "logprobs": [float]}`` (``read_external``), rescored by ``bitrl mismatch --model``.

Only readers live here (integrations depend on kernels and train only); ``bitrl mismatch``
(``engine/mismatch_cmd.py``) turns what they return into its report.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["read_jsonl", "read_external", "read_external_dump"]


def _pad(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return values, mask


def read_jsonl(path: str | Path) -> Iterator[tuple[str, object]]:
    """(``"FILE:LINE"``, parsed object) for each non-blank line; a line that is not JSON raises ``ValueError``
    naming it."""
    path = Path(path)
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None


def read_external(path: str | Path, vocab_size: int | None = None) -> list[dict]:
    """Parse and validate bitrl's plain external log-prob file; errors name the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--external: no such file {str(path)!r}")
    rows = []
    for where, row in read_jsonl(path):
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


def _read_trl_jsonl(path: Path) -> dict:
    train, rollout = [], []
    for where, row in read_jsonl(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with old_logprobs and rollout_logprobs")
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
