// CPU body of layer norm and RMS norm over the last dimension, float32 statistics.
//
// Meaning (megatron/fused_kernels/layer_norm.py):
//   layer norm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(biased var + eps)
//   RMS norm:   y = x * rstd * w,                rstd = 1 / sqrt(mean(x^2) + eps)
// The output has x's dtype, except float32 x with half-precision weights gives the weights'
// dtype. Forward also returns mean and rstd (float32, one per row) for the backward:
//   xhat = (x - mean) rstd, dxhat = dy * w,
//   dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))   (RMS: no mean(dxhat) term)
//   dw = sum over rows of dy xhat, db = sum over rows of dy  (float32, fixed block order).
#include <torch/library.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include "../common/cpu_utils.h"

namespace megatron_fused {
namespace {

MEGATRON_INLINE void norm_row_fwd_body(const float* x, const float* w, const float* b, float* y,
                                       int64_t n, float eps, bool rms, float* mean_out,
                                       float* rstd_out) {
  float mean = 0.0f, rstd;
  if (rms) {
    rstd = 1.0f / std::sqrt(lanes_dot(x, x, n) / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) y[j] = (x[j] * rstd) * w[j];
  } else {
    mean = lanes_sum(x, n) / static_cast<float>(n);
    rstd = 1.0f / std::sqrt(lanes_sq_dev(x, n, mean) / static_cast<float>(n) + eps);
    if (b != nullptr) {
      for (int64_t j = 0; j < n; ++j) y[j] = ((x[j] - mean) * rstd) * w[j] + b[j];
    } else {
      for (int64_t j = 0; j < n; ++j) y[j] = ((x[j] - mean) * rstd) * w[j];
    }
  }
  *mean_out = mean;
  *rstd_out = rstd;
}
MEGATRON_SIMD_FN(norm_row_fwd, (const float* x, const float* w, const float* b, float* y, int64_t n,
                                float eps, bool rms, float* mean_out, float* rstd_out),
                 (x, w, b, y, n, eps, rms, mean_out, rstd_out))

// dx for one row, and dy * xhat, dy added into the per-block sums gw, gb (gb may be null).
MEGATRON_INLINE void norm_row_bwd_body(const float* g, const float* x, const float* w, float mean,
                                       float rstd, int64_t n, bool rms, float* dx, float* gw,
                                       float* gb) {
  float acc_dxh[MEGATRON_LANES] = {0.0f}, acc_dxh_xhat[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) {
      const float xhat = (x[j + k] - mean) * rstd;
      const float dxh = g[j + k] * w[j + k];
      acc_dxh[k] += dxh;
      acc_dxh_xhat[k] += dxh * xhat;
    }
  for (int k = 0; j + k < n; ++k) {
    const float xhat = (x[j + k] - mean) * rstd;
    const float dxh = g[j + k] * w[j + k];
    acc_dxh[k] += dxh;
    acc_dxh_xhat[k] += dxh * xhat;
  }
  float sum_dxh = 0.0f, sum_dxh_xhat = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) {
    sum_dxh += acc_dxh[k];
    sum_dxh_xhat += acc_dxh_xhat[k];
  }
  const float a = rms ? 0.0f : sum_dxh / static_cast<float>(n);
  const float c = sum_dxh_xhat / static_cast<float>(n);
  for (j = 0; j < n; ++j) {
    const float xhat = (x[j] - mean) * rstd;
    dx[j] = rstd * (g[j] * w[j] - a - xhat * c);
    gw[j] += g[j] * xhat;
  }
  if (gb != nullptr) add_into(gb, g, n);
}
MEGATRON_SIMD_FN(norm_row_bwd, (const float* g, const float* x, const float* w, float mean,
                                float rstd, int64_t n, bool rms, float* dx, float* gw, float* gb),
                 (g, x, w, mean, rstd, n, rms, dx, gw, gb))

// Calls f(Tx{}, To{}) for the supported (input, output) dtype pairs.
template <typename F>
void dispatch_norm_types(at::ScalarType x_type, at::ScalarType out_type, const char* op, F&& f) {
  dispatch_float_types(x_type, op, [&](auto x_tag) {
    dispatch_float_types(out_type, op, [&](auto out_tag) { f(x_tag, out_tag); });
  });
}

at::ScalarType output_type(const at::Tensor& x, const at::Tensor& w) {
  const bool half_w = w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16;
  return (x.scalar_type() == at::kFloat && half_w) ? w.scalar_type() : x.scalar_type();
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "megatron_fused::", op,
              ": weight of shape ", w.sizes(), " does not match the last dim of input ",
              x.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    double eps, bool rms) {
  check_norm_args(input, weight, "layer_norm_fwd");
  const at::Tensor x = input.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const bool has_bias = !rms && bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(output_type(x, weight)));
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  float* mp = mean.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  dispatch_norm_types(x.scalar_type(), y.scalar_type(), "layer_norm_fwd", [&](auto xt, auto ot) {
    using Tx = decltype(xt);
    using To = decltype(ot);
    const Tx* xp = x.data_ptr<Tx>();
    To* yp = y.data_ptr<To>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, by;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        float* yr = float_out(yp + r * n, n, by);
        norm_row_fwd(xr, wp, bp, yr, n, static_cast<float>(eps), rms, mp + r, rp + r);
        finish_out(yr, yp + r * n, n);
      }
    });
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd, bool rms) {
  check_norm_args(input, weight, "layer_norm_bwd");
  TORCH_CHECK(grad_output.sizes() == input.sizes(), "megatron_fused::layer_norm_bwd: grad of "
              "shape ", grad_output.sizes(), " for input of shape ", input.sizes());
  const at::Tensor x = input.contiguous(), g = grad_output.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor mean_c = mean.to(at::kFloat).contiguous();
  const at::Tensor rstd_c = rstd.to(at::kFloat).contiguous();
  at::Tensor dx = at::empty_like(x);
  const RowBlocks blocks(rows);
  auto fopts = x.options().dtype(at::kFloat);
  at::Tensor part_w = at::zeros({blocks.count, n}, fopts);
  at::Tensor part_b = rms ? at::Tensor() : at::zeros({blocks.count, n}, fopts);
  at::Tensor grad_w = at::empty({n}, fopts);
  at::Tensor grad_b = at::empty({rms ? 0 : n}, fopts);
  const float* wp = w.data_ptr<float>();
  const float* mp = mean_c.data_ptr<float>();
  const float* rp = rstd_c.data_ptr<float>();
  float* pw = part_w.data_ptr<float>();
  float* pb = rms ? nullptr : part_b.data_ptr<float>();
  dispatch_norm_types(x.scalar_type(), g.scalar_type(), "layer_norm_bwd", [&](auto xt, auto gt) {
    using Tx = decltype(xt);
    using Tg = decltype(gt);
    const Tx* xp = x.data_ptr<Tx>();
    const Tg* gp = g.data_ptr<Tg>();
    Tx* dp = dx.data_ptr<Tx>();
    at::parallel_for(0, blocks.count, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> bx, bg, bd;
      for (int64_t blk = b0; blk < b1; ++blk) {
        for (int64_t r = blocks.begin(blk); r < blocks.end(blk); ++r) {
          const float* xr = float_row(xp + r * n, n, bx);
          const float* gr = float_row(gp + r * n, n, bg);
          float* dr = float_out(dp + r * n, n, bd);
          norm_row_bwd(gr, xr, wp, rms ? 0.0f : mp[r], rp[r], n, rms, dr, pw + blk * n,
                       pb == nullptr ? nullptr : pb + blk * n);
          finish_out(dr, dp + r * n, n);
        }
      }
    });
  });
  sum_blocks(pw, blocks.count, n, grad_w.data_ptr<float>());
  if (!rms) sum_blocks(pb, blocks.count, n, grad_b.data_ptr<float>());
  return {dx, grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
}

}  // namespace megatron_fused
