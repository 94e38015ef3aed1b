// CPU body of bias + GeLU (tanh approximation), forward and backward.
//
// Meaning (megatron/fused_kernels/bias_gelu.py), with v = x + bias:
//   y  = 0.5 v (1 + tanh(0.79788456 v (1 + 0.044715 v^2)))
//   dx = dy * (0.5 v (1 - t^2)(0.79788456 + 3 * 0.044715 * 0.79788456 v^2) + 0.5 (1 + t))
//   dbias = sum of dx over all leading dims (float32, fixed block order).
// Math in float32 for every input dtype; one pass per row, OpenMP over rows.
#include <torch/library.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include "../common/cpu_utils.h"

namespace megatron_fused {
namespace {

constexpr float kSqrt2OverPi = 0.79788456f;
constexpr float kCubic = 0.044715f;
constexpr float kDerivCubic = 3.0f * 0.044715f * 0.79788456f;

MEGATRON_INLINE void gelu_row_fwd_body(const float* x, const float* b, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = b != nullptr ? x[j] + b[j] : x[j];
    const float t = tanh_f(kSqrt2OverPi * v * (1.0f + kCubic * v * v));
    y[j] = v * 0.5f * (1.0f + t);
  }
}
MEGATRON_SIMD_FN(gelu_row_fwd, (const float* x, const float* b, float* y, int64_t n),
                 (x, b, y, n))

MEGATRON_INLINE void gelu_row_bwd_body(const float* g, const float* x, const float* b, float* dx,
                                       float* gb, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = b != nullptr ? x[j] + b[j] : x[j];
    const float t = tanh_f(kSqrt2OverPi * v * (1.0f + kCubic * v * v));
    const float d = 0.5f * v * (1.0f - t * t) * (kSqrt2OverPi + kDerivCubic * v * v) +
                    0.5f * (1.0f + t);
    dx[j] = d * g[j];
  }
  if (gb != nullptr) add_into(gb, dx, n);
}
MEGATRON_SIMD_FN(gelu_row_bwd, (const float* g, const float* x, const float* b, float* dx,
                                float* gb, int64_t n),
                 (g, x, b, dx, gb, n))

int64_t row_length(const at::Tensor& x, const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.dim() >= 1, "megatron_fused::", op, ": input must have at least one dim");
  const int64_t n = x.size(-1);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "megatron_fused::", op, ": bias of shape ",
                bias->sizes(), " does not match the last dim of input ", x.sizes());
  return n;
}

at::Tensor bias_gelu_fwd(const at::Tensor& input, const std::optional<at::Tensor>& bias) {
  const int64_t n = row_length(input, bias, "bias_gelu_fwd");
  const at::Tensor x = input.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  dispatch_float_types(x.scalar_type(), "bias_gelu_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, by;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        float* yr = float_out(yp + r * n, n, by);
        gelu_row_fwd(xr, bp, yr, n);
        finish_out(yr, yp + r * n, n);
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& grad_output,
                                                 const at::Tensor& input,
                                                 const std::optional<at::Tensor>& bias) {
  const int64_t n = row_length(input, bias, "bias_gelu_bwd");
  TORCH_CHECK(grad_output.sizes() == input.sizes() &&
                  grad_output.scalar_type() == input.scalar_type(),
              "megatron_fused::bias_gelu_bwd: grad and input must share shape and dtype");
  const at::Tensor x = input.contiguous(), g = grad_output.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  at::Tensor dx = at::empty_like(x);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const RowBlocks blocks(rows);
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor part = has_bias ? at::zeros({blocks.count, n}, fopts) : at::Tensor();
  at::Tensor grad_b = at::empty({has_bias ? n : 0}, fopts);
  float* pp = has_bias ? part.data_ptr<float>() : nullptr;
  dispatch_float_types(x.scalar_type(), "bias_gelu_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* gp = g.data_ptr<T>();
    T* dp = dx.data_ptr<T>();
    at::parallel_for(0, blocks.count, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> bx, bg, bd;
      for (int64_t blk = b0; blk < b1; ++blk) {
        for (int64_t r = blocks.begin(blk); r < blocks.end(blk); ++r) {
          const float* xr = float_row(xp + r * n, n, bx);
          const float* gr = float_row(gp + r * n, n, bg);
          float* dr = float_out(dp + r * n, n, bd);
          gelu_row_bwd(gr, xr, bp, dr, pp == nullptr ? nullptr : pp + blk * n, n);
          finish_out(dr, dp + r * n, n);
        }
      }
    });
  });
  if (has_bias) sum_blocks(pp, blocks.count, n, grad_b.data_ptr<float>());
  return {dx, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("bias_gelu_fwd", &bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
}

}  // namespace megatron_fused
