"""Speculative rollout reuse: acceptance rule, resume from rejection, exactness (total variation), cache."""

import contextlib
import copy
import math

import pytest
import torch
from conftest import TINY_DEMO_MODEL
from reuse_tv import (
    engine_against_formula,
    enumerable_model,
    fresh_distribution,
    next_token_table,
    perturbed,
    reuse_distribution,
    sequences,
    total_variation,
)

from bitrl.kernels.sampling import draw_step_seed, sample_seeds
from bitrl.rollout.draft_cache import Draft, RolloutCache
from bitrl.rollout.draft_tree import DraftTree
from bitrl.rollout.generation import RolloutEngine
from bitrl.rollout.reuse import (
    SpeculativeReuse,
    acceptance,
    fixed_prompt_batch,
    generate_with_drafts,
    residual_logprobs,
)
from bitrl.rollout.settings import Sampling, filtered_logprobs
from bitrl.train.logprobs import token_logprobs

L = math.log

# --------------------------------------------------------------------------- acceptance rule


def test_acceptance_hand_computed():
    # ratios p_new / p_old: 2 (capped at 1), 0.5, 1, 0.25
    new = torch.tensor([[L(0.5), L(0.2), L(0.9), L(0.1)]])
    old = torch.tensor([[L(0.25), L(0.4), L(0.9), L(0.4)]])
    u = torch.tensor([[0.99, 0.6, 0.1, 0.2]])
    n = torch.tensor([4])
    acc, length = acceptance(new, old, u, n, lenience=1.0)
    assert acc.tolist() == [[True, False, True, True]] and length.tolist() == [1]
    # lenience 1.5: 0.6 <= 0.75 accepted, 0.2 <= 0.375 accepted
    acc, length = acceptance(new, old, u, n, lenience=1.5)
    assert acc.tolist() == [[True, True, True, True]] and length.tolist() == [4]
    # lenience 0.5: 0.99 > min(1, 1.0)? no: 0.99 <= 1 accepted; 0.6 > 0.25 rejected
    acc, length = acceptance(new, old, u, n, lenience=0.5)
    assert acc[0, :2].tolist() == [True, False] and length.tolist() == [1]
    # the draft length masks later positions
    _, length = acceptance(new, old, torch.zeros(1, 4) + 0.01, torch.tensor([2]), lenience=1.0)
    assert length.tolist() == [2]


def test_acceptance_edges():
    new = torch.tensor([[float("-inf"), 0.0], [L(0.3), L(0.3)]])
    old = torch.tensor([[L(0.5), L(0.5)], [L(0.6), L(0.6)]])
    u = torch.tensor([[0.0, 0.0], [0.5 - 1e-6, 0.5 + 1e-6]])
    acc, length = acceptance(new, old, u, torch.tensor([2, 2]))
    assert not acc[0, 0] and length[0] == 0  # outside the new support: never, even with u = 0
    assert acc[1].tolist() == [True, False] and length[1] == 1  # u just below / above the ratio 0.5
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="lenience"):
            acceptance(new, old, u, torch.tensor([2, 2]), lenience=bad)


def test_residual_hand_computed_and_exact_for_lenience_up_to_one():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.5, 0.3]])
    ids = torch.arange(3)[None]
    r = residual_logprobs(p.log(), ids, q.log(), 1.0).exp()
    torch.testing.assert_close(r, torch.tensor([[1.0, 0.0, 0.0]]))
    # lenience 0.5: p - min(q, p/2) = [0.3, 0.15, 0.1] / 0.55
    r = residual_logprobs(p.log(), ids, q.log(), 0.5).exp()
    torch.testing.assert_close(r, torch.tensor([[0.3, 0.15, 0.1]]) / 0.55)
    # Speculative sampling identity: accepted mass + rejected mass * residual == p, for any lenience <= 1.
    g = torch.Generator().manual_seed(0)
    for lenience in (0.3, 0.8, 1.0):
        p = torch.softmax(torch.randn(4, 7, generator=g), -1)
        q = torch.softmax(torch.randn(4, 7, generator=g), -1)
        accept = torch.minimum(q, lenience * p)
        r = residual_logprobs(p.log(), torch.arange(7).expand(4, -1), q.log(), lenience).exp()
        torch.testing.assert_close(accept + (1 - accept.sum(-1, keepdim=True)) * r, p)
    # no residual mass (p == q): falls back to p
    r = residual_logprobs(p.log(), torch.arange(7).expand(4, -1), p.log(), 1.0).exp()
    torch.testing.assert_close(r, p)


