// Torch binding of the CUDA bias + dropout + residual add kernels (bias_dropout_add_kernels.cuh);
// meaning in bias_dropout_add_cpu.cpp. (seed, offset) come from the device's CUDA generator, so
// torch.cuda.manual_seed and the model-parallel RNG tracker control the mask.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <mutex>

#include "../common/cuda_binding.h"
#include "bias_dropout_add_kernels.cuh"

namespace megatron_fused {
namespace {

cuda::DropoutArgs dropout_args(double prob, bool training, uint64_t seed, uint64_t offset) {
  cuda::DropoutArgs a;
  a.seed = seed;
  a.offset = offset;
  const uint64_t t = dropout_threshold(prob);
  a.threshold = t > 0xFFFFFFFFull ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  a.scale = prob >= 1.0 ? 0.0f : 1.0f / static_cast<float>(1.0 - prob);
  a.drop = training && prob > 0.0;
  return a;
}

std::tuple<at::Tensor, at::Tensor> bda_fwd(const at::Tensor& input,
                                           const std::optional<at::Tensor>& bias,
                                           const at::Tensor& residual, double prob,
                                           bool training, std::optional<at::Generator> generator) {
  TORCH_CHECK(input.sizes() == residual.sizes() && input.scalar_type() == residual.scalar_type(),
              "megatron_fused::bias_dropout_add_fwd (CUDA): input and residual must share "
              "shape and dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == input.size(-1) &&
                            bias->scalar_type() == input.scalar_type()),
              "megatron_fused::bias_dropout_add_fwd (CUDA): bias must be [", input.size(-1),
              "] of the input's dtype");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous(), res = residual.contiguous();
  const std::optional<at::Tensor> b =
      has_bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  at::Tensor out = at::empty_like(x);
  at::Tensor rng_state = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  uint64_t seed = 0, offset = 0;
  if (training && prob > 0.0) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    const auto inputs = gen->philox_engine_inputs(static_cast<uint64_t>((x.numel() + 3) / 4));
    seed = inputs.first;
    offset = inputs.second;
  }
  rng_state[0] = static_cast<int64_t>(seed);
  rng_state[1] = static_cast<int64_t>(offset);
  const cuda::DropoutArgs a = dropout_args(prob, training, seed, offset);
  dispatch_cuda_float_types(x.scalar_type(), "bias_dropout_add_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_bias_dropout_add_fwd<T>(cuda_ptr<T>(x), cuda_ptr_or_null<T>(b), cuda_ptr<T>(res),
                                         cuda_ptr<T>(out), x.numel(), x.size(-1), a,
                                         current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, rng_state};
}

std::tuple<at::Tensor, at::Tensor> bda_bwd(const at::Tensor& grad_output,
                                           const at::Tensor& rng_state, double prob,
                                           bool training, int64_t bias_numel) {
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor g = grad_output.contiguous();
  const int64_t n = bias_numel > 0 ? bias_numel : g.size(-1);
  TORCH_CHECK(g.size(-1) == n, "megatron_fused::bias_dropout_add_bwd (CUDA): bias of ",
              bias_numel, " values vs grad ", g.sizes());
  const at::Tensor state = rng_state.to(at::kCPU);
  const cuda::DropoutArgs a = dropout_args(prob, training,
                                           static_cast<uint64_t>(state[0].item<int64_t>()),
                                           static_cast<uint64_t>(state[1].item<int64_t>()));
  const int64_t rows = n == 0 ? 0 : g.numel() / n;
  auto fopts = g.options().dtype(at::kFloat);
  at::Tensor dx = at::empty_like(g);
  at::Tensor workspace =
      at::empty({bias_numel > 0 ? cuda::column_blocks(rows).count * n : 0}, fopts);
  at::Tensor grad_b = at::empty({bias_numel > 0 ? n : 0}, fopts);
  dispatch_cuda_float_types(g.scalar_type(), "bias_dropout_add_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::launch_bias_dropout_add_bwd<T>(cuda_ptr<T>(g), cuda_ptr<T>(dx),
                                         workspace.data_ptr<float>(),
                                         bias_numel > 0 ? grad_b.data_ptr<float>() : nullptr,
                                         g.numel(), n, a, current_stream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &bda_fwd);
  m.impl("bias_dropout_add_bwd", &bda_bwd);
}

}  // namespace megatron_fused
