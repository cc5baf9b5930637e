// FP4 decode GEMV: out[M, N] (fp32) = x[M, K] (bf16) @ deq(W)[N, K]^T for M <= 16 rows, the memory-bound
// decode case. W is stored as bitrl.quant stores it: E2M1 codes two per byte ([N, Kp/2] uint8, element 2i in
// the low nibble, code = sign << 3 | exponent << 1 | mantissa) and one scale byte per block along K
// ([N, Kp/bw]): MXFP4 an E8M0 biased exponent over 32 elements, NVFP4 an E4M3 value over 16 elements times
// an fp32 tensor scale. The weight is dequantized in registers (never written out): every byte of W is read
// once from HBM, which is what bounds this kernel.
//
// One warp per weight row; each lane decodes 16 elements (8 bytes) per step, so the warp covers 512 elements
// of K per step. The activations of that K slice are staged once per block in shared memory (zero beyond K)
// and reused by the block's 8 warps. fp32 accumulation, warp-shuffle reduction.
//
// Plain CUDA C++ (no ATen): extern "C" launchers over raw pointers and a stream, loaded with ctypes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kWarps = 8;
constexpr int kMaxRows = 16;
constexpr int kLaneElems = 16;
constexpr int kStep = 32 * kLaneElems;  // elements of K per warp step

__device__ __forceinline__ float e2m1_value(uint32_t code) {
  // 0, 0.5 (subnormal) and 2^(e - 1) * (1 + m / 2) for exponent field e >= 1: 1, 1.5, 2, 3, 4, 6
  uint32_t e = (code >> 1) & 3u, mant = code & 1u;
  float v = e == 0 ? 0.5f * (float)mant : __uint_as_float(((e + 126u) << 23) | (mant << 22));
  return (code & 8u) ? -v : v;
}

__device__ __forceinline__ float e8m0_value(uint32_t b) {
  if (b == 0xFFu) return __uint_as_float(0x7FC00000u);  // the E8M0 NaN: a NaN scale shows in the output
  return b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);  // 2^(b - 127)
}

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  if ((b & 0x7Fu) == 0x7Fu) return __uint_as_float(0x7FC00000u);  // E4M3 (fn) NaN, not 480
  uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -v : v;
}

template <bool NV>
__global__ void __launch_bounds__(kWarps * 32)
    fp4_gemv_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w,
                    const uint8_t* __restrict__ scale, const float* __restrict__ tensor_scale,
                    float* __restrict__ out, int m, int n, int k, int kp) {
  constexpr int kBlock = NV ? 16 : 32;
  __shared__ __nv_bfloat16 xs[kMaxRows][kStep];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = (int64_t)blockIdx.x * kWarps + warp;
  const bool active = row < n;
  const int64_t row_bytes = kp / 2, row_scales = kp / kBlock;
  const uint8_t* wrow = w + row * row_bytes;
  const uint8_t* srow = scale + row * row_scales;
  float acc[kMaxRows];
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) acc[i] = 0.f;

  for (int k0 = 0; k0 < kp; k0 += kStep) {
    __syncthreads();  // the previous slice is consumed
    for (int idx = threadIdx.x; idx < m * kStep; idx += kWarps * 32) {
      int r = idx / kStep, c = idx - r * kStep;
      xs[r][c] = (k0 + c < k) ? x[(int64_t)r * k + k0 + c] : __float2bfloat16(0.f);
    }
    __syncthreads();
    const int e0 = k0 + lane * kLaneElems;  // first element of this lane
    if (!active || e0 >= kp) continue;
    uint2 packed = *reinterpret_cast<const uint2*>(wrow + e0 / 2);
    float s = NV ? e4m3_value(srow[e0 / kBlock]) : e8m0_value(srow[e0 / kBlock]);
    float wv[kLaneElems];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t byte = ((j < 4 ? packed.x : packed.y) >> (8 * (j & 3))) & 0xFFu;
      wv[2 * j] = e2m1_value(byte & 15u) * s;
      wv[2 * j + 1] = e2m1_value(byte >> 4) * s;
    }
#pragma unroll
    for (int i = 0; i < kMaxRows; ++i) {
      if (i < m) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < kLaneElems; ++j) a += __bfloat162float(xs[i][lane * kLaneElems + j]) * wv[j];
        acc[i] += a;
      }
    }
  }
  if (!active) return;
  const float ts = tensor_scale ? *tensor_scale : 1.f;
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    if (i < m) {
      float a = acc[i];
      for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane == 0) out[(int64_t)i * n + row] = a * ts;
    }
  }
}

template <bool NV>
cudaError_t launch(const __nv_bfloat16* x, const uint8_t* w, const uint8_t* scale, const float* tensor_scale,
                   float* out, int m, int n, int k, int kp, cudaStream_t stream) {
  constexpr int kBlock = NV ? 16 : 32;
  if (m < 1 || m > kMaxRows || n < 0 || k < 1 || kp < k || kp % kBlock) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  fp4_gemv_kernel<NV><<<(n + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(x, w, scale, tensor_scale, out, m,
                                                                               n, k, kp);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// x [m, k] bf16 row-major; w [n, kp/2] uint8; scale [n, kp/32] E8M0 bytes; out [m, n] fp32.
cudaError_t bitrl_fp4_gemv_mxfp4(const __nv_bfloat16* x, const uint8_t* w, const uint8_t* scale, float* out,
                                 int m, int n, int k, int kp, cudaStream_t stream) {
  return launch<false>(x, w, scale, nullptr, out, m, n, k, kp, stream);
}

// x [m, k] bf16 row-major; w [n, kp/2] uint8; scale [n, kp/16] E4M3 bytes; tensor_scale: 1 fp32 on device.
cudaError_t bitrl_fp4_gemv_nvfp4(const __nv_bfloat16* x, const uint8_t* w, const uint8_t* scale,
                                 const float* tensor_scale, float* out, int m, int n, int k, int kp,
                                 cudaStream_t stream) {
  return launch<true>(x, w, scale, tensor_scale, out, m, n, k, kp, stream);
}

}  // extern "C"
