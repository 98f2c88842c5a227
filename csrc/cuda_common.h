#pragma once
// The framework-free kernels' constants, call descriptions and error type
// (namespace fp8_kernels; fp8_kernels.h is the documented entry). Built
// into torch_ops's extension (common.h adds the PyTorch API around them)
// and into keras_fp8's JAX custom calls. Errors throw
// fp8_kernels::CudaError (a std::runtime_error); each framework's entry
// turns it into its own error.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp8_kernels {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw CudaError(std::string("CUDA error in ") + expr + ": " + cudaGetErrorString(err) + " (" + file +
                  ":" + std::to_string(line) + ")");
}

}  // namespace fp8_kernels

#define FP8_KERNELS_CUDA_CHECK(expr)                                                   \
  do {                                                                               \
    const cudaError_t err__ = (expr);                                                \
    if (err__ != cudaSuccess) ::fp8_kernels::throw_cuda_error(err__, #expr, __FILE__, __LINE__); \
  } while (0)

namespace fp8_kernels {
// Per-device tables (workspaces, cached attributes) hold this many devices;
// larger indices are looked up on every call.
constexpr int kMaxDevices = 64;

// The numerics constants, each torch_ops/reference.py's (the torch_ops
// extension's load compares them: torch_ops/extension.py).
// FP8 formats as the launches take them (FP8_FORMAT_IDS).
constexpr int kE4M3 = 0;
constexpr int kE5M2 = 1;
// The largest finite value of each format (FP8_MAX).
constexpr double kE4M3Max = 448.0;
constexpr double kE5M2Max = 57344.0;
// Amax algorithms as the launches take them (AMAX_COMPUTE_ALGO_IDS).
constexpr int kAmaxMax = 0;
constexpr int kAmaxMostRecent = 1;
// The smallest scale before the margin's factor: the smallest normal float32
// (MIN_SCALE; docs/numerics.md).
constexpr float kMinScale = 1.17549435082228750797e-38f;  // 2**-126
// Fold counts wrap here, so that fold tokens stay exact in float32
// (FOLD_COUNT_PERIOD).
constexpr float kFoldCountPeriod = 1048576.0f;  // 2**20
// The longest amax history a state may have (MAX_HISTORY_LEN).
constexpr long long kMaxHistoryLen = 1LL << 20;

// `device`'s value of `attr`, looked up once per device (through `cache`:
// zero until then; devices past kMaxDevices are looked up every call).
inline int cached_device_attribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int device) {
  const bool cached = device >= 0 && device < kMaxDevices;
  int v = cached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    FP8_KERNELS_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
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

// The workspace of the amax reductions: this many zeroed 32-bit words,
// left zero again by every launch (its last block resets what it used).
// Slots: [0,1] pre-pass, [2,3] main kernel, [2..7] the jobs of the state
// kernel, [8..10] float scratch (scale_used of state-only updates), [12,13]
// the seed of the lean kernels' fallback launch (Finalize::split).
constexpr int kWsWords = 16;

enum class InType { kBF16, kF16, kF32 };

// One quantize of a contiguous (R, C) x (fp8_kernels.h, quantize_run); a
// null pointer where an argument is not given.
struct QuantizeCall {
  const void* x = nullptr;
  InType x_type = InType::kBF16;
  long long R = 0, C = 0;
  int fmt = kE4M3;
  int scale_mode = 0;                   // 0 given scale, 1 delayed, 2 current
  const float* scale_in = nullptr;      // mode 0: the scale; 1: state scale; 2: prev (may be null)
  float* scale_used = nullptr;          // mode 0: the scale itself (read only)
  float* amax_out = nullptr;
  float* history = nullptr;             // null: nothing recorded
  long long H = 0;
  float* scale_state = nullptr;         // the next scale when recording
  const float* hist_for_empty = nullptr;  // mode 1: the history (the empty check)
  long long hist_for_empty_n = 0;
  uint8_t* q = nullptr;                 // (R, ldq)
  long long ldq = 0;
  uint8_t* qt = nullptr;                // (C, ldqt)
  long long ldqt = 0;
  int algo = 0;
  float mdiv = 1.0f;
  bool skip_zero = false;
  const QuantizeExtras* extras = nullptr;
  int device = 0;                       // current while the launch runs
  cudaStream_t stream = nullptr;
  unsigned* workspace = nullptr;        // kWsWords words (see above)
};

}  // namespace fp8_kernels
