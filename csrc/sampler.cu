// bitrl's fused sampler in CUDA C++: temperature, top-k, top-p, counter-based Gumbel-max sampling and the
// fp32 log-prob of the sampled token under the distribution sampled from, one thread block per row.
//
// Semantics (identical to bitrl.kernels.sampling.fused_sample_reference):
//   z_v = float(logit_v) / T (T == 0: greedy argmax, log-prob 0);
//   top-k keeps z_v >= the k-th largest z (boundary ties kept);
//   top-p keeps v when the mass of kept tokens with probability strictly above p_v is < top_p;
//   token = argmax over the kept support of z_v - log(-log(u_v)), u_v from Philox4x32-10 keyed by
//   (seed, position), lowest index on exact ties; log-prob = z_token - logsumexp(z over the kept support).
// Both selections are sort-free: four 8-bit radix passes over order-preserving float keys find the k-th
// largest value and the smallest kept probability exactly.
//
// Plain CUDA C++ (no ATen): extern "C" launchers over raw pointers and a stream, loaded with ctypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "sampler_core.h"

namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Block-wide sum and max (every thread gets the result). `red` holds kThreads / 32 floats.
__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];
  return s;
}

__device__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
  return m;
}

// Argmax with the lowest index on ties, block-wide.
__device__ void block_argmax(float* v, int* i, float* redv, int* redi) {
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, *v, o);
    int oi = __shfl_xor_sync(0xffffffffu, *i, o);
    if (ov > *v || (ov == *v && oi < *i)) {
      *v = ov;
      *i = oi;
    }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    redv[threadIdx.x >> 5] = *v;
    redi[threadIdx.x >> 5] = *i;
  }
  __syncthreads();
  *v = redv[0];
  *i = redi[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    if (redv[w] > *v || (redv[w] == *v && redi[w] < *i)) {
      *v = redv[w];
      *i = redi[w];
    }
  }
}

template <typename T>
__device__ __forceinline__ float scaled(const T* row, int v, float temperature) {
  return to_float(row[v]) / temperature;
}

