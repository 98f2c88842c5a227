// Folding a pending output-gradient amax into the gradient's scaling state, in
// one launch (keras_fp8's gradient channel; torch_ops/fold.py has the
// reference and the meaning of every entry).
//
// One block: pass 1 writes the new history to `history_out` (out of place, so
// no thread reads an entry another has already shifted) and reduces the
// window's max; pass 2 copies it back into `history`; thread 0 finishes the
// scale, the fold state and the token. Same float32 operations in the same
// order as the reference: bit-identical state.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"

namespace torch_ops {
namespace {

constexpr int kThreads = 256;
constexpr float kFoldCountPeriod = 1048576.0f;  // 2**20

// torch's max: NaN wins.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(b) || b > a) ? b : a; }

__global__ void fold_grad_amax_kernel(const float* __restrict__ pending, float* __restrict__ fold_state,
                                      float* __restrict__ history, float* __restrict__ scale,
                                      float* __restrict__ token_out, float* __restrict__ scale_out,
                                      float* __restrict__ history_out, int H, int window, float inv_max, float mdiv,
                                      bool most_recent, bool update_scale) {
  __shared__ float partial[kThreads / 32];
  const float amax = pending[0], token = pending[1], loss_scale = pending[2];
  const float folds = fold_state[0], last_token = fold_state[1], last_loss_scale = fold_state[2];
  // A changed fp16 loss scale rescales what was recorded under the old one.
  float rescale = 1.0f;
  if (loss_scale > 0.0f && last_loss_scale > 0.0f) rescale = __fdiv_rn(loss_scale, fmaxf(last_loss_scale, 1e-30f));
  const bool fresh = token > 0.0f && token != last_token;
  const bool record = fresh && isfinite(amax) && amax > 0.0f;

  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v;
    if (record) {
      v = i == 0 ? amax : __fmul_rn(history[i - 1], rescale);
    } else {
      v = __fmul_rn(history[i], rescale);
    }
    history_out[i] = v;
    if (i < window) local_max = nan_max(local_max, v);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = nan_max(local_max, __shfl_down_sync(0xffffffffu, local_max, offset));
  }
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = local_max;
  __syncthreads();  // also makes history_out visible to the whole block
  for (int i = threadIdx.x; i < H; i += blockDim.x) history[i] = history_out[i];
  if (threadIdx.x != 0) return;
  float window_amax = partial[0];
  for (int w = 1; w < kThreads / 32; ++w) window_amax = nan_max(window_amax, partial[w]);
  if (most_recent) window_amax = history_out[0];

  float s = __fmul_rn(scale[0], rescale);
  if (update_scale && fresh && isfinite(window_amax) && window_amax > 0.0f) {
    s = __fmul_rn(__fmul_rn(window_amax, inv_max), mdiv);
  }
  scale[0] = s;
  scale_out[0] = s;
  const float new_folds = fresh ? fmodf(folds + 1.0f, kFoldCountPeriod) : folds;
  fold_state[0] = new_folds;
  fold_state[1] = fresh ? token : last_token;
  fold_state[2] = loss_scale > 0.0f ? loss_scale : last_loss_scale;
  token_out[0] = new_folds + 1.0f;
}

// The gradient-channel value of one backward: out[0] holds the gradient's
// amax and becomes 0 where it is not finite; a (3,) out gets [., token, 0]
// (token 0 when none was emitted).
__global__ void emit_pending_grad_kernel(float* __restrict__ out, const float* __restrict__ token, int n) {
  const float a = out[0];
  out[0] = isfinite(a) ? a : 0.0f;
  if (n == 3) {
    out[1] = token ? token[0] : 0.0f;
    out[2] = 0.0f;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state,
                                                              const at::Tensor& history, const at::Tensor& scale,
                                                              double inv_max, double mdiv, int algo,
                                                              long long window, bool update_scale) {
  TORCH_CHECK(pending.is_cuda(), "pending: expected a CUDA tensor, got device ", pending.device());
  check_f32_state(pending, "pending", pending, 3, true);
  check_f32_state(fold_state, "fold_state", pending, 3, true);
  check_f32_state(history, "amax_history", pending, -1, true);
  check_f32_state(scale, "scale", pending, 1, false);
  TORCH_CHECK(history.numel() >= 1 && history.numel() < (1LL << 31), "amax_history: expected 1 to 2**31-1 entries");
  TORCH_CHECK(window >= 1, "window: expected >= 1, got ", std::to_string(window));
  const DeviceScope device_scope(pending);
  const int H = static_cast<int>(history.numel());
  const int w = static_cast<int>(std::min<long long>(window, H));
  at::Tensor token = at::empty({}, pending.options());
  at::Tensor scale_out = at::empty({}, pending.options());
  at::Tensor history_out = at::empty({H}, pending.options());
  fold_grad_amax_kernel<<<1, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      pending.data_ptr<float>(), fold_state.data_ptr<float>(), history.data_ptr<float>(), scale.data_ptr<float>(),
      token.data_ptr<float>(), scale_out.data_ptr<float>(), history_out.data_ptr<float>(), H, w,
      static_cast<float>(inv_max), static_cast<float>(mdiv), algo == 1, update_scale);
  TORCH_OPS_CUDA_CHECK(cudaGetLastError());
  return {token, scale_out, history_out};
}

// out: 0-d or (3,) float32 on CUDA holding the amax in out[0]; token: 0-d
// float32 or undefined (linear.cpp's backward, one launch instead of
// isfinite/where/stack).
void emit_pending_grad_launch(const at::Tensor& out, const at::Tensor& token) {
  const DeviceScope device_scope(out);
  emit_pending_grad_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      out.data_ptr<float>(), token.defined() ? token.data_ptr<float>() : nullptr, (int)out.numel());
  TORCH_OPS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torch_ops
