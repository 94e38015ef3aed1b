// Torch binding of the CUDA multi-tensor AdamW kernel (adam_kernels.cuh); meaning in
// adam_cpu.cpp. Tensors are grouped by (grad dtype, model-param dtype); each group is one launch
// whose tensor and chunk tables are staged in pinned memory and copied to the device.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "../common/cuda_binding.h"
#include "adam_kernels.cuh"

namespace megatron_fused {
namespace {

cuda::AdamArgs adam_args(double lr, double beta1, double beta2, double eps, double weight_decay,
                         double step, bool amsgrad, bool maximize) {
  cuda::AdamArgs s;
  s.has_decay = weight_decay != 0.0;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_small = std::abs(s.lerp_weight) < 0.5f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, step), 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  s.amsgrad = amsgrad;
  s.maximize = maximize;
  return s;
}

// Copies a host table to the device (stream-ordered; the staging buffer is pinned).
template <typename Row>
at::Tensor to_device(const std::vector<Row>& rows, const at::Device& device) {
  const int64_t bytes = static_cast<int64_t>(rows.size() * sizeof(Row));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), rows.data(), static_cast<size_t>(bytes));
  return host.to(device, /*non_blocking=*/true);
}

void adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                at::TensorList model_params, double lr, double beta1, double beta2, double eps,
                double weight_decay, double step, bool amsgrad, bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  (!amsgrad || max_exp_avg_sqs.size() == n) &&
                  (model_params.empty() || model_params.size() == n),
              "megatron_fused::fused_adamw_ (CUDA): tensor lists differ in length");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cuda::AdamArgs args =
      adam_args(lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize);
  // (grad dtype, model dtype or Undefined) -> tensor indices
  std::map<std::pair<int, int>, std::vector<size_t>> groups;
  std::vector<at::Tensor> keep_grads(n);
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->is_cuda(),
                  "megatron_fused::fused_adamw_ (CUDA): params and states must be contiguous "
                  "float32 CUDA tensors (tensor ", i, ")");
    keep_grads[i] = grads[i].contiguous();
    const int model = model_params.empty() ? -1 : static_cast<int>(model_params[i].scalar_type());
    groups[{static_cast<int>(keep_grads[i].scalar_type()), model}].push_back(i);
  }
  for (const auto& [types, members] : groups) {
    std::vector<cuda::AdamTensor> table;
    std::vector<cuda::AdamChunk> chunks;
    for (size_t i : members) {
      cuda::AdamTensor t;
      t.param = params[i].data_ptr<float>();
      t.grad = keep_grads[i].data_ptr();
      t.exp_avg = exp_avgs[i].data_ptr<float>();
      t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
      t.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
      t.model_param = model_params.empty() ? nullptr : model_params[i].data_ptr();
      t.numel = params[i].numel();
      for (int64_t start = 0; start < t.numel; start += cuda::kAdamChunk)
        chunks.push_back({static_cast<int64_t>(table.size()), start});
      table.push_back(t);
    }
    const at::Tensor dev_table = to_device(table, params[0].device());
    const at::Tensor dev_chunks = to_device(chunks, params[0].device());
    const auto* tp = reinterpret_cast<const cuda::AdamTensor*>(dev_table.data_ptr());
    const auto* cp = reinterpret_cast<const cuda::AdamChunk*>(dev_chunks.data_ptr());
    const auto grad_type = static_cast<at::ScalarType>(types.first);
    const auto model_type =
        types.second < 0 ? at::kFloat : static_cast<at::ScalarType>(types.second);
    dispatch_cuda_float_types(grad_type, "fused_adamw_", [&](auto gt) {
      using Tg = typename decltype(gt)::type;
      dispatch_cuda_float_types(model_type, "fused_adamw_", [&](auto mt) {
        using Tm = typename decltype(mt)::type;
        cuda::launch_adamw<Tg, Tm>(tp, cp, static_cast<int64_t>(chunks.size()), args,
                                   current_stream());
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CUDA, m) { m.impl("fused_adamw_", &adamw_cuda); }

}  // namespace megatron_fused
