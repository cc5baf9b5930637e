"""The RL loop: rollout -> reward -> advantages -> train -> weight sync, with evaluation, metrics and
checkpoints. Read `run` top to bottom for one whole training run."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from bitrl.engine.config import Config, ConfigError
from bitrl.engine.evaluate import accuracy, encode_prompts, score
from bitrl.engine.models import (
    build_demo_model,
    load_pretrained,
    load_tokenizer,
    model_directory,
    resolve_model_source,
)
from bitrl.engine.report import plot_metrics
from bitrl.engine.tasks import REWARDS, ArithmeticTask, CharTokenizer, InputError, JsonlTask, WordsTask
from bitrl.engine.warmstart import warm_start
from bitrl.quant import AQN, AQNSchedule
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.precision import QUANT_FORMATS, make_rollout_model, sync_rollout_model_
from bitrl.rollout.reuse import SpeculativeReuse, draw_prompt_pool, fixed_prompt_batch
from bitrl.rollout.settings import EngineOptions, Sampling
from bitrl.train.advantages import compute_advantages
from bitrl.train.checkpoint import (
    load_checkpoint,
    load_policy_state,
    load_sharded_checkpoint,
    policy_state,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from bitrl.train.distributed import (
    broadcast_module_,
    gather_rows,
    gathered,
    init_distributed,
    pad_to_global_width,
    rank_groups,
    sample_ids,
    sync_rollout_model_sharded_,
)
from bitrl.train.lora import BASE_FORMATS, apply_lora
from bitrl.train.memory import device_memory, pin_mmap_threshold, plan_memory
from bitrl.train.trainer import PolicyTrainer


def build_task(cfg: Config):
    """The task as the config describes it; its data is checked (bad input raises InputError)."""
    if not cfg.model.path and cfg.task.kind != "arithmetic":
        raise InputError(
            f"task.kind={cfg.task.kind}: the embedded demo model only speaks the arithmetic task; "
            "set model.path"
        )
    if cfg.task.kind == "jsonl":
        return JsonlTask(cfg.task.path, cfg.task.n_eval, cfg.seed)
    if cfg.task.kind == "words":
        return WordsTask(cfg.task.digits, cfg.task.n_eval, cfg.seed, cfg.task.ops, cfg.task.show_work)
    return ArithmeticTask(cfg.task.digits, cfg.task.n_eval, cfg.seed, cfg.task.ops)


def build_tokenizer(cfg: Config, log=print):
    """The policy's tokenizer, without its weights (a GGUF model is converted first, once)."""
    if cfg.model.path:
        return load_tokenizer(model_directory(cfg.model.path, cfg.model.dtype, log=log))
    return CharTokenizer(ArithmeticTask.alphabet)


def build_policy(cfg: Config, tokenizer, log=print):
    """The policy model: a pretrained one from model.path, or the embedded demo model."""
    if cfg.model.path:
        return load_pretrained(cfg.model.path, cfg.model.dtype, log=log)[0]
    torch.manual_seed(cfg.seed)
    return build_demo_model(cfg.model, tokenizer.vocab_size)


def build(cfg: Config, log=print):
    """(policy, tokenizer, task) as the config describes them; the task's data and the model path are
    checked before any weights load (bad input raises InputError with a one-line message)."""
    task, tokenizer = build_task(cfg), build_tokenizer(cfg, log=log)
    return build_policy(cfg, tokenizer, log=log), tokenizer, task


def model_config(cfg: Config):
    """The policy's Hugging Face config, without loading any weights (a GGUF's is in its metadata)."""
    if cfg.model.path:
        from transformers import AutoConfig

        source = resolve_model_source(cfg.model.path)
        if source.suffix == ".gguf":  # the shapes are in the file's metadata
            return AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        return AutoConfig.from_pretrained(source)
    with torch.device("meta"):  # shapes only, no memory
        return build_demo_model(cfg.model, CharTokenizer(ArithmeticTask.alphabet).vocab_size).config


def longest_prompt(cfg: Config, task, tokenizer) -> int:
    """The longest prompt in tokens, encoded as the rollout encodes it: the held-out problems and a sample
    of training ones (a stream of fresh problems has no end to scan)."""
    draw = random.Random(f"plan-{cfg.seed}")
    problems = list(task.eval_problems) + [task.sample(draw) for _ in range(256)]
    return max(len(ids) for ids in encode_prompts(tokenizer, problems, cfg.task))


