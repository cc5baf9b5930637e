"""`bitrl export RUN --out DIR`: a Hugging Face directory, LoRA merged, that AutoModelForCausalLM loads
and that computes what the trained policy computes."""

import pytest
import torch
from conftest import TINY_DEMO_MODEL

from bitrl.engine.cli import main
from bitrl.engine.config import load_config

RUN = [
    *TINY_DEMO_MODEL,
    "task.n_eval=8",
    "warmstart.steps=20",
    "warmstart.target_accuracy=null",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "train.lr=1e-2",
    "train.loss.entropy_coef=0.1",
    "steps=2",
    "threads=1",
]


def trained_policy(cfg):
    """The run's policy as training left it (adapters unmerged), rebuilt from its checkpoint."""
    from bitrl.engine.loop import build, prepare_policy
    from bitrl.engine.warmstart import warm_start
    from bitrl.train.checkpoint import load_checkpoint, load_policy_state

    policy, tokenizer, task = build(cfg)
    warm_start(policy, tokenizer, task, cfg, log=lambda *_: None)
    policy = prepare_policy(policy, cfg)
    for p in policy.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    load_policy_state(policy, load_checkpoint(cfg.run_dir)["policy"])
    return policy.eval(), tokenizer


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model.lora.rank=4", "model.lora.alpha=16"],
        ["model.lora.rank=4", "model.lora.base_precision=nvfp4"],
    ],
    ids=["full", "lora", "lora-nvfp4-base"],
)
def test_export_round_trips(tmp_path, extra):
    from transformers import AutoModelForCausalLM

    from bitrl.engine.loop import run
    from bitrl.engine.tasks import CharTokenizer

    overrides = [*RUN, *extra, f"out_dir={tmp_path}", "name=run"]
    cfg = load_config(overrides=overrides)
    run(cfg, log=lambda *_: None)
    out = tmp_path / "exported"
    assert main(["export", str(cfg.run_dir), "--out", str(out)]) == 0

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name in exported.state_dict())
    policy, _ = trained_policy(cfg)
    tokenizer = CharTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("12+34=46", add_special_tokens=True)])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, policy(ids).logits, rtol=0, atol=1e-4)
    if extra:  # the adapters were trained (B starts at 0): the merge has something to merge
        assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)


def test_export_of_a_missing_run_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