// Descending radix selection over the keys of z: weight(v) = 1 (top-k, target k, not strict) or the
// probability p_v = exp(z_v - m) / norm (top-p, target top_p, strict). Only entries with key >= floor_key
// take part. Returns the selected key.
template <typename T, typename W>
__device__ uint32_t radix_select(const T* row, int vocab, float temperature, uint32_t floor_key, float m,
                                 float inv_norm, W target, bool strict, W* hist, uint32_t* shared_prefix) {
  uint32_t prefix = 0, prefix_mask = 0;
  W above = (W)0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += kThreads) hist[d] = (W)0;
    __syncthreads();
    for (int v = threadIdx.x; v < vocab; v += kThreads) {
      float z = scaled(row, v, temperature);
      uint32_t key = bitrl::float_key(__float_as_uint(z));
      if (key >= floor_key && (key & prefix_mask) == prefix) {
        atomicAdd(&hist[(key >> shift) & 255u], bitrl::selection_weight<W>(strict, z, m, inv_norm));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int d = bitrl::select_digit<W>(hist, &above, target, strict);
      prefix |= (uint32_t)d << shift;
      prefix_mask |= 255u << shift;
      shared_prefix[0] = prefix;
      shared_prefix[1] = prefix_mask;
    }
    __syncthreads();
    prefix = shared_prefix[0];
    prefix_mask = shared_prefix[1];
  }
  return prefix;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fused_sample_kernel(const T* __restrict__ logits, const int64_t* __restrict__ seeds,
                        const int64_t* __restrict__ positions, float temperature, int top_k, float top_p,
                        int64_t* __restrict__ tokens, float* __restrict__ logprobs, int vocab) {
  __shared__ float redv[kThreads / 32];
  __shared__ int redi[kThreads / 32];
  __shared__ uint32_t count_hist[256];
  __shared__ bitrl::Mass mass_hist[256];  // fixed point: the cut does not depend on the atomics' order
  __shared__ uint32_t shared_prefix[2];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * (int64_t)vocab;

  if (temperature == 0.f) {  // greedy
    float best = -INFINITY;
    int idx = vocab;
    for (int v = threadIdx.x; v < vocab; v += kThreads) {
      float x = to_float(row[v]);
      if (x > best || idx == vocab) {
        best = x;
        idx = v;
      }
    }
    block_argmax(&best, &idx, redv, redi);
    if (threadIdx.x == 0) {
      tokens[r] = idx;
      logprobs[r] = 0.f;
    }
    return;
  }

  float m = -INFINITY;
  for (int v = threadIdx.x; v < vocab; v += kThreads) m = fmaxf(m, scaled(row, v, temperature));
  m = block_max(m, redv);

  uint32_t thr = 0;  // keep v iff float_key(z_v) >= thr
  if (top_k > 0 && top_k < vocab)
    thr = radix_select<T, uint32_t>(row, vocab, temperature, 0u, m, 1.f, (uint32_t)top_k, false, count_hist,
                                    shared_prefix);
  if (top_p < 1.f) {
    float s = 0.f;
    for (int v = threadIdx.x; v < vocab; v += kThreads) {
      float z = scaled(row, v, temperature);
      if (bitrl::float_key(__float_as_uint(z)) >= thr) s += expf(z - m);
    }
    s = block_sum(s, redv);
    thr = radix_select<T, bitrl::Mass>(row, vocab, temperature, thr, m, 1.f / s, bitrl::mass_fixed(top_p),
                                       true, mass_hist, shared_prefix);
  }

  const uint64_t seed = (uint64_t)seeds[r], pos = (uint64_t)positions[r];
  float s = 0.f, best = -INFINITY, zbest = 0.f;
  int idx = vocab;
  for (int v = threadIdx.x; v < vocab; v += kThreads) {
    float z = scaled(row, v, temperature);
    if (bitrl::float_key(__float_as_uint(z)) < thr) continue;
    s += expf(z - m);
    float g = z - logf(-logf(bitrl::sample_uniform(seed, pos, (uint32_t)v)));
    if (g > best || idx == vocab) {
      best = g;
      idx = v;
      zbest = z;
    }
  }
  s = block_sum(s, redv);
  int winner = idx;
  float gbest = best;
  block_argmax(&gbest, &winner, redv, redi);
  __syncthreads();
  if (idx == winner && winner < vocab) {  // the owner of the winning entry writes
    tokens[r] = winner;
    logprobs[r] = (zbest - m) - logf(s);
  }
}

template <typename T>
cudaError_t launch(const T* logits, const int64_t* seeds, const int64_t* positions, float temperature,
                   int top_k, float top_p, int64_t* tokens, float* logprobs, int rows, int vocab,
                   cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || temperature < 0.f || !(top_p > 0.f) || top_p > 1.f || top_k < 0)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  fused_sample_kernel<T><<<rows, kThreads, 0, stream>>>(logits, seeds, positions, temperature, top_k, top_p,
                                                        tokens, logprobs, vocab);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

cudaError_t bitrl_fused_sample_f32(const float* logits, const int64_t* seeds, const int64_t* positions,
                                   float temperature, int top_k, float top_p, int64_t* tokens, float* logprobs,
                                   int rows, int vocab, cudaStream_t stream) {
  return launch(logits, seeds, positions, temperature, top_k, top_p, tokens, logprobs, rows, vocab, stream);
}

cudaError_t bitrl_fused_sample_bf16(const __nv_bfloat16* logits, const int64_t* seeds, const int64_t* positions,
                                    float temperature, int top_k, float top_p, int64_t* tokens,
                                    float* logprobs, int rows, int vocab, cudaStream_t stream) {
  return launch(logits, seeds, positions, temperature, top_k, top_p, tokens, logprobs, rows, vocab, stream);
}

cudaError_t bitrl_fused_sample_f16(const __half* logits, const int64_t* seeds, const int64_t* positions,
                                   float temperature, int top_k, float top_p, int64_t* tokens, float* logprobs,
                                   int rows, int vocab, cudaStream_t stream) {
  return launch(logits, seeds, positions, temperature, top_k, top_p, tokens, logprobs, rows, vocab, stream);
}

}  // extern "C"
