// CUDA kernels of bias + dropout + residual add (no torch here).
//
// Same meaning and the same random stream as the CPU body (bias_dropout_add_cpu.cpp): element e
// is kept when word e % 4 of Philox4x32-10(counter = offset + e / 4, key = seed) is >= threshold
// (= p * 2^32), so CPU and GPU drop the same elements for the same (seed, offset). Each thread
// handles the 4 elements of one counter. dbias: per-row-block partials, summed in fixed order.
#pragma once

#include "../common/cuda_utils.cuh"
#include "../common/philox.h"

namespace megatron_fused {
namespace cuda {

struct DropoutArgs {
  uint64_t seed;
  uint64_t offset;
  uint32_t threshold;  // keep when word >= threshold
  float scale;         // 1 / (1 - p), 0 when p >= 1
  bool drop;           // false: plain residual + x + bias
};

__device__ __forceinline__ uint32_t dropout_word(const DropoutArgs& a, int64_t e) {
  const Philox4 r = philox4x32_10(a.offset + static_cast<uint64_t>(e / 4), a.seed);
  return r.v[e % 4];
}

template <typename T>
__global__ void bias_dropout_add_fwd_kernel(const T* x, const T* bias, const T* res, T* out,
                                            int64_t numel, int64_t n, DropoutArgs a) {
  const int64_t groups = (numel + 3) / 4;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Philox4 r = {{0u, 0u, 0u, 0u}};
    if (a.drop) r = philox4x32_10(a.offset + static_cast<uint64_t>(k), a.seed);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int64_t e = 4 * k + w;
      if (e >= numel) break;
      const float v = to_float(x[e]) + (bias != nullptr ? to_float(bias[e % n]) : 0.0f);
      const float kept = a.drop ? (r.v[w] >= a.threshold ? v * a.scale : 0.0f) : v;
      out[e] = from_float<T>(to_float(res[e]) + kept);
    }
  }
}

template <typename T>
__global__ void bias_dropout_add_bwd_kernel(const T* g, T* dx, int64_t numel, DropoutArgs a) {
  const int64_t groups = (numel + 3) / 4;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Philox4 r = {{0u, 0u, 0u, 0u}};
    if (a.drop) r = philox4x32_10(a.offset + static_cast<uint64_t>(k), a.seed);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int64_t e = 4 * k + w;
      if (e >= numel) break;
      const float gv = to_float(g[e]);
      dx[e] = from_float<T>(a.drop ? (r.v[w] >= a.threshold ? gv * a.scale : 0.0f) : gv);
    }
  }
}

// Partial dbias of one block of rows (recomputes the mask), one thread per column.
template <typename T>
__global__ void bias_dropout_add_bias_grad_kernel(const T* g, float* part, int64_t rows,
                                                  int64_t n, int64_t rows_per_block,
                                                  DropoutArgs a) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = blockIdx.y;
  if (c >= n) return;
  const int64_t r0 = blk * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t e = r * n + c;
    const float gv = to_float(g[e]);
    s += a.drop ? (dropout_word(a, e) >= a.threshold ? gv * a.scale : 0.0f) : gv;
  }
  part[blk * n + c] = s;
}

template <typename T>
void launch_bias_dropout_add_fwd(const T* x, const T* bias, const T* res, T* out, int64_t numel,
                                 int64_t n, const DropoutArgs& a, cudaStream_t stream) {
  if (numel == 0) return;
  bias_dropout_add_fwd_kernel<T><<<elementwise_grid((numel + 3) / 4), 256, 0, stream>>>(
      x, bias, res, out, numel, n, a);
}

// workspace: column_blocks(numel / n).count * n floats when grad_bias is wanted (non-null).
template <typename T>
void launch_bias_dropout_add_bwd(const T* g, T* dx, float* workspace, float* grad_bias,
                                 int64_t numel, int64_t n, const DropoutArgs& a,
                                 cudaStream_t stream) {
  if (numel == 0) return;
  bias_dropout_add_bwd_kernel<T><<<elementwise_grid((numel + 3) / 4), 256, 0, stream>>>(
      g, dx, numel, a);
  if (grad_bias == nullptr) return;
  const int64_t rows = numel / n;
  const ColumnBlocks blocks = column_blocks(rows);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(blocks.count));
  bias_dropout_add_bias_grad_kernel<T><<<grid, 256, 0, stream>>>(g, workspace, rows, n,
                                                                blocks.rows_per_block, a);
  launch_sum_column_blocks(workspace, blocks.count, n, grad_bias, stream);
}

}  // namespace cuda
}  // namespace megatron_fused
