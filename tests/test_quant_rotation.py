"""4-bit rollout remedies: the block Hadamard rotation (reference, torch and Triton paths), rotated rollout
copies (equal to the unrotated model up to rounding, refreshed by a sync), error-chosen block scales, and
the outlier fallback of QuantLinear."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bitrl.kernels._common import HAS_TRITON
from bitrl.kernels.hadamard import block_hadamard, block_hadamard_reference, random_signs
from bitrl.quant import QuantLinear, fake_quantize, quantize, quantize_model
from bitrl.quant.formats import get_format
from bitrl.quant.rotation import Rotation, rotate_model_, sync_rotated_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding of the output, plus fp32 sums over a block in another order
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def sylvester(b: int) -> torch.Tensor:
    """H_b by its definition H[i, j] = (-1)^popcount(i & j), in float64."""
    i = torch.arange(b)
    bits = (i[:, None] & i[None, :]).tolist()
    return torch.tensor([[(-1.0) ** bin(v).count("1") for v in row] for row in bits], dtype=torch.float64)


def test_the_reference_is_the_orthogonal_block_hadamard_matrix():
    b, n = 8, 24
    signs = random_signs(n, 3)
    rotation = block_hadamard_reference(torch.eye(n, dtype=torch.float64), signs, b)
    h = sylvester(b) / math.sqrt(b)
    for k in range(n // b):
        block = rotation[k * b : (k + 1) * b, k * b : (k + 1) * b]
        assert torch.equal(block, signs[k * b : (k + 1) * b, None].double() * h)
    assert torch.allclose(rotation @ rotation.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert rotation.abs().sum() == pytest.approx(n * b / math.sqrt(b))  # nothing off the diagonal blocks


IMPLS = ["torch", *(["triton"] if HAS_TRITON else [])]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("transpose", [False, True])
def test_block_hadamard_matches_the_dense_reference(impl, dtype, block, transpose):
    g = torch.Generator().manual_seed(block + transpose)
    rows = int(torch.randint(1, 70, (1,), generator=g))
    n = block * int(torch.randint(1, 4, (1,), generator=g))
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    signs = random_signs(n, block)
    ref = block_hadamard_reference(x, signs, block, transpose)
    out = block_hadamard(x, signs, block, transpose, impl=impl)
    assert out.dtype == dtype and out.shape == x.shape
    scale = ref.double().abs().amax(-1, keepdim=True).clamp(min=1)
    assert ((out.double() - ref.double()).abs() / scale).max() <= ULP[dtype]
    back = block_hadamard(out.float(), signs, block, not transpose, impl=impl)
    assert torch.allclose(back, x.float(), atol=4 * ULP[dtype] * float(x.float().abs().max()))


@pytest.mark.parametrize("impl", IMPLS)
def test_block_hadamard_spreads_a_nan_over_its_block_and_no_further(impl):
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    out = block_hadamard(x, random_signs(64, 0), 32, impl=impl)
    assert out[1, :32].isnan().all() and out[1, 32:].isfinite().all()
    assert not out[2, 32:].isfinite().any() and out[2, :32].isfinite().all()
    assert out[0].isfinite().all()


def test_block_hadamard_rejects_bad_input():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="power of two"):
        block_hadamard(x, random_signs(48, 0), 24)
    with pytest.raises(ValueError, match="does not divide"):
        block_hadamard(x, random_signs(48, 0), 32)
    with pytest.raises(ValueError, match="signs"):
        block_hadamard(x, random_signs(47, 0), 16)
    with pytest.raises(ValueError, match="floating"):
        block_hadamard(torch.ones(2, 16, dtype=torch.int32), random_signs(16, 0), 16)


def tiny_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    model = model_cls(config_cls(**shape, **heads)).eval()
    with torch.no_grad():  # norms and biases away from their init, so that folding them is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.3, 2.0)
            elif name.endswith("bias"):
                p.normal_()
    return model


ROTATIONS = [Rotation("residual", 32), Rotation("residual", 16, seed=5), Rotation("inputs", 32)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rotation", ROTATIONS, ids=lambda r: f"{r.mode}-{r.block}")
def test_a_rotated_copy_computes_the_same_function(arch, rotation):
    model = tiny_model(arch)
    ids = torch.randint(0, 96, (3, 11))
    with torch.no_grad():
        want = model(ids).logits
        rotated = rotate_model_(copy.deepcopy(model), rotation)
        got = rotated(ids).logits
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the source stays tied
    # fp32: a few roundings per layer over sums of 64-96 terms
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    q_proj = rotated.model.layers[0].self_attn.q_proj
    q_proj = q_proj.inner if rotation.mode == "inputs" else q_proj
    assert not torch.equal(q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)  # it did rotate


@pytest.mark.parametrize("rotation", ROTATIONS, ids=lambda r: f"{r.mode}-{r.block}")
def test_a_sync_refreshes_a_rotated_quantized_copy_from_the_policy(rotation):
    policy = tiny_model("qwen2")
    ids = torch.randint(0, 96, (2, 7))
    rollout = rotate_model_(copy.deepcopy(policy), rotation)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        want = policy(ids).logits
        stale = (rollout(ids).logits - want).abs().max()
        stats = sync_rotated_(rollout, policy, rotation)
        assert (rollout(ids).logits - want).abs().max() <= 1e-5 * want.abs().max() < stale
        assert stats["rotated"] > 0
        # quantized: the sync re-quantizes the rotated weights, matching a fresh rotated copy bit for bit
        q = quantize_model(rotate_model_(copy.deepcopy(policy), rotation), "nvfp4", act=None)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        sync_rotated_(q, policy, rotation)
        fresh = quantize_model(rotate_model_(copy.deepcopy(policy), rotation), "nvfp4", act=None)
        assert torch.equal(q(ids).logits, fresh(ids).logits)


def test_rotation_settings_are_checked():
    with pytest.raises(ValueError, match="rollout.rotation must be"):
        Rotation("spin")
    with pytest.raises(ValueError, match="power of two"):
        Rotation("inputs", 12)


# ---------------------------------------------------------------------------------- error-chosen scales


def block_sse(x: torch.Tensor, xq: torch.Tensor, bw: int) -> torch.Tensor:
    return (xq.double() - x.double()).square().view(x.shape[0], -1, bw).sum(-1)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_mse_scales_never_lose_to_the_amax_scale_in_any_block(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 4
    x[3, 7] = 40.0  # an outlier: its block's best scale clips it
    bw = get_format(fmt).block_size
    qt = quantize(x, fmt, scale_mode="mse")
    assert qt.scale_mode == "mse" and qt.data.dtype == quantize(x, fmt).data.dtype
    mse = block_sse(x, qt.dequantize(), bw)
    for mode in ("floor", "rceil") if fmt.startswith("mx") else ("floor",):
        base = block_sse(x, fake_quantize(x, fmt, scale_mode=mode), bw)
        assert (mse <= base * (1 + 1e-12)).all()
        if mode == "floor":
            assert mse.sum() < base.sum()  # and it does better somewhere
    # the stored scales are the format's own: dequantizing by hand from them gives the same values
    assert torch.equal(quantize(qt.dequantize(), fmt, scale_mode="mse").dequantize(), qt.dequantize())


def test_mse_scales_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="scale_mode"):
        quantize(torch.randn(4, 32), "fp8_e4m3", scale_mode="mse")
    with pytest.raises(ValueError, match="torch path"):
        quantize(torch.randn(4, 32), "mxfp4", scale_mode="mse", backend="triton")


# ------------------------------------------------------------------------------------------ outlier fallback


def by_hand_outliers(w: torch.Tensor, bw: int, tau: float) -> torch.Tensor:
    mags = w.abs().view(w.shape[0], -1, bw)
    med = mags.median(dim=-1, keepdim=True).values
    return (mags > tau * med).view(w.shape)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_fallback_keeps_the_outliers_in_bf16_and_quantizes_the_rest_without_them(fmt, dtype):
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(128, 48, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=g) * 0.02)
        linear.weight[5, 9] = 0.9
        linear.weight[40, 100] = -0.5
    w = linear.weight.detach().float()
    bw = get_format(fmt).block_size
    mask = by_hand_outliers(w, bw, 6.0)
    assert mask[5, 9] and mask[40, 100]
    q = QuantLinear.from_linear(linear, fmt, act=None, outlier_tau=6.0)
    inliers = fake_quantize(w.masked_fill(mask, 0.0), fmt).float()
    want = torch.where(mask, w.to(torch.bfloat16).float(), inliers)
    assert torch.equal(q.dequantized_weight(torch.float32), want)
    # the fused paths add the outliers to the product of the inliers: the same output up to summation order
    x = torch.randn(5, 128, generator=g).to(dtype)
    plain = QuantLinear.from_linear(linear, fmt, act=None)
    plain.set_weight(w.masked_fill(mask, 0.0).to(dtype))
    plain.bias.data.copy_(linear.bias.detach())
    fused = q._add_outliers(x, torch.nn.functional.linear(x, plain.dequantized_weight(dtype), plain.bias))
    assert torch.allclose(fused.float(), q(x).float(), atol=8 * ULP[dtype], rtol=8 * ULP[dtype])
    kept = q.outlier_index.numel() * (4 + 2)
    assert q.resident_bytes() >= plain.resident_bytes() + kept


def test_outlier_fallback_lowers_the_error_of_a_block_with_one_large_weight():
    w = torch.randn(16, 64) * 0.01
    w[0, 3] = 1.0
    err = {}
    for tau in (None, 8.0):
        layer = QuantLinear(64, 16, bias=False, fmt="mxfp4", act=None, outlier_tau=tau)
        layer.set_weight(w)
        err[tau] = float((layer.dequantized_weight() - w)[0, :32].abs().sum())
    assert err[8.0] < 0.25 * err[None]
    with pytest.raises(ValueError, match="outlier_tau"):
        QuantLinear(64, 16, fmt="mxfp4", outlier_tau=0.0)


# ------------------------------------------------------------------------------------ the recipe in a rollout


def test_a_recipe_builds_and_syncs_a_rollout_copy_with_its_fp8_layers_and_rotation():
    from bitrl.quant.recipe import recipe_for
    from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_

    policy = tiny_model("llama")
    keep = ("model.layers.1.mlp.down_proj",)
    recipe = recipe_for("nvfp4", outlier_tau=6.0, rotation=Rotation("residual", 32), fp8_layers=keep)
    rollout = make_rollout_model(policy, "nvfp4", recipe)
    formats = {n: m.fmt for n, m in rollout.named_modules() if isinstance(m, QuantLinear)}
    assert formats.pop("model.layers.1.mlp.down_proj.inner") == "fp8_e4m3"
    assert set(formats.values()) == {"nvfp4"} and len(formats) == 13
    assert all(
        m.outlier_tau == 6.0 for m in rollout.modules() if isinstance(m, QuantLinear) and m.fmt == "nvfp4"
    )
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        sync_rollout_model_(rollout, policy, "nvfp4")
        fresh = make_rollout_model(policy, "nvfp4", recipe)
        assert torch.equal(rollout(ids).logits, fresh(ids).logits)
    with pytest.raises(ValueError, match="no module"):
        make_rollout_model(policy, "nvfp4", recipe_for("nvfp4", fp8_layers=("model.layers.9.mlp",)))
    with pytest.raises(ValueError, match="format"):
        make_rollout_model(policy, "mxfp4", recipe)


def test_bitrl_mismatch_takes_the_rollout_recipe_as_overrides(tmp_path):
    import json

    from bitrl.engine.mismatch_cmd import main

    args = ["--demo", "--rollout-precision", "nvfp4", "--num-prompts", "8", "--out", str(tmp_path)]
    assert main([*args, "rollout.scale_mode=floor", "rollout.fp8_layers=2"]) == 0
    assert json.loads((tmp_path / "mismatch.json").read_text())["num_tokens"] > 0
    assert main([*args, "train.lr=1"]) == 2  # only rollout.* settings
