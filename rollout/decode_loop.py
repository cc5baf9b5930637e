"""The decode loop of a rollout: continuous batching over a fixed number of slots, a decode step without host
synchronisation, and its compiled form.

Continuous batching: samples wait in a queue; at most `max_batch_rows` slots decode at once, and a finished
sample's slot takes the next waiting one (its prompt's K/V copied in, its first token drawn from the
prefill's last hidden state). The decode step detects finished rows on the device (EOS or budget) and writes
tokens and log-probs into per-sample output buffers by index, so the host only looks every `sync_every`
steps. Once the queue is empty, finished slots leave the batch at once: the live rows past the new end move
into the holes (one row of K/V each), and every buffer keeps its first rows as a view.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from bitrl.kernels.aligned import aligned_logprobs
from bitrl.rollout.decoder import Decoder, KVCache
from bitrl.rollout.settings import EngineOptions, Sampling


@dataclass
class Contexts:
    """Where the samples' contexts are (the K/V each new token attends to) and how each one continues.

    cache: K/V of the contexts; row [N]: the cache row of sample n; visible [N, C] bool: the columns of that
    row it attends to (C <= cache.columns); position [N]: the position of the token it feeds next; token [N]:
    that token (already sampled); counter [N]: the response position of the next token it samples (the
    sampling counter); budget [N]: how many more tokens it may sample (>= 1); seed [N]: its sampling seed.
    """

    cache: KVCache
    row: torch.Tensor
    visible: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    counter: torch.Tensor
    budget: torch.Tensor
    seed: torch.Tensor

    def subset(self, samples: torch.Tensor) -> Contexts:
        """The contexts of `samples` only (same cache)."""
        fields = {k: v[samples] for k, v in self.__dict__.items() if k != "cache"}
        return Contexts(cache=self.cache, **fields)


class Slots:
    """The rows decoding now: a slot cache [S, ..., C + R] and per-slot state, all on the device."""

    def __init__(
        self, decoder: Decoder, ctx: Contexts, slots: int, width: int, kv_cache_dtype: str, static=False
    ):
        """static: mark the buffers as static addresses (for a compiled step; see `static_addresses`)."""
        device = decoder.device
        self.cache = decoder.new_cache(slots, width, kv_cache_dtype)
        self.context_width = ctx.visible.shape[1]
        self.visible = torch.zeros((slots, width), dtype=torch.bool, device=device)
        self.visible[:, 0] = True  # an empty slot still attends somewhere (no NaN)
        zeros = torch.zeros(slots, dtype=torch.long, device=device)
        self.sample = zeros.clone()
        self.token, self.position, self.column = zeros.clone(), zeros.clone(), zeros.clone()
        self.counter, self.budget, self.done, self.seed = (
            zeros.clone(),
            zeros.clone(),
            zeros.clone(),
            zeros.clone(),
        )
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        if static:
            static_addresses(self)
        self.steps_host = [0] * slots  # tokens decoded since admission, per slot (host mirror, no sync)

    def admit(self, slot_list: list[int], sample_list: list[int], ctx: Contexts) -> None:
        """Start samples `sample_list` in slots `slot_list` (host lists: the host mirror needs no read)."""
        device = self.alive.device
        slots, samples = torch.tensor(slot_list, device=device), torch.tensor(sample_list, device=device)
        c = self.context_width
        self.cache.copy_rows_(slots, ctx.cache, ctx.row[samples], c)
        self.visible[slots] = False
        self.visible[slots, :c] = ctx.visible[samples]
        self.sample[slots] = samples
        self.token[slots] = ctx.token[samples]
        self.position[slots] = ctx.position[samples]
        self.column[slots] = c
        self.counter[slots] = ctx.counter[samples]
        self.budget[slots] = ctx.budget[samples]
        self.seed[slots] = ctx.seed[samples]
        self.done[slots] = 0
        self.alive[slots] = True
        for s in slot_list:
            self.steps_host[s] = 0

    def compact_(self, alive: list[bool], width: int) -> None:
        """Drop the finished slots: live slots past the first sum(alive) move into the holes before it (one
        row of K/V each), and every buffer keeps its first sum(alive) rows as a view."""
        live = sum(alive)
        holes = [s for s in range(live) if not alive[s]]
        movers = [s for s in range(live, len(alive)) if alive[s]]
        dst = torch.tensor(holes, dtype=torch.long, device=self.alive.device)
        src = torch.tensor(movers, dtype=torch.long, device=self.alive.device)
        self.cache.compact_(dst, src, live, width)
        for name in (
            "visible",
            "sample",
            "token",
            "position",
            "column",
            "counter",
            "budget",
            "done",
            "seed",
            "alive",
        ):
            t = getattr(self, name)
            if holes:
                t[dst] = t[src]
            setattr(self, name, t[:live])
        for d, s in zip(holes, movers):
            self.steps_host[d] = self.steps_host[s]
        del self.steps_host[live:]


@dataclass
class Outputs:
    """Per sample (plus a spare last row that finished and empty slots write to): tokens [N+1, R] int64,
    logprobs [N+1, R] fp32, lengths [N+1] int64, and with keep_topk K > 0 top_ids [N+1, R, K] int64 /
    top_logprobs [N+1, R, K] fp32."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    @classmethod
    def empty(cls, samples: int, width: int, keep_topk: int, device) -> Outputs:
        top = (samples + 1, width, keep_topk)
        return cls(
            torch.zeros((samples + 1, width), dtype=torch.long, device=device),
            torch.zeros((samples + 1, width), dtype=torch.float32, device=device),
            torch.zeros(samples + 1, dtype=torch.long, device=device),
            torch.zeros(top, dtype=torch.long, device=device) if keep_topk else None,
            torch.full(top, float("-inf"), device=device) if keep_topk else None,
        )

    def without_spare(self) -> Outputs:
        return Outputs(*(None if t is None else t[:-1] for t in self.__dict__.values()))


