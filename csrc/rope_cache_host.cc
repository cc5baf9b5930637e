// The rotary embedding of a decode step's queries and keys, with the keys and values stored into the KV
// cache in the same pass: one call per layer where torch runs about twenty small ops (transposes, the two
// halves' negation and concatenation, four products, two sums, the cache's index arithmetic and copies),
// each of which pays the interpreter's cache misses after the layer's matrix products.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
//
// Numerics: the formula x cos + rotate_half(x) sin as torch evaluates it in the tensors' dtype: each product
// and the sum rounded to that dtype (bf16: computed in fp32, rounded to nearest even; NaN stays NaN), no
// contraction into FMAs. So the results have the bits of the torch ops they replace.
#include <stdint.h>
#include <string.h>

#include <vector>

#include "host_math.h"

using bitrl_host::bf16_to_float;
using bitrl_host::float_to_bf16;

namespace {

template <bool kBf16>
inline float load(const void* p, int64_t i) {
  if constexpr (kBf16) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

template <bool kBf16>
inline float round_to(float x) {
  if constexpr (kBf16) {
    return x != x ? x : bf16_to_float(float_to_bf16(x));
  } else {
    return x;
  }
}

template <bool kBf16>
inline void store(void* p, int64_t i, float x) {
  if constexpr (kBf16) {
    static_cast<uint16_t*>(p)[i] = x != x ? (uint16_t)0x7FC0u : float_to_bf16(x);
  } else {
    static_cast<float*>(p)[i] = x;
  }
}

// out[0, d) = x[0, d) cos + rotate_half(x) sin, rotate_half(x) = (-x[h, d), x[0, h)), h = d / 2 (two loops
// without a branch, so that each vectorizes)
template <bool kBf16>
inline void rotate(const void* x, int64_t x_off, const void* cos, const void* sin, int64_t cs_off, void* out,
                   int64_t out_off, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t c = 0; c < h; ++c) {
    const float a = round_to<kBf16>(load<kBf16>(x, x_off + c) * load<kBf16>(cos, cs_off + c));
    const float b = round_to<kBf16>(-load<kBf16>(x, x_off + c + h) * load<kBf16>(sin, cs_off + c));
    store<kBf16>(out, out_off + c, a + b);
  }
  for (int64_t c = h; c < d; ++c) {
    const float a = round_to<kBf16>(load<kBf16>(x, x_off + c) * load<kBf16>(cos, cs_off + c));
    const float b = round_to<kBf16>(load<kBf16>(x, x_off + c - h) * load<kBf16>(sin, cs_off + c));
    store<kBf16>(out, out_off + c, a + b);
  }
}

// q [R * T, q_heads * d] and k, v [R * T, kv_heads * d] at row strides q_tok and kv_tok (features contiguous)
template <bool kBf16>
void rope_store(const void* q, const void* k, const void* v, const void* cos, const void* sin,
                const int64_t* cols, void* q_out, void* k_cache, void* v_cache, int64_t rows, int64_t tokens,
                int64_t q_heads, int64_t kv_heads, int64_t d, int64_t columns, int64_t cache_row_stride,
                int64_t q_tok, int64_t kv_tok) {
  const int64_t elem = kBf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * tokens * (q_heads + 2 * kv_heads) * d >= (1 << 14))
  for (int64_t rt = 0; rt < rows * tokens; ++rt) {
    const int64_t r = rt / tokens, t = rt % tokens;
    const int64_t col = cols[rt];
    for (int64_t hq = 0; hq < q_heads; ++hq) {  // q [R, T, Hq, d] -> q_out [R, Hq, T, d]
      rotate<kBf16>(q, rt * q_tok + hq * d, cos, sin, rt * d, q_out, ((r * q_heads + hq) * tokens + t) * d, d);
    }
    for (int64_t hk = 0; hk < kv_heads; ++hk) {  // k, v [R, T, Hk, d] -> cache [R, Hk, C, d] at column col
      const int64_t in = rt * kv_tok + hk * d, at = r * cache_row_stride + (hk * columns + col) * d;
      rotate<kBf16>(k, in, cos, sin, rt * d, k_cache, at, d);
      memcpy(static_cast<char*>(v_cache) + at * elem, static_cast<const char*>(v) + in * elem, d * elem);
    }
  }
}