def check_memory_plan(cfg: Config, prompt_tokens: int, force: bool = False, log=print, world_size: int = 1):
    """Print the run's memory plan, per rank of `world_size`, before any weights load; refuse (ConfigError)
    a plan over 95% of the device unless `force`. prompt_tokens: the longest prompt."""
    device_bytes = device_memory(cfg.torch_device)
    if cfg.torch_device.type == "cpu":  # the ranks on one machine share its memory
        device_bytes /= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    plan = plan_memory(cfg, model_config(cfg), world_size, device_bytes, prompt_tokens=prompt_tokens)
    log(plan.line())
    refusal = plan.refusal()
    if refusal and not force:
        raise ConfigError(f"memory plan: {refusal}")
    return plan


def lora_base_recipe(cfg: Config, distributed: bool = False):
    """The bitrl.quant.QuantRecipe of a QeRL run's frozen base (model.lora.base_precision): the rollout's
    scale, outlier and GPTQ settings, weights only; None for a full-precision base. GPTQ only when
    rollout.gptq=true ("auto" keeps round-to-nearest) and the run is not data-parallel (every rank would
    round its own copy)."""
    if not cfg.model.lora.rank or cfg.model.lora.base_precision == "full":
        return None
    fmt = BASE_FORMATS[cfg.model.lora.base_precision]
    possible = cfg.rollout.gptq is True and not distributed
    return replace(cfg.rollout.quant_recipe(fmt, gptq_possible=possible), act=None)


def prepare_policy(policy, cfg: Config, tokenizer=None, task=None, log=print, distributed: bool = False):
    """The trained form of the policy: LoRA adapters (and a quantized frozen base) when model.lora asks.

    A GPTQ-rounded base (lora_base_recipe) is rounded on the policy's own samples of `task`'s prompts
    (gptq_calibration): rebuilt from the same warm start, a resumed or exported run draws the same ones
    and rounds the same bits, so the checkpoint keeps only the adapters."""
    if not cfg.model.lora.rank:
        return policy
    recipe = lora_base_recipe(cfg, distributed)
    calibration = None
    if recipe is not None and recipe.gptq:
        if tokenizer is None or task is None:
            raise ValueError("prepare_policy: a GPTQ-rounded LoRA base needs the tokenizer and the task")
        calibration = gptq_calibration(policy, tokenizer, task, cfg, log)
    return apply_lora(policy, cfg.model.lora, recipe, calibration)


def rollout_precision(cfg: Config) -> str:
    """rollout.precision, with "full" meaning model.dtype (fp32 master weights must not leak into it)."""
    if cfg.rollout.precision != "full" or cfg.model.lora.base_precision != "full":
        return cfg.rollout.precision
    return {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.model.dtype, "full")


def check_matched_dtypes(rollout_model, trainer) -> None:
    """rollout.aligned: the rollout copy must compute in the trainer's forward dtype."""
    rollout_dtype = next(rollout_model.parameters()).dtype
    if rollout_dtype != trainer.compute_dtype:
        raise ValueError(
            f"rollout.aligned: the rollout copy computes in {rollout_dtype} and the trainer in "
            f"{trainer.compute_dtype}; set rollout.precision (or train.autocast) so that they match"
        )


def sensitive_layers(policy, tokenizer, fmt: str, cfg: Config, log=print) -> tuple[str, ...]:
    """The rollout.fp8_layers linears most sensitive to `fmt`, ranked once per model on calibration text
    (bitrl.quant.sensitivity); the ranking is cached beside the warm starts."""
    count = cfg.rollout.fp8_layers
    if not count:
        return ()
    if cfg.model.lora.rank:
        raise ValueError("rollout.fp8_layers: not with LoRA (the ranking reads the policy's plain linears)")
    from bitrl.kernels._common import cache_root
    from bitrl.quant.sensitivity import calibration_ids, layer_sensitivity, most_sensitive

    recipe = cfg.rollout.quant_recipe(fmt)
    weights = [float(p.detach().double().sum()) for p in policy.parameters()]  # the warm-started policy
    key = json.dumps([weights, fmt, recipe.quant_kwargs()], sort_keys=True).encode()
    path = cache_root() / "sensitivity" / f"{hashlib.sha256(key).hexdigest()[:16]}.json"
    if path.exists():
        ranking = [tuple(row) for row in json.loads(path.read_text())]
    else:
        t0 = time.perf_counter()
        text = None if isinstance(tokenizer, CharTokenizer) else tokenizer  # the demo's: digits only
        ids = calibration_ids(text, policy.config.vocab_size, cfg.seed)
        device = next(policy.parameters()).device
        ranking = layer_sensitivity(policy, fmt, [x.to(device) for x in ids], **recipe.quant_kwargs())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ranking))
        seconds = time.perf_counter() - t0
        log(f"rollout.fp8_layers: ranked {len(ranking)} linears by {fmt} sensitivity in {seconds:.0f} s")
    names = most_sensitive(ranking, count)
    log(f"rollout.fp8_layers: {len(names)} linears kept in fp8, from {names[0]}")
    return names


