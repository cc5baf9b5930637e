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
#include <string.h>

#include <type_traits>
#include <vector>

#include "host_math.h"

using bitrl_host::bf16_to_float;
using bitrl_host::exp2_poly;
using bitrl_host::float_to_bf16;
using bitrl_host::kLog2e;

namespace {

// 16 fp32 lanes, held as one GCC vector (Wide: a zmm register under AVX-512) or as two of 8 (Halves: two ymm
// under AVX2, where GCC keeps a 16-lane vector in memory and moves it through general registers, about 10x
// slower). Both run the same operations on every lane, so their results have the same bits.
constexpr int kLanes = 16;
typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VecU32 __attribute__((vector_size(4 * kLanes)));
typedef uint16_t VecU16 __attribute__((vector_size(2 * kLanes)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef uint32_t Vec8U32 __attribute__((vector_size(32)));
typedef uint16_t Vec8U16 __attribute__((vector_size(16)));

struct Halves {
  Vec8 lo, hi;
};

// 16 consecutive values from element i of a bf16 (widened exactly) or fp32 buffer
template <bool kBf16, class W, class WU32, class WU16>
__attribute__((always_inline)) inline W load_as(const void* base, int64_t i) {
  W x;
  if constexpr (kBf16) {
    WU16 h;
    memcpy(&h, static_cast<const uint16_t*>(base) + i, sizeof h);
    const WU32 u = __builtin_convertvector(h, WU32) << 16;
    memcpy(&x, &u, sizeof x);
  } else {
    memcpy(&x, static_cast<const float*>(base) + i, sizeof x);
  }
  return x;
}

template <bool kBf16, class V>
__attribute__((always_inline)) inline V load16(const void* base, int64_t i) {
  if constexpr (std::is_same_v<V, VecF>) {
    return load_as<kBf16, VecF, VecU32, VecU16>(base, i);
  } else {
    return {load_as<kBf16, Vec8, Vec8U32, Vec8U16>(base, i),
            load_as<kBf16, Vec8, Vec8U32, Vec8U16>(base, i + 8)};
  }
}

__attribute__((always_inline)) inline void store16(float* p, const VecF& x) { memcpy(p, &x, sizeof x); }
__attribute__((always_inline)) inline void store16(float* p, const Halves& x) {
  memcpy(p, &x.lo, sizeof x.lo);
  memcpy(p + 8, &x.hi, sizeof x.hi);
}

// acc += a * b, lane by lane (two roundings: no contraction)
__attribute__((always_inline)) inline void multiply_add(VecF& acc, const VecF& a, const VecF& b) {
  acc += a * b;
}
__attribute__((always_inline)) inline void multiply_add(Halves& acc, const Halves& a, const Halves& b) {
  acc.lo += a.lo * b.lo;
  acc.hi += a.hi * b.hi;
}
__attribute__((always_inline)) inline void multiply_add(VecF& acc, float a, const VecF& b) { acc += a * b; }
__attribute__((always_inline)) inline void multiply_add(Halves& acc, float a, const Halves& b) {
  acc.lo += a * b.lo;
  acc.hi += a * b.hi;
}

// The 16 lanes added in a fixed tree: lane j += lane j + 8, then + 4, + 2, + 1; lane 0's sum.
__attribute__((always_inline)) inline float lane_sum(VecF lane) {
  lane += __builtin_shufflevector(lane, lane, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  lane += __builtin_shufflevector(lane, lane, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  lane += __builtin_shufflevector(lane, lane, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  lane += __builtin_shufflevector(lane, lane, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return lane[0];
}
__attribute__((always_inline)) inline float lane_sum(const Halves& lane) {
  Vec8 s = lane.lo + lane.hi;
  s += __builtin_shufflevector(s, s, 4, 5, 6, 7, 0, 1, 2, 3);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
  return s[0];
}

// q . k over d, k widened from its buffer at element k_off: 16 lanes each summing every 16th product in
// ascending order, then lane_sum. d is a multiple of 16 (the caller checks).
template <bool kBf16, class V>
__attribute__((always_inline)) inline float dot16(const float* __restrict q, const void* k, int64_t k_off,
                                                  int64_t d) {
  V lane = {};
  for (int64_t c = 0; c < d; c += kLanes) {
    multiply_add(lane, load16<false, V>(q, c), load16<kBf16, V>(k, k_off + c));
  }
  return lane_sum(lane);
}

// dot16 of one query against the 4 key columns at k_off, k_off + d, + 2 d, + 3 d: the same operations per
// score, interleaved so that the 4 chains of additions overlap instead of waiting on each other.
template <bool kBf16, class V>
__attribute__((always_inline)) inline void dot16_x4(const float* __restrict q, const void* k, int64_t k_off,
                                                    int64_t d, float* out) {
  V l0 = {}, l1 = {}, l2 = {}, l3 = {};
  for (int64_t c = 0; c < d; c += kLanes) {
    const V qc = load16<false, V>(q, c);
    multiply_add(l0, qc, load16<kBf16, V>(k, k_off + c));
    multiply_add(l1, qc, load16<kBf16, V>(k, k_off + d + c));
    multiply_add(l2, qc, load16<kBf16, V>(k, k_off + 2 * d + c));
    multiply_add(l3, qc, load16<kBf16, V>(k, k_off + 3 * d + c));
  }
  out[0] = lane_sum(l0);
  out[1] = lane_sum(l1);
  out[2] = lane_sum(l2);
  out[3] = lane_sum(l3);
}

// Asks for the bytes [p, p + bytes) in cache ahead of their use (one request per 64-byte line).
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

// acc[0, 16 N) = sum over w < width, ascending, of p[w] * v[v_off + w d + (0, 16 N)]: N vectors of
// accumulators held in registers across the columns.
template <bool kBf16, class V, int N>
__attribute__((always_inline)) inline void weighted_sum(const float* __restrict p, const void* v,
                                                        int64_t v_off, int64_t width, int64_t d,
                                                        float* __restrict acc) {
  V a[N] = {};
  for (int64_t w = 0; w < width; ++w) {
    const float pw = p[w];
    for (int j = 0; j < N; ++j) multiply_add(a[j], pw, load16<kBf16, V>(v, v_off + w * d + j * kLanes));
  }
  for (int j = 0; j < N; ++j) store16(acc + j * kLanes, a[j]);
}

// One (row, kv head): queries q [m, d], keys and values k, v [width, d] (element offsets into their
// buffers), the visible mask row of query i at vis + (i % tokens) * vis_stride, output out [m, d].
// Scratch: scores [m, width], qf [m, d], acc [d].
template <bool kBf16, class V>
__attribute__((always_inline)) inline void attend_head(const void* q, int64_t q_off, const void* k,
                                                       const void* v, int64_t kv_off, const uint8_t* vis,
                                                       int64_t vis_stride, int64_t tokens, void* out, int64_t m,
                                                       int64_t width, int64_t d, int64_t columns, float scale,
                                                       float* scores,
                                                       float* qf, float* acc) {
  for (int64_t i = 0; i < m * d; i += kLanes) store16(qf + i, load16<kBf16, V>(q, q_off + i));
  // Scores by blocks of 4 columns, each block read once for all m queries (masked columns are scored too
  // and then dropped: cheaper than breaking the block). Meanwhile this head's V and the next head's K (the
  // next item of this thread's static share) are requested: the cache is read from memory once per step,
  // and the requests overlap that wait with the arithmetic.
  const int64_t elem = kBf16 ? 2 : 4, col_bytes = d * elem;
  const char* k_bytes = static_cast<const char*>(k) + kv_off * elem;
  const char* v_bytes = static_cast<const char*>(v) + kv_off * elem;
  const int64_t next_head = columns * col_bytes;
  int64_t w = 0;
  for (; w + 4 <= width; w += 4) {
    prefetch(v_bytes + w * col_bytes, 4 * col_bytes);
    prefetch(k_bytes + next_head + w * col_bytes, 4 * col_bytes);
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* see = vis + (i % tokens) * vis_stride;
      float* s = scores + i * width;
      float dots[4];
      dot16_x4<kBf16, V>(qf + i * d, k, kv_off + w * d, d, dots);
      for (int j = 0; j < 4; ++j) s[w + j] = see[w + j] ? dots[j] * scale : -INFINITY;
    }
  }
  for (; w < width; ++w) {
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* see = vis + (i % tokens) * vis_stride;
      scores[i * width + w] = see[w] ? dot16<kBf16, V>(qf + i * d, k, kv_off + w * d, d) * scale : -INFINITY;
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
      int64_t c = 0;
      for (; c + 4 * kLanes <= d; c += 4 * kLanes) {
        weighted_sum<kBf16, V, 4>(s, v, kv_off + c, width, d, acc + c);
      }
      switch ((d - c) / kLanes) {
        case 3: weighted_sum<kBf16, V, 3>(s, v, kv_off + c, width, d, acc + c); break;
        case 2: weighted_sum<kBf16, V, 2>(s, v, kv_off + c, width, d, acc + c); break;
        case 1: weighted_sum<kBf16, V, 1>(s, v, kv_off + c, width, d, acc + c); break;
        default: break;
      }
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

// The per-head body compiled once per dtype and instruction set, each with its form of the 16 lanes, and
// chosen once by the CPU (target_clones cannot vary the form).
#define BITRL_ATTEND_HEAD_ARGS                                                                             \
  const void *q, int64_t q_off, const void *k, const void *v, int64_t kv_off, const uint8_t *vis,             \
      int64_t vis_stride, int64_t tokens, void *out, int64_t m, int64_t width, int64_t d, int64_t columns,      \
      float scale, float *scores, float *qf, float *acc
#define BITRL_ATTEND_HEAD_CALL \
  q, q_off, k, v, kv_off, vis, vis_stride, tokens, out, m, width, d, columns, scale, scores, qf, acc
using AttendHead = void (*)(BITRL_ATTEND_HEAD_ARGS);

template <bool kBf16>
__attribute__((target("avx512f"))) void attend_head_avx512(BITRL_ATTEND_HEAD_ARGS) {
  attend_head<kBf16, VecF>(BITRL_ATTEND_HEAD_CALL);
}
template <bool kBf16>
__attribute__((target("avx2"))) void attend_head_avx2(BITRL_ATTEND_HEAD_ARGS) {
  attend_head<kBf16, Halves>(BITRL_ATTEND_HEAD_CALL);
}
template <bool kBf16>
void attend_head_baseline(BITRL_ATTEND_HEAD_ARGS) {
  attend_head<kBf16, Halves>(BITRL_ATTEND_HEAD_CALL);
}

template <bool kBf16>
AttendHead attend_head_for_this_cpu() {
  static const AttendHead chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &attend_head_avx512<kBf16>;
    if (__builtin_cpu_supports("avx2")) return &attend_head_avx2<kBf16>;
    return &attend_head_baseline<kBf16>;
  }();
  return chosen;
}

template <bool kBf16>
void attend(const void* q, const void* k, const void* v, const uint8_t* vis, void* out, int64_t rows,
            int64_t heads, int64_t m, int64_t tokens, int64_t width, int64_t d, int64_t columns,
            int64_t vis_row_stride, int64_t vis_stride, float scale) {
  const AttendHead attend_head_here = attend_head_for_this_cpu<kBf16>();
#pragma omp parallel
  {
    std::vector<float> scores(m * width), qf(m * d), acc(d);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * heads; ++rh) {
      const int64_t r = rh / heads;
      attend_head_here(q, rh * m * d, k, v, rh * columns * d, vis + r * vis_row_stride, vis_stride, tokens, out,
                       m, width, d, columns, scale, scores.data(), qf.data(), acc.data());
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
