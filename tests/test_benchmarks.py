"""Smoke tests of the benchmark scripts at tiny sizes: they run end to end and tabulate what they measured
(their figures come from running them, never from tests)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_DEMO_MODEL

from bitrl.benchmarks import bench_reuse
from bitrl.kernels.bench_stats import mean_ci95

TINY = [
    *TINY_DEMO_MODEL,
    "task.n_eval=16",
    "warmstart.steps=10",
    "warmstart.target_accuracy=null",
    "rollout.group_size=2",
]


def test_mean_ci95_by_hand():
    mean, half = mean_ci95([1.0, 3.0])  # sd sqrt(2), n 2, t(1) 12.71: half-width 12.71
    assert mean == 2.0 and half == pytest.approx(12.71)
    with pytest.raises(ValueError, match="at least two"):
        mean_ci95([1.0])


def test_bench_reuse_runs_and_merges_seeds(tmp_path):
    """Two arms, two seeds in two runs, then one merged table with the gap paired by seed."""
    for seed in ("0", "1"):
        args = ["--epochs", "2", "--prompts", "8", "--prompts-per-step", "4", "--seeds", seed]
        args += ["--arms", "no reuse", "exact l=1", "--out", str(tmp_path / seed), "--set", *TINY]
        assert bench_reuse.main(args) == 0
    merge = ["--merge", str(tmp_path / "0"), str(tmp_path / "1"), "--out", str(tmp_path)]
    assert bench_reuse.main(merge) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert sorted((r["arm"], r["seed"]) for r in rows) == [
        ("exact l=1", 0),
        ("exact l=1", 1),
        ("no reuse", 0),
        ("no reuse", 1),
    ]
    reuse = [r for r in rows if r["arm"] == "exact l=1"]
    assert all(0.0 <= r["full_reuse_frac"] <= 1.0 and r["generated_over_returned"] <= 1.0 for r in reuse)
    # every rollout puts its 4 prompts through the model, each longer than one token
    assert all(r["model_tokens_per_rollout_later"] > 4 and r["forwards_per_rollout_later"] >= 1 for r in rows)
    line = next(x for x in (tmp_path / "table.md").read_text().splitlines() if x.startswith("| exact l=1 |"))
    assert "| 2 |" in line and " ± " in line  # two seeds, and a paired gap with its interval
    for r in rows:  # per rollout after the first epoch: 4 prompts x 2 samples
        assert r["rows_per_rollout"] == 8 and 0 < r["response_tokens_mean"] <= 6
        assert 0 <= r["generated_per_rollout_later"] <= r["returned_per_rollout_later"] <= 8 * 6
        assert r["rollout_wall_s_per_rollout_later"] > 0 and r["rollout_cpu_s_per_rollout_later"] > 0
    fresh = [r for r in rows if r["arm"] == "no reuse"]
    assert all(r["generated_per_rollout_later"] == r["returned_per_rollout_later"] for r in fresh)
    # the per-rollout table: each measure with its paired ratio to no reuse and that ratio's interval
    per_rollout = (tmp_path / "table.md").read_text().split("Per rollout, epochs 2+:")[1]
    line = next(x for x in per_rollout.splitlines() if x.startswith("| exact l=1 |"))
    # (an arm that generated nothing in a seed is reported by seed totals, its per-seed ratio being infinite)
    assert line.count("x ± ") + line.count("(seed totals;") == 4


def test_bench_decode_runs_on_a_tiny_model(tmp_path):
    """The GPU decode-bandwidth benchmark's code path, on the CPU at a tiny size (figures: GPU only)."""
    from bitrl.benchmarks import bench_decode

    out = tmp_path / "decode.json"
    args = ["--tiny", "--device", "cpu", "--rows", "2", "--prompt-len", "4", "--new-tokens", "48"]
    bench_decode.main(
        [*args, "--reps", "1", "--copy-gib", "0.001", "--precisions", "full", "nvfp4", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    full, nvfp4 = result["results"]
    assert full["precision"] == "full" and full["step_ms"] > 0 and full["fraction_of_bandwidth"] > 0
    assert nvfp4["weight_mib"] < 0.5 * full["weight_mib"]  # packed 4-bit weights (the tied head stays bf16)


def test_bench_attention_cpu_times_both_forms_and_checks_its_width(tmp_path):
    """The CPU attention benchmark at a small shape: both forms timed, the bytes counted, the JSON written."""
    from bitrl.benchmarks import bench_attention_cpu

    out = tmp_path / "attention.json"
    args = ["--rows", "2", "--kv-heads", "1", "--group", "2", "--head-dim", "16", "--width", "5"]
    result = bench_attention_cpu.main(
        [*args, "--columns", "8", "--layers", "3", "--reps", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert set(result["ms_per_step"]) == {"from memory", "resident"}
    assert all(t > 0 for t in result["ms_per_step"].values())
    assert result["kv_bytes_per_step"] == 3 * 2 * 1 * 5 * 16 * 4 * 2
    with pytest.raises(SystemExit, match="--width 9 exceeds --columns 8"):
        bench_attention_cpu.main([*args[:-1], "9", "--columns", "8"])


def test_bench_gptq_sync_times_the_hessians_and_the_loop(tmp_path):
    """The GPTQ sync benchmark on the tiny demo model: every batch size timed, whole syncs re-round every FP4
    layer, the JSON written."""
    from bitrl.benchmarks import bench_gptq_sync

    out = tmp_path / "gptq_sync.json"
    sets = [*TINY_DEMO_MODEL, "rollout.gptq=true", "rollout.gptq_prompts=4"]
    result = bench_gptq_sync.main(
        ["--demo", "--batch-tokens", "1", "32", "--reps", "1", "--out", str(out), "--set", *sets]
    )
    assert json.loads(out.read_text()) == result
    assert set(result["hessians_s"]) == {"1", "32", str(result["library_batch_tokens"])}
    assert result["gptq_layers"] > 0 and result["calibration_sequences"] == 4
    assert result["sync_s"] > 0 and all(t > 0 for t in result["hessians_s"].values())
    with pytest.raises(SystemExit, match="--batch-tokens must be >= 1"):
        bench_gptq_sync.main(["--demo", "--batch-tokens", "0"])


def test_gemm_meter_counts_products_and_rounds_bf16_once():
    """The bf16 stand-in: fp32 sums of the bf16 operands, rounded once; every product form counted."""
    from bitrl.benchmarks.bench_gemm_floor import GemmMeter

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).bfloat16() for s in ((5, 7), (7, 3)))
    out, acc = torch.empty(5, 3, dtype=torch.bfloat16), torch.zeros(5, 3)
    meter = GemmMeter()
    with meter:
        c = a @ b
        torch.mm(a, b, out=out)
        acc.addmm_(a.float(), b.float())
    want = a.float() @ b.float()
    assert c.dtype == torch.bfloat16 and torch.equal(c, want.bfloat16()) and torch.equal(out, c)
    assert torch.equal(acc, want)
    assert meter.madds == 3 * 5 * 7 * 3


def test_bench_gemm_floor_bf16_split(tmp_path):
    """At a tiny size: naive torch runs 3 products; bitrl's GRPO tiles keep every product at the default
    memory budget, so 3 over the 7/8 of tokens that are not padding; its log-prob + entropy keeps every logit,
    so 3."""
    from bitrl.benchmarks import bench_gemm_floor

    out = tmp_path / "floor.json"
    assert bench_gemm_floor.main(["--bf16", "--shape", "64x1024", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["bf16/64x1024"]
    products = {k: v["products"] for k, v in rows.items() if isinstance(v, dict) and "products" in v}
    assert products == pytest.approx(
        {
            "grpo_loss/bitrl": 3 * 7 / 8,
            "grpo_loss/naive": 3.0,
            "logprob_entropy/bitrl": 3.0,
            "logprob_entropy/naive": 3.0,
        }
    )
    assert all(v["rest_s"] > 0 for k, v in rows.items() if k in products)
    assert set(rows["grpo_loss/ratio_at"]) == {"fp32/1", "fp32/2", "fp32/4", "fp32/8", "fp32/16"}


def test_trainer_floor_counts_the_steps_products():
    """bench_trainer's floor: the products of one SmolLM2-135M step, counted against the model's shape."""
    from bitrl.benchmarks import bench_trainer
    from bitrl.engine.models import architecture_config

    c = architecture_config("smollm2-135m")
    rows, prompt, response = 2, 8, 4
    T = prompt + response
    products, dtype, trains = bench_trainer.arm_products("fp32", rows, prompt, response)
    flops = sum(count * 2 * m * k * n * abs(batch) for count, (m, k), (_, n), batch in products)
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    H, inter = c.hidden_size, c.intermediate_size
    per_token = c.num_hidden_layers * (2 * H * H + 2 * H * kv + 3 * H * inter)  # q, o; k, v; gate, up, down
    expected = 2 * rows * T * per_token + 2 * rows * response * H * c.vocab_size
    expected += c.num_hidden_layers * rows * c.num_attention_heads * 2 * T * T * H // c.num_attention_heads
    assert flops == expected and (dtype, trains) == ("float32", True)
    for arm, kind in [("LoRA r16, bf16 base", ("bfloat16", False)), ("LoRA r16, fp32", ("float32", False))]:
        assert bench_trainer.arm_products(arm, rows, prompt, response)[1:] == kind
    for arm in ("bf16 autocast, fp32 master", "bf16 plain + ckpt"):  # bf16 products, every weight trains
        assert bench_trainer.arm_products(arm, rows, prompt, response)[1:] == ("bfloat16", True)
    small = [(1, (4, 8), (8, 16), 1), (2, (3, 4), (4, 3), -2)]
    for backward in (False, True):  # timed products, each a positive time
        assert bench_trainer.floor_seconds(small, "float32", True, backward=backward) > 0


def test_rollout_kv_floor_counts_each_decode_tokens_context():
    """bench_rollout's floor+kv: the token fed at response position j of a p-token prompt reads p + j
    columns of K and V in every layer and KV head, in the cache's dtype; the stream rate is a rate."""
    from conftest import TINY_QWEN, make_qwen

    from bitrl.benchmarks import bench_rollout

    model = make_qwen(**TINY_QWEN)  # 2 layers, 2 KV heads of 32 / 4 = 8 dims
    prompts, new = [[1, 2, 3], [4, 5]], 4
    columns = sum(len(p) + j for p in prompts for j in range(1, new))
    per_column_fp32 = 2 * 2 * 8 * 2 * 4  # layers x KV heads x dims x (K, V) x bytes
    assert bench_rollout.kv_read_bytes(model, prompts, new, torch.float32) == columns * per_column_fp32
    assert bench_rollout.kv_read_bytes(model, prompts, new, torch.bfloat16) == columns * per_column_fp32 // 2
    assert bench_rollout.stream_bandwidth(megabytes=8, passes=1) > 1e8


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packed products need oneDNN")
def test_rollout_floor_packs_the_products_where_the_decoder_does(monkeypatch):
    """Where the decoder packs its products, the floor times them packed and stacked as it runs them: each
    layer's q, k, v as one product, o, gate, up, down; then the head."""
    from conftest import TINY_QWEN, make_qwen

    import bitrl.rollout.decoder as decoder
    from bitrl.benchmarks import bench_rollout
    from bitrl.kernels.packed_linear import packed_linear

    monkeypatch.setattr(decoder, "use_packed_linear", lambda dtype, device: True)
    model = make_qwen(**TINY_QWEN)
    products = bench_rollout.floor_products(model, rows=64)
    assert len(products) == 2 * 5 + 1 and all(p.func is packed_linear for p in products)
    q, k, v = (getattr(model.model.layers[0].self_attn, f"{n}_proj") for n in "qkv")
    assert products[0].args[1].out_features == q.out_features + k.out_features + v.out_features
    assert products[0].args[1].bias is not None  # Qwen2's q, k, v biases, stacked
    assert products[-1].args[1].out_features == model.config.vocab_size
    assert bench_rollout.linear_products(model, rows=64, passes=1) > 0


def test_rollout_floor_times_each_product_in_the_decode_steps_form(monkeypatch):
    """bench_rollout's floor: one product per linear layer in the form the decoder takes (counted as
    x @ weight.T they would let the engine beat its own floor): without packed products, the layers'
    weight-major at 16-256 rows, the wide fp32 head by blocks, whatever the weights' requires_grad."""
    from conftest import TINY_QWEN, make_qwen

    import bitrl.rollout.decoder as decoder
    from bitrl.benchmarks import bench_rollout
    from bitrl.kernels.weight_major import WEIGHT_MAJOR_BLOCK, weight_major_linear

    monkeypatch.setattr(decoder, "use_packed_linear", lambda dtype, device: False)
    model = make_qwen(**{**TINY_QWEN, "vocab_size": WEIGHT_MAJOR_BLOCK + 100})
    assert model.lm_head.weight.requires_grad
    products = bench_rollout.floor_products(model, rows=64)
    assert len(products) == 2 * 7 + 1
    assert [p.func is weight_major_linear for p in products] == [False] * 14 + [True]
    # the layers' products as the feature-major step runs them: weight @ x_t, x_t [K, 64]
    assert all(p.func is bench_rollout._weight_major_mm and p.args[0].shape[1] == 64 for p in products[:14])
    few = bench_rollout.floor_products(model, rows=4)  # few rows: x @ weight.T throughout
    assert all(p.func is bench_rollout._mm_t for p in few)
    assert bench_rollout.linear_products(model, rows=64, passes=1) > 0


def test_rollout_bench_runs_the_engine_with_and_without_packed_products(monkeypatch):
    """bench_rollout's "new-unpacked" engine: the same samples as "new" but through the modules' products."""
    from conftest import TINY_QWEN, make_qwen

    import bitrl.rollout.decoder as decoder
    from bitrl.benchmarks import bench_rollout

    monkeypatch.setattr(decoder, "use_packed_linear", lambda dtype, device: True)
    model = make_qwen(**TINY_QWEN)
    calls = []
    real = decoder.packed_linear
    monkeypatch.setattr(decoder, "packed_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [[1, 5, 6], [1, 7]] * 8
    assert bench_rollout.run_engine("new-unpacked", model, prompts, 4, -1, 0, 0, None) == 16 * 4
    assert not calls
    assert bench_rollout.run_engine("new", model, prompts, 4, -1, 0, 0, None) == 16 * 4
    assert calls
