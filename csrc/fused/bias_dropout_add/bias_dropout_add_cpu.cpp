// CPU body of bias + dropout + residual add, training and inference.
//
// Meaning (megatron/fused_kernels/bias_dropout_add.py): out = residual + dropout(x + bias, p).
// Inference: out = residual + x + bias. Training: element e is kept when word e % 4 of
// Philox4x32-10(counter = offset + e / 4, key = seed) is >= p * 2^32, and then scaled by
// 1 / (1 - p). seed is drawn from the CPU generator (torch.manual_seed and the model-parallel
// RNG tracker control it); (seed, offset) are returned so the backward regenerates the mask
// instead of storing it:  dx = keep ? dy / (1 - p) : 0,  dbias = sum of dx over rows,
// dresidual = dy (passed through by the Python wrapper).
#include <torch/library.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <mutex>

#include "../common/cpu_utils.h"
#include "../common/philox.h"

namespace megatron_fused {
namespace {

MEGATRON_INLINE void philox_fill_body(uint32_t* out, uint64_t counter0, int64_t count,
                                      uint64_t key) {
  for (int64_t i = 0; i < count; ++i) {
    const Philox4 r = philox4x32_10(counter0 + static_cast<uint64_t>(i), key);
    out[4 * i + 0] = r.v[0];
    out[4 * i + 1] = r.v[1];
    out[4 * i + 2] = r.v[2];
    out[4 * i + 3] = r.v[3];
  }
}
MEGATRON_SIMD_FN(philox_fill, (uint32_t* out, uint64_t counter0, int64_t count, uint64_t key),
                 (out, counter0, count, key))

// Random words of elements [e0, e0 + n), in buf; returns a pointer to the word of e0.
const uint32_t* element_words(int64_t e0, int64_t n, uint64_t seed, uint64_t offset,
                              std::vector<uint32_t>& buf) {
  const int64_t k0 = e0 / 4, k1 = (e0 + n + 3) / 4;
  buf.resize(static_cast<size_t>(4 * (k1 - k0)));
  philox_fill(buf.data(), offset + static_cast<uint64_t>(k0), k1 - k0, seed);
  return buf.data() + (e0 - 4 * k0);
}

MEGATRON_INLINE void dropout_add_row_body(const float* x, const float* b, const float* res,
                                          const uint32_t* words, float* out, int64_t n,
                                          uint32_t threshold, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = b != nullptr ? x[j] + b[j] : x[j];
    out[j] = res[j] + (words[j] >= threshold ? v * scale : 0.0f);
  }
}
MEGATRON_SIMD_FN(dropout_add_row, (const float* x, const float* b, const float* res,
                                   const uint32_t* words, float* out, int64_t n, uint32_t threshold,
                                   float scale),
                 (x, b, res, words, out, n, threshold, scale))

MEGATRON_INLINE void add_row_body(const float* x, const float* b, const float* res, float* out,
                                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = res[j] + (b != nullptr ? x[j] + b[j] : x[j]);
}
MEGATRON_SIMD_FN(add_row, (const float* x, const float* b, const float* res, float* out, int64_t n),
                 (x, b, res, out, n))

MEGATRON_INLINE void dropout_grad_row_body(const float* g, const uint32_t* words, float* dx,
                                           int64_t n, uint32_t threshold, float scale) {
  for (int64_t j = 0; j < n; ++j) dx[j] = words[j] >= threshold ? g[j] * scale : 0.0f;
}
MEGATRON_SIMD_FN(dropout_grad_row, (const float* g, const uint32_t* words, float* dx, int64_t n,
                                    uint32_t threshold, float scale),
                 (g, words, dx, n, threshold, scale))

struct DropoutParams {
  uint32_t threshold;
  float scale;
  explicit DropoutParams(double p) {
    const uint64_t t = dropout_threshold(p);
    threshold = t > 0xFFFFFFFFull ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
    scale = p >= 1.0 ? 0.0f : 1.0f / static_cast<float>(1.0 - p);
  }
};

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_fwd(
    const at::Tensor& input, const std::optional<at::Tensor>& bias, const at::Tensor& residual,
    double prob, bool training, std::optional<at::Generator> generator) {
  TORCH_CHECK(input.sizes() == residual.sizes() && input.scalar_type() == residual.scalar_type(),
              "megatron_fused::bias_dropout_add_fwd: input ", input.sizes(), " ",
              input.scalar_type(), " and residual ", residual.sizes(), " ",
              residual.scalar_type(), " must share shape and dtype");
  TORCH_CHECK(prob >= 0.0 && prob <= 1.0, "megatron_fused::bias_dropout_add_fwd: dropout ",
              "probability must be in [0, 1], got ", prob);
  const int64_t n = input.dim() == 0 ? 1 : input.size(-1);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == n),
              "megatron_fused::bias_dropout_add_fwd: bias of shape ",
              has_bias ? bias->sizes() : at::IntArrayRef{}, " does not match input ",
              input.sizes());
  const at::Tensor x = input.contiguous(), res = residual.contiguous();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(x);
  at::Tensor rng_state = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  uint64_t seed = 0, offset = 0;
  const bool drop = training && prob > 0.0;
  if (drop) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        generator, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    seed = gen->random64();
  }
  rng_state[0] = static_cast<int64_t>(seed);
  rng_state[1] = static_cast<int64_t>(offset);
  const DropoutParams dp(prob);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  dispatch_float_types(x.scalar_type(), "bias_dropout_add_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = res.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, br, bo;
      std::vector<uint32_t> bw;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        const float* rr = float_row(rp + r * n, n, br);
        float* orow = float_out(op + r * n, n, bo);
        if (drop) {
          const uint32_t* w = element_words(r * n, n, seed, offset, bw);
          dropout_add_row(xr, bp, rr, w, orow, n, dp.threshold, dp.scale);
        } else {
          add_row(xr, bp, rr, orow, n);
        }
        finish_out(orow, op + r * n, n);
      }
    });
  });
  return {out, rng_state};
}