def gptq_calibration(policy, tokenizer, task, cfg: Config, log=print) -> list[torch.Tensor]:
    """rollout.gptq's calibration: rollout.gptq_prompts training prompts (their own seeded draw, which leaves
    the run's prompt stream alone), each with the policy's own sampled response."""
    rng = random.Random(f"gptq-{cfg.seed}")
    rounded = cfg.model.lora.base_precision if cfg.model.lora.rank else cfg.rollout.precision
    problems = [task.sample(rng) for _ in range(cfg.rollout.gptq_prompt_count(rounded))]
    prompts = encode_prompts(tokenizer, problems, cfg.task)
    return policy_sequences(
        policy, tokenizer, prompts, cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.seed, log
    )


@torch.no_grad()
def policy_sequences(policy, tokenizer, prompts, max_new_tokens, temperature, seed, log=print):
    """Each prompt (token ids) with the policy's own sampled response, as a rollout copy will see them:
    int64 ids [prompt + response] per sequence, no padding (GPTQ's calibration, bitrl.quant.gptq)."""
    t0 = time.perf_counter()
    sampling = Sampling(
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=temperature,
    )
    was_training = policy.training
    policy.eval()
    rollout = RolloutEngine(policy, sampling).generate(prompts, generator=torch.Generator().manual_seed(seed))
    policy.train(was_training)
    sequences = [
        torch.cat([p[pm], r[rm]]).cpu()
        for p, pm, r, rm in zip(
            rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
        )
    ]
    tokens, seconds = sum(len(s) for s in sequences), time.perf_counter() - t0
    log(f"rollout.gptq: {len(sequences)} calibration sequences, {tokens} tokens, in {seconds:.0f} s")
    return sequences


