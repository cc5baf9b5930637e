"""Supervised warm start: RL cannot start from a random model, so the policy first imitates a few reference
answers. The result is cached on disk, keyed by everything that determines it, and reused."""

from __future__ import annotations

import hashlib
import json
import os
import random

import torch
from safetensors.torch import load_model, save_model

import bitrl
from bitrl.engine.evaluate import accuracy, encode_prompts
from bitrl.kernels._common import cache_root
from bitrl.rollout.batch import left_pad, position_ids_from_mask


def cache_key(cfg) -> str:
    """Hash of the settings that determine the warm-started weights. cfg: engine Config."""
    blob = json.dumps(
        {
            "version": bitrl.__version__,
            "seed": cfg.seed,
            "model": cfg.model.model_dump(),
            # show_work left out while off, so that warm starts cached before the field existed stay valid
            "task": cfg.task.model_dump(exclude=set() if cfg.task.show_work else {"show_work"}),
            "warmstart": cfg.warmstart.model_dump(exclude={"cache"}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def supervised_batch(tokenizer, problems, task):
    """(input_ids, attention_mask, position_ids, labels) with labels -100 outside the answer and its EOS.
    task: TaskConfig (prompts are encoded as for rollouts)."""
    rows, label_rows = [], []
    for p, prompt in zip(problems, encode_prompts(tokenizer, problems, task)):
        answer = tokenizer.encode(p.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    for i, lab in enumerate(label_rows):
        labels[i, ids.shape[1] - len(lab) :] = torch.tensor(lab)
    return ids, mask.long(), position_ids_from_mask(mask), labels


def warm_start(policy, tokenizer, task, cfg, log=print) -> bool:
    """Train `policy` in place on reference answers, or load the cached result. Returns True on a cache hit.

    Stops after `warmstart.steps` steps, or earlier once greedy accuracy on a validation sample of the
    training distribution reaches `warmstart.target_accuracy`: RL should start from a model that is right
    sometimes, not from one that has already solved the task.
    """
    ws = cfg.warmstart
    if ws.steps == 0:
        return False
    path = cache_root() / "warmstart" / cache_key(cfg) / "model.safetensors"
    if ws.cache and path.is_file():
        load_model(policy, path)
        log(f"warm start: loaded cached weights from {path}")
        return True
    rng = random.Random(f"warmstart-{cfg.seed}")
    # Validation problems come from the training stream, never from the held-out split.
    val_rng = random.Random(f"warmstart-val-{cfg.seed}")
    val_problems = [task.sample(val_rng) for _ in range(ws.val_size)]
    val_acc = None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=ws.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    policy.train()
    device = next(policy.parameters()).device
    for step in range(1, ws.steps + 1):
        problems = [task.sample(rng) for _ in range(ws.batch_size)]
        ids, mask, pos, labels = (t.to(device) for t in supervised_batch(tokenizer, problems, cfg.task))
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if ws.target_accuracy is not None and step % ws.eval_every == 0:
            val_acc = accuracy(policy, tokenizer, val_problems, cfg)
            policy.train()
            if val_acc >= ws.target_accuracy:
                break
    log(f"warm start: {step} supervised steps, loss {loss.item():.3f}, validation accuracy {val_acc}")
    if ws.cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_model(policy, str(tmp))
        os.replace(tmp, path)
    return False
