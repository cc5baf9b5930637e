"""Error decomposition (exact by construction and by test), corrections, AQN and the quant-report command."""

import copy
import json
import math

import pytest
import torch
from conftest import make_qwen
from hypothesis import given, settings
from hypothesis import strategies as st

from bitrl.quant import FORMATS, quantize
from bitrl.quant.analysis import error_decomposition, quantize_macroblock, quantize_outlier_fallback
from bitrl.quant.aqn import AQN, AQNSchedule, is_rmsnorm

CASES = [
    ("mxfp4", {}),
    ("mxfp4", {"scale_mode": "rceil"}),
    ("mxfp8", {}),
    ("nvfp4", {}),
    ("fp8_e4m3", {}),
    ("fp8_e4m3", {"granularity": "row"}),
    ("fp8_e5m2", {"block_size": 128}),
]


def outlier_weight(rows=96, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, torch.randperm(cols, generator=g)[:3]] *= 20.0
    return w


def adversarial(cols=96):
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.zeros(cols),
        torch.full((cols,), 1e-40),
        torch.linspace(-1, 1, cols) * 3e38,
        torch.randn(cols, generator=g) * 10.0 ** torch.randint(-30, 30, (cols,), generator=g).float(),
        torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.2] * 10)[:cols],
        torch.randn(cols, generator=g),
    ]
    return torch.stack(rows)


def _check_exact(x, fmt, kw, **extra):
    d = error_decomposition(x, fmt, **kw, **extra)
    assert torch.equal(d.scale_bias + d.deadzone + d.grid_noise, d.total)
    assert torch.equal(d.total, d.xhat - d.x)
    assert d.total.dtype == torch.float64
    # disjoint supports: the deadzone part lives only on flushed entries, the others only off them
    assert (d.scale_bias[d.flushed] == 0).all() and (d.grid_noise[d.flushed] == 0).all()
    assert torch.equal(d.deadzone[d.flushed], -d.x[d.flushed])
    return d


@pytest.mark.parametrize("fmt,kw", CASES, ids=[f"{f}{k}" for f, k in CASES])
def test_parts_sum_exactly(fmt, kw):
    for x in (outlier_weight(), adversarial(), torch.randn(3, 5, 40)):
        d = _check_exact(x, fmt, kw)
        xhat = quantize(x, fmt, **kw).dequantize().double()
        assert torch.equal(d.xhat, xhat)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    case=st.sampled_from(CASES),
    cols=st.integers(1, 100),
    log_scale=st.integers(-60, 60),
    spread=st.integers(0, 12),
    seed=st.integers(0, 1000),
)
def test_parts_sum_exactly_property(case, cols, log_scale, spread, seed):
    fmt, kw = case
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** (log_scale + torch.randint(-spread, spread + 1, (3, cols), generator=g).float())
    x = torch.randn(3, cols, generator=g) * mag
    _check_exact(x, fmt, kw)


def test_decomposition_by_hand():
    # FLOOR scale 2**0 (floor(log2 7) - 2 = 0), ideal scale 7/6
    x = torch.zeros(32)
    x[:3] = torch.tensor([7.0, 1.0, 0.1])
    d = error_decomposition(x, "mxfp4")
    s_star = torch.tensor(7.0) / 6.0  # float32
    assert d.xhat[:3].tolist() == [6.0, 1.0, 0.0]
    # 7: clipped to 6 by the power-of-two scale; with the ideal scale it is exact -> all scale bias
    assert d.scale_bias[0].item() == -1.0 and d.grid_noise[0].item() == 0.0
    # 1: 1 / (7/6) = 0.857 -> 1 -> ideal value 7/6; actual value 1
    ideal = float(s_star)
    assert d.grid_noise[1].item() == ideal - 1.0
    assert d.scale_bias[1].item() == 1.0 - ideal
    # 0.1: flushed
    assert d.flushed[2] and d.deadzone[2].item() == -float(torch.tensor(0.1))
    assert d.deadzone_fraction == pytest.approx(1 / 32)


