// torch_ops's quantize launches (common.h): the kernels and their launch are
// quantize_kernels.cuh's; this file adds the PyTorch side: the device and
// stream of the tensors, the persistent workspace of the amax reductions
// (CUDA-graph capture included) and the checks.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "common.h"
#include "fp8_kernels.h"

namespace torch_ops {
namespace {

// Persistent workspace of the amax reductions, one per (device, stream):
// zeroed once when created; every kernel that uses a slot pair leaves it zero
// again (its last block resets it), so no memset per call. Kernels on one
// stream run in order, so they can share it; another stream gets its own.
// Under CUDA-graph capture each capture gets its own workspace: one of the
// device's reserve slots, zeroed before any capture (the kernels leave their
// counters at zero when they finish), or, past those, one zeroed by a memset
// captured into that graph at its first use (so once per replay, not per
// call): a workspace first zeroed inside a graph that is never replayed must
// not be used by anything else.
// (kWsWords and its slots: cuda_common.h.)
struct Ws {
  unsigned long long capture_id;  // 0: not captured
  at::Tensor t;
};
std::mutex g_ws_mu;
std::map<std::pair<int, cudaStream_t>, Ws> g_ws;
// Per device: workspaces zeroed outside any capture for the first
// kReserveSlots (capture, stream) pairs (a slot is never handed out twice;
// later captures zero their own inside the graph).
constexpr int kReserveSlots = 64;
struct WsReserve {
  at::Tensor t;
  int next = 0;
};
std::map<int, WsReserve> g_ws_reserve;
std::atomic<unsigned long long> g_ws_generation{0};  // +1 whenever an entry gets a new tensor

unsigned* workspace_lookup(const at::Tensor& like, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  FP8_KERNELS_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
  if (status != cudaStreamCaptureStatusActive) id = 0;
  const int device = (int)like.get_device();
  std::lock_guard<std::mutex> lk(g_ws_mu);
  Ws& w = g_ws[std::make_pair(device, stream)];
  if (!w.t.defined() || w.capture_id != id) {
    WsReserve& r = g_ws_reserve[device];
    if (id != 0 && r.t.defined() && r.next < kReserveSlots) {
      // A capture: a slot zeroed ahead (no memset node in the graph).
      w.t = r.t.narrow(0, (int64_t)r.next++ * fp8_kernels::kWsWords, fp8_kernels::kWsWords);
    } else {
      // at::zeros runs on the current stream (= stream): ordered before the
      // first kernel that uses it (inside a capture: a node of that graph,
      // the memory from the graph's pool).
      w.t = at::zeros({fp8_kernels::kWsWords}, like.options().dtype(at::kInt));
    }
    if (id == 0 && !r.t.defined()) {
      // The device's first workspace outside a capture: zero the slots for
      // later captures too, and wait for it once, so that a graph replayed
      // on any stream finds them zeroed.
      // (Relaxed: another thread's capture in global mode does not forbid
      // this thread's one synchronization of a stream it is not capturing.)
      r.t = at::zeros({(int64_t)kReserveSlots * fp8_kernels::kWsWords}, like.options().dtype(at::kInt));
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      FP8_KERNELS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      const cudaError_t synced = cudaStreamSynchronize(stream);
      FP8_KERNELS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      FP8_KERNELS_CUDA_CHECK(synced);
    }
    w.capture_id = id;
    g_ws_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  return reinterpret_cast<unsigned*>(w.t.data_ptr<int>());
}

// workspace_lookup with a per-thread memo of the last eager (device, stream):
// outside capture a call costs one cudaStreamIsCapturing, no lock. The memo
// is dropped whenever any entry gets a new tensor (the generation moved).
unsigned* workspace(const at::Tensor& like, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FP8_KERNELS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return workspace_lookup(like, stream);
  struct Memo {
    int device = -1;
    cudaStream_t stream = nullptr;
    unsigned long long generation = ~0ull;
    unsigned* ws = nullptr;
  };
  thread_local Memo memo;
  const int device = (int)like.get_device();
  const unsigned long long generation = g_ws_generation.load(std::memory_order_acquire);
  if (memo.device == device && memo.stream == stream && memo.generation == generation) return memo.ws;
  // The generation read before the lookup: a replacement since then misses
  // next time instead of being memoized as current.
  memo = Memo{device, stream, generation, workspace_lookup(like, stream)};
  return memo.ws;
}

float* f32_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
uint8_t* bytes_or_null(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint8_t*>(t.data_ptr()) : nullptr;
}

}  // namespace

// x: contiguous (R, C) on CUDA. Writes outputs, returns nothing (allocation
// happens in the caller, bindings.cpp).
//   scale_mode: 0 = given scale (scale_used is read, never written here)
//               1 = delayed (scale_used seeded from the amax when the history
//                   is empty: by a pre-pass, or where the lean kernels apply
//                   by their own check and a fallback launch)
//               2 = current (pre-pass always computes scale_used from amax)
//   extras: null, or work for the last block after the state update (common.h).
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode,
                     const at::Tensor& scale_in,        // mode 0: the scale; mode 1: state scale; mode 2: prev (may be undefined)
                     const at::Tensor& scale_used,      // 0-d float32 output (mode 0: same as scale_in)
                     const at::Tensor& amax_out,
                     const at::Tensor& history,         // undefined: no record
                     const at::Tensor& scale_state,     // where the next scale goes when recording
                     const at::Tensor& hist_for_empty,  // mode 1: history (for the empty check)
                     const at::Tensor& q, long long ldq, const at::Tensor& qt, long long ldqt, int algo,
                     double mdiv_d, bool skip_zero, const QuantizeExtras* extras) {
  const DeviceScope device_scope(x);
  if (extras) {
    TORCH_CHECK(extras->emit_n == 0 || (amax_out.defined() && amax_out.numel() == extras->emit_n),
                "quantize_launch: the gradient channel's size does not match emit_n");
  }
  fp8_kernels::QuantizeCall c;
  c.x = x.data_ptr();
  switch (x.scalar_type()) {
    case at::kBFloat16: c.x_type = fp8_kernels::InType::kBF16; break;
    case at::kHalf: c.x_type = fp8_kernels::InType::kF16; break;
    case at::kFloat: c.x_type = fp8_kernels::InType::kF32; break;
    default:
      TORCH_CHECK(false, "x: expected a bfloat16, float16 or float32 tensor, got ", x.scalar_type());
  }
  c.R = R;
  c.C = C;
  c.fmt = fmt;
  c.scale_mode = scale_mode;
  c.scale_in = f32_or_null(scale_in);
  c.scale_used = scale_used.data_ptr<float>();
  c.amax_out = amax_out.data_ptr<float>();
  c.history = f32_or_null(history);
  c.H = history.defined() ? history.numel() : 0;
  c.scale_state = f32_or_null(scale_state);
  c.hist_for_empty = f32_or_null(hist_for_empty);
  c.hist_for_empty_n = hist_for_empty.defined() ? hist_for_empty.numel() : 0;
  c.q = bytes_or_null(q);
  c.ldq = ldq;
  c.qt = bytes_or_null(qt);
  c.ldqt = ldqt;
  c.algo = algo;
  c.mdiv = (float)mdiv_d;
  c.skip_zero = skip_zero;
  c.extras = extras;
  c.device = (int)x.get_device();
  c.stream = c10::cuda::getCurrentCUDAStream();
  c.workspace = workspace(x, c.stream);
  fp8_kernels::quantize_run(c);
}

// Records `amax` into `history` and publishes the next scale (one block).
void record_amax_launch(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt,
                        int algo, double mdiv_d, bool skip_zero) {
  const DeviceScope device_scope(history);
  fp8_kernels::record_amax_run(history.data_ptr<float>(), history.numel(), scale.data_ptr<float>(),
                               amax.data_ptr<float>(), fmt, algo, (float)mdiv_d, skip_zero,
                               c10::cuda::getCurrentCUDAStream());
}

}  // namespace torch_ops
