"""Speculative rollout reuse (SPEC-RL): last epoch's responses are drafts that the current policy verifies.

For every prompt seen before, the rollout cache holds the response sampled for it last time, the log-probs
it was sampled with (pi_old) and, for the "exact" mode, the top-k of the old sampling distribution at each
position (bitrl.rollout.draft_cache). `generate_with_drafts` then

1. verifies all drafts in ONE forward, prompts included (bitrl.rollout.draft_tree): each distinct prompt
   is followed by the prefix tree of its rows' drafts (the G samples of a group often share their first
   tokens or their whole response, and each shared prefix is scored once), and these [prompt | tree]
   segments are packed into rows. A 4D attention mask lets each tree node see its prompt and its
   ancestors, and its position is the prompt length plus its depth, so pi_new at every node is what a plain
   forward over that row's own sequence gives;
2. accepts draft token i if u_i <= min(1, lenience * pi_new(y_i) / pi_old(y_i)), tested in log space, with
   u_i drawn from the rollout generator; the accepted prefix is the run of accepted tokens before the first
   rejection;
3. returns fully accepted, finished drafts as they are, and resumes generation for the other rows at their
   first rejected position, reusing the verification KV cache (no second prefill). Each resumed row takes a
   copy of its segment's packed row and attends to its prompt and to the nodes of its accepted prefix only;
   every row keeps its own position counter, so no cache columns are moved. Columns after the last one any
   resumed row needs are cropped, and rows that need no generation are dropped from the cache before
   decoding.

At the first rejected position the "spec-rl" mode samples from pi_new (SPEC-RL); the "exact" mode samples
from the residual norm(max(0, pi_new - min(pi_old, lenience * pi_new))), which is plain speculative sampling
at lenience 1 (and exact for every lenience <= 1; for lenience > 1 it equals norm(max(0, pi_new - pi_old))
and the accepted part is biased). pi_old is known only on the stored top-k tokens plus the drafted token:
the rest of its mass is treated as zero, so the residual over-weights tokens outside the stored support
(exact when the stored support covers the old distribution, e.g. top_k / top_p filtering with k <=
exact_topk, or a small vocabulary).

The log-probs returned are those of the current rollout policy's sampling distribution for every token,
accepted or generated (filtered and renormalised like `RolloutEngine.generate`'s), so the trainer sees an
ordinary `Rollout`.
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import dataclass, field

import torch

from bitrl.kernels.sampling import draw_step_seed, fused_sample, sample_seeds
from bitrl.rollout.batch import Rollout, distinct_prompts
from bitrl.rollout.decode_loop import Contexts
from bitrl.rollout.draft_cache import Draft, RolloutCache, prompt_fingerprint
from bitrl.rollout.draft_tree import DraftTree, score_nodes
from bitrl.rollout.generation import RolloutEngine, check_sample_ids

MODES = ("spec-rl", "exact")


# --------------------------------------------------------------------------- acceptance


def acceptance(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
    lenience: float = 1.0,
):
    """Per-token acceptance and accepted-prefix length.

    new_logprobs, old_logprobs, uniforms: [B, D] (log pi_new(y_i), log pi_old(y_i), u_i ~ U[0, 1)); lengths:
    [B] draft lengths (positions >= length are ignored). Token i is accepted iff log u_i <= min(0,
    log(lenience) + log pi_new(y_i) - log pi_old(y_i)), i.e. u_i <= min(1, lenience * ratio); a token
    outside the new support (log pi_new = -inf) is never accepted. Returns (accepted [B, D] bool,
    accepted_len [B] int64: the number of leading accepted tokens).
    """
    if lenience <= 0 or not math.isfinite(lenience):
        raise ValueError(f"lenience must be a finite number > 0, got {lenience}")
    log_ratio = math.log(lenience) + new_logprobs.float() - old_logprobs.float()
    accepted = torch.log(uniforms.float()) <= log_ratio.clamp(max=0.0)
    accepted &= torch.isfinite(new_logprobs)
    width = new_logprobs.shape[1]
    in_draft = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    accepted &= in_draft
    accepted_len = accepted.long().cumprod(dim=1).sum(dim=1)
    return accepted, accepted_len


def residual_logprobs(
    new_logprobs: torch.Tensor,
    old_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    lenience: float = 1.0,
) -> torch.Tensor:
    """log norm(max(0, p - min(q, lenience * p))) per row, the distribution to resample a rejected position
    from.

    new_logprobs: [N, V] log p (the current sampling distribution); old_ids / old_logprobs: [N, K] the known
    entries of q (unknown entries count as 0; -inf entries are harmless, and an id may repeat if every copy
    carries the same value). Where the residual has no mass (p == q), returns log p.
    """
    p = new_logprobs.float().exp()
    q = torch.zeros_like(p).scatter(-1, old_ids, old_logprobs.float().exp())
    residual = (p - torch.minimum(q, lenience * p)).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    empty = mass <= 1e-12
    residual = torch.where(empty, p, residual / mass.clamp(min=1e-30))
    return residual.log()


# --------------------------------------------------------------------------- generation from drafts


@dataclass
class ReuseStats:
    """What one `generate_with_drafts` call did. accepted / draft_len: [B] (0 where a row had no draft)."""

    has_draft: torch.Tensor
    draft_len: torch.Tensor
    accepted: torch.Tensor
    fully_reused: torch.Tensor
    tokens_generated: int
    tokens_returned: int
    verify_time_s: float
    decode_steps: int
    max_new_tokens: int
    extra: dict = field(default_factory=dict)

    def metrics(self) -> dict:
        """Scalars (and one histogram list) for a step record; prefixed `reuse_`."""
        rows = self.has_draft
        acc = self.accepted[rows].float()
        out = {
            "reuse_hit_rate": float(rows.float().mean()),
            "reuse_full_frac": float(self.fully_reused.float().mean()),
            "reuse_tokens_generated": self.tokens_generated,
            "reuse_tokens_returned": self.tokens_returned,
            "reuse_verify_time_s": self.verify_time_s,
            "reuse_decode_steps": self.decode_steps,
        }
        if rows.any():
            q = torch.quantile(acc, torch.tensor([0.1, 0.5, 0.9]))
            out |= {
                "reuse_accept_len_mean": float(acc.mean()),
                "reuse_accept_len_p10": float(q[0]),
                "reuse_accept_len_p50": float(q[1]),
                "reuse_accept_len_p90": float(q[2]),
                "reuse_accept_token_frac": float(acc.sum() / self.draft_len[rows].sum().clamp(min=1)),
                "reuse_accept_hist": torch.bincount(
                    self.accepted[rows], minlength=self.max_new_tokens + 1
                ).tolist(),
            }
        return out | self.extra


def _packed_per_call(generate):
    """`generate(engine, ...)` with the engine's products packed once for the call, freed after it
    (`Decoder.packing`)."""

    @functools.wraps(generate)
    def run(engine, *args, **kwargs):
        with engine.decoder.packing():
            return generate(engine, *args, **kwargs)

    return run


@torch.no_grad()
@_packed_per_call
def generate_with_drafts(
    engine: RolloutEngine,
    prompts: list[list[int]],
    drafts: list[Draft | None],
    *,
    lenience: float = 1.0,
    mode: str = "spec-rl",
    keep_topk: int = 0,
    generator: torch.Generator | None = None,
    sample_ids: torch.Tensor | None = None,
) -> tuple[Rollout, ReuseStats, list[Draft]]:
    """Verify each row's draft with the current policy (the engine's model, sampling as engine.sampling
    says), then generate past the first rejection.

    prompts: token lists; drafts: a Draft or None per row (drafts longer than max_new_tokens are cut).
    Returns (rollout, stats, new_drafts): the Rollout has the layout and log-prob convention of
    `engine.generate`
    (log-probs of the current policy's sampling distribution for every returned token); new_drafts are the
    returned responses as drafts for the next epoch (with the top-`keep_topk` of the current distribution at
    every position).

    Random numbers, all from `generator`: one uniform per draft position ([B, max draft length], none when
    no row has a draft), then per decoding step one multinomial over the rows that still need generation, as
    `engine.generate` draws them. So given a generator state after the uniforms, the resumed rows produce
    the tokens that `engine.generate` produces for the prompts extended by their accepted prefixes (spec-rl
    mode, or
    rows that were not rejected).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sampling, decoder, device = engine.sampling, engine.decoder, engine.device
    if sampling.temperature <= 0:
        raise ValueError("speculative reuse needs sampling (temperature > 0)")
    if len(drafts) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(drafts)} drafts")
    t_start = time.perf_counter()
    max_new_tokens, eos_id, pad_id = sampling.max_new_tokens, sampling.eos_id, sampling.pad_id
    batch = len(prompts)
    keep_topk = min(keep_topk, decoder.model.config.vocab_size)

    # ---- 1. verification: ONE forward over each distinct prompt followed by the prefix tree of its drafts
    draft_tokens = [(d.tokens[:max_new_tokens].tolist() if d is not None else []) for d in drafts]
    n = torch.tensor([len(t) for t in draft_tokens], dtype=torch.long, device=device)
    width_d = max(len(t) for t in draft_tokens)
    p_ids, p_mask, prompt_rows = distinct_prompts(prompts, pad_id, device)
    distinct = [ids[mask].tolist() for ids, mask in zip(p_ids, p_mask)]
    tree = DraftTree.build(distinct, prompt_rows.tolist(), draft_tokens, pad_id, device)
    rows_t, columns = tree.ids.shape
    cache = decoder.new_cache(rows_t, columns, engine.options.kv_cache_dtype)
    col_index = torch.arange(columns, device=device).expand(rows_t, -1)
    hidden = decoder.hidden(tree.ids, tree.position, cache, col_index, tree.attention()[:, 0])
    predicting = hidden[tree.row[:, None], tree.prediction_columns()]  # [S, N+1, H]
    # [B, D+1]: the prediction column (within its segment) for response position i of row b's draft
    col = torch.cat([tree.path.new_zeros((batch, 1)), tree.path + 1], dim=1)
    segment = tree.segment_of_row  # [B]
    drafted = torch.tensor(
        [t + [pad_id] * (width_d - len(t)) for t in draft_tokens], dtype=torch.long, device=device
    ).view(batch, width_d)
    # log pi_new of each drafted token, and the top-k of each node's distribution, a chunk of nodes at a time
    nodes = segment[:, None] * predicting.shape[1] + col[:, :width_d]  # [B, D] into the flattened nodes
    new_lp_drafted, node_top = score_nodes(
        decoder, predicting.flatten(0, 1), nodes, drafted, sampling, keep_topk
    )

    # ---- 2. acceptance
    old_lp = torch.nn.utils.rnn.pad_sequence(
        [d.logprobs[: len(t)].float() if t else torch.zeros(0) for t, d in zip(draft_tokens, drafts)],
        batch_first=True,
    ).to(device)
    old_lp = torch.cat([old_lp, old_lp.new_zeros(batch, width_d - old_lp.shape[1])], dim=1)
    if width_d > 0:
        gen_device = generator.device if generator is not None else device
        uniforms = torch.rand((batch, width_d), generator=generator, device=gen_device).to(device)
        _, accepted_len = acceptance(new_lp_drafted, old_lp, uniforms, n, lenience)
    else:
        accepted_len = torch.zeros(batch, dtype=torch.long, device=device)
    seeds = sample_seeds(draw_step_seed(generator), check_sample_ids(sample_ids, batch, device))
    rejected = accepted_len < n
    finished = torch.tensor(
        [len(t) > 0 and (t[-1] == eos_id or len(t) >= max_new_tokens) for t in draft_tokens],
        dtype=torch.bool,
        device=device,
    )
    fully_reused = ~rejected & finished
    verify_time = time.perf_counter() - t_start

    # ---- 3. resume the other rows at their first rejected (or first undrafted) position, in the engine
    active = (~fully_reused).nonzero().squeeze(-1)
    steps_c = 1
    cont_len = torch.zeros(batch, dtype=torch.long, device=device)
    cont_tok = torch.full((batch, 1), pad_id, dtype=torch.long, device=device)
    cont_lp = torch.zeros((batch, 1), dtype=torch.float32, device=device)
    cont_top = None
    decode_steps = 0
    if len(active):
        a_acc = accepted_len[active]
        sel = segment[active]
        # A resumed row attends to its prompt and the tree nodes of its accepted prefix, in its segment's
        # packed row of the verification cache; the columns after the last one any resumed row needs go.
        prefix = torch.arange(width_d, device=device)[None, :] < a_acc[:, None]
        path = torch.where(prefix, tree.path[active], -1)
        kept = int((tree.first_node[sel] + (path.max(dim=1).values + 1 if width_d else 0)).max())
        # the current policy at the resume position: what the returned log-probs are measured under, and
        # (spec-rl, or a row whose draft simply ended) what the token is drawn from
        resume_logits = decoder.logits(predicting[sel, col[active, a_acc]])
        first_tok, first_lp = sampling.draw(resume_logits, seeds[active], a_acc)
        if mode == "exact" and bool(rejected[active].any()):
            step_logp = sampling.logprobs(resume_logits)
            residual = _resample_rejected(step_logp, active, rejected, a_acc, drafts, lenience, device)
            redrawn, _ = fused_sample(residual, seeds[active], a_acc, 1.0, 0, 1.0)
            first_tok = torch.where(rejected[active], redrawn, first_tok)
            first_lp = step_logp.gather(-1, first_tok[:, None]).squeeze(-1)
        first_top = sampling.top(resume_logits, keep_topk) if keep_topk else None
        ctx = Contexts(
            cache=cache,
            row=tree.row[sel],
            visible=tree.resume_attention(sel, path, kept).bool(),
            position=tree.prompt_len[sel] + a_acc,
            token=first_tok,
            counter=a_acc + 1,
            budget=max_new_tokens - a_acc - 1,
            seed=seeds[active],
        )
        ids, mask, lps, top, decode_steps = engine.continue_after_first(ctx, first_lp, first_top)
        steps_c = ids.shape[1]
        cont_tok = torch.full((batch, steps_c), pad_id, dtype=torch.long, device=device)
        cont_lp = torch.zeros((batch, steps_c), dtype=torch.float32, device=device)
        cont_len[active] = mask.sum(1)
        cont_tok[active], cont_lp[active] = ids, lps
        if keep_topk:
            k = top[0].shape[-1]
            cont_top = (
                torch.zeros((batch, steps_c, k), dtype=torch.long, device=device),
                torch.full((batch, steps_c, k), float("-inf"), device=device),
            )
            cont_top[0][active], cont_top[1][active] = top

    # ---- 4. assemble: accepted prefix + continuation, log-probs of the current policy everywhere
    total = accepted_len + cont_len
    width_r = int(total.max())
    cols_r = torch.arange(width_r, device=device)[None, :]
    in_prefix = cols_r < accepted_len[:, None]
    from_cont = (cols_r - accepted_len[:, None]).clamp(0, steps_c - 1)
    response_mask = cols_r < total[:, None]

    def splice(prefix: torch.Tensor, cont: torch.Tensor, fill) -> torch.Tensor:
        """[B, width_r, ...]: prefix[:, j] for j < accepted, else cont[:, j - accepted]; fill past the end."""
        extra = prefix.shape[2:]
        if prefix.shape[1] < width_r:
            pad = prefix.new_full((batch, width_r - prefix.shape[1], *extra), fill)
            prefix = torch.cat([prefix, pad], dim=1)
        prefix = prefix[:, :width_r]
        index = from_cont.view(batch, width_r, *([1] * len(extra))).expand(batch, width_r, *extra)
        out = torch.where(in_prefix.view(batch, width_r, *([1] * len(extra))), prefix, cont.gather(1, index))
        return out.masked_fill(~response_mask.view(batch, width_r, *([1] * len(extra))), fill)

    response_ids = splice(drafted, cont_tok, pad_id)
    logprobs = splice(new_lp_drafted.float(), cont_lp, 0.0)
    rollout = Rollout(p_ids[prompt_rows], p_mask[prompt_rows], response_ids, response_mask, logprobs)

    # ---- 5. the returned responses are next epoch's drafts
    lengths = total.tolist()
    top_ids = top_lp = None
    if keep_topk:
        k = node_top[0].shape[-1]
        acc_ids, acc_top = node_top[0].view(batch, width_d, k), node_top[1].view(batch, width_d, k)
        if cont_top is None:
            cont_top = (
                acc_ids.new_zeros((batch, steps_c, k)),
                acc_top.new_full((batch, steps_c, k), float("-inf")),
            )
        top_ids = splice(acc_ids, cont_top[0], 0).cpu()
        top_lp = splice(acc_top, cont_top[1], float("-inf")).cpu()
    hashes = [prompt_fingerprint(p) for p in prompts]
    ids_cpu, lps_cpu = response_ids.cpu(), logprobs.cpu()
    new_drafts = [
        Draft(
            tokens=ids_cpu[b, :length].clone(),
            logprobs=lps_cpu[b, :length].clone(),
            top_ids=None if top_ids is None else top_ids[b, :length].clone(),
            top_logprobs=None if top_lp is None else top_lp[b, :length].clone(),
            prompt_hash=hashes[b],
        )
        for b, length in enumerate(lengths)
    ]
    tokens_returned = int(response_mask.sum())
    stats = ReuseStats(
        has_draft=(n > 0).cpu(),
        draft_len=n.cpu(),
        accepted=accepted_len.cpu(),
        fully_reused=fully_reused.cpu(),
        tokens_generated=tokens_returned - int(accepted_len.sum()),
        tokens_returned=tokens_returned,
        verify_time_s=verify_time,
        decode_steps=decode_steps,
        max_new_tokens=max_new_tokens,
    )
    return rollout, stats, new_drafts