def test_fp8_amax_scale_has_no_scale_bias_and_exact_mx_blocks_have_none():
    x = outlier_weight()
    d = error_decomposition(x, "fp8_e4m3")
    assert (d.scale_bias == 0).all()
    # a block whose amax is 6 * 2**k: the power-of-two FLOOR scale is the ideal scale
    y = torch.randn(4, 32)
    y[:, 0] = 6.0 * 2.0 ** torch.tensor([-3.0, 0.0, 2.0, 5.0])
    y[:, 1:] = y[:, 1:].clamp(-5.9, 5.9) * 2.0 ** torch.tensor([-3.0, 0.0, 2.0, 5.0])[:, None]
    assert (error_decomposition(y, "mxfp4").scale_bias == 0).all()


def test_energies_and_summary():
    d = error_decomposition(outlier_weight(), "mxfp4")
    e = d.energies()
    assert set(e) == {"total", "scale_bias", "deadzone", "grid_noise"}
    assert e["total"] == pytest.approx(d.rel_error**2)
    assert 0 < d.deadzone_fraction < 0.5
    assert d.summary()["E_deadzone"] == e["deadzone"]


def test_macroblock_shrinks_scale_bias():
    w = outlier_weight()
    base = error_decomposition(w, "mxfp4").energies()
    xm, info = quantize_macroblock(w, "mxfp4", macro_block=128)
    d = _check_exact(w, "mxfp4", {}, xhat=xm)
    assert d.energies()["scale_bias"] < base["scale_bias"] / 1.5
    assert d.energies()["total"] < base["total"]
    assert info["j"].shape == (96, 2) and info["overhead_bits_per_element"] == 8 / 128
    with pytest.raises(ValueError, match="macro_block"):
        quantize_macroblock(w, "mxfp4", macro_block=48)


def test_outlier_fallback_shrinks_deadzone():
    w = outlier_weight()
    base = error_decomposition(w, "mxfp4")
    xo, mask, info = quantize_outlier_fallback(w, "mxfp4", tau=8.0, clip_tol=None)
    d = _check_exact(w, "mxfp4", {}, xhat=xo, fallback=mask)
    assert d.energies()["deadzone"] < base.energies()["deadzone"] / 10
    assert d.deadzone_fraction < base.deadzone_fraction
    assert d.energies()["total"] < base.energies()["total"]
    assert 0 < info["fraction"] < 0.05
    assert torch.equal(xo[mask], w[mask].to(torch.bfloat16).float())
    # the fallback entries contribute only bf16 rounding, booked as grid noise
    assert (d.scale_bias[mask] == 0).all()
    _, mask2, _ = quantize_outlier_fallback(w, "mxfp4", tau=8.0, clip_tol=0.1)
    assert mask2.sum() >= mask.sum()


# ----------------------------------------------------------------------------------------------- AQN


def test_aqn_schedule():
    s = AQNSchedule(total_steps=100, num_stages=5)
    sig = s.sigmas()
    assert sig[0] == 0.0 and sig[1] == pytest.approx(1e-2) and sig[-1] == pytest.approx(1e-4)
    ratios = [sig[k + 1] / sig[k] for k in range(1, 4)]
    assert all(r == pytest.approx(ratios[0]) for r in ratios)  # geometric
    assert [s.stage(t) for t in (0, 19, 20, 99, 500)] == [0, 0, 1, 4, 4]
    assert s.sigma(0) == 0.0 and s.sigma(99) == pytest.approx(1e-4)
    assert AQNSchedule(10, num_stages=2).sigmas() == [0.0, 1e-2]
    with pytest.raises(ValueError, match="num_stages"):
        AQNSchedule(10, num_stages=1)
    with pytest.raises(ValueError, match="total_steps"):
        AQNSchedule(0)


