"""The host C++ softmax passes over one bf16 tile (csrc/softmax_tile_host.cc, loaded by kernels/host_ext.py),
which ``TiledLinearSoftmax`` (tiled_cpu.py) runs on CPU for bf16 GEMM tiles without bias or clamping."""

from __future__ import annotations

import torch


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
