"""Rejection-by-divergence and adaptive-IS corrections against closed-form values on crafted inputs."""

import math

import pytest
import torch

from bitrl.kernels import CORRECTIONS, policy_loss
from bitrl.kernels.policy_loss import LossConfig, ais_coefficients


def _keep(name, log_rho, mask, **cfg):
    return CORRECTIONS[name](log_rho, mask, LossConfig(**cfg)).keep


def test_token_rejection_by_each_divergence():
    rho = torch.tensor([[1.0, 1.9, 2.1, 0.45]])
    log_rho, mask = rho.log(), torch.ones(1, 4, dtype=torch.bool)
    # default thresholds: each divergence at rho = 2; k1 and k2 are symmetric in log rho, so 0.45 fails
    assert _keep("reject-k1-token", log_rho, mask).tolist() == [[True, True, False, False]]
    assert _keep("reject-k2-token", log_rho, mask).tolist() == [[True, True, False, False]]
    # k3 = rho - 1 - log rho is asymmetric: at rho = 0.45 it is 0.249 < 0.307, so that token stays
    assert _keep("reject-k3-token", log_rho, mask).tolist() == [[True, True, False, True]]
    # k3(1.9) = 0.258 and k3(0.45) = 0.249 both exceed 0.24
    keep = _keep("reject-k3-token", log_rho, mask, reject_threshold=0.24)
    assert keep.tolist() == [[True, False, False, False]]


def test_sequence_rejection_sum_mean_max():
    # sequence 0: log rho = [0.3, 0.3, 0.3]; sequence 1: [0.0, 0.0, 0.9] with its last token masked
    log_rho = torch.tensor([[0.3, 0.3, 0.3], [0.0, 0.0, 0.9]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    k2 = lambda x: 0.5 * x * x
    # seq-sum of k1 = |-0.9| > log 2 drops sequence 0; sequence 1 sums to 0 (its 0.9 is masked)
    assert _keep("reject-k1-seq-sum", log_rho, mask)[:, 0].tolist() == [False, True]
    # seq-mean of k1 = 0.3 < log 2 keeps both
    assert _keep("reject-k1-seq-mean", log_rho, mask)[:, 0].tolist() == [True, True]
    # seq-max of k2 with threshold between k2(0.3) and k2(0.9): nothing exceeds it among unmasked tokens
    keep = _keep("reject-k2-seq-max", log_rho, mask, reject_threshold=(k2(0.3) + k2(0.9)) / 2)
    assert keep[:, 0].tolist() == [True, True]
    keep = _keep("reject-k2-seq-max", log_rho, mask, reject_threshold=k2(0.3) / 2)
    assert keep.tolist() == [[False] * 3, [True] * 3]


def test_presets_carry_the_usual_defaults():
    # Preset names are the registered corrections with the papers' defaults (DESIGN.md).
    assert CORRECTIONS["tis"] is CORRECTIONS["tis-token"]
    assert CORRECTIONS["seq-tis"] is CORRECTIONS["tis-seq"]
    assert CORRECTIONS["token-mis"] is CORRECTIONS["mask-token"]
    assert CORRECTIONS["seq-mis"] is CORRECTIONS["mask-seq"]
    assert CORRECTIONS["geo-mis"] is CORRECTIONS["mask-geo"]
    mask = torch.ones(1, 2, dtype=torch.bool)
    # TIS caps rho at 2
    weight = CORRECTIONS["tis"](torch.tensor([[math.log(3.0), math.log(0.5)]]), mask, LossConfig()).weight
    assert torch.allclose(weight, torch.tensor([[2.0, 0.5]]))
    # sequence MIS keeps products of rho in [0.5, 2]: 1.3 * 1.5 = 1.95 stays, 1.5 * 1.5 = 2.25 goes
    log_rho = torch.tensor([[1.3, 1.5], [1.5, 1.5]]).log()
    assert _keep("seq-mis", log_rho, mask.expand(2, 2))[:, 0].tolist() == [True, False]
    # geometric MIS keeps geometric means in [0.999, 1.001]
    log_rho = torch.tensor([[0.0005, -0.0005], [0.002, 0.0]])
    assert _keep("geo-mis", log_rho, mask.expand(2, 2))[:, 0].tolist() == [True, False]
    # IcePop weights rho inside [0.5, 5] and zeroes the rest
    rho = torch.tensor([[0.4, 4.9]])
    weight = CORRECTIONS["icepop"](rho.log(), mask, LossConfig()).weight
    assert torch.allclose(weight, torch.tensor([[0.0, 4.9]]))


def test_ais_identical_policies_need_no_correction():
    log_rho, mask = torch.zeros(3, 5), torch.ones(3, 5, dtype=torch.bool)
    coef = ais_coefficients(log_rho, mask, LossConfig())
    assert coef["lambda"] == 0 and coef["severity"] == 0 and coef["reliability"] == 1
    result = CORRECTIONS["ais"](log_rho, mask, LossConfig())
    assert torch.equal(result.weight, torch.ones(3, 5)) and result.keep is None


def test_ais_wild_ratios_get_full_correction_and_masking():
    log_rho = torch.tensor([[3.0, -3.0, 0.1, 0.0], [2.0, -2.5, 0.0, 0.2]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    coef = ais_coefficients(log_rho, mask, LossConfig())
    assert coef["lambda"] == 1 and coef["reliability"] < 0.5
    result = CORRECTIONS["ais"](log_rho, mask, LossConfig())
    torch.testing.assert_close(result.weight, log_rho.exp().clamp(max=2.0))  # full truncated IS
    rho = log_rho.exp()
    assert torch.equal(result.keep, (rho >= 0.5) & (rho <= 2.0))  # unreliable weights: extremes masked


def test_ais_lambda_closed_form_for_a_mild_mismatch():
    log_rho = torch.tensor([[0.05, -0.05, 0.1, -0.1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    rho = [math.exp(x) for x in log_rho[0].tolist()]
    kl3 = sum(r - 1 - math.log(r) for r in rho) / 4
    severity = 1 - math.exp(-kl3 / 0.01)
    reliability = (sum(rho) / 4) ** 2 / (sum(r * r for r in rho) / 4)
    amplification = (sum(r * r for r in rho) / 4) / (sum(rho) / 4) ** 2 - 1  # no ratio reaches the cap
    lam = severity * (1 + amplification) / (1 + amplification * reliability)
    coef = ais_coefficients(log_rho, mask, LossConfig())
    assert math.isclose(float(coef["lambda"]), lam, rel_tol=1e-4)
    weight = CORRECTIONS["ais"](log_rho, mask, LossConfig()).weight
    torch.testing.assert_close(weight, (1 - lam) + lam * log_rho.exp(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["ais", "reject-k3-token", "reject-k2-seq-mean", "reject-k1-seq-max"])
def test_new_corrections_agree_across_implementations(name):
    torch.manual_seed(0)
    lp = torch.randn(4, 6) * 0.1 - 1
    roll = lp + torch.randn(4, 6) * 0.5
    adv, mask = torch.randn(4), torch.rand(4, 6) > 0.2
    losses = [
        policy_loss(
            lp.clone().requires_grad_(),
            lp,
            adv,
            mask,
            LossConfig(correction=name),
            rollout_logprobs=roll,
            impl=impl,
        )[0]
        for impl in ("torch", "reference")
    ]
    torch.testing.assert_close(losses[0], losses[1])