# --------------------------------------------------------------------------- resume from rejection


PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13], [1, 3], [1, 4, 4]]
M = 10


@contextlib.contextmanager
def recorded_forwards(model):
    """The input_ids shapes of the model's passes while the block runs (every pass of the rollout engine,
    prefill, verification or decode step, starts at the token embedding)."""
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _, args, out: calls.append(tuple(args[0].shape))
    )
    try:
        yield calls
    finally:
        hook.remove()


def _forced_drafts(rollout, accept_at):
    """Drafts = the rollout's responses, with old log-probs crafted so that exactly accept_at[b] tokens are
    accepted (-1e4: always accepted; +1e4: always rejected). accept_at None: no draft."""
    drafts = []
    for b, a in enumerate(accept_at):
        if a is None:
            drafts.append(None)
            continue
        n = int(rollout.response_mask[b].sum())
        lp = torch.full((n,), -1e4)
        if a < n:
            lp[a] = 1e4
        drafts.append(Draft(rollout.response_ids[b, :n].clone(), lp))
    return drafts


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_resume_from_rejection_equals_fresh_generation(tiny_qwen, top_k, top_p):
    engine = RolloutEngine(
        tiny_qwen, Sampling(max_new_tokens=M, eos_id=2, pad_id=0, top_k=top_k, top_p=top_p)
    )
    r0 = engine.generate(PROMPTS, generator=torch.Generator().manual_seed(3))
    lengths = r0.response_mask.sum(1).tolist()
    # row 0: reject at 1; row 1: no draft; row 2: reject at 0; row 3: fully accepted; row 4: reject at 2
    accept_at = [1, None, 0, lengths[3], 2]
    accept_at = [a if a is None else min(a, n) for a, n in zip(accept_at, lengths)]
    drafts = _forced_drafts(r0, accept_at)
    for b in (0, 2, 4):
        assert accept_at[b] < lengths[b], "the seed must give drafts long enough to be rejected"

    with recorded_forwards(tiny_qwen) as calls:
        out, stats, new_drafts = generate_with_drafts(
            engine, PROMPTS, drafts, generator=torch.Generator().manual_seed(11)
        )
    # Verification: ONE forward over the prompts, each followed by its draft, packed into rows as long as the
    # longest; after that only single-token decoding steps (no second prefill).
    segments = [len(p) + (len(d.tokens) if d else 0) for p, d in zip(PROMPTS, drafts)]
    rows, width = calls[0]
    assert width == max(segments) and rows < len(PROMPTS) and rows * width >= sum(segments)
    assert all(shape[1] == 1 for shape in calls[1:]) and len(calls) > 1

    expected_acc = [0 if a is None else a for a in accept_at]
    assert stats.accepted.tolist() == expected_acc
    finished = r0.response_ids[3, lengths[3] - 1] == 2 or lengths[3] == M
    assert bool(stats.fully_reused[3]) == bool(finished)

    # The same random numbers: after the verification's uniforms, one step seed; each resumed row b draws
    # with its own seed (sample id b) from response position accepted[b] on, as a fresh generation from the
    # prompt extended by the accepted prefix does with those seeds and counters.
    g = torch.Generator().manual_seed(11)
    torch.rand((len(PROMPTS), int(stats.draft_len.max())), generator=g)
    active = [b for b in range(len(PROMPTS)) if not stats.fully_reused[b]]
    extended = [PROMPTS[b] + r0.response_ids[b, : expected_acc[b]].tolist() for b in active]
    seeds = sample_seeds(draw_step_seed(g), torch.tensor(active))
    fresh = engine.generate_rows(extended, seeds, torch.tensor([expected_acc[b] for b in active]))
    for i, b in enumerate(active):
        a = expected_acc[b]
        cont = fresh.response_ids[i][fresh.response_mask[i]].tolist()[: M - a]
        got = out.response_ids[b][out.response_mask[b]].tolist()
        assert got == r0.response_ids[b, :a].tolist() + cont
    for b in range(len(PROMPTS)):
        if stats.fully_reused[b]:
            assert out.response_ids[b][out.response_mask[b]].tolist() == drafts[b].tokens.tolist()

    # Returned log-probs are the current policy's, for accepted and generated tokens alike.
    ids, mask, pos = out.full_sequence()
    with torch.no_grad():
        logits = tiny_qwen(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    p = out.prompt_ids.shape[1]
    ref = filtered_logprobs(logits[:, p - 1 : p - 1 + out.response_ids.shape[1]], 1.0, top_k, top_p)
    ref = ref.gather(-1, out.response_ids[..., None]).squeeze(-1)
    m = out.response_mask
    torch.testing.assert_close(out.logprobs[m], ref[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.logprobs[~m], torch.zeros_like(out.logprobs[~m]))
    # The new drafts are the returned responses with those log-probs.
    for b, d in enumerate(new_drafts):
        n = int(m[b].sum())
        assert d.tokens.tolist() == out.response_ids[b, :n].tolist()
        torch.testing.assert_close(d.logprobs, out.logprobs[b, :n])


def test_draft_tree_by_hand():
    # prompt 0 = [1, 4]: rows 0, 1, 2, 4 with drafts 5-6-7, 5-6-8, 5-6-7, none -> nodes 5, 6, 7, 8
    # prompt 1 = [3]: row 3 with draft 5; prompt 2 = [9, 9]: row 5 without a draft
    prompts = [[1, 4], [3], [9, 9]]
    drafts = [[5, 6, 7], [5, 6, 8], [5, 6, 7], [5], [], []]
    tree = DraftTree.build(prompts, [0, 0, 0, 1, 0, 2], drafts, 0, "cpu")
    # segments of 6, 2 and 2 columns: the longest fills row 0, the two others share row 1
    assert tree.ids.tolist() == [[1, 4, 5, 6, 7, 8], [3, 5, 9, 9, 0, 0]]
    assert tree.position.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 0, 1, 0, 0]]
    assert tree.segment.tolist() == [[0] * 6, [1, 1, 2, 2, -1, -1]]
    assert tree.parent.tolist() == [[-1, -1, -1, 2, 3, 3], [-1] * 6]
    assert tree.row.tolist() == [0, 1, 1] and tree.start.tolist() == [0, 0, 2]
    assert tree.num_nodes.tolist() == [4, 1, 0] and tree.segment_of_row.tolist() == [0, 0, 0, 1, 0, 2]
    assert tree.path.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 2], [0, -1, -1], [-1] * 3, [-1] * 3]
    mask = tree.attention()[:, 0].int().tolist()
    assert mask[0] == [
        [1, 0, 0, 0, 0, 0],  # prompt: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # node 5: the prompt and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],  # node 7: not its sibling 8
        [1, 1, 1, 1, 0, 1],
    ]
    assert mask[1] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],  # prompt 2 does not see prompt 1's segment
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],  # padding attends to itself only (no empty row)
        [0, 0, 0, 0, 0, 1],
    ]
    assert tree.prediction_columns().tolist() == [[1, 2, 3, 4, 5], [0, 1, 0, 0, 0], [3, 3, 3, 3, 3]]
    resumed = tree.resume_attention(
        torch.tensor([0, 1, 2]), torch.tensor([[0, 1, -1], [-1] * 3, [-1] * 3]), 6
    )
    assert resumed.tolist() == [[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]

    # At most 5 columns a segment: 5-6-8 would make prompt 0's tree 6 columns long, so it starts a second
    # segment, which 5-6-7 then joins (the row without a draft goes to the open one too).
    tree = DraftTree.build(prompts, [0, 0, 0, 1, 0, 2], drafts, 0, "cpu", max_columns=5)
    assert tree.segment_of_row.tolist() == [0, 1, 2, 3, 2, 4]
    assert tree.num_nodes.tolist() == [3, 3, 3, 1, 0]
    assert tree.path.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, -1, -1], [-1] * 3, [-1] * 3]


