"""The trainer's forward: per-token log-probs and entropies of a rollout's responses under the policy."""

from __future__ import annotations

import torch

from bitrl.rollout.engine import Rollout


def response_hidden_states(model, rollout: Rollout) -> torch.Tensor:
    """Hidden states that predict each response token: [B, R, H] in the model's dtype.

    Runs the base model (no LM head) over prompt + response, so the caller can project to the vocabulary
    in a fused op without building [B, R, V] logits for the prompt part.
    """
    ids, mask, pos = rollout.full_sequence()
    base = model.base_model
    hidden = base(input_ids=ids, attention_mask=mask.long(), position_ids=pos).last_hidden_state
    prompt_len = rollout.prompt_ids.shape[1]
    response_len = rollout.response_ids.shape[1]
    # Position t predicts token t+1: the response token j is predicted from position prompt_len - 1 + j.
    return hidden[:, prompt_len - 1 : prompt_len - 1 + response_len]


def token_logprobs(model, rollout: Rollout, temperature: float = 1.0, with_entropy: bool = True):
    """(logprobs [B, R] fp32, entropy [B, R] fp32 or None) of the response tokens at `temperature`.

    Masked positions hold finite values; callers weight them out with rollout.response_mask.
    """
    hidden = response_hidden_states(model, rollout)
    head = model.get_output_embeddings()
    logits = head(hidden).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logprobs, entropy
