"""The RL loop: rollout -> reward -> advantages -> train -> weight sync, with evaluation, metrics and
checkpoints. Read `run` top to bottom for one whole training run."""

from __future__ import annotations

import json
import random
import time

import torch
from tqdm import tqdm

from bitrl.engine.config import Config
from bitrl.engine.evaluate import accuracy, encode_prompts, score
from bitrl.engine.models import build_demo_model, load_pretrained
from bitrl.engine.report import plot_metrics
from bitrl.engine.tasks import REWARDS, ArithmeticTask, CharTokenizer, InputError, JsonlTask, WordsTask
from bitrl.engine.warmstart import warm_start
from bitrl.quant import AQN, AQNSchedule
from bitrl.rollout.engine import generate
from bitrl.rollout.precision import make_rollout_model, sync_rollout_model_
from bitrl.rollout.reuse import SpeculativeReuse, draw_prompt_pool, fixed_prompt_batch
from bitrl.train.advantages import compute_advantages
from bitrl.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from bitrl.train.trainer import PolicyTrainer


def build(cfg: Config, log=print):
    """(policy, tokenizer, task) as the config describes them. The task's data and the model path are
    checked before any weights load; bad input raises InputError with a one-line message."""
    if cfg.task.kind == "jsonl":
        task = JsonlTask(cfg.task.path, cfg.task.n_eval, cfg.seed)
    else:
        task_cls = WordsTask if cfg.task.kind == "words" else ArithmeticTask
        task = task_cls(cfg.task.digits, cfg.task.n_eval, cfg.seed, cfg.task.ops)
    if cfg.model.path:
        policy, tokenizer = load_pretrained(cfg.model.path, cfg.model.dtype, log=log)
    else:
        if cfg.task.kind != "arithmetic":
            raise InputError(
                f"task.kind={cfg.task.kind}: the embedded demo model only speaks the arithmetic task; "
                "set model.path"
            )
        tokenizer = CharTokenizer(ArithmeticTask.alphabet)
        torch.manual_seed(cfg.seed)
        policy = build_demo_model(cfg.model, tokenizer.vocab_size)
    return policy, tokenizer, task


def run(cfg: Config, resume: bool = False, log=print) -> list[dict]:
    """Train as `cfg` says; with `resume`, continue from cfg.run_dir's checkpoint. Returns the metrics."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    device = cfg.torch_device
    policy, tokenizer, task = build(cfg, log=log)
    policy.to(device)
    trainer = PolicyTrainer(policy, cfg.train, temperature=cfg.rollout.temperature)
    sampler = torch.Generator(device).manual_seed(cfg.seed)  # drives every rollout sample
    data_rng = random.Random(f"data-{cfg.seed}")  # drives which training prompts are drawn
    reward_fn = REWARDS[cfg.task.reward]
    # Speculative rollout reuse: last epoch's responses for the same prompts are drafts the policy verifies.
    reuse = SpeculativeReuse(cfg.rollout.reuse) if cfg.rollout.reuse.enabled else None
    pool = draw_prompt_pool(task, cfg.rollout.fixed_prompts, cfg.seed) if cfg.rollout.fixed_prompts else None

    if resume:
        state = load_checkpoint(run_dir)
        policy.load_state_dict(state["policy"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scaler.load_state_dict(state["scaler"])
        sampler.set_state(state["sampler"])
        data_rng.setstate(state["data_rng"])
        set_rng_state(state["rng"])
        if reuse is not None and "reuse" in state:
            reuse.load_state_dict(state["reuse"])
        start_step, records = state["step"], state["records"]
        log(f"resumed {run_dir} at step {start_step}")
    else:
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
        warm_start(policy, tokenizer, task, cfg, log=log)
        start_step, records = (
            0,
            [{"step": 0, "accuracy": accuracy(policy, tokenizer, task.eval_problems, cfg)}],
        )
        log(f"held-out accuracy after warm start: {records[0]['accuracy']:.3f}")
    # Rewrite the metrics file from the records the checkpoint promised, dropping steps lost in a crash.
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    # The rollout copy in its own precision (bf16, fp8, mxfp4, ...), synced after every update.
    rollout_model = make_rollout_model(
        policy, cfg.rollout.precision, cfg.rollout.act_quant, cfg.rollout.mx_scale_mode
    )
    aqn = None
    if cfg.rollout.aqn_stages:  # adaptive quantization noise on the rollout copy's RMSNorm weights
        aqn = AQN(AQNSchedule(cfg.steps, num_stages=cfg.rollout.aqn_stages), seed=cfg.seed)
    progress = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc=cfg.name)
    for step in progress:
        t0 = time.perf_counter()
        aqn_sigma = aqn.apply_(rollout_model, step) if aqn is not None else None
        # 1. rollout: G samples for each of the step's prompts
        if pool is None:
            problems = [task.sample(data_rng) for _ in range(cfg.rollout.prompts_per_step)]
        else:
            problems = fixed_prompt_batch(pool, step, cfg.rollout.prompts_per_step, cfg.seed)
        grouped = [p for p in problems for _ in range(cfg.rollout.group_size)]
        # row i's draft is cached under (prompt uid, i-th sample of its group)
        draft_keys = [(p.uid, i % cfg.rollout.group_size) for i, p in enumerate(grouped)]
        rollout_fn = generate if reuse is None else reuse.bind(draft_keys)
        prompt_ids = encode_prompts(tokenizer, problems, cfg.task)
        rollout = rollout_fn(
            rollout_model,
            [ids for ids in prompt_ids for _ in range(cfg.rollout.group_size)],
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=cfg.rollout.temperature,
            top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p,
            generator=sampler,
        )
        t_rollout = time.perf_counter() - t0
        # 2. reward and advantages
        rewards = score(tokenizer, reward_fn, rollout, grouped)
        by_group = rewards.view(-1, cfg.rollout.group_size)
        flat = by_group.amax(1) == by_group.amin(1)  # groups whose samples all scored alike: no GRPO signal
        advantages = compute_advantages(cfg.train.advantage, by_group).flatten().to(device)
        if reuse is not None and cfg.rollout.reuse.refresh_flat:  # sample signal-free groups afresh
            for row in flat.repeat_interleave(cfg.rollout.group_size).nonzero().flatten().tolist():
                reuse.cache.discard(draft_keys[row])
        # 3. train, then 4. sync the rollout copy
        metrics = trainer.step(rollout, advantages)
        sync_rollout_model_(rollout_model, policy, cfg.rollout.precision)
        step_time = time.perf_counter() - t0

        record = {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "flat_group_frac": float(flat.float().mean()),
            **metrics,
            "response_len": rollout.num_tokens / rollout.response_mask.shape[0],
            "tokens_per_s": rollout.num_tokens / step_time,
            "rollout_time_s": t_rollout,
            "step_time_s": step_time,
            **(reuse.last_metrics if reuse is not None else {}),
            **({"aqn_sigma": aqn_sigma} if aqn is not None else {}),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record["accuracy"] = accuracy(policy, tokenizer, task.eval_problems, cfg)
        records.append(record)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        progress.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=record.get("accuracy", "-"))

        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(
                run_dir,
                {
                    "step": step + 1,
                    "policy": policy.state_dict(),
                    "optimizer": trainer.optimizer.state_dict(),
                    "scaler": trainer.scaler.state_dict(),
                    "sampler": sampler.get_state(),
                    "data_rng": data_rng.getstate(),
                    "rng": rng_state(),
                    "records": records,
                    "config": cfg.model_dump(),
                    **({"reuse": reuse.state_dict()} if reuse is not None else {}),
                },
            )
    progress.close()
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
