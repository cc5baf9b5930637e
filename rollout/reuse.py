"""Speculative rollout reuse (SPEC-RL): last epoch's responses are drafts that the current policy verifies.

For every prompt seen before, the rollout cache holds the response sampled for it last time, the log-probs
it was sampled with (pi_old) and, for the "exact" mode, the top-k of the old sampling distribution at each
position. `generate_with_drafts` then

1. verifies all drafts in ONE forward, prompts included (`DraftTree`): each distinct prompt is followed by
   the prefix tree of its rows' drafts (the G samples of a group often share their first tokens or their
   whole response, and each shared prefix is scored once), and these [prompt | tree] segments are packed
   into rows. A 4D attention mask lets each tree node see its prompt and its ancestors, and its position is
   the prompt length plus its depth, so pi_new at every node is what a plain forward over that row's own
   sequence gives;
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
accepted or generated (filtered and renormalised like `generate`'s), so the trainer sees an ordinary
`Rollout`.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from bitrl.kernels.fused_logprobs import default_chunk_size
from bitrl.kernels.sampling import draw_step_seed, filter_logits, fused_sample, sample_seeds
from bitrl.rollout.engine import (
    Contexts,
    Rollout,
    Sampling,
    check_sample_ids,
    continue_after_first,
    decoder_for,
    distinct_prompts,
    engine_options,
)

MODES = ("spec-rl", "exact")


# --------------------------------------------------------------------------- cache


def prompt_fingerprint(prompt: list[int]) -> int:
    """A stable 32-bit hash of a prompt's token ids (guards a cache key against a changed prompt)."""
    return zlib.crc32(array("q", prompt).tobytes())


