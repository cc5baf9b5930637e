"""A Llama-family model run step by step against a KV cache it owns: `Decoder`, `KVCache` and `prefill`.

The decoder runs the model's own modules (embedding, norms, projections, MLPs, rotary embedding, LM head;
quantized `QuantLinear`s included) in the order of the Hugging Face forward of the Llama family (Llama,
Qwen2, Qwen3, Mistral), with attention written here against a cache it owns, so nothing depends on the
`Cache` API of a transformers release.

KV cache: static per layer, one [rows, kv_heads, columns, head_dim] buffer pair per layer (as gpt-fast), not
paged blocks (as nano-vllm). A rollout knows its worst case before it starts (the longest prompt plus
max_new_tokens) and runs at most `max_batch_rows` rows at once, so a dense buffer of max_batch_rows x that
many columns is the whole budget, allocated once. Paging pays a block-table indirection on every attention
read to share memory between requests of unknown length (serving); here a slot wastes at most the columns
its sample does not use, and the decode step stays one fixed-shape function that torch.compile and CUDA
graphs can capture. Prefix sharing is by copy: each distinct prompt is prefilled once into a prefill buffer,
and each of its G samples copies those columns into its slot when it is admitted (a copy of the prompt's
K/V per sample is small next to its decode).
"""

from __future__ import annotations

import inspect
from functools import cache as memoize

import torch
import torch.nn.functional as F

from bitrl.kernels.decode_attention import decode_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0
# New tokens per row up to which the CPU attends through decode_attention (decode steps, drafts) rather than
# SDPA (prefill)
CPU_KERNEL_TOKENS = 16


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
        # decode_attention: on CUDA for an fp8 cache (read in the kernel, not cast); on the CPU for a decode
        # step or a draft (the host kernel: SDPA's CPU kernel pays per tiny batched product)
        kernel_attention = (
            cache.dtype == torch.float8_e4m3fn if self.device.type == "cuda" else steps <= CPU_KERNEL_TOKENS
        )
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
            q = q.reshape(rows, self.kv_heads, group * steps, self.head_dim)
            if kernel_attention:
                o = decode_attention(q, cache.k[i], cache.v[i], visible, self.scaling)
            else:
                keys, values = cache.read(i, width, q.dtype)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            o = o.view(rows, self.heads, steps, self.head_dim)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(rows, steps, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


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
