"""Scoring responses and measuring accuracy with greedy decoding."""

from __future__ import annotations

import torch

from bitrl.engine.tasks import REWARDS
from bitrl.rollout.engine import generate


def encode_prompts(tokenizer, problems, template: str) -> list[list[int]]:
    return [tokenizer.encode(template.format(prompt=p.prompt), add_special_tokens=True) for p in problems]


def score(tokenizer, reward_fn, rollout, problems) -> torch.Tensor:
    """Reward of each response: [B] fp32."""
    texts = [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(rollout.response_ids, rollout.response_mask)
    ]
    return torch.tensor([reward_fn(t, p.answer) for t, p in zip(texts, problems)], dtype=torch.float32)


@torch.no_grad()
def accuracy(model, tokenizer, problems, cfg, batch_size: int = 512) -> float:
    """Accuracy with greedy decoding: the fraction of `problems` whose reward is 1. cfg: engine Config."""
    model.eval()
    reward_fn = REWARDS[cfg.task.reward]
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        rollout = generate(
            model,
            encode_prompts(tokenizer, chunk, cfg.task.prompt_template),
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            temperature=0.0,
        )
        correct += float((score(tokenizer, reward_fn, rollout, chunk) >= 1.0).sum())
    return correct / len(problems)
