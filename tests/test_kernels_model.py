"""The fused ops on a real (tiny) Hugging Face causal LM, as the trainer uses them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_qwen
from test_kernels_helpers import assert_close

from bitrl.kernels import LossConfig, fused_linear_policy_loss, fused_logprobs, policy_loss

pytest.importorskip("transformers")


def _tiny_model(tie: bool):
    return make_qwen(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    ).double()


@pytest.mark.parametrize("tie", [False, True])
def test_fused_path_matches_logits_path_on_a_model(tie):
    model = _tiny_model(tie)
    g = torch.Generator().manual_seed(1)
    B, P, R = 3, 4, 5
    ids = torch.randint(0, 50, (B, P + R), generator=g)
    resp = ids[:, P:]
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[:, P - 1 : P - 1 + R]
        head = model.get_output_embeddings()
        old, _ = fused_logprobs(h.reshape(B * R, -1), head.weight, resp.reshape(-1), return_entropy=False)
        old = old.view(B, R) + 0.1 * torch.randn(B, R, generator=g, dtype=torch.float64)

    def fused():
        hidden = model.model(input_ids=ids).last_hidden_state[:, P - 1 : P - 1 + R]
        w = model.get_output_embeddings().weight
        return fused_linear_policy_loss(
            hidden, w, resp, old, adv, mask, LossConfig(entropy_coef=0.01), temperature=0.7, impl="torch"
        )[0]

    def unfused():
        logits = model(input_ids=ids).logits[:, P - 1 : P - 1 + R] / 0.7
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, resp[..., None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        cfg = LossConfig(entropy_coef=0.01)
        return policy_loss(lp, old, adv, mask, cfg, entropy=ent, impl="reference")[0]

    grads = []
    for fn in (fused, unfused):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert_close(grads[0][0], grads[1][0], atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert_close(a, b, atol=1e-10, rtol=1e-9)