@dataclass
class Draft:
    """One cached response. tokens [L] int64 and logprobs [L] fp32 (log-probs of the distribution each token
    was sampled from); top_ids [L, K] int64 / top_logprobs [L, K] fp32: the K most likely tokens of that
    distribution (K may be 0). prompt_hash: `prompt_fingerprint` of the prompt it answers."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt_hash: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class RolloutCache:
    """Drafts keyed by prompt identity, least recently used out once they hold more than `max_tokens`
    tokens.

    A key is any hashable, picklable value (the loop uses (problem uid, sample index within the group)). The
    cost of an entry is its number of response tokens; a draft longer than the cap is not stored.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict = OrderedDict()
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def keys(self) -> list:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key, prompt_hash: int | None = None) -> Draft | None:
        """The draft for `key` (marking it most recently used), or None. A draft recorded for a different
        prompt (its prompt_hash differs from a given one) is dropped and counts as a miss."""
        draft = self._entries.get(key)
        if draft is None:
            return None
        if prompt_hash is not None and draft.prompt_hash != prompt_hash:
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return draft

    def put(self, key, draft: Draft) -> None:
        if key in self._entries:
            self._remove(key)
        if draft.num_tokens > self.max_tokens:
            return
        self._entries[key] = draft
        self.tokens += draft.num_tokens
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))
            self.evictions += 1

    def discard(self, key) -> None:
        """Forget the draft under `key`, if any."""
        if key in self._entries:
            self._remove(key)

    def _remove(self, key) -> None:
        self.tokens -= self._entries.pop(key).num_tokens

    def state_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "evictions": self.evictions,
            "entries": [(k, d.__dict__.copy()) for k, d in self._entries.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self._entries = OrderedDict((k, Draft(**d)) for k, d in state["entries"])
        self.tokens = sum(d.num_tokens for d in self._entries.values())
        self.evictions = state["evictions"]
        if self.tokens > self.max_tokens:  # the cap may have been lowered since the checkpoint
            while self.tokens > self.max_tokens:
                self._remove(next(iter(self._entries)))
                self.evictions += 1


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


def _top(logp: torch.Tensor, k: int):
    """Top-k (ids int64, logprobs fp32) over the last dim of logp [..., V]; k = 0 gives empty tensors."""
    k = min(k, logp.shape[-1])
    if k == 0:
        empty = logp.new_empty((*logp.shape[:-1], 0))
        return empty.long(), empty.float()
    values, ids = torch.topk(logp, k, dim=-1)
    return ids, values.float()


# A segment is a prompt followed by the prefix tree of some of its drafts. The verification mask costs
# rows x columns^2 booleans, so a prompt's drafts start a new segment once its tree would pass this many
# columns (a single draft longer than that still gets a segment of its own).
MAX_SEGMENT_COLUMNS = 2048


@dataclass
class DraftTree:
    """Every draft of a rollout, laid out for ONE verification forward.

    The drafts of each distinct prompt are merged into a prefix tree (the G samples of a group often share
    their first tokens or their whole response; each shared prefix is scored once). A prompt followed by
    its tree is a segment (a prompt whose tree would pass `max_columns` gets several); segments are packed,
    longest first, into rows no longer than the longest segment, so the forward carries little padding. A
    node attends to its segment's prompt, its ancestors and itself, at position prompt length + depth: its
    hidden state is what a plain forward over its own sequence gives.

    ids, position [R, C] int64: the packed rows (pad_id / 0 in padding); segment [R, C] int64: the segment
    of each column (-1 in padding); parent [R, C] int64: the column of a node's parent node (-1 for prompt
    tokens, first tokens and padding); is_node [R, C] bool.
    row, start, prompt_len, num_nodes [S] int64: where segment s lies, its prompt's length (its nodes
    follow the prompt) and its number of nodes.
    segment_of_row [B] int64: the segment holding row b's draft (or its prompt); path [B, D] int64: the node
    of each position of row b's draft within that segment (-1 past its end).
    """

    ids: torch.Tensor
    position: torch.Tensor
    segment: torch.Tensor
    parent: torch.Tensor
    is_node: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    prompt_len: torch.Tensor
    num_nodes: torch.Tensor
    segment_of_row: torch.Tensor
    path: torch.Tensor

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        prompt_of_row: list[int],
        drafts: list[list[int]],
        pad_id: int,
        device,
        max_columns: int = MAX_SEGMENT_COLUMNS,
    ):
        """prompts: the distinct prompts; prompt_of_row[b]: row b's prompt; drafts[b]: its draft tokens (may
        be empty)."""
        prompt_of: list[int] = []  # per segment
        index: list[dict] = []  # per segment: (parent node, token) -> node
        tokens: list[list[int]] = []
        parent: list[list[int]] = []
        depth: list[list[int]] = []
        open_segment: dict[int, int] = {}  # prompt -> the segment its next drafts go to
        segment_of_row, paths = [], []
        for u, draft in zip(prompt_of_row, drafts):
            s = open_segment.get(u)
            if s is not None and tokens[s]:
                shared, node = 0, -1  # how much of the draft the segment's tree already holds
                while shared < len(draft) and (node, draft[shared]) in index[s]:
                    node, shared = index[s][node, draft[shared]], shared + 1
                if len(prompts[u]) + len(tokens[s]) + len(draft) - shared > max_columns:
                    s = None
            if s is None:
                s = open_segment[u] = len(prompt_of)
                prompt_of.append(u)
                index.append({})
                tokens.append([])
                parent.append([])
                depth.append([])
            node, path = -1, []
            for token in draft:
                child = index[s].setdefault((node, token), len(tokens[s]))
                if child == len(tokens[s]):
                    tokens[s].append(token)
                    parent[s].append(node)
                    depth[s].append(len(path))
                node = child
                path.append(node)
            segment_of_row.append(s)
            paths.append(path)

        # first fit, longest segment first, into rows as long as the longest segment
        prompt_len = [len(prompts[u]) for u in prompt_of]
        length = [p + len(t) for p, t in zip(prompt_len, tokens)]
        width = max(length)
        used: list[int] = []
        row, start = [0] * len(length), [0] * len(length)
        for s in sorted(range(len(length)), key=lambda s: -length[s]):
            r = next((r for r, n in enumerate(used) if n + length[s] <= width), len(used))
            if r == len(used):
                used.append(0)
            row[s], start[s] = r, used[r]
            used[r] += length[s]

        ids, position = [[pad_id] * width for _ in used], [[0] * width for _ in used]
        segment, parent_col = [[-1] * width for _ in used], [[-1] * width for _ in used]
        is_node = torch.zeros((len(used), width), dtype=torch.bool)
        for s, u in enumerate(prompt_of):
            r, first, end = row[s], start[s] + prompt_len[s], start[s] + length[s]  # nodes: [first, end)
            ids[r][start[s] : end] = prompts[u] + tokens[s]
            position[r][start[s] : end] = [*range(prompt_len[s]), *(prompt_len[s] + d for d in depth[s])]
            segment[r][start[s] : end] = [s] * length[s]
            parent_col[r][first:end] = [first + q if q >= 0 else -1 for q in parent[s]]
            is_node[r, first:end] = True

        def tensor(x) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        width_d = max(len(p) for p in paths)
        return cls(
            ids=tensor(ids),
            position=tensor(position),
            segment=tensor(segment),
            parent=tensor(parent_col),
            is_node=is_node.to(device),
            row=tensor(row),
            start=tensor(start),
            prompt_len=tensor(prompt_len),
            num_nodes=tensor([len(t) for t in tokens]),
            segment_of_row=tensor(segment_of_row),
            path=tensor([p + [-1] * (width_d - len(p)) for p in paths]),
        )

    def attention(self) -> torch.Tensor:
        """[R, 1, C, C] bool, True where a query column may attend to a key column: within a segment, a
        prompt token attends to the prompt causally, a node to the whole prompt and to its ancestors and
        itself. Padding attends to itself only, so no row of the mask is empty (an empty row gives NaN)."""
        rows, width = self.ids.shape
        col = torch.arange(width, device=self.ids.device)
        same = (self.segment[:, :, None] == self.segment[:, None, :]) & (self.segment[:, None, :] >= 0)
        allowed = same & ~self.is_node[:, None, :] & (col[None, None, :] <= col[None, :, None])
        # ancestors-or-self of every node by pointer jumping, one level per step, as many steps as the
        # longest draft has tokens (column `width` collects finished chains)
        ancestors = torch.zeros((rows, width, width + 1), dtype=torch.bool, device=col.device)
        node = torch.where(self.is_node, col, -1)
        for _ in range(self.path.shape[1]):
            ancestors.scatter_(2, torch.where(node >= 0, node, width)[..., None], True)
            node = torch.where(node >= 0, self.parent.gather(1, node.clamp(min=0)), node)
        itself = torch.eye(width, dtype=torch.bool, device=col.device)
        return (allowed | ancestors[..., :width] | itself)[:, None]

    @property
    def first_node(self) -> torch.Tensor:
        """[S] int64: the column of each segment's node 0 (right after its prompt)."""
        return self.start + self.prompt_len

    def prediction_columns(self) -> torch.Tensor:
        """[S, N+1] int64: per segment, the column whose hidden state predicts a response's first token (its
        last prompt token), then the column of each node (predicting the token after it); padded with the
        first."""
        steps = torch.arange(int(self.num_nodes.max()) + 1, device=self.ids.device)[None, :]
        columns = self.first_node[:, None] - 1 + steps
        return torch.where(steps <= self.num_nodes[:, None], columns, columns[:, :1])

    def resume_attention(self, segments: torch.Tensor, path: torch.Tensor, width: int) -> torch.Tensor:
        """[A, width] int64 2D attention mask of resumed rows over the first `width` cache columns: their
        segment's prompt and the nodes on `path` [A, D] (-1 entries ignored). segments [A]: their segments."""
        col = torch.arange(width, device=path.device)[None, :]
        start, first = self.start[segments, None], self.first_node[segments, None]
        mask = ((col >= start) & (col < first)).long()
        on_path = torch.zeros((len(path), width + 1), dtype=torch.long, device=path.device)
        on_path.scatter_(1, torch.where(path >= 0, first + path, width), 1)  # column `width` takes the -1s
        return mask | on_path[:, :width]


