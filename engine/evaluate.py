"""Scoring responses and measuring accuracy with greedy decoding."""

from __future__ import annotations

import torch

from bitrl.engine.tasks import REWARDS
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.settings import EngineOptions, Sampling


def prompt_text(tokenizer, prompt: str, task) -> tuple[str, bool]:
    """(text, add_special_tokens): the prompt as the model sees it. task: TaskConfig.

    `task.prompt_template` is applied first; with `task.chat_template=auto` and a tokenizer that has a chat
    template, the result becomes a user turn (after `task.system_prompt`, if any) followed by the assistant's
    header. The rendered template already holds its special tokens, so none are added when encoding it.
    """
    text = task.prompt_template.format(prompt=prompt)
    if task.chat_template == "none" or not getattr(tokenizer, "chat_template", None):
        return text, True
    messages = [{"role": "system", "content": task.system_prompt}] if task.system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False


def encode_prompts(tokenizer, problems, task) -> list[list[int]]:
    """Token ids of each problem's prompt (see prompt_text). task: TaskConfig."""
    encoded = []
    for p in problems:
        text, add_special = prompt_text(tokenizer, p.prompt, task)
        encoded.append(tokenizer.encode(text, add_special_tokens=add_special))
    return encoded


def score(tokenizer, reward_fn, rollout, problems) -> torch.Tensor:
    """Reward of each response: [B] fp32."""
    texts = [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(rollout.response_ids, rollout.response_mask)
    ]
    return torch.tensor([reward_fn(t, p.answer) for t, p in zip(texts, problems)], dtype=torch.float32)


@torch.no_grad()
def accuracy(
    model, tokenizer, problems, cfg, options: EngineOptions | None = None, batch_size: int = 512
) -> float:
    """Accuracy with greedy decoding: the fraction of `problems` whose reward is 1. cfg: engine Config;
    options: how the rollout engine runs on `model` (default EngineOptions())."""
    model.eval()
    reward_fn = REWARDS[cfg.task.reward]
    greedy = Sampling(
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        temperature=0.0,
    )
    engine = RolloutEngine(model, greedy, options)
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        rollout = engine.generate(encode_prompts(tokenizer, chunk, cfg.task))
        correct += float((score(tokenizer, reward_fn, rollout, chunk) >= 1.0).sum())
    return correct / len(problems)
