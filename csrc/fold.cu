// Folding a pending output-gradient amax into the gradient's scaling state, in
// one launch (keras_fp8's gradient channel; torch_ops/reference.py has the
// reference and the meaning of every entry). The block's work is
// fold_block.cuh's, which quantize.cu's last block also runs where a layer's
// forward folds during its input's quantize (linear.cpp).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include "common.h"
#include "fp8_kernels.h"

namespace torch_ops {

FoldOutputs prepare_fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state, const at::Tensor& history,
                                   const at::Tensor& scale, double inv_max, double mdiv, int algo, long long window,
                                   bool update_scale) {
  TORCH_CHECK(pending.is_cuda(), "pending: expected a CUDA tensor, got device ", pending.device());
  check_f32_state(pending, "pending", pending, 3, true);
  check_f32_state(fold_state, "fold_state", pending, 3, true);
  check_f32_state(history, "amax_history", pending, -1, true);
  check_f32_state(scale, "scale", pending, 1, false);
  TORCH_CHECK(history.numel() >= 1 && history.numel() <= kMaxHistoryLen,
              "amax_history: expected 1 to ", std::to_string(kMaxHistoryLen), " entries, got ",
              std::to_string(history.numel()));
  TORCH_CHECK(window >= 1, "window: expected >= 1, got ", std::to_string(window));
  FoldOutputs o;
  const int H = static_cast<int>(history.numel());
  o.token = at::empty({}, pending.options());
  o.scale = at::empty({}, pending.options());
  o.history = at::empty({H}, pending.options());
  FoldJob& j = o.job;
  j.pending = pending.data_ptr<float>();
  j.fold_state = fold_state.data_ptr<float>();
  j.history = history.data_ptr<float>();
  j.scale = scale.data_ptr<float>();
  j.token_out = o.token.data_ptr<float>();
  j.scale_out = o.scale.data_ptr<float>();
  j.history_out = o.history.data_ptr<float>();
  j.H = H;
  j.window = static_cast<int>(std::min<long long>(window, H));
  j.inv_max = static_cast<float>(inv_max);
  j.mdiv = static_cast<float>(mdiv);
  j.most_recent = algo == kAmaxMostRecent ? 1 : 0;
  j.update_scale = update_scale ? 1 : 0;
  return o;
}

void fold_launch(const at::Tensor& like, const FoldJob& job) {
  const DeviceScope device_scope(like);
  fp8_kernels::fold_run(job, c10::cuda::getCurrentCUDAStream());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state,
                                                              const at::Tensor& history, const at::Tensor& scale,
                                                              double inv_max, double mdiv, int algo,
                                                              long long window, bool update_scale) {
  FoldOutputs o = prepare_fold_grad_amax(pending, fold_state, history, scale, inv_max, mdiv, algo, window, update_scale);
  fold_launch(pending, o.job);
  return {o.token, o.scale, o.history};
}

}  // namespace torch_ops
