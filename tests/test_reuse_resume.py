"""With speculative reuse enabled, a run killed with SIGKILL and resumed reaches the same metrics as an
uninterrupted run: the rollout cache travels in the checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

TIMING = {"tokens_per_s", "rollout_time_s", "step_time_s", "reuse_verify_time_s", "reuse_rollout_time_s"}
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "task.n_eval=24",
    "warmstart.steps=30",
    "warmstart.target_accuracy=null",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.fixed_prompts=8",
    "rollout.reuse.enabled=true",
    "rollout.reuse.mode=exact",
    "rollout.reuse.lenience=1.6487",
    "rollout.reuse.exact_topk=4",
    "train.lr=3e-3",
    "train.entropy_coef=0.05",  # moves the policy even while every reward is 0
    "steps=24",
    "eval_every=6",
    "checkpoint_every=3",
    "threads=1",
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


def test_sigkill_then_resume_with_reuse_matches_uninterrupted_run(tmp_path):
    env = dict(os.environ, BITRL_CACHE=str(tmp_path / "cache"))
    full = _bitrl([*TINY, f"out_dir={tmp_path}", "name=full"], env)
    assert full.wait(timeout=300) == 0, full.stderr.read()

    victim = _bitrl([*TINY, f"out_dir={tmp_path}", "name=killed"], env)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:  # kill between checkpoints, after step 8 (checkpoints at 3 and 6)
        if metrics.exists() and any(
            json.loads(line)["step"] >= 8 for line in metrics.read_text().splitlines()
        ):
            break
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"

    resumed = _bitrl(["--resume", str(tmp_path / "killed")], env)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    a, b = _records(tmp_path / "full" / "metrics.jsonl"), _records(metrics)
    assert [r["step"] for r in b] == list(range(0, 25))
    assert a == b
    later = [r for r in a if r["step"] > 2]  # from the second epoch on, every prompt has a draft
    assert all(r["reuse_hit_rate"] == 1.0 for r in later)
    assert all(r["reuse_tokens_returned"] >= r["reuse_tokens_generated"] for r in later)
    assert any(r["reuse_tokens_generated"] > 0 for r in later)  # the policy moves: some drafts are rejected
