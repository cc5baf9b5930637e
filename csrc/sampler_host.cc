// The fused sampler's random numbers on the CPU: Philox4x32-10 uniforms (sampler_core.h) for
// bitrl.kernels.sampling. The torch formula needs ~40 int64 tensor ops per Philox round; this is one loop, so
// a decode step's draw at a real vocabulary costs milliseconds instead of most of the step.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
#include <stdint.h>

#include "sampler_core.h"

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
    out[i] = bitrl::sample_uniform((uint64_t)seeds[i], (uint64_t)positions[i], (uint32_t)tokens[i]);
  }
}

}  // extern "C"
