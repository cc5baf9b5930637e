// The row-wise parts of bitrl's matched-precision mode on the CPU (bitrl.kernels.aligned): RMSNorm, the
// gated SiLU of the MLP, and the log-softmax statistics of logits rows. The rollout decoder (rows x 1 token
// per step) and the trainer's forward (rows x sequence) call these same functions, so each output depends
// on its own row only: the order of every sum is fixed by the row length, never by the number of rows, the
// threads or the vector width (each of the 16 lanes sums every 16th term in ascending order, then the lanes
// are added in a fixed tree; host_math.h's polynomial replaces libm's exp, which differs between its scalar
// and vector forms). Built with -ffp-contract=off: no FMA contraction, so every clone gives the same bits.
//
// Numerics: fp32 throughout; bf16 inputs widened exactly, outputs rounded to nearest even.
#include <math.h>
#include <stdint.h>

#include "host_math.h"

using bitrl_host::bf16_to_float;
using bitrl_host::exp2_poly;
using bitrl_host::float_to_bf16;
using bitrl_host::kLog2e;

namespace {

constexpr int kLanes = 16;

template <bool kBf16>
inline float load(const void* base, int64_t i) {
  if constexpr (kBf16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

// Rounds to the storage dtype and back: the value a tensor of that dtype holds.
template <bool kBf16>
inline float round_to(float x) {
  if constexpr (kBf16) return x != x ? x : bf16_to_float(float_to_bf16(x));
  return x;
}

template <bool kBf16>
inline void store(void* base, int64_t i, float x) {
  if constexpr (kBf16) {
    static_cast<uint16_t*>(base)[i] = x != x ? (uint16_t)0x7FC0u : float_to_bf16(x);
  } else {
    static_cast<float*>(base)[i] = x;
  }
}

inline float lane_total(float* lane) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

// out = w * round(x / sqrt(mean(x^2) + eps)), as Hugging Face's Llama RMSNorm writes it.
template <bool kBf16>
__attribute__((always_inline)) inline void rms_norm_row(const void* x, const void* w, void* out, int64_t row,
                                                        int64_t h, float eps) {
  const int64_t off = row * h;
  float lane[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= h; c += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = load<kBf16>(x, off + c + j);
      lane[j] += v * v;
    }
  }
  for (int j = 0; c + j < h; ++j) {
    const float v = load<kBf16>(x, off + c + j);
    lane[j] += v * v;
  }
  const float inv = 1.0f / sqrtf(lane_total(lane) / (float)h + eps);
  for (int64_t k = 0; k < h; ++k) {
    const float y = round_to<kBf16>(load<kBf16>(x, off + k) * inv);
    store<kBf16>(out, off + k, load<kBf16>(w, k) * y);
  }
}

// Each kernel's body runs as a target clone called from inside its OpenMP loop: a clone of the function
// holding the loop would not reach the loop's body, which the compiler outlines (and builds for the baseline
// ISA only). Every clone gives the same bits (explicit lanes, no FMA contraction).
#define BITRL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

BITRL_CLONES void rms_norm_rows_bf16(const void* x, const void* w, void* out, int64_t row, int64_t h, float eps) {
  rms_norm_row<true>(x, w, out, row, h, eps);
}

BITRL_CLONES void rms_norm_rows_f32(const void* x, const void* w, void* out, int64_t row, int64_t h, float eps) {
  rms_norm_row<false>(x, w, out, row, h, eps);
}

void rms_norm_bf16(const void* x, const void* w, void* out, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_norm_rows_bf16(x, w, out, r, h, eps);
}

void rms_norm_f32(const void* x, const void* w, void* out, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rms_norm_rows_f32(x, w, out, r, h, eps);
}

// The same norm of every column of x [h, n] (one token per column: a decode step whose activations are
// feature-major, bitrl.kernels.weight_major), with the bits of rms_norm_row: lane j still sums the squares of
// features j, j + 16, ... in ascending order and the lanes meet in lane_total's tree; the loops run across a
// block of columns instead, so they vectorize over tokens.
constexpr int64_t kColumnBlock = 64;

template <bool kBf16>
__attribute__((always_inline)) inline void rms_norm_column_block(const void* x, const void* w, void* out,
                                                                 int64_t h, int64_t n, int64_t start,
                                                                 int64_t end, float eps) {
  float lanes[kLanes][kColumnBlock] = {};
  const int64_t width = end - start;
  for (int64_t k = 0; k < h; ++k) {
    float* acc = lanes[k % kLanes];
    for (int64_t c = 0; c < width; ++c) {
      const float v = load<kBf16>(x, k * n + start + c);
      acc[c] += v * v;
    }
  }
  float inv[kColumnBlock];
  for (int64_t c = 0; c < width; ++c) {
    float lane[kLanes];
    for (int j = 0; j < kLanes; ++j) lane[j] = lanes[j][c];
    inv[c] = 1.0f / sqrtf(lane_total(lane) / (float)h + eps);
  }
  for (int64_t k = 0; k < h; ++k) {
    const float wk = load<kBf16>(w, k);
    for (int64_t c = 0; c < width; ++c) {
      const float y = round_to<kBf16>(load<kBf16>(x, k * n + start + c) * inv[c]);
      store<kBf16>(out, k * n + start + c, wk * y);
    }
  }
}

BITRL_CLONES void rms_norm_column_block_bf16(const void* x, const void* w, void* out, int64_t h, int64_t n,
                                             int64_t start, int64_t end, float eps) {
  rms_norm_column_block<true>(x, w, out, h, n, start, end, eps);
}

BITRL_CLONES void rms_norm_column_block_f32(const void* x, const void* w, void* out, int64_t h, int64_t n,
                                            int64_t start, int64_t end, float eps) {
  rms_norm_column_block<false>(x, w, out, h, n, start, end, eps);
}

void rms_norm_columns(const void* x, const void* w, void* out, int64_t h, int64_t n, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (h * n >= (1 << 14))
  for (int64_t s = 0; s < n; s += kColumnBlock) {
    const int64_t e = s + kColumnBlock < n ? s + kColumnBlock : n;
    if (bf16) {
      rms_norm_column_block_bf16(x, w, out, h, n, s, e, eps);
    } else {
      rms_norm_column_block_f32(x, w, out, h, n, s, e, eps);
    }
  }
}

// out = round(round(silu(g)) * u), silu(g) = g / (1 + e^-g): the MLP's act_fn(gate) * up, each product
// rounded to the storage dtype as the two torch ops would.
template <bool kBf16>
__attribute__((always_inline)) inline void silu_mul_range(const void* gate, const void* up, void* out,
                                                          int64_t start, int64_t end) {
  for (int64_t i = start; i < end; ++i) {
    const float g = load<kBf16>(gate, i);
    const float s = round_to<kBf16>(g / (1.0f + exp2_poly(-g * kLog2e)));
    store<kBf16>(out, i, s * load<kBf16>(up, i));
  }
}

constexpr int64_t kChunk = 4096;

BITRL_CLONES void silu_mul_chunk_bf16(const void* gate, const void* up, void* out, int64_t start, int64_t end) {
  silu_mul_range<true>(gate, up, out, start, end);
}

BITRL_CLONES void silu_mul_chunk_f32(const void* gate, const void* up, void* out, int64_t start, int64_t end) {
  silu_mul_range<false>(gate, up, out, start, end);
}

void silu_mul(const void* gate, const void* up, void* out, int64_t n, int bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < n; s += kChunk) {
    const int64_t e = s + kChunk < n ? s + kChunk : n;
    if (bf16) {
      silu_mul_chunk_bf16(gate, up, out, s, e);
    } else {
      silu_mul_chunk_f32(gate, up, out, s, e);
    }
  }
}

// One logits row z [v] at u = z * inv_t: lse = max + log(sum 2^((u - max) log2 e)), logprob = u[target] - lse
// (0 for target < 0), entropy = lse - sum p u. A NaN anywhere in the row makes both NaN.
template <bool kBf16>
__attribute__((always_inline)) inline void logprob_row(const void* z, int64_t off, int64_t v, float inv_t,
                                                       int64_t target, float* lp, float* entropy) {
  float mx = -INFINITY;
  bool nan = false;
  for (int64_t c = 0; c < v; ++c) {
    const float u = load<kBf16>(z, off + c) * inv_t;
    nan |= u != u;
    mx = u > mx ? u : mx;
  }
  if (nan || mx == -INFINITY) {  // no finite maximum: nothing to normalise
    *lp = NAN;
    *entropy = NAN;
    return;
  }
  float mass[kLanes] = {}, moment[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= v; c += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float u = load<kBf16>(z, off + c + j) * inv_t;
      const float e = exp2_poly((u - mx) * kLog2e);
      mass[j] += e;
      moment[j] += u == -INFINITY ? 0.0f : e * u;  // e = 0 there: 0 * -inf would be NaN
    }
  }
  for (int j = 0; c + j < v; ++j) {
    const float u = load<kBf16>(z, off + c + j) * inv_t;
    const float e = exp2_poly((u - mx) * kLog2e);
    mass[j] += e;
    moment[j] += u == -INFINITY ? 0.0f : e * u;
  }
  const float total = lane_total(mass);
  const float lse = mx + logf(total);
  *entropy = lse - lane_total(moment) / total;
  *lp = target < 0 ? 0.0f : load<kBf16>(z, off + target) * inv_t - lse;
}