@pytest.mark.parametrize("attention,max_columns", [("sdpa", 2048), ("eager", 2048), ("sdpa", 12)])
def test_group_drafts_sharing_prefixes_are_scored_as_one_tree(tiny_qwen, attention, max_columns, monkeypatch):
    """Rows of a group whose drafts share prefixes: one forward over packed [prompt | tree] segments; every
    row's returned log-probs are those of a plain forward over its own sequence, also when a prompt's
    drafts are split over several segments."""
    monkeypatch.setattr("bitrl.rollout.draft_tree.MAX_SEGMENT_COLUMNS", max_columns)
    tiny_qwen.set_attn_implementation(attention)
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[2]] * 2
    engine = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=M, eos_id=2, pad_id=0))
    r0 = engine.generate(prompts, generator=torch.Generator().manual_seed(1))
    lengths = r0.response_mask.sum(1).tolist()
    assert min(lengths[:3]) >= 4, "the seed must give drafts long enough to branch"
    accept_at = [2, 3, 1, None, lengths[4], 0]
    drafts = _forced_drafts(r0, accept_at)
    reject_at_3 = torch.full((lengths[0],), -1e4).index_fill(0, torch.tensor([3]), 1e4)
    drafts[1] = Draft(drafts[0].tokens.clone(), reject_at_3)  # row 0's draft again
    drafts[2] = Draft(torch.cat([drafts[0].tokens[:2], drafts[2].tokens[2:]]), drafts[2].logprobs)

    def tree_size(group):  # distinct draft prefixes of a group
        return len({tuple(d.tokens[: i + 1].tolist()) for d in group if d for i in range(len(d.tokens))})

    with recorded_forwards(tiny_qwen) as calls:
        out, stats, _ = generate_with_drafts(
            engine, prompts, drafts, generator=torch.Generator().manual_seed(8)
        )
    assert tree_size(drafts[:4]) < sum(lengths[:3])  # rows 0-2 share prefixes
    segments = [len(PROMPTS[0]) + tree_size(drafts[:4]), len(PROMPTS[2]) + tree_size(drafts[4:])]
    if max_columns >= max(segments):  # one segment per prompt
        assert calls[0] == (1 if sum(segments) <= max(segments) else 2, max(segments))
    else:
        longest = max(len(p) + len(d.tokens) for p, d in zip(prompts, drafts) if d)
        assert max_columns < calls[0][1] <= longest  # only a draft longer than the cap passes it
    assert all(shape[1] == 1 for shape in calls[1:])
    assert stats.accepted.tolist() == [2, 3, 1, 0, lengths[4], 0]

    ids, mask, pos = out.full_sequence()
    with torch.no_grad():
        logits = tiny_qwen(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    p = out.prompt_ids.shape[1]
    ref = torch.log_softmax(logits[:, p - 1 : -1].float(), -1).gather(-1, out.response_ids[..., None])[..., 0]
    m = out.response_mask
    torch.testing.assert_close(out.logprobs[m], ref[m], atol=2e-5, rtol=1e-5)


def test_verification_scores_the_vocabulary_a_chunk_of_nodes_at_a_time(tiny_qwen, monkeypatch):
    """Drafts are scored with the LM head on a few tree nodes at a time (never [rows, tokens, vocab]); the
    results do not depend on the chunk size, and a FlashAttention setting does not matter (the engine runs
    its own attention over the tree mask)."""
    engine = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=M, eos_id=2, pad_id=0, top_k=6, top_p=0.9))
    r0 = engine.generate(PROMPTS, generator=torch.Generator().manual_seed(3))
    drafts = _forced_drafts(r0, [1, None, 0, 3, 2])

    def run():
        rows = []
        hook = tiny_qwen.lm_head.register_forward_hook(lambda _, args, out: rows.append(args[0].shape[0]))
        try:
            out = generate_with_drafts(
                engine, PROMPTS, drafts, mode="exact", keep_topk=3, generator=torch.Generator().manual_seed(4)
            )
        finally:
            hook.remove()
        return out, rows

    (ref, _, ref_drafts), _ = run()
    monkeypatch.setattr("bitrl.rollout.draft_tree.default_chunk_size", lambda *a, **k: 2)
    tiny_qwen.config._attn_implementation = "flash_attention_2"
    (out, _, new_drafts), rows = run()
    assert max(rows[:3]) == 2  # the first LM-head calls score tree nodes, two at a time
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-6, rtol=0)
    for a, b in zip(new_drafts, ref_drafts):
        assert torch.equal(a.top_ids, b.top_ids)


