"""The trainer at real sizes: micro-batching, gradient checkpointing, master weights, LoRA, rollout copy."""

import copy

import pytest
import torch
from conftest import TINY_QWEN, assert_same_adam_update, count_host_syncs, fp32_sum_bound, make_qwen

from bitrl.engine.config import load_config
from bitrl.rollout.batch import Rollout
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.lora_merge import lora_layers
from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_
from bitrl.rollout.settings import Sampling
from bitrl.train.logprobs import token_logprobs
from bitrl.train.lora import apply_lora
from bitrl.train.trainer import PolicyTrainer, micro_batches


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: one thread avoids thread hand-off costs on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_cfg(*overrides):
    return load_config(overrides=["train.lr=1e-2", *overrides]).train


def lora_cfg(*overrides):
    return load_config(overrides=["model.lora.rank=4", "model.lora.alpha=8", *overrides]).model.lora


def sample(model, seed=0, rows=8) -> Rollout:
    """Responses of varied lengths to prompts of varied lengths, with rollout log-probs that differ from the
    trainer's (so that rollout corrections have something to correct)."""
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11, 12]] * (rows // 4)
    gen = torch.Generator().manual_seed(seed)
    rollout = RolloutEngine(model, Sampling(max_new_tokens=6, eos_id=2, pad_id=0)).generate(
        prompts, generator=gen
    )
    noise = 0.3 * torch.randn(rollout.logprobs.shape, generator=gen)
    rollout.logprobs = (rollout.logprobs + noise) * rollout.response_mask
    assert rollout.response_mask.sum(-1).unique().numel() > 1  # lengths really vary
    return rollout


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def accumulated_gradient(model, cfg, rollout, advantages):
    trainer = PolicyTrainer(model, cfg)
    trainer.policy.train()
    old = trainer.old_logprobs(rollout)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss, _ = trainer.backward(rollout, old, advantages)
    return loss, grads(model), old


def relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_micro_batches_split_by_token_budget():
    rows = torch.arange(10)
    assert [len(r) for r in micro_batches(rows, 8, 0)] == [10]
    assert [len(r) for r in micro_batches(rows, 8, 24)] == [3, 3, 3, 1]
    assert [len(r) for r in micro_batches(rows, 8, 5)] == [1] * 10  # a row longer than the budget: alone


@pytest.mark.parametrize(
    "aggregation,correction,args",
    [
        ("token-mean", "none", {}),
        ("seq-mean-token-mean", "tis-token", {}),
        ("dr_grpo", "mask-seq", {"correction_low": 0.5, "correction_high": 2.0}),
        ("token-mean", "ais", {}),
    ],
)
def test_micro_batching_gives_the_one_batch_update(aggregation, correction, args):
    """Gradient accumulation over micro-batches equals the one-batch gradient, also with batch-level
    corrections (AIS) and corrections that mask whole sequences: equal up to the order in which fp32 sums
    their tokens (a normaliser taken per micro-batch instead of the global one would be off by ~1e-2)."""
    rollout = sample(make_qwen(**TINY_QWEN))
    advantages = torch.linspace(-1.5, 1.5, 8)
    common = [f"train.loss.loss_agg_mode={aggregation}", f"train.loss.correction={correction}"]
    common += ["train.autocast=none", *(f"train.loss.{k}={v}" for k, v in args.items())]
    results = {}
    for budget in (0, 10, 25):
        model = make_qwen(**TINY_QWEN)
        results[budget] = accumulated_gradient(
            model, train_cfg(*common, f"train.micro_batch_tokens={budget}"), rollout, advantages
        )
    loss, grad, old = results[0]
    assert grad.norm() > 0
    # The loss is a weighted mean of n per-token terms: aggregation weights summing to at most 1, times
    # |advantage| times a correction weight no larger than max(1, rho) (TIS caps rho, masks zero it, AIS
    # interpolates between 1 and rho). Its scale is that bound, not |loss|, which cancels to ~1e-2.
    n = int(rollout.response_mask.sum())
    log_rho = (old - rollout.logprobs)[rollout.response_mask.bool()]
    scale = float(advantages.abs().max()) * max(1.0, float(log_rho.max().exp()))
    for budget in (10, 25):
        loss_m, grad_m, old_m = results[budget]
        # The old-log-prob pass, micro-batched: each token's log-prob is one log-softmax of the same logits.
        torch.testing.assert_close(old_m, old, rtol=1e-6, atol=1e-6)
        assert abs(loss_m - loss) <= fp32_sum_bound(n, scale), (budget, loss_m - loss)
        # Each weight's gradient sums n per-token contributions in another order.
        assert relative_error(grad_m, grad) < fp32_sum_bound(n, 1.0), budget


def test_a_micro_batch_reads_few_values_back_to_the_host():
    """The update keeps its metrics, loss and counts on the device and reads them once per minibatch: each
    extra micro-batch adds only the loss op's input checks and the model's own mask handling (about five
    reads, each a device sync on a GPU), not one read per metric (about twenty before)."""
    rollout, advantages = sample(make_qwen(**TINY_QWEN)), torch.linspace(-1.5, 1.5, 8)
    reads = {}
    for budget in (0, 25):  # one micro-batch, then several
        model = make_qwen(**TINY_QWEN)
        cfg = train_cfg(
            "train.autocast=none", "train.loss.correction=tis-token", f"train.micro_batch_tokens={budget}"
        )
        trainer = PolicyTrainer(model, cfg)
        old = trainer.old_logprobs(rollout)
        micro = len(trainer.micro_batches(torch.arange(len(old)), rollout))
        with count_host_syncs() as syncs:
            trainer.backward(rollout, old, advantages)
        reads[budget] = (micro, syncs.count)
    (one, few), (many, more) = reads[0], reads[25]
    assert one == 1 and many >= 3
    assert (more - few) / (many - one) <= 6, reads


def test_micro_batched_step_matches_one_batch_step():
    """A whole trainer step (two updates, two minibatches) leaves the same weights either way."""
    rollout, advantages = sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8)
    weights = []
    for budget in (0, 9):
        model = make_qwen(**TINY_QWEN)
        cfg = train_cfg("train.minibatches=2", f"train.micro_batch_tokens={budget}", "train.lr=1e-3")
        PolicyTrainer(model, cfg).step(rollout, advantages)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert_same_adam_update(weights[1], weights[0], lr=1e-3)


