// Torch binding of the CUDA bias + GeLU kernels (bias_gelu_kernels.cuh); meaning in
// bias_gelu_cpu.cpp. The bias must have the input's dtype (the Python wrapper ensures it).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "../common/cuda_binding.h"
#include "bias_gelu_kernels.cuh"

namespace megatron_fused {
namespace {

void check_bias(const at::Tensor& x, const std::optional<at::Tensor>& bias, const char* op) {
  if (!bias.has_value() || !bias->defined()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(-1) &&
                  bias->scalar_type() == x.scalar_type(),
              "megatron_fused::", op, " (CUDA): bias ", bias->sizes(), " ", bias->scalar_type(),
              " must be [", x.size(-1), "] of the input's dtype ", x.scalar_type());
}

at::Tensor gelu_fwd(const at::Tensor& input, const std::optional<at::Tensor>& bias) {
  check_bias(input, bias, "bias_gelu_fwd");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const std::optional<at::Tensor> b =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(bias->contiguous())
                                          : std::nullopt;
  at::Tensor y = at::empty_like(x);
  dispatch_cuda_float_types(x.scalar_type(), "bias_gelu_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_bias_gelu_fwd<T>(cuda_ptr<T>(x), cuda_ptr_or_null<T>(b), cuda_ptr<T>(y),
                                  x.numel(), x.size(-1), current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::tuple<at::Tensor, at::Tensor> gelu_bwd(const at::Tensor& grad_output,
                                            const at::Tensor& input,
                                            const std::optional<at::Tensor>& bias) {
  check_bias(input, bias, "bias_gelu_bwd");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous(), g = grad_output.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  const std::optional<at::Tensor> b =
      has_bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor dx = at::empty_like(x);
  at::Tensor workspace = at::empty({has_bias ? cuda::column_blocks(rows).count * n : 0}, fopts);
  at::Tensor grad_b = at::empty({has_bias ? n : 0}, fopts);
  dispatch_cuda_float_types(x.scalar_type(), "bias_gelu_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_bias_gelu_bwd<T>(cuda_ptr<T>(g), cuda_ptr<T>(x), cuda_ptr_or_null<T>(b),
                                  cuda_ptr<T>(dx), workspace.data_ptr<float>(),
                                  grad_b.data_ptr<float>(), x.numel(), n, current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
  m.impl("bias_gelu_fwd", &gelu_fwd);
  m.impl("bias_gelu_bwd", &gelu_bwd);
}

}  // namespace megatron_fused
