// The pieces of bitrl's fused sampler shared by the CUDA kernel (csrc/sampler.cu) and its host build
// (csrc/host_check.cu): the counter-based Philox4x32-10 generator, the uniform it feeds, the order-preserving
// float key, and the digit choice of the radix selections. Semantics: the fused-sampler contract in
// bitrl.kernels.sampling (temperature, top-k with boundary ties kept, sort-free top-p, Gumbel-max, fp32
// log-prob under the distribution sampled from).
#pragma once

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define BITRL_HD __host__ __device__ __forceinline__
#else
#define BITRL_HD inline
#endif

namespace bitrl {

struct U32x4 {
  uint32_t x[4];
};

BITRL_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
}

// Philox4x32 with 10 rounds (Random123; the generator of triton.language.philox).
BITRL_HD U32x4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c0, &hi0, &lo0);
    mulhilo32(0xCD9E8D57u, c2, &hi1, &lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  U32x4 out = {{c0, c1, c2, c3}};
  return out;
}

// u in (0, 1), exact in fp32: 24 random bits centred in their cell, capped at 1 - 2^-24 (the fp32 sum
// rounds (2^24 - 1) + 0.5 to 2^24, which would give u = 1 and an infinite Gumbel key; bitrl.kernels.sampling
// caps it the same way).
BITRL_HD float uniform_from_bits(uint32_t x) {
  return fminf(((float)(x >> 8) + 0.5f) * 5.9604644775390625e-08f, 0.99999994f);
}

// The uniform of vocabulary entry v for (seed, position): counter (v / 4, position lo, position hi, 0),
// key (seed lo, seed hi), lane v % 4.
BITRL_HD float sample_uniform(uint64_t seed, uint64_t position, uint32_t v) {
  U32x4 r = philox4x32_10(v >> 2, (uint32_t)position, (uint32_t)(position >> 32), 0u, (uint32_t)seed,
                          (uint32_t)(seed >> 32));
  return uniform_from_bits(r.x[v & 3]);
}

// Order-preserving map of fp32 bits to uint32 (a < b  <=>  key(a) < key(b); NaN excluded).
BITRL_HD uint32_t float_key(uint32_t bits) { return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u); }

// Top-p masses as fixed-point integers, in units of 2^-52 of the row's mass (p <= 1, so a row's total stays
// far below 2^63): integer addition is associative, so the mass histogram, and with it the top-p cut and the
// sampled token, do not depend on the order in which the threads add to it (float atomics would).
typedef unsigned long long Mass;
BITRL_HD Mass mass_fixed(float p) { return (Mass)((double)p * 4503599627370496.0 + 0.5); }

// The weight of one candidate in a radix selection: a count (top-k) or its fixed-point mass (top-p).
template <typename W>
BITRL_HD W selection_weight(bool strict, float z, float m, float inv_norm) {
  return strict ? (W)mass_fixed(expf(z - m) * inv_norm) : (W)1;
}

// One digit of a descending radix selection. hist[d] holds the weight (count or probability mass) of the
// candidates whose current digit is d; `above` is the weight of everything already known to lie above the
// candidates. Returns the highest digit d whose inclusive weight above + sum(hist[d..255]) reaches `target`
// and adds the weight of the digits above d to `above`:
//   top-k: weights are counts, target = k     -> the bucket holding the k-th largest value;
//   top-p: weights are masses (Mass), target = mass_fixed(top_p) -> with `strict`, the lowest non-empty
//          bucket whose strictly greater mass stays below top_p (the smallest kept probability).
template <typename W>
BITRL_HD int select_digit(const W* hist, W* above, W target, bool strict) {
  W acc = *above;
  if (!strict) {
    for (int d = 255; d >= 0; --d) {
      if (acc + hist[d] >= target) {
        *above = acc;
        return d;
      }
      acc += hist[d];
    }
    *above = acc;
    return 0;
  }
  // strict: keep going down while the mass strictly above the next non-empty bucket stays below target
  int best = -1;
  W best_above = acc;
  for (int d = 255; d >= 0; --d) {
    if (hist[d] > (W)0) {
      if (acc < target) {
        best = d;
        best_above = acc;
      } else {
        break;
      }
      acc += hist[d];
    }
  }
  *above = best_above;
  return best < 0 ? 255 : best;
}

}  // namespace bitrl
