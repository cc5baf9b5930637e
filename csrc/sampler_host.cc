// The fused sampler's random numbers on the CPU: Philox4x32-10 uniforms (sampler_core.h) for
// bitrl.kernels.sampling. The torch formula needs ~40 int64 tensor ops per Philox round; this is one loop, so
// a decode step's draw at a real vocabulary costs milliseconds instead of most of the step.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "host_math.h"
#include "sampler_core.h"

using bitrl::sample_uniform;
using bitrl::uniform_from_bits;
using bitrl_host::exp2_poly;
using bitrl_host::kLog2e;

extern "C" {

// Philox4x32-10 of counters (w0 + j, c1, c2, 0), j < kBlock, under one key: the same rounds as
// philox4x32_10, written over arrays so that the compiler vectorizes across counters (32x32->64 multiplies).
// out[4 j + lane]: lane `lane` of counter w0 + j, i.e. the bits of token 4 (w0 + j) + lane.
constexpr int kBlock = 16;

__attribute__((target_clones("avx512f", "avx2", "default")))
static void philox_block(uint32_t w0, uint32_t c1_in, uint32_t c2_in, uint32_t k0_in, uint32_t k1_in,
                         uint32_t out[4 * kBlock]) {
  uint32_t c0[kBlock], c1[kBlock], c2[kBlock], c3[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    c0[j] = w0 + (uint32_t)j;
    c1[j] = c1_in;
    c2[j] = c2_in;
    c3[j] = 0u;
  }
  uint32_t k0 = k0_in, k1 = k1_in;
  for (int r = 0; r < 10; ++r) {
    // not unrolled: GCC unrolls a 16-trip loop fully and then leaves the 32x32->64 products scalar
#pragma GCC unroll 1
    for (int j = 0; j < kBlock; ++j) {
      const uint64_t p0 = (uint64_t)0xD2511F53u * c0[j];
      const uint64_t p1 = (uint64_t)0xCD9E8D57u * c2[j];
      const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[j] ^ k0;
      const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[j] ^ k1;
      c1[j] = (uint32_t)p1;
      c3[j] = (uint32_t)p0;
      c0[j] = n0;
      c2[j] = n2;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int j = 0; j < kBlock; ++j) {  // token order: word w0 + j holds tokens 4 (w0 + j) + lane
    out[4 * j] = c0[j];
    out[4 * j + 1] = c1[j];
    out[4 * j + 2] = c2[j];
    out[4 * j + 3] = c3[j];
  }
}

// out[b, v] (rows x vocab, row-major fp32) = the uniform of token v for (seeds[b], positions[b]).
void bitrl_sampling_uniforms(const int64_t* seeds, const int64_t* positions, int64_t rows, int64_t vocab,
                             float* out) {
  uint32_t x[4 * kBlock];
  for (int64_t b = 0; b < rows; ++b) {
    const uint64_t s = (uint64_t)seeds[b], p = (uint64_t)positions[b];
    float* row = out + b * vocab;
    const int64_t words = (vocab + 3) / 4;
    for (int64_t w = 0; w < words; w += kBlock) {
      philox_block((uint32_t)w, (uint32_t)p, (uint32_t)(p >> 32), (uint32_t)s, (uint32_t)(s >> 32), x);
      const int64_t stop = vocab < 4 * (w + kBlock) ? vocab : 4 * (w + kBlock);
      for (int64_t v = 4 * w; v < stop; ++v) row[v] = uniform_from_bits(x[v - 4 * w]);
    }
  }
}

// out[i] = the uniform of token tokens[i] for (seeds[i], positions[i]).
void bitrl_uniforms_at(const int64_t* seeds, const int64_t* positions, const int64_t* tokens, int64_t n,
                       float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = sample_uniform((uint64_t)seeds[i], (uint64_t)positions[i], (uint32_t)tokens[i]);
  }
}


// ---------------------------------------------------------------------------------------------------------
// The Gumbel-max draw over a row's scaled logits, without its transcendental work on every token.
//
// The token drawn is argmax_v s_v, s_v = z_v - log(-log(u_v)) as torch evaluates it in fp32. Two logs per
// token of a 49k vocabulary are most of a CPU decode step's sampler, so this finds, per row, the few tokens
// that can win: keys from a polynomial log (at most 1.04e-6 nats off over all 2^24 uniforms), the best
// approximate score, and every token within `kMargin` of it (the true winner among them for any two
// evaluations whose errors sum to less than half the margin). The caller scores those candidates with
// torch's own log, so the draw stays the formula's bit for bit.

// log(x) for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(1 + f) by its minimax polynomial
// (Cephes' logf coefficients). Branch-free, so that a loop over it vectorizes.
static inline float poly_log(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const float m = __builtin_bit_cast(float, (bits & 0x007FFFFFu) | 0x3F000000u);  // in [0.5, 1)
  const bool small = m < 0.70710678f;
  const float e = (float)((int32_t)((bits >> 23) & 0xFFu) - (small ? 127 : 126));
  const float f = (small ? m + m : m) - 1.0f;
  const float f2 = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * f2 - 0.5f * f2;
  return f + y + e * 0.693147180559945f;
}

// The approximate Gumbel key -log(-log(u)) of u in (0, 1).
static inline float approx_key(float u) { return -poly_log(-poly_log(u)); }

// keys[i] = approx_key of the uniform of Philox output bits[i], i < n: uniform_from_bits with its cap as a
// select (fminf, equal for these non-NaN values, keeps the loop from vectorizing).
static inline void approx_keys(const uint32_t* bits, float* keys, int n) {
  for (int i = 0; i < n; ++i) {
    const float u = ((float)(bits[i] >> 8) + 0.5f) * 5.9604644775390625e-08f;
    keys[i] = approx_key(u < 0.99999994f ? u : 0.99999994f);
  }
}

constexpr float kGumbelMax = 16.64f;  // the largest key any uniform gives (u <= 1 - 2^-24)
constexpr int kTile = 4 * kBlock;     // tokens per Philox block

// Candidates within the margin of the best approximate score: 1e-3 nats plus 2^-16 of its magnitude, far
// above the two evaluations' errors (~1e-6 nats in the key plus half an fp32 ulp of the score each).
static inline float margin_of(float best) { return 1e-3f + fabsf(best) * 1.52587890625e-05f; }

// The smallest 24-bit uniform integer m (u = (m + 0.5) 2^-24, as uniform_from_bits) whose Gumbel key
// -log(-log(u)) can reach t: key(u) >= t iff u >= exp(-exp(-t)); in double, one less than the exact bound
// for its rounding. kKeySlack (nats) covers the approximate keys' error (1e-6) many times over.
constexpr double kKeySlack = 1e-2;
static inline uint32_t min_bits_reaching(double t) {
  const double m = floor(exp(-exp(-t)) * 16777216.0 - 0.5) - 1.0;
  return m <= 0.0 ? 0u : (uint32_t)m;
}

// 8 fp32 lanes as a GCC vector (one ymm, or two xmm), for the maxima, where scalar loops with their
// NaN-aware selects stay scalar. Not 16: under AVX2 GCC keeps a 16-lane vector in memory and runs its
// compares and selects through general registers (9.4 ms for a 64 x 49152 draw). The maxima are exact in
// any width.
constexpr int kLanes = 8;
typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));
static inline VecF vec_load(const float* p) {
  VecF v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void vec_store(float* p, VecF v) { memcpy(p, &v, sizeof v); }
static inline VecF vec_splat(float x) { return VecF{} + x; }
static inline VecF vec_maximum(VecF a, VecF b) { return a > b ? a : b; }
static inline float vec_max(VecF v) {  // of non-NaN lanes, by halves
  v = vec_maximum(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vec_maximum(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = vec_maximum(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}
// The log-sum-exp's lanes: 16, whatever the vector width above (its bits depend on this count).
constexpr int kSumLanes = 16;

// Row `row` (vocab fp32) of bitrl_gumbel_candidates: writes the candidates to mine[:n] and returns n, or -1.
// Its own target clones: the OpenMP body below is outlined into a function the clones of its caller do not
// reach.
__attribute__((target_clones("avx512f", "avx2", "default")))
static int64_t gumbel_row(const float* row, int64_t vocab, uint64_t s, uint64_t p, int64_t cap,
                          int64_t* mine, float* lse) {
  const uint32_t k0 = (uint32_t)s, k1 = (uint32_t)(s >> 32), c1 = (uint32_t)p, c2 = (uint32_t)(p >> 32);
  // the row's largest z (its token's score is where the best starts); NaN or +inf: the plain way
  // NaN or +inf by the bits' maxima (GCC leaves a vector compare's mask scalar, but not a max): a NaN has
  // |bits| > 0x7F800000, +inf is the signed bits' largest non-NaN value
  VecF top_v = vec_splat(-INFINITY);
  VecI signed_max = VecI{} + INT32_MIN, magnitude_max = VecI{};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const VecF x = vec_load(row + v);
    top_v = vec_maximum(x, top_v);
    VecI bits;
    memcpy(&bits, &x, sizeof bits);
    signed_max = signed_max > bits ? signed_max : bits;
    const VecI magnitude = bits & 0x7FFFFFFF;
    magnitude_max = magnitude_max > magnitude ? magnitude_max : magnitude;
  }
  float top = vec_max(top_v);
  int bad = 0;
  for (int i = 0; i < kLanes; ++i) bad |= (signed_max[i] >= 0x7F800000) | (magnitude_max[i] > 0x7F800000);
  for (; v < vocab; ++v) {
    const float x = row[v];
    top = x > top ? x : top;
    bad |= (x != x) | (x == INFINITY);
  }
  if (bad || top == -INFINITY) {
    return -1;
  }
  // log sum exp z = top + log sum 2^((z - top) log2 e): 16 lanes over the row in order, then the lanes
  float lane[kSumLanes] = {};
  for (v = 0; v + kSumLanes <= vocab; v += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) lane[j] += exp2_poly((row[v + j] - top) * kLog2e);
  }
  for (; v < vocab; ++v) lane[0] += exp2_poly((row[v] - top) * kLog2e);
  float total = 0.0f;
  for (int j = 0; j < kSumLanes; ++j) total += lane[j];
  *lse = top + logf(total);
  int64_t top_at = 0;
  while (top_at + kLanes <= vocab && vec_max(vec_load(row + top_at)) != top) top_at += kLanes;
  while (row[top_at] != top) ++top_at;
  float best = top + approx_key(sample_uniform(s, p, (uint32_t)top_at));
  int64_t n = 0;
  uint32_t x[kTile];
  float key[kTile];
  float score[kTile];
  for (int64_t start = 0; start < vocab && n >= 0; start += kTile) {
    const int64_t len = vocab - start < kTile ? vocab - start : kTile;
    float tile_max, score_max;
    if (len == kTile) {
      VecF m = vec_load(row + start);
      for (int c = kLanes; c < kTile; c += kLanes) {
        const VecF z = vec_load(row + start + c);
        m = vec_maximum(z, m);
      }
      tile_max = vec_max(m);
    } else {
      tile_max = -INFINITY;
      for (int64_t j = 0; j < len; ++j) tile_max = row[start + j] > tile_max ? row[start + j] : tile_max;
    }
    if (tile_max + kGumbelMax + margin_of(best) < best) continue;  // no token here can come near
    philox_block((uint32_t)(start / 4), c1, c2, k0, k1, x);
    // Before any log: a token of this tile is a candidate only if its key reaches best - margin - tile_max,
    // which needs its uniform's 24 bits at least `need` (most tiles of a real row have none)
    const uint32_t need = min_bits_reaching((double)best - margin_of(best) - tile_max - kKeySlack);
    uint32_t hit = 0;
    for (int j = 0; j < kTile; ++j) hit |= (uint32_t)((x[j] >> 8) >= need);
    if (!hit) continue;
    approx_keys(x, key, kTile);  // key[j]: token start + j
    // -inf z gives a -inf score, below any finite best
    if (len == kTile) {
      VecF m = vec_splat(-INFINITY);
      for (int c = 0; c < kTile; c += kLanes) {
        const VecF sc = vec_load(row + start + c) + vec_load(key + c);
        vec_store(score + c, sc);
        m = vec_maximum(sc, m);
      }
      score_max = vec_max(m);
    } else {
      score_max = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        score[j] = row[start + j] + key[j];
        score_max = score[j] > score_max ? score[j] : score_max;
      }
    }
    if (score_max < best - margin_of(best)) continue;  // no candidate in this tile: skip the scalar walk
    for (int64_t j = 0; j < len; ++j) {
      const float sj = score[j];
      if (sj == -INFINITY) continue;
      if (sj > best) {  // a new best: keep the earlier candidates still within its margin
        best = sj;
        int64_t kept = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float si = row[mine[i]] + approx_key(sample_uniform(s, p, (uint32_t)mine[i]));
          if (si >= best - margin_of(best)) mine[kept++] = mine[i];
        }
        n = kept;
      }
      if (sj >= best - margin_of(best)) {
        if (n == cap) {
          n = -1;
          break;
        }
        mine[n++] = start + j;
      }
    }
  }
  return n;
}

// For each row b of z (rows x vocab fp32, row-major; -inf outside the kept support): cand[b, :count[b]] the
// tokens, ascending, whose score may be the row's maximum (at most cap), and lse[b] its log-sum-exp; or count[b] = -1
// where the row must be drawn the plain way (a NaN or +inf in it, or more than cap candidates; lse[b] is then
// not written when the row is bad).
void bitrl_gumbel_candidates(const float* z, const int64_t* seeds, const int64_t* positions, int64_t rows,
                             int64_t vocab, int64_t cap, int64_t* cand, int64_t* count, float* lse) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < rows; ++b) {
    count[b] = gumbel_row(z + b * vocab, vocab, (uint64_t)seeds[b], (uint64_t)positions[b], cap,
                          cand + b * cap, lse + b);
  }
}

}  // extern "C"
