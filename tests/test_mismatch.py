import math

import pytest
import torch

from bitrl.train.mismatch import mismatch_diagnostics


def test_every_diagnostic_against_a_hand_computation():
    # Two sequences: [0.5 vs 0.4, 0.2 vs 0.2] and [0.9 vs 0.6, (masked)].
    p_train = [[0.5, 0.2], [0.9, 0.3]]
    p_roll = [[0.4, 0.2], [0.6, 0.7]]
    mask = torch.tensor([[True, True], [True, False]])
    d = mismatch_diagnostics(torch.tensor(p_train).log(), torch.tensor(p_roll).log(), mask)
    rho = [0.5 / 0.4, 1.0, 0.9 / 0.6]
    lr = [math.log(r) for r in rho]
    mean = lambda xs: sum(xs) / len(xs)
    expected = {
        "k1_kl": mean([-x for x in lr]),
        "k3_kl": mean([r - 1 - x for r, x in zip(rho, lr)]),
        "chi2_token": mean([r * r for r in rho]) - 1,
        "chi2_seq": mean([(rho[0] * rho[1]) ** 2, rho[2] ** 2]) - 1,
        "ess": 1 / mean([(r / mean(rho)) ** 2 for r in rho]),
        "exp_abs_dlogp": mean([math.exp(abs(x)) for x in lr]),
        "max_abs_dp": 0.3,
    }
    # log ppl per sequence: -mean log p over its tokens
    lpt = [-(math.log(0.5) + math.log(0.2)) / 2, -math.log(0.9)]
    lpr = [-(math.log(0.4) + math.log(0.2)) / 2, -math.log(0.6)]
    expected["log_ppl_diff"] = mean([a - b for a, b in zip(lpt, lpr)])
    expected["ppl_ratio"] = math.exp(expected["log_ppl_diff"])
    for key, value in expected.items():
        assert math.isclose(d[f"mismatch_{key}"], value, rel_tol=1e-5, abs_tol=1e-6), key


def test_identical_policies_have_no_mismatch():
    lp = torch.randn(4, 7).clamp(max=-0.01)
    d = mismatch_diagnostics(lp, lp.clone(), torch.ones(4, 7, dtype=torch.bool))
    for key in ("k1_kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "max_abs_dp"):
        assert abs(d[f"mismatch_{key}"]) < 1e-6, key
    for key in ("ess", "ppl_ratio", "exp_abs_dlogp"):
        assert math.isclose(d[f"mismatch_{key}"], 1.0, rel_tol=1e-6), key


def test_empty_mask_and_bad_shapes():
    d = mismatch_diagnostics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert d["mismatch_k3_kl"] == 0.0 and d["mismatch_ess"] == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_diagnostics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


def test_huge_sequence_ratio_stays_finite():
    lt = torch.zeros(1, 200)
    lr = torch.full((1, 200), -5.0)
    d = mismatch_diagnostics(lt, lr, torch.ones(1, 200, dtype=torch.bool))
    assert all(math.isfinite(v) for v in d.values())
