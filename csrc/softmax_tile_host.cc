// The softmax passes of one [rows, cols] tile of bf16 logits on the CPU, for the tiles of
// bitrl.kernels.fused_logprobs.TiledLinearSoftmax: one pass each over the bf16 GEMM output, where the torch
// formula makes ~6 (upcast, shift, scale, exp, sum or multiply, downcast) through an fp32 copy of the tile.
// Built with the host C++ compiler by bitrl.kernels.host_ext and called through ctypes on CPU tensors.
//
// Numerics: everything in fp32. x = float(z) * inv_t (one rounding, as the torch formula's fp32 tile), shifts
// subtracted from x before scaling by log2 e, and e^d computed as 2^(d log2 e) with a degree-7 polynomial on
// [-1/2, 1/2] (relative error under 2.5e-7 + |d| 2^-23, the latter from rounding log2 e and d log2 e to fp32,
// as in the torch formula; 0 below 2^-126, where the torch formula gives denormals). Sums run
// in 16 lanes, then added in order: a different order from torch's, within fp32 rounding of it.
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "host_math.h"

namespace {

using bitrl_host::bf16_to_float;
using bitrl_host::exp2_poly;
using bitrl_host::float_to_bf16;
using bitrl_host::kLog2e;

constexpr int kLanes = 16;

// Rows [r0, r1) of the statistics pass (see bitrl_tile_stats_bf16).
__attribute__((target_clones("avx512f", "avx2", "default")))
void stats_rows(const uint16_t* z, int64_t r0, int64_t r1, int64_t cols, int64_t ld, const float* inv_t,
                float* m, float* s, float* t) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = z + r * ld;
    const float scale = inv_t ? inv_t[r] : 1.0f;
    float mx[kLanes];
    for (int k = 0; k < kLanes; ++k) mx[k] = -3.0e38f;
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float x = bf16_to_float(row[j + k]) * scale;
        mx[k] = std::max(mx[k], x);
      }
    }
    float tile_max = -3.0e38f;
    for (int k = 0; k < kLanes; ++k) tile_max = std::max(tile_max, mx[k]);
    for (; j < cols; ++j) tile_max = std::max(tile_max, bf16_to_float(row[j]) * scale);
    const float m_old = m[r];
    const float m_new = std::max(m_old, tile_max);
    float se[kLanes], te[kLanes];
    for (int k = 0; k < kLanes; ++k) se[k] = te[k] = 0.0f;
    j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float d = bf16_to_float(row[j + k]) * scale - m_new;
        const float e = exp2_poly(d * kLog2e);
        se[k] += e;
        te[k] += e * d;
      }
    }
    float sum_e = 0.0f, sum_ed = 0.0f;
    for (int k = 0; k < kLanes; ++k) {
      sum_e += se[k];
      sum_ed += te[k];
    }
    for (; j < cols; ++j) {
      const float d = bf16_to_float(row[j]) * scale - m_new;
      const float e = exp2_poly(d * kLog2e);
      sum_e += e;
      sum_ed += e * d;
    }
    const float alpha = exp2_poly((m_old - m_new) * kLog2e);
    if (t) t[r] = alpha * (t[r] + s[r] * (m_old - m_new)) + sum_ed;
    s[r] = s[r] * alpha + sum_e;
    m[r] = m_new;
  }
}

// Rows [r0, r1) of the gradient pass (see bitrl_tile_grad_bf16).
__attribute__((target_clones("avx512f", "avx2", "default")))
void grad_rows(uint16_t* z, int64_t r0, int64_t r1, int64_t cols, int64_t ld, const float* inv_t,
               const float* m, const float* ls, const float* A, const float* B, const float* C,
               const int64_t* col) {
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* row = z + r * ld;
    const float scale = inv_t ? inv_t[r] : 1.0f;
    const float mr = m[r], lr = ls[r], a = A ? A[r] : 0.0f, b = B[r];
    const int64_t c = col[r];
    const float zc = c >= 0 ? bf16_to_float(row[c]) : 0.0f;  // read before the row is overwritten
    for (int64_t j = 0; j < cols; ++j) {
      const float q = (bf16_to_float(row[j]) * scale - mr) - lr;  // log p
      const float p = exp2_poly(q * kLog2e);
      row[j] = float_to_bf16(p * (a * q + b));
    }
    if (c >= 0) {
      const float q = (zc * scale - mr) - lr;
      const float p = exp2_poly(q * kLog2e);
      row[c] = float_to_bf16(p * (a * q + b) + C[r]);
    }
  }
}

// Rows split over the threads of OpenMP, the runtime torch itself runs on (one libgomp in the process: its
// workers, still spinning after the GEMM before this pass, take the rows at once, where threads of our own
// would compete with them for the cores). Built without OpenMP, one thread.
template <class F>
void over_rows(int64_t rows, int64_t cols, int threads, F&& fn) {
  // at least ~64k elements per thread: below that, waking a thread costs more than it saves
  const int64_t by_size = std::max<int64_t>(1, rows * cols / 65536);
  const int n = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, rows, by_size}));
  const int64_t step = (rows + n - 1) / n;
#pragma omp parallel for num_threads(n) schedule(static, 1)
  for (int i = 0; i < n; ++i) fn(std::min(rows, i * step), std::min(rows, (i + 1) * step));
}

}  // namespace

extern "C" {

// Online softmax statistics over one more vocabulary block: z [rows, cols] bf16 raw logits (row stride ld),
// x = z * inv_t[r] (inv_t may be null: 1). Per row, m <- max(m, max_j x); with e_j = exp(x_j - m_new),
// s <- s exp(m_old - m_new) + sum_j e_j and, when t is not null,
// t <- exp(m_old - m_new) (t + s_old (m_old - m_new)) + sum_j e_j (x_j - m_new).
void bitrl_tile_stats_bf16(const uint16_t* z, int64_t rows, int64_t cols, int64_t ld, const float* inv_t,
                           float* m, float* s, float* t, int threads) {
  over_rows(rows, cols, threads,
            [=](int64_t r0, int64_t r1) { stats_rows(z, r0, r1, cols, ld, inv_t, m, s, t); });
}

// d loss / d z of one tile, written over z as bf16: with x = z * inv_t[r] and q = (x - m[r]) - ls[r] (the
// log-prob), dz = e^q (A[r] q + B[r]), plus C[r] at column col[r] when col[r] >= 0. A may be null (0).
void bitrl_tile_grad_bf16(uint16_t* z, int64_t rows, int64_t cols, int64_t ld, const float* inv_t,
                          const float* m, const float* ls, const float* A, const float* B, const float* C,
                          const int64_t* col, int threads) {
  over_rows(rows, cols, threads,
            [=](int64_t r0, int64_t r1) { grad_rows(z, r0, r1, cols, ld, inv_t, m, ls, A, B, C, col); });
}

}  // extern "C"
