"""The rollout engine: batched generation with a preallocated KV cache, continuous batching, a decode step
without host synchronisation, and counter-based fused sampling (bitrl.kernels.sampling).

It runs the model's own modules (embedding, norms, projections, MLPs, rotary embedding, LM head; quantized
`QuantLinear`s included) in the order of the Hugging Face forward of the Llama family (Llama, Qwen2, Qwen3,
Mistral), with attention written here against a cache it owns, so nothing depends on the `Cache` API of a
transformers release.

KV cache: static per layer, one [rows, kv_heads, columns, head_dim] buffer pair per layer (as gpt-fast), not
paged blocks (as nano-vllm). A rollout knows its worst case before it starts (the longest prompt plus
max_new_tokens) and runs at most `max_batch_rows` rows at once, so a dense buffer of max_batch_rows x that
many columns is the whole budget, allocated once. Paging pays a block-table indirection on every attention
read to share memory between requests of unknown length (serving); here a slot wastes at most the columns
its sample does not use, and the decode step stays one fixed-shape function that torch.compile and CUDA
graphs can capture. Prefix sharing is by copy: each distinct prompt is prefilled once into a prefill buffer,
and each of its G samples copies those columns into its slot when it is admitted (a copy of the prompt's
K/V per sample is small next to its decode).

Continuous batching: samples wait in a queue; at most `max_batch_rows` slots decode at once, and a finished
sample's slot takes the next waiting one (its prompt's K/V copied in, its first token drawn from the
prefill's last hidden state). The decode step detects finished rows on the device (EOS or budget) and writes
tokens and log-probs into per-sample output buffers by index, so the host only looks every `sync_every`
steps. Once the queue is empty, finished slots leave the batch at once: the live rows past the new end move
into the holes (one row of K/V each), and every buffer keeps its first rows as a view.

Sampling: one 64-bit step seed per call from `generator`; row seeds = sample_seeds(step seed, sample id) and
the counter is the response position, so a sample does not depend on the batch it runs in, its slot, the
admission order, max_batch_rows, world size or rank (pass global `sample_ids` from a data-parallel trainer).
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from functools import cache as memoize

import torch
import torch.nn.functional as F

from bitrl.kernels.sampling import (
    check_sampling_settings,
    draw_step_seed,
    filter_logits,
    fused_sample,
    sample_seeds,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0


@dataclass
class Rollout:
    """A batch of generated responses.

    prompt_ids [B, P] int64, left-padded; prompt_mask [B, P] bool.
    response_ids [B, R] int64, right-padded with pad_id after EOS; response_mask [B, R] bool, True for every
    generated token up to and including EOS. logprobs [B, R] fp32: log-prob of each sampled token under the
    distribution it was sampled from (0 where masked).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def full_sequence(self):
        """(input_ids [B, P+R], attention_mask [B, P+R], position_ids [B, P+R]) of prompt + response."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask, position_ids_from_mask(mask)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over attended tokens only; padding gets position 0. mask: [B, T] -> [B, T] int64."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(sequences: list[list[int]], pad_id: int, device=None):
    """Left-pad token lists into (ids [B, L] int64, mask [B, L] bool)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = True
    return ids.to(device), mask.to(device)


def distinct_prompts(prompts: list[list[int]], pad_id: int, device=None):
    """The distinct prompts, left-padded, in order of first appearance (the G samples of a GRPO group share
    one). Returns (ids [U, P] int64, mask [U, P] bool, row_of [B] int64: the distinct prompt of row b)."""
    index: dict = {}
    row_of = [index.setdefault(tuple(p), len(index)) for p in prompts]
    ids, mask = left_pad([list(p) for p in index], pad_id, device)
    return ids, mask, torch.tensor(row_of, dtype=torch.long, device=device)