def _resample_rejected(logp, active, rejected, a_acc, drafts, lenience, device):
    """Replace the resume distribution of rejected rows by the speculative-sampling residual, all rows in one
    call. logp: [A, V] the resume distributions of the `active` rows; a_acc [A]: their accepted lengths."""
    picked = rejected[active].nonzero().squeeze(-1)  # positions in `active` (one host sync for all rows)
    known_ids, known_lps = [], []
    for b, a in zip(active[picked].tolist(), a_acc[picked].tolist()):
        # what is known of pi_old at the rejected position: stored top-k + the drafted token
        d = drafts[b]
        ids, lps = d.tokens[a : a + 1].long(), d.logprobs[a : a + 1].float()
        if d.top_ids is not None and d.top_ids.shape[-1]:
            ids = torch.cat([d.top_ids[a].long(), ids])
            lps = torch.cat([d.top_logprobs[a].float(), lps])
        known_ids.append(ids)
        known_lps.append(lps)
    # Rows may know different numbers of entries: pad by repeating a row's drafted token, a duplicate that
    # scatters the same value (a padding id with zero mass could overwrite a real entry of that id).
    width = max(len(x) for x in known_ids)
    ids = torch.stack([torch.cat([x, x[-1:].expand(width - len(x))]) for x in known_ids]).to(device)
    lps = torch.stack([torch.cat([x, x[-1:].expand(width - len(x))]) for x in known_lps]).to(device)
    logp = logp.clone()
    logp[picked] = residual_logprobs(logp[picked], ids, lps, lenience)
    return logp


