// CPU body of the scaled masked softmax and the scaled upper-triangular (causal) masked softmax.
//
// Meaning (megatron/fused_kernels/softmax.py): z = x * scale, masked positions set to -10000,
// y = softmax(z) over the last dim, math in float32, y in the input's dtype. A fully masked row
// is therefore uniform. Backward: dx = scale * y * (dy - sum(dy * y)), zero where masked.
// One pass per row over data already in cache; OpenMP over rows.
#include <torch/library.h>
#include <ATen/ops/empty_like.h>

#include "../common/cpu_utils.h"

namespace megatron_fused {
namespace {

constexpr float kMasked = -10000.0f;

// Softmax of one row; mask may be null (no masking). y may not alias x.
MEGATRON_INLINE void masked_row_fwd_body(const float* x, const bool* mask, float* y, int64_t n,
                                         float scale) {
  if (mask != nullptr) {
    for (int64_t j = 0; j < n; ++j) y[j] = mask[j] ? kMasked : x[j] * scale;
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] = x[j] * scale;
  }
  const float m = lanes_max(y, n);
  const float inv = 1.0f / exp_shift_sum(y, n, m);
  for (int64_t j = 0; j < n; ++j) y[j] *= inv;
}
MEGATRON_SIMD_FN(masked_row_fwd, (const float* x, const bool* mask, float* y, int64_t n,
                                  float scale),
                 (x, mask, y, n, scale))

// Causal row: the first `visible` keys are unmasked, the other n - visible hold -10000.
MEGATRON_INLINE void causal_row_fwd_body(const float* x, float* y, int64_t n, int64_t visible,
                                         float scale) {
  for (int64_t j = 0; j < visible; ++j) y[j] = x[j] * scale;
  const int64_t hidden = n - visible;
  float m = lanes_max(y, visible);
  if (hidden > 0) m = m > kMasked ? m : kMasked;
  const float e_masked = hidden > 0 ? exp_f(kMasked - m) : 0.0f;
  const float sum = exp_shift_sum(y, visible, m) + static_cast<float>(hidden) * e_masked;
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < visible; ++j) y[j] *= inv;
  const float y_masked = e_masked * inv;
  for (int64_t j = visible; j < n; ++j) y[j] = y_masked;
}
MEGATRON_SIMD_FN(causal_row_fwd, (const float* x, float* y, int64_t n, int64_t visible,
                                  float scale),
                 (x, y, n, visible, scale))

// dx[j] = masked(j) ? 0 : scale * y[j] * (dy[j] - dot); masked(j) is mask[j], or j >= visible.
MEGATRON_INLINE void row_bwd_body(const float* dy, const float* y, const bool* mask,
                                  int64_t visible, float* dx, int64_t n, float scale) {
  const float dot = lanes_dot(dy, y, n);
  if (mask != nullptr) {
    for (int64_t j = 0; j < n; ++j) dx[j] = mask[j] ? 0.0f : (y[j] * (dy[j] - dot)) * scale;
  } else {
    for (int64_t j = 0; j < visible; ++j) dx[j] = (y[j] * (dy[j] - dot)) * scale;
    for (int64_t j = visible; j < n; ++j) dx[j] = 0.0f;
  }
}
MEGATRON_SIMD_FN(row_bwd, (const float* dy, const float* y, const bool* mask, int64_t visible,
                           float* dx, int64_t n, float scale),
                 (dy, y, mask, visible, dx, n, scale))

// Maps a row index of x (all dims but the last) to the offset of its mask row.
struct MaskRows {
  const bool* data = nullptr;
  std::vector<int64_t> sizes, strides;  // of the leading dims

  MaskRows(const std::optional<at::Tensor>& mask, const at::Tensor& x, at::Tensor& keep) {
    if (!mask.has_value() || !mask->defined()) return;
    TORCH_CHECK(mask->scalar_type() == at::kBool, "megatron_fused softmax: mask must be bool ",
                "(True = masked), got ", mask->scalar_type());
    TORCH_CHECK(mask->device() == x.device(), "megatron_fused softmax: mask on ",
                mask->device(), " but scores on ", x.device());
    keep = mask->expand(x.sizes());
    if (keep.size(-1) > 1 && keep.stride(-1) != 1) keep = keep.contiguous();
    data = keep.data_ptr<bool>();
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      sizes.push_back(x.size(d));
      strides.push_back(keep.stride(d));
    }
  }

  const bool* row(int64_t r) const {
    if (data == nullptr) return nullptr;
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      offset += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return data + offset;
  }
};