BITRL_CLONES void logprob_row_bf16(const void* z, int64_t off, int64_t v, float inv_t, int64_t target, float* lp,
                                   float* entropy) {
  logprob_row<true>(z, off, v, inv_t, target, lp, entropy);
}

BITRL_CLONES void logprob_row_f32(const void* z, int64_t off, int64_t v, float inv_t, int64_t target, float* lp,
                                  float* entropy) {
  logprob_row<false>(z, off, v, inv_t, target, lp, entropy);
}

void logprobs(const void* z, const int64_t* targets, int64_t rows, int64_t v, int64_t ld, float inv_t, float* lp,
              float* entropy, int bf16) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      logprob_row_bf16(z, r * ld, v, inv_t, targets[r], lp + r, entropy + r);
    } else {
      logprob_row_f32(z, r * ld, v, inv_t, targets[r], lp + r, entropy + r);
    }
  }
}

}  // namespace

extern "C" {

// x, out: [rows, h] contiguous; w: [h]; all bf16 (bf16 = 1) or all fp32.
void bitrl_aligned_rms_norm(const void* x, const void* w, void* out, int64_t rows, int64_t h, float eps,
                            int bf16) {
  if (bf16) {
    rms_norm_bf16(x, w, out, rows, h, eps);
  } else {
    rms_norm_f32(x, w, out, rows, h, eps);
  }
}

// x, out: [h, n] contiguous (a column per token); w: [h]; all bf16 (bf16 = 1) or all fp32.
void bitrl_rms_norm_columns(const void* x, const void* w, void* out, int64_t h, int64_t n, float eps, int bf16) {
  rms_norm_columns(x, w, out, h, n, eps, bf16);
}

// gate, up, out: n contiguous elements, all bf16 or all fp32.
void bitrl_aligned_silu_mul(const void* gate, const void* up, void* out, int64_t n, int bf16) {
  silu_mul(gate, up, out, n, bf16);
}

// z: [rows, v] with row stride ld (elements); targets: [rows] int64 (< 0: no target); lp, entropy: [rows] fp32.
void bitrl_aligned_logprobs(const void* z, const int64_t* targets, int64_t rows, int64_t v, int64_t ld,
                            float inv_t, float* lp, float* entropy, int bf16) {
  logprobs(z, targets, rows, v, ld, inv_t, lp, entropy, bf16);
}

}  // extern "C"
