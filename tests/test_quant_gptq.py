"""GPTQ rounding of the FP4 formats (bitrl.quant.gptq) and its place in the rollout recipe.

The reference here is GPTQ as first written (optimal brain quantization, one column at a time, the inverse
Hessian updated by eliminating each rounded column), in float64, without the Cholesky form, the lazy
batches or the padding of the code under test."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bitrl.quant import QuantLinear, get_format, quantize
from bitrl.quant import reference as ref
from bitrl.quant.gptq import collect_hessians, gptq_quantize, gptq_requantize_


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """[tokens, features] fp32 inputs whose features are correlated (and a few loud), as a model's are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features**0.5 + torch.eye(features)
    x = torch.randn(tokens, features, generator=g) @ mix
    x[:, :: max(features // 8, 1)] *= 4.0  # outlier channels
    return x


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    return float((x @ (weight - approx).t()).pow(2).mean())


def reference_gptq_mxfp4(weight, hessian, damp, scale_mode):
    """Column-by-column GPTQ (the OBQ update of the inverse Hessian) in float64; each 32-column group's
    scales from the plain quantizer applied to the group as the earlier errors have left it."""
    e2m1 = get_format("mxfp4").element
    w = weight.double().clone()
    h = hessian.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    out = torch.zeros_like(w)
    for col in range(w.shape[1]):
        if col % 32 == 0:
            stored = quantize(w[:, col : col + 32].float(), "mxfp4", scale_mode=scale_mode).scale
            scale = ref.e8m0_from_storage(stored).double()[:, 0]
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        x = w[:, col]
        code = ref.round_to_element((x / safe).abs().float(), e2m1).double().copysign(x)
        out[:, col] = q = torch.where(scale > 0, code * scale, torch.zeros_like(code))
        err = (x - q) / hinv[col, col]
        w[:, col:] -= err[:, None] * hinv[col, col:][None]
        hinv = hinv - hinv[:, col : col + 1] @ hinv[col : col + 1, :] / hinv[col, col]
    return out


# ----------------------------------------------------------------------------------------------- the rounding


@pytest.mark.parametrize(
    "fmt,mode", [("nvfp4", "floor"), ("nvfp4", "mse"), ("mxfp4", "floor"), ("mxfp4", "mse")]
)
@pytest.mark.parametrize("shape", [(24, 64), (7, 200)])
def test_with_an_identity_hessian_gptq_is_round_to_nearest_bit_for_bit(fmt, mode, shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    qt, final = gptq_quantize(weight, torch.eye(shape[1]), fmt, scale_mode=mode)
    rtn = quantize(weight, fmt, scale_mode=mode)
    assert torch.equal(qt.data, rtn.data) and torch.equal(qt.scale.float(), rtn.scale.float())
    if rtn.tensor_scale is not None:
        assert torch.equal(qt.tensor_scale, rtn.tensor_scale)
    assert torch.equal(qt.dequantize(torch.float32), rtn.dequantize(torch.float32))
    assert torch.equal(final, rtn.dequantize(torch.float32))


@pytest.mark.parametrize("mode", ["floor", "mse"])
@pytest.mark.parametrize("damp", [0.01, 0.1])
def test_gptq_matches_the_column_by_column_reference(mode, damp):
    x = correlated_inputs(512, 96, seed=2)
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    hessian = x.t() @ x / x.shape[0]
    _, final = gptq_quantize(weight, hessian, "mxfp4", scale_mode=mode, damp=damp)
    want = reference_gptq_mxfp4(weight, hessian, damp, mode).float()
    # float32 against float64: a value at a rounding boundary may round the other way and move its
    # neighbours a little; nearly every code agrees and the output errors agree closely
    assert (final == want).float().mean() >= 0.97
    got_err, want_err = output_error(x, weight, final), output_error(x, weight, want)
    assert abs(got_err - want_err) <= 0.05 * want_err


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_cuts_the_output_error_of_round_to_nearest_on_correlated_inputs(fmt):
    x = correlated_inputs(2048, 128)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    hessian = x.t() @ x / x.shape[0]
    qt, final = gptq_quantize(weight, hessian, fmt, scale_mode="mse")
    assert torch.equal(qt.dequantize(torch.float32), final)
    rtn = quantize(weight, fmt, scale_mode="mse").dequantize(torch.float32)
    # measured 0.5x on these inputs; the weight error itself grows, as it should
    assert output_error(x, weight, final) < 0.75 * output_error(x, weight, rtn)
    assert (weight - final).pow(2).mean() > (weight - rtn).pow(2).mean()


def test_kept_weights_are_held_outside_the_codes_and_dead_inputs_round_alone():
    x = correlated_inputs(1024, 64)
    x[:, 5] = 0.0  # an input no calibration token reaches
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) * 0.05
    keep = torch.zeros_like(weight, dtype=torch.bool)
    keep[3, 10] = keep[17, 40] = True
    weight[keep] = 2.0
    qt, final = gptq_quantize(weight, x.t() @ x / 1024, "nvfp4", keep=keep)
    deq = qt.dequantize(torch.float32)
    assert torch.equal(deq[keep], torch.zeros(2))  # their codes are zero
    assert torch.equal(final[keep], final[keep].bfloat16().float()) and (final[keep] - 2.0).abs().max() < 0.1
    assert torch.equal(final[~keep], deq[~keep])
    assert torch.isfinite(final).all() and final[:, 5].count_nonzero() > 16  # the dead input's weights stay


def test_gptq_refuses_what_it_cannot_round():
    w, h = torch.randn(8, 32), torch.eye(32)
    with pytest.raises(ValueError, match="FP4"):
        gptq_quantize(w, h, "fp8_e4m3")
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(16), "nvfp4")
    with pytest.raises(ValueError, match="NaN or inf"):
        gptq_quantize(w, h.masked_fill(h > 0, float("nan")), "nvfp4")
    with pytest.raises(ValueError, match="keep"):
        gptq_quantize(w, h, "nvfp4", keep=torch.zeros(8, 32))
    with pytest.raises(ValueError, match="NaN|inf|finite"):
        gptq_quantize(w.index_fill(1, torch.tensor([3]), float("nan")), h, "mxfp4")


# ------------------------------------------------------------------------------------------------ the model


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def sequences(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 96, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g)
        for _ in range(count)
    ]