def score_nodes(decoder, hidden: torch.Tensor, nodes: torch.Tensor, targets: torch.Tensor, sampling):
    """Log-prob of targets[b, i] under the sampling distribution predicted by hidden[nodes[b, i]], and with
    sampling.keep_topk = K > 0 that distribution's top-K, without a [B, D, V] tensor: the distinct nodes'
    logits are formed a chunk at a time (as bitrl.kernels.fused_logprobs tiles them) and dropped.

    hidden: [M, H] final hidden states; nodes, targets: [B, D] int64. Returns (logprobs [B, D] fp32, top:
    (ids [B*D, K] int64, logprobs [B*D, K] fp32) or None)."""
    flat_nodes, flat_targets = nodes.reshape(-1), targets.reshape(-1)
    logprobs = torch.zeros(flat_nodes.shape, dtype=torch.float32, device=hidden.device)
    k = sampling.keep_topk
    top = None
    if k:
        top = (
            torch.zeros((flat_nodes.numel(), k), dtype=torch.long, device=hidden.device),
            torch.full((flat_nodes.numel(), k), float("-inf"), device=hidden.device),
        )
    if flat_nodes.numel() == 0:
        return logprobs.view(nodes.shape), top
    unique, inverse = torch.unique(flat_nodes, return_inverse=True)
    chunk = default_chunk_size(decoder.model.config.vocab_size, hidden.device)
    for start in range(0, unique.numel(), chunk):
        logits = decoder.logits(hidden[unique[start : start + chunk]])
        z = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        logp = torch.log_softmax(z, dim=-1)
        pick = ((inverse >= start) & (inverse < start + chunk)).nonzero().squeeze(-1)
        local = inverse[pick] - start
        logprobs[pick] = logp[local, flat_targets[pick]]
        if k:
            values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            top[0][pick, : ids.shape[1]], top[1][pick, : ids.shape[1]] = ids[local], values[local]
    return logprobs.view(nodes.shape), top


