// Torch binding of the CUDA cross entropy kernels (cross_entropy_kernels.cuh); meaning in
// cross_entropy_cpu.cpp.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../common/cuda_binding.h"
#include "cross_entropy_kernels.cuh"

namespace megatron_fused {
namespace {

at::Tensor ce_fwd(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start) {
  TORCH_CHECK(target.scalar_type() == at::kLong &&
                  target.numel() * logits.size(-1) == logits.numel(),
              "megatron_fused::cross_entropy_fwd (CUDA): int64 target ", target.sizes(),
              " vs logits ", logits.sizes());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.contiguous(), t = target.contiguous();
  const int64_t n = x.size(-1), rows = t.numel();
  at::Tensor stats = at::empty({5, rows}, x.options().dtype(at::kFloat));
  dispatch_cuda_float_types(x.scalar_type(), "cross_entropy_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_cross_entropy_fwd<T>(cuda_ptr<T>(x), t.data_ptr<int64_t>(),
                                      stats.data_ptr<float>(), rows, n, vocab_start,
                                      current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}

void ce_bwd(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
            const at::Tensor& grad_loss, int64_t vocab_start, int64_t vocab_size,
            double smoothing, const at::Tensor& grad_input) {
  TORCH_CHECK(grad_input.sizes() == logits.sizes() &&
                  grad_input.scalar_type() == logits.scalar_type() &&
                  grad_input.is_contiguous() && logits.is_contiguous(),
              "megatron_fused::cross_entropy_bwd (CUDA): grad_input must be contiguous with "
              "the logits' shape and dtype");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor t = target.contiguous();
  const at::Tensor l = lse.to(at::kFloat).contiguous(), g = grad_loss.to(at::kFloat).contiguous();
  const int64_t n = logits.size(-1), rows = t.numel();
  dispatch_cuda_float_types(logits.scalar_type(), "cross_entropy_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_cross_entropy_bwd<T>(
        cuda_ptr<T>(logits), t.data_ptr<int64_t>(), l.data_ptr<float>(), g.data_ptr<float>(),
        cuda_ptr<T>(grad_input), rows, n, vocab_start,
        static_cast<float>(smoothing / static_cast<double>(vocab_size)),
        static_cast<float>(1.0 - smoothing), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
  m.impl("cross_entropy_fwd", &ce_fwd);
  m.impl("cross_entropy_bwd", &ce_bwd);
}

}  // namespace megatron_fused