def next_tokens(decoder: Decoder, st: Slots, sampling: Sampling, width: int):
    """The model part of a decode step, on the device only: forward the fed token of every slot (its K/V
    into the slot cache) and sample the next ones. Returns (tokens [S] int64, logprobs [S] fp32, logits
    [S, V]). Every tensor it reads or writes is a slot buffer, so under torch.compile its shapes are the
    slots' alone: one graph per (model, sampling settings, width)."""
    rows = torch.arange(st.column.shape[0], device=st.column.device)
    column = st.column.clamp(max=st.cache.columns - 1)  # slots finished but not yet recycled keep going
    st.visible[rows, column] = True
    hidden = decoder.hidden(
        st.token[:, None], st.position[:, None], st.cache, column[:, None], st.visible[:, None, :width]
    )
    logits = decoder.logits(hidden[:, -1])
    tok, lp = draw(decoder, sampling, logits, st.seed, st.counter)
    return tok, lp, logits


def draw(decoder: Decoder, sampling: Sampling, logits: torch.Tensor, seeds, counters):
    """`sampling.draw`: (tokens [S] int64, logprobs [S] fp32). In the aligned mode the log-probs are
    bitrl.kernels.aligned's of the same logits, the bits the aligned trainer gives the same tokens."""
    tok, lp = sampling.draw(logits, seeds, counters)
    if decoder.aligned and sampling.temperature > 0:
        lp = aligned_logprobs(logits, tok, sampling.temperature)[0]
    return tok, lp


def decode_step(decoder: Decoder, st: Slots, out: Outputs, sampling: Sampling, width: int, model_part):
    """One token for every slot: `model_part` (`next_tokens`, or its compiled form), then record the tokens
    for the live slots (finished or empty slots write to the spare last row of the outputs) and mark the
    slots that just finished (EOS or budget)."""
    tok, lp, logits = model_part(decoder, st, sampling, width)
    spare = out.tokens.shape[0] - 1
    out_row = torch.where(st.alive, st.sample, spare)
    out_col = st.done.clamp(max=out.tokens.shape[1] - 1)
    out.tokens[out_row, out_col] = tok
    out.logprobs[out_row, out_col] = lp
    if out.top_ids is not None:
        top = sampling.top(logits, out.top_ids.shape[-1])
        out.top_ids[out_row, out_col], out.top_logprobs[out_row, out_col] = top
    st.done += 1
    out.lengths[out_row] = st.done
    st.alive &= (tok != sampling.eos_id) & (st.done < st.budget)
    st.token.copy_(tok)
    st.position += 1
    st.column += 1
    st.counter += 1


