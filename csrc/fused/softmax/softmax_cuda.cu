// Torch binding of the CUDA softmax kernels (softmax_kernels.cuh); meaning in softmax_cpu.cpp.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "../common/cuda_binding.h"
#include "softmax_kernels.cuh"

namespace megatron_fused {
namespace {

cuda::MaskIndex mask_index(const std::optional<at::Tensor>& mask, const at::Tensor& x,
                           at::Tensor& keep, const bool** data) {
  cuda::MaskIndex idx{};
  *data = nullptr;
  if (!mask.has_value() || !mask->defined()) return idx;
  TORCH_CHECK(mask->scalar_type() == at::kBool, "megatron_fused softmax: mask must be bool");
  TORCH_CHECK(x.dim() - 1 <= 7, "megatron_fused softmax: at most 8 dims, got ", x.dim());
  keep = mask->expand(x.sizes());
  if (keep.size(-1) > 1 && keep.stride(-1) != 1) keep = keep.contiguous();
  *data = keep.data_ptr<bool>();
  idx.ndim = static_cast<int>(x.dim() - 1);
  for (int d = 0; d < idx.ndim; ++d) {
    idx.sizes[d] = x.size(d);
    idx.strides[d] = keep.stride(d);
  }
  return idx;
}

at::Tensor masked_fwd(const at::Tensor& input, const std::optional<at::Tensor>& mask,
                      double scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor keep;
  const bool* mp;
  const cuda::MaskIndex idx = mask_index(mask, x, keep, &mp);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  dispatch_cuda_float_types(x.scalar_type(), "scaled_masked_softmax_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_masked_softmax_fwd<T>(cuda_ptr<T>(x), mp, idx, cuda_ptr<T>(y), rows, n,
                                       static_cast<float>(scale), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor masked_bwd(const at::Tensor& grad_output, const at::Tensor& output,
                      const std::optional<at::Tensor>& mask, double scale) {
  const c10::cuda::CUDAGuard guard(output.device());
  const at::Tensor g = grad_output.contiguous(), y = output.contiguous();
  at::Tensor dx = at::empty_like(y);
  at::Tensor keep;
  const bool* mp;
  const cuda::MaskIndex idx = mask_index(mask, y, keep, &mp);
  const int64_t n = y.size(-1), rows = n == 0 ? 0 : y.numel() / n;
  dispatch_cuda_float_types(y.scalar_type(), "scaled_masked_softmax_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_masked_softmax_bwd<T>(cuda_ptr<T>(g), cuda_ptr<T>(y), mp, idx, cuda_ptr<T>(dx),
                                       rows, n, static_cast<float>(scale), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

at::Tensor causal_fwd(const at::Tensor& input, double scale) {
  TORCH_CHECK(input.dim() >= 2, "scaled_upper_triang_masked_softmax_fwd: need [.., sq, sk]");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t sk = x.size(-1), sq = x.size(-2), rows = sk == 0 ? 0 : x.numel() / sk;
  dispatch_cuda_float_types(x.scalar_type(), "scaled_upper_triang_masked_softmax_fwd",
                            [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_causal_softmax_fwd<T>(cuda_ptr<T>(x), cuda_ptr<T>(y), rows, sq, sk,
                                       static_cast<float>(scale), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor causal_bwd(const at::Tensor& grad_output, const at::Tensor& output, double scale) {
  const c10::cuda::CUDAGuard guard(output.device());
  const at::Tensor g = grad_output.contiguous(), y = output.contiguous();
  at::Tensor dx = at::empty_like(y);
  const int64_t sk = y.size(-1), sq = y.size(-2), rows = sk == 0 ? 0 : y.numel() / sk;
  dispatch_cuda_float_types(y.scalar_type(), "scaled_upper_triang_masked_softmax_bwd",
                            [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_causal_softmax_bwd<T>(cuda_ptr<T>(g), cuda_ptr<T>(y), cuda_ptr<T>(dx), rows, sq,
                                       sk, static_cast<float>(scale), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
  m.impl("scaled_masked_softmax_fwd", &masked_fwd);
  m.impl("scaled_masked_softmax_bwd", &masked_bwd);
  m.impl("scaled_upper_triang_masked_softmax_fwd", &causal_fwd);
  m.impl("scaled_upper_triang_masked_softmax_bwd", &causal_bwd);
}

}  // namespace megatron_fused
