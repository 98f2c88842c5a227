#pragma once
// The torch bindings' C++ API between the extension's translation units, and
// the checks and helpers they share: PyTorch tensors around the
// framework-free kernels of fp8_kernels.h. bindings.cpp exposes these to
// Python (torch_ops/ops.py and torch_ops/linear.py); torch_ops/reference.py
// is the reference of every numerics rule they implement.
//
// Integers go into error messages as std::to_string(...), shapes through
// shape_str: with torch 2.11 and g++ 13, a TORCH_CHECK message that streamed
// an int, a long or an IntArrayRef killed the process (SIGSEGV) instead of
// raising, while strings, devices and dtypes were fine.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <cuda_runtime.h>

#include "cuda_common.h"

#include <atomic>
#include <string>
#include <tuple>
#include <vector>

namespace torch_ops {
// The framework-free kernels' constants and call descriptions the torch
// bindings share (fp8_kernels.h).
using fp8_kernels::FoldJob;
using fp8_kernels::kAmaxMax;
using fp8_kernels::kAmaxMostRecent;
using fp8_kernels::kE4M3;
using fp8_kernels::kE4M3Max;
using fp8_kernels::kE5M2;
using fp8_kernels::kE5M2Max;
using fp8_kernels::kMaxHistoryLen;
using fp8_kernels::QuantizeExtras;

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

// Makes `t`'s device current for the scope, switching (and switching back)
// only when it is not current already: a CUDAGuard's set and restore are
// runtime calls on every launch, host time on the eager path.
struct DeviceScope {
  c10::cuda::OptionalCUDAGuard guard;
  explicit DeviceScope(const at::Tensor& t) {
    int current = -1;
    FP8_KERNELS_CUDA_CHECK(cudaGetDevice(&current));
    if (current != t.get_device()) guard.set_index(t.get_device());
  }
};

// ---------------------------------------------------------------------------
// quantize.cu

// x: contiguous (R, C) on CUDA; the outputs are allocated by the caller.
//   scale_mode 0: quantize with `scale_in` (scale_used is scale_in);
//              1: delayed scaling (`scale_in` is the state's scale; seeded
//                 from the amax where `hist_for_empty` is empty);
//              2: current scaling (`scale_in`: the fallback, may be undefined).
//   history, scale_state: where a recording call shifts the amax in and
//   writes the next scale (undefined: nothing recorded).
//   q (R, ldq), qt (C, ldqt): undefined where not wanted; padding columns
//   are written as zero bytes. mdiv: the margin's factor of the scale
//   (2**margin as float32).
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode,
                     const at::Tensor& scale_in, const at::Tensor& scale_used, const at::Tensor& amax_out,
                     const at::Tensor& history, const at::Tensor& scale_state, const at::Tensor& hist_for_empty,
                     const at::Tensor& q, long long ldq, const at::Tensor& qt, long long ldqt, int algo,
                     double mdiv, bool skip_zero, const QuantizeExtras* extras);

// Records `amax` into `history` (if finite; and > 0 with skip_zero) and
// writes the next scale into `scale`.
void record_amax_launch(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt,
                        int algo, double mdiv, bool skip_zero);

// ---------------------------------------------------------------------------
// fold.cu

// fold_grad_amax in two steps: the checks, the copies and the job, then its
// launch (on its own, or by a quantize's last block: QuantizeExtras).
struct FoldOutputs {
  at::Tensor token, scale, history;
  FoldJob job;
};
FoldOutputs prepare_fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state, const at::Tensor& history,
                                   const at::Tensor& scale, double inv_max, double mdiv, int algo, long long window,
                                   bool update_scale);
void fold_launch(const at::Tensor& like, const FoldJob& job);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state,
                                                              const at::Tensor& history, const at::Tensor& scale,
                                                              double inv_max, double mdiv, int algo,
                                                              long long window, bool update_scale);

// ---------------------------------------------------------------------------
// gemm.cpp

// out (M, N) = (a @ b^T) * scale_a * scale_b (+ bias), a (M, K) and b (N, K)
// FP8, through cuBLASLt (lt_gemm.h); `autotune`: time the candidates of a shape's first
// call (outside graph capture) and keep the fastest.
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum, bool autotune);

// ---------------------------------------------------------------------------
// block.cu: block-scaling quantize (torch_ops/reference.py's quantize_tiles,
// quantize_blocks). `mult`: the margin's factor 2**margin.

