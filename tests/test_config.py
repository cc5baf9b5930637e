import pytest

from bitrl.engine.cli import main as cli_main
from bitrl.engine.config import ConfigError, load_config


def test_defaults_are_the_demo():
    cfg = load_config()
    assert cfg.model.path is None and cfg.task.kind == "arithmetic" and cfg.name == "demo"


def test_overrides_and_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.002\nrollout:\n  group_size: 4\n")
    cfg = load_config(path, ["rollout.group_size=6", "name=x", "task.ops=+-"])
    assert cfg.train.lr == 0.002 and cfg.rollout.group_size == 6 and cfg.name == "x" and cfg.task.ops == "+-"


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.lrr=1", "train.lrr: unknown field"),
        ("bogus=1", "bogus: unknown field"),
        ("train.lr=-1", "train.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.group_size=zero", "rollout.group_size"),
        ("train.loss.loss_type=nope", "train.loss.loss_type"),
        ("train.loss.clip_ratio_c=0.5", "train.loss.clip_ratio_c"),
        ("train.clip_eps_low=0.1", "train.clip_eps_low was renamed train.loss.eps_low"),
        ("train.aggregation=token-mean", "train.aggregation was renamed train.loss.loss_agg_mode"),
        ("train.advantage=nope", "train.advantage"),
        ("task.reward=nope", "task.reward"),
        ("task.kind=jsonl", "task.path"),
        ("model.num_heads=3", "model.hidden_size must divide"),
        ("model.dtype=float64", "model.dtype"),
        ("train.loss_memory_budget=-1", "train.loss_memory_budget"),
        ("train.loss_memory_budget=1.5", "train.loss_memory_budget"),
        ("train.loss_memory_budget=lots", "train.loss_memory_budget"),
        ("train.loss_memory_budget=12XB", "train.loss_memory_budget"),
        ("train.loss_memory_budget=true", "train.loss_memory_budget"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["name=x", "name.y=1"])


def test_cli_stops_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "train.lrr=1"]) == 2
    assert "train.lrr: unknown field" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert cli_main(["nope"]) == 2
    assert cli_main(["--help"]) == 0


def test_correction_args():
    cfg = load_config(None, ["train.loss.correction=icepop", "train.loss.icepop_alpha=0.4"])
    assert cfg.train.loss.icepop_alpha == 0.4
    with pytest.raises(ConfigError, match=r"train\.loss\.alpha: unknown field"):
        load_config(None, ["train.loss.alpha=0.4"])
    with pytest.raises(ConfigError, match=r"rollout\.precision"):
        load_config(None, ["rollout.precision=int3"])


