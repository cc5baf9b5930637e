"""Rollout/trainer mismatch diagnostics on the same sampled tokens.

Inputs: train_logprobs and rollout_logprobs [B, T] (log pi_train(y_t) and log pi_rollout(y_t), both under
the same weights), mask [B, T] bool. With log rho_t = lp_train - lp_rollout, every statistic is over unmasked
tokens (token level) or over sequences with at least one token (sequence level):

  k1_kl          mean_t(lp_rollout - lp_train)                 estimates KL(rollout || train)
  k3_kl          mean_t(rho - 1 - log rho)                      non-negative, low-variance KL estimate
  chi2_token     mean_t(rho^2) - 1
  chi2_seq       mean_s(rho_seq^2) - 1, rho_seq = exp(sum_t log rho_t)
  ess            1 / mean_t(w^2) with w = rho / mean_t(rho): effective sample size as a fraction of tokens
  log_ppl_diff   mean_s(log ppl_train(s) - log ppl_rollout(s)), log ppl(s) = -mean_t lp(y_t)
  ppl_ratio      exp(log_ppl_diff)
  exp_abs_dlogp  mean_t exp(|log rho_t|)                        1 when identical
  max_abs_dp     max_t |pi_train(y_t) - pi_rollout(y_t)|
All are returned as python floats with the prefix `mismatch_`.
"""

from __future__ import annotations

import torch

# exp(2 * 40) is still finite in fp64 but shows a sequence ratio is meaningless beyond it.
_MAX_SEQ_LOG_RATIO = 40.0


def mismatch_diagnostics(train_logprobs, rollout_logprobs, mask) -> dict[str, float]:
    m = mask.bool()
    lt, lr = train_logprobs.double(), rollout_logprobs.double()
    if lt.shape != lr.shape or lt.shape != m.shape:
        raise ValueError(
            f"shapes differ: train {tuple(lt.shape)}, rollout {tuple(lr.shape)}, mask {tuple(m.shape)}"
        )
    names = (
        "k1_kl",
        "k3_kl",
        "chi2_token",
        "chi2_seq",
        "ess",
        "log_ppl_diff",
        "ppl_ratio",
        "exp_abs_dlogp",
        "max_abs_dp",
    )
    if not m.any():
        return {f"mismatch_{k}": (1.0 if k in ("ess", "ppl_ratio", "exp_abs_dlogp") else 0.0) for k in names}
    log_rho = (lt - lr).masked_fill(~m, 0.0)
    tok = log_rho[m]
    rho = tok.exp()
    w = rho / rho.mean()
    has = m.any(-1)
    n_tok = m.sum(-1).clamp(min=1)
    seq_log_rho = log_rho.sum(-1)[has].clamp(max=_MAX_SEQ_LOG_RATIO)
    log_ppl_train = -(lt.masked_fill(~m, 0.0).sum(-1) / n_tok)[has]
    log_ppl_rollout = -(lr.masked_fill(~m, 0.0).sum(-1) / n_tok)[has]
    log_ppl_diff = (log_ppl_train - log_ppl_rollout).mean()
    out = {
        "k1_kl": (-tok).mean(),
        "k3_kl": (torch.expm1(tok) - tok).mean(),
        "chi2_token": (rho**2).mean() - 1,
        "chi2_seq": (2 * seq_log_rho).exp().mean() - 1,
        "ess": 1 / (w**2).mean(),
        "log_ppl_diff": log_ppl_diff,
        "ppl_ratio": log_ppl_diff.exp(),
        "exp_abs_dlogp": tok.abs().exp().mean(),
        "max_abs_dp": (lt[m].exp() - lr[m].exp()).abs().max(),
    }
    return {f"mismatch_{k}": float(v) for k, v in out.items()}
