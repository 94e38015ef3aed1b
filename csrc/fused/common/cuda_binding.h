// Shared pieces of the thin torch bindings of the CUDA bodies (csrc/fused/*/ *_cuda.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace megatron_fused {

template <typename T>
struct CudaTag {
  using type = T;
};

// Calls f(CudaTag<T>{}) with T the CUDA type of a float32 / float16 / bfloat16 tensor
// (at::Half and at::BFloat16 share the layout of __half and __nv_bfloat16).
template <typename F>
void dispatch_cuda_float_types(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::ScalarType::Float: f(CudaTag<float>{}); break;
    case at::ScalarType::Half: f(CudaTag<__half>{}); break;
    case at::ScalarType::BFloat16: f(CudaTag<__nv_bfloat16>{}); break;
    default:
      TORCH_CHECK(false, "megatron_fused::", op, " (CUDA): dtype ", st,
                  " is not supported (expected float32, float16 or bfloat16)");
  }
}

template <typename T>
T* cuda_ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
const T* cuda_ptr_or_null(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace megatron_fused
