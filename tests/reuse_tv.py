"""The bias of speculative reuse, measured exactly on a model whose response distribution can be enumerated.

With a tiny vocabulary and a short maximum length, every response y (ending at EOS or at max_new_tokens) can
be listed, so the distribution of fresh sampling from the new policy, P_new(y) = prod_t p(y_t | y_<t), and
the distribution of "draft from the old policy, verify and resume with the new one" can both be computed
exactly:

P_reuse(y) = prod_t min(q_t, l p_t)                                         (the whole draft accepted) +
sum_i prod_{t<i} min(q_t, l p_t) * sum_v q(v) (1 - a(v)) r_v(y_i) prod_{t>i} p_t   (rejected at i)

where q is the old policy, a(v) = min(1, l p(v) / q(v)), and r_v is what the mode resamples position i from:
p for "spec-rl", the residual of `residual_logprobs` for "exact" (which depends on the rejected token v when
only the top-k of q is known). `total_variation(P_reuse, P_new)` is the bias; `empirical_distribution`
counts what the engine actually returns, to check the engine against the formula.

Shared by tests/test_reuse.py and benchmarks/bench_reuse_tv.py; not part of the shipped package.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import torch

from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.reuse import generate_with_drafts, residual_logprobs
from bitrl.rollout.settings import Sampling, filtered_logprobs


def enumerable_model(vocab_size: int = 5, eos_id: int = 2, seed: int = 0, scale: float = 0.5):
    """A 1-layer Qwen2 with a tiny vocabulary and large random weights: its response distribution over a few
    tokens can be enumerated exactly and is far from uniform."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=eos_id,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
    return model


def perturbed(model, sigma: float, seed: int = 1):
    """A copy of `model` with N(0, sigma^2) added to every weight: a policy one training step away."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * sigma)
    return new


@torch.no_grad()
def next_token_table(
    model, prompt, *, vocab_size, max_new_tokens, eos_id, temperature=1.0, top_k=0, top_p=1.0
):
    """{prefix tuple: log p(. | prompt + prefix) [V] fp32} for every unfinished prefix shorter than
    max_new_tokens."""
    table = {}
    frontier = [()]
    for _ in range(max_new_tokens):
        ids = torch.tensor([list(prompt) + list(s) for s in frontier], dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
        logp = filtered_logprobs(logits, temperature, top_k, top_p)
        for s, row in zip(frontier, logp):
            table[s] = row
        frontier = [s + (v,) for s in frontier for v in range(vocab_size) if v != eos_id]
    return table


def sequences(table: dict, vocab_size: int, max_new_tokens: int, eos_id: int) -> list[tuple]:
    """Every possible response, in a fixed order."""
    out = []
    for s in table:
        for v in range(vocab_size):
            if v == eos_id or len(s) + 1 == max_new_tokens:
                out.append(s + (v,))
    return out


def fresh_distribution(table: dict, seqs: list[tuple]) -> dict:
    """P(y) of sampling every token from `table`."""
    probs = {}
    for y in seqs:
        lp = sum(float(table[y[:t]][y[t]]) for t in range(len(y)))
        probs[y] = math.exp(lp)
    return probs


def reuse_distribution(
    new: dict, old: dict, seqs: list[tuple], *, lenience: float, mode: str, old_topk: int
) -> tuple[dict, dict]:
    """(P_reuse(y) for every y, summary) for drafts sampled from `old` and verified against `new`; in "exact"
    mode the old distribution is known through its top `old_topk` tokens plus the drafted token. summary:
    expected accepted draft tokens and probability that a draft is fully reused."""
    probs = dict.fromkeys(seqs, 0.0)
    logp_new = {y: [float(new[y[:t]][y[t]]) for t in range(len(y))] for y in seqs}
    accepted_tokens = fully_reused = 0.0
    for s in new:  # s: an accepted prefix (every unfinished prefix)
        i = len(s)
        mass = 1.0  # probability that a draft starts with s and all of s is accepted
        for t in range(i):
            mass *= min(math.exp(float(old[s[:t]][s[t]])), lenience * math.exp(float(new[s[:t]][s[t]])))
        if mass == 0.0:
            continue
        accepted_tokens += mass if i else 0.0
        p, q = new[s].exp().double(), old[s].exp().double()
        accept = torch.minimum(q, lenience * p)
        for v in range(len(p)):  # drafts that end at position i, fully accepted
            if s + (v,) in probs:
                probs[s + (v,)] += mass * float(accept[v])
                fully_reused += mass * float(accept[v])
                accepted_tokens += mass * float(accept[v])
        # first rejection at position i: the rejected token v, then y_i ~ r_v, then the rest ~ new
        mix = torch.zeros_like(p)
        for v in range(len(p)):
            reject = float(q[v] - accept[v])
            if reject <= 0:
                continue
            if mode == "spec-rl":
                r = p
            else:
                k = min(old_topk, len(q))
                ids = (
                    torch.tensor([v])
                    if k == 0
                    else torch.cat([torch.topk(old[s], k).indices, torch.tensor([v])])
                )
                r = residual_logprobs(new[s][None], ids[None], old[s][ids][None], lenience)[0].exp().double()
            mix += reject * r
        for y, lps in logp_new.items():
            if y[:i] == s:
                probs[y] += mass * float(mix[y[i]]) * math.exp(sum(lps[i + 1 :]))
    return probs, {"accepted_tokens": accepted_tokens, "fully_reused": fully_reused}


def total_variation(p: dict, q: dict) -> float:
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


def empirical_distribution(rollout) -> dict:
    """Frequencies of the responses in a Rollout."""
    counts = Counter(
        tuple(ids[mask].tolist()) for ids, mask in zip(rollout.response_ids, rollout.response_mask)
    )
    n = sum(counts.values())
    return {k: c / n for k, c in counts.items()}


@torch.no_grad()
def engine_reuse_distribution(
    old_model,
    new_model,
    prompt,
    n: int,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    lenience: float,
    mode: str,
    old_topk: int,
    seed: int = 0,
):
    """The empirical distribution of n responses from the engine: drafts sampled from old_model (fresh), then
    verified and resumed by new_model."""
    prompts = [list(prompt)] * n
    sampling = Sampling(max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id)
    _, _, drafts = generate_with_drafts(
        RolloutEngine(old_model, sampling),
        prompts,
        [None] * n,
        keep_topk=old_topk,
        generator=torch.Generator().manual_seed(seed),
    )
    rollout, _, _ = generate_with_drafts(
        RolloutEngine(new_model, sampling),
        prompts,
        drafts,
        lenience=lenience,
        mode=mode,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    return empirical_distribution(rollout)


def engine_against_formula(setup, n: int, *, mode: str, old_topk: int, max_new_tokens: int, eos_id: int):
    """(the engine's empirical distribution of n responses, the formula's) at lenience 1, for a setup
    (old model, new model, prompt, old table, new table, sequences)."""
    old, new, prompt, t_old, t_new, seqs = setup
    empirical = engine_reuse_distribution(
        old,
        new,
        prompt,
        n,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=0,
        lenience=1.0,
        mode=mode,
        old_topk=old_topk,
    )
    dist, _ = reuse_distribution(t_new, t_old, seqs, lenience=1.0, mode=mode, old_topk=old_topk)
    return empirical, dist
