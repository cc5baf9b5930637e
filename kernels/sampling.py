"""Counter-based fused sampling: temperature, top-k, top-p, Gumbel-max draw and the log-prob of the drawn
token under the distribution actually sampled from, one pass per row, no sort.

``fused_sample(logits [B, V], seeds [B] int64, positions [B] int64, temperature, top_k, top_p)
-> (tokens [B] int64, logprobs [B] fp32)``

Semantics (shared with the CUDA C++ twin in csrc/sampler.cu; all math in fp32):

1. z_v = float32(logit_v) / T; T == 0 is greedy (argmax, lowest index on ties; log-prob 0).
2. top-k (0 < top_k < V): keep v iff z_v >= the k-th largest z (ties at the boundary all kept).
3. top-p (top_p < 1), on p = softmax(z) over the top-k support: keep v iff the mass of the kept tokens whose
   probability is strictly greater than p_v is < top_p. p is strictly increasing in z, so "p_w > p_v" is
   evaluated as "z_w > z_v" (no rounding of p can merge two tokens). Tied tokens are kept or dropped
   together; the most likely token is always kept.
4. Per-token uniforms from Philox4x32-10 (Random123, as ``triton.language.philox``): key = (low, high 32
   bits of the row's seed), counter = (v // 4, low, high 32 bits of the row's position, 0), x_v = output
   lane v % 4, u_v = ((x_v >> 8) + 0.5) * 2^-24 in fp32 arithmetic, capped at 1 - 2^-24 (the fp32 sum
   rounds half to even and would give exactly 1.0 for x_v >> 8 = 2^24 - 1, an infinite Gumbel key).
5. token = argmax over the kept support of z_v - log(-log(u_v)) (lowest index on exact ties).
6. logprob = z_token - logsumexp(z over the kept support).

A row's draw depends only on its logits, its seed and its position: not on the batch it sits in, its row
index, or how many rows run at once. `sample_seeds` derives per-row seeds from one step seed and global
sample ids.

Implementations (``impl=`` or ``BITRL_KERNEL_IMPL``): ``"reference"`` the formula above written plainly
(pairwise top-p masses, O(V^2) per row: tests only); ``"torch"`` the CPU execution path (top-p through one
sort, tie groups resolved exactly); ``"triton"`` one kernel, one program per row, vocabulary in tiles: top-k
and top-p thresholds found by bisection over the order-preserving integer image of fp32 (32 counting passes
each, only when the filter is on), then one pass for the Gumbel argmax and the kept log-sum-exp.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, check_same_device, check_tensor, next_pow2, resolve_impl
from .host_ext import load_host_library

__all__ = [
    "philox4x32",
    "sampling_uniforms",
    "uniforms_at",
    "sample_seeds",
    "draw_step_seed",
    "fused_sample_reference",
    "fused_sample",
    "filter_logits",
]

MASK32 = 0xFFFFFFFF
PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
U_SCALE = 2.0**-24
U_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------------
# Philox4x32-10 and the per-token uniforms (torch)
# ----------------------------------------------------------------------------------------------------------


def _mulhilo(a: int, b: torch.Tensor):
    """(high, low) 32-bit halves of a * b for a 32-bit constant a and int64 tensor b holding uint32 values.
    The int64 product wraps modulo 2^64, which keeps all 64 bits of a product below 2^64."""
    prod = b * a
    return (prod >> 32) & MASK32, prod & MASK32


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 (Random123). counter: 4 int64 tensors (or ints) holding uint32 values; key: 2 of them; all
    broadcastable. Returns the 4 output words as int64 tensors holding uint32 values."""
    c0, c1, c2, c3 = (torch.as_tensor(c) & MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k) & MASK32 for k in key)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(PHILOX_ROUND[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_ROUND[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_KEY_STEP[0]) & MASK32
        k1 = (k1 + PHILOX_KEY_STEP[1]) & MASK32
    return c0, c1, c2, c3


# Philox words drawn per chunk: the intermediates of ten rounds stay in cache (2-3x faster on a CPU than one
# pass over [B, V/4], where every round streams the whole tensor through memory).
CHUNK_WORDS = 1 << 17


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """Philox output words (int64 holding uint32) -> u fp32 in (0, 1), step 4 of the semantics."""
    return (((x >> 8).float() + 0.5) * U_SCALE).clamp_(max=U_MAX)


def _key(seeds: torch.Tensor):
    return seeds & MASK32, (seeds >> 32) & MASK32


def _host_library(*tensors):
    """The compiled Philox (csrc/sampler_host.cc) for CPU tensors, else None (the torch formula runs)."""
    return load_host_library() if all(t.device.type == "cpu" for t in tensors) else None


def sampling_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [B, V] fp32 in (0, 1): the uniform of token v of row b (step 4 of the semantics).
    seeds, positions: [B] int64."""
    lib = _host_library(seeds, positions)
    if lib is None:
        return _sampling_uniforms_torch(seeds, positions, vocab_size)
    seeds, positions = seeds.long().contiguous(), positions.long().contiguous()
    u = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32)
    rows = seeds.shape[0]
    lib.bitrl_sampling_uniforms(seeds.data_ptr(), positions.data_ptr(), rows, vocab_size, u.data_ptr())
    return u


def _sampling_uniforms_torch(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`sampling_uniforms` in torch ops (any device)."""
    seeds, positions = seeds.long()[:, None], positions.long()[:, None]
    u = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    span = 4 * max(1, CHUNK_WORDS // max(1, seeds.shape[0]))  # tokens per chunk, a multiple of 4
    for start in range(0, vocab_size, span):
        stop = min(vocab_size, start + span)
        c0 = torch.arange(start // 4, -(-stop // 4), dtype=torch.long, device=seeds.device)[None, :]
        counter = (c0, positions & MASK32, (positions >> 32) & MASK32, torch.zeros_like(c0))
        x = torch.stack(
            torch.broadcast_tensors(*philox4x32(counter, _key(seeds))), dim=-1
        )  # [B, words, lane]
        u[:, start:stop] = _uniform(x.reshape(x.shape[0], -1)[:, : stop - start])
    return u


def uniforms_at(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """u [N] fp32 of token tokens[i] in a row with seed seeds[i] sampling position positions[i] (all [N]
    int64): `sampling_uniforms` at chosen (row, token) pairs only."""
    lib = _host_library(seeds, positions, tokens)
    if lib is None:
        return _uniforms_at_torch(seeds, positions, tokens)
    seeds, positions, tokens = (t.long().contiguous() for t in (seeds, positions, tokens))
    u = torch.empty(tokens.shape, dtype=torch.float32)
    n = tokens.numel()
    lib.bitrl_uniforms_at(seeds.data_ptr(), positions.data_ptr(), tokens.data_ptr(), n, u.data_ptr())
    return u


def _uniforms_at_torch(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`uniforms_at` in torch ops (any device)."""
    counter = (tokens // 4, positions & MASK32, (positions >> 32) & MASK32, torch.zeros_like(tokens))
    words = torch.stack(torch.broadcast_tensors(*philox4x32(counter, _key(seeds))))  # [lane, N]
    return _uniform(words.gather(0, (tokens % 4)[None]).squeeze(0))


def draw_step_seed(generator: torch.Generator | None = None) -> int:
    """One 64-bit step seed from a torch generator (the global one when None): the only draw a sampling
    call makes from it."""
    return int(torch.randint(-(2**63), 2**63 - 1, (), generator=generator, dtype=torch.long))


def sample_seeds(step_seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
    """One 64-bit sampling seed per row [B] int64: Philox keyed by `step_seed`, counter = the row's global
    sample id. Rows with the same id draw the same numbers whatever batch they sit in."""
    ids = sample_ids.long()
    step_seed = int(step_seed) & (2**64 - 1)
    key = (step_seed & MASK32, step_seed >> 32)
    zero = torch.zeros_like(ids)
    w0, w1, _, _ = philox4x32((ids & MASK32, (ids >> 32) & MASK32, zero, zero), key)
    return (w1 << 32) | w0


# ----------------------------------------------------------------------------------------------------------
# the reference: the semantics written plainly
# ----------------------------------------------------------------------------------------------------------


def _greedy(logits: torch.Tensor):
    tokens = logits.float().argmax(-1)
    return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)


def fused_sample_reference(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """The sampling semantics, term by term. logits [B, V] fp32/bf16/fp16; seeds, positions [B] int64.
    Returns (tokens [B] int64, logprobs [B] fp32). The top-p mass above a token sums the probabilities of the
    distinct logit values above its own (O(V log V) time, O(V) memory per row: real vocabularies fit)."""
    if temperature == 0:
        return _greedy(logits)
    z = logits.float() / temperature
    vocab = z.shape[-1]
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if top_p < 1.0:
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        for row in range(z.shape[0]):
            # mass_above[v] = sum of p_w over kept w with z_w > z_v (dropped w have p_w = 0): the mass of
            # each distinct value, then for each value the sum over the strictly greater ones
            values, group = torch.unique(z[row], return_inverse=True)  # ascending
            group_mass = torch.zeros_like(values).index_add_(0, group, p[row])
            above = torch.zeros_like(group_mass)
            above[:-1] = group_mass.flip(0).cumsum(0).flip(0)[1:]
            keep[row] &= above[group] < top_p
    u = _sampling_uniforms_torch(seeds, positions, vocab)  # the formula, not the compiled twin
    score = (z - torch.log(-torch.log(u))).masked_fill(~keep, float("-inf"))
    tokens = score.argmax(-1)
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - lse


# ----------------------------------------------------------------------------------------------------------
# the torch execution path (CPU)
# ----------------------------------------------------------------------------------------------------------


def _top_p_threshold(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, 1]: the smallest kept z under top-p (z already -inf outside the top-k support). One sort; the mass
    strictly above a token is the exclusive cumulative sum at the first member of its tie group."""
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    p = torch.softmax(sorted_z, dim=-1)
    exclusive = p.cumsum(-1) - p
    index = torch.arange(z.shape[-1], device=z.device).expand_as(sorted_z)
    new_group = torch.ones_like(sorted_z, dtype=torch.bool)
    new_group[:, 1:] = sorted_z[:, 1:] != sorted_z[:, :-1]
    group_start = torch.where(new_group, index, torch.zeros_like(index)).cummax(-1).values
    kept = exclusive.gather(-1, group_start) < top_p  # a prefix of the sorted row
    return sorted_z.gather(-1, kept.sum(-1, keepdim=True) - 1)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """z = logits / T in fp32 [..., V], -inf outside the kept support (steps 1-3). temperature > 0.
    log_softmax of the result is the log-prob of the distribution `fused_sample` draws from."""
    z = logits.float()
    if temperature != 1.0:  # z / 1 is z: no pass over the vocabulary for it
        z = z / temperature
    shape = z.shape
    z = z.reshape(-1, shape[-1])
    if 0 < top_k < shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0 and z.shape[0]:
        z = z.masked_fill(z < _top_p_threshold(z, top_p), float("-inf"))
    return z.reshape(shape)


# The largest Gumbel key -log(-log(u)) any uniform can give (u <= U_MAX): 16.6355. A token whose z is more
# than this below a score already drawn in its row can neither win nor tie.
GUMBEL_MAX = 16.64
# Drawing one token's uniform alone costs a whole Philox block (4 lanes), plus the indexing: measured on
# SmolLM2's logits at B = 64 the sparse draw stays faster up to about a quarter of the vocabulary.
SPARSE_FRACTION = 4


def _fused_sample_torch(logits, seeds, positions, temperature, top_k, top_p):
    """Steps 1-6 in torch ops, steps 5 and 6's normaliser through `_gumbel_argmax`."""
    z = filter_logits(logits, temperature, top_k, top_p)
    tokens, lse = _gumbel_argmax(z, seeds.long(), positions.long())
    return tokens, z[torch.arange(z.shape[0], device=z.device), tokens] - lse


# Candidates per row the host library may hand back (a row with more is drawn the plain way).
HOST_CANDIDATES = 16


def _gumbel_argmax(z: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """(argmax_v z_v - log(-log(u_v)) [B] int64, logsumexp_v z_v [B] fp32) per row of z [B, V] fp32 (lowest
    index on exact ties), the argmax the full formula's bits. On the CPU the host library names each row's few
    possible winners (csrc/sampler_host.cc: approximate keys, every token within a margin of the best) and
    torch scores only those; the library sums the row's log-sum-exp in the same pass (its own exp, within
    1e-6 of torch's). Elsewhere, or for a row the library leaves to it, `_gumbel_argmax_torch` and
    torch.logsumexp."""
    lib = _host_library(z, seeds, positions)
    if lib is None:
        return _gumbel_argmax_torch(z, seeds, positions), torch.logsumexp(z, dim=-1)
    z = z.contiguous()
    rows = z.shape[0]
    candidates = torch.full((rows, HOST_CANDIDATES), -1, dtype=torch.long)
    count = torch.empty(rows, dtype=torch.long)
    lse = torch.empty(rows, dtype=torch.float32)
    seeds, positions = seeds.contiguous(), positions.contiguous()
    lib.bitrl_gumbel_candidates(
        z.data_ptr(),
        seeds.data_ptr(),
        positions.data_ptr(),
        rows,
        z.shape[1],
        HOST_CANDIDATES,
        candidates.data_ptr(),
        count.data_ptr(),
        lse.data_ptr(),
    )
    row, slot = (torch.arange(HOST_CANDIDATES) < count[:, None]).nonzero(as_tuple=True)
    token = candidates[row, slot]
    u = uniforms_at(seeds[row], positions[row], token)
    score = torch.full((rows, HOST_CANDIDATES), float("-inf"))
    score[row, slot] = z[row, token] - torch.log(-torch.log(u))
    tokens = candidates.gather(1, score.argmax(1, keepdim=True)).squeeze(1)  # candidates ascend: lowest wins
    plain = (count < 0).nonzero().squeeze(1)
    if plain.numel():
        tokens[plain] = _gumbel_argmax_torch(z[plain], seeds[plain], positions[plain])
        lse[plain] = torch.logsumexp(z[plain], dim=-1)
    return tokens, lse


def _gumbel_argmax_torch(z: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`_gumbel_argmax` without drawing V uniforms per row: the score of each row's most likely token bounds
    the winner's z from below (z_win >= score - GUMBEL_MAX), so Philox runs only for the tokens within that
    distance (hundreds of a real model's 49k at T = 0.7-1, all of them in a flat row)."""
    rows = torch.arange(z.shape[0], device=z.device)
    top = z.argmax(-1)
    top_score = z[rows, top] - torch.log(-torch.log(uniforms_at(seeds, positions, top)))
    # 1.0 of slack covers the rounding of z - log(-log(u)); a wider candidate set only costs time
    candidates = z >= (top_score - (GUMBEL_MAX + 1.0))[:, None]
    if candidates.sum() > candidates.numel() // SPARSE_FRACTION:  # flat rows: every token may win
        score = z - torch.log(-torch.log(sampling_uniforms(seeds, positions, z.shape[-1])))
    else:
        row, token = candidates.nonzero(as_tuple=True)
        u = uniforms_at(seeds[row], positions[row], token)
        score = torch.full_like(z, float("-inf"))
        score[row, token] = z[row, token] - torch.log(-torch.log(u))
    return score.argmax(-1)  # the first maximum: lowest index on exact ties


# ----------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ordered_key(z):
        """fp32 -> int64 with the same order (+0.0 and -0.0 must be canonicalised first)."""
        bits = z.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)

    @triton.jit
    def _scaled_logits(row_ptr, offs, vocab, temperature):
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        return tl.div_rn(x, temperature) + 0.0  # + 0.0 turns -0.0 into +0.0

    @triton.jit
    def _fused_sample_kernel(
        logits_ptr,
        seeds_ptr,
        positions_ptr,
        tokens_ptr,
        logprobs_ptr,
        stride_row,
        vocab,
        temperature,
        top_k,
        top_p,
        USE_TOP_K: tl.constexpr,
        USE_TOP_P: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        arange = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        key_neg_inf = -2139095041  # _ordered_key(-inf): bits 0xFF800000

        # top-k: the k-th largest key, the largest t with count(key >= t) >= k (bisection, 32 passes)
        kth_key = tl.full((), key_neg_inf, tl.int64)
        if USE_TOP_K:
            lo = tl.full((), key_neg_inf, tl.int64)
            hi = tl.full((), 2139095041, tl.int64)  # above _ordered_key(+inf)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                count = tl.zeros((), tl.int64)
                for start in range(0, vocab, BLOCK):
                    offs = start + arange
                    key = _ordered_key(_scaled_logits(row_ptr, offs, vocab, temperature))
                    count += tl.sum(((key >= mid) & (offs < vocab)).to(tl.int64), axis=0)
                big = count >= top_k
                lo = tl.where(big, mid, lo)
                hi = tl.where(big, hi, mid)
            kth_key = lo

        # row max and the softmax normaliser over the top-k support
        row_max = tl.full((), neg_inf, tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + arange
            row_max = tl.maximum(row_max, tl.max(_scaled_logits(row_ptr, offs, vocab, temperature), axis=0))
        total = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + arange
            z = _scaled_logits(row_ptr, offs, vocab, temperature)
            kept = (_ordered_key(z) >= kth_key) & (offs < vocab)
            total += tl.sum(tl.where(kept, tl.exp(z - row_max), 0.0), axis=0)

        # top-p: the smallest key t with mass(kept, key > t) < top_p * total (bisection, 32 passes)
        min_key = kth_key
        if USE_TOP_P:
            lo = kth_key - 1
            hi = _ordered_key(row_max)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros((), tl.float32)
                for start in range(0, vocab, BLOCK):
                    offs = start + arange
                    z = _scaled_logits(row_ptr, offs, vocab, temperature)
                    key = _ordered_key(z)
                    above = (key > mid) & (key >= kth_key) & (offs < vocab)
                    mass += tl.sum(tl.where(above, tl.exp(z - row_max), 0.0), axis=0)
                small = mass < top_p * total
                hi = tl.where(small, mid, hi)
                lo = tl.where(small, lo, mid)
            min_key = hi

        # Gumbel-max over the kept support, and its log-sum-exp
        pos = tl.load(positions_ptr + row)
        seed = tl.load(seeds_ptr + row)
        pos_lo = (pos & 0xFFFFFFFF).to(tl.uint32)
        pos_hi = ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
        best_score = tl.full((), neg_inf, tl.float32)
        best_index = tl.zeros((), tl.int64)
        best_z = tl.zeros((), tl.float32)
        kept_sum = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + arange
            z = _scaled_logits(row_ptr, offs, vocab, temperature)
            kept = (_ordered_key(z) >= min_key) & (offs < vocab)
            kept_sum += tl.sum(tl.where(kept, tl.exp(z - row_max), 0.0), axis=0)
            c0 = (offs // 4).to(tl.uint32)
            c1 = tl.zeros_like(c0) + pos_lo
            c2 = tl.zeros_like(c0) + pos_hi
            c3 = tl.zeros_like(c0)
            x0, x1, x2, x3 = tl.philox(seed, c0, c1, c2, c3)
            lane = offs % 4
            x = tl.where(lane == 0, x0, tl.where(lane == 1, x1, tl.where(lane == 2, x2, x3)))
            u = ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
            u = tl.minimum(u, 0.99999994039535522)
            score = tl.where(kept, z - tl.log(-tl.log(u)), neg_inf)
            tile_best = tl.max(score, axis=0)
            tile_index = tl.min(tl.where(score == tile_best, offs, 2147483647), axis=0).to(tl.int64)
            tile_z = tl.sum(tl.where(offs == tile_index, z, 0.0), axis=0)
            better = tile_best > best_score
            best_index = tl.where(better, tile_index, best_index)
            best_z = tl.where(better, tile_z, best_z)
            best_score = tl.where(better, tile_best, best_score)
        tl.store(tokens_ptr + row, best_index)
        tl.store(logprobs_ptr + row, best_z - row_max - tl.log(kept_sum))


def _fused_sample_triton(logits, seeds, positions, temperature, top_k, top_p):
    rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    block = min(next_pow2(vocab), 4096)
    _fused_sample_kernel[(rows,)](
        logits,
        seeds.contiguous(),
        positions.contiguous(),
        tokens,
        logprobs,
        logits.stride(0),
        vocab,
        float(temperature),
        int(top_k),
        float(top_p),
        USE_TOP_K=bool(0 < top_k < vocab),
        USE_TOP_P=bool(top_p < 1.0),
        BLOCK=block,
    )
    return tokens, logprobs


# ----------------------------------------------------------------------------------------------------------
# the public op
# ----------------------------------------------------------------------------------------------------------


def check_sampling_settings(temperature, top_k, top_p) -> None:
    """Raise ValueError naming the bad setting."""
    if not (isinstance(temperature, (int, float)) and temperature >= 0 and temperature != float("inf")):
        raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {top_p!r}")


def fused_sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    *,
    impl: str | None = None,
):
    """Draw one token per row and its log-prob under the distribution sampled from (module docstring).

    logits: [B, V] fp32 / bf16 / fp16 (at least one finite entry per row; no NaN or +inf); seeds: [B] int64
    (one 64-bit key per row, e.g. from `sample_seeds`); positions: [B] int64 (the position being sampled).
    temperature >= 0 (0 = greedy), top_k >= 0 (0 = off; >= V is off), 0 < top_p <= 1 (1 = off).
    Returns (tokens [B] int64, logprobs [B] fp32). No host synchronisation.
    """
    check_tensor("logits", logits, ndim=2, dtypes=LOGIT_DTYPES)
    rows = logits.shape[0]
    check_tensor("seeds", seeds, shape=(rows,), dtypes=(torch.int64,))
    check_tensor("positions", positions, shape=(rows,), dtypes=(torch.int64,))
    check_same_device("logits", logits, seeds=seeds, positions=positions)
    check_sampling_settings(temperature, top_k, top_p)
    if logits.shape[1] == 0:
        raise ValueError("logits: the vocabulary dimension is empty")
    if temperature == 0:
        return _greedy(logits)
    impl = resolve_impl(impl, logits.device, op="fused_sample")
    if impl == "reference":
        return fused_sample_reference(logits, seeds, positions, temperature, top_k, top_p)
    if impl == "triton":
        return _fused_sample_triton(logits, seeds, positions, temperature, top_k, top_p)
    return _fused_sample_torch(logits, seeds, positions, temperature, top_k, top_p)
