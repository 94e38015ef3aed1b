// CUDA kernels of bias + GeLU (tanh approximation), forward and backward (no torch here).
//
// Same meaning as the CPU body (bias_gelu_cpu.cpp): v = x + bias (float32),
// y = 0.5 v (1 + tanh(0.79788456 v (1 + 0.044715 v^2))), dx = dy * dgelu(v); dbias is summed
// over rows per row block, then over blocks in a fixed order (deterministic).
#pragma once

#include "../common/cuda_utils.cuh"

namespace megatron_fused {
namespace cuda {

__device__ __forceinline__ float gelu_tanh_f(float v) {
  const float t = tanhf(0.79788456f * v * (1.0f + 0.044715f * v * v));
  return v * 0.5f * (1.0f + t);
}

__device__ __forceinline__ float gelu_tanh_grad_f(float v) {
  const float t = tanhf(0.79788456f * v * (1.0f + 0.044715f * v * v));
  return 0.5f * v * (1.0f - t * t) * (0.79788456f + 3.0f * 0.044715f * 0.79788456f * v * v) +
         0.5f * (1.0f + t);
}

template <typename T>
__global__ void bias_gelu_fwd_kernel(const T* x, const T* bias, T* y, int64_t numel,
                                     int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]) + (bias != nullptr ? to_float(bias[i % n]) : 0.0f);
    y[i] = from_float<T>(gelu_tanh_f(v));
  }
}

template <typename T>
__global__ void bias_gelu_bwd_kernel(const T* g, const T* x, const T* bias, T* dx,
                                     int64_t numel, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = to_float(x[i]) + (bias != nullptr ? to_float(bias[i % n]) : 0.0f);
    dx[i] = from_float<T>(to_float(g[i]) * gelu_tanh_grad_f(v));
  }
}

// Partial dbias of one block of rows (recomputes dx in float32), one thread per column.
template <typename T>
__global__ void bias_gelu_bias_grad_kernel(const T* g, const T* x, const T* bias, float* part,
                                           int64_t rows, int64_t n, int64_t rows_per_block) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = blockIdx.y;
  if (c >= n) return;
  const int64_t r0 = blk * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  const float bv = to_float(bias[c]);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    s += to_float(g[r * n + c]) * gelu_tanh_grad_f(to_float(x[r * n + c]) + bv);
  part[blk * n + c] = s;
}

template <typename T>
void launch_bias_gelu_fwd(const T* x, const T* bias, T* y, int64_t numel, int64_t n,
                          cudaStream_t stream) {
  if (numel == 0) return;
  bias_gelu_fwd_kernel<T><<<elementwise_grid(numel), 256, 0, stream>>>(x, bias, y, numel, n);
}

// workspace: column_blocks(numel / n).count * n floats when bias is given.
template <typename T>
void launch_bias_gelu_bwd(const T* g, const T* x, const T* bias, T* dx, float* workspace,
                          float* grad_bias, int64_t numel, int64_t n, cudaStream_t stream) {
  if (numel == 0) return;
  bias_gelu_bwd_kernel<T><<<elementwise_grid(numel), 256, 0, stream>>>(g, x, bias, dx, numel, n);
  if (bias == nullptr) return;
  const int64_t rows = numel / n;
  const ColumnBlocks blocks = column_blocks(rows);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(blocks.count));
  bias_gelu_bias_grad_kernel<T><<<grid, 256, 0, stream>>>(g, x, bias, workspace, rows, n,
                                                         blocks.rows_per_block);
  launch_sum_column_blocks(workspace, blocks.count, n, grad_bias, stream);
}

}  // namespace cuda
}  // namespace megatron_fused