def test_without_drafts_it_is_generate(tiny_qwen):
    engine = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=8, eos_id=2, pad_id=0, temperature=0.8))
    ref = engine.generate(PROMPTS, generator=torch.Generator().manual_seed(5))
    out, stats, _ = generate_with_drafts(
        engine, PROMPTS, [None] * len(PROMPTS), generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(out.response_ids, ref.response_ids)
    assert torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=2e-5, rtol=1e-5)
    assert stats.metrics()["reuse_hit_rate"] == 0.0


def test_same_policy_accepts_every_draft_and_is_deterministic(tiny_qwen):
    engine = RolloutEngine(tiny_qwen, Sampling(max_new_tokens=6, eos_id=2, pad_id=0))
    reuse = SpeculativeReuse(_ReuseCfg(lenience=1.0, mode="spec-rl", cache_tokens=10_000, exact_topk=0))
    keys = list(range(len(PROMPTS)))
    first, m1 = reuse.generate(engine, PROMPTS, keys, generator=torch.Generator().manual_seed(1))
    assert m1["reuse_hit_rate"] == 0
    runs = []
    for _ in range(2):
        again = copy.deepcopy(reuse)
        runs.append(again.generate(engine, PROMPTS, keys, generator=torch.Generator().manual_seed(2)))
    (second, m2), (third, m3) = runs
    # pi_new == pi_old: every draft token is accepted (u < 1 = ratio), so the first responses come back.
    assert m2["reuse_full_frac"] == 1.0 and m2["reuse_tokens_generated"] == 0
    assert torch.equal(second.response_ids, first.response_ids)
    assert (
        torch.equal(second.response_ids, third.response_ids)
        and m2["reuse_accept_hist"] == m3["reuse_accept_hist"]
    )
    assert sum(m2["reuse_accept_hist"]) == len(PROMPTS)


