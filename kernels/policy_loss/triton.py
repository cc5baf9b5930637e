"""The Triton policy-loss kernel: token-level loss + metrics + gradients in one elementwise-plus-reduction
pass over the [B, T] tokens of a plan (``evaluate_triton``), for the losses registered with ``fused=True``.

Which losses run here is the registry's declaration (``@register_policy_loss(..., fused=True)``);
``triton_losses()`` derives the kernel's table from it. A plan the kernel cannot evaluate (a loss without
``fused=True``, ``kl_is_correction``, fp64) runs on the torch path, with one ``FusedFallbackWarning`` naming
the loss and the path taken (``warn_fallback``).
"""

from __future__ import annotations

import warnings

import torch

from .._common import HAS_TRITON
from .plan import _SUM_KEYS, Plan
from .registry import POLICY_LOSSES

__all__ = [
    "KERNEL_BRANCHES",
    "POLICY_BLOCK",
    "TRITON_KL",
    "FusedFallbackWarning",
    "evaluate_triton",
    "triton_losses",
    "triton_supported",
    "warn_fallback",
]

# The kernel's LOSS branches, by the registered name of the policy loss each computes (LOSS = the index).
KERNEL_BRANCHES = ("grpo", "cispo", "sapo")
TRITON_KL = {"k1": 1, "k2": 2, "k3": 3}
# partial sums per program: pg, kl_term, ent_term, n, clip_low, clip_high, clip_dual, ratio_sum, kl_sum,
# ent_sum, ratio_min, ratio_max
_NPART = 12
POLICY_BLOCK = 1024  # elements per program of the policy-loss kernel (tests lower it)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _policy_loss_kernel(
        LP,
        OLD,
        ADV,
        M,
        W,
        CORR,
        REF,
        ENT,
        DLP,
        DENT,
        PART,
        n_elem,
        eps_low,
        eps_high,
        clip_c,
        delta,
        rmax_cispo,
        tau_pos,
        tau_neg,
        lr_clamp,
        kl_coef,
        ent_coef,
        LOSS: tl.constexpr,
        KL: tl.constexpr,
        HAS_CORR: tl.constexpr,
        HAS_ENT: tl.constexpr,
        HAS_DUAL: tl.constexpr,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # int64 offsets: B * T may exceed 2**31
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n_elem
        m = tl.load(M + offs, mask=inb, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=inb, other=0.0).to(tl.float32)
        lp = tl.load(LP + offs, mask=inb, other=0.0).to(tl.float32)
        lp = tl.where(m > 0, lp, 0.0)
        old = tl.load(OLD + offs, mask=inb, other=0.0).to(tl.float32)
        adv = tl.load(ADV + offs, mask=inb, other=0.0).to(tl.float32)
        d = lp - old
        in_clamp = (d >= -lr_clamp) & (d <= lr_clamp)
        log_r = tl.minimum(tl.maximum(d, -lr_clamp), lr_clamp)
        r = tl.exp(log_r)
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        clip_lo = zero
        clip_hi = zero
        clip_du = zero
        if LOSS == 0:
            lo = 1.0 - eps_low
            hi = 1.0 + eps_high
            r_u = r
            dr_u = r
            if HAS_DELTA:
                r_u = tl.minimum(r, delta)
                dr_u = tl.where(r < delta, r, 0.0)
            r_c = tl.minimum(tl.maximum(r, lo), hi)
            dr_c = tl.where((r >= lo) & (r <= hi), r, 0.0)
            s1 = -adv * r_u
            s2 = -adv * r_c
            use1 = s1 >= s2
            pg = tl.where(use1, s1, s2)
            dpg = tl.where(use1, -adv * dr_u, -adv * dr_c)
            clip_lo = tl.where((r < lo) & (adv < 0), 1.0, 0.0)
            clip_hi = tl.where((r > hi) & (adv > 0), 1.0, 0.0)
            if HAS_DUAL:
                s3 = -adv * clip_c
                dual = (adv < 0) & (pg > s3)
                pg = tl.where(dual, s3, pg)
                dpg = tl.where(dual, 0.0, dpg)
                clip_du = tl.where(dual, 1.0, 0.0)
        elif LOSS == 1:
            wc = tl.minimum(r, rmax_cispo)
            pg = -wc * adv * lp
            dpg = -wc * adv
            clip_hi = tl.where((r > rmax_cispo) & (adv > 0), 1.0, 0.0)
        else:
            tau = tl.where(adv > 0, tau_pos, tau_neg)
            sg = tl.sigmoid(tau * (r - 1.0))
            pg = -sg * (4.0 / tau) * adv
            dpg = -4.0 * adv * sg * (1.0 - sg) * r
        if LOSS != 1:
            dpg = tl.where(in_clamp, dpg, 0.0)
        if HAS_CORR:
            c = tl.load(CORR + offs, mask=inb, other=0.0).to(tl.float32)
            pg = pg * c
            dpg = dpg * c
        dl = dpg
        kl = zero
        if KL != 0:
            ref = tl.load(REF + offs, mask=inb, other=0.0).to(tl.float32)
            if KL == 1:
                kl = lp - ref
                dkl = zero + 1.0
            elif KL == 2:
                kl = 0.5 * (lp - ref) * (lp - ref)
                dkl = lp - ref
            else:
                dd = ref - lp
                inside = (dd >= -20.0) & (dd <= 20.0)
                dd = tl.minimum(tl.maximum(dd, -20.0), 20.0)
                kl = tl.exp(dd) - dd - 1.0
                dkl = tl.where(inside, 1.0 - tl.exp(dd), 0.0)
            dl += kl_coef * dkl
        ent = zero
        if HAS_ENT:
            ent = tl.load(ENT + offs, mask=inb, other=0.0).to(tl.float32)
            ent = tl.where(m > 0, ent, 0.0)
            tl.store(DENT + offs, -ent_coef * w, mask=inb)
        tl.store(DLP + offs, w * dl, mask=inb)
        base = PART + pid * 12
        tl.store(base + 0, tl.sum(w * pg, axis=0))
        tl.store(base + 1, tl.sum(w * kl, axis=0))
        tl.store(base + 2, tl.sum(w * ent, axis=0))
        tl.store(base + 3, tl.sum(m, axis=0))
        tl.store(base + 4, tl.sum(m * clip_lo, axis=0))
        tl.store(base + 5, tl.sum(m * clip_hi, axis=0))
        tl.store(base + 6, tl.sum(m * clip_du, axis=0))
        tl.store(base + 7, tl.sum(m * r, axis=0))
        tl.store(base + 8, tl.sum(m * kl, axis=0))
        tl.store(base + 9, tl.sum(m * ent, axis=0))
        tl.store(base + 10, tl.min(tl.where(m > 0, r, 3.0e38), axis=0))
        tl.store(base + 11, tl.max(tl.where(m > 0, r, -3.0e38), axis=0))


