// Float conversions and small vector helpers used by every CPU body (see cpu_utils.h).
#include "cpu_utils.h"

#include <cstdlib>
#include <string>

namespace megatron_fused {

namespace {

// The widest clone this CPU runs, capped by MEGATRON_FUSED_CPU_ISA (baseline, x86-64-v3,
// x86-64-v4). An unknown value is refused by the Python loader before any op runs.
int detect_isa_level() {
#if MEGATRON_HAVE_ISA_CLONES
  __builtin_cpu_init();
  int level = 0;
  if (__builtin_cpu_supports("x86-64-v4")) {
    level = 2;
  } else if (__builtin_cpu_supports("x86-64-v3")) {
    level = 1;
  }
#else
  int level = 0;
#endif
  const char* cap = std::getenv("MEGATRON_FUSED_CPU_ISA");
  if (cap != nullptr) {
    const std::string want(cap);
    const int limit = want == "baseline" ? 0 : (want == "x86-64-v3" ? 1 : 2);
    level = level < limit ? level : limit;
  }
  return level;
}

}  // namespace

int cpu_isa_level() {
  static const int level = detect_isa_level();
  return level;
}

int64_t cpu_isa_level_op() { return cpu_isa_level(); }

void convert_to_float(const float* src, float* dst, int64_t n) {
  std::copy(src, src + n, dst);
}

MEGATRON_INLINE void bf16_to_float_loop_body(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
MEGATRON_SIMD_FN(bf16_to_float_loop, (const uint16_t* src, float* dst, int64_t n),
                 (src, dst, n))

MEGATRON_INLINE void float_to_bf16_loop_body(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
MEGATRON_SIMD_FN(float_to_bf16_loop, (const float* src, uint16_t* dst, int64_t n),
                 (src, dst, n))

void convert_to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  bf16_to_float_loop(reinterpret_cast<const uint16_t*>(src), dst, n);
}

void convert_from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  float_to_bf16_loop(src, reinterpret_cast<uint16_t*>(dst), n);
}

void convert_from_float(const float* src, float* dst, int64_t n) {
  std::copy(src, src + n, dst);
}

// Half conversions use c10's (round-to-nearest-even, subnormals, inf and NaN handled).
MEGATRON_INLINE void half_to_float_loop_body(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
MEGATRON_SIMD_FN(half_to_float_loop, (const c10::Half* src, float* dst, int64_t n),
                 (src, dst, n))

MEGATRON_INLINE void float_to_half_loop_body(const float* src, c10::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}
MEGATRON_SIMD_FN(float_to_half_loop, (const float* src, c10::Half* dst, int64_t n),
                 (src, dst, n))

void convert_to_float(const c10::Half* src, float* dst, int64_t n) {
  half_to_float_loop(src, dst, n);
}

void convert_from_float(const float* src, c10::Half* dst, int64_t n) {
  float_to_half_loop(src, dst, n);
}

void sum_blocks(const float* partial, int64_t blocks, int64_t cols, float* out) {
  at::parallel_for(0, cols, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) out[c] = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) add_into(out + c0, partial + b * cols + c0, c1 - c0);
  });
}

MEGATRON_INLINE void add_into_body(float* acc, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += src[i];
}
MEGATRON_SIMD_FN(add_into, (float* acc, const float* src, int64_t n),
                 (acc, src, n))

}  // namespace megatron_fused
