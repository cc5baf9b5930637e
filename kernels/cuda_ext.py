"""Build and load bitrl's CUDA C++ kernels (``csrc/``) without ATen: nvcc + ctypes.

The kernels are plain CUDA C++ with ``extern "C"`` launchers over raw pointers and a ``cudaStream_t``, so they
compile wherever ``nvcc`` exists (no CUDA build of torch, no cuBLAS headers needed). ``compile_objects`` and
``build_library`` compile them for the given architectures (the test suite builds sm_90a and sm_100a on
machines without a GPU); ``load_library`` builds once for the local GPU into the bitrl cache and opens it
with ctypes. The launchers' Python wrappers (``fused_sample_cuda`` here, ``fp4_gemv`` in
``bitrl.kernels.fp4_gemv``) pass ``data_ptr()`` values and the current stream.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from ._common import kernel_cache_root

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("sampler.cu", "fp4_gemv.cu")
ARCHS = ("sm_90a", "sm_100a")
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC")


def nvcc() -> str | None:
    """Path of nvcc (``$CUDA_HOME/bin``, then ``PATH``), or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode(archs) -> list[str]:
    """``-gencode`` flags for architectures like ``sm_90a`` (SASS for each)."""
    flags = []
    for a in archs:
        num = a.removeprefix("sm_")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return flags


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")


def compile_objects(out_dir: str | Path, archs=ARCHS) -> list[Path]:
    """Compile every source of ``csrc/`` to an object file holding SASS for each of ``archs``."""
    exe = nvcc()
    if exe is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    objs = []
    for src in SOURCES:
        obj = out / (Path(src).stem + ".o")
        _run([exe, *NVCC_FLAGS, *gencode(archs), "-c", str(CSRC / src), "-o", str(obj)])
        objs.append(obj)
    return objs


def link_library(objs, out: str | Path) -> Path:
    """Link object files from :func:`compile_objects` into one shared library."""
    _run([nvcc(), "-shared", *map(str, objs), "-o", str(out), "-lcudart"])
    return Path(out)


def build_library(out_dir: str | Path, archs=ARCHS) -> Path:
    """Objects for ``archs`` linked into ``out_dir/libbitrl_kernels.so``."""
    return link_library(compile_objects(out_dir, archs), Path(out_dir) / "libbitrl_kernels.so")


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA C++ kernels cannot run here (None when they can)."""
    if not torch.cuda.is_available():
        return "the CUDA C++ kernels need a CUDA device (this torch sees none)"
    if nvcc() is None:
        return "nvcc not found: the CUDA C++ kernels are built on first use"
    return None


_LIB: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    """Build (once, cached by source hash and GPU architecture) and open the kernels of ``csrc/``."""
    global _LIB
    if _LIB is not None:
        return _LIB
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    digest = hashlib.sha256()
    for p in sorted(CSRC.glob("*.[ch]*")):
        digest.update(p.read_bytes())
    out = kernel_cache_root() / f"{digest.hexdigest()[:16]}-{arch}"
    lib = out / "libbitrl_kernels.so"
    if not lib.exists():
        build_library(out, (arch,))
    _LIB = ctypes.CDLL(str(lib))
    for name in ("bitrl_fused_sample_f32", "bitrl_fused_sample_bf16", "bitrl_fused_sample_f16"):
        getattr(_LIB, name).argtypes = (
            [ctypes.c_void_p] * 3
            + [ctypes.c_float, ctypes.c_int, ctypes.c_float]
            + [ctypes.c_void_p] * 2
            + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        )
    _LIB.bitrl_fp4_gemv_mxfp4.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    _LIB.bitrl_fp4_gemv_nvfp4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    return _LIB


def check_status(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what}: CUDA error {code} ({torch.cuda.get_device_name()})")


def stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


_SAMPLE_FN = {
    torch.float32: "bitrl_fused_sample_f32",
    torch.bfloat16: "bitrl_fused_sample_bf16",
    torch.float16: "bitrl_fused_sample_f16",
}


def fused_sample_cuda(logits, seeds, positions, temperature=1.0, top_k=0, top_p=1.0):
    """The CUDA C++ fused sampler (csrc/sampler.cu): ``(tokens [B] int64, logprobs [B] fp32)``.

    logits [B, V] fp32/bf16/fp16 on a CUDA device; seeds, positions [B] int64 (the counter-based RNG keys).
    Same semantics as ``bitrl.kernels.sampling.fused_sample_reference``.
    """
    if logits.dim() != 2 or logits.dtype not in _SAMPLE_FN:
        raise ValueError(f"logits: expected [B, V] fp32/bf16/fp16, got {logits.dtype}{list(logits.shape)}")
    B, V = logits.shape
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (B,) or t.dtype != torch.int64 or t.device != logits.device:
            raise ValueError(f"{name}: expected [{B}] int64 on {logits.device}, got {t.dtype}{list(t.shape)}")
    lib = load_library()
    logits = logits.contiguous()
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    code = getattr(lib, _SAMPLE_FN[logits.dtype])(
        logits.data_ptr(),
        seeds.contiguous().data_ptr(),
        positions.contiguous().data_ptr(),
        float(temperature),
        int(top_k),
        float(top_p),
        tokens.data_ptr(),
        logprobs.data_ptr(),
        B,
        V,
        stream_handle(logits.device),
    )
    check_status(code, "bitrl_fused_sample")
    return tokens, logprobs


def main(argv=None) -> int:
    """``python -m bitrl.kernels.cuda_ext OUT.json``: build the kernels for the local GPU into the kernel
    cache (once; later runs and tests load that build) and write what happened as JSON: built, the
    library's path, or why not (no CUDA device, no nvcc, a failed build)."""
    import json
    import sys
    import time

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bitrl.kernels.cuda_ext OUT.json", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = {"built": False, "library": None, "reason": cuda_unavailable_reason()}
    if result["reason"] is None:
        try:
            lib = load_library()
            result.update(built=True, library=getattr(lib, "_name", None))
        except (RuntimeError, OSError) as err:
            result["reason"] = str(err)[-2000:]
    result["seconds"] = round(time.perf_counter() - t0, 2)
    Path(argv[0]).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["built"] or not torch.cuda.is_available() else 1


if __name__ == "__main__":
    raise SystemExit(main())
