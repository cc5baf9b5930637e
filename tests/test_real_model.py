"""The real-model path: a Hugging Face model directory (config.json + safetensors + tokenizer) and a JSONL
dataset with the math-answer reward, through the same `bitrl train` command."""

import json

import pytest


def test_train_on_a_model_directory_and_jsonl(hf_model_dir, tmp_path, monkeypatch):
    model_dir = hf_model_dir
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
            "flat_group_frac",
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
