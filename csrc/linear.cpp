// The eager entry of torch_ops/linear.py: the FP8 linear's quantize launches,
// GEMMs and an autograd Function whose backward runs without Python. The
// algorithm is torch_ops/linear.py's (whose autograd Function over the
// torch.library ops is the torch.compile path); tests compare the two and
// both with torch_ops/reference.py.
//
// linear(x, weight, bias, <6 state tensors>, grad_amax_pending,
//        grad_fold_state, options, training, record_inputs, autotune, x_fp8,
//        return_x_fp8)
//   -> [out (x's leading dims, N)] (+ x's quantized copy, see common.h).
//   `options` is the call's LinearConfig as a LinearOptions struct
//   (common.h). With a gradient channel (grad_amax_pending and
//   grad_fold_state given): the channel's fold, then the linear with
//   `grad_amax_pending` as the channel: its gradient is [amax (0 if not
//   finite), token, 0]. With `x_fp8` (one quantize per tensor,
//   torch_ops/sharing.py) x arrives quantized by an earlier linear and only
//   its amax is recorded here.
// torch_ops/linear.py checks every argument and chooses this route (plain
// dense CUDA tensors the kernels serve, per-tensor scaling, no amax
// reduction, at or above min_gemm_size) before calling: nothing is checked
// again here.

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <vector>

#include "common.h"

namespace torch_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// quantize_launch's scale modes of the two per-tensor scalings.
constexpr int kDelayedMode = 1;
constexpr int kCurrentMode = 2;

long long r16(long long v) { return (v + 15) / 16 * 16; }

// The bias in `dtype` (the GEMMs' output dtype), if there is one.
c10::optional<at::Tensor> bias_as(const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  if (!bias) return c10::nullopt;
  return bias->scalar_type() == dtype ? *bias : bias->to(dtype);
}

struct Q {
  at::Tensor q, qt, scale_used, amax;
};

