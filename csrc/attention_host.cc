// Attention of a few new tokens per row over a KV cache on the CPU: the decode step's attention for
// bitrl.rollout.decoder (one query token per row, or a draft's few), where F.scaled_dot_product_attention
// runs hundreds of tiny batched products per layer.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
//
// Numerics: fp32 throughout (bf16 inputs widened exactly, the output rounded once to nearest even). Each
// score is q . k summed over head_dim in ascending order, times the scale; the softmax takes the visible
// columns in ascending order (max, then the sum of 2^((s - max) log2 e) by host_math.h's polynomial), and
// the output adds p v over the same columns in the same order. So a query's result depends on its own
// vector and the columns it sees only: not on the rows, tokens or masked columns beside it. A NaN in a
// visible score makes its query's output NaN; a query that sees no column gets zeros.
#include <math.h>
#include <stdint.h>

#include <vector>

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

// acc[c] += p * v[off + c], c < d
template <bool kBf16>
inline void axpy(float p, const void* v, int64_t off, float* __restrict acc, int64_t d) {
  if constexpr (kBf16) {
    const uint16_t* __restrict x = static_cast<const uint16_t*>(v) + off;
    for (int64_t c = 0; c < d; ++c) acc[c] += p * bf16_to_float(x[c]);
  } else {
    const float* __restrict x = static_cast<const float*>(v) + off;
    for (int64_t c = 0; c < d; ++c) acc[c] += p * x[c];
  }
}

// q . k over d: 16 lanes each summing every 16th product in ascending order, then the lanes added in a
// fixed tree. d is a multiple of 16 (the caller checks).
inline float dot16(const float* __restrict q, const float* __restrict k, int64_t d) {
  float lane[kLanes] = {};
  for (int64_t c = 0; c < d; c += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] += q[c + j] * k[c + j];
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

// One (row, kv head): queries q [m, d], keys and values k, v [width, d] (element offsets into their
// buffers), the visible mask row of query i at vis + (i % tokens) * vis_stride, output out [m, d].
template <bool kBf16>
__attribute__((always_inline)) inline void attend_head(const void* q, int64_t q_off, const void* k,
                                                       const void* v, int64_t kv_off, const uint8_t* vis,
                                                       int64_t vis_stride, int64_t tokens, void* out, int64_t m,
                                                       int64_t width, int64_t d, float scale, float* scores,
                                                       float* qf, float* kt, float* acc) {
  for (int64_t i = 0; i < m * d; ++i) qf[i] = load<kBf16>(q, q_off + i);
  for (int64_t w = 0; w < width; ++w) {
    bool seen = false;
    for (int64_t i = 0; i < m && !seen; ++i) seen = vis[(i % tokens) * vis_stride + w];
    if (!seen) {
      for (int64_t i = 0; i < m; ++i) scores[i * width + w] = -INFINITY;
      continue;
    }
    for (int64_t c = 0; c < d; ++c) kt[c] = load<kBf16>(k, kv_off + w * d + c);
    for (int64_t i = 0; i < m; ++i) {
      const bool see = vis[(i % tokens) * vis_stride + w];
      scores[i * width + w] = see ? dot16(qf + i * d, kt, d) * scale : -INFINITY;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    float* s = scores + i * width;
    float mx = -INFINITY;
    bool nan = false;
    for (int64_t w = 0; w < width; ++w) {
      nan |= s[w] != s[w];
      mx = s[w] > mx ? s[w] : mx;
    }
    for (int64_t c = 0; c < d; ++c) acc[c] = 0.0f;
    float total = 0.0f;
    if (mx != -INFINITY && !nan) {
      for (int64_t w = 0; w < width; ++w) s[w] = exp2_poly((s[w] - mx) * kLog2e);  // masked: 2^-inf = 0
      for (int64_t w = 0; w < width; ++w) total += s[w];
      // every column multiplies (masked ones by 0), as in the product of the probabilities with V
      for (int64_t w = 0; w < width; ++w) axpy<kBf16>(s[w], v, kv_off + w * d, acc, d);
    }
    const float inv = nan ? NAN : (total > 0.0f ? 1.0f / total : 0.0f);
    for (int64_t c = 0; c < d; ++c) {
      const float o = acc[c] * inv;
      if constexpr (kBf16) {
        static_cast<uint16_t*>(out)[q_off + i * d + c] = o != o ? (uint16_t)0x7FC0u : float_to_bf16(o);
      } else {
        static_cast<float*>(out)[q_off + i * d + c] = o;
      }
    }
  }
}

// The per-head body compiled once per dtype and instruction set (target_clones does not reach templates).
#define BITRL_ATTEND_HEAD_ARGS                                                                             \
  const void *q, int64_t q_off, const void *k, const void *v, int64_t kv_off, const uint8_t *vis,             \
      int64_t vis_stride, int64_t tokens, void *out, int64_t m, int64_t width, int64_t d, float scale,       \
      float *scores, float *qf, float *kt, float *acc
#define BITRL_ATTEND_HEAD_CALL \
  q, q_off, k, v, kv_off, vis, vis_stride, tokens, out, m, width, d, scale, scores, qf, kt, acc
__attribute__((target_clones("avx512f", "avx2", "default"))) void attend_head_bf16(BITRL_ATTEND_HEAD_ARGS) {
  attend_head<true>(BITRL_ATTEND_HEAD_CALL);
}
__attribute__((target_clones("avx512f", "avx2", "default"))) void attend_head_f32(BITRL_ATTEND_HEAD_ARGS) {
  attend_head<false>(BITRL_ATTEND_HEAD_CALL);
}

template <bool kBf16>
void attend(const void* q, const void* k, const void* v, const uint8_t* vis, void* out, int64_t rows,
            int64_t heads, int64_t m, int64_t tokens, int64_t width, int64_t d, int64_t columns,
            int64_t vis_row_stride, int64_t vis_stride, float scale) {
#pragma omp parallel
  {
    std::vector<float> scores(m * width), qf(m * d), kt(d), acc(d);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * heads; ++rh) {
      const int64_t r = rh / heads;
      (kBf16 ? attend_head_bf16 : attend_head_f32)(q, rh * m * d, k, v, rh * columns * d,
                                                  vis + r * vis_row_stride, vis_stride, tokens, out, m,
                                                  width, d, scale, scores.data(), qf.data(), kt.data(),
                                                  acc.data());
    }
  }
}

}  // namespace

extern "C" {

// q, out: [rows, heads, m, d] contiguous (m = group x tokens: query head g * tokens + t of kv head h reads
// token t); k, v: [rows, heads, columns, d] contiguous, the first `width` columns attended; vis: bool
// [rows, tokens, width] with strides (vis_row_stride, vis_stride, 1). bf16: 1 for bf16 tensors, 0 for fp32.
void bitrl_decode_attention(const void* q, const void* k, const void* v, const uint8_t* vis, void* out,
                            int64_t rows, int64_t heads, int64_t m, int64_t tokens, int64_t width, int64_t d,
                            int64_t columns, int64_t vis_row_stride, int64_t vis_stride, float scale,
                            int bf16) {
  if (bf16) {
    attend<true>(q, k, v, vis, out, rows, heads, m, tokens, width, d, columns, vis_row_stride, vis_stride,
                 scale);
  } else {
    attend<false>(q, k, v, vis, out, rows, heads, m, tokens, width, d, columns, vis_row_stride, vis_stride,
                  scale);
  }
}

}  // extern "C"