class FusedFallbackWarning(UserWarning):
    """A policy loss expected on the fused Triton kernel runs on the torch path instead."""


def triton_losses() -> dict[str, int]:
    """The fused kernel's table, derived from the registry: the registered name of every policy loss declared
    ``fused=True`` -> its kernel branch (the LOSS constexpr)."""
    fused = {fn.registry_name for fn in POLICY_LOSSES.values() if fn.fused}
    return {name: KERNEL_BRANCHES.index(name) for name in sorted(fused) if name in KERNEL_BRANCHES}


def _check_declarations():
    """Every kernel branch is a loss declared fused=True, and every built-in one declared so has a branch."""
    fused = {fn.registry_name for fn in POLICY_LOSSES.values() if fn.fused}
    if fused != set(KERNEL_BRANCHES):
        raise RuntimeError(
            f"policy losses declared fused=True {sorted(fused)} differ from the Triton kernel's branches "
            f"{sorted(KERNEL_BRANCHES)}"
        )


_check_declarations()


def triton_supported(plan: Plan) -> str | None:
    """Why the Triton kernel cannot evaluate this plan, naming the loss (None when it can)."""
    name, cfg = plan.loss_type, plan.cfg
    if not POLICY_LOSSES[name].fused:
        return f"loss_type {name!r} has no fused Triton kernel (it is registered without fused=True)"
    if name not in KERNEL_BRANCHES:
        return f"loss_type {name!r} is registered with fused=True, but the Triton kernel has no branch for it"
    if cfg.kl_is_correction:
        return f"loss_type {name!r} with kl_is_correction has no fused Triton kernel"
    if plan.ref is not None and cfg.kl_type not in TRITON_KL:
        return f"loss_type {name!r} with kl_type {cfg.kl_type!r} has no fused Triton kernel"
    if plan.mask.dtype == torch.float64:
        return f"loss_type {name!r} in fp64: the Triton kernel computes in fp32"
    return None


