// Torch binding of the CUDA layer norm / RMS norm kernels (layer_norm_kernels.cuh); meaning in
// layer_norm_cpu.cpp.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "../common/cuda_binding.h"
#include "layer_norm_kernels.cuh"

namespace megatron_fused {
namespace {

at::ScalarType norm_output_type(const at::Tensor& x, const at::Tensor& w) {
  const bool half_w = w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16;
  return (x.scalar_type() == at::kFloat && half_w) ? w.scalar_type() : x.scalar_type();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& input,
                                                        const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias,
                                                        double eps, bool rms) {
  TORCH_CHECK(weight.dim() == 1 && input.size(-1) == weight.size(0),
              "megatron_fused::layer_norm_fwd: weight ", weight.sizes(), " vs input ",
              input.sizes());
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const bool has_bias = !rms && bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(norm_output_type(x, weight)));
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch_cuda_float_types(x.scalar_type(), "layer_norm_fwd", [&](auto xt) {
    using Tx = typename decltype(xt)::type;
    dispatch_cuda_float_types(y.scalar_type(), "layer_norm_fwd", [&](auto ot) {
      using To = typename decltype(ot)::type;
      cuda::launch_norm_fwd<Tx, To>(cuda_ptr<Tx>(x), w.data_ptr<float>(),
                                    has_bias ? b.data_ptr<float>() : nullptr, cuda_ptr<To>(y),
                                    mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, n,
                                    static_cast<float>(eps), rms, current_stream());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& grad_output,
                                                        const at::Tensor& input,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& mean,
                                                        const at::Tensor& rstd, bool rms) {
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "megatron_fused::layer_norm_bwd: grad ",
              grad_output.sizes(), " vs input ", input.sizes());
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous(), g = grad_output.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor mu = mean.to(at::kFloat).contiguous(), rs = rstd.to(at::kFloat).contiguous();
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor dx = at::empty_like(x);
  at::Tensor workspace = at::empty({2 * cuda::column_blocks(rows).count * n}, fopts);
  at::Tensor grad_w = at::empty({n}, fopts);
  at::Tensor grad_b = at::empty({rms ? 0 : n}, fopts);
  dispatch_cuda_float_types(x.scalar_type(), "layer_norm_bwd", [&](auto xt) {
    using Tx = typename decltype(xt)::type;
    dispatch_cuda_float_types(g.scalar_type(), "layer_norm_bwd", [&](auto gt) {
      using Tg = typename decltype(gt)::type;
      cuda::launch_norm_bwd<Tx, Tg>(cuda_ptr<Tg>(g), cuda_ptr<Tx>(x), w.data_ptr<float>(),
                                    mu.data_ptr<float>(), rs.data_ptr<float>(), cuda_ptr<Tx>(dx),
                                    workspace.data_ptr<float>(), grad_w.data_ptr<float>(),
                                    rms ? nullptr : grad_b.data_ptr<float>(), rows, n, rms,
                                    current_stream());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
  m.impl("layer_norm_fwd", &norm_fwd);
  m.impl("layer_norm_bwd", &norm_bwd);
}

}  // namespace megatron_fused
