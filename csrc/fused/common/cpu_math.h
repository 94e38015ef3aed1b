// Plain C++ float helpers shared by the CPU bodies of the fused ops (no torch here).
//
// Everything is written so that GCC auto-vectorises the loops that call it: straight-line code,
// selects instead of branches, bit casts through memcpy. The build adds -fno-trapping-math and
// -fno-math-errno (they change no finite result) which GCC needs to if-convert float selects.
// Hot loops are written once as an always-inline body and compiled three times by
// MEGATRON_SIMD_FN: for x86-64-v4 (AVX-512 with 512-bit vectors), x86-64-v3 (AVX2 + FMA) and
// the baseline x86-64. A call runs the widest clone the CPU supports (cpu_isa_level()), so the
// binary runs on any x86-64 CPU; MEGATRON_FUSED_CPU_ISA=baseline|x86-64-v3|x86-64-v4 caps the
// choice (the determinism tests run every clone the machine supports through it). The clones
// target arch levels, not CPU models: GCC enables exactly the level's features, so AMD and later
// Intel CPUs get the clone their feature bits allow. Reductions use MEGATRON_LANES independent
// accumulators combined in a fixed order and -ffp-contract=off keeps multiply-adds unfused, so
// every clone, thread count and run gives bit-identical results.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && \
    !defined(MEGATRON_FUSED_NO_CLONES)
#define MEGATRON_HAVE_ISA_CLONES 1
#define MEGATRON_TARGET_V4 __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
#define MEGATRON_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else
#define MEGATRON_HAVE_ISA_CLONES 0
#endif

#if defined(__GNUC__)
#define MEGATRON_INLINE inline __attribute__((always_inline))
#else
#define MEGATRON_INLINE inline
#endif

namespace megatron_fused {

// The clone a MEGATRON_SIMD_FN call runs: 0 baseline x86-64, 1 x86-64-v3, 2 x86-64-v4. Chosen
// once per process from the CPU's feature bits and MEGATRON_FUSED_CPU_ISA (cpu_convert.cpp).
int cpu_isa_level();

// Defines `void name params` calling name##_body (a MEGATRON_INLINE function) in the clone for
// this CPU. Every clone does the same float operations in the same order, so the choice changes
// speed only, never a bit of the result.
#if MEGATRON_HAVE_ISA_CLONES
#define MEGATRON_SIMD_FN(name, params, args)                   \
  MEGATRON_TARGET_V4 static void name##_x86_64_v4 params {     \
    name##_body args;                                         \
  }                                                           \
  MEGATRON_TARGET_V3 static void name##_x86_64_v3 params {     \
    name##_body args;                                         \
  }                                                           \
  static void name##_x86_64 params { name##_body args; }       \
  void name params {                                          \
    const int level = cpu_isa_level();                        \
    if (level == 2) {                                         \
      name##_x86_64_v4 args;                                  \
    } else if (level == 1) {                                  \
      name##_x86_64_v3 args;                                  \
    } else {                                                  \
      name##_x86_64 args;                                     \
    }                                                         \
  }
#else
#define MEGATRON_SIMD_FN(name, params, args) \
  void name params { name##_body args; }
#endif

// Independent accumulators per reduction; fixed, so results never depend on the vector width.
constexpr int MEGATRON_LANES = 16;

MEGATRON_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

MEGATRON_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// exp(x) in float, within ~2 ulp; exactly 0 below -87 (where the true value is subnormal).
// Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for exp(r), then 2^n from bits.
MEGATRON_INLINE float exp_f(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scale = bits_to_float(static_cast<uint32_t>((static_cast<int32_t>(n) + 127) << 23));
  return x < -87.0f ? 0.0f : p * scale;
}

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)); absolute error ~1e-7, which is what the GeLU
// forward and backward need (they use 1 + tanh and 1 - tanh^2).
MEGATRON_INLINE float tanh_f(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = exp_f(2.0f * (ax > 9.0f ? 9.0f : ax));
  const float t = 1.0f - 2.0f / (e + 1.0f);
  return x < 0.0f ? -t : t;
}

// bfloat16 <-> float with round-to-nearest-even (NaN stays NaN).
MEGATRON_INLINE float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}

MEGATRON_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

// Reductions over a row with MEGATRON_LANES accumulators, combined in a fixed order.
MEGATRON_INLINE float lanes_max(const float* v, int64_t n) {
  float acc[MEGATRON_LANES];
  for (int k = 0; k < MEGATRON_LANES; ++k) acc[k] = -INFINITY;
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) acc[k] = acc[k] > v[j + k] ? acc[k] : v[j + k];
  for (int k = 0; j + k < n; ++k) acc[k] = acc[k] > v[j + k] ? acc[k] : v[j + k];
  float m = acc[0];
  for (int k = 1; k < MEGATRON_LANES; ++k) m = m > acc[k] ? m : acc[k];
  return m;
}

// y[j] = exp(y[j] - m); returns the sum of the new y (fixed lane order).
MEGATRON_INLINE float exp_shift_sum(float* y, int64_t n, float m) {
  float acc[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) {
      const float e = exp_f(y[j + k] - m);
      y[j + k] = e;
      acc[k] += e;
    }
  for (int k = 0; j + k < n; ++k) {
    const float e = exp_f(y[j + k] - m);
    y[j + k] = e;
    acc[k] += e;
  }
  float s = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc[k];
  return s;
}

MEGATRON_INLINE float lanes_dot(const float* a, const float* b, int64_t n) {
  float acc[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) acc[k] += a[j + k] * b[j + k];
  for (int k = 0; j + k < n; ++k) acc[k] += a[j + k] * b[j + k];
  float s = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc[k];
  return s;
}

MEGATRON_INLINE float lanes_sum(const float* v, int64_t n) {
  float acc[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) acc[k] += v[j + k];
  for (int k = 0; j + k < n; ++k) acc[k] += v[j + k];
  float s = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc[k];
  return s;
}

// sum of (v[j] - c)^2
MEGATRON_INLINE float lanes_sq_dev(const float* v, int64_t n, float c) {
  float acc[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) {
      const float d = v[j + k] - c;
      acc[k] += d * d;
    }
  for (int k = 0; j + k < n; ++k) {
    const float d = v[j + k] - c;
    acc[k] += d * d;
  }
  float s = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc[k];
  return s;
}

}  // namespace megatron_fused
