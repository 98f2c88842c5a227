#pragma once
// The fold of keras_fp8's gradient channel by one block (fold.cu launches it
// on its own; quantize.cu's last block runs it after a quantize's state
// update, QuantizeExtras). torch_ops/reference.py (fold_pending_grad_amax) has the reference and the
// meaning of every entry; the same float32 operations in the same order, so
// the state is bit-identical.
//
// Pass 1 writes the new history to `history_out` (out of place, so no thread
// reads an entry another has already shifted) and reduces the window's max;
// pass 2 copies it back into `history`; thread 0 finishes the scale, the fold
// state and the token. Any block of whole warps (up to 1024 threads); every
// thread of the block must call it.

#include <cuda_runtime.h>

#include "cuda_common.h"

namespace fp8_kernels {
namespace {

// torch's max: NaN wins.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(b) || b > a) ? b : a; }

__device__ void fold_block(const FoldJob& j) {
  __shared__ float partial[32];
  const float amax = j.pending[0], token = j.pending[1], loss_scale = j.pending[2];
  const float folds = j.fold_state[0], last_token = j.fold_state[1], last_loss_scale = j.fold_state[2];
  // A changed fp16 loss scale rescales what was recorded under the old one.
  float rescale = 1.0f;
  if (loss_scale > 0.0f && last_loss_scale > 0.0f) rescale = __fdiv_rn(loss_scale, fmaxf(last_loss_scale, 1e-30f));
  const bool fresh = token > 0.0f && token != last_token;
  const bool record = fresh && isfinite(amax) && amax > 0.0f;

  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < j.H; i += blockDim.x) {
    const float v = record ? (i == 0 ? amax : __fmul_rn(j.history[i - 1], rescale)) : __fmul_rn(j.history[i], rescale);
    j.history_out[i] = v;
    if (i < j.window) local_max = nan_max(local_max, v);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = nan_max(local_max, __shfl_down_sync(0xffffffffu, local_max, offset));
  }
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = local_max;
  __syncthreads();  // also makes history_out visible to the whole block, and every read of fold_state done
  for (int i = threadIdx.x; i < j.H; i += blockDim.x) j.history[i] = j.history_out[i];
  if (threadIdx.x == 0) {
    float window_amax = partial[0];
    for (int w = 1; w < (int)(blockDim.x / 32); ++w) window_amax = nan_max(window_amax, partial[w]);
    if (j.most_recent) window_amax = j.history_out[0];
    float s = fmaxf(__fmul_rn(j.scale[0], rescale), kMinScale);
    if (j.update_scale && fresh && isfinite(window_amax) && window_amax > 0.0f) {
      s = __fmul_rn(fmaxf(__fmul_rn(window_amax, j.inv_max), kMinScale), j.mdiv);
    }
    j.scale[0] = s;
    j.scale_out[0] = s;
    const float new_folds = fresh ? fmodf(folds + 1.0f, kFoldCountPeriod) : folds;
    j.fold_state[0] = new_folds;
    j.fold_state[1] = fresh ? token : last_token;
    j.fold_state[2] = loss_scale > 0.0f ? loss_scale : last_loss_scale;
    j.token_out[0] = new_folds + 1.0f;
  }
  __syncthreads();  // the block may reuse `partial`'s neighbours next
}

constexpr int kFoldThreads = 256;

__global__ void __launch_bounds__(kFoldThreads) fold_grad_amax_kernel(FoldJob j) { fold_block(j); }

// The fold `job` describes, as one launch of one block on `stream`.
inline void fold_run(const FoldJob& job, cudaStream_t stream) {
  fold_grad_amax_kernel<<<1, kFoldThreads, 0, stream>>>(job);
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace fp8_kernels
