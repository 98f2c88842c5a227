#pragma once
// Error checks and message helpers shared by the extension's translation units.
//
// Integers go into error messages as std::to_string(...), shapes through
// shape_str: on the H200 (torch 2.11, g++ 13) a TORCH_CHECK message that
// streamed an int, a long or an IntArrayRef killed the process (SIGSEGV)
// instead of raising, also in a minimal extension built with torch's own
// flags (scripts/cxx_throw_probe.py), while strings, devices and dtypes were
// fine.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <string>

namespace torch_ops {
// "(4, 7)" / "(5,)" as Python prints a shape tuple.
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  if (t.dim() == 1) s += ",";
  return s + ")";
}

// A float32 state tensor (a scale, an amax history, a gradient channel):
// contiguous, on `like`'s device; `vector`: 1-D; `numel` >= 0: exactly that
// many elements.
inline void check_f32_state(const at::Tensor& t, const char* name, const at::Tensor& like, long long numel,
                            bool vector) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": expected float32, got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), name, ": expected device ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  if (vector) TORCH_CHECK(t.dim() == 1, name, ": expected a 1-D tensor, got shape ", shape_str(t));
  if (numel >= 0)
    TORCH_CHECK(t.numel() == numel, name, ": expected ", numel == 1 ? std::string("one element") :
                std::to_string(numel) + " elements", ", got shape ", shape_str(t));
}

// One tensor of a delayed-scaling state update without quantizing
// (amax_record_launch, quantize.cu): the tensor, its amax history and scale
// (float32, updated in place) and its FP8 format (0 E4M3, 1 E5M2).
constexpr int kMaxRecordJobs = 3;
struct AmaxRecord {
  const at::Tensor* x;
  const at::Tensor* hist;
  const at::Tensor* scale;
  int fmt;
};
void amax_record_launch(const AmaxRecord* recs, int n, int algo, double mdiv);
}  // namespace torch_ops

#define TORCH_OPS_CUDA_CHECK(expr)                                                     \
  do {                                                                                 \
    cudaError_t err__ = (expr);                                                        \
    TORCH_CHECK(err__ == cudaSuccess, "torch_ops: CUDA error in ", #expr, ": ",        \
                cudaGetErrorString(err__), " (", __FILE__, ":", std::to_string(__LINE__), ")");       \
  } while (0)

namespace torch_ops {
// Makes `t`'s device current for the scope, switching (and switching back)
// only when it is not current already: a CUDAGuard's set and restore are
// runtime calls on every launch, host time that the small path pays per step.
struct DeviceScope {
  c10::cuda::OptionalCUDAGuard guard;
  explicit DeviceScope(const at::Tensor& t) {
    int current = -1;
    TORCH_OPS_CUDA_CHECK(cudaGetDevice(&current));
    if (current != t.get_device()) guard.set_index(t.get_device());
  }
};
}  // namespace torch_ops