def warn_fallback(op: str, reason: str, path: str) -> None:
    """The one warning of a plan expected on the fused kernel that runs on ``path`` instead."""
    warnings.warn(f"{op}: {reason}; running {path}", FusedFallbackWarning, stacklevel=3)


def evaluate_triton(lp: torch.Tensor, ent: torch.Tensor | None, plan: Plan, rows: slice | None = None):
    """Triton stage 2 on a block of rows: (loss, parts, dlp [b, T] fp32, dent [b, T] fp32 | None)."""
    cfg = plan.cfg
    sl = rows if rows is not None else slice(None)
    mask = plan.mask[sl]
    B, T = mask.shape
    n = B * T
    dev = mask.device
    f32 = torch.float32

    def flat(x):
        return x[sl].reshape(-1).to(f32).contiguous()

    lp_f = lp.detach().reshape(-1).to(f32).contiguous()
    old_f = lp_f if plan.old is None else flat(plan.old)
    BLOCK = POLICY_BLOCK
    nblk = max(1, triton.cdiv(n, BLOCK))
    part = torch.empty(nblk, _NPART, dtype=f32, device=dev)
    dlp = torch.empty(n, dtype=f32, device=dev)
    dent = torch.empty(n, dtype=f32, device=dev) if ent is not None else dlp
    dummy = lp_f
    if n:
        _policy_loss_kernel[(nblk,)](
            lp_f,
            old_f,
            flat(plan.adv),
            flat(plan.mask),
            flat(plan.weight),
            flat(plan.corr) if plan.corr is not None else dummy,
            flat(plan.ref) if plan.ref is not None else dummy,
            ent.detach().reshape(-1).to(f32).contiguous() if ent is not None else dummy,
            dlp,
            dent,
            part,
            n,
            float(cfg.eps_low),
            float(cfg.eps_high),
            float(cfg.clip_ratio_c or 0.0),
            float(cfg.delta or 0.0),
            float(cfg.cispo_clip_max if cfg.cispo_clip_max is not None else 1.0 + cfg.eps_high),
            float(cfg.sapo_tau_pos),
            float(cfg.sapo_tau_neg),
            float(cfg.log_ratio_clamp),
            float(cfg.kl_coef),
            float(cfg.entropy_coef),
            LOSS=KERNEL_BRANCHES.index(plan.loss_type),
            KL=TRITON_KL[cfg.kl_type] if plan.ref is not None else 0,
            HAS_CORR=plan.corr is not None,
            HAS_ENT=ent is not None,
            HAS_DUAL=cfg.clip_ratio_c is not None,
            HAS_DELTA=cfg.delta is not None,
            BLOCK=BLOCK,
        )
        s = part.sum(0)
        rmin, rmax = part[:, 10].amin(), part[:, 11].amax()
    else:
        s = torch.zeros(_NPART, dtype=f32, device=dev)
        rmin = torch.tensor(3.0e38, device=dev)
        rmax = torch.tensor(-3.0e38, device=dev)
    parts = {k: s[i] for i, k in enumerate(_SUM_KEYS)}
    parts["ratio_min"], parts["ratio_max"] = rmin, rmax
    loss = parts["pg"]
    if plan.ref is not None and cfg.kl_coef:
        loss = loss + cfg.kl_coef * parts["kl_term"]
    if ent is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * parts["ent_term"]
    return loss, parts, dlp.view(B, T), (dent.view(B, T) if ent is not None else None)
