// CUDA kernels of the scaled masked softmax and the scaled causal softmax (no torch here).
//
// Same meaning as the CPU body (softmax_cpu.cpp): z = x * scale, masked -> -10000, softmax in
// float32, output in T; backward dx = masked ? 0 : scale * y * (dy - sum(dy * y)).
// One block per row; the row is read from global memory (L2) once per pass.
#pragma once

#include "../common/cuda_utils.cuh"

namespace megatron_fused {
namespace cuda {

constexpr float kSoftmaxMasked = -10000.0f;

// Maps a row index (over all dims but the last) to the offset of its mask row; the mask is
// broadcast to the scores' shape (stride 0 on broadcast dims). Up to 7 leading dims.
struct MaskIndex {
  int ndim;
  int64_t sizes[7];
  int64_t strides[7];
};

__device__ __forceinline__ int64_t mask_row_offset(const MaskIndex& idx, int64_t r) {
  int64_t offset = 0;
  for (int d = idx.ndim - 1; d >= 0; --d) {
    offset += (r % idx.sizes[d]) * idx.strides[d];
    r /= idx.sizes[d];
  }
  return offset;
}

// visible < 0: use mask (may be null: no masking); else keys >= visible are masked.
template <typename T>
__device__ void softmax_row_fwd(const T* x, const bool* mask, int64_t visible, T* y, int64_t n,
                                float scale) {
  __shared__ float scratch[32];
  auto masked = [&](int64_t j) {
    return visible >= 0 ? j >= visible : (mask != nullptr && mask[j]);
  };
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    m = fmaxf(m, masked(j) ? kSoftmaxMasked : to_float(x[j]) * scale);
  m = block_max(m, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    s += expf((masked(j) ? kSoftmaxMasked : to_float(x[j]) * scale) - m);
  const float inv = 1.0f / block_sum(s, scratch);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    y[j] = from_float<T>(expf((masked(j) ? kSoftmaxMasked : to_float(x[j]) * scale) - m) * inv);
}

template <typename T>
__device__ void softmax_row_bwd(const T* dy, const T* y, const bool* mask, int64_t visible,
                                T* dx, int64_t n, float scale) {
  __shared__ float scratch[32];
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += to_float(dy[j]) * to_float(y[j]);
  dot = block_sum(dot, scratch);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const bool is_masked = visible >= 0 ? j >= visible : (mask != nullptr && mask[j]);
    const float yj = to_float(y[j]);
    dx[j] = from_float<T>(is_masked ? 0.0f : (yj * (to_float(dy[j]) - dot)) * scale);
  }
}

template <typename T>
__global__ void masked_softmax_fwd_kernel(const T* x, const bool* mask, MaskIndex idx, T* y,
                                          int64_t n, float scale) {
  const int64_t r = blockIdx.x;
  const bool* mrow = mask == nullptr ? nullptr : mask + mask_row_offset(idx, r);
  softmax_row_fwd(x + r * n, mrow, -1, y + r * n, n, scale);
}

template <typename T>
__global__ void masked_softmax_bwd_kernel(const T* dy, const T* y, const bool* mask,
                                          MaskIndex idx, T* dx, int64_t n, float scale) {
  const int64_t r = blockIdx.x;
  const bool* mrow = mask == nullptr ? nullptr : mask + mask_row_offset(idx, r);
  softmax_row_bwd(dy + r * n, y + r * n, mrow, -1, dx + r * n, n, scale);
}

__device__ __forceinline__ int64_t causal_visible(int64_t r, int64_t sq, int64_t sk) {
  const int64_t v = r % sq + sk - sq + 1;
  return v < 0 ? 0 : (v > sk ? sk : v);
}

template <typename T>
__global__ void causal_softmax_fwd_kernel(const T* x, T* y, int64_t sq, int64_t sk,
                                          float scale) {
  const int64_t r = blockIdx.x;
  softmax_row_fwd(x + r * sk, nullptr, causal_visible(r, sq, sk), y + r * sk, sk, scale);
}

template <typename T>
__global__ void causal_softmax_bwd_kernel(const T* dy, const T* y, T* dx, int64_t sq,
                                          int64_t sk, float scale) {
  const int64_t r = blockIdx.x;
  softmax_row_bwd(dy + r * sk, y + r * sk, nullptr, causal_visible(r, sq, sk), dx + r * sk, sk,
                  scale);
}

// ---- host launchers (rows = numel / n; one block per row) ----

template <typename T>
void launch_masked_softmax_fwd(const T* x, const bool* mask, const MaskIndex& idx, T* y,
                               int64_t rows, int64_t n, float scale, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  masked_softmax_fwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      x, mask, idx, y, n, scale);
}

template <typename T>
void launch_masked_softmax_bwd(const T* dy, const T* y, const bool* mask, const MaskIndex& idx,
                               T* dx, int64_t rows, int64_t n, float scale, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  masked_softmax_bwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(n), 0, stream>>>(
      dy, y, mask, idx, dx, n, scale);
}

template <typename T>
void launch_causal_softmax_fwd(const T* x, T* y, int64_t rows, int64_t sq, int64_t sk,
                               float scale, cudaStream_t stream) {
  if (rows == 0 || sk == 0) return;
  causal_softmax_fwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(sk), 0, stream>>>(
      x, y, sq, sk, scale);
}

template <typename T>
void launch_causal_softmax_bwd(const T* dy, const T* y, T* dx, int64_t rows, int64_t sq,
                               int64_t sk, float scale, cudaStream_t stream) {
  if (rows == 0 || sk == 0) return;
  causal_softmax_bwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(sk), 0, stream>>>(
      dy, y, dx, sq, sk, scale);
}

}  // namespace cuda
}  // namespace megatron_fused
