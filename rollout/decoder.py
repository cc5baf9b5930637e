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
from contextlib import contextmanager
from functools import cache as memoize
from functools import partial

import torch
import torch.nn.functional as F

from bitrl.kernels.aligned import (
    aligned_attention,
    aligned_linear,
    aligned_rms_norm,
    aligned_silu_mul,
    check_aligned_dtype,
    column_rms_norm,
)
from bitrl.kernels.decode_attention import decode_attention
from bitrl.kernels.host_ext import load_host_library
from bitrl.kernels.packed_linear import pack_linear, packed_linear, use_packed_linear
from bitrl.kernels.rope_cache import rope_store, rotate_half
from bitrl.kernels.weight_major import (
    WEIGHT_MAJOR_MAX_ROWS,
    WEIGHT_MAJOR_MIN_ROWS,
    use_weight_major,
    weight_major_linear,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0
# New tokens per row up to which the CPU attends through decode_attention (decode steps, drafts) rather than
# SDPA (prefill)
CPU_KERNEL_TOKENS = 16
ROPE_BLOCK = 64  # positions per rotary call when the aligned mode builds its table


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


def linear_weights(module, dtype: torch.dtype):
    """(weight [out, in], bias [out] or None) of a linear layer in `dtype`, differentiable: an nn.Linear's
    own, or a LoRA layer's merged W + (alpha / r) B A computed as the rollout copy holds it (in fp32, then
    cast), so the aligned trainer and its rollout copy multiply by the same bits."""
    from bitrl.rollout.lora_merge import ADAPTER, is_lora_layer, merged_weight

    if is_lora_layer(module):
        dropout = module.lora_dropout[ADAPTER]
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            raise ValueError("rollout.aligned: merged LoRA weights take no dropout; set model.lora.dropout=0")
        with torch.autocast(module.base_layer.weight.device.type, enabled=False):  # B A in fp32, as synced
            weight, bias = merged_weight(module, dtype), module.base_layer.bias
    elif isinstance(module, torch.nn.Linear):
        weight, bias = module.weight.to(dtype), module.bias
    else:
        raise ValueError(
            "rollout.aligned: runs full-precision linear layers (and LoRA on them), got "
            f"{type(module).__name__}"
        )
    return weight, None if bias is None else bias.to(dtype)


def check_aligned_model(model, dtype: torch.dtype, device: torch.device) -> None:
    """Raise, naming the reason, where the aligned mode cannot make `model`'s tokens batch-invariant."""
    check_aligned_dtype(dtype, device)
    config = model.config
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"rollout.aligned: the MLP's activation must be silu, got {act!r}")
    head_dim = model.model.layers[0].self_attn.head_dim
    if torch.device(device).type == "cpu" and head_dim % 16:
        raise ValueError(f"rollout.aligned: the CPU attention kernel needs head_dim % 16 == 0: {head_dim}")


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


def _call(layer, fn):
    return fn()


def _weight_major_products(linears, x_t: torch.Tensor) -> torch.Tensor:
    """Each nn.Linear's weight [O_i, K] @ x_t [K, N] (+ its bias), stacked: [sum O_i, N] fp32, every product
    written in place into its rows of the stack (a fused projection with no fused weight)."""
    out = torch.empty(
        (sum(m.out_features for m in linears), x_t.shape[1]), dtype=x_t.dtype, device=x_t.device
    )
    start = 0
    for m in linears:
        part = out[start : start + m.out_features]
        if m.bias is None:
            torch.mm(m.weight, x_t, out=part)
        else:
            torch.addmm(m.bias[:, None], m.weight, x_t, out=part)
        start += m.out_features
    return out


