// Shared device helpers for the CUDA kernel headers (plain CUDA C++, no torch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_fused {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (or max) over the block; every thread gets the result. blockDim.x is a multiple of 32,
// at most 1024. `scratch` holds 32 floats of shared memory; the call synchronises the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// Threads per block for a row of n elements: a multiple of 32 in [32, 1024].
inline int row_threads(int64_t n) {
  int threads = 32;
  while (threads < 1024 && threads < n) threads *= 2;
  return threads;
}

// Blocks of 256 threads for a grid-stride loop over numel elements.
inline unsigned elementwise_grid(int64_t numel) {
  const int64_t blocks = (numel + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// Row blocks for deterministic column sums: the partition depends only on the row count.
struct ColumnBlocks {
  int64_t rows_per_block;
  int64_t count;
};

inline ColumnBlocks column_blocks(int64_t rows) {
  ColumnBlocks b;
  b.rows_per_block = rows < 16 * 256 ? 16 : (rows + 255) / 256;
  b.count = rows == 0 ? 0 : (rows + b.rows_per_block - 1) / b.rows_per_block;
  return b;
}

// out[c] = sum over blocks b, in order, of partial[b * cols + c].
static __global__ void sum_column_blocks_kernel(const float* partial, int64_t blocks, int64_t cols,
                                         float* out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) s += partial[b * cols + c];
  out[c] = s;
}

inline void launch_sum_column_blocks(const float* partial, int64_t blocks, int64_t cols,
                                     float* out, cudaStream_t stream) {
  if (cols == 0) return;
  const int threads = 256;
  const unsigned grid = static_cast<unsigned>((cols + threads - 1) / threads);
  sum_column_blocks_kernel<<<grid, threads, 0, stream>>>(partial, blocks, cols, out);
}

}  // namespace cuda
}  // namespace megatron_fused