// bias_numel > 0: also return dbias of that length (rows of that length); 0: no bias.
std::tuple<at::Tensor, at::Tensor> bias_dropout_add_bwd(const at::Tensor& grad_output,
                                                        const at::Tensor& rng_state, double prob,
                                                        bool training, int64_t bias_numel) {
  const at::Tensor g = grad_output.contiguous();
  const int64_t n = bias_numel > 0 ? bias_numel : (g.dim() == 0 ? 1 : g.size(-1));
  TORCH_CHECK(g.dim() >= 1 && g.size(-1) == n, "megatron_fused::bias_dropout_add_bwd: bias of ",
              bias_numel, " values does not match grad ", g.sizes());
  const at::Tensor state = rng_state.to(at::kCPU);
  const uint64_t seed = static_cast<uint64_t>(state[0].item<int64_t>());
  const uint64_t offset = static_cast<uint64_t>(state[1].item<int64_t>());
  const bool drop = training && prob > 0.0;
  const DropoutParams dp(prob);
  at::Tensor dx = at::empty_like(g);
  const int64_t rows = n == 0 ? 0 : g.numel() / n;
  const RowBlocks blocks(rows);
  auto fopts = g.options().dtype(at::kFloat);
  at::Tensor part = bias_numel > 0 ? at::zeros({blocks.count, n}, fopts) : at::Tensor();
  at::Tensor grad_b = at::empty({bias_numel > 0 ? n : 0}, fopts);
  float* pp = bias_numel > 0 ? part.data_ptr<float>() : nullptr;
  dispatch_float_types(g.scalar_type(), "bias_dropout_add_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = g.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    at::parallel_for(0, blocks.count, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> bg, bd;
      std::vector<uint32_t> bw;
      for (int64_t blk = b0; blk < b1; ++blk) {
        for (int64_t r = blocks.begin(blk); r < blocks.end(blk); ++r) {
          const float* gr = float_row(gp + r * n, n, bg);
          float* dr = float_out(dxp + r * n, n, bd);
          if (drop) {
            const uint32_t* w = element_words(r * n, n, seed, offset, bw);
            dropout_grad_row(gr, w, dr, n, dp.threshold, dp.scale);
          } else {
            std::copy(gr, gr + n, dr);
          }
          if (pp != nullptr) add_into(pp + blk * n, dr, n);
          finish_out(dr, dxp + r * n, n);
        }
      }
    });
  });
  if (pp != nullptr) sum_blocks(pp, blocks.count, n, grad_b.data_ptr<float>());
  return {dx, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("bias_dropout_add_fwd", &bias_dropout_add_fwd);
  m.impl("bias_dropout_add_bwd", &bias_dropout_add_bwd);
}

}  // namespace megatron_fused
