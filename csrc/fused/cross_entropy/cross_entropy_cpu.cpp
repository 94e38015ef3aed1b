// CPU body of the chunked (vocab-parallel capable) cross entropy: never forms softmax(logits).
//
// Forward, per row of logits x (this rank's vocabulary slice [vocab_start, vocab_start + V_local)):
//   stats[0] = max x,  stats[1] = sum exp(x - max),  stats[2] = x[target] if this slice owns the
//   target else 0,  stats[3] = sum x,  stats[4] = 1 if this slice owns the target else 0.
// The Python wrapper combines the stats across tensor-parallel ranks (rescaling the sums to the
// global max) and forms loss = lse - x[target] (Megatron's label smoothing from sum x).
// Backward writes grad = (exp(x - lse) - (1 - s) onehot(target) - s / V) * dloss into
// grad_input, which may be the logits' own storage (in-place backward, no extra [N, V] buffer).
#include <torch/library.h>
#include <ATen/ops/empty.h>

#include "../common/cpu_utils.h"

namespace megatron_fused {
namespace {

MEGATRON_INLINE float lanes_exp_sum(const float* x, int64_t n, float m) {
  float acc[MEGATRON_LANES] = {0.0f};
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) acc[k] += exp_f(x[j + k] - m);
  for (int k = 0; j + k < n; ++k) acc[k] += exp_f(x[j + k] - m);
  float s = 0.0f;
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc[k];
  return s;
}

// max and sum of x in one pass (both cheap), then the sum of exponentials.
MEGATRON_INLINE void ce_row_stats_body(const float* x, int64_t n, float* max_out, float* sumexp_out,
                                       float* sum_out) {
  float acc_max[MEGATRON_LANES], acc_sum[MEGATRON_LANES] = {0.0f};
  for (int k = 0; k < MEGATRON_LANES; ++k) acc_max[k] = -INFINITY;
  int64_t j = 0;
  for (; j + MEGATRON_LANES <= n; j += MEGATRON_LANES)
    for (int k = 0; k < MEGATRON_LANES; ++k) {
      acc_max[k] = acc_max[k] > x[j + k] ? acc_max[k] : x[j + k];
      acc_sum[k] += x[j + k];
    }
  for (int k = 0; j + k < n; ++k) {
    acc_max[k] = acc_max[k] > x[j + k] ? acc_max[k] : x[j + k];
    acc_sum[k] += x[j + k];
  }
  float m = acc_max[0], s = 0.0f;
  for (int k = 1; k < MEGATRON_LANES; ++k) m = m > acc_max[k] ? m : acc_max[k];
  for (int k = 0; k < MEGATRON_LANES; ++k) s += acc_sum[k];
  *max_out = m;
  *sum_out = s;
  *sumexp_out = lanes_exp_sum(x, n, m);
}
MEGATRON_SIMD_FN(ce_row_stats, (const float* x, int64_t n, float* max_out, float* sumexp_out,
                                float* sum_out),
                 (x, n, max_out, sumexp_out, sum_out))

// dx may alias x (element j is read before it is written).
MEGATRON_INLINE void ce_row_grad_body(const float* x, float* dx, int64_t n, float lse,
                                      float uniform, float g) {
  for (int64_t j = 0; j < n; ++j) dx[j] = (exp_f(x[j] - lse) - uniform) * g;
}
MEGATRON_SIMD_FN(ce_row_grad, (const float* x, float* dx, int64_t n, float lse, float uniform,
                               float g),
                 (x, dx, n, lse, uniform, g))

void check_ce_args(const at::Tensor& logits, const at::Tensor& target, const char* op) {
  TORCH_CHECK(logits.dim() >= 1 && target.numel() * logits.size(-1) == logits.numel(),
              "megatron_fused::", op, ": target of shape ", target.sizes(),
              " does not match logits of shape ", logits.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, "megatron_fused::", op,
              ": target must be int64, got ", target.scalar_type());
}

at::Tensor cross_entropy_fwd(const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start) {
  check_ce_args(logits, target, "cross_entropy_fwd");
  const at::Tensor x = logits.contiguous(), t = target.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = t.numel();
  at::Tensor stats = at::empty({5, rows}, x.options().dtype(at::kFloat));
  float* sp = stats.data_ptr<float>();
  const int64_t* tp = t.data_ptr<int64_t>();
  dispatch_float_types(x.scalar_type(), "cross_entropy_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> bx;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        ce_row_stats(xr, n, sp + r, sp + rows + r, sp + 3 * rows + r);
        const int64_t local = tp[r] - vocab_start;
        const bool owned = local >= 0 && local < n;
        sp[2 * rows + r] = owned ? xr[local] : 0.0f;
        sp[4 * rows + r] = owned ? 1.0f : 0.0f;
      }
    });
  });
  return stats;
}

void cross_entropy_bwd(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                       const at::Tensor& grad_loss, int64_t vocab_start, int64_t vocab_size,
                       double smoothing, const at::Tensor& grad_input) {
  check_ce_args(logits, target, "cross_entropy_bwd");
  TORCH_CHECK(grad_input.sizes() == logits.sizes() &&
                  grad_input.scalar_type() == logits.scalar_type() &&
                  grad_input.is_contiguous() && logits.is_contiguous(),
              "megatron_fused::cross_entropy_bwd: grad_input must be contiguous with the "
              "logits' shape and dtype");
  const at::Tensor t = target.contiguous();
  const at::Tensor l = lse.to(at::kFloat).contiguous(), g = grad_loss.to(at::kFloat).contiguous();
  const int64_t n = logits.size(-1), rows = t.numel();
  TORCH_CHECK(l.numel() == rows && g.numel() == rows, "megatron_fused::cross_entropy_bwd: lse ",
              "and grad_loss need one value per target");
  const float uniform = static_cast<float>(smoothing / static_cast<double>(vocab_size));
  const float on_target = static_cast<float>(1.0 - smoothing);
  const int64_t* tp = t.data_ptr<int64_t>();
  const float* lp = l.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  dispatch_float_types(logits.scalar_type(), "cross_entropy_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.data_ptr<T>();
    T* dp = grad_input.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, bd;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        float* dr = float_out(dp + r * n, n, bd);
        const int64_t local = tp[r] - vocab_start;
        const bool owned = local >= 0 && local < n;
        const float x_target = owned ? xr[local] : 0.0f;
        ce_row_grad(xr, dr, n, lp[r], uniform, gp[r]);
        if (owned) dr[local] = ((exp_f(x_target - lp[r]) - on_target) - uniform) * gp[r];
        finish_out(dr, dp + r * n, n);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("cross_entropy_fwd", &cross_entropy_fwd);
  m.impl("cross_entropy_bwd", &cross_entropy_bwd);
}

}  // namespace megatron_fused