def test_device():
    import torch

    assert load_config(None, ["device=cpu"]).torch_device == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert load_config().torch_device.type == expected  # auto
    with pytest.raises(ConfigError, match="device"):
        load_config(None, ["device=gpu0"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"device.*'cuda:1' asked for, but .* no CUDA"):
            load_config(None, ["device=cuda:1"])


def test_pretrained_models_skip_the_warm_start_unless_asked():
    assert load_config().warmstart.steps == 1500  # the demo model needs it
    assert load_config(None, ["model.path=m"]).warmstart.steps == 0
    assert load_config(None, ["model.path=m", "warmstart.lr=0.01"]).warmstart.steps == 0
    assert load_config(None, ["model.path=m", "warmstart.steps=7"]).warmstart.steps == 7


def test_task_chat_fields():
    cfg = load_config(None, ["task.kind=words", "task.chat_template=none", "task.system_prompt=Be brief."])
    assert (
        cfg.task.kind == "words"
        and cfg.task.chat_template == "none"
        and cfg.task.system_prompt == "Be brief."
    )
    assert load_config().task.chat_template == "auto" and load_config().task.system_prompt is None
    with pytest.raises(ConfigError, match=r"task\.chat_template"):
        load_config(None, ["task.chat_template=chatml"])
    with pytest.raises(ConfigError, match=r"task\.kind"):
        load_config(None, ["task.kind=poems"])


def test_task_show_work_needs_the_words_task():
    assert load_config(None, ["task.kind=words", "task.show_work=true"]).task.show_work
    assert not load_config().task.show_work
    with pytest.raises(
        ConfigError, match=r"^invalid config: task: task\.show_work needs task\.kind 'words', got"
    ):
        load_config(None, ["task.show_work=true"])
    with pytest.raises(ConfigError, match=r"task\.show_work: Input should be a valid boolean"):
        load_config(None, ["task.kind=words", "task.show_work=often"])


def test_cli_preset_and_config_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--preset", "smollm2-add", "--config", str(tmp_path / "c.yaml")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_auto_settings_resolve_in_one_place():
    """train.autocast and train.fsdp_mixed_precision "auto", as the trainer and the memory plan read them."""
    import torch

    train = load_config().train
    assert train.autocast == "auto" and train.fsdp_mixed_precision == "auto"
    assert train.resolved_autocast("cuda", torch.float32) == "bf16"
    assert train.resolved_autocast("cpu", torch.float32) == "none"
    assert (
        train.resolved_autocast("cpu", torch.bfloat16) == train.resolved_autocast("cpu", "bfloat16") == "bf16"
    )
    assert train.resolved_autocast("cpu", "float16") == "fp16"
    assert load_config(None, ["train.autocast=fp16"]).train.resolved_autocast("cuda", torch.float32) == "fp16"
    assert train.resolved_fsdp_mixed_precision("cuda") == "bf16"
    assert train.resolved_fsdp_mixed_precision("cpu") == "none"
    assert (
        load_config(None, ["train.fsdp_mixed_precision=bf16"]).train.resolved_fsdp_mixed_precision("cpu")
        == "bf16"
    )


def test_the_rollout_recipe_resolves_its_autos_per_format():
    rollout = load_config(None, []).rollout
    mx, nv, fp8 = (rollout.quant_recipe(f) for f in ("mxfp4", "nvfp4", "fp8_e4m3"))
    assert (mx.scale_mode, mx.outlier_tau, mx.rotation, mx.fp8_layers) == ("mse", 8.0, None, ())
    assert (nv.scale_mode, nv.outlier_tau) == ("mse", None)
    assert (fp8.scale_mode, fp8.outlier_tau, fp8.quant_kwargs()) == ("floor", None, {})
    custom = load_config(
        None, ["rollout.scale_mode=rceil", "rollout.outlier_tau=4", "rollout.rotation=inputs"]
    ).rollout.quant_recipe("mxfp4", ("model.layers.0.mlp.down_proj",))
    assert custom.quant_kwargs() == {"scale_mode": "rceil", "outlier_tau": 4.0}
    assert (custom.rotation.mode, custom.rotation.block, custom.fp8_layers[0]) == (
        "inputs",
        32,
        "model.layers.0.mlp.down_proj",
    )
    with pytest.raises(ValueError, match="does not apply to nvfp4"):
        load_config(None, ["rollout.scale_mode=rceil"]).rollout.quant_recipe("nvfp4")
    for bad, field in (
        ("rollout.mx_scale_mode=floor", "renamed rollout.scale_mode"),
        ("rollout.outlier_tau=0", "outlier_tau"),
        ("rollout.rotation_block=24", "power of two"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(None, [bad])


def test_loss_memory_budget_takes_bytes_sizes_or_auto():
    read = lambda v: load_config(None, [f"train.loss_memory_budget={v}"]).train  # noqa: E731
    assert read("auto").loss_memory_budget == "auto" and read(0).loss_memory_budget == 0
    assert read("512MiB").loss_memory_budget == 512 * 2**20 and read("2GiB").loss_memory_budget == 2**31
    assert read("1.5GB").loss_memory_budget == 1_500_000_000 and read(4096).loss_memory_budget == 4096
    # auto is what the run's memory plan has to spare, or the ops' own default without a plan
    assert read("auto").resolved_loss_memory_budget(3e9) == 3_000_000_000
    assert read("auto").resolved_loss_memory_budget(None) is None
    assert read("1MiB").resolved_loss_memory_budget(3e9) == 2**20


def test_model_dtype_auto_follows_the_cpu_bf16_units(monkeypatch):
    from pathlib import Path

    import bitrl.kernels.bench_stats as bench_stats

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
    cfg = load_config(None, ["device=cpu", "model.dtype=auto"])
    native = bool(flags & {"amx_bf16", "avx512_bf16"})
    assert cfg.model.dtype == ("bfloat16" if native else "float32")
    assert "auto: this CPU has" in cfg.model.dtype_line
    # resolved once: what the run saves (config.json) names the dtype, not "auto"
    saved = cfg.model_dump()["model"]["dtype"]
    assert saved == cfg.model.dtype and load_config(None, [f"model.dtype={saved}"]).model.dtype == saved

    # both kinds of machine, whichever this is
    real = bench_stats.machine()
    monkeypatch.setattr(bench_stats, "machine", lambda: {**real, "native_bf16": []})
    cfg = load_config(None, ["device=cpu", "model.dtype=auto"])
    assert cfg.model.dtype == "float32" and "no bf16 units" in cfg.model.dtype_line
    monkeypatch.setattr(bench_stats, "machine", lambda: {**real, "native_bf16": ["amx_bf16"]})
    cfg = load_config(None, ["device=cpu", "model.dtype=auto"])
    assert cfg.model.dtype == "bfloat16" and "(amx_bf16)" in cfg.model.dtype_line
    # an explicit dtype is never overridden, and says nothing about the machine
    assert load_config(None, ["model.dtype=float32"]).model.dtype_line == "model.dtype float32"


def test_aqn_on_the_policy_needs_lora():
    with pytest.raises(ConfigError, match="aqn_target=policy: needs LoRA"):
        load_config(None, ["rollout.aqn_stages=3", "rollout.aqn_target=policy"])
    cfg = load_config(None, ["rollout.aqn_stages=3", "rollout.aqn_target=policy", "model.lora.rank=4"])
    assert cfg.rollout.aqn_target == "policy"
