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

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace torch_ops {
// Per-device tables (streams, kernel handles, cached attributes) hold this
// many devices; larger indices fail with a clear error or skip the cache.
constexpr int kMaxDevices = 64;

// The index in `choices` of environment variable `name`'s value; `dflt`
// where it is unset or empty. Any other value warns (naming the variable and
// the values it accepts) and gives `dflt`. For settings read once.
inline int env_choice(const char* name, std::initializer_list<const char*> choices, int dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == 0) return dflt;
  int i = 0;
  std::string accepted;
  for (const char* c : choices) {
    if (std::strcmp(v, c) == 0) return i;
    accepted += std::string(i ? ", '" : "'") + c + "'";
    ++i;
  }
  TORCH_WARN(name, "='", std::string(v), "' is not one of ", accepted, "; using the default");
  return dflt;
}

// An on/off setting: 1, true, on, yes / 0, false, off, no; unset or empty
// gives `dflt`, anything else warns (env_choice) and gives `dflt`.
inline bool env_flag(const char* name, bool dflt) {
  return env_choice(name, {"0", "false", "off", "no", "1", "true", "on", "yes"}, dflt ? 4 : 0) >= 4;
}

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
struct FoldJob;  // below
// `fold`: optional; the last block of the first tensor's job also runs it.
void amax_record_launch(const AmaxRecord* recs, int n, int algo, double mdiv, const FoldJob* fold = nullptr);

// The small path's bf16 GEMM that records its operands' amax (gemm_amax.cu):
// layout 0: out (M, N) = a (M, K) . b (N, K)^T; 1: a (M, K) . b (K, N);
// 2: a (K, M)^T . b (K, N). rec_a / rec_b (null: not recorded; the record's
// `x` is unused: the operand is the tensor); `bias`: added to each output
// row (bf16, contiguous, 4-byte aligned: gemm_amax_bias_applies). gemm_amax_applies says where it
// runs (bf16, contiguous, 16-byte aligned, rows a multiple of 8 elements,
// an sm_90 device).
bool gemm_amax_applies(const at::Tensor& a, const at::Tensor& b, int layout);
bool gemm_amax_bias_applies(const at::Tensor& bias, long long n, const at::Tensor& like);
bool gemm_amax_wide(long long M, long long N, int device);
at::Tensor gemm_amax(const at::Tensor& a, const at::Tensor& b, int layout, const AmaxRecord* rec_a,
                     const AmaxRecord* rec_b, int algo, double mdiv, const at::Tensor* bias = nullptr);
// Two of them in one launch (the small path's backward: dX in layout 0 or
// 1, dW in layout 2): (a0 . b0, a1 . b1); recs: the records of a0, b0, a1,
// b1 (null: none, at most three non-null). gemm_amax_pair_applies says
// where it runs: where gemm_amax runs each, and all their tiles fit in one
// wave of CTAs (or dX's do and dW's split into as many parts: the chain).
// gemm_amax_pair_fits: whether the backward of a (M, K) x (K, N) linear
// layer (weight in_out or out_in) has the tiles for it.
bool gemm_amax_pair_applies(const at::Tensor& a0, const at::Tensor& b0, int layout0, const at::Tensor& a1,
                            const at::Tensor& b1);
bool gemm_amax_pair_fits(long long M, long long K, long long N, bool in_out, int device);
std::pair<at::Tensor, at::Tensor> gemm_amax_pair(const at::Tensor& a0, const at::Tensor& b0, int layout0,
                                                 const at::Tensor& a1, const at::Tensor& b1,
                                                 const AmaxRecord* const (&recs)[4], int algo, double mdiv);

// keras_fp8's gradient channel folded into the gradient's scaling state by
// one block (fold.cu: fold_grad_amax, and torch_ops/fold.py for the meaning
// of every entry): reads `pending` and `fold_state`, updates `history`,
// `scale` and `fold_state` in place and writes the snapshots `token_out`,
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
  float mdiv = 1.0f;
  int most_recent = 0;
  int update_scale = 0;
};

// One-block work that the last block of a quantize launch (quantize.cu) does
// after the call's own state update, instead of a launch of its own
// (linear.cpp: two fewer launches per layer and step on keras_fp8's path):
//   fold    a FoldJob (the forward's fold of the gradient channel);
//   emit_n  1 or 3: amax_out receives the gradient-channel value instead of
//           the amax: a non-finite amax reads 0, and a (3,) channel gets
//           [amax, *emit_token (0 where null), 0] (emit_pending_grad).
struct QuantizeExtras {
  FoldJob fold;
  int emit_n = 0;
  const float* emit_token = nullptr;
};

// fold_grad_amax in two steps (fold.cu): the checks, the snapshot tensors and
// the job, then its launch (on its own, or by a quantize's last block).
struct FoldOutputs {
  at::Tensor token, scale, history;
  FoldJob job;
};
FoldOutputs prepare_fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state, const at::Tensor& history,
                                   const at::Tensor& scale, double inv_max, double mdiv, int algo, long long window,
                                   bool update_scale);
void fold_launch(const at::Tensor& like, const FoldJob& job);

// True when `stream` is capturing a CUDA graph, or its state cannot be read
// (gemm.cpp).
bool stream_capturing(cudaStream_t stream);
}  // namespace torch_ops

#define TORCH_OPS_CUDA_CHECK(expr)                                                     \
  do {                                                                                 \
    cudaError_t err__ = (expr);                                                        \
    TORCH_CHECK(err__ == cudaSuccess, "torch_ops: CUDA error in ", #expr, ": ",        \
                cudaGetErrorString(err__), " (", __FILE__, ":", std::to_string(__LINE__), ")");       \
  } while (0)

namespace torch_ops {
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

// The SM count of `device`, and its compute capability as major * 10 +
// minor: the per-device attributes the launches size and choose by.
inline int device_sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices];
  return cached_device_attribute(cache, cudaDevAttrMultiProcessorCount, device);
}
inline int device_capability(int device) {
  static std::atomic<int> major[kMaxDevices], minor[kMaxDevices];
  return 10 * cached_device_attribute(major, cudaDevAttrComputeCapabilityMajor, device) +
         cached_device_attribute(minor, cudaDevAttrComputeCapabilityMinor, device);
}

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