class _ReuseCfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# --------------------------------------------------------------------------- exactness (total variation)


V, LEN, EOS = 5, 3, 2


@pytest.fixture(scope="module")
def tv_setup():
    old = enumerable_model(V, EOS)
    new = perturbed(old, 0.2)
    prompt = [1, 3]
    t_old = next_token_table(old, prompt, vocab_size=V, max_new_tokens=LEN, eos_id=EOS)
    t_new = next_token_table(new, prompt, vocab_size=V, max_new_tokens=LEN, eos_id=EOS)
    seqs = sequences(t_new, V, LEN, EOS)
    return old, new, prompt, t_old, t_new, seqs


def test_tv_formula(tv_setup):
    _, _, _, t_old, t_new, seqs = tv_setup
    assert len(seqs) == 1 + 4 + 16 + 64
    p_new, p_old = fresh_distribution(t_new, seqs), fresh_distribution(t_old, seqs)
    assert math.isclose(sum(p_new.values()), 1.0, abs_tol=1e-5)
    assert total_variation(p_new, p_new) == 0 and total_variation(p_new, p_old) > 0.1
    for mode, k, lenience in [("exact", V, 1.0), ("exact", V, 0.5), ("spec-rl", 0, 1.0), ("spec-rl", 0, 2.0)]:
        dist, summary = reuse_distribution(t_new, t_old, seqs, lenience=lenience, mode=mode, old_topk=k)
        assert math.isclose(sum(dist.values()), 1.0, abs_tol=1e-5)
        tv = total_variation(dist, p_new)
        if mode == "exact":
            assert tv < 1e-5  # plain speculative sampling with the full old distribution is exact
        else:
            assert 0.05 < tv < total_variation(p_new, p_old) + 1e-6
        assert 0 < summary["fully_reused"] < 1
    # Reusing against the same policy is exact in both modes, and every draft is fully reused.
    for mode in ("spec-rl", "exact"):
        dist, summary = reuse_distribution(t_old, t_old, seqs, lenience=1.0, mode=mode, old_topk=V)
        assert total_variation(dist, p_old) < 1e-5 and math.isclose(
            summary["fully_reused"], 1.0, rel_tol=1e-5
        )