# --------------------------------------------------------------------------- the loop's entry point


class SpeculativeReuse:
    """The rollout cache plus the settings to verify and extend its drafts. cfg: an object with lenience,
    mode, cache_tokens and exact_topk (bitrl.engine.config.ReuseConfig)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.cache = RolloutCache(cfg.cache_tokens)

    def generate(
        self,
        engine: RolloutEngine,
        prompts: list[list[int]],
        keys: list,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[Rollout, dict]:
        """Rollout by `engine` for `prompts` (row i's draft cached under keys[i]); updates the cache. Returns
        (rollout, metrics)."""
        t0 = time.perf_counter()
        hashes = [prompt_fingerprint(p) for p in prompts]
        drafts = [self.cache.get(k, h) for k, h in zip(keys, hashes)]
        keep_topk = self.cfg.exact_topk if self.cfg.mode == "exact" else 0
        rollout, stats, new = generate_with_drafts(
            engine,
            prompts,
            drafts,
            lenience=self.cfg.lenience,
            mode=self.cfg.mode,
            keep_topk=keep_topk,
            generator=generator,
        )
        for key, draft in zip(keys, new):
            self.cache.put(key, draft)
        stats.extra = {
            "reuse_cache_tokens": self.cache.tokens,
            "reuse_cache_evictions": self.cache.evictions,
            "reuse_rollout_time_s": time.perf_counter() - t0,
        }
        return rollout, stats.metrics()

    def state_dict(self) -> dict:
        return {"cache": self.cache.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.cache.load_state_dict(state["cache"])


def fixed_prompt_batch(pool: list, step: int, per_step: int, seed: int) -> list:
    """The `per_step` problems of `step` when training epoch by epoch over a fixed `pool`: each epoch visits
    the pool in its own seeded order, and steps take consecutive slices (crossing epoch boundaries).
    Stateless, so a resumed run draws the same batches."""
    size = len(pool)
    out = []
    for index in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(index, size)
        order = list(range(size))
        random.Random(f"epoch-{seed}-{epoch}").shuffle(order)
        out.append(pool[order[offset]])
    return out


def draw_prompt_pool(task, size: int, seed: int) -> list:
    """`size` distinct training problems (fewer if the task has fewer), drawn once with a seeded RNG."""
    rng = random.Random(f"prompt-pool-{seed}")
    pool, seen = [], set()
    for _ in range(100 * size):
        if len(pool) == size:
            break
        problem = task.sample(rng)
        if problem.uid not in seen:
            seen.add(problem.uid)
            pool.append(problem)
    return pool
