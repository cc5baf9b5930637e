import json

import pytest
import torch

from bitrl.engine.mismatch_cmd import main, read_external
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.settings import Sampling


def test_demo_mxfp4_writes_summary_and_plot(tmp_path):
    assert (
        main(["--demo", "--rollout-precision", "mxfp4", "--num-prompts", "16", "--out", str(tmp_path)]) == 0
    )
    summary = json.loads((tmp_path / "mismatch.json").read_text())
    assert summary["num_tokens"] > 0 and summary["mismatch_k3_kl"] > 1e-5  # 4-bit weights do move the policy
    assert (tmp_path / "mismatch.png").stat().st_size > 0


def test_external_file_from_the_same_model_has_no_mismatch(tmp_path, hf_model_dir):
    from transformers import AutoModelForCausalLM

    model_dir = hf_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[1, 10, 11, 12], [1, 13]]
    r = RolloutEngine(model, Sampling(max_new_tokens=6, eos_id=2, pad_id=0)).generate(
        prompts, generator=torch.Generator().manual_seed(0)
    )
    path = tmp_path / "ext.jsonl"
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            m = r.response_mask[i]
            row = {
                "prompt_ids": p,
                "response_ids": r.response_ids[i][m].tolist(),
                "logprobs": r.logprobs[i][m].tolist(),
            }
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "out"
    assert main(["--model", str(model_dir), "--external", str(path), "--out", str(out)]) == 0
    summary = json.loads((out / "mismatch.json").read_text())
    assert summary["mismatch_k3_kl"] < 1e-9 and summary["mismatch_max_abs_dp"] < 1e-5


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "line_file.jsonl:2: not valid JSON"),
        ('{"prompt_ids": [1], "response_ids": [3]}', "line_file.jsonl:2: missing field 'logprobs'"),
        (
            '{"prompt_ids": [1], "response_ids": [3], "logprobs": [-0.1, -0.2]}',
            "field 'logprobs' has 2 values",
        ),
        ('{"prompt_ids": [1], "response_ids": [99], "logprobs": [-0.1]}', "field 'response_ids' holds 99"),
        (
            '{"prompt_ids": [], "response_ids": [3], "logprobs": [-0.1]}',
            "field 'prompt_ids' must be a non-empty",
        ),
        ('{"prompt_ids": [1], "response_ids": [3], "logprobs": [0.5]}', "field 'logprobs' holds 0.5"),
        ('{"prompt_ids": [1], "response_ids": [3], "logprobs": [NaN]}', "field 'logprobs' holds nan"),
    ],
)
def test_malformed_external_file_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "line_file.jsonl"
    path.write_text('{"prompt_ids": [1], "response_ids": [3], "logprobs": [-0.1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("'", "'")):
        read_external(path, vocab_size=16)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["--demo", "--rollout-precision", "int3", "--out", str(tmp_path)]) == 2
    assert "--rollout-precision must be one of" in capsys.readouterr().err
