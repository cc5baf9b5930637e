// Scalar fp32 helpers of bitrl's host (CPU) C++ kernels, written so that loops over them vectorize: bf16
// conversions and 2^y by a polynomial (no libm call, no -ffast-math).
#pragma once

#include <stdint.h>
#include <string.h>

namespace bitrl_host {

constexpr float kLog2e = 1.44269504088896340736f;

inline float bf16_to_float(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest even (finite inputs)
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// 2^y: y = k + f with k an integer and |f| <= 1/2, 2^f by its Taylor polynomial, k added to the exponent.
inline float exp2_poly(float y) {
  const float yc = y < -126.0f ? -126.0f : (y > 127.0f ? 127.0f : y);
  const float k = (yc + 12582912.0f) - 12582912.0f;  // round to nearest (|y| < 2^22)
  const float f = yc - k;
  float p = 1.5252733804059841e-05f;  // ln2^7 / 7!
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  uint32_t u;
  memcpy(&u, &p, 4);
  u += (uint32_t)(int32_t)k << 23;
  float r;
  memcpy(&r, &u, 4);
  return y < -126.0f ? 0.0f : r;
}

}  // namespace bitrl_host
