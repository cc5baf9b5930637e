"""The trainer's forward: per-token log-probs and entropies of a rollout's responses under the policy.

The base model runs over prompt + response; the LM head is applied inside `bitrl.kernels.fused_logprobs`,
which never builds the [tokens, vocab] logits. In the matched-precision mode (rollout.aligned) the model runs
as the rollout decoder runs it, every op batch-invariant (bitrl.kernels.aligned), so each token's log-prob
has the bits the rollout recorded for it.
"""

from __future__ import annotations

import torch

from bitrl.kernels import fused_logprobs
from bitrl.kernels.aligned import aligned_token_logprobs
from bitrl.rollout.batch import Rollout
from bitrl.rollout.decoder import Decoder, linear_weights


def response_hidden_states(model, rollout: Rollout) -> torch.Tensor:
    """Hidden states that predict each response token: [B, R, H] in the model's dtype."""
    ids, mask, pos = rollout.full_sequence()
    hidden = model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).last_hidden_state
    prompt_len, response_len = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    # Position t predicts token t+1: response token j is predicted from position prompt_len - 1 + j.
    return hidden[:, prompt_len - 1 : prompt_len - 1 + response_len]


def lm_head_operands(hidden: torch.Tensor, head):
    """(hidden, weight, bias) of the LM head's product, all in one dtype: bf16 where bf16 autocast is on (as
    F.linear would run under it: bf16 products with fp32 accumulation, not fp32 products of fp32 master
    weights), else hidden's. fp16 autocast keeps hidden's dtype: the fused loss returns the weight gradient
    in its operand's dtype, and fp16 loss scaling would overflow an fp16 one."""
    device = hidden.device.type
    bf16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else hidden.dtype
    bias = getattr(head, "bias", None)
    return hidden.to(dtype), head.weight.to(dtype), None if bias is None else bias.to(dtype)


def token_logprobs(
    model,
    rollout: Rollout,
    temperature: float = 1.0,
    with_entropy: bool = True,
    memory_budget: int | None = None,
):
    """(logprobs [B, R] fp32, entropy [B, R] fp32 or None) of the response tokens at `temperature`.

    Positions outside rollout.response_mask hold 0. memory_budget: fused_logprobs' (None: its default).
    """
    hidden = response_hidden_states(model, rollout)
    batch, length, width = hidden.shape
    hidden, weight, bias = lm_head_operands(hidden.reshape(-1, width), model.get_output_embeddings())
    targets = rollout.response_ids.masked_fill(~rollout.response_mask, -100)
    logprobs, entropy = fused_logprobs(
        hidden,
        weight,
        targets.reshape(-1),
        temperature=temperature,
        bias=bias,
        return_entropy=with_entropy,
        memory_budget=memory_budget,
    )
    entropy = entropy.view(batch, length) if entropy is not None else None
    return logprobs.view(batch, length), entropy


def compute_dtype(model) -> torch.dtype:
    """The dtype the forward computes in: bf16/fp16 under autocast, else the weights'."""
    device = next(model.parameters()).device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return model.get_input_embeddings().weight.dtype


def aligned_response_hidden_states(model, rollout: Rollout, run_layer=None) -> torch.Tensor:
    """`response_hidden_states` by the rollout decoder's aligned forward, in compute_dtype(model).
    run_layer: the Decoder's (a sharded trainer gathers each layer's weights through it)."""
    ids, mask, pos = rollout.full_sequence()
    col = torch.arange(ids.shape[1], device=ids.device)
    visible = (col[None, :] <= col[:, None])[None] & mask[:, None, :]  # [B, T, T]: causal, real tokens
    decoder = Decoder(model, aligned=True, dtype=compute_dtype(model), run_layer=run_layer)
    hidden = decoder.hidden(ids, pos, None, None, visible)
    prompt_len, response_len = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    return hidden[:, prompt_len - 1 : prompt_len - 1 + response_len]


def aligned_token_logprobs_of(model, rollout: Rollout, temperature: float = 1.0, run_layer=None):
    """(logprobs [B, R] fp32, entropy [B, R] fp32) of the response tokens by the aligned forward (the bits
    the aligned rollout engine recorded for them); positions outside the response mask hold 0 (log-prob)."""
    hidden = aligned_response_hidden_states(model, rollout, run_layer)
    batch, length, width = hidden.shape
    weight, bias = linear_weights(model.get_output_embeddings(), hidden.dtype)
    targets = rollout.response_ids.masked_fill(~rollout.response_mask, -100)
    logprobs, entropy = aligned_token_logprobs(
        hidden.reshape(-1, width), weight, targets.reshape(-1), temperature, bias
    )
    return logprobs.view(batch, length), entropy.view(batch, length)