def run(cfg: Config, resume: bool = False, log=print, force: bool = False) -> list[dict]:
    """Train as `cfg` says; with `resume`, continue from cfg.run_dir's checkpoint. Returns the metrics.

    force: run even when the memory plan says the run needs over 95% of the device's memory."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    mmap_threshold = pin_mmap_threshold(cfg)  # before any tensor (train.mmap_threshold)
    # Data-parallel under torchrun: each rank rolls out and trains on its share of the groups; rank 0 logs.
    ctx = init_distributed(cfg.torch_device)
    if not ctx.is_main:
        log = lambda *args, **kwargs: None  # noqa: E731
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    device = ctx.device
    log(f"device {device}, {cfg.model.dtype_line}")
    if mmap_threshold is not None:
        log(f"glibc's mmap threshold pinned at {mmap_threshold // 1024} KiB (train.mmap_threshold)")
    task, tokenizer = build_task(cfg), build_tokenizer(cfg, log=log)  # no weights yet
    plan = check_memory_plan(cfg, longest_prompt(cfg, task, tokenizer), force, log, ctx.world_size)
    policy = build_policy(cfg, tokenizer, log=log)
    policy.to(device)
    if not resume and ctx.is_main:
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    # LoRA adapts the warm-started model, so a resumed LoRA run rebuilds that base (cached) first.
    if not resume or cfg.model.lora.rank:
        if ctx.is_main:
            warm_start(policy, tokenizer, task, cfg, log=log)
        broadcast_module_(policy)  # data-parallel: every rank starts from rank 0's weights
    policy = prepare_policy(policy, cfg, tokenizer, task, log, ctx.enabled)
    # The rollout copy in its own precision (bf16, fp8, mxfp4, ...), synced after every update. Made before
    # the trainer, which shards the policy when data-parallel: every rank keeps a whole rollout copy.
    precision = rollout_precision(cfg)
    recipe = None
    if precision in QUANT_FORMATS:
        if ctx.enabled and cfg.rollout.rotation != "none":
            raise ValueError("rollout.rotation: not with data-parallel runs (their sync does not rotate)")
        fmt = QUANT_FORMATS[precision]
        fp8 = sensitive_layers(policy, tokenizer, fmt, cfg, log)
        recipe = cfg.rollout.quant_recipe(fmt, fp8, gptq_possible=not (ctx.enabled or cfg.model.lora.rank))
    state = load_checkpoint(run_dir) if resume and not ctx.enabled else None
    calibration = None
    if recipe and recipe.gptq:
        # A resumed run rounds on the sequences its first build drew (the checkpoint keeps them): new ones,
        # drawn by the policy before its weights are loaded, would round the copy otherwise than the
        # uninterrupted run does. The copy built here is rounded again once they are loaded.
        if state is None:
            calibration = gptq_calibration(policy, tokenizer, task, cfg, log)
        elif "gptq_calibration" in state:
            calibration = state["gptq_calibration"]
        else:
            raise ConfigError(
                f"{run_dir}: its checkpoint holds no GPTQ calibration (written with rollout.gptq off or "
                "before it existed); set rollout.gptq=false in its config.json to resume it as it ran"
            )
    rollout_model = make_rollout_model(policy, precision, recipe, calibration)
    options = EngineOptions.from_config(cfg.rollout)  # cache dtype, batch rows, compiled step
    sampling = Sampling(
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
    )
    engine = RolloutEngine(rollout_model, sampling, options)
    trainer = PolicyTrainer(
        policy,
        cfg.train,
        temperature=cfg.rollout.temperature,
        spare_bytes=plan.spare,
        aligned=cfg.rollout.aligned,
    )
    if cfg.rollout.aligned:
        check_matched_dtypes(rollout_model, trainer)
    budget = trainer.memory_budget
    log(
        f"loss memory budget: {budget / 2**20:.0f} MiB"
        + (" (what the memory plan has to spare)" if cfg.train.loss_memory_budget == "auto" else "")
    )

    # Sharded, the policy is evaluated through its rollout copy where that holds the very same weights (full
    # precision, no noise, no adapters to merge), else gathered whole for the evaluation on every rank.
    same_weights = precision == "full" and not cfg.rollout.aqn_stages and not cfg.model.lora.rank

    def evaluate():
        """Held-out accuracy of the policy."""
        if ctx.enabled and same_weights:
            return accuracy(rollout_model, tokenizer, task.eval_problems, cfg, options)
        with gathered(policy):
            return accuracy(policy, tokenizer, task.eval_problems, cfg)

    def sync_rollout_model():
        if ctx.enabled:  # gathered one FSDP unit at a time
            return sync_rollout_model_sharded_(rollout_model, policy)
        return sync_rollout_model_(rollout_model, policy, precision)

    sampler = torch.Generator(device).manual_seed(cfg.seed)  # drives every rollout sample
    data_rng = random.Random(f"data-{cfg.seed}")  # drives which training prompts are drawn
    reward_fn = REWARDS[cfg.task.reward]
    # Speculative rollout reuse: last epoch's responses for the same prompts are drafts the policy verifies.
    reuse = SpeculativeReuse(cfg.rollout.reuse) if cfg.rollout.reuse.enabled else None
    pool = draw_prompt_pool(task, cfg.rollout.fixed_prompts, cfg.seed) if cfg.rollout.fixed_prompts else None

    if resume and ctx.enabled:  # sharded: model and optimizer shards loaded in place, the rest per rank
        state = load_sharded_checkpoint(run_dir, policy, trainer.optimizer)
    if resume:
        if not ctx.enabled:
            load_policy_state(policy, state["policy"])
            trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scaler.load_state_dict(state["scaler"])
        sampler.set_state(state["sampler"])
        data_rng.setstate(state["data_rng"])
        set_rng_state(state["rng"])
        if reuse is not None and "reuse" in state:
            reuse.load_state_dict(state["reuse"])
        start_step, records = state["step"], state["records"]
        sync_rollout_model()
        log(f"resumed {run_dir} at step {start_step}")
    else:
        start_step, records = (
            0,
            [{"step": 0, "accuracy": evaluate()}],
        )
        log(f"held-out accuracy after warm start: {records[0]['accuracy']:.3f}")
    # Rewrite the metrics file from the records the checkpoint promised, dropping steps lost in a crash.
    if ctx.is_main:
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    aqn = None
    if cfg.rollout.aqn_stages:  # adaptive quantization noise on the rollout copy's RMSNorm weights
        aqn = AQN(AQNSchedule(cfg.steps, num_stages=cfg.rollout.aqn_stages), seed=cfg.seed)
    # QeRL's form: the same noise on the policy's frozen norms for the step, so the trainer scores the model
    # that sampled; removed after the update (evaluation and checkpoints see the clean policy).
    noisy_policy = aqn is not None and cfg.rollout.aqn_target == "policy"
    if noisy_policy and ctx.enabled:
        raise ValueError("rollout.aqn_target=policy: not with data-parallel runs yet (sharded norm weights)")
    steps = range(start_step, cfg.steps)
    progress = tqdm(steps, initial=start_step, total=cfg.steps, desc=cfg.name, disable=not ctx.is_main)
    G = cfg.rollout.group_size
    my_groups = rank_groups(cfg.rollout.prompts_per_step, ctx.rank, ctx.world_size, G, cfg.train.minibatches)
    for step in progress:
        t0 = time.perf_counter()
        aqn_sigma = aqn.apply_(rollout_model, step) if aqn is not None else None
        if noisy_policy:
            aqn.apply_(policy, step)  # the same draw: seeded by (seed, step), layers in the same order
        # 1. rollout: G samples for each of the step's prompts
        if pool is None:
            problems = [task.sample(data_rng) for _ in range(cfg.rollout.prompts_per_step)]
        else:
            problems = fixed_prompt_batch(pool, step, cfg.rollout.prompts_per_step, cfg.seed)
        problems = problems[my_groups.start : my_groups.stop]  # this rank's whole groups (all of them at 1)
        grouped = [p for p in problems for _ in range(G)]
        # row i's draft is cached under (prompt uid, i-th sample of its group)
        draft_keys = [(p.uid, i % G) for i, p in enumerate(grouped)]
        prompts = [ids for ids in encode_prompts(tokenizer, problems, cfg.task) for _ in range(G)]
        if reuse is None:
            # sampling keyed by global sample id: a sample does not depend on the world size or on its rank
            ids = sample_ids(my_groups, G).to(device)
            rollout, reuse_metrics = engine.generate(prompts, generator=sampler, sample_ids=ids), {}
        else:
            rollout, reuse_metrics = reuse.generate(engine, prompts, draft_keys, generator=sampler)
        rollout = pad_to_global_width(rollout, tokenizer.pad_token_id)
        t_rollout = time.perf_counter() - t0
        # 2. reward and advantages
        rewards = score(tokenizer, reward_fn, rollout, grouped)
        by_group = rewards.view(-1, G)
        flat = by_group.amax(1) == by_group.amin(1)  # groups whose samples all scored alike: no GRPO signal
        advantages = compute_advantages(cfg.train.advantage, by_group).flatten().to(device)
        if reuse is not None and cfg.rollout.reuse.refresh_flat:  # sample signal-free groups afresh
            for row in flat.repeat_interleave(G).nonzero().flatten().tolist():
                reuse.cache.discard(draft_keys[row])
        # 3. train, then 4. sync the rollout copy
        metrics = trainer.step(rollout, advantages)
        if noisy_policy:
            aqn.remove_(policy)
        t_sync = time.perf_counter()
        sync_rollout_model()
        t_sync = time.perf_counter() - t_sync
        step_time = time.perf_counter() - t0

        # metrics of the global batch: every rank's rows, in rank order
        rewards, flat, response_mask = gather_rows(rewards, flat, rollout.response_mask)
        num_tokens = int(response_mask.sum())
        record = {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "flat_group_frac": float(flat.float().mean()),
            **metrics,
            "response_len": num_tokens / response_mask.shape[0],
            "tokens_per_s": num_tokens / step_time,
            "rollout_time_s": t_rollout,
            "sync_time_s": t_sync,  # the rollout copy refreshed: a copy, a cast, a re-quantization or GPTQ
            "trainable_params": trainer.trainable_parameters,
            "step_time_s": step_time,
            **reuse_metrics,
            **({"aqn_sigma": aqn_sigma} if aqn is not None else {}),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record["accuracy"] = evaluate()
        records.append(record)
        if ctx.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        progress.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=record.get("accuracy", "-"))

        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            state = {
                "step": step + 1,
                "scaler": trainer.scaler.state_dict(),
                "sampler": sampler.get_state(),
                "data_rng": data_rng.getstate(),
                "rng": rng_state(),
                "records": records,
                "config": cfg.model_dump(),
                **({"reuse": reuse.state_dict()} if reuse is not None else {}),
                **({"gptq_calibration": calibration} if calibration is not None else {}),
            }
            if ctx.enabled:  # policy and optimizer as shards; the rest is this rank's own state
                save_sharded_checkpoint(run_dir, step + 1, policy, trainer.optimizer, state)
            else:
                state |= {"policy": policy_state(policy), "optimizer": trainer.optimizer.state_dict()}
                save_checkpoint(run_dir, state)
    progress.close()
    if ctx.is_main:
        plot_metrics(records, run_dir / "report.png", title=cfg.name)
    return records


def summarize(records: list[dict]) -> dict:
    evals = [r for r in records if "accuracy" in r]
    return {
        "accuracy_start": evals[0]["accuracy"],
        "accuracy_end": evals[-1]["accuracy"],
        "steps": records[-1]["step"],
        "train_time_s": sum(r.get("step_time_s", 0.0) for r in records),
    }
