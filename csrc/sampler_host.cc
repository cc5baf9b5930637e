// The fused sampler's random numbers on the CPU: Philox4x32-10 uniforms (sampler_core.h) for
// bitrl.kernels.sampling. The torch formula needs ~40 int64 tensor ops per Philox round; this is one loop, so
// a decode step's draw at a real vocabulary costs milliseconds instead of most of the step.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sampler_core.h"

using bitrl::sample_uniform;
using bitrl::uniform_from_bits;

extern "C" {

// Philox4x32-10 of counters (w0 + j, c1, c2, 0), j < kBlock, under one key: the same rounds as
// philox4x32_10, written over arrays so that the compiler vectorizes across counters (32x32->64 multiplies).
constexpr int kBlock = 16;

__attribute__((target_clones("avx512f", "avx2", "default")))
static void philox_block(uint32_t w0, uint32_t c1_in, uint32_t c2_in, uint32_t k0_in, uint32_t k1_in,
                         uint32_t out[4][kBlock]) {
  uint32_t c0[kBlock], c1[kBlock], c2[kBlock], c3[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    c0[j] = w0 + (uint32_t)j;
    c1[j] = c1_in;
    c2[j] = c2_in;
    c3[j] = 0u;
  }
  uint32_t k0 = k0_in, k1 = k1_in;
  for (int r = 0; r < 10; ++r) {
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
  for (int j = 0; j < kBlock; ++j) {
    out[0][j] = c0[j];
    out[1][j] = c1[j];
    out[2][j] = c2[j];
    out[3][j] = c3[j];
  }
}

// out[b, v] (rows x vocab, row-major fp32) = the uniform of token v for (seeds[b], positions[b]).
void bitrl_sampling_uniforms(const int64_t* seeds, const int64_t* positions, int64_t rows, int64_t vocab,
                             float* out) {
  uint32_t x[4][kBlock];
  for (int64_t b = 0; b < rows; ++b) {
    const uint64_t s = (uint64_t)seeds[b], p = (uint64_t)positions[b];
    float* row = out + b * vocab;
    const int64_t words = (vocab + 3) / 4;
    for (int64_t w = 0; w < words; w += kBlock) {
      philox_block((uint32_t)w, (uint32_t)p, (uint32_t)(p >> 32), (uint32_t)s, (uint32_t)(s >> 32), x);
      const int64_t stop = vocab < 4 * (w + kBlock) ? vocab : 4 * (w + kBlock);
      for (int64_t v = 4 * w; v < stop; ++v) row[v] = uniform_from_bits(x[v & 3][(v >> 2) - w]);
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

// Row `row` (vocab fp32) of bitrl_gumbel_candidates: writes the candidates to mine[:n] and returns n, or -1.
// Its own target clones: the OpenMP body below is outlined into a function the clones of its caller do not
// reach.
__attribute__((target_clones("avx512f", "avx2", "default")))
static int64_t gumbel_row(const float* row, int64_t vocab, uint64_t s, uint64_t p, int64_t cap,
                          int64_t* mine) {
  const uint32_t k0 = (uint32_t)s, k1 = (uint32_t)(s >> 32), c1 = (uint32_t)p, c2 = (uint32_t)(p >> 32);
  // the row's largest z (its token's score is where the best starts); NaN or +inf: the plain way
  float top = -INFINITY;
  int bad = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float x = row[v];
    top = x > top ? x : top;
    bad |= (x != x) | (x == INFINITY);
  }
  if (bad || top == -INFINITY) {
    return -1;
  }
  int64_t top_at = 0;
  while (row[top_at] != top) ++top_at;
  float best = top + approx_key(sample_uniform(s, p, (uint32_t)top_at));
  int64_t n = 0;
  uint32_t x[4][kBlock];
  float key[4][kBlock];
  for (int64_t start = 0; start < vocab && n >= 0; start += kTile) {
    const int64_t len = vocab - start < kTile ? vocab - start : kTile;
    float tile_max = -INFINITY;
    for (int64_t j = 0; j < len; ++j) tile_max = row[start + j] > tile_max ? row[start + j] : tile_max;
    if (tile_max + kGumbelMax + margin_of(best) < best) continue;  // no token here can come near
    philox_block((uint32_t)(start / 4), c1, c2, k0, k1, x);
    approx_keys(&x[0][0], &key[0][0], kTile);  // key[lane][w]: token 4 w + lane
    for (int64_t j = 0; j < len; ++j) {
      const float zj = row[start + j];
      if (zj == -INFINITY) continue;
      const float sj = zj + key[j & 3][j >> 2];
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
// tokens, ascending, whose score may be the row's maximum (at most cap), or count[b] = -1 where the row must
// be drawn the plain way (a NaN or +inf in it, or more than cap candidates).
void bitrl_gumbel_candidates(const float* z, const int64_t* seeds, const int64_t* positions, int64_t rows,
                             int64_t vocab, int64_t cap, int64_t* cand, int64_t* count) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < rows; ++b) {
    count[b] = gumbel_row(z + b * vocab, vocab, (uint64_t)seeds[b], (uint64_t)positions[b], cap,
                          cand + b * cap);
  }
}

}  // extern "C"
