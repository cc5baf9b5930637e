"""The chunked engine (``ChunkEngine``): each chunk of tokens gets its [chunk, V] logits from torch products
(cuBLAS on a GPU), reduced row by row and dropped; the backward recomputes them, forms d logits and runs the
two gradient matmuls (dW accumulated in fp32).

The row math is a strategy picked by ``backend``: ``TorchRows`` (torch ops, in place in the workspace; the
loss op's one-pass CPU path) or ``TritonRows`` (triton_rows.py: the Triton path of both ops).
``ChunkedLogprobs`` drives the engine for ``fused_logprobs``.
"""

from __future__ import annotations

import torch

from . import numerics
from .numerics import NEG_LOGIT, acc_dtype, bmm_rowdot, exp_, matmul_dtype
from .triton_rows import TritonRows


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


class TorchRows:
    """``ChunkEngine``'s row math in torch ops (``backend="torch"``), in place in the logits workspace.

    No entropy: the logits buffer is exponentiated in place (p = e / sum e), so one [c, V] buffer and about
    five passes over it cover forward and gradient. With entropy, a second buffer keeps z - max."""

    def __init__(self, engine):
        self.acc, self.scale, self.clamp = engine.acc, engine.scale, engine.clamp
        z = engine.zbuf
        self.ebuf = torch.empty(z.shape, dtype=self.acc, device=z.device) if engine.need_ent else None

    def stats(self, z, y, valid, inv_t, need_ent):
        """(lp, entropy | None, log-sum-exp, E_p[z]) of the chunk's logits z; keeps what ``grad`` needs."""
        if self.scale:
            z.mul_(inv_t.unsqueeze(-1))
        if self.clamp:
            z.clamp_(min=NEG_LOGIT)
        m = z.amax(dim=-1, keepdim=True)
        zy = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        z.sub_(m)
        m = m.squeeze(-1)
        if need_ent and self.ebuf is not None:
            ebuf = self.ebuf[: z.shape[0]]
            exp_(z, out=ebuf)
            sum_e = ebuf.sum(-1)
            pzm = bmm_rowdot(ebuf, z) / sum_e  # E_p[z - m]
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

    def grad(self, y, inv_t, g_lp, g_ent):
        """d loss / d raw logits of the last ``stats`` chunk (overwrites the workspace); ``g_lp`` in the
        accumulation dtype."""
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


# the row math of each ``backend``
ROWS = {"torch": TorchRows, "triton": TritonRows}


class ChunkEngine:
    """The per-chunk work shared by ``fused_logprobs`` and ``fused_linear_policy_loss``.

    Holds one (two with entropy) reusable [chunk, V] fp32 workspace(s), so no chunk allocates or page-faults
    fresh memory. ``forward(s, e)`` forms the logits of tokens [s, e) and returns
    (logprob, entropy | None, lse, E_p[z]); ``grad(g_lp, g_ent)`` then turns the loss gradients w.r.t. the
    log-prob / entropy of the same chunk into d loss / d logits (in the workspace), and
    ``accumulate(dz, dh, dw, db)`` runs the two backward matmuls (dW accumulated in fp32).

    ``backend`` ("torch" | "triton") picks the row math of each chunk (``ROWS``): ``TorchRows`` or
    ``TritonRows``, which reduce the workspace to the row statistics and turn it into d logits.

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
        self.need_ent = need_ent
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
        self.rows = ROWS[backend](self)  # its own buffers beside the logits workspace

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
            step = numerics.LOGITS_BLOCK if z.device.type == "cpu" else max(V, 1)
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
        """(logprob, entropy | None, lse, E_p[z]) of the chunk of tokens [s, e)."""
        need_ent = self.need_ent if need_ent is None else need_ent
        idx, h, y, valid, inv_t = self._select(s, e)
        self._start = s
        z = self.logits(h, s)
        self._cur = (idx, h, y, inv_t)
        return self.rows.stats(z, y, valid, inv_t, need_ent)

    def grad(self, g_lp: torch.Tensor, g_ent: torch.Tensor | None) -> torch.Tensor:
        """d loss / d raw logits of the last ``forward`` chunk (overwrites the workspace)."""
        _, _, y, inv_t = self._cur
        return self.rows.grad(y, inv_t, g_lp.to(self.acc), g_ent)

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


class ChunkedLogprobs:
    """``fused_logprobs`` on ``ChunkEngine``, chunk by chunk of the active tokens: the forward keeps the
    logits of the first whole chunks that fit in what the memory budget leaves beside the chunk's workspace
    and drops the others, which the backward recomputes. ``inputs``: (hidden, weight, bias, y, valid, inv_t,
    index), as ``ChunkEngine`` takes them."""

    def __init__(self, *, chunk, backend, unit_temperature):
        self.chunk, self.backend, self.unit_t = chunk, backend, unit_temperature

    def _engine(self, inputs, need_ent, kept, fill=False):
        *tensors, index = inputs
        return ChunkEngine(
            *tensors,
            chunk=self.chunk,
            backend=self.backend,
            need_ent=need_ent,
            unit_temperature=self.unit_t,
            index=index,
            kept=kept,
            fill=fill,
        )

    def forward(self, inputs, lp, ent, *, need_ent, budget):
        """Writes the active tokens' log-probs (and entropies) into lp, ent [N]; returns (kept logits,).
        ``budget``: bytes of the workspace and kept logits (0 when no gradient will be asked for)."""
        hidden, weight, *_, index = inputs
        n, chunk = hidden.shape[0] if index is None else index.numel(), self.chunk
        acc = acc_dtype(hidden)
        # whole chunks of rows: each one is either kept or recomputed; the [chunk, V] workspace (two with the
        # entropy on the torch rows) comes out of the budget first
        row_bytes = weight.shape[0] * acc.itemsize
        work = min(chunk, max(n, 1)) * row_bytes * (2 if need_ent and self.backend == "torch" else 1)
        keep_bytes = max(0, budget - work)
        k = min(n, keep_bytes // (row_bytes * chunk) * chunk)
        kept = torch.empty(k, weight.shape[0], dtype=acc, device=hidden.device) if k else None
        eng = self._engine(inputs, need_ent, kept, fill=True)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lp_c, ent_c, _, _ = eng.forward(s, e)
            rows = slice(s, e) if index is None else index[s:e]
            lp[rows] = lp_c
            if need_ent:
                ent[rows] = ent_c
        return (kept,)

    def backward(self, inputs, saved, g_lp, g_ent, needs):
        """(dh, dW, db) from the [N] gradients of lp and entropy (None: unused); dW and db in fp32 (fp64)."""
        hidden, weight, *_, index = inputs
        (kept,) = saved
        need_h, need_w, need_b = needs
        n, chunk = hidden.shape[0] if index is None else index.numel(), self.chunk
        acc = acc_dtype(hidden)
        eng = self._engine(inputs, g_ent is not None, kept)
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
        return dh, dw, db
