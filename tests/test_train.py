import math

import pytest
import torch
from conftest import TRAIN_CFG, assert_same_adam_update

from bitrl.train.advantages import ADVANTAGES, compute_advantages


def test_grpo_advantage_matches_hand_computation():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    a = compute_advantages("grpo", r)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert (a[1] == 0).all()  # a group with one outcome carries no signal


def test_other_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(compute_advantages("dr_grpo", r), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    # RLOO: r_i minus the mean of the others.
    torch.testing.assert_close(compute_advantages("rloo", r), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGES)
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("nope", r)
    with pytest.raises(ValueError, match="n_groups, G"):
        compute_advantages("grpo", r[0])


@pytest.mark.parametrize("autocast", ["none", "bf16", "fp16"])
def test_trainer_step_moves_probability_toward_positive_advantages(tiny_qwen, autocast):
    """One PolicyTrainer update raises the log-likelihood of rewarded responses relative to the others."""
    from bitrl.engine.config import TrainConfig
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling
    from bitrl.train.logprobs import token_logprobs
    from bitrl.train.trainer import PolicyTrainer

    cfg = TrainConfig(**TRAIN_CFG | {"minibatches": 2, "autocast": autocast})
    rollout = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=5, eos_id=2, pad_id=0)).generate(
        [[1, 5, 6]] * 8, generator=torch.Generator().manual_seed(0)
    )
    advantages = torch.tensor([1.0, -1.0] * 4)
    trainer = PolicyTrainer(tiny_qwen, cfg)
    with torch.no_grad():
        before = (token_logprobs(tiny_qwen, rollout)[0] * rollout.response_mask).sum(-1)
    metrics = trainer.step(rollout, advantages)
    with torch.no_grad():
        after = (token_logprobs(tiny_qwen, rollout)[0] * rollout.response_mask).sum(-1)
    delta = after - before
    assert delta[advantages > 0].mean() > delta[advantages < 0].mean() + 0.1
    for key in ("loss", "entropy", "grad_norm", "clipfrac", "mismatch_k3_kl"):
        assert key in metrics and math.isfinite(metrics[key])
    if autocast == "none":
        assert metrics["mismatch_k3_kl"] < 1e-8  # rollout and trainer share weights and precision
    else:
        assert 0 < metrics["mismatch_k3_kl"] < 1e-2  # a half-precision trainer forward vs an fp32 rollout
    if autocast == "fp16":
        assert trainer.scaler.get_scale() > 0


def test_autocast_auto_is_bf16_on_gpu_and_off_on_cpu(tiny_qwen):
    from bitrl.engine.config import load_config
    from bitrl.train.trainer import PolicyTrainer

    cfg = load_config().train
    assert cfg.autocast == "auto"
    trainer = PolicyTrainer(tiny_qwen, cfg)  # tiny_qwen lives on the CPU
    assert trainer.autocast == "none" and not trainer.scaler.is_enabled()


@pytest.mark.parametrize("autocast", ["none", "bf16"])
def test_the_loss_memory_budget_reaches_the_fused_ops_and_keeps_the_update(tiny_qwen, autocast, monkeypatch):
    """train.loss_memory_budget (0: the two-pass tiles) and auto with what a plan spares (the 3-product form)
    reach fused_linear_policy_loss and give the same update."""
    import copy

    from bitrl.engine.config import TrainConfig
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling
    from bitrl.train import trainer as trainer_mod

    rollout = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=5, eos_id=2, pad_id=0)).generate(
        [[1, 5, 6]] * 4, generator=torch.Generator().manual_seed(0)
    )
    advantages = torch.tensor([1.0, -1.0] * 2)
    seen = []
    fused = trainer_mod.fused_linear_policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["memory_budget"])
        return fused(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "fused_linear_policy_loss", spy)
    weights = []
    for budget, spare in ((0, 2**30), ("auto", 2**30)):
        cfg = TrainConfig(
            **TRAIN_CFG | {"autocast": autocast, "updates_per_batch": 1, "loss_memory_budget": budget}
        )
        policy = copy.deepcopy(tiny_qwen)
        trainer_mod.PolicyTrainer(policy, cfg, spare_bytes=spare).step(rollout, advantages)
        weights.append(torch.cat([p.detach().reshape(-1) for p in policy.parameters()]))
    assert seen == [0, 2**30]
    assert_same_adam_update(weights[0], weights[1], TRAIN_CFG["lr"], what=f"autocast {autocast}")
