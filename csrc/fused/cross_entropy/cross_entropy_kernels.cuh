// CUDA kernels of the chunked (vocab-parallel capable) cross entropy (no torch here).
//
// Same meaning as the CPU body (cross_entropy_cpu.cpp): the forward writes five float32 stats
// per row (max, sum exp(x - max), target logit if owned, sum x, owned) and never forms the
// softmax; the backward writes (exp(x - lse) - (1 - s) onehot - s / V) * dloss into grad, which
// may alias the logits. One block per row.
#pragma once

#include "../common/cuda_utils.cuh"

namespace megatron_fused {
namespace cuda {

template <typename T>
__global__ void cross_entropy_fwd_kernel(const T* x, const int64_t* target, float* stats,
                                         int64_t rows, int64_t n, int64_t vocab_start) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * n;
  float m = -INFINITY, sum_x = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = to_float(xr[j]);
    m = fmaxf(m, v);
    sum_x += v;
  }
  m = block_max(m, scratch);
  sum_x = block_sum(sum_x, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += expf(to_float(xr[j]) - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    const int64_t local = target[r] - vocab_start;
    const bool owned = local >= 0 && local < n;
    stats[r] = m;
    stats[rows + r] = s;
    stats[2 * rows + r] = owned ? to_float(xr[local]) : 0.0f;
    stats[3 * rows + r] = sum_x;
    stats[4 * rows + r] = owned ? 1.0f : 0.0f;
  }
}

template <typename T>
__global__ void cross_entropy_bwd_kernel(const T* x, const int64_t* target, const float* lse,
                                         const float* grad_loss, T* grad, int64_t n,
                                         int64_t vocab_start, float uniform, float on_target) {
  const int64_t r = blockIdx.x;
  const int64_t local = target[r] - vocab_start;
  const float l = lse[r], g = grad_loss[r];
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float p = expf(to_float(x[r * n + j]) - l);
    const float hit = j == local ? on_target : 0.0f;
    grad[r * n + j] = from_float<T>(((p - hit) - uniform) * g);
  }
}

template <typename T>
void launch_cross_entropy_fwd(const T* x, const int64_t* target, float* stats, int64_t rows,
                              int64_t n, int64_t vocab_start, cudaStream_t stream) {
  if (rows == 0) return;
  cross_entropy_fwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      x, target, stats, rows, n, vocab_start);
}

template <typename T>
void launch_cross_entropy_bwd(const T* x, const int64_t* target, const float* lse,
                              const float* grad_loss, T* grad, int64_t rows, int64_t n,
                              int64_t vocab_start, float uniform, float on_target,
                              cudaStream_t stream) {
  if (rows == 0) return;
  cross_entropy_bwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      x, target, lse, grad_loss, grad, n, vocab_start, uniform, on_target);
}

}  // namespace cuda
}  // namespace megatron_fused