@torch.no_grad()
def decode(
    decoder: Decoder,
    ctx: Contexts,
    sampling: Sampling,
    options: EngineOptions,
    model_part,
    keep_topk: int = 0,
) -> tuple[Outputs, int]:
    """Continue every sample of `ctx` until EOS or its budget, at most options.max_batch_rows at once, each
    step's model part being `model_part` (`next_tokens` or `compiled_next_tokens`); keep_topk K > 0 also
    records the top-K of every sampled position's distribution. Returns (its `Outputs`, the number of decode
    steps). R = the largest budget; entries past a sample's length are unspecified."""
    n = ctx.row.shape[0]
    device = decoder.device
    longest = int(ctx.budget.max())
    out = Outputs.empty(n, longest, keep_topk, device)
    compiled = model_part is not next_tokens
    columns = ctx.visible.shape[1] + longest
    if compiled:  # one graph per shape: always max_batch_rows slots, the width rounded up to a power of two
        slots, columns = options.max_batch_rows, compiled_width(columns)
    else:
        slots = min(options.max_batch_rows, n)
    st = Slots(decoder, ctx, slots, columns, options.kv_cache_dtype, static=compiled)
    sync_every = options.sync_every or (8 if device.type == "cuda" else 1)
    waiting = deque(range(n))
    first = [waiting.popleft() for _ in range(min(slots, n))]
    st.admit(list(range(len(first))), first, ctx)
    since_sync = steps = 0
    while True:
        # eager: attend over the columns in use only; compiled: one fixed shape (no recompilation per width)
        width = (
            st.cache.columns if compiled else min(st.context_width + max(st.steps_host) + 1, st.cache.columns)
        )
        decode_step(decoder, st, out, sampling, width, model_part)
        st.steps_host = [s + 1 for s in st.steps_host]
        since_sync += 1
        steps += 1
        if since_sync < sync_every:
            continue
        since_sync = 0
        alive = st.alive.tolist()
        free = [s for s, a in enumerate(alive) if not a]
        if waiting and free:
            take = free[: len(waiting)]
            samples = [waiting.popleft() for _ in take]
            st.admit(take, samples, ctx)
        elif not waiting:
            live = sum(alive)
            if live == 0:
                break
            # Eager: decode the live rows only (a finished row costs as much as a live one where the step is
            # compute-bound, as on a CPU). Compiled: one shape, no shrinking.
            if live < len(alive) and not compiled:
                st.compact_(alive, width)
    return out.without_spare(), steps


def compiled_width(columns: int) -> int:
    """The cache width of a compiled decode step: `columns` rounded up to a power of two (at least 64), so
    that rollouts of any prompt length and budget share a handful of graphs."""
    return max(64, 1 << (columns - 1).bit_length())


def static_addresses(st: Slots) -> None:
    """Mark the slot buffers and the slot cache's K and V as static for torch.compile: the step mutates them
    in place, which CUDA graphs allow for static inputs only (any other mutated input makes inductor skip
    the graph)."""
    buffers = [t for t in vars(st).values() if isinstance(t, torch.Tensor)]
    for t in buffers + st.cache.k + st.cache.v:
        torch._dynamo.mark_static_address(t)


# Guarded per graph: the model, the sampling settings and the width bucket. A run meets a few of each (the
# rollout copy and the policy, sampling and greedy evaluation); past the limit torch.compile would fall back
# to eager without saying so, and the tests count the graphs.
COMPILED_STEP_GRAPHS = 64


def compiled_next_tokens(options: EngineOptions, device):
    """The model part of the decode step as `options` ask on `device`: `next_tokens`, or with compile on,
    `next_tokens` under torch.compile, one per device type: CUDA graphs ("reduce-overhead") on CUDA, a plain
    compile elsewhere (a process that compiled on the CPU first still gets its graphs on the GPU)."""
    use = options.compile if options.compile != "auto" else device.type == "cuda" and not options.aligned
    if not use:
        return next_tokens
    if device.type not in _COMPILED_NEXT_TOKENS:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_STEP_GRAPHS)
        mode = "reduce-overhead" if device.type == "cuda" else None
        _COMPILED_NEXT_TOKENS[device.type] = torch.compile(next_tokens, mode=mode, dynamic=False)
    return _COMPILED_NEXT_TOKENS[device.type]


_COMPILED_NEXT_TOKENS: dict = {}
