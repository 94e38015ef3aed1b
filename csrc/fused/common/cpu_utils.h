// Shared pieces of the CPU bodies: dtype dispatch, row conversion to float, deterministic
// column sums. Included by every csrc/fused/*/ *_cpu.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace megatron_fused {

// Row conversions (defined in cpu_convert.cpp, vectorised with runtime ISA selection).
void convert_to_float(const float* src, float* dst, int64_t n);
void convert_to_float(const c10::BFloat16* src, float* dst, int64_t n);
void convert_to_float(const c10::Half* src, float* dst, int64_t n);
void convert_from_float(const float* src, float* dst, int64_t n);
void convert_from_float(const float* src, c10::BFloat16* dst, int64_t n);
void convert_from_float(const float* src, c10::Half* dst, int64_t n);

// Calls f(T{}) with T the C++ type of a float32 / float16 / bfloat16 tensor.
template <typename F>
void dispatch_float_types(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::ScalarType::Float: f(float{}); break;
    case at::ScalarType::Half: f(c10::Half{}); break;
    case at::ScalarType::BFloat16: f(c10::BFloat16{}); break;
    default:
      TORCH_CHECK(false, "megatron_fused::", op, ": dtype ", st,
                  " is not supported (expected float32, float16 or bfloat16)");
  }
}

// A float view of n values at src: src itself for float, else a conversion into buf.
template <typename T>
const float* float_row(const T* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    convert_to_float(src, buf.data(), n);
    return buf.data();
  }
}

// Where a float result for dst should be written: dst itself for float, else buf.
template <typename T>
float* float_out(T* dst, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    return buf.data();
  }
}

// Finishes float_out: converts buf into dst when T is not float.
template <typename T>
void finish_out(const float* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) convert_from_float(src, dst, n);
}

// Rows grouped into blocks whose count depends only on the number of rows, so that per-block
// partial sums, added in block order, give the same bits for any thread count.
struct RowBlocks {
  int64_t rows;
  int64_t rows_per_block;
  int64_t count;
  explicit RowBlocks(int64_t rows_)
      : rows(rows_),
        rows_per_block(std::max<int64_t>(16, (rows_ + 255) / 256)),
        count((rows_ + rows_per_block - 1) / rows_per_block) {}
  int64_t begin(int64_t b) const { return b * rows_per_block; }
  int64_t end(int64_t b) const { return std::min(rows, (b + 1) * rows_per_block); }
};

// out[c] = sum over b of partial[b * cols + c], blocks added in order.
void sum_blocks(const float* partial, int64_t blocks, int64_t cols, float* out);

// Adds src into acc (both float, n values).
void add_into(float* acc, const float* src, int64_t n);

// Grain sizes for at::parallel_for: enough work per task to amortise the fork.
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len));
}

}  // namespace megatron_fused