at::Tensor masked_softmax_fwd(const at::Tensor& input, const std::optional<at::Tensor>& mask,
                              double scale) {
  TORCH_CHECK(input.dim() >= 1, "megatron_fused::scaled_masked_softmax_fwd: empty shape");
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x);
  at::Tensor mask_keep;
  const MaskRows masks(mask, x, mask_keep);
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  dispatch_float_types(x.scalar_type(), "scaled_masked_softmax_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, by;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = float_row(xp + r * n, n, bx);
        float* yr = float_out(yp + r * n, n, by);
        masked_row_fwd(xr, masks.row(r), yr, n, static_cast<float>(scale));
        finish_out(yr, yp + r * n, n);
      }
    });
  });
  return out;
}

at::Tensor masked_softmax_bwd(const at::Tensor& grad_output, const at::Tensor& output,
                              const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(grad_output.sizes() == output.sizes() &&
                  grad_output.scalar_type() == output.scalar_type(),
              "megatron_fused::scaled_masked_softmax_bwd: grad and output must share shape "
              "and dtype");
  const at::Tensor g = grad_output.contiguous(), y = output.contiguous();
  at::Tensor dx = at::empty_like(y);
  at::Tensor mask_keep;
  const MaskRows masks(mask, y, mask_keep);
  const int64_t n = y.size(-1);
  const int64_t rows = n == 0 ? 0 : y.numel() / n;
  dispatch_float_types(y.scalar_type(), "scaled_masked_softmax_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = g.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    T* dp = dx.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> bg, by, bd;
      for (int64_t r = r0; r < r1; ++r) {
        const float* gr = float_row(gp + r * n, n, bg);
        const float* yr = float_row(yp + r * n, n, by);
        float* dr = float_out(dp + r * n, n, bd);
        row_bwd(gr, yr, masks.row(r), n, dr, n, static_cast<float>(scale));
        finish_out(dr, dp + r * n, n);
      }
    });
  });
  return dx;
}

// Keys visible to query i of sq against sk keys: j <= i + sk - sq (clamped to [0, sk]).
inline int64_t visible_keys(int64_t i, int64_t sq, int64_t sk) {
  return std::min<int64_t>(sk, std::max<int64_t>(0, i + sk - sq + 1));
}

at::Tensor causal_softmax_fwd(const at::Tensor& input, double scale) {
  TORCH_CHECK(input.dim() >= 2, "megatron_fused::scaled_upper_triang_masked_softmax_fwd: ",
              "expected [attn_batches, sq, sk], got ", input.sizes());
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t sk = x.size(-1), sq = x.size(-2);
  const int64_t rows = sk == 0 ? 0 : x.numel() / sk;
  dispatch_float_types(x.scalar_type(), "scaled_upper_triang_masked_softmax_fwd", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> bx, by;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t visible = visible_keys(r % sq, sq, sk);
        const float* xr = float_row(xp + r * sk, visible, bx);
        float* yr = float_out(yp + r * sk, sk, by);
        causal_row_fwd(xr, yr, sk, visible, static_cast<float>(scale));
        finish_out(yr, yp + r * sk, sk);
      }
    });
  });
  return out;
}

at::Tensor causal_softmax_bwd(const at::Tensor& grad_output, const at::Tensor& output,
                              double scale) {
  TORCH_CHECK(grad_output.sizes() == output.sizes() &&
                  grad_output.scalar_type() == output.scalar_type() && output.dim() >= 2,
              "megatron_fused::scaled_upper_triang_masked_softmax_bwd: grad and output must ",
              "share shape and dtype");
  const at::Tensor g = grad_output.contiguous(), y = output.contiguous();
  at::Tensor dx = at::empty_like(y);
  const int64_t sk = y.size(-1), sq = y.size(-2);
  const int64_t rows = sk == 0 ? 0 : y.numel() / sk;
  dispatch_float_types(y.scalar_type(), "scaled_upper_triang_masked_softmax_bwd", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = g.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    T* dp = dx.data_ptr<T>();
    at::parallel_for(0, rows, row_grain(sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> bg, by, bd;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t visible = visible_keys(r % sq, sq, sk);
        const float* gr = float_row(gp + r * sk, sk, bg);
        const float* yr = float_row(yp + r * sk, sk, by);
        float* dr = float_out(dp + r * sk, sk, bd);
        row_bwd(gr, yr, nullptr, visible, dr, sk, static_cast<float>(scale));
        finish_out(dr, dp + r * sk, sk);
      }
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_fused, CPU, m) {
  m.impl("scaled_masked_softmax_fwd", &masked_softmax_fwd);
  m.impl("scaled_masked_softmax_bwd", &masked_softmax_bwd);
  m.impl("scaled_upper_triang_masked_softmax_fwd", &causal_softmax_fwd);
  m.impl("scaled_upper_triang_masked_softmax_bwd", &causal_softmax_bwd);
}

}  // namespace megatron_fused
