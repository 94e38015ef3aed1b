// Philox4x32-10 counter-based random numbers, the same on the CPU and the GPU (no torch here).
//
// The dropout mask of element e is decided by word (e % 4) of philox(key = seed,
// counter = offset + e / 4): the CPU and CUDA bodies produce the same mask for the same
// (seed, offset), any thread count, and the backward recomputes the mask instead of storing it.
// Reference: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEGATRON_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGATRON_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace megatron_fused {

struct Philox4 {
  uint32_t v[4];
};

MEGATRON_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Four 32-bit random words for a 64-bit counter and 64-bit key (10 rounds).
MEGATRON_HOST_DEVICE Philox4 philox4x32_10(uint64_t counter, uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, &hi0, &lo0);
    philox_mulhilo(0xCD9E8D57u, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  Philox4 out;
  out.v[0] = c0;
  out.v[1] = c1;
  out.v[2] = c2;
  out.v[3] = c3;
  return out;
}

// Dropout keeps an element when its random word is >= this threshold (drop probability p).
// p >= 1 gives 2^32: nothing is kept.
MEGATRON_HOST_DEVICE uint64_t dropout_threshold(double p) {
  if (p <= 0.0) return 0u;
  if (p >= 1.0) return 0x100000000ull;
  const double t = p * 4294967296.0;
  return static_cast<uint64_t>(t + 0.5);
}

}  // namespace megatron_fused