def test_gradient_checkpointing_gives_the_same_gradients():
    rollout, advantages = sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8)
    plain = accumulated_gradient(make_qwen(**TINY_QWEN), train_cfg(), rollout, advantages)
    model = make_qwen(**TINY_QWEN)
    checkpointed = accumulated_gradient(
        model, train_cfg("train.gradient_checkpointing=true"), rollout, advantages
    )
    assert model.model.gradient_checkpointing  # the switch reached the decoder
    # The recomputed forward runs the same products at the same shapes, so the same kernels and summation
    # order on any CPU: the gradients are the same bits.
    assert torch.equal(checkpointed[1], plain[1])


def test_bf16_model_keeps_fp32_master_weights_and_runs_under_autocast():
    model = make_qwen(**TINY_QWEN).to(torch.bfloat16)
    trainer = PolicyTrainer(model, train_cfg())
    assert trainer.autocast == "bf16"  # on the CPU too: the weights were loaded in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    trainer.step(sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8))
    states = [s for st in trainer.optimizer.state.values() for s in st.values() if s.dim()]
    assert states and all(s.dtype == torch.float32 for s in states)

    plain = make_qwen(**TINY_QWEN).to(torch.bfloat16)
    PolicyTrainer(plain, train_cfg("train.master_weights=model")).step(
        sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8)
    )
    assert all(p.dtype == torch.bfloat16 for p in plain.parameters())


def test_bf16_autocast_runs_the_lm_head_in_bf16_in_both_passes(monkeypatch):
    """fp32 master weights under bf16 autocast: the fused LM-head ops get bf16 operands (as F.linear would
    under autocast), in the old-log-prob pass and in the update alike, not fp32 products of the masters."""
    from bitrl.train import logprobs, trainer

    seen = []

    def spy(op):
        def call(hidden, weight, *args, **kw):
            seen.append((op.__name__, hidden.dtype, weight.dtype))
            return op(hidden, weight, *args, **kw)

        return call

    monkeypatch.setattr(logprobs, "fused_logprobs", spy(logprobs.fused_logprobs))
    monkeypatch.setattr(trainer, "fused_linear_policy_loss", spy(trainer.fused_linear_policy_loss))
    model = make_qwen(**TINY_QWEN).to(torch.bfloat16)
    policy = PolicyTrainer(model, train_cfg())
    assert policy.autocast == "bf16" and model.lm_head.weight.dtype == torch.float32
    policy.step(sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8))
    assert {name for name, _, _ in seen} == {"fused_logprobs", "fused_linear_policy_loss"}
    assert all(h == w == torch.bfloat16 for _, h, w in seen), seen


def test_lora_gradients_reach_only_adapters_and_the_base_stays_put():
    model = apply_lora(make_qwen(**TINY_QWEN), lora_cfg())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer = PolicyTrainer(model, train_cfg())
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n
    }
    rollout, advantages = sample(make_qwen(**TINY_QWEN)), torch.linspace(-1, 1, 8)
    trainer.policy.train()
    trainer.backward(rollout, trainer.old_logprobs(rollout), advantages)
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in with_grad if "lora_B" in n)
    trainer.step(rollout, advantages)
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n
    assert trainer.trainable_parameters == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_lora_rollout_copy_gets_the_merged_weights():
    model = apply_lora(make_qwen(**TINY_QWEN), lora_cfg('model.lora.target_modules=["q_proj","down_proj"]'))
    assert {n.rsplit(".", 1)[1] for n in lora_layers(model)} == {"q_proj", "down_proj"}
    trainer = PolicyTrainer(model, train_cfg())
    rollout_model = make_rollout_model(model, "full")
    assert not lora_layers(rollout_model)  # a plain model: what an inference engine takes
    rollout = sample(make_qwen(**TINY_QWEN))
    trainer.step(rollout, torch.linspace(-1, 1, 8))
    stats = sync_rollout_model_(rollout_model, model, "full")
    assert stats["merged"] == 4  # 2 layers x 2 adapted modules
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(rollout_model, rollout)[0], token_logprobs(model, rollout)[0], rtol=0, atol=1e-5
        )

    quantized = make_rollout_model(model, "nvfp4")
    trainer.step(rollout, torch.linspace(1, -1, 8))
    assert sync_rollout_model_(quantized, model, "nvfp4")["requantized"] == 4
    layer = lora_layers(model)["model.layers.0.self_attn.q_proj"]
    merged = layer.base_layer.weight + layer.get_delta_weight("default")
    from bitrl.quant import quantize

    assert torch.equal(
        quantized.model.layers[0].self_attn.q_proj.qdata,
        quantize(merged.detach(), "nvfp4", scale_mode="mse").data,  # the default recipe's scales
    )