@pytest.mark.parametrize("mode,old_topk", [("spec-rl", 0), ("exact", V), ("exact", 1)])
def test_engine_matches_the_tv_formula(tv_setup, mode, old_topk):
    """The engine's empirical response distribution is within sampling noise of the formula's."""
    n = 12000
    empirical, dist = engine_against_formula(
        tv_setup, n, mode=mode, old_topk=old_topk, max_new_tokens=LEN, eos_id=EOS
    )
    # E[TV] of n samples is about sum_y sqrt(p_y / (2 pi n)); allow a wide margin.
    noise = sum(math.sqrt(p / (2 * math.pi * n)) for p in dist.values())
    assert total_variation(empirical, dist) < 1.6 * noise + 0.005
    if mode == "spec-rl":
        _, _, _, _, t_new, seqs = tv_setup
        assert total_variation(empirical, fresh_distribution(t_new, seqs)) > 2 * noise


# --------------------------------------------------------------------------- cache


def _draft(n, h=0):
    return Draft(torch.arange(n), torch.zeros(n), prompt_hash=h)


def test_cache_lru_eviction_by_tokens():
    cache = RolloutCache(max_tokens=10)
    cache.put("a", _draft(4))
    cache.put("b", _draft(4))
    assert cache.tokens == 8 and cache.keys() == ["a", "b"]
    assert cache.get("a") is not None  # a becomes most recently used
    cache.put("c", _draft(3))  # 11 > 10: the least recently used (b) goes
    assert cache.keys() == ["a", "c"] and cache.tokens == 7 and cache.evictions == 1
    cache.put("a", _draft(6))  # replacing an entry re-counts its tokens
    assert cache.tokens == 9 and cache.keys() == ["c", "a"]
    cache.put("big", _draft(11))  # larger than the cap: not stored, nothing evicted
    assert "big" not in cache and cache.tokens == 9
    cache.put("d", _draft(5))
    assert cache.keys() == ["d"] and cache.evictions == 3
    assert cache.get("missing") is None
    # a draft recorded for another prompt is a miss, and is dropped
    assert cache.get("d", prompt_hash=123) is None and len(cache) == 0
    with pytest.raises(ValueError):
        RolloutCache(0)


def test_cache_checkpoint_round_trip(tmp_path):
    cache = RolloutCache(max_tokens=100)
    for i, key in enumerate([("p1", 0), ("p2", 1), ("p3", 0)]):
        cache.put(
            key,
            Draft(
                torch.arange(i + 2),
                torch.randn(i + 2),
                torch.zeros(i + 2, 3).long(),
                torch.randn(i + 2, 3),
                7,
            ),
        )
    cache.get(("p1", 0))
    torch.save({"reuse": cache.state_dict()}, tmp_path / "ck.pt")
    restored = RolloutCache(max_tokens=100)
    restored.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False)["reuse"])
    assert restored.keys() == cache.keys() == [("p2", 1), ("p3", 0), ("p1", 0)]
    assert restored.tokens == cache.tokens and restored.evictions == cache.evictions
    keys = cache.keys()
    for key in keys:
        a, b = cache.get(key), restored.get(key)
        for f in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            assert torch.equal(getattr(a, f), getattr(b, f))
        assert a.prompt_hash == b.prompt_hash
    smaller = RolloutCache(max_tokens=5)  # a lowered cap evicts the oldest on load
    smaller.load_state_dict(cache.state_dict())
    assert smaller.keys() == [("p1", 0)] and smaller.tokens == 2