// Tiles of 128 along x's rows (transposed false: q (R, C), scales
// (R, ceil(C/128))) or along its columns, written transposed (q (C, R),
// scales (C, ceil(R/128))).
std::tuple<at::Tensor, at::Tensor> quantize_tiles(const at::Tensor& x, int64_t fmt, bool transposed, double mult,
                                                  bool power_of_two);
// 128 x 128 blocks of w: (q (R, C), q_t (C, R), scales (ceil(R/128), ceil(C/128))).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& w, int64_t fmt, double mult,
                                                               bool power_of_two);

// gemm.cpp: out (M, N) = a (M, K) @ b (N, K)^T of block-scaled operands: a in
// 1 x 128 tiles along K (a_scales (M, ceil(K/128))), b in 1 x 128 tiles
// (b_tiles: b_scales (N, ceil(K/128))) or 128 x 128 blocks (b_scales
// (ceil(N/128), ceil(K/128))); float32 accumulation, the bias added before
// the one rounding. An undefined tensor where cuBLASLt has no kernel for the
// combination (the caller runs the reference).
at::Tensor block_gemm(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                      const at::Tensor& b_scales, bool b_tiles, const c10::optional<at::Tensor>& bias,
                      at::ScalarType out_dtype);

// ---------------------------------------------------------------------------
// linear.cpp: the eager entry of torch_ops/linear.py (see there)

// torch_ops.LinearConfig as the eager entry reads it: built once per config
// (torch_ops/linear.py's native_options), bound to Python as LinearOptions.
// Hidden, as pybind11's own types are: a bound type must not be more
// visible than pybind11's base class of it.
struct __attribute__((visibility("hidden"))) LinearOptions {
  at::ScalarType grad_dtype = at::kFloat8_e5m2;  // the output gradient's FP8 dtype
  bool current_scaling = false;                  // false: delayed scaling
  double margin_multiplier = 1.0;                // 2**margin, a float32 value
  int64_t amax_algorithm = kAmaxMax;             // kAmaxMax or kAmaxMostRecent
  int64_t fold_window = 0;                       // the gradient fold's "max" window; 0: the whole history
  bool in_out = false;                           // the weight is (K, N)
  bool fast_accum_forward = true;                // cuBLASLt's fast accumulation, per GEMM
  bool fast_accum_dgrad = false;
  bool fast_accum_wgrad = false;
};

// The FP8 linear: x (..., K), weight (N, K) or (K, N) (in_out), bias (N,)
// or none, state the six float32 tensors of torch_ops.FP8LinearState in
// field order, and optionally its gradient channel (pending, fold_state).
// x_fp8: empty, or x as an earlier linear quantized it (torch_ops/sharing.py)
// {q, q_t (None where not written), scale_used, amax}: x is not quantized
// again and a training call records that amax. Every argument checked by
// the caller. Returns {(..., N) in x's dtype}, followed, with return_x_fp8
// (and no x_fp8), by x's {q, q_t (None where not written), scale_used, amax}.
std::vector<c10::optional<at::Tensor>> linear(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const std::vector<at::Tensor>& state, const c10::optional<at::Tensor>& grad_amax_pending,
    const c10::optional<at::Tensor>& grad_fold_state, const LinearOptions& options, bool training, bool record_inputs,
    bool autotune, const std::vector<c10::optional<at::Tensor>>& x_fp8, bool return_x_fp8);

// ---------------------------------------------------------------------------
// producers.cu: fused producers (a norm's last step, a gated activation)
// writing y, its FP8 copy (rows padded to 16 bytes with `pad`) and its amax.
// `history` given: the scale is a linear's delayed-scaling state (`scale`),
// seeded from y's amax while the history is empty; else `scale` as given.
// Returns {y, q, scale_used, amax}. Every argument checked by the caller
// (bindings.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> scaled_rows_quantize_launch(
    const at::Tensor& x, const at::Tensor& row_mul, const at::Tensor& weight, at::ScalarType out_dtype,
    const c10::optional<at::Tensor>& history, const at::Tensor& scale, int fmt, double mdiv, bool pad);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_quantize_launch(
    const at::Tensor& gate, const c10::optional<at::Tensor>& up, int activation,
    const c10::optional<at::Tensor>& history, const at::Tensor& scale, int fmt, double mdiv, bool pad);
}  // namespace torch_ops