@torch.no_grad()
def generate_with_drafts(
    model,
    prompts: list[list[int]],
    drafts: list[Draft | None],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    lenience: float = 1.0,
    mode: str = "spec-rl",
    keep_topk: int = 0,
    generator: torch.Generator | None = None,
    sample_ids: torch.Tensor | None = None,
) -> tuple[Rollout, ReuseStats, list[Draft]]:
    """Verify each row's draft with the current policy, then generate past the first rejection.

    prompts: token lists; drafts: a Draft or None per row (drafts longer than max_new_tokens are cut).
    Returns (rollout, stats, new_drafts): the Rollout has the layout and log-prob convention of `generate`
    (log-probs of the current policy's sampling distribution for every returned token); new_drafts are the
    returned responses as drafts for the next epoch (with the top-`keep_topk` of the current distribution at
    every position).

    Random numbers, all from `generator`: one uniform per draft position ([B, max draft length], none when
    no row has a draft), then per decoding step one multinomial over the rows that still need generation, as
    `generate` draws them. So given a generator state after the uniforms, the resumed rows produce the
    tokens that `generate` produces for the prompts extended by their accepted prefixes (spec-rl mode, or
    rows that were not rejected).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if temperature <= 0:
        raise ValueError("speculative reuse needs sampling (temperature > 0)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(drafts) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(drafts)} drafts")
    t_start = time.perf_counter()
    options = engine_options(model)
    decoder = decoder_for(model)
    device = decoder.device
    batch = len(prompts)
    keep_topk = min(keep_topk, decoder.model.config.vocab_size)
    sampling = Sampling(float(temperature), int(top_k), float(top_p), eos_id, keep_topk)

    # ---- 1. verification: ONE forward over each distinct prompt followed by the prefix tree of its drafts
    draft_tokens = [(d.tokens[:max_new_tokens].tolist() if d is not None else []) for d in drafts]
    n = torch.tensor([len(t) for t in draft_tokens], dtype=torch.long, device=device)
    width_d = max(len(t) for t in draft_tokens)
    p_ids, p_mask, prompt_rows = distinct_prompts(prompts, pad_id, device)
    distinct = [ids[mask].tolist() for ids, mask in zip(p_ids, p_mask)]
    tree = DraftTree.build(distinct, prompt_rows.tolist(), draft_tokens, pad_id, device, MAX_SEGMENT_COLUMNS)
    rows_t, columns = tree.ids.shape
    cache = decoder.new_cache(rows_t, columns, options.kv_cache_dtype)
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
    new_lp_drafted, node_top = score_nodes(decoder, predicting.flatten(0, 1), nodes, drafted, sampling)

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
            step_logp = torch.log_softmax(filter_logits(resume_logits, temperature, top_k, top_p), dim=-1)
            residual = _resample_rejected(step_logp, active, rejected, a_acc, drafts, lenience, device)
            redrawn, _ = fused_sample(residual, seeds[active], a_acc, 1.0, 0, 1.0)
            first_tok = torch.where(rejected[active], redrawn, first_tok)
            first_lp = step_logp.gather(-1, first_tok[:, None]).squeeze(-1)
        first_top = sampling.top(resume_logits) if keep_topk else None
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
        ids, mask, lps, top, decode_steps = continue_after_first(
            decoder, ctx, first_lp, first_top, sampling, options, pad_id
        )
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
        self.last_metrics: dict = {}

    def bind(self, keys: list):
        """A function with `generate`'s signature that rolls out through the cache under `keys` (one per
        prompt) and leaves its metrics in `last_metrics`."""

        def rollout_fn(model, prompts, **sampling) -> Rollout:
            rollout, self.last_metrics = self.generate(model, prompts, keys, **sampling)
            return rollout

        return rollout_fn

    def generate(self, model, prompts: list[list[int]], keys: list, **sampling) -> tuple[Rollout, dict]:
        """Rollout for `prompts` (row i's draft cached under keys[i]); updates the cache. Returns (rollout,
        metrics). sampling: max_new_tokens, eos_id, pad_id, temperature, top_k, top_p, generator."""
        t0 = time.perf_counter()
        hashes = [prompt_fingerprint(p) for p in prompts]
        drafts = [self.cache.get(k, h) for k, h in zip(keys, hashes)]
        keep_topk = self.cfg.exact_topk if self.cfg.mode == "exact" else 0
        rollout, stats, new = generate_with_drafts(
            model,
            prompts,
            drafts,
            lenience=self.cfg.lenience,
            mode=self.cfg.mode,
            keep_topk=keep_topk,
            **sampling,
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