def test_fixed_prompt_batches_cover_each_epoch_once():
    pool = list(range(12))
    batches = [fixed_prompt_batch(pool, s, 4, seed=0) for s in range(6)]
    assert sorted(sum(batches[:3], [])) == pool and sorted(sum(batches[3:], [])) == pool
    assert sum(batches[:3], []) != sum(batches[3:], [])  # each epoch has its own order
    assert batches == [fixed_prompt_batch(pool, s, 4, seed=0) for s in range(6)]  # stateless


def test_reuse_config_validation():
    from bitrl.engine.config import ConfigError, load_config

    cfg = load_config(
        None, ["rollout.reuse.enabled=true", "rollout.reuse.mode=exact", "rollout.fixed_prompts=64"]
    )
    assert cfg.rollout.reuse.enabled and cfg.rollout.reuse.mode == "exact" and cfg.rollout.fixed_prompts == 64
    for override, field in [
        ("rollout.reuse.lenience=0", "rollout.reuse.lenience"),
        ("rollout.reuse.mode=fast", "rollout.reuse.mode"),
        ("rollout.reuse.cache_tokens=0", "rollout.reuse.cache_tokens"),
        ("rollout.reuse.exact_topk=-1", "rollout.reuse.exact_topk"),
        ("rollout.fixed_prompts=0", "rollout.fixed_prompts"),
        ("rollout.reuse.nope=1", "rollout.reuse.nope: unknown field"),
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [override])


def test_draft_length_against_max_new_tokens(tiny_qwen):
    """Drafts are cut at max_new_tokens; an accepted draft that has not ended nor hit the limit goes on."""

    def engine(max_new_tokens):
        return RolloutEngine(tiny_qwen, Sampling(max_new_tokens=max_new_tokens, eos_id=2, pad_id=0))

    r0 = engine(4).generate(PROMPTS, generator=torch.Generator().manual_seed(4))
    drafts = _forced_drafts(r0, [4] * len(PROMPTS))  # every token accepted
    short, stats, _ = generate_with_drafts(
        engine(2), PROMPTS, drafts, generator=torch.Generator().manual_seed(0)
    )
    assert stats.fully_reused.all() and torch.equal(short.response_ids, r0.response_ids[:, :2])
    long, stats, _ = generate_with_drafts(
        engine(7), PROMPTS, drafts, generator=torch.Generator().manual_seed(0)
    )
    for b in range(len(PROMPTS)):
        n = int(r0.response_mask[b].sum())
        got = long.response_ids[b][long.response_mask[b]].tolist()
        assert got[:n] == r0.response_ids[b, :n].tolist()
        ended = r0.response_ids[b, n - 1] == 2
        assert bool(stats.fully_reused[b]) == bool(ended)
        assert len(got) == n if ended else (len(got) == 7 or got[-1] == 2)