@memoize
def _cache_keyword(forward_owner: type) -> str:
    # transformers 5.2x renamed the forward's `past_key_values` to `cache`; an older release silently puts an
    # unknown `cache=` into **kwargs and decodes every token without its context.
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model, cache) -> dict:
    """The keyword arguments that hand a transformers `cache` to `model`'s forward under this release's name
    for it (for code that runs the Hugging Face forward with its own cache, e.g. benchmarks)."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


def check_cache_filled(cache, tokens: int) -> None:
    """Fail loudly if a forward that was handed `cache` did not fill it (a KV cache silently ignored)."""
    if cache.get_seq_length() < tokens:
        raise RuntimeError(
            f"the model's forward did not fill the KV cache it was given ({cache.get_seq_length()} of "
            f"{tokens} positions): this transformers release names the cache argument differently"
        )


# --------------------------------------------------------------------------- options


@dataclass
class EngineOptions:
    """How `generate` runs on a model (set with `set_engine_options`; bitrl.engine.config.RolloutConfig
    holds the same fields). max_batch_rows: rows decoding at once; kv_cache_dtype: "auto" (the model's
    dtype) or "fp8" (E4M3, values clamped to +-448); compile: torch.compile the decode step ("auto": on CUDA
    only: on the 2-core CPU the compiled step ran at 0.94x the eager one, SmolLM2-135M bf16 at 64 rows, see
    README; a compiled step keeps max_batch_rows slots at a power-of-two width, so rollouts of any size share
    its graphs, finished slots are recycled and the batch never shrinks);
    sync_every: decode steps between host looks at the finished rows (None: 1 on CPU, where a look costs
    nothing, 8 on CUDA)."""

    max_batch_rows: int = 256
    kv_cache_dtype: str = "auto"
    compile: bool | str = "auto"
    sync_every: int | None = None

    def __post_init__(self):
        if not (isinstance(self.max_batch_rows, int) and self.max_batch_rows >= 1):
            raise ValueError(f"max_batch_rows: must be an int >= 1, got {self.max_batch_rows!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"compile: must be true, false or 'auto', got {self.compile!r}")
        if self.sync_every is not None and not (isinstance(self.sync_every, int) and self.sync_every >= 1):
            raise ValueError(f"sync_every: must be an int >= 1 or None, got {self.sync_every!r}")

    @classmethod
    def from_config(cls, rollout_cfg) -> EngineOptions:
        """From a bitrl.engine.config.RolloutConfig."""
        return cls(
            max_batch_rows=rollout_cfg.max_batch_rows,
            kv_cache_dtype=rollout_cfg.kv_cache_dtype,
            compile=rollout_cfg.compile,
        )


_OPTIONS_ATTR = "_bitrl_engine_options"


def set_engine_options(model, options: EngineOptions | None = None, **fields) -> EngineOptions:
    """Attach engine options to a rollout model (`generate`'s signature stays the public one)."""
    options = options if options is not None else EngineOptions(**fields)
    object.__setattr__(model, _OPTIONS_ATTR, options)
    return options


def engine_options(model) -> EngineOptions:
    return getattr(model, _OPTIONS_ATTR, None) or EngineOptions()


# --------------------------------------------------------------------------- the model, run step by step


class KVCache:
    """Per layer a K and a V buffer [rows, kv_heads, columns, head_dim] in `dtype` (fp8: E4M3, clamped)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, columns: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, columns, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.dtype = dtype

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def columns(self) -> int:
        return self.k[0].shape[2]

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float8_e4m3fn:
            x = x.clamp(-FP8_MAX, FP8_MAX)
        return x.to(self.dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, cols: torch.Tensor) -> None:
        """k, v [R, kv_heads, T, head_dim] into column cols[r, t] of row r. cols: [R, T] int64."""
        rows, heads, _, dim = k.shape
        # Whole head_dim vectors by flat (row, head, column) index into a [rows * heads * columns, dim] view:
        # on a CPU 10-30x faster than assigning through advanced indices on dims 0 and 2.
        start = torch.arange(rows * heads, device=k.device).view(rows, heads, 1) * self.columns
        index = (start + cols[:, None, :]).reshape(-1)
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            x = self._store(x).reshape(-1, dim)
            if cache.dtype == torch.float8_e4m3fn:  # moved as bytes: index_copy_ has no fp8 kernel
                cache, x = cache.view(torch.uint8), x.view(torch.uint8)
            cache.view(-1, dim).index_copy_(0, index, x)

    def read(self, layer: int, width: int, dtype):
        """The first `width` columns of K and V, in `dtype`."""
        k, v = self.k[layer][:, :, :width], self.v[layer][:, :, :width]
        return k.to(dtype), v.to(dtype)

    def copy_rows_(self, dst_rows: torch.Tensor, src: KVCache, src_rows: torch.Tensor, width: int) -> None:
        """Row dst_rows[i], columns [0, width) <- src row src_rows[i] (same layout, same dtype)."""
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            for dst, s in zip(mine, theirs):
                dst[dst_rows, :, :width] = s[src_rows, :, :width]

    def view(self, rows: slice) -> KVCache:
        """The same buffers restricted to a slice of rows (writes go to this cache)."""
        part = KVCache.__new__(KVCache)
        part.k, part.v, part.dtype = [t[rows] for t in self.k], [t[rows] for t in self.v], self.dtype
        return part

    def compact_(self, dst: torch.Tensor, src: torch.Tensor, rows: int, width: int) -> None:
        """Row dst[i] <- row src[i] (columns [0, width)), then keep rows [0, rows) as views (no copy of the
        rows that stay)."""
        for buffers in (self.k, self.v):
            for layer, t in enumerate(buffers):
                if dst.numel():
                    t[dst, :, :width] = t[src, :, :width]
                buffers[layer] = t[:rows]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Decoder:
    """A Llama-family causal LM's modules, run against a `KVCache`.

    Attention over a cache is defined by three things per row: the columns its new tokens are written to,
    their positions (for the rotary embedding), and which cache columns each new token may see. The prefill,
    the decode step and the verification of a draft tree are the same call with different masks.
    """

    def __init__(self, model):
        config = model.config
        model_type = getattr(config, "model_type", type(model).__name__)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the rollout engine runs Llama-family models {SUPPORTED_MODEL_TYPES}; got model_type "
                f"{model_type!r}"
            )
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"the rollout engine needs full attention in every layer; got {sorted(layer_types)}"
            )
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.head = model.get_output_embeddings()
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.kv_heads = config.num_key_value_heads
        self.heads = config.num_attention_heads
        self.dtype = self.inner.embed_tokens.weight.dtype
        self.device = self.inner.embed_tokens.weight.device

    def new_cache(self, rows: int, columns: int, kv_cache_dtype: str = "auto") -> KVCache:
        dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        return KVCache(len(self.layers), rows, self.kv_heads, columns, self.head_dim, dtype, self.device)

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        cols: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Final-norm hidden states [R, T, H] of tokens ids [R, T] at positions [R, T], written into cache
        row r at columns cols [R, T]; visible [R, T, W] bool: the cache columns each token attends to (its own
        column included), W <= cache.columns."""
        rows, steps = ids.shape
        width = visible.shape[-1]
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        # Grouped-query attention as one block of queries per KV head: query head h = j * group + g reads KV
        # head j, so the [R, heads, T, d] queries view as [R, kv_heads, group * T, d]. No enable_gqa and no
        # copy of the cache: a bool mask with enable_gqa leaves CUDA only the math kernel (its
        # memory-efficient kernel takes masks but not GQA), which builds the [R, heads, T, W] scores.
        group = self.heads // self.kv_heads
        mask = (
            visible[:, None, None].expand(rows, 1, group, steps, width).reshape(rows, 1, group * steps, width)
        )
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(rows, steps, -1, self.head_dim)
            k = attn.k_proj(h).view(rows, steps, -1, self.head_dim)
            v = attn.v_proj(h).view(rows, steps, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache.write(i, k, v, cols)
            keys, values = cache.read(i, width, q.dtype)
            q = q.reshape(rows, self.kv_heads, group * steps, self.head_dim)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            o = o.view(rows, self.heads, steps, self.head_dim)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(rows, steps, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def decoder_for(model) -> Decoder:
    """The model's `Decoder` (built once per model object)."""
    decoder = getattr(model, "_bitrl_decoder", None)
    if decoder is None or decoder.model is not model:
        decoder = Decoder(model)
        object.__setattr__(model, "_bitrl_decoder", decoder)
    return decoder


@torch.no_grad()
def prefill(decoder: Decoder, prompts: list[list[int]], chunk_rows: int, kv_cache_dtype: str = "auto"):
    """Run each prompt once. prompts: U token lists. Returns (cache: U rows, prompt in columns [0, len),
    lengths [U] int64, last_hidden [U, H]: the final hidden state at each prompt's last token)."""
    device = decoder.device
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(lengths.max())
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for u, p in enumerate(prompts):
        ids[u, : len(p)] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(device)
    cache = decoder.new_cache(len(prompts), width, kv_cache_dtype)
    col = torch.arange(width, device=device)
    causal = col[None, :] <= col[:, None]  # [T, W]
    last = []
    for start in range(0, len(prompts), chunk_rows):
        part = slice(start, start + chunk_rows)
        n = ids[part].shape[0]
        visible = causal[None] & (col[None, None, :] < lengths[part, None, None])
        hidden = decoder.hidden(ids[part], col.expand(n, -1), cache.view(part), col.expand(n, -1), visible)
        last.append(hidden[torch.arange(n, device=device), lengths[part] - 1])
    return cache, lengths, torch.cat(last)


# --------------------------------------------------------------------------- continuous batching


@dataclass
class Sampling:
    """Sampling settings of a rollout; keep_topk > 0 also records the top-k of every sampled position's
    distribution (speculative reuse's exact mode keeps them with its drafts)."""

    temperature: float
    top_k: int
    top_p: float
    eos_id: int
    keep_topk: int = 0

    def draw(self, logits, seeds, positions):
        return fused_sample(logits, seeds, positions, self.temperature, self.top_k, self.top_p)

    def top(self, logits):
        """(ids [B, K] int64, log-probs [B, K] fp32) of the sampling distribution's K most likely tokens."""
        logp = torch.log_softmax(filter_logits(logits, self.temperature, self.top_k, self.top_p), dim=-1)
        values, ids = torch.topk(logp, min(self.keep_topk, logp.shape[-1]), dim=-1)
        return ids, values


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
    tok, lp = sampling.draw(logits, st.seed, st.counter)
    return tok, lp, logits


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
    if sampling.keep_topk:
        out.top_ids[out_row, out_col], out.top_logprobs[out_row, out_col] = sampling.top(logits)
    st.done += 1
    out.lengths[out_row] = st.done
    st.alive &= (tok != sampling.eos_id) & (st.done < st.budget)
    st.token.copy_(tok)
    st.position += 1
    st.column += 1
    st.counter += 1


@torch.no_grad()
def decode(decoder: Decoder, ctx: Contexts, sampling: Sampling, options: EngineOptions) -> Outputs:
    """Continue every sample of `ctx` until EOS or its budget, at most options.max_batch_rows at once.
    Returns (its `Outputs`, the number of decode steps). R = the largest budget; entries past a sample's
    length are unspecified."""
    n = ctx.row.shape[0]
    device = decoder.device
    longest = int(ctx.budget.max())
    out = Outputs.empty(n, longest, sampling.keep_topk, device)
    model_part = _compiled_next_tokens(options, device)
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


def _compiled_next_tokens(options: EngineOptions, device):
    """`next_tokens` under torch.compile, one per device type: CUDA graphs ("reduce-overhead") on CUDA, a
    plain compile elsewhere (a process that compiled on the CPU first still gets its graphs on the GPU)."""
    use = options.compile if options.compile != "auto" else device.type == "cuda"
    if not use:
        return next_tokens
    if device.type not in _COMPILED_NEXT_TOKENS:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_STEP_GRAPHS)
        mode = "reduce-overhead" if device.type == "cuda" else None
        _COMPILED_NEXT_TOKENS[device.type] = torch.compile(next_tokens, mode=mode, dynamic=False)
    return _COMPILED_NEXT_TOKENS[device.type]


_COMPILED_NEXT_TOKENS: dict = {}


# --------------------------------------------------------------------------- generate


def check_sample_ids(sample_ids, batch: int, device) -> torch.Tensor:
    if sample_ids is None:
        return torch.arange(batch, device=device)
    if (
        not isinstance(sample_ids, torch.Tensor)
        or sample_ids.shape != (batch,)
        or sample_ids.dtype != torch.long
    ):
        raise ValueError(
            f"sample_ids: expected a [{batch}] int64 tensor (one global id per prompt), got {sample_ids!r}"
        )
    return sample_ids.to(device)


def first_tokens(decoder: Decoder, hidden: torch.Tensor, rows: torch.Tensor, seeds, counter, sampling, chunk):
    """Sample each row's first token from hidden[rows[i]] (the LM head on at most `chunk` rows at once).
    Returns (tokens [N] int64, logprobs [N] fp32, top: (ids, logprobs) [N, K] or None)."""
    toks, lps, tops = [], [], []
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        logits = decoder.logits(hidden[rows[part]])
        tok, lp = sampling.draw(logits, seeds[part], counter[part])
        toks.append(tok)
        lps.append(lp)
        if sampling.keep_topk:
            tops.append(sampling.top(logits))
    top = (torch.cat([t[0] for t in tops]), torch.cat([t[1] for t in tops])) if tops else None
    return torch.cat(toks), torch.cat(lps), top


def continue_after_first(
    decoder: Decoder, ctx: Contexts, first_lp, first_top, sampling: Sampling, options: EngineOptions, pad_id
):
    """Responses = each sample's first token (ctx.token, already drawn, log-prob first_lp [N], top-k
    first_top or None) followed by its decoded continuation (samples whose first token is EOS or whose
    budget is 0 stop there). Returns (response_ids [N, W] int64, response_mask [N, W] bool, logprobs [N, W]
    fp32, top: (ids, logprobs) [N, W, K] or None, decode steps run), W = the longest response."""
    n, device = ctx.token.shape[0], decoder.device
    rows = ((ctx.token != sampling.eos_id) & (ctx.budget > 0)).nonzero().squeeze(-1)
    full = Outputs.empty(n, max(int(ctx.budget.max()), 1), sampling.keep_topk, device).without_spare()
    steps = 0
    if rows.numel():
        out, steps = decode(decoder, ctx.subset(rows), sampling, options)
        width = out.tokens.shape[1]
        for name, value in out.__dict__.items():
            if value is not None:
                target = getattr(full, name)
                if value.dim() == 1:
                    target[rows] = value
                else:
                    target[rows, :width] = value
    total = full.lengths + 1
    width = int(total.max())
    mask = torch.arange(width, device=device)[None, :] < total[:, None]

    def splice(first, rest, fill):
        joined = torch.cat([first[:, None], rest], dim=1)[:, :width]
        return joined.masked_fill(~mask.view(*mask.shape, *([1] * (joined.dim() - 2))), fill)

    ids = splice(ctx.token, full.tokens, pad_id)
    lps = splice(first_lp, full.logprobs, 0.0)
    top = None
    if sampling.keep_topk:
        top = (splice(first_top[0], full.top_ids, 0), splice(first_top[1], full.top_logprobs, float("-inf")))
    return ids, mask, lps, top, steps


@torch.no_grad()
def generate_rows(
    model,
    prompts: list[list[int]],
    seeds: torch.Tensor,
    first_counter: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Rollout:
    """`generate` with explicit per-row sampling seeds [B] int64 and the sampling counter of each row's
    first response token first_counter [B] int64 (0 in `generate`; speculative reuse resumes a response at
    its first rejected position)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling_settings(temperature, top_k, top_p)
    options = engine_options(model)
    decoder = decoder_for(model)
    device = decoder.device
    p_ids, p_mask, row_of = distinct_prompts(prompts, pad_id, device)
    sampling = Sampling(float(temperature), int(top_k), float(top_p), eos_id)
    distinct = [p[m].tolist() for p, m in zip(p_ids, p_mask)]
    cache, lengths, last_hidden = prefill(decoder, distinct, options.max_batch_rows, options.kv_cache_dtype)
    first_tok, first_lp, _ = first_tokens(
        decoder, last_hidden, row_of, seeds, first_counter, sampling, options.max_batch_rows
    )
    col = torch.arange(cache.columns, device=device)
    ctx = Contexts(
        cache=cache,
        row=row_of,
        visible=col[None, :] < lengths[row_of, None],
        position=lengths[row_of],
        token=first_tok,
        counter=first_counter + 1,
        budget=torch.full_like(row_of, max_new_tokens - 1),
        seed=seeds,
    )
    ids, mask, lps, _, _ = continue_after_first(decoder, ctx, first_lp, None, sampling, options, pad_id)
    return Rollout(p_ids[row_of], p_mask[row_of], ids, mask, lps)


def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    sample_ids: torch.Tensor | None = None,
) -> Rollout:
    """Sample up to `max_new_tokens` tokens after each prompt, stopping a row at `eos_id`.

    model: a Hugging Face causal LM of the Llama family (module docstring), any dtype, quantized linears
    included; engine settings from `set_engine_options`. Repeated prompts are prefilled once. One 64-bit
    seed is drawn from `generator` per call; sample_ids [B] int64 (default arange(B)) key each row's random
    numbers, so a row's sample does not depend on the batch it runs in. temperature 0 is greedy (log-prob 0).
    """
    device = decoder_for(model).device
    ids = check_sample_ids(sample_ids, len(prompts), device)
    seeds = sample_seeds(draw_step_seed(generator), ids)
    return generate_rows(
        model,
        prompts,
        seeds,
        torch.zeros_like(seeds),
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
