// CPU body of the multi-tensor AdamW step: every parameter of a group updated in one call.
//
// Same arithmetic as torch.optim.AdamW (single-tensor path), element by element in float32:
//   p  = p * (1 - lr wd)
//   m  = lerp(m, g, 1 - beta1)                     (fused multiply-add, as torch's kernel)
//   v  = v beta2 + ((1 - beta2) g) g               (fused multiply-add, as torch's kernel)
//   v^ = max(v^, v) when amsgrad
//   p  = p + (-lr / (1 - beta1^t)) m / (sqrt(v or v^) / sqrt(1 - beta2^t) + eps)
// with g negated when maximize. Scalars are formed in double and rounded to float once, as
// torch does. Differences from torch are rounding only (an ulp of the denominator at most):
// torch's CPU sqrt goes through MKL (not correctly rounded) where this uses IEEE sqrt, and the
// division by sqrt(1 - beta2^t) is a multiplication by its float reciprocal here.
// Tensors are cut into fixed chunks and the chunks spread over threads; grads may be
// float32/float16/bfloat16; after the update each parameter can be copied into a
// float16/bfloat16/float32 model parameter (mixed precision: fp32 main params, half model).
#include <torch/library.h>

#include <cmath>

#include "../common/cpu_utils.h"

namespace megatron_fused {
namespace {

struct AdamScalars {
  float decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
  bool lerp_small, amsgrad, maximize, has_decay;
};

// Straight-line body (selects, no branches) so that GCC vectorises it; amsgrad is a template
// argument because it adds a store.
template <bool kAmsgrad>
MEGATRON_INLINE void adamw_loop(float* __restrict p, const float* __restrict g,
                                float* __restrict m, float* __restrict v,
                                float* __restrict vmax, int64_t n, const AdamScalars& s) {
  const float decay = s.has_decay ? s.decay : 1.0f;
  const float coeff = s.lerp_small ? s.lerp_weight : s.lerp_weight - 1.0f;
  const bool from_avg = s.lerp_small;
  const float beta2 = s.beta2, omb2 = s.one_minus_beta2;
  // One division fewer than torch (which divides by the bias correction): division and sqrt
  // throughput bound this loop, and the result differs by at most an ulp of the denominator.
  const float inv_bc2 = 1.0f / s.bias_correction2_sqrt;
  const float eps = s.eps, step = s.neg_step_size, sign = s.maximize ? -1.0f : 1.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float grad = sign * g[j];
    const float param = p[j] * decay;
    const float diff = grad - m[j];
    // torch's lerp: m + w (g - m) for w < 0.5, else g - (g - m)(1 - w)
    const float avg = std::fma(coeff, diff, from_avg ? m[j] : grad);
    const float sq = std::fma(omb2 * grad, grad, v[j] * beta2);
    float sq_used = sq;
    if constexpr (kAmsgrad) {
      sq_used = vmax[j] > sq ? vmax[j] : sq;
      vmax[j] = sq_used;
    }
    const float denom = std::sqrt(sq_used) * inv_bc2 + eps;
    m[j] = avg;
    v[j] = sq;
    p[j] = param + (step * avg) / denom;
  }
}

MEGATRON_INLINE void adamw_chunk_body(float* p, const float* g, float* m, float* v, float* vmax,
                                      int64_t n, const AdamScalars& s) {
  if (s.amsgrad) {
    adamw_loop<true>(p, g, m, v, vmax, n, s);
  } else {
    adamw_loop<false>(p, g, m, v, vmax, n, s);
  }
}
MEGATRON_SIMD_FN(adamw_chunk, (float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                               const AdamScalars& s),
                 (p, g, m, v, vmax, n, s))

struct Chunk {
  int64_t tensor, start, length;
};

constexpr int64_t kChunk = 32768;

void check_lists(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs,
                 const std::vector<at::Tensor>& model_params, bool amsgrad) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "megatron_fused::fused_adamw_: ", n, " params but ", grads.size(), " grads, ",
              exp_avgs.size(), " exp_avgs, ", exp_avg_sqs.size(), " exp_avg_sqs");
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, "megatron_fused::fused_adamw_: amsgrad "
              "needs one max_exp_avg_sq per param, got ", max_exp_avg_sqs.size());
  TORCH_CHECK(model_params.empty() || model_params.size() == n, "megatron_fused::fused_adamw_: ",
              "model_params must be empty or one per param, got ", model_params.size());
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    auto fp32_state = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                  "megatron_fused::fused_adamw_: ", what, " ", i, " must be a contiguous float32 "
                  "tensor of ", numel, " elements, got ", t.scalar_type(), " ", t.sizes());
    };
    fp32_state(params[i], "param");
    fp32_state(exp_avgs[i], "exp_avg");
    fp32_state(exp_avg_sqs[i], "exp_avg_sq");
    if (amsgrad) fp32_state(max_exp_avg_sqs[i], "max_exp_avg_sq");
    TORCH_CHECK(grads[i].numel() == numel, "megatron_fused::fused_adamw_: grad ", i, " has ",
                grads[i].numel(), " elements, param has ", numel);
    if (!model_params.empty())
      TORCH_CHECK(model_params[i].numel() == numel && model_params[i].is_contiguous(),
                  "megatron_fused::fused_adamw_: model_param ", i, " must be contiguous with ",
                  numel, " elements");
  }
}

void fused_adamw(at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                 at::TensorList model_params, double lr, double beta1, double beta2, double eps,
                 double weight_decay, double step, bool amsgrad, bool maximize) {
  const std::vector<at::Tensor> p = params.vec(), m = exp_avgs.vec(), v = exp_avg_sqs.vec(),
                                vmax = max_exp_avg_sqs.vec(), out = model_params.vec();
  std::vector<at::Tensor> g;
  for (const auto& t : grads_in) g.push_back(t.contiguous());
  check_lists(p, g, m, v, vmax, out, amsgrad);

  AdamScalars s;
  s.has_decay = weight_decay != 0.0;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.lerp_small = std::abs(s.lerp_weight) < 0.5f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.amsgrad = amsgrad;
  s.maximize = maximize;

  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < static_cast<int64_t>(p.size()); ++i)
    for (int64_t start = 0; start < p[i].numel(); start += kChunk)
      chunks.push_back({i, start, std::min(kChunk, p[i].numel() - start)});

  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> bg;
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& ch = chunks[c];
      const int64_t i = ch.tensor, off = ch.start, n = ch.length;
      float* pp = p[i].data_ptr<float>() + off;
      const float* gp = nullptr;
      dispatch_float_types(g[i].scalar_type(), "fused_adamw_", [&](auto tag) {
        using T = decltype(tag);
        gp = float_row(g[i].data_ptr<T>() + off, n, bg);
      });
      adamw_chunk(pp, gp, m[i].data_ptr<float>() + off, v[i].data_ptr<float>() + off,
                  amsgrad ? vmax[i].data_ptr<float>() + off : nullptr, n, s);
      if (!out.empty()) {
        dispatch_float_types(out[i].scalar_type(), "fused_adamw_", [&](auto tag) {
          using T = decltype(tag);
          T* dst = out[i].data_ptr<T>() + off;
          if constexpr (std::is_same_v<T, float>) {
            if (dst != pp) std::copy(pp, pp + n, dst);
          } else {
            convert_from_float(pp, dst, n);
          }
        });
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) { m.impl("fused_adamw_", &fused_adamw); }

}  // namespace megatron_fused