def test_low_precision_rollout_copy(tiny_qwen):
    """A bf16 rollout copy verifies and resumes; log-probs are its own (fp32), within bf16 noise."""
    model = copy.deepcopy(tiny_qwen).to(torch.bfloat16)
    engine = RolloutEngine(model, Sampling(max_new_tokens=8, eos_id=2, pad_id=0))
    r0 = engine.generate(PROMPTS, generator=torch.Generator().manual_seed(6))
    drafts = _forced_drafts(r0, [1, 0, 2, None, 3])
    out, stats, _ = generate_with_drafts(
        engine, PROMPTS, drafts, mode="exact", keep_topk=4, generator=torch.Generator().manual_seed(1)
    )
    assert out.logprobs.dtype == torch.float32
    with torch.no_grad():
        full, _ = token_logprobs(model, out, with_entropy=False)
    m = out.response_mask
    torch.testing.assert_close(out.logprobs[m], full[m], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("precision", ["fp8", "mxfp4", "nvfp4"])
def test_quantized_rollout_copy(tiny_qwen, precision):
    """Reuse runs on every quantized rollout copy; returned log-probs are that copy's own."""
    from bitrl.rollout.precision import make_rollout_model

    model = make_rollout_model(tiny_qwen, precision)
    engine = RolloutEngine(model, Sampling(max_new_tokens=6, eos_id=2, pad_id=0))
    r0 = engine.generate(PROMPTS, generator=torch.Generator().manual_seed(6))
    out, _, _ = generate_with_drafts(
        engine, PROMPTS, _forced_drafts(r0, [1, 0, 2, None, 3]), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        full, _ = token_logprobs(model, out, with_entropy=False)
    m = out.response_mask
    torch.testing.assert_close(out.logprobs[m], full[m], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("refresh", [False, True])
def test_refresh_flat_drops_the_drafts_of_groups_without_signal(tmp_path, refresh):
    """An untrained model never answers right, so every group is flat: with refresh_flat no draft survives."""
    from bitrl.engine.config import load_config
    from bitrl.engine.loop import run

    cfg = load_config(
        None,
        [
            *TINY_DEMO_MODEL,
            "task.n_eval=8",
            "warmstart.steps=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "rollout.fixed_prompts=8",
            "rollout.reuse.enabled=true",
            f"rollout.reuse.refresh_flat={str(refresh).lower()}",
            "steps=6",
            f"out_dir={tmp_path}",
        ],
    )
    steps = [r for r in run(cfg, log=lambda *a: None) if r["step"] > 2]  # epochs 2 and 3
    assert all(r["flat_group_frac"] == 1.0 for r in steps)
    assert all(r["reuse_hit_rate"] == (0.0 if refresh else 1.0) for r in steps)


def test_cache_discard():
    cache = RolloutCache(max_tokens=10)
    cache.put("a", _draft(4))
    cache.discard("a")
    cache.discard("missing")
    assert len(cache) == 0 and cache.tokens == 0


def test_batched_residual_equals_row_by_row_with_uneven_old_support():
    """Rejected rows resample from their own residual even when drafts store different amounts of pi_old
    (including token id 0, which a zero-mass padding entry must not overwrite)."""
    from bitrl.rollout.reuse import _resample_rejected

    torch.manual_seed(0)
    vocab = 6
    logp = torch.log_softmax(torch.randn(3, vocab), -1)
    old = torch.log_softmax(torch.randn(3, 2, vocab), -1)  # pi_old at draft positions 0 and 1
    tokens = torch.tensor([[0, 3], [2, 0], [5, 1]])
    top_lp, top_ids = old.topk(3, dim=-1)
    drafts = [
        Draft(tokens[0], old[0].gather(-1, tokens[0, :, None]).squeeze(-1), top_ids[0], top_lp[0]),
        Draft(tokens[1], old[1].gather(-1, tokens[1, :, None]).squeeze(-1)),  # no stored top-k
        Draft(
            tokens[2], old[2].gather(-1, tokens[2, :, None]).squeeze(-1), top_ids[2, :, :1], top_lp[2, :, :1]
        ),
    ]
    active, a_acc = torch.arange(3), torch.tensor([0, 1, 1])
    rejected = torch.tensor([True, True, True])
    got = _resample_rejected(logp, active, rejected, a_acc, drafts, 1.0, torch.device("cpu"))
    for i, d in enumerate(drafts):
        a = int(a_acc[i])
        ids, lps = d.tokens[a : a + 1], d.logprobs[a : a + 1]
        if d.top_ids is not None:
            ids, lps = torch.cat([d.top_ids[a], ids]), torch.cat([d.top_logprobs[a], lps])
        want = residual_logprobs(logp[i : i + 1], ids[None], lps[None], 1.0)[0]
        torch.testing.assert_close(got[i], want)