@pytest.mark.parametrize("base_precision", ["fp8", "mxfp4", "nvfp4"])
def test_qerl_base_is_bit_identical_in_trainer_and_rollout(base_precision):
    model = apply_lora(
        make_qwen(**TINY_QWEN).to(torch.bfloat16), lora_cfg(f"model.lora.base_precision={base_precision}")
    )
    trainer = PolicyTrainer(model, train_cfg())
    rollout_model = make_rollout_model(model, "full")
    for name, layer in lora_layers(model).items():
        twin = rollout_model.get_submodule(name)
        assert twin is not layer and twin.base_layer is layer.base_layer  # stored once, shared
        assert torch.equal(
            twin.base_layer.dequantized_weight(torch.bfloat16),
            layer.base_layer.dequantized_weight(torch.bfloat16),
        )
    rollout = sample(make_qwen(**TINY_QWEN))
    trainer.step(rollout, torch.linspace(-1, 1, 8))
    assert sync_rollout_model_(rollout_model, model, "full")["copied"] == len(trainer.trainable)
    with torch.no_grad():  # same base bits, same adapters: the same log-probs, bit for bit
        assert torch.equal(token_logprobs(rollout_model, rollout)[0], token_logprobs(model, rollout)[0])
    with pytest.raises(ValueError, match="shares the trainer's"):
        make_rollout_model(model, "bf16")


def test_qerl_base_is_quantized_as_the_recipe_says():
    from torch import nn

    from bitrl.engine.loop import prepare_policy
    from bitrl.quant import QuantLinear, quantize

    def base_of(model, name="model.layers.0.mlp.down_proj"):
        return lora_layers(model)[name].base_layer

    for fmt, overrides in [("nvfp4", []), ("mxfp4", []), ("nvfp4", ["rollout.scale_mode=floor"])]:
        source = make_qwen(**TINY_QWEN).to(torch.bfloat16)
        weight = source.model.layers[0].mlp.down_proj.weight.detach().clone()
        lora = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.base_precision={fmt}"]
        cfg = load_config(overrides=[*lora, *overrides])
        base = base_of(prepare_policy(source, cfg))
        scale_mode = "floor" if overrides else "mse"  # the rollout's settings, "auto": mse for both formats
        # mxfp4's default outlier fallback (tau 8) is kept beside the packed base; nvfp4 has none
        assert (base.outlier_tau, base.act) == ((8.0 if fmt == "mxfp4" else None), None)
        if fmt == "nvfp4":
            assert torch.equal(base.qdata, quantize(weight, fmt, scale_mode=scale_mode).data)
        else:  # the outliers leave the packed part: the same as a layer built with those settings
            twin = QuantLinear.from_linear(nn.Linear(64, 32, bias=False), fmt, act=None, scale_mode="mse")
            twin.outlier_tau = 8.0
            twin.set_weight(weight)
            assert torch.equal(base.qdata, twin.qdata) and torch.equal(base.outlier_value, twin.outlier_value)
    with pytest.raises(ValueError, match="base recipe must be nvfp4"):
        from bitrl.quant.recipe import recipe_for

        apply_lora(make_qwen(**TINY_QWEN), lora_cfg("model.lora.base_precision=nvfp4"), recipe_for("mxfp4"))


def test_lora_config_errors_are_clear():
    from bitrl.engine.config import ConfigError

    with pytest.raises(ConfigError, match="base_precision needs LoRA"):
        load_config(overrides=["model.lora.base_precision=nvfp4"])
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        apply_lora(make_qwen(**TINY_QWEN), lora_cfg('model.lora.target_modules=["nope"]'))


def test_checkpoint_state_of_a_lora_policy_is_the_adapters_only():
    from bitrl.train.checkpoint import load_policy_state, policy_state

    model = apply_lora(make_qwen(**TINY_QWEN), lora_cfg())
    state = policy_state(model)
    assert state and all("lora_" in n for n in state)
    other = apply_lora(make_qwen(**TINY_QWEN), lora_cfg())
    load_policy_state(other, copy.deepcopy(state))
    assert all(torch.equal(other.get_parameter(n), t) for n, t in state.items())
    with pytest.raises(ValueError, match="does not match the policy"):
        load_policy_state(other, {})
