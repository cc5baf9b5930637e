"""Hidden states -> per-token log-prob and entropy of the target token, without the [N, V] logits.

``fused_logprobs(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N] fp32, entropy [N] fp32 | None)``

Implementations (``impl=``, or ``BITRL_KERNEL_IMPL``):

* ``"reference"`` - the naive unfused torch formula (``linear -> /T -> log_softmax -> gather``) in the input
  dtype. The tests run it in fp64 as ground truth and in the native dtype as the "unfused" baseline.
* ``"torch"`` - the CPU path (``TiledLinearSoftmax``): the logits are visited in [tokens x vocabulary]
  tiles sized by ``TILE_BYTES`` - an online log-sum-exp over the vocabulary blocks gives log-prob, entropy,
  log-sum-exp and lse - E_p[z] per token; the backward revisits the tiles, forms
  dz = g_lp (onehot - p) - g_H p (z - E_p[z]) and writes dW block by block (no forward recomputation, no
  [V, H] buffer beside the gradient). The entropy term is only formed when the entropy received a gradient.
* ``"triton"`` - chunked over tokens (``ChunkEngine``): each chunk's logits are reduced by Triton row kernels
  (per-row online log-sum-exp tiled over the vocabulary) and dropped; backward recomputes them and the
  in-place gradient kernel forms dz; matmuls stay on cuBLAS with fp32 accumulation, dW accumulates in fp32.

Both backends recompute each tile's logits in the backward, except those the forward kept: up to
``keep_logits_bytes`` of them (``KEEP_LOGITS_BYTES``: 512 MiB on CPU, where that saves one product of the
four, ~20% of the op's time; nothing on CUDA). Kept or recomputed, they are the same products h W^T.

Numerics: log-sum-exp, entropy and dW accumulate in fp32 (fp64 when the inputs are fp64). On the torch
backend, bf16 inputs multiply in bf16 where the CPU has bf16 units (fp32 accumulation inside the GEMM, logits
rounded to bf16 once, as in the unfused bf16 path, then fp32 for everything else; see ``TiledLinearSoftmax``)
and in fp32 where it has not (``CPU_BF16_MATMUL``); fp16 inputs on CPU multiply in fp32. ``-inf`` logits
(for instance from a ``-inf`` bias entry masking part of the vocabulary) are clamped to -1e30 so that p = 0
there exactly and no NaN appears (a target on such an entry gets log-prob about -1e30). Non-finite
hidden/weight values, NaN or +inf in the bias, and non-positive temperatures raise ``ValueError``. Rows
whose target is ``ignore_index`` get log-prob 0 and entropy 0 and no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import host_ext
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    all_finite,
    check_same_device,
    check_tensor,
    next_pow2,
    resolve_impl,
)

__all__ = ["fused_logprobs", "fused_logprobs_reference", "default_chunk_size", "KEEP_LOGITS_BYTES"]

# Bytes of fp32 logits one chunk may hold. On CPU, 128 MiB keeps the peak far below the unfused path while
# each chunk's matmuls run at full speed (1024 tokens at V = 32k measured ~3% faster than 512); on a GPU,
# chunks must be large enough to fill the machine.
CHUNK_BYTES = {"cpu": 128 * 2**20, "cuda": 1024 * 2**20}


LOGITS_BLOCK = 1024  # vocabulary columns per logits matmul of a CPU chunk (ChunkEngine.logits)


def device_budget(budgets: dict[str, int], device: torch.device | str) -> int:
    """The byte budget of ``device``'s type in a {"cpu": ..., "cuda": ...} table (others: the CPU's)."""
    return budgets.get(torch.device(device).type, budgets["cpu"])


def default_chunk_size(vocab: int, device: torch.device | str = "cpu", budget_bytes: int | None = None):
    """Tokens per chunk so that one fp32 [chunk, V] logits tile stays within the device's budget."""
    budget = budget_bytes if budget_bytes is not None else device_budget(CHUNK_BYTES, device)
    return max(16, min(65536, budget // (4 * max(int(vocab), 1))))


# ----------------------------------------------------------------------------------------------------------
# naive reference
# ----------------------------------------------------------------------------------------------------------


def fused_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature=1.0,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = True,
):
    """The unfused path in the input dtype: logits -> /T -> log_softmax -> gather (and entropy).

    Materialises the full [N, V] logits. Outputs are cast to fp32 (fp64 stays fp64). Used as ground truth
    (fp64 inputs) and as the "unfused same dtype" baseline in the tests and benchmarks.
    """
    logits = F.linear(hidden, weight, bias)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)
    elif temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(out_dtype)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    ent = None
    if return_entropy:
        p = logp.exp()
        # p log p -> 0 where p = 0 (a -inf logit), without a NaN in the backward either
        logp_finite = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
        ent = (-(p * logp_finite).sum(-1)).to(out_dtype)
        ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent


# ----------------------------------------------------------------------------------------------------------
# chunk building blocks (shared with fused_linear_policy_loss)
# ----------------------------------------------------------------------------------------------------------


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """Operand dtype of the Triton backend's logits matmul: native on CUDA (fp32 accumulation and output in
    cuBLAS), fp32 on CPU (the same products and sums as that fp32-output GEMM, for testing the GPU path)."""
    if x.dtype == torch.float64:
        return torch.float64
    if x.device.type == "cuda":
        return x.dtype
    return torch.float32


def _cpu_bf16_matmul_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX), else fp32: without those units torch
    emulates bf16 GEMMs, measured at ~15 GFLOP/s against 100-140 for fp32 on an AVX2 CPU."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        native = False
    return torch.bfloat16 if native else torch.float32


# The matmul dtype of bf16 inputs on CPU (see tile_matmul_dtype); a module attribute so that the tests run
# both paths on any machine.
CPU_BF16_MATMUL = _cpu_bf16_matmul_dtype()


def tile_matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """Operand dtype of the torch backend's matmuls: the input dtype, except on CPU
    * fp16: fp32 (CPU fp16 GEMMs run 3-300x slower than fp32 ones);
    * bf16: ``CPU_BF16_MATMUL``, bf16 where the CPU has bf16 units, else fp32 (an emulated bf16 GEMM runs
      ~7x slower than an fp32 one). A bf16 GEMM accumulates in fp32 and rounds its result to bf16; an fp32
      GEMM of the same bf16 operands forms the same exact products and sums and keeps the fp32 result.
    Outputs (log-probs, gradients) keep their dtypes either way."""
    if x.device.type == "cuda":
        return x.dtype
    if x.dtype == torch.float16:
        return torch.float32
    if x.dtype == torch.bfloat16:
        return CPU_BF16_MATMUL
    return x.dtype


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mm_acc_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out = a @ b, out in the accumulation dtype (fp32). On CUDA the GEMM writes fp32 itself (``out_dtype``)
    even from bf16 operands: no low-precision product to round, and no copy into out."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except (RuntimeError, TypeError):  # a torch without the fp32-output GEMM
            pass
    return out.copy_(a @ b)


def addmm_acc_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total += a @ b, total in the accumulation dtype (fp32). On CUDA one GEMM accumulates into total
    (beta = 1) even from bf16 operands: no fresh [M, N] product per call."""
    if a.dtype == total.dtype:
        return total.addmm_(a, b)
    if a.is_cuda:
        try:
            return torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
        except (RuntimeError, TypeError):
            pass
    return total.add_(a @ b)


# -inf logits are clamped to this value: exp() of it is exactly 0, and products with any gradient stay finite
NEG_LOGIT = -1.0e30
LOG2E = 1.4426950408889634


def exp_(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x) into ``out`` (default: in place), computed as 2^(x log2 e).

    On CPU torch's fp32 exp2 runs ~1.8x faster than its exp (2-core AVX2: 3.1 against 5.6 ms for a
    [3584, 1536] tile), enough to pay for the extra multiply pass. Rounding log2 e and x log2 e to fp32 adds
    a relative error under |x| 2^-23 to the result: the tiles exponentiate x = z - max <= 0, where p = e^x
    is negligible long before that matters (e^x |x| 2^-23 <= 4.4e-8)."""
    return torch.mul(x, LOG2E, out=x if out is None else out).exp2_()


