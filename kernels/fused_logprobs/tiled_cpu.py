"""The tiled engine (``impl="torch"``, the CPU path; ``TiledLinearSoftmax``, shared with the loss op): the
logits are visited in [tokens x vocabulary] tiles sized by ``TILE_BYTES``, a statistics pass (online
log-sum-exp) then a gradient pass that writes dW block by block. bf16 tiles on CPU run their softmax passes
in the host C++ library (host_tiles.py) where it builds. ``TiledLogprobs`` drives the engine for
``fused_logprobs``.
"""

from __future__ import annotations

import torch

from .. import host_ext
from . import numerics
from .host_tiles import host_tile_grad, host_tile_stats
from .numerics import LOG2E, NEG_LOGIT, acc_dtype, bmm_rowdot, device_budget, exp_, tile_matmul_dtype

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
TILE_MIN_VOCAB = 256  # a tile holds every token when that leaves at least this many vocabulary columns
VOCAB_ALIGN = 64  # vocabulary tiles are multiples of this (below it, any size: the tests use tiny tiles)


def tile_bytes(n: int, V: int, hidden: torch.Tensor, op: str) -> int:
    """The most bytes the tiles of one pass over n active tokens hold: ``TILE_BYTES[op]`` of the device, or
    the whole [n, V] at the largest element (fp32 logits, entropy buffer and low-precision product) when
    that is less. What a ``memory_budget`` pays for first."""
    acc, mm = acc_dtype(hidden), tile_matmul_dtype(hidden)
    elem = 2 * acc.itemsize + (0 if mm == acc else mm.itemsize)
    return min(device_budget(TILE_BYTES[op], hidden.device), n * V * elem)


def kept_columns(n: int, V: int, hidden: torch.Tensor, op: str, budget: int) -> int:
    """Vocabulary columns [0, k) of the n active tokens' products (h W^T in the matmul dtype) that fit in
    what ``budget`` leaves beside the tiles (``tile_bytes``): the columns the gradient pass reads instead of
    multiplying again. k = V is the 3-product form; k = 0 the two-pass tiles alone (4 products)."""
    if n == 0:
        return 0
    spare = budget - tile_bytes(n, V, hidden, op)
    return max(0, min(V, spare // (n * tile_matmul_dtype(hidden).itemsize)))


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
            self.c, self.vb = min(self.c, TOKEN_TILE_ROWS), min(self.vb, numerics.LOGITS_BLOCK)
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
                t[k0:k1] = alpha * (t[k0:k1] + s_old * (m_old - m_new)) + bmm_rowdot(e, z)
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


class TiledLogprobs:
    """``fused_logprobs`` on ``TiledLinearSoftmax``: the statistics pass in the forward, the gradient pass in
    the backward (no forward recomputation); the forward keeps the products of the first vocabulary columns
    of every active token that fit in what the memory budget leaves beside the tiles (``kept_columns``: all
    of them is the 3-product form). ``inputs``: (hidden, weight, bias, y, valid, inv_t, index), as
    ``TiledLinearSoftmax`` takes them."""

    def __init__(self, *, chunk, unit_temperature):
        self.chunk, self.unit_t = chunk, unit_temperature

    def _engine(self, inputs, need_ent, kept):
        *tensors, index = inputs
        return TiledLinearSoftmax(
            *tensors,
            chunk=self.chunk,
            need_ent=need_ent,
            unit_temperature=self.unit_t,
            op="logprobs",
            index=index,
            kept=kept,
        )

    def forward(self, inputs, lp, ent, *, need_ent, budget):
        """Writes the active tokens' log-probs (and entropies) into lp, ent [N]; returns (kept products, lse,
        lse - E_p[z]), what the gradient pass reads. ``budget``: bytes of tiles and kept products (0 when
        no gradient will be asked for)."""
        hidden, weight, *_, index = inputs
        n = hidden.shape[0] if index is None else index.numel()
        # vocabulary columns [0, k) of every active token
        k = kept_columns(n, weight.shape[0], hidden, "logprobs", budget)
        mm = tile_matmul_dtype(hidden)
        kept = torch.empty(n, k, dtype=mm, device=hidden.device) if k else None
        lp_a, ent_a, lse, gap = self._engine(inputs, need_ent, kept).stats()
        rows = slice(None) if index is None else index
        lp[rows] = lp_a
        if need_ent:
            ent[rows] = ent_a
        return kept, lse, gap

    def backward(self, inputs, saved, g_lp, g_ent, needs):
        """(dh, dW, db) from the [N] gradients of lp and entropy (None: unused); dW in the weight's dtype, db
        in fp32 (fp64)."""
        index = inputs[-1]
        kept, lse, gap = saved
        need_h, need_w, need_b = needs
        eng = self._engine(inputs, g_ent is not None, kept)
        sel = (lambda x: x) if index is None else (lambda x: x[index])
        return eng.grad(
            sel(g_lp),
            None if g_ent is None else sel(g_ent),
            lse,
            gap,
            need_h=need_h,
            need_w=need_w,
            need_b=need_b,
        )