def _tiny():
    pytest.importorskip("transformers")
    return make_qwen(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_aqn_applies_noise_without_accumulating():
    model = _tiny()
    norms = [m for n, m in model.named_modules() if is_rmsnorm(n, m)]
    assert len(norms) == 2 * 2 + 1
    clean = [m.weight.detach().clone() for m in norms]
    lin_before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    aqn = AQN(AQNSchedule(total_steps=5, num_stages=5), seed=3)
    assert aqn.apply_(model, 0) == 0.0
    assert all(torch.equal(m.weight, c) for m, c in zip(norms, clean))
    for _ in range(3):  # repeated calls re-draw around the clean weight
        assert aqn.apply_(model, 1) == pytest.approx(1e-2)
    dev = torch.cat([(m.weight.detach() - c).flatten() for m, c in zip(norms, clean)])
    assert 0.5e-2 < float(dev.std()) < 2e-2
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, lin_before)
    # reproducible per (seed, step)
    w1 = norms[0].weight.clone()
    aqn.apply_(model, 1)
    assert torch.equal(norms[0].weight, w1)
    # an external write (requantize_ copying the trainer's new norm) becomes the new clean weight
    with torch.no_grad():
        norms[0].weight.copy_(torch.full_like(norms[0].weight, 2.0))
    aqn.apply_(model, 4)
    assert float((norms[0].weight.detach() - 2.0).abs().max()) < 1e-3
    aqn.remove_(model)
    assert torch.equal(norms[0].weight, torch.full_like(norms[0].weight, 2.0))
    assert torch.equal(norms[1].weight, clean[1])


def test_aqn_with_requantize_loop():
    from bitrl.quant import quantize_model, requantize_

    policy = _tiny()
    qmodel = quantize_model(copy.deepcopy(policy), "mxfp4", source=policy)
    aqn = AQN(AQNSchedule(total_steps=4, num_stages=4))
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 6))
    for step in range(4):
        policy(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        requantize_(qmodel, policy)
        sigma = aqn.apply_(qmodel, step)
        diff = (qmodel.model.norm.weight.detach() - policy.model.norm.weight.detach()).abs().max()
        assert float(diff) <= 6 * sigma + 1e-7  # noise around the *current* trainer weight


# ----------------------------------------------------------------------------------------------- report


def test_report_on_tiny_model(tmp_path):
    from bitrl.quant.report import run_report

    lines = []
    rep = run_report(_tiny(), "mxfp4", out_dir=str(tmp_path), aqn_stages=3, print_fn=lines.append)
    text = "\n".join(lines)
    assert "scale-bias energy" in text and "deadzone energy" in text and "AQN" in text
    assert (tmp_path / "quant_report_mxfp4.png").stat().st_size > 1000
    data = json.loads((tmp_path / "quant_report_mxfp4.json").read_text())
    assert len(data["layers"]) == 14 and data["aqn"][1]["sigma"] == 0.0
    agg = rep["aggregate"]
    assert agg["macro_block"]["E_scale_bias"] < agg["base"]["E_scale_bias"]
    assert agg["outlier_fallback"]["E_deadzone"] <= agg["base"]["E_deadzone"]
    assert math.isclose(agg["base"]["rel_error"] ** 2, agg["base"]["E_total"])
    outs = {o["variant"]: o["kl_to_ref"] for o in rep["outputs"]}
    assert set(outs) == {"plain", "macro_block", "outlier_fallback"}
    # the fake-quantized model and the quantize_model (QuantLinear) model give the same outputs
    assert outs["plain"] == pytest.approx(rep["aqn"][1]["kl_to_ref"], rel=1e-4, abs=1e-9)


def test_report_cli(tmp_path, capsys):
    from bitrl.quant.report import main

    rc = main(["--demo", "--format", "nvfp4", "--hidden", "128", "--layers", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "outlier fallback" in out and "L0.q_proj" in out
    assert (tmp_path / "quant_report_nvfp4.png").exists()
    assert main(["--model", str(tmp_path / "missing"), "--format", "mxfp4"]) == 2
    with pytest.raises(SystemExit):
        main(["--format", "mxfp4"])  # --model or --demo is required


def test_report_cli_on_a_saved_model(tmp_path, capsys):
    from bitrl.quant.report import main

    _tiny().save_pretrained(tmp_path / "m")
    rc = main(
        ["--model", str(tmp_path / "m"), "--format", "mxfp4", "--out", str(tmp_path), "--aqn-stages", "2"]
    )
    assert rc == 0 and "macro-block scaling" in capsys.readouterr().out
    assert (tmp_path / "quant_report_mxfp4.json").exists()


def test_all_formats_known():
    assert set(FORMATS) == {"fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4"}