// dst [n, f] (row-major) <- src, element (i, j) of src at i * tok + j * feat: a feature-major [f, tokens]
// slice brought to rows of features, in 16 x 16 tiles (each cache line of src read once). T: the element's
// storage (uint16_t for bf16, float for fp32): values are moved, never converted.
template <typename T>
void gather_tokens(const T* src, int64_t tok, int64_t feat, T* dst, int64_t n, int64_t f) {
  constexpr int64_t kTile = 16;
#pragma omp parallel for schedule(static) if (n * f >= (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    const int64_t i1 = i0 + kTile < n ? i0 + kTile : n;
    for (int64_t j0 = 0; j0 < f; j0 += kTile) {
      const int64_t j1 = j0 + kTile < f ? j0 + kTile : f;
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = i0; i < i1; ++i) dst[i * f + j] = src[i * tok + j * feat];
      }
    }
  }
}

// q, k, v gathered into one scratch buffer of rows of features; the pointers and token strides moved there
template <typename T>
void gather_qkv(const void*& q, const void*& k, const void*& v, int64_t& q_tok, int64_t& kv_tok, int64_t feat,
                int64_t n, int64_t qf, int64_t kf, std::vector<T>& scratch) {
  if (scratch.size() < (size_t)(n * (qf + 2 * kf))) scratch.resize((size_t)(n * (qf + 2 * kf)));
  T* dst = scratch.data();
  gather_tokens(static_cast<const T*>(q), q_tok, feat, dst, n, qf);
  gather_tokens(static_cast<const T*>(k), kv_tok, feat, dst + n * qf, n, kf);
  gather_tokens(static_cast<const T*>(v), kv_tok, feat, dst + n * (qf + kf), n, kf);
  q = dst, k = dst + n * qf, v = dst + n * (qf + kf);
  q_tok = qf, kv_tok = kf;
}

}  // namespace

extern "C" {

// q [rows, tokens, q_heads, d], k and v [rows, tokens, kv_heads, d]: element (token i, feature j) at
// i * q_tok + j * feat (k, v: i * kv_tok + j * feat), so per-head rows (feat 1) or slices of a feature-major
// [features, tokens] buffer (tok 1, feat = tokens); cos and sin [rows, tokens, d] contiguous; all in one dtype
// (bf16: 1, fp32: 0); cols [rows, tokens] int64: the cache column of each token.
// Writes q_out [rows, q_heads, tokens, d] (contiguous) and the caches [rows, kv_heads, columns, d] (rows
// cache_row_stride elements apart, the rest contiguous). Returns 0, or (writing nothing) 1 + the index of
// the first column outside [0, columns).
int64_t bitrl_rope_store(const void* q, const void* k, const void* v, const void* cos, const void* sin,
                      const int64_t* cols, void* q_out, void* k_cache, void* v_cache, int64_t rows,
                      int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t columns,
                      int64_t cache_row_stride, int64_t q_tok, int64_t kv_tok, int64_t feat, int bf16) {
  for (int64_t i = 0; i < rows * tokens; ++i) {
    if (cols[i] < 0 || cols[i] >= columns) return 1 + i;
  }
  // kept between calls: a fresh buffer of this size is fresh pages (faults and zeroing) on every layer
  thread_local std::vector<uint16_t> scratch_bf16;
  thread_local std::vector<float> scratch_f32;
  if (feat != 1) {  // feature-major: each token's features gathered into contiguous rows first
    const int64_t n = rows * tokens, qf = q_heads * d, kf = kv_heads * d;
    if (bf16) {
      gather_qkv(q, k, v, q_tok, kv_tok, feat, n, qf, kf, scratch_bf16);
    } else {
      gather_qkv(q, k, v, q_tok, kv_tok, feat, n, qf, kf, scratch_f32);
    }
  }
  if (bf16) {
    rope_store<true>(q, k, v, cos, sin, cols, q_out, k_cache, v_cache, rows, tokens, q_heads, kv_heads, d,
                     columns, cache_row_stride, q_tok, kv_tok);
  } else {
    rope_store<false>(q, k, v, cos, sin, cols, q_out, k_cache, v_cache, rows, tokens, q_heads, kv_heads, d,
                      columns, cache_row_stride, q_tok, kv_tok);
  }
  return 0;
}

}  // extern "C"