// torch_ops/linear.py's _quantize (the GEMM-ready padded layouts). Outputs
// not asked for stay undefined; the amax goes to `amax_out` when given (a
// gradient-channel buffer), else to a new 0-d tensor. A recording call under
// current scaling stores the scale it used in `scale`. `extras`: the
// launch's last block also folds or emits (common.h).
Q quant(const at::Tensor& x, const at::Tensor& hist, const at::Tensor& scale, int fmt, bool current_scaling,
        double mdiv, int algo, bool transpose, bool record, bool write_q, const at::Tensor& amax_out = at::Tensor(),
        const QuantizeExtras* extras = nullptr) {
  const long long R = x.size(0), C = x.size(1);
  const auto opts = x.options().dtype(fmt == kE5M2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  const long long ldq = r16(C), ldqt = r16(R);
  Q o;
  if (write_q) o.q = at::empty({R, ldq}, opts);
  if (transpose) o.qt = at::empty({C, ldqt}, opts);
  const auto fo = x.options().dtype(at::kFloat);
  o.amax = amax_out.defined() ? amax_out : at::empty({}, fo);
  o.scale_used = at::empty({}, fo);
  at::Tensor none;
  if (!current_scaling) {
    quantize_launch(x, R, C, fmt, kDelayedMode, scale, o.scale_used, o.amax, record ? hist : none,
                    record ? scale : none, hist, o.q, ldq, o.qt, ldqt, algo, mdiv, false, extras);
  } else {
    quantize_launch(x, R, C, fmt, kCurrentMode, scale, o.scale_used, o.amax, none, none, none, o.q, ldq, o.qt,
                    ldqt, 0, mdiv, false, extras);
    if (record) scale.copy_(o.scale_used.reshape(scale.sizes()));
  }
  return o;
}

// What one call's backward needs besides its differentiable inputs.
struct Saved {
  at::Tensor qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_hist, grad_scale, token;
  bool need_dx = false, need_dw = false, record_grad = false, has_bias = false;
  bool has_channel = false;     // the node's channel input: its gradient is [amax, token, 0]
  bool db_in_x_dtype = false;   // a gradient-channel call: the bias was added in x's dtype
  bool autotune = false;
};

int fp8_format_id(at::ScalarType t) { return t == at::kFloat8_e5m2 ? kE5M2 : kE4M3; }

class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2d, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& channel,
                            const LinearOptions& options, const Saved& s) {
    (void)channel;
    auto& sd = ctx->saved_data;
    // The options and the call's flags, one typed entry each.
    sd["grad_dtype"] = options.grad_dtype;
    sd["current_scaling"] = options.current_scaling;
    sd["margin_multiplier"] = options.margin_multiplier;
    sd["amax_algorithm"] = options.amax_algorithm;
    sd["in_out"] = options.in_out;
    sd["fast_accum_dgrad"] = options.fast_accum_dgrad;
    sd["fast_accum_wgrad"] = options.fast_accum_wgrad;
    sd["need_dx"] = s.need_dx;
    sd["need_dw"] = s.need_dw;
    sd["record_grad"] = s.record_grad;
    sd["has_bias"] = s.has_bias;
    sd["has_channel"] = s.has_channel;
    sd["db_in_x_dtype"] = s.db_in_x_dtype;
    sd["autotune"] = s.autotune;
    sd["x_dtype"] = x2d.scalar_type();
    sd["w_dtype"] = weight.scalar_type();
    sd["b_dtype"] = s.has_bias ? bias->scalar_type() : at::kFloat;
    // The grad state is read and written by the backward's quantize kernel
    // (raw pointers, as the Python path does): kept without version checks.
    sd["grad_hist"] = s.grad_hist;
    sd["grad_scale"] = s.grad_scale;
    if (s.token.defined()) sd["token"] = s.token;
    sd["qxt"] = s.qxt;
    sd["qw_bwd"] = s.qw_bwd;
    sd["sx"] = s.sx;
    sd["sw"] = s.sw;
    return fp8_gemm(s.qx, s.qw_fwd, s.sx, s.sw, bias_as(bias, x2d.scalar_type()), x2d.scalar_type(),
                    options.fast_accum_forward, s.autotune);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& sd = ctx->saved_data;
    const int grad_fmt = fp8_format_id(sd["grad_dtype"].toScalarType());
    const bool current_scaling = sd["current_scaling"].toBool();
    const double mdiv = sd["margin_multiplier"].toDouble();
    const int algo = (int)sd["amax_algorithm"].toInt();
    const bool in_out = sd["in_out"].toBool(), autotune = sd["autotune"].toBool();
    const bool has_bias = sd["has_bias"].toBool(), has_channel = sd["has_channel"].toBool();
    const bool record_grad = sd["record_grad"].toBool();
    const auto x_dtype = sd["x_dtype"].toScalarType(), w_dtype = sd["w_dtype"].toScalarType();
    const auto b_dtype = sd["b_dtype"].toScalarType();
    const at::Tensor grad_hist = sd["grad_hist"].toTensor(), grad_scale = sd["grad_scale"].toTensor();
    // Edges: x2d 0, weight 1, bias (if given), channel (if given).
    const bool need_dx = sd["need_dx"].toBool() && ctx->needs_input_grad(0);
    const bool need_dw = sd["need_dw"].toBool() && ctx->needs_input_grad(1);
    const bool need_db = has_bias && ctx->needs_input_grad(2);
    at::Tensor g2d = grads[0].contiguous();
    at::Tensor dx, dw, db, dchannel;
    // The channel's gradient buffer receives [amax, token, 0] directly from
    // the gradient's quantize (its last block emits it: QuantizeExtras).
    QuantizeExtras emit;
    if (has_channel) {
      dchannel = at::empty({3}, g2d.options().dtype(at::kFloat));
      emit.emit_n = 3;
      auto it = sd.find("token");
      if (it != sd.end()) emit.emit_token = it->second.toTensor().data_ptr<float>();
    }
    if (need_dx || need_dw || record_grad || has_channel) {
      // Current scaling never writes the gradient's scale (the forward's fold
      // or the state's owner does).
      Q qg = quant(g2d, grad_hist, grad_scale, grad_fmt, current_scaling, mdiv, algo, need_dw,
                   record_grad && !current_scaling, need_dx, dchannel, &emit);
      if (need_dx) {
        dx = fp8_gemm(qg.q, sd["qw_bwd"].toTensor(), qg.scale_used, sd["sw"].toTensor(), c10::nullopt, x_dtype,
                      sd["fast_accum_dgrad"].toBool(), autotune);
        qg.q.reset();  // the row-major copy is done: the weight gradient's GEMM runs without it (peak memory)
      }
      if (need_dw) {
        const at::Tensor qxt = sd["qxt"].toTensor(), sx = sd["sx"].toTensor();
        const bool fast = sd["fast_accum_wgrad"].toBool();
        dw = in_out ? fp8_gemm(qxt, qg.qt, sx, qg.scale_used, c10::nullopt, w_dtype, fast, autotune)
                    : fp8_gemm(qg.qt, qxt, qg.scale_used, sx, c10::nullopt, w_dtype, fast, autotune);
      }
    }
    // One record per forward: a second backward through this node
    // (retain_graph, two losses) quantizes with the state's scale.
    sd["record_grad"] = false;
    if (need_db) {
      db = g2d.sum(0, false, at::kFloat);
      // The bias was added in x's dtype: its gradient rounds through it too.
      if (sd["db_in_x_dtype"].toBool() && x_dtype != b_dtype) db = db.to(x_dtype);
      db = db.to(b_dtype);
    }
    return {dx, dw, db, dchannel, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Records the amax of x quantized by another linear (x_fp8) in this
// linear's state, as its own quantize would have (torch_ops/linear.py's
// _record_shared): delayed scaling records it and moves the scale to the
// window; current scaling stores the scale x was quantized with, or keeps
// its own where the amax defines none.
static void record_shared(const at::Tensor& hist, const at::Tensor& scale, const at::Tensor& amax,
                          const at::Tensor& scale_used, bool current_scaling, double mdiv, int algo) {
  if (!current_scaling) {
    record_amax_launch(hist, scale, amax, kE4M3, algo, mdiv, false);
    return;
  }
  const at::Tensor usable = at::isfinite(amax).logical_and_(amax.gt(0));
  scale.copy_(at::where(usable, scale_used.reshape({}), scale.reshape({})).reshape(scale.sizes()));
}

std::vector<c10::optional<at::Tensor>> linear(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
    const std::vector<at::Tensor>& state_in, const c10::optional<at::Tensor>& pending_in,
    const c10::optional<at::Tensor>& fold_state_in, const LinearOptions& options, bool training,
    bool record_inputs, bool autotune, const std::vector<c10::optional<at::Tensor>>& x_fp8, bool return_x_fp8) {
  const long long K = x.size(-1);
  const long long N = options.in_out ? weight.size(1) : weight.size(0);
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value() && bias_in->defined()) bias = *bias_in;
  const bool has_channel = pending_in.has_value() && pending_in->defined();
  std::vector<at::Tensor> state = state_in;
  const bool current_scaling = options.current_scaling;
  const double mdiv = options.margin_multiplier;
  const int algo = (int)options.amax_algorithm;

  // The gradient channel's fold, on a training call: its copies are this
  // call's grad state, valid for its backward even when a later call folds
  // into the variables again. Launched by x's quantize (below; the weight's
  // where x arrives quantized), before anything reads them.
  FoldOutputs folded;
  const bool folds = has_channel && training;
  if (folds) {
    const double fmax = options.grad_dtype == at::kFloat8_e5m2 ? kE5M2Max : kE4M3Max;
    folded = prepare_fold_grad_amax(*pending_in, *fold_state_in, state[5], state[4], 1.0 / fmax, mdiv, algo,
                                    options.fold_window > 0 ? options.fold_window : state[5].numel(),
                                    !current_scaling);
    state[4] = folded.scale;
    state[5] = folded.history;
  }
  // The channel is an input of the autograd node where its gradient is wanted.
  c10::optional<at::Tensor> channel;
  if (has_channel && at::GradMode::is_enabled() && pending_in->requires_grad()) channel = *pending_in;

  const bool grad_on = at::GradMode::is_enabled();
  const bool need_dx = grad_on && x.requires_grad();
  const bool need_dw = grad_on && weight.requires_grad();
  const bool needs_graph = grad_on && (x.requires_grad() || weight.requires_grad() ||
                                       (bias && bias->requires_grad()) || channel.has_value());
  at::Tensor x2d = x.dim() == 2 ? x : x.reshape({-1, K});
  if (!x2d.is_contiguous()) x2d = x2d.contiguous();
  // A forward recomputed inside a backward (activation checkpointing) records
  // no amax of x or the weight a second time.
  const bool record = training && record_inputs;

  Saved s;
  s.need_dx = need_dx;
  s.need_dw = need_dw;
  s.record_grad = training && !channel.has_value();
  s.has_bias = bias.has_value();
  s.has_channel = channel.has_value();
  s.db_in_x_dtype = has_channel;
  s.autotune = autotune;
  s.grad_hist = state[5];
  s.grad_scale = state[4];
  s.token = folded.token;
  at::Tensor qx_amax;
  {
    at::NoGradGuard ng;
    // The weight as the kernels read it (contiguous; a copy made without
    // recording autograd history).
    const at::Tensor wd = weight.is_contiguous() ? weight : weight.contiguous();
    QuantizeExtras with_fold;
    if (folds) with_fold.fold = folded.job;
    const bool shared = !x_fp8.empty();
    Q qx;
    if (shared) {
      qx.q = *x_fp8[0];
      if (x_fp8[1].has_value()) qx.qt = *x_fp8[1];
      qx.scale_used = *x_fp8[2];
      qx.amax = *x_fp8[3];
      if (record) record_shared(state[1], state[0], qx.amax, qx.scale_used, current_scaling, mdiv, algo);
    } else {
      qx = quant(x2d, state[1], state[0], kE4M3, current_scaling, mdiv, algo, need_dw, record, true, at::Tensor(),
                 folds ? &with_fold : nullptr);
    }
    // The forward wants the weight as (N, K), the dX GEMM as (K, N); out_in stores (N, K).
    const bool in_out = options.in_out;
    Q qw = quant(wd, state[3], state[2], kE4M3, current_scaling, mdiv, algo, in_out || need_dx, record,
                 (!in_out) || need_dx, at::Tensor(), folds && shared ? &with_fold : nullptr);
    s.qx = qx.q;
    s.qxt = qx.qt;
    s.sx = qx.scale_used;
    qx_amax = qx.amax;
    s.sw = qw.scale_used;
    s.qw_fwd = in_out ? qw.qt : qw.q;
    s.qw_bwd = in_out ? qw.q : qw.qt;
  }
  at::Tensor out;
  if (needs_graph) {
    out = LinearFn::apply(x2d, weight, bias, channel, options, s);
  } else {
    at::NoGradGuard ng;
    out = fp8_gemm(s.qx, s.qw_fwd, s.sx, s.sw, bias_as(bias, x2d.scalar_type()), x2d.scalar_type(),
                   options.fast_accum_forward, autotune);
  }
  if (x.dim() != 2) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(N);
    out = out.reshape(shape);
  }
  std::vector<c10::optional<at::Tensor>> result{out};
  if (return_x_fp8 && x_fp8.empty()) {
    auto maybe = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
    result.insert(result.end(), {maybe(s.qx), maybe(s.qxt), s.sx, qx_amax});
  }
  return result;
}

}  // namespace torch_ops
