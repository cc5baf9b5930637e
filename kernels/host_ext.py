"""Build and load bitrl's host (CPU) C++ helpers (``csrc/*_host.cc``): the system C++ compiler + ctypes.

They are plain C++ over raw pointers, built once per source hash into the kernel cache
(``kernel_cache_root()``: ``$BITRL_KERNEL_CACHE``, default ``~/.cache/bitrl/csrc``). Where no compiler
exists, or ``BITRL_HOST_EXT=0``, `load_host_library` returns None and callers keep their torch formula (the
semantics; the tests check both give the same bits).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from ._common import kernel_cache_root
from .cuda_ext import CSRC

HOST_SOURCES = (
    "sampler_host.cc",
    "softmax_tile_host.cc",
    "attention_host.cc",
    "aligned_host.cc",
    "rope_cache_host.cc",
)
HEADERS = ("sampler_core.h", "host_math.h")
# No -ffast-math or -march=native: the results must be the IEEE fp32 of the formula as written (no
# contraction into FMAs, so every target clone gives the same bits), and the cached library may be shared by
# machines of one architecture. -fno-trapping-math lets float selects vectorize; it changes no result.
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-trapping-math")
# OpenMP where the compiler has it: the library then shares torch's libgomp (same soname, loaded first) and
# its threads; without it, the same code runs on one thread.
OPENMP_FLAGS = ("-fopenmp",)

_LIB: ctypes.CDLL | None = None
_TRIED = False


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, then g++, clang++, c++ on PATH; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_host_library(out: str | Path) -> Path:
    """Compile ``HOST_SOURCES`` into the shared library ``out`` (written atomically: ranks of one run may
    build at once)."""
    exe = compiler()
    if exe is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    sources = [str(CSRC / s) for s in HOST_SOURCES]
    for flags in ((*CXX_FLAGS, *OPENMP_FLAGS), CXX_FLAGS):
        cmd = [exe, *flags, *sources, "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            break
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"host build failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def load_host_library() -> ctypes.CDLL | None:
    """The host library (built on first use, cached by source hash), or None where it cannot be built or
    ``BITRL_HOST_EXT=0``; a failed build warns once, naming why."""
    global _LIB, _TRIED
    if os.environ.get("BITRL_HOST_EXT", "1") == "0":
        return None
    if _TRIED:
        return _LIB
    _TRIED = True
    # Any failure here (sources missing from an incomplete install, no compiler, a failed build, a library
    # that will not load) leaves the torch formulas in charge: one warning, never a crash.
    try:
        digest = hashlib.sha256(" ".join(CXX_FLAGS + OPENMP_FLAGS).encode())
        for name in (*HOST_SOURCES, *HEADERS):
            digest.update((CSRC / name).read_bytes())
        lib = kernel_cache_root() / f"host-{digest.hexdigest()[:16]}" / "libbitrl_host.so"
        if not lib.exists():
            build_host_library(lib)
        _LIB = ctypes.CDLL(str(lib))
    except (RuntimeError, OSError) as err:
        warnings.warn(f"bitrl: host C++ helpers unavailable, using the torch formulas: {err}", stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    _LIB.bitrl_sampling_uniforms.argtypes = [ptr, ptr, i64, i64, ptr]
    _LIB.bitrl_uniforms_at.argtypes = [ptr, ptr, ptr, i64, ptr]
    _LIB.bitrl_gumbel_candidates.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    _LIB.bitrl_sampling_uniforms.restype = _LIB.bitrl_uniforms_at.restype = None
    _LIB.bitrl_gumbel_candidates.restype = None
    _LIB.bitrl_decode_attention.argtypes = [ptr] * 5 + [i64] * 9 + [ctypes.c_float, ctypes.c_int]
    _LIB.bitrl_decode_attention.restype = None
    _LIB.bitrl_tile_stats_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    _LIB.bitrl_tile_grad_bf16.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    _LIB.bitrl_tile_stats_bf16.restype = _LIB.bitrl_tile_grad_bf16.restype = None
    f32, i32 = ctypes.c_float, ctypes.c_int
    _LIB.bitrl_aligned_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, i32]
    _LIB.bitrl_aligned_silu_mul.argtypes = [ptr, ptr, ptr, i64, i32]
    _LIB.bitrl_aligned_logprobs.argtypes = [ptr, ptr, i64, i64, i64, f32, ptr, ptr, i32]
    _LIB.bitrl_rms_norm_columns.argtypes = [ptr, ptr, ptr, i64, i64, f32, i32]
    _LIB.bitrl_rope_store.argtypes = [ptr] * 9 + [i64] * 10 + [i32]
    for fn in (
        "bitrl_aligned_rms_norm",
        "bitrl_rms_norm_columns",
        "bitrl_aligned_silu_mul",
        "bitrl_aligned_logprobs",
    ):
        getattr(_LIB, fn).restype = None
    _LIB.bitrl_rope_store.restype = i64
    return _LIB
