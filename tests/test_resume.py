"""A run killed with SIGKILL and resumed reaches the same metrics at the same step as an uninterrupted run,
with and without speculative rollout reuse, with LoRA adapters (checkpoints hold only the adapters), and with
GPTQ-rounded 4-bit rollouts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_DEMO_MODEL

TIMING = {
    "tokens_per_s",
    "rollout_time_s",
    "step_time_s",
    "old_logprobs_time_s",
    "update_time_s",
    "sync_time_s",
    "reuse_verify_time_s",
    "reuse_rollout_time_s",
}
TINY = [
    *TINY_DEMO_MODEL,
    "task.n_eval=24",
    "warmstart.steps=30",
    "warmstart.target_accuracy=null",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "eval_every=5",
    "checkpoint_every=3",
    "threads=1",
]
PLAIN = [*TINY, "train.lr=1e-3", "steps=40"]
# With speculative reuse the rollout cache must travel in the checkpoint too.
REUSE = [
    *TINY,
    "rollout.fixed_prompts=8",
    "rollout.reuse.enabled=true",
    "rollout.reuse.mode=exact",
    "rollout.reuse.lenience=1.6487",
    "rollout.reuse.exact_topk=4",
    "rollout.reuse.refresh_flat=false",  # every reward is 0 here: refreshing would drop every draft
    "train.lr=3e-3",
    "train.loss.entropy_coef=0.05",  # moves the policy even while every reward is 0
    "steps=24",
]

# LoRA on a QeRL-style MXFP4 base, GPTQ-rounded, micro-batched, with gradient checkpointing: the base is
# rebuilt from the warm start (cached), its calibration drawn and rounded again on resume; the checkpoint
# holds the adapters and the optimizer.
LORA = [
    *TINY,
    "model.lora.rank=4",
    "model.lora.alpha=16",
    "model.lora.base_precision=mxfp4",
    "rollout.gptq=true",
    "rollout.gptq_prompts=8",
    "train.micro_batch_tokens=40",
    "train.gradient_checkpointing=true",
    "train.lr=1e-2",
    "train.loss.entropy_coef=0.05",
    "steps=12",
]

# GPTQ-rounded NVFP4 rollouts: the calibration sequences travel in the checkpoint, so the resumed copy is
# rounded on the same ones as the uninterrupted run's (a fresh draw would round it otherwise).
GPTQ = [
    *TINY,
    "rollout.precision=nvfp4",
    "rollout.gptq=true",
    "rollout.gptq_prompts=8",
    "train.loss.correction=tis",
    "train.lr=1e-3",
    "steps=12",
]


def _bitrl(args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "bitrl", "train", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _records(path):
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING}
        for line in path.read_text().splitlines()
    ]


def complete_records(metrics: Path) -> list[dict]:
    """The records of metrics.jsonl whose line is whole: a read can land in the middle of the run's write."""
    text = metrics.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.mark.parametrize("overrides", [PLAIN, REUSE, LORA, GPTQ], ids=["plain", "reuse", "lora", "gptq"])
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, overrides):
    steps = int(next(o for o in overrides if o.startswith("steps=")).split("=")[1])
    env = dict(os.environ, BITRL_CACHE=str(tmp_path / "cache"))
    full = _bitrl([*overrides, f"out_dir={tmp_path}", "name=full"], env)
    assert full.wait(timeout=300) == 0, full.stderr.read()

    victim = _bitrl([*overrides, f"out_dir={tmp_path}", "name=killed"], env)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    # Kill mid-run, between checkpoints: after step 8 was logged (checkpoints are at 3 and 6 by then).
    while time.time() < deadline:
        if metrics.exists() and any(record["step"] >= 8 for record in complete_records(metrics)):
            break
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(record["step"] for record in complete_records(metrics))
    assert killed_at < steps

    resumed = _bitrl(["--resume", str(tmp_path / "killed")], env)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    a, b = _records(tmp_path / "full" / "metrics.jsonl"), _records(metrics)
    assert [r["step"] for r in b] == list(range(0, steps + 1))  # no step lost, none duplicated
    assert a == b
    assert (tmp_path / "killed" / "report.png").stat().st_size > 0
    if overrides is LORA:
        import torch

        saved = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["policy"]
        assert saved and all("lora_" in name for name in saved)
        assert len({r["trainable_params"] for r in a[1:]}) == 1
        assert a[-1]["entropy"] != a[1]["entropy"]  # the adapters moved the policy
    if overrides is GPTQ:
        assert all(r["mismatch_k3_kl"] > 0 for r in a[1:])  # a rounded copy, not the policy itself
    if overrides is REUSE:
        later = [r for r in a if r["step"] > 2]  # from the second epoch on, every prompt has a draft
        assert all(r["reuse_hit_rate"] == 1.0 for r in later)
        assert all(r["reuse_tokens_returned"] >= r["reuse_tokens_generated"] for r in later)
        assert any(r["reuse_tokens_generated"] > 0 for r in later)  # the policy moves: some drafts rejected


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    from bitrl.engine.cli import main

    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A crash during torch.save leaves the previous checkpoint intact."""
    import torch

    from bitrl.train.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, {"step": 1})

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 2})
    assert load_checkpoint(tmp_path)["step"] == 1


def test_rng_state_round_trip_touches_no_other_gpu():
    """The checkpoint's random state: python, numpy, torch CPU, and on CUDA the current device's only."""
    import random

    import numpy as np
    import torch

    from bitrl.train.checkpoint import rng_state, set_rng_state

    state = rng_state()
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - GPU only
        assert isinstance(state["cuda"], torch.Tensor)  # one state, not one per GPU
        want += (float(torch.rand((), device="cuda")),)
    set_rng_state(state)
    got = (random.random(), float(np.random.rand()), float(torch.rand(())))
    if "cuda" in state:  # pragma: no cover - GPU only
        got += (float(torch.rand((), device="cuda")),)
    assert got == want
