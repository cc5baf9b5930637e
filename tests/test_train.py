import math

import pytest
import torch

from bitrl.train.advantages import ADVANTAGES, compute_advantages
from bitrl.train.losses import policy_loss
from bitrl.train.trainer import mismatch_metrics


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


def test_grpo_clip_loss_hand_example():
    # Two tokens of one sequence; ratio 1.5 with A>0 is clipped at 1.28, ratio 0.5 with A<0 clipped at 0.8.
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, False], [True, True]])
    loss, m = policy_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    # tokens: -min(1.5, 1.28) = -1.28 ; -min(-1.0, -1.6) = 1.6 ; -min(-2, -2) = 2
    assert math.isclose(loss.item(), (-1.28 + 1.6 + 2.0) / 3, rel_tol=1e-6)
    assert math.isclose(m["clip_frac"], 2 / 3, rel_tol=1e-6)
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * r / n = 2 / 3
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [0.0, 2 / 3]]))


def test_loss_increases_logprob_of_positive_advantage():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(
        lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)
    )
    loss.backward()
    assert (lp.grad[0] < 0).all() and (lp.grad[1] > 0).all()


def test_mismatch_metrics_hand_computation():
    train = torch.tensor([[math.log(0.5), math.log(0.2)]])
    roll = torch.tensor([[math.log(0.4), math.log(0.2)]])
    m = mismatch_metrics(train, roll, torch.tensor([[True, True]]))
    rho = 0.5 / 0.4
    assert math.isclose(m["mismatch_k3_kl"], (rho - 1 - math.log(rho)) / 2, rel_tol=1e-5)
    assert math.isclose(m["mismatch_k1_kl"], -math.log(rho) / 2, rel_tol=1e-5)
    assert mismatch_metrics(train, roll, torch.zeros(1, 2, dtype=torch.bool))["mismatch_k3_kl"] == 0.0
