"""A short RL run of the demo (two-digit addition) that must improve held-out accuracy."""

import json


def test_short_demo_run_improves_heldout_accuracy(tmp_path, monkeypatch):
    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    # train.autocast=none: "auto" means bf16 on a GPU, and a bf16 trainer against the full-precision rollout
    # copy is a real mismatch (test_autocast_trainer_against_full_precision_rollout_is_a_mismatch)
    args = ["train", "name=e2e", "task.n_eval=200", "steps=60", "eval_every=30", "checkpoint_every=60"]
    assert main([*args, "train.autocast=none"]) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/e2e/metrics.jsonl").read_text().splitlines()]
    evals = [r["accuracy"] for r in records if "accuracy" in r]
    assert 0.05 <= evals[0] <= 0.45, f"the warm start should be only modestly accurate: {evals}"
    assert evals[-1] >= evals[0] + 0.12, evals
    assert all(r["mismatch_k3_kl"] < 1e-6 for r in records[1:])  # full-precision rollouts: no mismatch
    assert (tmp_path / "runs/e2e/report.png").stat().st_size > 0


def test_autocast_trainer_against_full_precision_rollout_is_a_mismatch(tmp_path, monkeypatch):
    """What ``train.autocast=auto`` does on a GPU (bf16), run on CPU: the trainer's bf16 log-probs differ
    from the fp32 rollout copy's, so "full-precision rollouts: no mismatch" holds only with autocast off
    (which the demo test above now pins)."""
    from conftest import TINY_DEMO_MODEL

    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    kl = {}
    for autocast in ("none", "bf16"):
        args = [
            "train",
            f"name={autocast}",
            "task.n_eval=8",
            "steps=1",
            "eval_every=100",
            "checkpoint_every=100",
            "warmstart.steps=0",
            "rollout.prompts_per_step=8",
        ]
        assert main([*args, *TINY_DEMO_MODEL, f"train.autocast={autocast}"]) == 0
        lines = (tmp_path / f"runs/{autocast}/metrics.jsonl").read_text().splitlines()
        kl[autocast] = max(json.loads(line).get("mismatch_k3_kl", 0.0) for line in lines)
    # On this untrained one-layer model the bf16 gap is small in absolute terms (~1e-8 k3), but it is a
    # gap: orders of magnitude above the fp32 trainer's rounding noise, and it grows with the logits' scale.
    assert kl["none"] < 1e-12 and kl["bf16"] > 1e3 * kl["none"], kl


def test_mxfp4_rollouts_with_icepop_stay_finite_and_learn(tmp_path, monkeypatch):
    """4-bit rollouts put a real mismatch between sampler and trainer; IcePop keeps training finite and
    learning."""
    import math

    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["train", "name=mx", "task.n_eval=200", "steps=40", "eval_every=20", "checkpoint_every=40"]
    # round-to-nearest weights: GPTQ (the default) leaves too little mismatch here to test IcePop against
    args += ["rollout.precision=mxfp4", "rollout.gptq=false", "train.loss.correction=icepop"]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/mx/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    evals = [r["accuracy"] for r in records if "accuracy" in r]
    assert evals[-1] >= evals[0] + 0.1, evals
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
    assert min(r["mismatch_k3_kl"] for r in steps) > 1e-3  # a real mismatch, every step


def test_short_run_on_cuda(tmp_path, monkeypatch):
    """The loop on a GPU: rollout, fused loss, checkpoint and resume all on the CUDA device."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the loop's GPU path)")
    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "name=gpu",
        "device=cuda",
        "task.n_eval=100",
        "steps=4",
        "eval_every=2",
        "warmstart.steps=0",
    ]
    assert main([*args, "checkpoint_every=2", "rollout.precision=mxfp4", "train.loss.correction=tis"]) == 0
    assert main(["train", "--resume", "runs/gpu", "steps=6"]) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/gpu/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(7))


def test_qerl_noise_on_the_policy_too_leaves_no_mismatch(tmp_path, monkeypatch):
    """QeRL's form of AQN: a LoRA run on an NVFP4 base shared by trainer and rollout, with the step's noise
    on the policy's frozen norms as well as the rollout copy's, scores the very model that sampled; noise on
    the rollout copy alone is a mismatch the trainer sees."""
    from conftest import TINY_DEMO_MODEL

    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    kl = {}
    for target in ("policy", "rollout"):
        args = ["train", f"name={target}", "task.n_eval=8", "steps=3", "eval_every=100"]
        args += ["checkpoint_every=100"]
        args += ["warmstart.steps=0", "rollout.prompts_per_step=8", "train.autocast=none"]
        args += ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.base_precision=nvfp4"]
        args += ["rollout.aqn_stages=3", f"rollout.aqn_target={target}"]
        assert main([*args, *TINY_DEMO_MODEL]) == 0
        lines = (tmp_path / f"runs/{target}/metrics.jsonl").read_text().splitlines()
        kl[target] = [r["mismatch_k3_kl"] for r in map(json.loads, lines) if r.get("aqn_sigma")]
    assert len(kl["policy"]) == 2  # steps 2 and 3 carry noise (sigma 1e-2, 1e-4)
    assert max(kl["policy"]) < 1e-9 and kl["rollout"][0] > 1e3 * max(max(kl["policy"]), 1e-12), kl
