// Host build of the fused sampler's shared pieces (sampler_core.h), for machines without a GPU.
//
//   host_check kat                       Philox4x32-10 on Random123's known-answer counters/keys
//   host_check uniforms SEED POS V       the V uniforms of (seed, position), one per line
//   host_check sample FILE               the sampler, run serially with the kernel's selections:
//       FILE = int32 rows, int32 vocab, float32 temperature, int32 top_k, float32 top_p,
//              rows x vocab float32 logits, rows int64 seeds, rows int64 positions
//       prints "token logprob" per row (logprob with 9 significant digits)
//
// The serial sampler makes the same decisions as csrc/sampler.cu (same keys, same radix digit choice, same
// Philox lanes, same fixed-point top-p masses); only the order of the fp32 sums (the softmax normaliser)
// differs.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "sampler_core.h"

using bitrl::float_key;

static uint32_t bits_of(float z) {
  uint32_t b;
  memcpy(&b, &z, 4);
  return b;
}

template <typename W>
static uint32_t radix_select(const std::vector<float>& z, uint32_t floor_key, float m, float inv_norm, W target,
                             bool strict) {
  uint32_t prefix = 0, mask = 0;
  W above = (W)0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    W hist[256];
    for (int d = 0; d < 256; ++d) hist[d] = (W)0;
    for (size_t v = 0; v < z.size(); ++v) {
      uint32_t key = float_key(bits_of(z[v]));
      if (key >= floor_key && (key & mask) == prefix)
        hist[(key >> shift) & 255u] += bitrl::selection_weight<W>(strict, z[v], m, inv_norm);
    }
    int d = bitrl::select_digit<W>(hist, &above, target, strict);
    prefix |= (uint32_t)d << shift;
    mask |= 255u << shift;
  }
  return prefix;
}

static void sample_row(const float* logits, int vocab, float t, int top_k, float top_p, uint64_t seed,
                       uint64_t pos, int64_t* token, float* logprob) {
  if (t == 0.f) {
    int best = 0;
    for (int v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    *token = best;
    *logprob = 0.f;
    return;
  }
  std::vector<float> z(vocab);
  float m = -INFINITY;
  for (int v = 0; v < vocab; ++v) {
    z[v] = logits[v] / t;
    m = fmaxf(m, z[v]);
  }
  uint32_t thr = 0;
  if (top_k > 0 && top_k < vocab) thr = radix_select<uint32_t>(z, 0u, m, 1.f, (uint32_t)top_k, false);
  if (top_p < 1.f) {
    float s = 0.f;
    for (int v = 0; v < vocab; ++v)
      if (float_key(bits_of(z[v])) >= thr) s += expf(z[v] - m);
    thr = radix_select<bitrl::Mass>(z, thr, m, 1.f / s, bitrl::mass_fixed(top_p), true);
  }
  float s = 0.f, best = -INFINITY;
  int idx = -1;
  for (int v = 0; v < vocab; ++v) {
    if (float_key(bits_of(z[v])) < thr) continue;
    s += expf(z[v] - m);
    float g = z[v] - logf(-logf(bitrl::sample_uniform(seed, pos, (uint32_t)v)));
    if (idx < 0 || g > best) {
      best = g;
      idx = v;
    }
  }
  *token = idx;
  *logprob = (z[idx] - m) - logf(s);
}

static int read_all(FILE* f, void* dst, size_t n) { return fread(dst, 1, n, f) == n ? 0 : 1; }

int main(int argc, char** argv) {
  if (argc >= 2 && strcmp(argv[1], "kat") == 0) {
    const uint32_t in[3][6] = {{0u, 0u, 0u, 0u, 0u, 0u},
                               {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                               {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u}};
    for (int i = 0; i < 3; ++i) {
      bitrl::U32x4 r = bitrl::philox4x32_10(in[i][0], in[i][1], in[i][2], in[i][3], in[i][4], in[i][5]);
      printf("%08x %08x %08x %08x\n", r.x[0], r.x[1], r.x[2], r.x[3]);
    }
    return 0;
  }
  if (argc == 5 && strcmp(argv[1], "uniforms") == 0) {
    uint64_t seed = strtoull(argv[2], 0, 10), pos = strtoull(argv[3], 0, 10);
    int vocab = atoi(argv[4]);
    for (int v = 0; v < vocab; ++v) printf("%.9g\n", bitrl::sample_uniform(seed, pos, (uint32_t)v));
    return 0;
  }
  if (argc == 3 && strcmp(argv[1], "sample") == 0) {
    FILE* f = fopen(argv[2], "rb");
    if (!f) return 2;
    int32_t rows, vocab, top_k;
    float t, top_p;
    if (read_all(f, &rows, 4) || read_all(f, &vocab, 4) || read_all(f, &t, 4) || read_all(f, &top_k, 4) ||
        read_all(f, &top_p, 4))
      return 3;
    std::vector<float> logits((size_t)rows * vocab);
    std::vector<int64_t> seeds(rows), pos(rows);
    if (read_all(f, logits.data(), logits.size() * 4) || read_all(f, seeds.data(), rows * 8) ||
        read_all(f, pos.data(), rows * 8))
      return 3;
    fclose(f);
    for (int r = 0; r < rows; ++r) {
      int64_t tok;
      float lp;
      sample_row(&logits[(size_t)r * vocab], vocab, t, top_k, top_p, (uint64_t)seeds[r], (uint64_t)pos[r], &tok,
                 &lp);
      printf("%lld %.9g\n", (long long)tok, lp);
    }
    return 0;
  }
  fprintf(stderr, "usage: host_check kat | uniforms SEED POS V | sample FILE\n");
  return 1;
}