class Decoder:
    """A Llama-family causal LM's modules, run against a `KVCache`.

    Attention over a cache is defined by three things per row: the columns its new tokens are written to,
    their positions (for the rotary embedding), and which cache columns each new token may see. The prefill,
    the decode step and the verification of a draft tree are the same call with different masks; without a
    cache (the trainer's forward) the tokens attend to each other.

    aligned: the matched-precision mode (bitrl.kernels.aligned): every op batch-invariant, so that a token's
    hidden state has the same bits in a decode step, a prefill and the trainer's forward over the whole
    sequence. dtype: the compute dtype (default the weights'; a trainer under bf16 autocast passes bf16 and
    the weights are cast per forward, differentiably, as the rollout copy holds them cast once).
    run_layer(layer, fn): runs fn, the computation of decoder layer `layer` (default: fn()); a sharded
    trainer runs it as the layer's forward, between FSDP2's hooks that gather its weights.

    packed: whether a forward without autograd may run the products packed where the CPU has that form
    (`packed_products`; off for a decode step under torch.compile, whose graph takes the weights as they are).

    weight_major_layers: whether a CPU decode step of 16-256 tokens keeps its activations feature-major
    ([features, tokens]) and runs each projection as weight @ x_t (plain fp32 nn.Linear layers only; set it
    False to take the row-major step).
    """

    def __init__(
        self,
        model,
        aligned: bool = False,
        dtype: torch.dtype | None = None,
        run_layer=None,
        packed: bool = True,
    ):
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
        self.device = self.inner.embed_tokens.weight.device
        # compute dtype: the weights' own, or (a trainer under autocast) the dtype they are cast to
        self.dtype = dtype or self.inner.embed_tokens.weight.dtype
        self.aligned = aligned
        self.run_layer = run_layer or _call
        self._rope = None
        if aligned:
            check_aligned_model(model, self.dtype, self.device)
        # A CPU decode step runs the norms and the MLP's silu(gate) * up through the host kernels of the
        # aligned mode (one call each instead of 6-8 torch ops: ~6 ms of a SmolLM2 step at 64 rows); the
        # models here all share the Llama RMSNorm formula. Outside a decode step, the modules themselves.
        self._host_elementwise = (
            not aligned
            and self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and getattr(config, "hidden_act", "silu") == "silu"
            and load_host_library() is not None
        )
        # ... and where every projection is a plain fp32 nn.Linear (not quantized, not Qwen3's per-head
        # norms), the decode step keeps its activations feature-major ([features, tokens]) so that every
        # product runs weight-major (bitrl.kernels.weight_major): on the 2-core AVX2 EPYC SmolLM2's layer
        # products at 64 rows take 111 ms per step instead of 145, with the same bits.
        projections = [
            m
            for layer in self.layers
            for m in (
                *(getattr(layer.self_attn, f"{n}_proj") for n in "qkvo"),
                *(getattr(layer.mlp, f"{n}_proj") for n in ("gate", "up", "down")),
            )
        ]
        # Where the CPU has oneDNN's packed products for the compute dtype (AVX-512 for fp32, bf16 units for
        # bf16), a forward without autograd runs every plain nn.Linear through them (bitrl.kernels.
        # packed_linear: 1.3-2.6x faster at 64 rows than x @ W.T): a layer's q, k, v stacked into one
        # product, silu(gate), the multiply by up and both residual adds fused into the products. The packed
        # copies are made on first use, rebuilt when a weight changes, and freed when a rollout ends
        # (`packing`).
        self.packed_products = packed and not aligned and use_packed_linear(self.dtype, self.device)
        self._packs: dict[tuple, object] = {}
        self.weight_major_layers = (
            self._host_elementwise
            and not self.packed_products
            and self.dtype == torch.float32
            and not hasattr(attn, "q_norm")
            and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in projections)
        )

    def new_cache(self, rows: int, columns: int, kv_cache_dtype: str = "auto") -> KVCache:
        dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        return KVCache(len(self.layers), rows, self.kv_heads, columns, self.head_dim, dtype, self.device)

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        cols: torch.Tensor | None,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Final-norm hidden states [R, T, H] of tokens ids [R, T] at positions [R, T], written into cache
        row r at columns cols [R, T]; visible [R, T, W] bool: the cache columns each token attends to (its own
        column included), W <= cache.columns. cache None: no cache, the tokens attend to each other
        (visible [R, T, T]; the trainer's forward, differentiable in the aligned mode)."""
        rows, steps = ids.shape
        width = visible.shape[-1]
        x = self._embed(ids)
        cos, sin = self._rotary(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        # Grouped-query attention as one block of queries per KV head: query head h = j * group + g reads KV
        # head j, so the [R, heads, T, d] queries view as [R, kv_heads, group * T, d]. No enable_gqa and no
        # copy of the cache: a bool mask with enable_gqa leaves CUDA only the math kernel (its
        # memory-efficient kernel takes masks but not GQA), which builds the [R, heads, T, W] scores.
        group = self.heads // self.kv_heads
        # decode_attention: on CUDA for an fp8 cache (read in the kernel, not cast); on the CPU for a decode
        # step or a draft (the host kernel: SDPA's CPU kernel pays per tiny batched product); always in the
        # aligned mode (its reductions do not depend on the rows, tokens or masked columns)
        fp8 = cache is not None and cache.dtype == torch.float8_e4m3fn
        kernel_attention = self.aligned or (fp8 if self.device.type == "cuda" else steps <= CPU_KERNEL_TOKENS)
        mask = (
            visible[:, None, None].expand(rows, 1, group, steps, width).reshape(rows, 1, group * steps, width)
        )
        attend = partial(self._attention, kernel_attention, cache, cols, visible, mask, width)
        host = self._host_elementwise and cache is not None and not torch.is_grad_enabled()
        # the host's rotary pass writes K and V into the cache itself (a cache in the compute dtype)
        store = (cache, cols) if host and cache.dtype == self.dtype else None
        if (
            store is not None
            and self.weight_major_layers
            and WEIGHT_MAJOR_MIN_ROWS <= rows * steps <= WEIGHT_MAJOR_MAX_ROWS
        ):
            x_t = x.reshape(rows * steps, -1).t().contiguous()  # [H, N]: token r * T + t in column r * T + t
            for i, layer in enumerate(self.layers):
                step = partial(self._layer_weight_major, i, layer, x_t, cos, sin, attend, store)
                x_t = self.run_layer(layer, step)
            norm = self.inner.norm
            return column_rms_norm(x_t, norm.weight, norm.variance_epsilon).t().view(rows, steps, -1)
        for i, layer in enumerate(self.layers):
            x = self.run_layer(layer, partial(self._layer, i, layer, x, cos, sin, attend, host, store))
        return self._norm(self.inner.norm, x, host)

    def _layer(self, i, layer, x, cos, sin, attend, host=False, store=None):
        rows, steps = x.shape[:2]
        attn = layer.self_attn
        h = self._norm(layer.input_layernorm, x, host)
        q, k, v = (
            t.view(rows, steps, -1, self.head_dim)
            for t in self._products((attn.q_proj, attn.k_proj, attn.v_proj), h)
        )
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = self._norm(attn.q_norm, q, host), self._norm(attn.k_norm, k, host)
        if store is not None:  # one host pass: the rotary embedding, K and V into the cache
            cache, cols = store
            q = rope_store(q, k, v, cos[:, 0], sin[:, 0], cache.k[i], cache.v[i], cols)
            k = v = None  # stored
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        o = attend(i, q, k, v).view(rows, self.heads, steps, self.head_dim)
        x = self._linear(attn.o_proj, o.transpose(1, 2).reshape(rows, steps, -1), residual=x)
        return self._mlp(layer.mlp, self._norm(layer.post_attention_layernorm, x, host), x, host)

    def _layer_weight_major(self, i, layer, x_t, cos, sin, attend, store):
        """`_layer`'s host path on feature-major activations x_t [H, N] (N = R * T tokens): each product is
        weight @ x_t, the norms `column_rms_norm`; the same bits as `_layer` where the two forms of the
        products have them (they do on the CPUs measured, at these rows)."""
        attn, mlp = layer.self_attn, layer.mlp
        rows, steps, d = cos.shape[0], cos.shape[2], self.head_dim
        ln = layer.input_layernorm
        qkv = _weight_major_products(
            (attn.q_proj, attn.k_proj, attn.v_proj), column_rms_norm(x_t, ln.weight, ln.variance_epsilon)
        )
        tokens = qkv.t()  # [N, (Hq + 2 Hk) d], a view: rope_store reads the projections where they lie
        q_end, k_end = attn.q_proj.out_features, attn.q_proj.out_features + attn.k_proj.out_features
        q, k, v = (
            tokens[:, s:e].view(rows, steps, -1, d) for s, e in ((0, q_end), (q_end, k_end), (k_end, None))
        )
        cache, cols = store
        q = rope_store(q, k, v, cos[:, 0], sin[:, 0], cache.k[i], cache.v[i], cols)
        o = attend(i, q, None, None).view(rows, self.heads, steps, d)
        o_t = o.permute(1, 3, 0, 2).reshape(self.heads * d, rows * steps)  # [Hq d, N]
        x_t = x_t + _weight_major_products((attn.o_proj,), o_t)
        ln = layer.post_attention_layernorm
        gate_up = _weight_major_products(
            (mlp.gate_proj, mlp.up_proj), column_rms_norm(x_t, ln.weight, ln.variance_epsilon)
        )
        inner = mlp.gate_proj.out_features
        return x_t + _weight_major_products(
            (mlp.down_proj,), aligned_silu_mul(gate_up[:inner], gate_up[inner:])
        )

    def _attention(self, kernel_attention, cache, cols, visible, mask, width, i, q, k, v):
        """Layer i's attention of q [R, heads, T, d] over the cache (k, v [R, kv_heads, T, d] written into
        it first) or, without a cache, over k and v themselves."""
        rows, _, steps, _ = q.shape
        if cache is not None:
            if k is not None:  # else already stored (rope_store)
                cache.write(i, k, v, cols)
            keys, values = cache.k[i], cache.v[i]
        else:
            keys, values = k, v
        q = q.reshape(rows, self.kv_heads, -1, self.head_dim)
        if self.aligned:
            return aligned_attention(q, keys, values, visible, self.scaling)
        if kernel_attention:
            return decode_attention(q, keys, values, visible, self.scaling)
        if cache is not None:
            keys, values = cache.read(i, width, q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)

    # The model's modules, or (aligned) their batch-invariant forms on the same weights.

    def _embed(self, ids):
        table = self.inner.embed_tokens
        return table(ids) if not self.aligned else F.embedding(ids, table.weight.to(self.dtype))

    def _norm(self, norm, x, host=False):
        if not (self.aligned or host):
            return norm(x)
        return aligned_rms_norm(x, norm.weight.to(self.dtype), norm.variance_epsilon)

    def _linear(self, module, x, residual=None):
        """module(x) (+ residual)."""
        if self.aligned:
            y = aligned_linear(x, *linear_weights(module, self.dtype))
        else:
            packed = self._packed((module,))
            if packed is not None:
                return packed_linear(x, packed, add=residual)  # the residual added in the product
            y = module(x)
        return y if residual is None else residual + y

    def _products(self, modules, x):
        """Each linear module's output on x: views into one stacked product where they are packed."""
        packed = self._packed(modules)
        if packed is None:
            return [self._linear(m, x) for m in modules]
        return packed_linear(x, packed).split([m.out_features for m in modules], dim=-1)

    def packed_groups(self) -> list[tuple]:
        """The products a packed forward runs, in its order: per layer q, k and v stacked, o, gate, up and
        down; then the LM head (what a floor of the packed step times)."""
        groups = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups += [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,)]
            groups += [(mlp.gate_proj,), (mlp.up_proj,), (mlp.down_proj,)]
        return groups + [(self.head,)]

    @contextmanager
    def packing(self):
        """Within: the packed copies made on first use are kept; at the end they are freed. A rollout packs
        once and leaves no second copy of its weights behind while the trainer runs (whose update changes
        them anyway)."""
        try:
            yield self
        finally:
            self._packs.clear()

    def _packed(self, modules):
        """The packed product of `modules` (plain nn.Linear layers in the compute dtype), packed on first use
        and again when a weight changes; None where the packed form is not taken (no packed products here,
        autograd on, another kind of layer, a module with forward hooks)."""
        if not self.packed_products or torch.is_grad_enabled():
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
            return None  # a hooked module runs its own forward, so that its hooks see the call
        key = tuple(map(id, modules))
        packed = self._packs.get(key)
        if packed is False:
            return None
        if packed is None and not all(
            type(m) is torch.nn.Linear and m.weight.dtype == self.dtype for m in modules
        ):
            self._packs[key] = False
            return None
        weights = [m.weight for m in modules]
        if packed is None or not packed.current(weights):
            self._packs[key] = None  # the old copy goes before the new one is made
            packed = self._packs[key] = pack_linear(weights, [m.bias for m in modules])
        return packed

    def _mlp(self, mlp, x, residual, host=False):
        """residual + the MLP of x."""
        if not (self.aligned or host):
            return residual + mlp(x)
        gate, up = self._packed((mlp.gate_proj,)), self._packed((mlp.up_proj,))
        if gate is not None and up is not None:  # up(x) * silu(gate(x)), each step fused into a product
            gated = packed_linear(x, up, mul=packed_linear(x, gate, silu=True))
        else:
            gated = aligned_silu_mul(self._linear(mlp.gate_proj, x), self._linear(mlp.up_proj, x))
        return self._linear(mlp.down_proj, gated, residual=residual)

    def _rotary(self, x, positions):
        if not self.aligned:
            return self.inner.rotary_emb(x, positions)
        # A table built in fixed blocks of positions: each entry's bits depend on its position alone (one
        # rotary call over all positions would put an entry in a vector loop's body or in its scalar tail
        # depending on how many there are).
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need:
            size = -(-max(need, 2 * (0 if self._rope is None else self._rope[0].shape[0])) // ROPE_BLOCK)
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            parts = [
                self.inner.rotary_emb(probe, torch.arange(s, s + ROPE_BLOCK, device=self.device)[None])
                for s in range(0, size * ROPE_BLOCK, ROPE_BLOCK)
            ]
            self._rope = (torch.cat([c[0] for c, _ in parts]), torch.cat([s[0] for _, s in parts]))
        cos, sin = self._rope
        return cos[positions], sin[positions]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [..., V] in the compute dtype."""
        head = self.head
        packed = None if self.aligned else self._packed((head,))
        if packed is not None:
            return packed_linear(hidden, packed)
        if (
            not self.aligned
            and type(head) is torch.nn.Linear
            and head.bias is None
            and use_weight_major(hidden, head.weight)
        ):  # a CPU decode step's head: the weight-major blocks are 1.2-1.9x faster there, same bits
            return weight_major_linear(hidden, head.weight)
        return self._linear(head, hidden)


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
