// CUDA kernels of layer norm and RMS norm with float32 statistics (no torch here).
//
// Same meaning as the CPU body (layer_norm_cpu.cpp). Weight and bias arrive as float32 (the
// binding converts the [h] vectors once); Tx is the input dtype, To the output dtype.
// Forward and dx: one block per row. dw / db: per-row-block partial sums written to a float32
// workspace, then summed over blocks in a fixed order (deterministic, no atomics).
#pragma once

#include "../common/cuda_utils.cuh"

namespace megatron_fused {
namespace cuda {

template <typename Tx, typename To>
__global__ void norm_fwd_kernel(const Tx* x, const float* w, const float* b, To* y, float* mean,
                                float* rstd, int64_t n, float eps, bool rms) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const Tx* xr = x + r * n;
  float mu = 0.0f, var;
  if (rms) {
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float v = to_float(xr[j]);
      s += v * v;
    }
    var = block_sum(s, scratch) / static_cast<float>(n);
  } else {
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += to_float(xr[j]);
    mu = block_sum(s, scratch) / static_cast<float>(n);
    float d2 = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float d = to_float(xr[j]) - mu;
      d2 += d * d;
    }
    var = block_sum(d2, scratch) / static_cast<float>(n);
  }
  const float rs = 1.0f / sqrtf(var + eps);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float v = ((to_float(xr[j]) - mu) * rs) * w[j];
    if (b != nullptr) v += b[j];
    y[r * n + j] = from_float<To>(v);
  }
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename Tx, typename Tg>
__global__ void norm_bwd_input_kernel(const Tg* g, const Tx* x, const float* w, const float* mean,
                                      const float* rstd, Tx* dx, int64_t n, bool rms) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const float mu = rms ? 0.0f : mean[r], rs = rstd[r];
  float s_dxh = 0.0f, s_dxh_xhat = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float xhat = (to_float(x[r * n + j]) - mu) * rs;
    const float dxh = to_float(g[r * n + j]) * w[j];
    s_dxh += dxh;
    s_dxh_xhat += dxh * xhat;
  }
  const float a = rms ? 0.0f : block_sum(s_dxh, scratch) / static_cast<float>(n);
  const float c = block_sum(s_dxh_xhat, scratch) / static_cast<float>(n);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float xhat = (to_float(x[r * n + j]) - mu) * rs;
    dx[r * n + j] = from_float<Tx>(rs * (to_float(g[r * n + j]) * w[j] - a - xhat * c));
  }
}

// Partial dw (and db) of one block of rows, one thread per column.
template <typename Tx, typename Tg>
__global__ void norm_bwd_params_kernel(const Tg* g, const Tx* x, const float* mean,
                                       const float* rstd, float* part_w, float* part_b,
                                       int64_t rows, int64_t n, int64_t rows_per_block,
                                       bool rms) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = blockIdx.y;
  if (c >= n) return;
  const int64_t r0 = blk * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  float sw = 0.0f, sb = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float gv = to_float(g[r * n + c]);
    const float xhat = (to_float(x[r * n + c]) - (rms ? 0.0f : mean[r])) * rstd[r];
    sw += gv * xhat;
    sb += gv;
  }
  part_w[blk * n + c] = sw;
  if (part_b != nullptr) part_b[blk * n + c] = sb;
}

template <typename Tx, typename To>
void launch_norm_fwd(const Tx* x, const float* w, const float* b, To* y, float* mean,
                     float* rstd, int64_t rows, int64_t n, float eps, bool rms,
                     cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  norm_fwd_kernel<Tx, To><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      x, w, b, y, mean, rstd, n, eps, rms);
}

// workspace: 2 * column_blocks(rows).count * n floats. grad_w, grad_b: n floats each
// (grad_b unused when rms).
template <typename Tx, typename Tg>
void launch_norm_bwd(const Tg* g, const Tx* x, const float* w, const float* mean,
                     const float* rstd, Tx* dx, float* workspace, float* grad_w, float* grad_b,
                     int64_t rows, int64_t n, bool rms, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  norm_bwd_input_kernel<Tx, Tg><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      g, x, w, mean, rstd, dx, n, rms);
  const ColumnBlocks blocks = column_blocks(rows);
  float* part_w = workspace;
  float* part_b = rms ? nullptr : workspace + blocks.count * n;
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(blocks.count));
  norm_bwd_params_kernel<Tx, Tg><<<grid, 256, 0, stream>>>(g, x, mean, rstd, part_w, part_b,
                                                          rows, n, blocks.rows_per_block, rms);
  launch_sum_column_blocks(part_w, blocks.count, n, grad_w, stream);
  if (!rms) launch_sum_column_blocks(part_b, blocks.count, n, grad_b, stream);
}

}  // namespace cuda
}  // namespace megatron_fused
