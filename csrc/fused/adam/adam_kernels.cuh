// CUDA kernel of the multi-tensor AdamW step (no torch here).
//
// Same arithmetic as the CPU body (adam_cpu.cpp) and torch.optim.AdamW. The binding writes a
// table of tensors (pointers and sizes) and a table of chunks (tensor, start) to device memory;
// one block updates one chunk, so a single launch covers every tensor with the same grad and
// model-param dtypes.
#pragma once

#include "../common/cuda_utils.cuh"

namespace megatron_fused {
namespace cuda {

struct AdamTensor {
  float* param;
  const void* grad;     // Tg
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  void* model_param;      // Tm, null when there is no copy-out
  int64_t numel;
};

struct AdamChunk {
  int64_t tensor;
  int64_t start;
};

struct AdamArgs {
  float decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
  bool lerp_small, amsgrad, maximize, has_decay;
};

constexpr int64_t kAdamChunk = 65536;

template <typename Tg, typename Tm>
__global__ void adamw_kernel(const AdamTensor* tensors, const AdamChunk* chunks, AdamArgs s) {
  const AdamChunk ch = chunks[blockIdx.x];
  const AdamTensor t = tensors[ch.tensor];
  const int64_t end = ch.start + kAdamChunk < t.numel ? ch.start + kAdamChunk : t.numel;
  const Tg* grads = static_cast<const Tg*>(t.grad);
  Tm* model = static_cast<Tm*>(t.model_param);
  for (int64_t j = ch.start + threadIdx.x; j < end; j += blockDim.x) {
    const float g0 = to_float(grads[j]);
    const float grad = s.maximize ? -g0 : g0;
    const float param = s.has_decay ? t.param[j] * s.decay : t.param[j];
    const float m = t.exp_avg[j];
    const float diff = grad - m;
    const float avg = s.lerp_small ? fmaf(s.lerp_weight, diff, m)
                                   : fmaf(s.lerp_weight - 1.0f, diff, grad);
    const float sq = fmaf(s.one_minus_beta2 * grad, grad, t.exp_avg_sq[j] * s.beta2);
    float sq_used = sq;
    if (s.amsgrad) {
      sq_used = fmaxf(t.max_exp_avg_sq[j], sq);
      t.max_exp_avg_sq[j] = sq_used;
    }
    const float denom = __fdiv_rn(sqrtf(sq_used), s.bias_correction2_sqrt) + s.eps;
    const float updated = param + __fdiv_rn(s.neg_step_size * avg, denom);
    t.exp_avg[j] = avg;
    t.exp_avg_sq[j] = sq;
    t.param[j] = updated;
    if (model != nullptr) model[j] = from_float<Tm>(updated);
  }
}

template <typename Tg, typename Tm>
void launch_adamw(const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks,
                  const AdamArgs& s, cudaStream_t stream) {
  if (num_chunks == 0) return;
  adamw_kernel<Tg, Tm><<<static_cast<unsigned>(num_chunks), 512, 0, stream>>>(tensors, chunks, s);
}

}  // namespace cuda
}  // namespace megatron_fused
