"""The memory plan: a pure function of (config, model config, world size, device memory) that refuses a run
that will not fit, and the `bitrl train` refusal."""

import pytest
from transformers import LlamaConfig

from bitrl.engine.config import load_config
from bitrl.train.memory import GiB, ModelShape, plan_memory

# SmolLM2-135M's architecture
SMOLLM2 = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def plan(*overrides, world_size=1, device=64 * GiB):
    cfg = load_config(overrides=["device=cpu", *overrides])
    return plan_memory(cfg, SMOLLM2, world_size=world_size, device_bytes=device, prompt_tokens=64)


def test_parameter_count_matches_the_model():
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(SMOLLM2)
    assert ModelShape.from_config(SMOLLM2).params == sum(p.numel() for p in model.parameters())


def test_parts_follow_the_settings():
    fp32 = plan()
    n = fp32.parts["_trainable_params"]
    assert fp32.parts["weights"] == n * 4 and fp32.parts["optimizer"] == 2 * n * 4
    sharded = plan(world_size=4)
    for part in ("weights", "gradients", "optimizer"):
        assert sharded.parts[part] == pytest.approx(fp32.parts[part] / 4)
    assert sharded.parts["kv_cache"] < fp32.parts["kv_cache"]  # each rank rolls out its share of groups

    ckpt = plan("train.gradient_checkpointing=true")
    assert ckpt.parts["activations"] < fp32.parts["activations"] / 5
    micro = plan("train.micro_batch_tokens=1024")
    assert micro.parts["activations"] < fp32.parts["activations"] / 5

    lora = plan("model.lora.rank=16", "model.dtype=bfloat16")
    assert lora.parts["optimizer"] < fp32.parts["optimizer"] / 20  # rank 16: 3.6% of the parameters
    assert lora.parts["weights"] < fp32.parts["weights"] / 1.8
    qerl = plan("model.lora.rank=16", "model.dtype=bfloat16", "model.lora.base_precision=nvfp4", "device=cpu")
    plain_bf16 = plan("train.master_weights=model", "model.dtype=bfloat16")
    assert plain_bf16.parts["optimizer"] == fp32.parts["optimizer"] / 2
    assert qerl.parts["rollout_copy"] < lora.parts["rollout_copy"] / 10  # only the adapters are copied
    assert plan("rollout.precision=nvfp4", "model.dtype=bfloat16").parts["rollout_copy"] > 0


def test_plan_line_names_every_part():
    line = plan().line()
    assert line.startswith("memory plan: ")
    for part in ("weights", "gradients", "optimizer", "rollout_copy", "kv_cache", "activations", "without"):
        assert part in line


def test_an_oversized_run_is_refused_with_the_settings_to_change():
    fits = plan(device=64 * GiB)
    assert fits.refusal() is None
    refused = plan(device=2 * GiB)
    message = refused.refusal()
    assert message and "--force" in message and "GiB" in message
    assert "model.lora.rank" in message and "train.gradient_checkpointing=true" in message


def test_bitrl_train_refuses_before_building_the_model(tmp_path, capsys):
    from bitrl.engine.cli import main

    huge = [
        "model.hidden_size=8192",
        "model.intermediate_size=28672",
        "model.num_layers=80",
        "model.num_heads=64",
        "model.num_kv_heads=8",
    ]  # a 70B-parameter demo model: building it would exhaust the memory long before training
    assert main(["train", f"out_dir={tmp_path}", *huge]) == 2
    err = capsys.readouterr()
    assert "memory plan: " in err.out and "bitrl train: memory plan: the run needs" in err.err
    assert "--force" in err.err


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        plan(world_size=0)