def _bmm_rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) for [c, V] tensors without a [c, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class ChunkEngine:
    """The per-chunk work shared by ``fused_logprobs`` and ``fused_linear_policy_loss``.

    Holds one (two with entropy) reusable [chunk, V] fp32 workspace(s), so no chunk allocates or page-faults
    fresh memory. ``forward(s, e)`` forms the logits of tokens [s, e) and returns
    (logprob, entropy | None, lse, E_p[z]); ``grad(g_lp, g_ent)`` then turns the loss gradients w.r.t. the
    log-prob / entropy of the same chunk into d loss / d logits (in the workspace), and
    ``accumulate(dz, s, e, dh, dw, db)`` runs the two backward matmuls (dW accumulated in fp32).

    Torch backend, no entropy: the logits buffer is exponentiated in place (p = e / sum e), so one [c, V]
    buffer and about five passes over it cover forward and gradient. With entropy, a second buffer keeps
    z - max. Triton backend: the row kernels read the logits and write the gradient in place.

    ``kept`` (optional, [k, V] in the accumulation dtype, k a multiple of the chunk): the logits (bias
    included) of chunk rows [0, k), written by ``forward`` when ``fill`` and read back in place of their
    product otherwise (the backward pass).
    """

    def __init__(
        self,
        hidden,
        weight,
        bias,
        y,
        valid,
        inv_t,
        *,
        chunk,
        backend,
        need_ent,
        unit_temperature,
        index=None,
        kept=None,
        fill=False,
    ):
        # ``index``: optional sorted token ids to compute (padding / ignored tokens are skipped entirely:
        # no logits, no matmul rows); chunk positions k0:k1 then refer to index[k0:k1].
        self.hidden, self.bias, self.y, self.valid, self.inv_t = hidden, bias, y, valid, inv_t
        self.index, self.kept, self.fill = index, kept, fill
        self.backend, self.need_ent = backend, need_ent
        self.acc = acc_dtype(hidden)
        self.mm = matmul_dtype(hidden)
        self.w_mm = weight if weight.dtype == self.mm else weight.to(self.mm)
        self.scale = not unit_temperature
        # -inf bias entries (masked vocabulary) or a low-precision matmul output need clamping to stay finite
        self.clamp = self.mm != self.acc or (bias is not None and bool(torch.isinf(bias).any()))
        self.bias_acc = None if bias is None else bias.to(self.acc)
        c = max(1, min(chunk, hidden.shape[0]))
        V = weight.shape[0]
        dev = hidden.device
        self.zbuf = torch.empty(c, V, dtype=self.acc, device=dev)
        self.ebuf = (
            torch.empty(c, V, dtype=self.acc, device=dev) if (need_ent and backend == "torch") else None
        )
        # Triton writes d logits straight in the matmul dtype (bf16 on GPU): no separate cast pass
        self.dzbuf = None
        if backend == "triton" and self.mm != self.acc:
            self.dzbuf = torch.empty(c, V, dtype=self.mm, device=dev)

    def _select(self, s: int, e: int):
        if self.index is None:
            sl = slice(s, e)
            return None, self.hidden[sl], self.y[sl], self.valid[sl], self.inv_t[sl]
        idx = self.index[s:e]
        return idx, self.hidden.index_select(0, idx), self.y[idx], self.valid[idx], self.inv_t[idx]

    def logits(self, h: torch.Tensor, s: int = 0) -> torch.Tensor:
        """fp32 (fp64) logits (bias included) of the chunk of rows [s, s + len(h))."""
        z = self.zbuf[: h.shape[0]]
        e, k = s + h.shape[0], 0 if self.kept is None else self.kept.shape[0]
        if e <= k and not self.fill:
            return z.copy_(self.kept[s:e])
        if self.mm == self.acc:
            # on CPU in vocabulary blocks: a [c, H] x [H, V] product with V in the tens of thousands packs
            # ~10 MiB of the weight and ran ~1.5x slower than the same product in LOGITS_BLOCK-column blocks
            h, V = h.to(self.mm), z.shape[1]
            step = LOGITS_BLOCK if z.device.type == "cpu" else max(V, 1)
            for v0 in range(0, V, step):
                torch.mm(h, self.w_mm[v0 : v0 + step].t(), out=z[:, v0 : v0 + step])
        else:
            mm_acc_(z, h.to(self.mm), self.w_mm.t())
        if self.bias_acc is not None:
            z.add_(self.bias_acc)
        if self.fill and e <= k:
            self.kept[s:e].copy_(z)
        return z

    def forward(self, s: int, e: int, need_ent: bool | None = None):
        need_ent = self.need_ent if need_ent is None else need_ent
        idx, h, y, valid, inv_t = self._select(s, e)
        self._start = s
        z = self.logits(h, s)
        self._cur = (idx, h, y, inv_t)
        if self.backend == "triton":
            lp, ent, stats = row_stats_triton(z, y, inv_t, valid, need_ent)
            self._state = (z, stats)
            m, log_s, ts = stats
            return lp, ent, m + log_s, m + ts
        if self.scale:
            z.mul_(inv_t.unsqueeze(-1))
        if self.clamp:
            z.clamp_(min=NEG_LOGIT)
        m = z.amax(dim=-1, keepdim=True)
        zy = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        z.sub_(m)
        m = m.squeeze(-1)
        if need_ent and self.ebuf is not None:
            ebuf = self.ebuf[: e - s]
            exp_(z, out=ebuf)
            sum_e = ebuf.sum(-1)
            pzm = _bmm_rowdot(ebuf, z) / sum_e  # E_p[z - m]
            ent = torch.log(sum_e) - pzm
            self._state = ("ent", z, ebuf, sum_e, pzm)
        else:
            sum_e = exp_(z).sum(-1)
            pzm = torch.zeros_like(sum_e)
            ent = None
            self._state = ("noent", z, sum_e)
        log_s = torch.log(sum_e)
        lse = m + log_s
        lp = (zy - m) - log_s  # relative to the max: no rounding at the magnitude of the logits
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        lp = torch.where(valid, lp, zero)
        if ent is not None:
            ent = torch.where(valid, ent, zero)
        return lp, ent, lse, pzm + m

    def grad(self, g_lp: torch.Tensor, g_ent: torch.Tensor | None) -> torch.Tensor:
        """d loss / d raw logits of the last ``forward`` chunk (overwrites the workspace)."""
        _, _, y, inv_t = self._cur
        g_lp = g_lp.to(self.acc)
        if self.backend == "triton":
            z, stats = self._state
            out = None if self.dzbuf is None else self.dzbuf[: z.shape[0]]
            return row_grad_triton(z, y, inv_t, stats, g_lp, g_ent, out=out)
        if self._state[0] == "ent":
            _, zm, p, sum_e, pzm = self._state
            p.mul_((1.0 / sum_e).unsqueeze(-1))
            if g_ent is not None:
                # dz = -g_lp p - g_H p (z - E_p[z]) + g_lp onehot  (z - E_p[z] = zm - pzm)
                g_ent = g_ent.to(self.acc)
                zm.sub_(pzm.unsqueeze(-1)).mul_(-g_ent.unsqueeze(-1)).sub_(g_lp.unsqueeze(-1)).mul_(p)
                dz = zm
            else:
                dz = p.mul_(-g_lp.unsqueeze(-1))
        else:
            if g_ent is not None:
                raise RuntimeError("entropy gradient requested from a chunk computed without entropy")
            _, ez, sum_e = self._state
            dz = ez.mul_((-g_lp / sum_e).unsqueeze(-1))
        dz.scatter_add_(-1, y.unsqueeze(-1), g_lp.unsqueeze(-1))
        if self.scale:
            dz.mul_(inv_t.unsqueeze(-1))
        return dz

    def accumulate(self, dz, dh, dw, db):
        """For the last chunk: dh[rows] = dz @ W, dw += dz^T h (fp32), db += sum(dz).

        With an ``index``, dh must be zero-initialised (skipped rows get no gradient)."""
        idx, h, _, _ = self._cur
        if db is not None:
            db += dz.sum(0, dtype=self.acc)
        dzm = dz if dz.dtype == self.mm else dz.to(self.mm)
        if dh is not None:
            if idx is not None:
                dh.index_copy_(0, idx, (dzm @ self.w_mm).to(dh.dtype))
            elif dh.dtype == self.mm:
                s = self._start
                torch.mm(dzm, self.w_mm, out=dh[s : s + dz.shape[0]])
            else:
                s = self._start
                dh[s : s + dz.shape[0]] = (dzm @ self.w_mm).to(dh.dtype)
        if dw is not None:
            h = h if h.dtype == self.mm else h.to(self.mm)
            addmm_acc_(dw, dzm.t(), h)


# ----------------------------------------------------------------------------------------------------------
# torch backend: [tokens x vocabulary] tiles, statistics pass then gradient pass
# ----------------------------------------------------------------------------------------------------------

# Bytes of one [tokens, vocabulary] tile of the torch backend (its fp32 logits, the entropy buffer and the
# low-precision matmul output together), per op and device. Larger tiles mean fewer, larger ops (on a loaded
# CPU every parallel op also waits for a scheduler slice, so ~15 passes per tile add up); smaller tiles a
# smaller working set. fused_logprobs: 128 MiB on CPU, like the Triton path's chunks. The loss op
# (fused_linear_policy_loss) runs its gradient pass inside the forward, next to the weight gradient it
# returns: 32 MiB on CPU (bf16, N=4096 V=32768 H=1024: a 141 MiB peak in all, Liger-Kernel 282-339 MiB;
# 48 MiB tiles cost 16 MiB more, 24 MiB ones ran ~15% slower) keeps its working set near half of
# Liger-Kernel's. On a GPU a tile spans the whole vocabulary of a chunk.
TILE_BYTES = {
    "logprobs": {"cpu": 128 * 2**20, "cuda": 1024 * 2**20},
    "loss": {"cpu": 32 * 2**20, "cuda": 1024 * 2**20},
}
DH_ROWS = 512  # tokens per partial hidden-gradient product of a bf16 tile (its buffers: 3 MiB at H = 1024)
# fp32 (fp64) weights in the loss op: tiles of at most TOKEN_TILE_ROWS tokens x LOGITS_BLOCK columns on CPU
# (GRPO, N=4096 V=151936 H=1024, 2-core CPU: 614 MiB in 36 s, against 652 MiB in 33 s for 3584 x 2304
# tiles, vocabulary outside, with [n, H] buffers of the gathered rows and their gradient)
TOKEN_TILE_ROWS = 256
# Bytes of logits the torch backend keeps from the forward for the backward (``keep_logits_bytes``): a kept
# column block skips its recomputation, the one product of the four (logits, logits again, dh, dW) that
# the unfused path does not run. On a 2-core CPU (~120 GFLOP/s) keeping all of N=4096 V=32768 H=1024
# took the op from 8.45 to 6.62 s (benchmarks/bench_gemm_floor.py), for 512 MiB of host memory; on a GPU
# that memory holds the model and its activations, and the product is fast, so nothing is kept by default.
KEEP_LOGITS_BYTES = {"cpu": 512 * 2**20, "cuda": 0}
TILE_MIN_VOCAB = 256  # a tile holds every token when that leaves at least this many vocabulary columns
VOCAB_ALIGN = 64  # vocabulary tiles are multiples of this (below it, any size: the tests use tiny tiles)


def tile_shape(n: int, V: int, chunk: int, elem_bytes: int, budget: int) -> tuple[int, int]:
    """(tokens, vocabulary columns) of one tile within ``budget`` bytes, ``chunk`` tokens at most.

    Tokens first: when a tile holds all n tokens, each block's weight gradient is one matmul over every token
    (no accumulation across tiles) and the hidden rows are gathered once."""
    elems = max(1, budget // elem_bytes)
    c = max(1, min(n, chunk, max(1, elems // min(V, TILE_MIN_VOCAB))))
    vb = max(1, elems // c)
    if vb >= V:
        return c, V
    return c, (vb // VOCAB_ALIGN * VOCAB_ALIGN if vb >= VOCAB_ALIGN else vb)


def _ptr(t: torch.Tensor | None, n: int, dtype: torch.dtype = torch.float32) -> int | None:
    """The address of a contiguous CPU tensor of ``n`` elements of ``dtype`` (None for None), for the host
    library, which reads raw memory."""
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n or t.dtype != dtype:
        raise ValueError(
            f"host kernels take contiguous CPU {dtype} tensors of {n} elements, got {t.dtype} {list(t.shape)}"
        )
    return t.data_ptr()


def _host_tile(z: torch.Tensor) -> tuple[int, int, int]:
    if z.dtype != torch.bfloat16 or z.dim() != 2 or z.stride(1) != 1 or z.device.type != "cpu":
        raise ValueError(f"host kernels take a [c, w] bf16 CPU tile with unit column stride, got {z.dtype}")
    return z.shape[0], z.shape[1], z.stride(0)


def host_tile_stats(lib, z, inv_t, m, s, t=None) -> None:
    """One more vocabulary block of the online softmax statistics, in the host library (in place).

    z [c, w] bf16: raw logits (x = z * inv_t, ``inv_t`` [c] fp32 or None for 1). m, s, t [c] fp32: the
    running max, sum exp(x - m) and sum exp(x - m) (x - m) (``t`` optional), as ``TiledLinearSoftmax.stats``
    keeps them. One pass over z: csrc/softmax_tile_host.cc."""
    c, w, ld = _host_tile(z)
    lib.bitrl_tile_stats_bf16(
        z.data_ptr(), c, w, ld, _ptr(inv_t, c), _ptr(m, c), _ptr(s, c), _ptr(t, c), torch.get_num_threads()
    )


def host_tile_grad(lib, z, inv_t, m, log_s, a, b, c_target, target) -> torch.Tensor:
    """d loss / d logits of one tile, written over its bf16 logits z [c, w] by the host library; returns z.

    With x = z * inv_t (``inv_t`` [c] or None) and log p = (x - m) - log_s: dz = p (a log p + b), plus
    ``c_target`` at column ``target`` (int64, -1 for none). m, log_s, a (None: 0), b, c_target: [c] fp32."""
    c, w, ld = _host_tile(z)
    lib.bitrl_tile_grad_bf16(
        z.data_ptr(),
        c,
        w,
        ld,
        _ptr(inv_t, c),
        _ptr(m, c),
        _ptr(log_s, c),
        _ptr(a, c),
        _ptr(b, c),
        _ptr(c_target, c),
        _ptr(target, c, torch.int64),
        torch.get_num_threads(),
    )
    return z


class TiledLinearSoftmax:
    """The torch backend of ``fused_logprobs`` and ``fused_linear_policy_loss``.

    The [n, V] logits are visited in [c, vb] tiles, twice. Low-precision weights: vocabulary blocks outside,
    token chunks inside, so that each block's weight gradient is written once in its dtype. fp32 (fp64)
    weights: token tiles outside, so that each tile's rows are gathered once and its hidden gradient is
    written once, while dW is accumulated in place (no [n, H] buffer; small tiles on CPU):

    * ``stats()``: an online log-sum-exp over the vocabulary blocks (running max, sum exp, sum p*z per token),
      giving log-prob, entropy, log-sum-exp and lse - E_p[z] (the unmasked row's entropy) for every token;
    * ``grad(g_lp, g_ent, lse, gap)``: each tile's logits are recomputed, turned into
      dz = (g_lp (onehot - p) - g_H p (z - E_p[z])) / T and multiplied at once:
      dW[block] (+)= dz^T h, dh[chunk] += dz W[block], db[block] += sum(dz).

    Nothing is larger than a tile except the outputs and, for low-precision weights, the gathered hidden rows
    and a [n, H] fp32 hidden-gradient accumulator: the weight gradient is written block by block in its dtype.
    ``kept`` (optional, [n, k] in the matmul dtype): the raw products h W^T of vocabulary columns [0, k),
    written by ``stats()`` and read by ``grad()`` in place of their recomputation (the same values).

    Numerics: fp32 and fp64 inputs multiply in their dtype. bf16 inputs multiply in bf16 (the GEMM
    accumulates in fp32; its [c, vb] logits come out rounded to bf16, as in an unfused bf16 forward, and are
    upcast to fp32 at once for the softmax statistics and dz, which are fp32). dz is rounded to bf16 for the
    two backward matmuls, as the unfused bf16 backward's d logits are. Each block's dW is one bf16 matmul
    over all tokens of the tile, rounded once (when a tile cannot hold every token - beyond ~16k tokens at the
    default budget - the block is summed by fp32 matmuls into an fp32 buffer and rounded once), and each
    block's partial dh (rounded to bf16 by the matmul) is added into an fp32 accumulator: nothing is summed in
    bf16 across tiles. fp16 on CPU, and bf16 on a CPU without bf16 units (``CPU_BF16_MATMUL``), multiply in
    fp32: the same exact products and fp32 sums, without the roundings to bf16; each dW block is summed in a
    one-block fp32 buffer and rounded once to the weight's dtype, dh is summed in fp32 and rounded once.

    bf16 GEMMs without a bias or clamping, while one tile holds every token: the softmax passes run in the
    host library where it builds (``host_tile_stats``, ``host_tile_grad``: one pass over the bf16 tile
    each, the same fp32 arithmetic in registers, dz rounded once to bf16), and a tile is its bf16 logits
    alone; elsewhere, or with ``BITRL_HOST_EXT=0``, the torch formula above.
    """

    def __init__(
        self,
        hidden,
        weight,
        bias,
        y,
        valid,
        inv_t,
        *,
        chunk,
        need_ent,
        unit_temperature,
        op,
        index=None,
        kept=None,
    ):
        """``op``: "logprobs" or "loss", whose ``TILE_BYTES`` budget sizes the tiles."""
        self.hidden, self.weight = hidden, weight
        self.index, self.kept = index, kept
        self.acc = acc_dtype(hidden)
        self.mm = tile_matmul_dtype(hidden)
        sel = (lambda x: x) if index is None else (lambda x: x[index])
        self.y, self.valid, self.inv_t = sel(y), sel(valid), sel(inv_t).to(self.acc).contiguous()
        self.n = hidden.shape[0] if index is None else index.numel()
        self.scale = not unit_temperature
        # -inf bias entries (masked vocabulary) or an fp16 matmul output (overflow to inf) need clamping
        self.clamp = self.mm == torch.float16 or (bias is not None and bool(torch.isinf(bias).any()))
        self.bias = None if bias is None else bias.to(self.acc)
        self.chunk, self.op = chunk, op
        # bf16 tiles on CPU, nothing but a temperature applied: the host library's one-pass softmax kernels
        fusable = self.mm == torch.bfloat16 and self.acc == torch.float32 and not self.clamp and bias is None
        self.host_lib = host_ext.load_host_library() if fusable and hidden.device.type == "cpu" else None
        self.h_all = None
        self.retile(need_ent)

    def retile(self, need_ent: bool) -> None:
        """Size the tiles and their buffers for a pass with or without the entropy terms (a gradient pass
        that needs no entropy gets larger tiles from the same budget)."""
        self.need_ent = need_ent
        self.zbuf = self.ebuf = self.lowbuf = None  # free the old buffers before allocating the new ones
        low = 0 if self.mm == self.acc else torch.finfo(self.mm).bits // 8
        acc_bytes = torch.finfo(self.acc).bits // 8
        budget = device_budget(TILE_BYTES[self.op], self.hidden.device)
        # the host kernels work on the bf16 tile alone, while one tile holds every token (dW blocks summed
        # over token tiles need dz in fp32)
        self.host = self.host_lib
        if self.host is not None:
            self.c, self.vb = tile_shape(self.n, self.weight.shape[0], self.chunk, low, budget)
            self.host = self.host if self.c >= self.n else None
        if self.host is None:
            elem = acc_bytes * (2 if need_ent else 1) + low
            self.c, self.vb = tile_shape(self.n, self.weight.shape[0], self.chunk, elem, budget)
        self.tokens_outer = self.mm == self.acc and self.weight.dtype == self.acc
        if self.tokens_outer and self.op == "loss" and self.hidden.device.type == "cpu":
            # the loss op's working set sits next to its outputs; fused_logprobs keeps its larger tiles (its
            # peak is 0.06-0.14x its peers' already, and its time is in its 4 GEMMs either way)
            self.c, self.vb = min(self.c, TOKEN_TILE_ROWS), min(self.vb, LOGITS_BLOCK)
        dev = self.hidden.device
        size = self.c * self.vb
        self.zbuf = None if self.host else torch.empty(size, dtype=self.acc, device=dev)
        self.ebuf = torch.empty(size, dtype=self.acc, device=dev) if need_ent and not self.host else None
        self.lowbuf = torch.empty(size, dtype=self.mm, device=dev) if low else None
        # one tile of tokens: gather the rows once
        gather_once = self.c >= self.n and (self.index is not None or self.hidden.dtype != self.mm)
        if not gather_once:
            self.h_all = None
        elif self.h_all is None:
            self.h_all = self._gather(0, self.n)

    def _gather(self, k0: int, k1: int) -> torch.Tensor:
        h = self.hidden[k0:k1] if self.index is None else self.hidden.index_select(0, self.index[k0:k1])
        return h if h.dtype == self.mm else h.to(self.mm)

    def _rows(self, k0: int, k1: int) -> torch.Tensor:
        return self._gather(k0, k1) if self.h_all is None else self.h_all[k0:k1]

    def _tiles(self):
        """(k0, k1, v0, v1, h, wb) of every tile in the pass order, the token rows and weight block fetched
        once per run of tiles that share them."""
        n, V = self.n, self.weight.shape[0]
        tokens = [(k0, min(n, k0 + self.c)) for k0 in range(0, n, self.c)]
        vocab = [(v0, min(V, v0 + self.vb)) for v0 in range(0, V, self.vb)]
        order = (
            [(k, v) for k in tokens for v in vocab]
            if self.tokens_outer
            else [(k, v) for v in vocab for k in tokens]
        )
        h = wb = rows = block = None
        for (k0, k1), (v0, v1) in order:
            if rows != (k0, k1):
                h = None  # release the previous rows first
                h, rows = self._rows(k0, k1), (k0, k1)
            if block != (v0, v1):
                wb = None
                wb, block = self._block(v0, v1), (v0, v1)
            yield k0, k1, v0, v1, h, wb

    def _block(self, v0: int, v1: int) -> torch.Tensor:
        w = self.weight[v0:v1]
        return w if w.dtype == self.mm else w.to(self.mm)

    def _product(self, h, wb, k0, k1, v0, v1, out, fill):
        """out [c, w] = h @ wb^T, the tile's raw logits in the matmul dtype. Columns held in ``kept`` are
        written there (``fill``, the statistics pass) or read from it (the gradient pass)."""
        w = v1 - v0
        k = 0 if self.kept is None else min(w, max(0, self.kept.shape[1] - v0))
        if fill or k == 0:
            torch.mm(h, wb.t(), out=out)
            if k:
                self.kept[k0:k1, v0 : v0 + k].copy_(out[:, :k])
            return out
        out[:, :k].copy_(self.kept[k0:k1, v0 : v0 + k])
        if k < w:  # a block across the kept edge: multiply the rest
            torch.mm(h, wb[k:].t(), out=out[:, k:])
        return out

    def _logits(self, h, wb, v0, v1, k0, k1, shift=None, fill=False):
        """fp32 (fp64) logits of tokens [k0, k1) and vocabulary [v0, v1), scaled by 1/T, clamped, minus the
        per-token shifts when given: ``shift`` [k, c], its rows subtracted one after the other (the row max
        first: z - max is exact near the max, where p is not negligible)."""
        c, w = k1 - k0, v1 - v0
        z = self.zbuf[: c * w].view(c, w)
        src = z if self.lowbuf is None else self.lowbuf[: c * w].view(c, w)
        self._product(h, wb, k0, k1, v0, v1, src, fill)
        # upcast first, then work in place: an op mixing the bf16 tile with fp32 operands would make a fp32
        # temporary of the whole tile on CPU (one more allocation and pass per tile)
        if src is not z:
            z.copy_(src)
        if self.bias is not None:
            z.add_(self.bias[v0:v1])
        elif self.scale:
            z.mul_(self.inv_t[k0:k1].unsqueeze(-1))
        if self.bias is not None and self.scale:
            z.mul_(self.inv_t[k0:k1].unsqueeze(-1))
        if self.clamp:
            z.clamp_(min=NEG_LOGIT)
        for row in () if shift is None else shift:
            z.sub_(row.unsqueeze(-1))
        return z

    def _low_logits(self, h, wb, k0, k1, v0, v1):
        """The tile's logits in the low-precision matmul dtype when nothing else applies to them (no bias,
        temperature 1, no clamping), else None (no matmul run). Statistics pass only."""
        if self.lowbuf is None or self.bias is not None or self.scale or self.clamp:
            return None
        low = self.lowbuf[: h.shape[0] * wb.shape[0]].view(h.shape[0], wb.shape[0])
        return self._product(h, wb, k0, k1, v0, v1, low, fill=True)

    def _target_col(self, k0, k1, v0, v1):
        """(column of each token's target inside the block, clamped, and whether it lies in the block)."""
        yc = self.y[k0:k1]
        inb = (yc >= v0) & (yc < v1)
        return (yc - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1), inb

    def _host_stats(self, h, wb, k0, k1, v0, v1, col, inb, m, s, t, zy):
        """The statistics pass over one tile in the host library (one pass over the bf16 logits)."""
        c, w = k1 - k0, v1 - v0
        low = self._product(h, wb, k0, k1, v0, v1, self.lowbuf[: c * w].view(c, w), fill=True)
        z_y = low.gather(1, col).squeeze(1).to(self.acc)
        inv_t = self.inv_t[k0:k1] if self.scale else None
        zy[k0:k1] = torch.where(inb, z_y if inv_t is None else z_y * inv_t, zy[k0:k1])
        host_tile_stats(self.host, low, inv_t, m[k0:k1], s[k0:k1], None if t is None else t[k0:k1])

    def _host_grad(self, h, wb, k0, k1, v0, v1, col, inb, lse, coefs):
        """The tile's bf16 d loss / d logits from the host library (one pass over the bf16 logits)."""
        c, w = k1 - k0, v1 - v0
        low = self._product(h, wb, k0, k1, v0, v1, self.lowbuf[: c * w].view(c, w), fill=False)
        a, b, c_lp = (None if x is None else x[k0:k1] for x in coefs)
        inv_t = self.inv_t[k0:k1] if self.scale else None
        target = torch.where(inb, col.squeeze(1), -1)
        return host_tile_grad(self.host, low, inv_t, lse[0, k0:k1], lse[1, k0:k1], a, b, c_lp, target)

    def stats(self):
        """(lp, entropy | None, lse, lse - E_p[z]) over the active tokens, in the acc dtype: lp, entropy and
        the gap [n]; lse [2, n] = (row max m, log sum exp(z - m)), log-sum-exp = their sum, kept apart
        because at |z| ~ 1e3 the rounding of their fp32 sum alone would cost p a relative 1e-4 error."""
        n = self.n
        dev, acc = self.hidden.device, self.acc
        m = torch.full((n,), NEG_LOGIT, dtype=acc, device=dev)
        s = torch.zeros(n, dtype=acc, device=dev)
        t = torch.zeros(n, dtype=acc, device=dev)
        zy = torch.zeros(n, dtype=acc, device=dev)
        for k0, k1, v0, v1, h, wb in self._tiles():
            col, inb = self._target_col(k0, k1, v0, v1)
            m_old = m[k0:k1]
            if self.host is not None:
                self._host_stats(h, wb, k0, k1, v0, v1, col, inb, m, s, t if self.need_ent else None, zy)
                continue
            low = self._low_logits(h, wb, k0, k1, v0, v1)
            if low is not None:  # bf16 logits as they are: the max and the target are exact in bf16
                m_new = torch.maximum(m_old, low.amax(dim=1).to(acc))
                zy[k0:k1] = torch.where(inb, low.gather(1, col).squeeze(1).to(acc), zy[k0:k1])
                z = self.zbuf[: low.numel()].view_as(low)
                z.copy_(low).sub_(m_new.unsqueeze(-1))  # in place: no fp32 temporary of the tile
            else:
                z = self._logits(h, wb, v0, v1, k0, k1, fill=True)
                zy[k0:k1] = torch.where(inb, z.gather(1, col).squeeze(1), zy[k0:k1])
                m_new = torch.maximum(m_old, z.amax(dim=1))
                z.sub_(m_new.unsqueeze(-1))
            alpha = torch.exp(m_old - m_new)
            s_old = s[k0:k1]
            if self.need_ent:
                e = self.ebuf[: z.numel()].view_as(z)
                exp_(z, out=e)
                # sum p (z - m) relative to the running max, rescaled when the max moves
                t[k0:k1] = alpha * (t[k0:k1] + s_old * (m_old - m_new)) + _bmm_rowdot(e, z)
                s[k0:k1] = s_old * alpha + e.sum(1)
            else:
                s[k0:k1] = s_old * alpha + exp_(z).sum(1)
            m[k0:k1] = m_new
        log_s = torch.log(s)
        zero = torch.zeros((), dtype=acc, device=dev)
        lp = torch.where(self.valid, (zy - m) - log_s, zero)  # relative to the max: no rounding at |z|
        gap = log_s - t / s  # lse - E_p[z] without the max: no cancellation at large |z|
        ent = torch.where(self.valid, gap, zero) if self.need_ent else None
        return lp, ent, torch.stack((m, log_s)), gap

    def grad(self, g_lp, g_ent, lse, gap, *, need_h=True, need_w=True, need_b=False):
        """(dh [N, H] | None, dW [V, H] | None, db [V] fp32 | None), dh and dW in the inputs' dtypes.

        ``g_lp``, ``g_ent`` (or None), ``gap`` (lse - E_p[z]): [n] per active token; ``lse`` [2, n] (both
        from ``stats``). Rows that are not active get a zero hidden gradient."""
        n, (V, H) = self.n, self.weight.shape
        N = self.hidden.shape[0]
        dev, acc, mm = self.hidden.device, self.acc, self.mm
        g_lp = g_lp.to(acc)
        g_ent = None if g_ent is None else g_ent.to(acc)
        # dh: accumulated across vocabulary blocks in fp32 (fp64): in place when the output is fp32 (fp64) and
        # every row is active; with inactive rows, per token tile in a [c, H] buffer written to its rows once
        # (fp32 weights, tokens outside); else (bf16) in an [n, H] accumulator of the active rows from which
        # the [N, H] output is made at the end, once the tiles are released (index_add_ into the output
        # instead runs at ~60 ms per [512, 1024] block on CPU, a fifth of the whole op)
        dh = dh_acc = dh_part = dh_part32 = dh_tile = None
        if need_h and self.hidden.dtype == acc and self.index is None:
            dh = dh_acc = torch.zeros(N, H, dtype=acc, device=dev)
        elif need_h and self.tokens_outer:  # each token tile's rows summed in a [c, H] buffer, then written
            dh = torch.zeros(N, H, dtype=acc, device=dev)
            dh_tile = torch.empty(self.c, H, dtype=acc, device=dev)
        elif need_h:
            dh_acc = torch.zeros(n, H, dtype=acc, device=dev)
        if need_h and mm != acc:
            # each tile's partial dh, DH_ROWS tokens at a time: the bf16 product, upcast into an fp32 buffer,
            # added. Two small buffers for every tile: a fresh [c, H] temporary per tile (or a mixed-dtype
            # add, which makes one) costs tens of MiB at N = 8192 and fragments the heap
            rows = min(self.c, DH_ROWS)
            dh_part = torch.empty(rows, H, dtype=mm, device=dev)
            dh_part32 = torch.empty(rows, H, dtype=acc, device=dev)
        # dW: blocks written once; in place when it is fp32 (fp64), else (bf16, fp16) straight from one bf16
        # matmul over every token when a tile holds them all, or through a one-block fp32 buffer
        dw = dw_blk = None
        if need_w:
            dw = torch.zeros(V, H, dtype=self.weight.dtype, device=dev)
            if dw.dtype != acc and (mm == acc or n > self.c):
                dw_blk = torch.empty(self.vb, H, dtype=acc, device=dev)
        db = torch.zeros(V, dtype=acc, device=dev) if need_b else None
        if g_ent is None:
            # dz = -g p = -sign(g) exp(z - lse + log|g|), rows scaled by 1/T: one exp pass and one multiply
            # (the multiply also writes the low-precision copy for the matmuls). The row max is subtracted
            # first (exact near it); the rest of the shift joins the multiply by log2 e of ``exp_``.
            shift = lse[:1]
            tail = (torch.log(g_lp.abs()) - lse[1]) * LOG2E
            factor = -torch.sign(g_lp)
            onehot = -g_lp.abs()  # added at the target before the multiply: factor * (-|g|) = g
        else:
            # dz = p (-g_lp - g_H (z - E_p[z])) = p (a (z - lse) + b),
            # a = -g_H, b = -g_H (lse - E_p[z]) - g_lp
            shift, factor = lse, None
            a_ent, b_ent = -g_ent, -g_ent * gap - g_lp
        if self.scale:
            factor = self.inv_t if factor is None else factor * self.inv_t
        if self.host is not None:
            # the same dz as p (a log p + b) + g_lp onehot (a = 0, b = -g_lp without entropy), all times 1/T
            inv_t = self.inv_t if self.scale else 1.0
            a = None if g_ent is None else a_ent * inv_t
            coefs = (a, (-g_lp if g_ent is None else b_ent) * inv_t, g_lp * inv_t)

        def end_block(block):  # the one-block fp32 dW buffer, rounded once
            if dw_blk is not None and block is not None:
                dw[block[0] : block[1]] = dw_blk[: block[1] - block[0]]

        def end_rows(rows):  # the token tile's hidden gradient, to its rows
            if dh_tile is not None and rows is not None:
                dh.index_copy_(0, self.index[rows[0] : rows[1]], dh_tile[: rows[1] - rows[0]])

        rows = block = None  # the token tile and the vocabulary block being summed
        for k0, k1, v0, v1, h, wb in self._tiles():
            if block != (v0, v1):
                end_block(block)
                block = (v0, v1)
                if dw_blk is not None:
                    dw_blk.zero_()
            if rows != (k0, k1):
                end_rows(rows)
                rows = (k0, k1)
                if dh_tile is not None:
                    dh_tile.zero_()
            col, inb = self._target_col(k0, k1, v0, v1)
            if self.host is not None:  # the bf16 dz alone, written over the tile's logits
                dz, dzm = None, self._host_grad(h, wb, k0, k1, v0, v1, col, inb, lse, coefs)
            else:
                z = self._logits(h, wb, v0, v1, k0, k1, shift=shift[:, k0:k1])
                if g_ent is None:
                    dz = torch.add(tail[k0:k1].unsqueeze(-1), z, alpha=LOG2E, out=z).exp2_()
                    dz.scatter_add_(1, col, torch.where(inb, onehot[k0:k1], 0.0).unsqueeze(-1))
                else:
                    p = exp_(z, out=self.ebuf[: z.numel()].view_as(z))
                    ab = (b_ent[k0:k1].unsqueeze(-1), z, a_ent[k0:k1].unsqueeze(-1))
                    dz = torch.addcmul(*ab, out=z).mul_(p)  # two passes
                    dz.scatter_add_(1, col, torch.where(inb, g_lp[k0:k1], 0.0).unsqueeze(-1))
                f = None if factor is None else factor[k0:k1].unsqueeze(-1)
                if self.lowbuf is not None:
                    dzm = self.lowbuf[: dz.numel()].view_as(dz)
                    if f is not None:  # in fp32 in place (db and fp32 dW blocks read dz), then one rounding
                        dz.mul_(f)
                    dzm.copy_(dz)
                else:
                    dzm = dz if f is None else dz.mul_(f)
            if db is not None:
                db[v0:v1] += dz.sum(0)
            if dw is not None:
                if dw.dtype == acc:
                    dw[v0:v1].addmm_(dzm.t(), h)
                elif dw_blk is None:  # one token chunk: the matmul sums every token, one rounding
                    torch.mm(dzm.t(), h, out=dw[v0:v1])
                else:  # fp32 products and sums, one rounding per block
                    dw_blk[: v1 - v0].addmm_(dz.t(), h.to(acc))
            if dh_part is not None:
                for r0 in range(k0, k1, DH_ROWS):
                    r1 = min(k1, r0 + DH_ROWS)
                    part = torch.mm(dzm[r0 - k0 : r1 - k0], wb, out=dh_part[: r1 - r0])
                    dh_acc[r0:r1] += dh_part32[: r1 - r0].copy_(part)
            elif dh_tile is not None:
                dh_tile[: k1 - k0].addmm_(dzm, wb)
            elif dh_acc is not None:
                dh_acc[k0:k1].addmm_(dzm, wb)
        end_block(block)
        end_rows(rows)
        if dh_acc is not None and dh is None:
            # the last pass: release the tiles before the output is made, in row blocks, from its
            # accumulator (no [n, H] temporary beside the two)
            self.zbuf = self.ebuf = self.lowbuf = self.h_all = None
            dh_part = dh_part32 = h = z = dz = dzm = p = part = None  # the views that keep them alive
            # inactive rows stay zero when only some rows are active
            out = self.hidden.dtype
            dh = (torch.empty if self.index is None else torch.zeros)(N, H, dtype=out, device=dev)
            for r0 in range(0, n, DH_ROWS):
                r1 = min(n, r0 + DH_ROWS)
                if self.index is None:
                    dh[r0:r1].copy_(dh_acc[r0:r1])
                else:
                    dh.index_copy_(0, self.index[r0:r1], dh_acc[r0:r1].to(out))
        return dh, dw, db


# ----------------------------------------------------------------------------------------------------------
# Triton kernels: per-row online log-sum-exp over vocabulary tiles, and the in-place gradient
# ----------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _logprob_rows_fwd_kernel(
        Z,
        stride_z,
        INV_T,
        Y,
        VALID,
        LP,
        ENT,
        MAX,
        LOGS,
        TS,
        V,
        BLOCK_V: tl.constexpr,
    ):
        # Online log-sum-exp over vocabulary tiles, all relative to the running max m for accuracy:
        # s = sum exp(z - m), t = sum exp(z - m) (z - m); lp = (z_y - m) - log s, H = log s - t / s.
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        y = tl.load(Y + row)
        inv_t = tl.load(INV_T + row)
        valid = tl.load(VALID + row)
        neg = -1.0e30
        m = neg
        s = 0.0
        t = 0.0
        zy = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inb = cols < V
            z = tl.load(z_row + cols, mask=inb, other=0.0).to(tl.float32) * inv_t
            # -inf logits to -1e30 (p = 0 exactly, no inf - inf); a comparison keeps NaN, tl.maximum drops it
            z = tl.where(inb, tl.where(z < neg, neg, z), neg)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            scale = tl.exp(m - m_new)
            zc = z - m_new
            e = tl.where(inb, tl.exp(zc), 0.0)
            t = scale * (t + s * (m - m_new)) + tl.sum(e * zc, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            zy += tl.sum(tl.where(cols == y, z, 0.0), axis=0)
            m = m_new
        log_s = tl.log(s)
        ts = t / s
        lp = tl.where(valid != 0, (zy - m) - log_s, 0.0)
        ent = tl.where(valid != 0, log_s - ts, 0.0)
        tl.store(LP + row, lp)
        tl.store(ENT + row, ent)
        tl.store(MAX + row, m)
        tl.store(LOGS + row, log_s)
        tl.store(TS + row, ts)

    @triton.jit
    def _logprob_rows_bwd_kernel(
        Z,
        stride_z,
        DZ,
        stride_dz,
        INV_T,
        Y,
        MAX,
        LOGS,
        TS,
        GLP,
        GENT,
        V,
        HAS_GENT: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        dz_row = DZ + row * stride_dz
        y = tl.load(Y + row)
        inv_t = tl.load(INV_T + row)
        m = tl.load(MAX + row)
        log_s = tl.load(LOGS + row)
        g_lp = tl.load(GLP + row)
        if HAS_GENT:
            g_ent = tl.load(GENT + row)
            ts = tl.load(TS + row)
        neg = -1.0e30
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            inb = cols < V
            z = tl.load(z_row + cols, mask=inb, other=0.0).to(tl.float32) * inv_t
            zc = tl.where(z < neg, neg, z) - m  # as in the forward: NaN stays NaN
            p = tl.exp(zc - log_s)
            dz = -g_lp * p
            if HAS_GENT:
                dz -= g_ent * p * (zc - ts)
            dz += tl.where(cols == y, g_lp, 0.0)
            dz = dz * inv_t
            tl.store(dz_row + cols, dz.to(DZ.dtype.element_ty), mask=inb)


BLOCK_V_MAX = 4096  # vocabulary tile of the row kernels (tests lower it to exercise the tile loop)
BLOCK_V_MIN = 1024  # smaller vocabularies mask part of one tile: three specializations cover every V


def _block_v(V: int) -> int:
    return min(BLOCK_V_MAX, max(BLOCK_V_MIN, next_pow2(V)))


def row_stats_triton(z, y, inv_t, valid, need_ent):
    """(lp [c], entropy [c] | None, stats) of the rows of z * inv_t; stats feed ``row_grad_triton``."""
    c, V = z.shape
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    lp = torch.empty(c, device=z.device, dtype=acc)
    ent = torch.empty_like(lp)
    m = torch.empty(c, device=z.device, dtype=torch.float32)
    log_s = torch.empty_like(m)
    ts = torch.empty_like(m)
    if c:
        _logprob_rows_fwd_kernel[(c,)](
            z,
            z.stride(0),
            inv_t.to(torch.float32).contiguous(),
            y.contiguous(),
            valid.to(torch.int8).contiguous(),
            lp,
            ent,
            m,
            log_s,
            ts,
            V,
            BLOCK_V=_block_v(V),
        )
    return lp, (ent if need_ent else None), (m, log_s, ts)


def row_grad_triton(z, y, inv_t, stats, g_lp, g_ent, out=None):
    """d loss / d logits, written into ``out`` (any float dtype, e.g. bf16 for the next matmuls) or ``z``.

    ``stats`` = (row max, log sum exp(z - max), E_p[z - max]) from ``row_stats_triton``.
    """
    m, log_s, ts = stats
    c, V = z.shape
    out = z if out is None else out
    if c:
        _logprob_rows_bwd_kernel[(c,)](
            z,
            z.stride(0),
            out,
            out.stride(0),
            inv_t.to(torch.float32).contiguous(),
            y.contiguous(),
            m.contiguous(),
            log_s.contiguous(),
            ts.contiguous(),
            g_lp.to(torch.float32).contiguous(),
            (g_ent if g_ent is not None else g_lp).to(torch.float32).contiguous(),
            V,
            HAS_GENT=g_ent is not None,
            BLOCK_V=_block_v(V),
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# validation shared by fused_logprobs and fused_linear_policy_loss
# ----------------------------------------------------------------------------------------------------------


def validate_linear_inputs(hidden, weight, targets, bias, temperature, *, check_finite=True):
    """Validate (hidden [N, H], weight [V, H], targets [N], bias [V]?, temperature float | [N]).

    Returns (inv_t [N] in the accumulation dtype, valid-target predicate inputs unchanged).
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    N, H = hidden.shape
    check_tensor("weight", weight, shape=(None, H), dtypes=FLOAT_DTYPES)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected dtype {hidden.dtype} (the dtype of hidden), got {weight.dtype}")
    V = weight.shape[0]
    if V == 0:
        raise ValueError("weight: vocabulary size is 0")
    check_tensor("targets", targets, shape=(N,), dtypes=(torch.int64, torch.int32))
    check_same_device("hidden", hidden, weight=weight, targets=targets, bias=bias)
    if bias is not None:
        check_tensor("bias", bias, shape=(V,), dtypes=FLOAT_DTYPES)
    acc = acc_dtype(hidden)
    if isinstance(temperature, torch.Tensor):
        check_tensor("temperature", temperature, shape=(N,), dtypes=FLOAT_DTYPES, device=hidden.device)
        t = temperature.detach().to(acc)
        if check_finite and not bool(((t > 0) & torch.isfinite(t)).all()):
            raise ValueError("temperature: every per-token temperature must be finite and > 0")
        inv_t = 1.0 / t
    else:
        try:
            tf = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(
                f"temperature: expected a float or an [N] tensor, got {type(temperature).__name__}"
            ) from None
        if not (tf > 0 and tf != float("inf")):
            raise ValueError(f"temperature: must be finite and > 0, got {tf}")
        inv_t = torch.full((N,), 1.0 / tf, dtype=acc, device=hidden.device)
    return inv_t


def check_linear_outputs(outputs, hidden, weight, bias) -> None:
    """Raise ``ValueError`` naming the input when the op's outputs are not finite.

    Non-finite hidden states, LM-head weights or bias entries always reach the outputs (the log-sum-exp of a
    row sees every logit), so one check of the small outputs (one host sync) replaces scanning the [V, H]
    weight on every call; the inputs are scanned only to name the culprit once something is wrong.
    """
    if all(all_finite(o) for o in outputs if o is not None):
        return
    if not all_finite(hidden):
        raise ValueError("hidden: contains NaN or inf")
    if not all_finite(weight):
        raise ValueError("weight: contains NaN or inf")
    if bias is not None and bool((torch.isnan(bias) | (bias == float("inf"))).any()):
        raise ValueError("bias: contains NaN or +inf (-inf entries, which mask tokens, are allowed)")
    raise ValueError("the logits overflowed: hidden and weight are finite but their product is not")


# ----------------------------------------------------------------------------------------------------------
# autograd Function (torch and triton backends)
# ----------------------------------------------------------------------------------------------------------


class FusedLogprobsFunction(torch.autograd.Function):
    """Chunked hidden->log-prob/entropy; the backward recomputes the logits the forward did not keep.
    Returns (lp [N], entropy [N])."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, inv_t, ignore_index, need_ent, chunk, backend, unit_t, keep_bytes
    ):
        N, _ = hidden.shape
        acc = acc_dtype(hidden)
        valid = targets != ignore_index
        y = torch.where(valid, targets, torch.zeros_like(targets)).long()
        index = None if bool(valid.all()) else valid.nonzero().squeeze(1)  # skip ignored tokens entirely
        n = N if index is None else index.numel()
        lp = torch.zeros(N, dtype=acc, device=hidden.device)
        ent = torch.zeros(N if need_ent else 0, dtype=acc, device=hidden.device)
        stats = ()
        if backend == "torch":
            # vocabulary columns [0, k) of every active token
            mm = tile_matmul_dtype(hidden)
            k = min(weight.shape[0], keep_bytes // max(1, n * torch.finfo(mm).bits // 8))
            kept = torch.empty(n, k, dtype=mm, device=hidden.device) if k else None
            eng = TiledLinearSoftmax(
                hidden,
                weight,
                bias,
                y,
                valid,
                inv_t,
                chunk=chunk,
                need_ent=need_ent,
                unit_temperature=unit_t,
                op="logprobs",
                index=index,
                kept=kept,
            )
            lp_a, ent_a, lse, gap = eng.stats()
            rows = slice(None) if index is None else index
            lp[rows] = lp_a
            if need_ent:
                ent[rows] = ent_a
            stats = (lse, gap)  # the backward pass needs no forward recomputation
        else:
            # whole chunks of rows: each one is either kept or recomputed
            row_bytes = weight.shape[0] * torch.finfo(acc).bits // 8
            k = min(n, keep_bytes // (row_bytes * chunk) * chunk)
            kept = torch.empty(k, weight.shape[0], dtype=acc, device=hidden.device) if k else None
            eng = ChunkEngine(
                hidden,
                weight,
                bias,
                y,
                valid,
                inv_t,
                chunk=chunk,
                backend=backend,
                need_ent=need_ent,
                unit_temperature=unit_t,
                index=index,
                kept=kept,
                fill=True,
            )
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                lp_c, ent_c, _, _ = eng.forward(s, e)
                rows = slice(s, e) if index is None else index[s:e]
                lp[rows] = lp_c
                if need_ent:
                    ent[rows] = ent_c
        del eng
        ctx.save_for_backward(hidden, weight, bias, y, valid, inv_t, index, kept, *stats)
        ctx.cfg = (chunk, backend, unit_t)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, y, valid, inv_t, index, kept, *stats = ctx.saved_tensors
        chunk, backend, unit_t = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None,) * 11
        N, _ = hidden.shape
        acc = acc_dtype(hidden)
        vf = valid.to(acc)
        g_lp = torch.zeros(N, dtype=acc, device=hidden.device) if g_lp is None else g_lp.to(acc) * vf
        if g_ent is not None:
            g_ent = g_ent.to(acc) * vf
        if backend == "torch":
            eng = TiledLinearSoftmax(
                hidden,
                weight,
                bias,
                y,
                valid,
                inv_t,
                chunk=chunk,
                need_ent=g_ent is not None,
                unit_temperature=unit_t,
                op="logprobs",
                index=index,
                kept=kept,
            )
            sel = (lambda x: x) if index is None else (lambda x: x[index])
            lse, gap = stats
            dh, dw, db = eng.grad(
                sel(g_lp),
                None if g_ent is None else sel(g_ent),
                lse,
                gap,
                need_h=need_h,
                need_w=need_w,
                need_b=need_b,
            )
            return (
                dh,
                dw,
                None if db is None else db.to(bias.dtype),
            ) + (None,) * 8
        eng = ChunkEngine(
            hidden,
            weight,
            bias,
            y,
            valid,
            inv_t,
            chunk=chunk,
            backend=backend,
            need_ent=g_ent is not None,
            unit_temperature=unit_t,
            index=index,
            kept=kept,
        )
        n = N if index is None else index.numel()
        dh = None
        if need_h:
            dh = torch.empty_like(hidden) if index is None else torch.zeros_like(hidden)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            rows = slice(s, e) if index is None else index[s:e]
            eng.forward(s, e)
            dz = eng.grad(g_lp[rows], None if g_ent is None else g_ent[rows])
            eng.accumulate(dz, dh, dw, db)
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
        ) + (None,) * 8


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = True,
    impl: str | None = None,
    chunk_size: int | None = None,
    keep_logits_bytes: int | None = None,
    check_finite: bool = True,
):
    """Log-prob (and entropy) of ``targets`` under softmax((hidden @ weight.T + bias) / temperature).

    Args:
        hidden: [N, H] fp32 / bf16 / fp16 (fp64 accepted, computed in fp64).
        weight: [V, H], same dtype and device as ``hidden`` (the LM head).
        targets: [N] int64/int32 token ids; entries equal to ``ignore_index`` are ignored (output 0, no grad).
        temperature: a positive float, or an [N] tensor of per-token temperatures (no gradient).
        bias: optional [V] bias; ``-inf`` entries mask vocabulary items.
        return_entropy: also return the entropy of each row's distribution.
        impl: ``"triton" | "torch" | "reference"``; default from ``BITRL_KERNEL_IMPL`` or the device.
        chunk_size: tokens per chunk (default: about 128 MiB of fp32 logits on CPU, 1 GiB on CUDA).
        keep_logits_bytes: bytes of logits the forward may keep for the backward, which then skips their
            recomputation (the same values); default ``KEEP_LOGITS_BYTES`` of the device: 512 MiB on CPU,
            0 on CUDA. 0 recomputes everything. Nothing is kept when no input requires a gradient.
        check_finite: raise ``ValueError`` naming the input when hidden, weight or bias hold NaN/inf, found
            from the [N] outputs (one device sync per call; the [V, H] weight is not scanned); ``False``
            skips it.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32 or None)``. Gradients flow to hidden, weight and bias; the
        entropy gradient is only computed when the entropy is used by the loss.
    """
    inv_t = validate_linear_inputs(hidden, weight, targets, bias, temperature, check_finite=check_finite)
    impl = resolve_impl(impl, hidden.device, op="fused_logprobs", dtype=hidden.dtype)
    if impl == "reference":
        lp, ent = fused_logprobs_reference(
            hidden,
            weight,
            targets,
            temperature=temperature,
            bias=bias,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    else:
        if chunk_size:
            chunk = int(chunk_size)
        elif (
            impl == "torch"
        ):  # tiles are sized by TILE_BYTES["logprobs"]; a tile spans every token when it can
            chunk = max(1, hidden.shape[0])
        else:
            chunk = default_chunk_size(weight.shape[0], hidden.device)
        if chunk <= 0:
            raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
        unit_t = not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0
        if keep_logits_bytes is None:
            keep_logits_bytes = device_budget(KEEP_LOGITS_BYTES, hidden.device)
        if int(keep_logits_bytes) < 0:
            raise ValueError(f"keep_logits_bytes: must be >= 0, got {keep_logits_bytes}")
        grads = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        keep = int(keep_logits_bytes) if grads and torch.is_grad_enabled() else 0
        lp, ent = FusedLogprobsFunction.apply(
            hidden,
            weight,
            bias,
            targets,
            inv_t,
            int(ignore_index),
            bool(return_entropy),
            chunk,
            impl,
            unit_t,
            keep,
        )
        ent = ent if return_entropy else None
    if check_finite:
        check_linear_outputs((lp.detach(), None if ent is None else ent.detach()), hidden, weight, bias)
    return lp, ent
