"""The CUDA C++ kernels of csrc/: nvcc builds them for sm_90a and sm_100a here; their shared host code
(Philox, the radix selections of the sampler) runs as a host program against Random123's known answers and an
independent numpy model of the sampler; the FP4 GEMV's torch twin is checked against bitrl.quant. The
CUDA-vs-twin comparisons run where a GPU exists."""

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from bitrl.kernels import cuda_ext
from bitrl.kernels.fp4_gemv import fp4_gemv, fp4_gemv_reference

needs_nvcc = pytest.mark.skipif(cuda_ext.nvcc() is None, reason="nvcc not found: csrc/ is not compiled here")
needs_cuda = pytest.mark.skipif(
    cuda_ext.cuda_unavailable_reason() is not None,
    reason=f"{cuda_ext.cuda_unavailable_reason()} (compiled above)",
)

# ------------------------------------------------------------------------------------------ numpy model


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 numpy arrays holding 32-bit lanes (Random123's round and key schedule)."""
    m32 = np.uint64(0xFFFFFFFF)
    c = [np.asarray(v, dtype=np.uint64) & m32 for v in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(k0) & m32, np.uint64(k1) & m32
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & m32, p1 >> np.uint64(32), p1 & m32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + np.uint64(0x9E3779B9)) & m32
        k1 = (k1 + np.uint64(0xBB67AE85)) & m32
    return c


def uniforms(seed: int, position: int, vocab: int) -> np.ndarray:
    v = np.arange(vocab, dtype=np.uint64)
    seed, position = seed % 2**64, position % 2**64
    lanes = philox4x32_10(
        v >> np.uint64(2), position & 0xFFFFFFFF, position >> 32, 0, seed & 0xFFFFFFFF, seed >> 32
    )
    x = np.choose((v & np.uint64(3)).astype(np.int64), lanes)
    u = ((x >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    return np.minimum(u, np.float32(1 - 2.0**-24)).astype(np.float32)  # the cap of the sampling semantics


def sample_model(logits, seed, position, t, top_k, top_p):
    """The sampler's semantics with sorting (independent of the kernels' radix selections).

    Returns (token, logprob)."""
    x = np.asarray(logits, dtype=np.float32)
    if t == 0:
        return int(np.argmax(x)), 0.0
    z = x / np.float32(t)
    keep = np.ones(z.shape, bool)
    if 0 < top_k < z.size:
        keep = z >= np.sort(z)[::-1][top_k - 1]
    m = z.max()
    if top_p < 1:
        e = np.where(keep, np.exp(z - m), 0).astype(np.float32)
        p = e / e.sum(dtype=np.float32)
        order = np.argsort(-p, kind="stable")
        ps = p[order]
        cum = np.concatenate(([0.0], np.cumsum(ps, dtype=np.float64)))
        # mass strictly above p_v = the cumulative mass before the first entry equal to p_v
        first = np.searchsorted(-ps, -ps, side="left")
        above = np.empty_like(p, dtype=np.float64)
        above[order] = cum[first]
        keep &= above < top_p
    g = np.where(keep, z - np.log(-np.log(uniforms(seed, position, z.size))), -np.inf)
    tok = int(np.argmax(g))
    lse = m + np.log(np.exp(z[keep] - m).sum(dtype=np.float64))
    return tok, float(z[tok] - lse)


# ------------------------------------------------------------------------------------------ builds


@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    if cuda_ext.nvcc() is None:
        pytest.skip("nvcc not found: csrc/ is not compiled here")
    exe = tmp_path_factory.mktemp("csrc") / "host_check"
    subprocess.run(
        [cuda_ext.nvcc(), "-O2", "-std=c++17", str(cuda_ext.CSRC / "host_check.cu"), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    return str(exe)


def _elf_archs(path) -> set[str]:
    import triton

    cuobjdump = cuda_ext.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run(
        [str(cuobjdump), "--list-elf", str(path)], capture_output=True, text=True, check=True
    )
    return {tok for tok in out.stdout.replace(".", " ").split() if tok.startswith("sm_")}


@needs_nvcc
def test_nvcc_builds_objects_and_one_library_for_hopper_and_blackwell(tmp_path):
    lib = cuda_ext.build_library(tmp_path, ("sm_90a", "sm_100a"))
    for src in cuda_ext.SOURCES:
        obj = tmp_path / (src.removesuffix(".cu") + ".o")
        assert _elf_archs(obj) >= {"sm_90a", "sm_100a"}, obj
    if shutil.which("nm"):
        symbols = subprocess.run(
            ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True
        ).stdout
    else:  # no binutils: the dynamic string table still names every exported launcher
        symbols = "".join(f" T {n}\n" for n in re.findall(r"bitrl_\w+", lib.read_bytes().decode("latin-1")))
    for name in (
        "bitrl_fused_sample_f32",
        "bitrl_fused_sample_bf16",
        "bitrl_fused_sample_f16",
        "bitrl_fp4_gemv_mxfp4",
        "bitrl_fp4_gemv_nvfp4",
    ):
        assert f" T {name}" in symbols, name


def test_kernels_build_without_aten_headers():
    for src in [*cuda_ext.SOURCES, "sampler_core.h", "host_check.cu", "sampler_host.cc"]:
        includes = [ln for ln in (cuda_ext.CSRC / src).read_text().splitlines() if ln.startswith("#include")]
        assert includes and not [ln for ln in includes if any(h in ln for h in ("ATen", "c10/", "torch/"))], (
            src
        )


# ------------------------------------------------------------------------------------------ Philox


def test_philox_known_answers(host_check):
    """Random123's kat_vectors for philox4x32 with 10 rounds."""
    expected = [
        "6627e8d5 e169c58d bc57ac4c 9b00dbd8",
        "408f276d 41c83b0e a20bc7c6 6d5451fd",
        "d16cfe09 94fdcceb 5001e420 24126ea1",
    ]
    out = subprocess.run([host_check, "kat"], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == expected
    # the numpy model gives the same words
    ins = [
        (0, 0, 0, 0, 0, 0),
        (2**32 - 1,) * 6,
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
    ]
    for args, want in zip(ins, expected):
        got = " ".join(f"{int(w):08x}" for w in philox4x32_10(*args))
        assert got == want


@pytest.mark.parametrize(
    "seed,position", [(0, 0), (1, 2), (2**63 + 12345, 2**40 + 7), (-1 % 2**64, 2**64 - 1)]
)
def test_uniforms_host_code_matches_numpy(host_check, seed, position):
    out = subprocess.run(
        [host_check, "uniforms", str(seed), str(position), "1031"], capture_output=True, text=True, check=True
    ).stdout.split()
    got = np.array([float(v) for v in out], dtype=np.float32)
    want = uniforms(seed, position, 1031)
    np.testing.assert_array_equal(got, want)
    assert got.min() > 0 and got.max() < 1


# ------------------------------------------------------------------------------------------ sampler


def _run_sampler(host_check, tmp_path, logits, seeds, positions, t, top_k, top_p):
    rows, vocab = logits.shape
    f = tmp_path / "case.bin"
    header = np.array([rows, vocab], np.int32).tobytes() + np.float32(t).tobytes()
    header += np.int32(top_k).tobytes() + np.float32(top_p).tobytes()
    body = (
        logits.astype(np.float32).tobytes()
        + seeds.astype(np.int64).tobytes()
        + positions.astype(np.int64).tobytes()
    )
    f.write_bytes(header + body)
    lines = subprocess.run(
        [host_check, "sample", str(f)], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    toks = np.array([int(line.split()[0]) for line in lines if line])
    lps = np.array([float(line.split()[1]) for line in lines if line])
    return toks, lps


def _hostile_logits(rng, rows, vocab):
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    x[0, ::7] = -np.inf  # masked vocabulary
    x[1, :] = np.round(x[1, :])  # many exact ties (boundary ties of top-k and top-p)
    x[2, :] = x[2, :] * 1e4  # huge logits: a near one-hot distribution
    x[3, :] = 0.0  # uniform distribution: everything tied
    return x


@pytest.mark.parametrize(
    "t,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.8, 40, 0.7), (0.0, 0, 1.0), (1.0, 1, 1.0)],
)
def test_host_sampler_matches_numpy_model(host_check, tmp_path, t, top_k, top_p):
    rng = np.random.default_rng(int(t * 10) + top_k)
    rows, vocab = 8, 1000
    logits = _hostile_logits(rng, rows, vocab)
    seeds = rng.integers(0, 2**62, rows) * 3
    positions = rng.integers(0, 2**40, rows)
    toks, lps = _run_sampler(host_check, tmp_path, logits, seeds, positions, t, top_k, top_p)
    for r in range(rows):
        tok, lp = sample_model(logits[r], int(seeds[r]), int(positions[r]), t, top_k, top_p)
        assert toks[r] == tok, (r, toks[r], tok)
        assert abs(lps[r] - lp) <= 1e-5 * max(1.0, abs(lp)), (r, lps[r], lp)
        assert np.isfinite(lps[r]) and lps[r] <= 0


def test_host_sampler_top_p_keeps_ties_together(host_check, tmp_path):
    # p = (0.4, 0.2, 0.2, 0.2): with top_p = 0.5 the three tied tokens have 0.4 above them, < 0.5: all kept.
    logits = np.log(np.array([[0.4, 0.2, 0.2, 0.2]], np.float32))
    p = np.array([0.4, 0.2, 0.2, 0.2])
    seen = set()
    for seed in range(40):
        toks, lps = _run_sampler(host_check, tmp_path, logits, np.array([seed]), np.array([0]), 1.0, 0, 0.5)
        assert abs(lps[0] - np.log(p[toks[0]])) < 1e-6  # nothing dropped: the original probabilities
        seen.add(int(toks[0]))
    assert seen == {0, 1, 2, 3}
    # top_p = 0.4: the mass above the tied tokens is 0.4, not < 0.4: only the most likely token remains
    toks, lps = _run_sampler(host_check, tmp_path, logits, np.array([3]), np.array([0]), 1.0, 0, 0.4)
    assert toks[0] == 0 and abs(lps[0]) < 1e-6


def test_host_sampler_matches_library_reference(host_check, tmp_path):
    sampling = pytest.importorskip(
        "bitrl.kernels.sampling", reason="bitrl.kernels.sampling (the torch reference) is not in this tree"
    )
    rng = np.random.default_rng(5)
    logits = _hostile_logits(rng, 6, 777)
    seeds, positions = rng.integers(0, 2**62, 6), rng.integers(0, 2**40, 6)
    for t, k, p in [(1.0, 0, 1.0), (0.7, 30, 0.9), (0.0, 0, 1.0)]:
        toks, lps = _run_sampler(host_check, tmp_path, logits, seeds, positions, t, k, p)
        ref_t, ref_lp = sampling.fused_sample_reference(
            torch.from_numpy(logits), torch.from_numpy(seeds), torch.from_numpy(positions), t, k, p
        )
        np.testing.assert_array_equal(toks, ref_t.numpy())
        np.testing.assert_allclose(lps, ref_lp.numpy(), rtol=1e-5, atol=1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.9), (0.0, 0, 1.0), (1.0, 20, 1.0)])
def test_cuda_sampler_matches_reference(dtype, t, top_k, top_p):  # pragma: no cover - GPU only
    from bitrl.kernels.sampling import fused_sample_reference

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 151936, generator=g) * 3).to(dtype)
    logits[0, ::5] = float("-inf")
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    positions = torch.randint(0, 2**40, (64,), generator=g)
    tok, lp = cuda_ext.fused_sample_cuda(logits.cuda(), seeds.cuda(), positions.cuda(), t, top_k, top_p)
    ref_t, ref_lp = fused_sample_reference(logits, seeds, positions, t, top_k, top_p)
    agree = (tok.cpu() == ref_t).float().mean().item()
    assert agree >= 0.99, agree  # fp32 sums in another order may flip a boundary token, rarely
    same = tok.cpu() == ref_t
    torch.testing.assert_close(lp.cpu()[same], ref_lp[same], rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.gpu
def test_cuda_sampler_is_deterministic():  # pragma: no cover - GPU only
    """A sample depends only on (seed, sample id): repeated calls cut top-p at the same token (the mass
    histogram is fixed point, so the order of the threads' atomic adds cannot move the cut)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(64, 151936, generator=g) * 2).cuda()
    seeds = torch.randint(0, 2**62, (64,), generator=g).cuda()
    positions = torch.randint(0, 2**40, (64,), generator=g).cuda()
    first = cuda_ext.fused_sample_cuda(logits, seeds, positions, 1.0, 0, 0.9)
    for _ in range(20):
        again = cuda_ext.fused_sample_cuda(logits, seeds, positions, 1.0, 0, 0.9)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


# ------------------------------------------------------------------------------------------ FP4 GEMV


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 100), (16, 544)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp4_gemv_twin_matches_quant_dequantize(fmt, m, k, dtype):
    from bitrl.quant import quantize

    g = torch.Generator().manual_seed(m * k)
    w = torch.randn(40, k, generator=g)
    w[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -7.5, 6.0])  # zeros, deadzone, saturation
    qt = quantize(w, fmt)
    x = torch.randn(m, k, generator=g).to(dtype)
    got = fp4_gemv_reference(x, qt.data, qt.scale, fmt, k=k, tensor_scale=qt.tensor_scale)
    want = x.double() @ qt.dequantize(torch.float64).T
    assert got.dtype == torch.float32 and got.shape == (m, 40)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k)
    assert torch.equal(fp4_gemv(x, qt.data, qt.scale, fmt, k=k, tensor_scale=qt.tensor_scale), got)


def test_packed_weights_reach_the_kernel_aligned():
    """The FP4 GEMV kernel loads 8 packed bytes at a time: a contiguous view at an odd offset into a larger
    buffer is copied to an aligned address first (same bytes), an aligned one passes as it is."""
    from bitrl.kernels.fp4_gemv import aligned

    buf = torch.arange(1 + 4 * 16, dtype=torch.uint8)
    view = buf[1:].view(4, 16)
    assert view.is_contiguous() and view.data_ptr() % 8 != 0
    fixed = aligned(view, 8)
    assert fixed.data_ptr() % 8 == 0 and torch.equal(fixed, view)
    fresh = torch.zeros(4, 16, dtype=torch.uint8)
    assert aligned(fresh, 8) is fresh


def test_fp4_gemv_rejects_bad_input():
    from bitrl.quant import quantize

    qt = quantize(torch.randn(8, 64), "mxfp4")
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        fp4_gemv(torch.randn(17, 64), qt.data, qt.scale, "mxfp4", k=64)
    with pytest.raises(ValueError, match="fmt"):
        fp4_gemv(x, qt.data, qt.scale, "int4", k=64)
    with pytest.raises(ValueError, match="columns"):
        fp4_gemv(x, qt.data, qt.scale, "mxfp4", k=32)
    with pytest.raises(ValueError, match="tensor_scale"):
        fp4_gemv(x, qt.data, qt.scale, "mxfp4", k=64, tensor_scale=torch.ones(()))
    with pytest.raises(ValueError, match="scale"):  # bytes the kernel would decode as something else
        fp4_gemv(x, qt.data, qt.scale.view(torch.uint8).float(), "mxfp4", k=64)
    nv = quantize(torch.randn(8, 64), "nvfp4")
    with pytest.raises(ValueError, match="scale"):
        fp4_gemv(x, nv.data, nv.scale.view(torch.uint8), "nvfp4", k=64, tensor_scale=nv.tensor_scale)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 1000, 1000), (7, 33, 80)])
def test_cuda_fp4_gemv_matches_twin(fmt, m, n, k):  # pragma: no cover - GPU only
    from bitrl.quant import quantize

    qt = quantize(torch.randn(n, k, device="cuda"), fmt)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = fp4_gemv(x, qt.data, qt.scale, fmt, k=k, tensor_scale=qt.tensor_scale)
    want = fp4_gemv(x, qt.data, qt.scale, fmt, k=k, tensor_scale=qt.tensor_scale, impl="torch")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def nan_scaled(fmt: str, device: str):
    """A quantized [4, 64] weight whose row 2 has one NaN block scale (E4M3 0x7F, E8M0 0xFF)."""
    from bitrl.quant import quantize

    qt = quantize(torch.randn(4, 64, device=device), fmt)
    raw = qt.scale.view(torch.uint8)
    raw[2, 1] = 0x7F if fmt == "nvfp4" else 0xFF
    return qt


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_a_nan_block_scale_gives_nan_outputs_on_the_torch_twin(fmt):
    qt = nan_scaled(fmt, "cpu")
    got = fp4_gemv(
        torch.randn(3, 64), qt.data, qt.scale, fmt, k=64, tensor_scale=qt.tensor_scale, impl="torch"
    )
    assert got[:, 2].isnan().all() and got[:, [0, 1, 3]].isfinite().all()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_cuda_fp4_gemv_gives_nan_for_a_nan_block_scale(fmt):  # pragma: no cover - GPU only
    qt = nan_scaled(fmt, "cuda")
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    got = fp4_gemv(x, qt.data, qt.scale, fmt, k=64, tensor_scale=qt.tensor_scale)
    assert got[:, 2].isnan().all() and got[:, [0, 1, 3]].isfinite().all()
