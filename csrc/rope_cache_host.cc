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

#include <type_traits>
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

// The same pass over feature-major q, k, v (element (token i, feature j) at i + j * feat: slices of one
// [features, tokens] buffer), 16 tokens at a time: each head's [d, 16] block is read a cache line per feature
// into a [16, d] tile (in L1), then rotated and stored from there as above.
constexpr int64_t kTileTokens = 16;

template <bool kBf16>
void rope_store_feature_major(const void* q, const void* k, const void* v, const void* cos, const void* sin,
                              const int64_t* cols, void* q_out, void* k_cache, void* v_cache, int64_t rows,
                              int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t columns,
                              int64_t cache_row_stride, int64_t feat) {
  using T = std::conditional_t<kBf16, uint16_t, float>;
  const int64_t n = rows * tokens;
#pragma omp parallel for schedule(static) if (n * (q_heads + 2 * kv_heads) * d >= (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += kTileTokens) {
    const int64_t len = n - i0 < kTileTokens ? n - i0 : kTileTokens;
    std::vector<T> tile((size_t)(kTileTokens * d));
    // head `head` of x into the tile: tile[i * d + c] = x[(head * d + c) * feat + i0 + i]
    auto load_head = [&](const void* x, int64_t head) {
      const T* src = static_cast<const T*>(x) + head * d * feat + i0;
      for (int64_t c = 0; c < d; ++c) {
        for (int64_t i = 0; i < len; ++i) tile[i * d + c] = src[c * feat + i];
      }
    };
    for (int64_t hq = 0; hq < q_heads; ++hq) {
      load_head(q, hq);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t rt = i0 + i, r = rt / tokens, t = rt % tokens;
        rotate<kBf16>(tile.data(), i * d, cos, sin, rt * d, q_out, ((r * q_heads + hq) * tokens + t) * d, d);
      }
    }
    for (int64_t hk = 0; hk < kv_heads; ++hk) {
      load_head(k, hk);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t rt = i0 + i, r = rt / tokens;
        rotate<kBf16>(tile.data(), i * d, cos, sin, rt * d, k_cache,
                      r * cache_row_stride + (hk * columns + cols[rt]) * d, d);
      }
      load_head(v, hk);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t rt = i0 + i, r = rt / tokens;
        T* dst = static_cast<T*>(v_cache) + r * cache_row_stride + (hk * columns + cols[rt]) * d;
        memcpy(dst, tile.data() + i * d, d * sizeof(T));
      }
    }
  }
}

}  // namespace

extern "C" {

// q [rows, tokens, q_heads, d], k and v [rows, tokens, kv_heads, d]: element (token i, feature j) at
// i * q_tok + j * feat (k, v: i * kv_tok + j * feat), either per-head rows (feat 1, any token strides) or
// slices of a feature-major [features, tokens] buffer (feat = tokens, q_tok and kv_tok ignored: 1); cos and
// sin [rows, tokens, d] contiguous; all in one dtype
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
  if (feat != 1) {
    if (bf16) {
      rope_store_feature_major<true>(q, k, v, cos, sin, cols, q_out, k_cache, v_cache, rows, tokens, q_heads,
                                     kv_heads, d, columns, cache_row_stride, feat);
    } else {
      rope_store_feature_major<false>(q, k, v, cos, sin, cols, q_out, k_cache, v_cache, rows, tokens, q_heads,
                                      kv_heads, d, columns, cache_row_stride, feat);
    }
    return 0;
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
