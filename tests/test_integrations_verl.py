"""bitrl's losses through verl's policy-loss registry, called exactly as verl's actor calls them.

Runs in the verl environment (`make .venv-oldest/.installed`: verl 0.9 pins transformers < 5.11)."""

import pytest
import torch

pytest.importorskip("verl", reason="verl runs in its own environment: make .venv-oldest/.installed")

from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from bitrl.integrations import verl as bitrl_verl  # noqa: E402
from bitrl.kernels import LossConfig, policy_loss  # noqa: E402

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]
BATCH_INFOS = [{}, {"dp_size": 1, "batch_num_tokens": 57, "global_batch_size": 9, "loss_scale_factor": 32}]


@pytest.fixture(autouse=True)
def registered():
    yield bitrl_verl.register()
    bitrl_verl.register()  # reset options a test may have set


def actor_config(**fields):
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=2, rollout_n=1, **fields)


def batch(seed, B=5, T=9, spread=0.4):
    """fp64: bitrl's losses and verl's are the same algebra, which fp64 checks to 1e-12 on any CPU (in fp32
    the two sum their tokens in other orders, and the order differs between CPU kinds)."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(B, T, generator=g) * 3).double()
    lp = (old + spread * torch.randn(B, T, generator=g).double()).requires_grad_(True)
    adv = torch.randn(B, T, generator=g).double() * 2
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[-1] = False  # an empty response
    mask[0, 0] = True
    return old, lp, adv, mask


def call(name, old, lp, adv, mask, mode, config, rollout_is_weights=None):
    """As verl's ppo_loss does: keywords, bool mask, the actor config with its global batch info."""
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


def test_register_adds_one_name_per_bitrl_loss():
    names = bitrl_verl.register()
    assert {"bitrl_grpo", "bitrl_gspo", "bitrl_cispo", "bitrl_sapo", "bitrl_gmpo", "bitrl_vespo"} <= set(
        names
    )
    for name in names:
        assert callable(get_policy_loss_fn(name))


@pytest.mark.parametrize("info", BATCH_INFOS, ids=["local", "global"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_bitrl_grpo_equals_verl_vanilla(mode, info, with_weights):
    old, lp, adv, mask = batch(0, spread=0.6)  # wide ratios: both clips and the dual clip are active
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28)
    config.global_batch_info.update(info)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(3)) * 2 if with_weights else None
    theirs = call("vanilla", old, lp, adv, mask, mode, config, weights)
    ours = call("bitrl_grpo", old, lp, adv, mask, mode, config, weights)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-12, rtol=1e-12)
    assert theirs[2]["actor/pg_clipfrac_lower"] > 0 and theirs[2]["actor/pg_clipfrac"] > 0
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[2][key] == pytest.approx(theirs[2][key], abs=1e-12)


@pytest.mark.parametrize("loss_type", bitrl_verl.LOSS_NAMES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_each_loss_equals_bitrl_policy_loss(loss_type, mode):
    """Same loss and gradient as bitrl's own policy_loss with the aggregation written out by hand."""
    old, lp, adv, mask = batch(1, spread=0.2)
    config = actor_config(clip_ratio_low=0.25, clip_ratio_high=0.25)
    config.global_batch_info.update(BATCH_INFOS[1])
    ours = call(f"bitrl_{loss_type}", old, lp, adv, mask, mode, config)
    hand = {  # verl's agg_loss normalisers for the global batch info above
        "token-mean": ("token-mean", {"global_token_count": 57}),
        "token-sum": ("seq-mean-token-sum-norm", {"loss_scale": 1.0}),
        "seq-mean-token-mean": ("seq-mean-token-mean", {"global_seq_count": 9}),
        "seq-mean-token-sum": ("seq-mean-token-sum", {"global_seq_count": 9}),
        "seq-mean-token-sum-norm": ("seq-mean-token-sum-norm", {"loss_scale": 9 * 32}),
    }[mode]
    extra = {"clip_ratio_c": 3.0} if loss_type == "grpo" else {}
    lp2 = lp.detach().clone().requires_grad_(True)
    cfg = LossConfig(
        loss_type=loss_type, loss_agg_mode=hand[0], eps_low=0.25, eps_high=0.25, **hand[1], **extra
    )
    want, _ = policy_loss(lp2, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(ours[0], want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours[1], grad, atol=1e-12, rtol=1e-12)


def test_correction_from_rollout_ratio():
    """With a bitrl correction, verl's rollout_is_weights are read as the raw ratio rho (IcePop by hand)."""
    old, lp, adv, mask = batch(2, spread=0.1)
    rho = torch.exp(0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5)).double())
    bitrl_verl.register(correction="icepop", icepop_alpha=0.7, icepop_beta=1.5)
    config = actor_config()
    loss, grad, metrics = call("bitrl_grpo", old, lp, adv, mask, "token-mean", config, rho)
    weight = torch.where((rho >= 0.7) & (rho <= 1.5), rho, torch.zeros_like(rho))
    bitrl_verl.register()
    want, want_grad, _ = call("vanilla", old, lp, adv, mask, "token-mean", config, weight)
    assert 0 < (weight[mask] == 0).sum() < mask.sum()
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-12)
    assert metrics["actor/bitrl/mismatch_k3"] > 0
    bitrl_verl.register(correction="ais")
    with pytest.raises(ValueError, match="rollout_is=token"):
        call("bitrl_grpo", old, lp, adv, mask, "token-mean", config, None)


