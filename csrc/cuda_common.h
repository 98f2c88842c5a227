#pragma once
// What the CUDA sources share with no framework in them: the kernels of
// quantize_kernels.cuh are built into torch_ops's extension (common.h adds
// the PyTorch API around them) and into keras_fp8's JAX custom calls
// (jax_quantize.cu). Errors throw torch_ops::CudaError (a
// std::runtime_error); each framework's entry turns it into its own error.
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

namespace torch_ops {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw CudaError(std::string("torch_ops: CUDA error in ") + expr + ": " + cudaGetErrorString(err) + " (" + file +
                  ":" + std::to_string(line) + ")");
}

}  // namespace torch_ops

#define TORCH_OPS_CUDA_CHECK(expr)                                                   \
  do {                                                                               \
    const cudaError_t err__ = (expr);                                                \
    if (err__ != cudaSuccess) ::torch_ops::throw_cuda_error(err__, #expr, __FILE__, __LINE__); \
  } while (0)

namespace torch_ops {
// Per-device tables (workspaces, cached attributes) hold this many devices;
// larger indices are looked up on every call.
constexpr int kMaxDevices = 64;

// FP8 formats as the launches take them.
constexpr int kE4M3 = 0;
constexpr int kE5M2 = 1;

// The smallest scale before the margin's factor: the smallest normal float32
// (torch_ops/reference.py's MIN_SCALE; docs/numerics.md).
constexpr float kMinScale = 1.17549435082228750797e-38f;  // 2**-126

// `device`'s value of `attr`, looked up once per device (through `cache`:
// zero until then; devices past kMaxDevices are looked up every call).
inline int cached_device_attribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int device) {
  const bool cached = device >= 0 && device < kMaxDevices;
  int v = cached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    TORCH_OPS_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
    if (cached) cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// The SM count of `device`, and its compute capability as major * 10 + minor.
inline int device_sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices];
  return cached_device_attribute(cache, cudaDevAttrMultiProcessorCount, device);
}
inline int device_capability(int device) {
  static std::atomic<int> major[kMaxDevices], minor[kMaxDevices];
  return 10 * cached_device_attribute(major, cudaDevAttrComputeCapabilityMajor, device) +
         cached_device_attribute(minor, cudaDevAttrComputeCapabilityMinor, device);
}

// keras_fp8's gradient channel folded into the gradient's scaling state by
// one block (fold_block.cuh; torch_ops/reference.py's fold_pending_grad_amax
// is the reference): reads `pending` and `fold_state`, updates `history`,
// `scale` and `fold_state` in place and writes the copies `token_out`,
// `scale_out` and `history_out`. `pending` null: no job.
struct FoldJob {
  const float* pending = nullptr;
  float* fold_state = nullptr;
  float* history = nullptr;
  float* scale = nullptr;
  float* token_out = nullptr;
  float* scale_out = nullptr;
  float* history_out = nullptr;
  int H = 0;
  int window = 0;
  float inv_max = 0.0f;
  float mdiv = 1.0f;  // the margin's factor of the scale, 2**margin
  int most_recent = 0;
  int update_scale = 0;
};

// Work the last block of a quantize launch does after the call's own state
// update, instead of a launch of its own (linear.cpp: two launches fewer per
// layer and step on keras_fp8's path):
//   fold    a FoldJob (the forward's fold of the gradient channel);
//   emit_n  1 or 3: amax_out receives the gradient-channel value instead of
//           the amax: a non-finite amax reads 0, and a (3,) channel gets
//           [amax, *emit_token (0 where null), 0].
struct QuantizeExtras {
  FoldJob fold;
  int emit_n = 0;
  const float* emit_token = nullptr;
};

}  // namespace torch_ops
