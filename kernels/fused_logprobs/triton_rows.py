"""The Triton path (``impl="triton"``): row kernels over a chunk's logits, and ``TritonRows``, their use by
``ChunkEngine`` (chunked.py), which forms the logits with cuBLAS and hands each chunk to them.

``row_stats_triton``: per-row online log-sum-exp over vocabulary tiles of ``BLOCK_V`` columns, giving
log-prob, entropy and the statistics the gradient needs; ``row_grad_triton``: d loss / d logits from the same
logits and statistics, written in place or into a buffer of the next matmul's dtype.
"""

from __future__ import annotations

import torch

from .._common import HAS_TRITON, next_pow2

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


class TritonRows:
    """``ChunkEngine``'s row math in the Triton kernels (``backend="triton"``): they read the fp32 logits
    workspace, scale by 1/T and clamp -inf themselves, and write d logits straight in the matmul dtype (bf16
    on a GPU: no separate cast pass)."""

    def __init__(self, engine):
        c, V = engine.zbuf.shape
        self.dzbuf = None
        if engine.mm != engine.acc:
            self.dzbuf = torch.empty(c, V, dtype=engine.mm, device=engine.zbuf.device)

    def stats(self, z, y, valid, inv_t, need_ent):
        """(lp, entropy | None, log-sum-exp, E_p[z]) of the chunk's logits z; keeps what ``grad`` needs."""
        lp, ent, stats = row_stats_triton(z, y, inv_t, valid, need_ent)
        self._state = (z, stats)
        m, log_s, ts = stats
        return lp, ent, m + log_s, m + ts

    def grad(self, y, inv_t, g_lp, g_ent):
        """d loss / d raw logits of the last ``stats`` chunk."""
        z, stats = self._state
        out = None if self.dzbuf is None else self.dzbuf[: z.shape[0]]
        return row_grad_triton(z, y, inv_t, stats, g_lp, g_ent, out=out)