def test_fused_linear_for_ppo_on_bitrl():
    """verl's fused-kernel LM head (torch backend) against the same head routed through bitrl."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    ids = torch.randint(0, 50, (2, 7))
    theirs = FusedLinearForPPO(chunk_size=4).forward(hidden, weight, ids, temperature=0.8)
    grads_theirs = torch.autograd.grad(theirs[0].sum() + 0.5 * theirs[1].sum(), (hidden, weight))
    original = FusedLinearForPPO.forward
    try:
        bitrl_verl.register(fused_kernels=True)
        assert FusedLinearForPPO.forward is bitrl_verl.bitrl_fused_linear_for_ppo
        ours = FusedLinearForPPO().forward(hidden, weight, ids, temperature=0.8)
    finally:
        FusedLinearForPPO.forward = original
    grads_ours = torch.autograd.grad(ours[0].sum() + 0.5 * ours[1].sum(), (hidden, weight))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for a, b in zip(grads_ours, grads_theirs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def _gen_batch(with_old: bool):
    """A rollout batch as verl's rollout returns it (left-padded prompts, right-padded responses)."""
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(7)
    B, P, R = 4, 5, 6
    prompts = torch.randint(3, 40, (B, P), generator=g)
    responses = torch.randint(3, 40, (B, R), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[2, 4:] = 0
    rollout = -torch.rand(B, R, generator=g) * 2
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "response_mask": response_mask,
        "rollout_log_probs": rollout,
    }
    if with_old:
        tensors["old_log_probs"] = rollout + 0.05 * torch.randn(B, R, generator=g)
    return DataProto.from_dict(tensors=tensors), tensors


def test_external_mismatch_reads_verl_rollout_dump(tmp_path):
    """A dump written by verl's own DataProto.save_to_disk (what its rollout skip/cache writes)."""
    from bitrl.engine.cli import main as cli_main
    from bitrl.integrations.external import read_external_dump
    from bitrl.train.mismatch import mismatch_diagnostics

    data, tensors = _gen_batch(with_old=True)
    path = tmp_path / "1" / "gen_batch.dp"
    path.parent.mkdir()
    data.save_to_disk(path)
    out = tmp_path / "report"
    assert cli_main(["mismatch", "--external", str(path), "--out", str(out)]) == 0
    import json

    report = json.loads((out / "mismatch.json").read_text())
    mask = tensors["response_mask"].bool()
    want = mismatch_diagnostics(tensors["old_log_probs"], tensors["rollout_log_probs"], mask)
    for key, value in want.items():
        assert report[key] == pytest.approx(value, rel=1e-5, abs=1e-7)

    data, tensors = _gen_batch(with_old=False)
    data.save_to_disk(path)
    dump = read_external_dump(path)
    assert dump["prompt_ids"][1] == tensors["prompts"][1, 2:].tolist()
    assert dump["response_ids"][2] == tensors["responses"][2, :4].tolist()
    assert cli_main(["mismatch", "--external", str(path), "--out", str(out)]) == 2  # needs --model


def test_external_verl_dump_rescored_by_model(tmp_path):
    """Without the trainer's log-probs in the dump, --model DIR rescores the dumped tokens."""
    import json

    from conftest import save_tiny_hf_model

    from bitrl.engine.cli import main as cli_main

    save_tiny_hf_model(tmp_path / "model")
    data, tensors = _gen_batch(with_old=False)
    data.save_to_disk(tmp_path / "gen_batch.dp")
    out = tmp_path / "report"
    argv = ["mismatch", "--model", str(tmp_path / "model"), "--external", str(tmp_path / "gen_batch.dp")]
    assert cli_main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "mismatch.json").read_text())
    assert report["num_tokens"] == int(tensors["response_mask"].sum())
    assert report["mismatch_k3_kl"] > 0