def test_collected_hessians_are_the_layers_input_second_moments():
    model = tiny_llama()
    seqs = sequences(3, seed=0)
    hessians = collect_hessians(model, seqs)
    assert len(hessians) == 2 * 7 + 1  # every linear, the LM head included
    layer = model.model.layers[0]
    with torch.no_grad():
        x = torch.cat([layer.input_layernorm(model.model.embed_tokens(s)) for s in seqs])
    want = x.t() @ x / x.shape[0]
    got = hessians["model.layers.0.self_attn.q_proj"]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(ValueError, match="no linear 'model.layers.9.mlp'"):
        collect_hessians(model, seqs, names=["model.layers.9.mlp"])
    with pytest.raises(ValueError, match="1-D int64"):
        collect_hessians(model, [torch.zeros(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="no input reached"):
        collect_hessians(model, [])


def test_hessians_of_padded_batches_are_those_of_each_sequence_alone():
    # Batches of unequal lengths, right-padded: the pads must reach neither a real token nor the sums. The
    # LM head's Hessian (its input: the final norm's output) is checked against the base model run alone.
    model = tiny_llama()
    seqs = sequences(9, seed=1)
    batched = collect_hessians(model, seqs, batch_tokens=64)  # several batches, each with pads
    alone = collect_hessians(model, seqs, batch_tokens=1)  # one sequence per forward, no pad
    assert sorted(batched) == sorted(alone)
    for name in alone:
        assert (batched[name] - alone[name]).abs().max() <= 1e-5 * alone[name].abs().max(), name
    with torch.no_grad():
        h = torch.cat([model.model(s[None]).last_hidden_state[0] for s in seqs])
    want = h.t() @ h / h.shape[0]
    assert (batched["lm_head"] - want).abs().max() <= 1e-5 * want.abs().max()
    # without the head among the names its logits are left out (logits_to_keep): the rest is unchanged
    body = [n for n in alone if n != "lm_head"]
    for name, got in collect_hessians(model, seqs, names=body, batch_tokens=64).items():
        assert (got - alone[name]).abs().max() <= 1e-5 * alone[name].abs().max(), name


def logit_error(model, reference, seqs) -> float:
    with torch.no_grad():
        return sum(float((model(s[None]).logits - reference(s[None]).logits).pow(2).mean()) for s in seqs)


@pytest.mark.parametrize("fmt,tau", [("nvfp4", None), ("mxfp4", 8.0)])
def test_a_gptq_rollout_copy_is_closer_to_the_policy_and_syncs_like_a_fresh_one(fmt, tau):
    from bitrl.quant.recipe import recipe_for
    from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_

    policy = tiny_llama()
    calibration, held_out = sequences(64, seed=1), sequences(16, seed=2)
    recipe = recipe_for(fmt, outlier_tau=tau, gptq=True)
    rollout = make_rollout_model(policy, fmt, recipe, calibration)
    rtn = make_rollout_model(policy, fmt, recipe_for(fmt, outlier_tau=tau))
    assert logit_error(rollout, policy, held_out) < 0.9 * logit_error(rtn, policy, held_out)
    if tau is not None:  # the kept outliers are there, at GPTQ's values
        layers = [m for m in rollout.modules() if isinstance(m, QuantLinear)]
        assert all(m.outlier_index is not None for m in layers)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    stats = sync_rollout_model_(rollout, policy, fmt)
    assert stats["gptq_layers"] == 14 and stats["calibration_tokens"] == sum(len(s) for s in calibration)
    fresh = make_rollout_model(policy, fmt, recipe, calibration)
    ids = held_out[0][None]
    with torch.no_grad():
        assert torch.equal(rollout(ids).logits, fresh(ids).logits)


@pytest.mark.parametrize("fmt,tau", [("nvfp4", None), ("mxfp4", 8.0)])
def test_a_gptq_lora_base_holds_the_bits_of_a_gptq_copy_of_the_plain_model(fmt, tau):
    from bitrl.engine.config import LoraConfig
    from bitrl.quant.recipe import recipe_for
    from bitrl.rollout.lora_merge import lora_layers
    from bitrl.rollout.precision import make_rollout_model
    from bitrl.train.lora import apply_lora

    policy = tiny_llama()
    calibration, held_out = sequences(64, seed=1), sequences(16, seed=2)
    recipe = recipe_for(fmt, act=None, outlier_tau=tau, gptq=True)
    plain = make_rollout_model(policy, fmt, recipe, calibration)  # GPTQ on the model without adapters
    lora_cfg = LoraConfig(rank=4, alpha=8, base_precision=fmt)
    lora = apply_lora(copy.deepcopy(policy), lora_cfg, recipe, calibration)
    layers = lora_layers(lora)
    assert len(layers) == 14
    for name, layer in layers.items():  # the adapters do not reach the Hessians: the same bits
        assert torch.equal(layer.base_layer.qdata, plain.get_submodule(name).qdata)
        assert layer.base_layer.source_name is None
    rtn = apply_lora(copy.deepcopy(policy), lora_cfg, recipe_for(fmt, act=None, outlier_tau=tau))
    assert logit_error(lora, policy, held_out) < 0.9 * logit_error(rtn, policy, held_out)
    with pytest.raises(ValueError, match="calibration"):
        apply_lora(copy.deepcopy(policy), lora_cfg, recipe)


def test_a_qerl_base_is_gptq_rounded_only_when_asked():
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import lora_base_recipe

    qerl = ["model.lora.rank=4", "model.lora.base_precision=mxfp4"]
    assert not lora_base_recipe(load_config(None, qerl)).gptq  # "auto": round-to-nearest
    asked = load_config(None, [*qerl, "rollout.gptq=true"])
    assert lora_base_recipe(asked).gptq and lora_base_recipe(asked).act is None
    assert asked.rollout.gptq_prompt_count(asked.model.lora.base_precision) == 256
    with pytest.raises(ValueError, match="data-parallel"):
        lora_base_recipe(asked, distributed=True)
    with pytest.raises(ValueError, match="model.lora.base_precision"):
        load_config(None, ["model.lora.rank=4", "model.lora.base_precision=fp8", "rollout.gptq=true"])


def test_gptq_requantize_leaves_the_fp8_layers_alone():
    from bitrl.quant.recipe import recipe_for
    from bitrl.rollout.precision import make_rollout_model

    policy = tiny_llama()
    keep = ("model.layers.1.mlp.down_proj",)
    rollout = make_rollout_model(
        policy, "nvfp4", recipe_for("nvfp4", fp8_layers=keep, gptq=True), sequences(8, 1)
    )
    fp8 = rollout.get_submodule(keep[0])
    before = fp8.qdata.clone()
    stats = gptq_requantize_(rollout, policy, sequences(8, 1))
    assert stats["gptq_layers"] == 13 and fp8.fmt == "fp8_e4m3" and torch.equal(fp8.qdata, before)


def test_the_gptq_recipe_refuses_what_it_does_not_cover():
    from bitrl.engine.config import load_config
    from bitrl.quant.recipe import recipe_for
    from bitrl.quant.rotation import Rotation
    from bitrl.rollout.precision import make_rollout_model

    with pytest.raises(ValueError, match="FP4"):
        recipe_for("fp8_e4m3", gptq=True)
    with pytest.raises(ValueError, match="rotation"):
        recipe_for("nvfp4", gptq=True, rotation=Rotation("inputs", 32))
    with pytest.raises(ValueError, match="calibration"):
        make_rollout_model(tiny_llama(), "nvfp4", recipe_for("nvfp4", gptq=True))
    with pytest.raises(ValueError, match="mxfp4 or nvfp4"):
        load_config(None, ["rollout.gptq=true", "rollout.precision=bf16"])
    with pytest.raises(ValueError, match="gptq_damp"):
        load_config(None, ["rollout.gptq_damp=0"])
    with pytest.raises(ValueError, match="gptq_prompts"):
        load_config(None, ["rollout.gptq_prompts=0"])
    prompts = {
        p: load_config(None, [f"rollout.precision={p}"]).rollout.gptq_prompt_count()
        for p in ("nvfp4", "mxfp4")
    }
    assert prompts == {"nvfp4": 64, "mxfp4": 256}  # "auto": the counts the study measured best
    assert (
        load_config(None, ["rollout.precision=mxfp4", "rollout.gptq_prompts=8"]).rollout.gptq_prompt_count()
        == 8
    )
    cfg = load_config(None, ["rollout.gptq=true", "rollout.precision=nvfp4", "rollout.gptq_damp=0.05"])
    assert (cfg.rollout.quant_recipe("nvfp4").gptq, cfg.rollout.quant_recipe("nvfp4").gptq_damp) == (
        True,
        0.05,
    )
    with pytest.raises(ValueError, match="data-parallel"):
        cfg.rollout.quant_recipe("nvfp4", gptq_possible=False)
    auto = load_config(None, []).rollout  # "auto": on for the FP4 copies that can be calibrated
    got = [auto.quant_recipe(f).gptq for f in ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3")]
    assert got == [True, True, False, False]
    assert not auto.quant_recipe("nvfp4", gptq_possible=False).gptq
    assert not load_config(None, ["rollout.rotation=inputs"]).rollout.quant_recipe("nvfp4").gptq


def test_a_quant_linear_rounds_by_gptq_when_given_a_hessian():
    x = correlated_inputs(1024, 64)
    linear = torch.nn.Linear(64, 48, bias=False)
    q = QuantLinear.from_linear(copy.deepcopy(linear), "mxfp4", act=None, outlier_tau=4.0)
    rtn_err = output_error(x, linear.weight.detach(), q.dequantized_weight(torch.float32))
    version = q.weight_version
    q.set_weight(linear.weight.detach(), hessian=x.t() @ x / 1024)
    assert q.weight_version == version + 1
    got = q.dequantized_weight(torch.float32)
    assert output_error(x, linear.weight.detach(), got) < 0.75 * rtn_err
    flat = got.reshape(-1)[q.outlier_index.long()]
    assert torch.equal(flat, q.outlier_value.float())  # the kept weights are what the layer computes with


# ----------------------------------------------------------------------------------------------- the commands


def test_bitrl_mismatch_and_train_take_rollout_gptq(tmp_path, monkeypatch):
    import json

    from conftest import TINY_DEMO_MODEL

    from bitrl.engine.cli import main
    from bitrl.engine.mismatch_cmd import main as mismatch

    args = ["--demo", "--rollout-precision", "nvfp4", "--num-prompts", "8", "--out", str(tmp_path / "m")]
    assert mismatch([*args, "rollout.gptq=true", "rollout.gptq_prompts=8"]) == 0
    assert json.loads((tmp_path / "m" / "mismatch.json").read_text())["num_tokens"] > 0
    monkeypatch.chdir(tmp_path)
    run = ["train", "name=gptq", "task.n_eval=8", "steps=2", "eval_every=100", "checkpoint_every=100"]
    run += ["warmstart.steps=0", "rollout.prompts_per_step=8", "rollout.precision=nvfp4"]
    run += ["rollout.gptq=true", "rollout.gptq_prompts=8"]
    assert main([*run, *TINY_DEMO_MODEL]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs/gptq/metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "mismatch_k3_kl" in r]) == 2


def test_the_fast_e2m1_rounding_is_the_reference_rounding():
    from bitrl.quant.quantize import round_e2m1

    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = (grid[1:] + grid[:-1]) / 2
    a = torch.cat(
        [torch.linspace(0, 8, 20001), grid, ties, ties.nextafter(torch.tensor(0.0)), torch.tensor([1e30])]
    )
    want = ref.round_to_element(a, get_format("nvfp4").element)
    assert torch.equal(round_e2m1(a), want)


def test_batched_and_shared_rounding_match_one_layer_at_a_time(monkeypatch):
    import bitrl.quant.gptq as gptq
    from bitrl.quant.recipe import recipe_for
    from bitrl.rollout.precision import make_rollout_model

    policy, calibration = tiny_llama(), sequences(16, seed=1)
    hessians = collect_hessians(policy, calibration)
    attention = policy.model.layers[1].self_attn
    assert hessians["model.layers.1.self_attn.q_proj"] is hessians["model.layers.1.self_attn.v_proj"]
    assert hessians["model.layers.1.self_attn.o_proj"] is not hessians["model.layers.1.self_attn.q_proj"]
    alone, _ = gptq_quantize(
        attention.k_proj.weight.detach(),
        hessians["model.layers.1.self_attn.k_proj"],
        "nvfp4",
        scale_mode="mse",
    )
    for elements in (1, 2**26):  # one problem per loop, all in one
        monkeypatch.setattr(gptq, "BATCH_ELEMENTS", elements)
        rollout = make_rollout_model(policy, "nvfp4", recipe_for("nvfp4", gptq=True), calibration)
        k_proj = rollout.get_submodule("model.layers.1.self_attn.k_proj")
        # stacked with q and v, batched with layer 0's: the same codes (a float sum's order may differ)
        agree = (k_proj.qdata == alone.data).float().mean()
        assert agree >= 0.98 and torch.equal(k_proj.qtensor_scale, alone.tensor_scale)
