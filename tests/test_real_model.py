"""The real-model path: a Hugging Face model directory (config.json + safetensors + tokenizer) and a JSONL
dataset with the math-answer reward, through the same `bitrl train` command."""

import json

import pytest
import torch


def save_tiny_hf_model(directory):
    """Write a random 2-layer Qwen2 model and a character-level fast tokenizer, as `save_pretrained` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = list("0123456789+-=?.,: abcdefghijklmnopqrstuvwxyz")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture
def model_dir(tmp_path):
    save_tiny_hf_model(tmp_path / "model")
    return tmp_path / "model"


def test_train_on_a_model_directory_and_jsonl(model_dir, tmp_path, monkeypatch):
    from bitrl.engine.cli import main

    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    data = tmp_path / "math.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"what is {i}+{i}?", "answer": 2 * i}) + "\n" for i in range(24))
    )
    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        f"model.path={model_dir}",
        "task.kind=jsonl",
        f"task.path={data}",
        "task.reward=math",
        "task.n_eval=4",
        "task.prompt_template={prompt} answer:",
        "warmstart.steps=3",
        "warmstart.target_accuracy=null",
        "rollout.prompts_per_step=2",
        "rollout.group_size=3",
        "rollout.max_new_tokens=5",
        "rollout.top_k=20",
        "steps=2",
        "eval_every=1",
        "name=real",
    ]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/real/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        for key in (
            "reward_mean",
            "accuracy",
            "loss",
            "entropy",
            "mismatch_k3_kl",
            "tokens_per_s",
            "step_time_s",
        ):
            assert key in r and r[key] == r[key], key  # present and not NaN
        # top-k rollouts sample from a narrower distribution than the trainer scores: a real mismatch
        assert r["mismatch_k3_kl"] > 0
    assert (tmp_path / "runs/real/report.png").is_file()


def test_model_path_errors(tmp_path, capsys):
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import build

    cfg = load_config(
        None, [f"model.path={tmp_path}", "task.kind=jsonl", f"task.path={tmp_path / 'x.jsonl'}"]
    )
    with pytest.raises(ValueError, match="task.path: no such file"):
        build(cfg)
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    with pytest.raises(ValueError, match="has no config.json"):
        build(cfg)
