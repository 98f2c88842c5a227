// The eager entry of torch_ops/linear.py: the FP8 linear's quantize launches,
// GEMMs and an autograd Function whose backward runs without Python. The
// algorithm is torch_ops/linear.py's (whose autograd Function over the
// torch.library ops is the torch.compile path); tests compare the two and
// both with torch_ops/reference.py.
//
// linear(x, weight, bias, <6 state tensors>, grad_fmt, scaling, mdiv, algo,
//        in_out, training, record_inputs, sink, autotune) -> out (x's leading dims, N)
// linear_folded(x, weight, bias, pending, fold_state, <6 state tensors>,
//        grad_fmt, scaling, mdiv, algo, window, in_out, training,
//        record_inputs, autotune)
//   -> out: the gradient channel's fold, then the linear with `pending` as
//   the channel: its gradient is [amax (0 if not finite), token, 0].
// Both return an undefined tensor (None) where a tensor is not a plain dense
// CUDA tensor (tensor subclasses, fake or functional tensors): the caller
// then takes the Python path. Calls below min_gemm_size never reach here.

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <string>
#include <typeinfo>

#include "common.h"

namespace torch_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kDelayed = 1;  // scaling: 1 delayed, 2 current (quantize_launch's scale_mode)

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
Q quant(const at::Tensor& x, const at::Tensor& hist, const at::Tensor& scale, int fmt, int scaling, double mdiv,
        int algo, bool transpose, bool record, bool write_q, const at::Tensor& amax_out = at::Tensor(),
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
  if (scaling == kDelayed) {
    quantize_launch(x, R, C, fmt, 1, scale, o.scale_used, o.amax, record ? hist : none, record ? scale : none, hist,
                    o.q, ldq, o.qt, ldqt, algo, mdiv, false, extras);
  } else {
    quantize_launch(x, R, C, fmt, 2, scale, o.scale_used, o.amax, none, none, none, o.q, ldq, o.qt, ldqt, 0, mdiv,
                    false, extras);
    if (record) scale.copy_(o.scale_used.reshape(scale.sizes()));
  }
  return o;
}

// Flags of one call, kept in the autograd context as one integer.
enum : int64_t {
  kInOut = 2,
  kNeedDx = 4,
  kNeedDw = 8,
  kRecordGrad = 16,
  kHasBias = 32,
  kHasSink = 64,
  kSinkVec = 128,  // the sink is the (3,) pending vector: its gradient is [amax, token, 0]
  kRoundDb = 256,  // the bias gradient is rounded to x's dtype first (the bias was cast to it)
  kAutotune = 512,
};

// Everything the Function needs besides its differentiable inputs.
struct Extra {
  int64_t flags = 0;
  int grad_fmt = kE5M2, scaling = kDelayed, algo = 0;
  double mdiv = 1.0;
  at::Tensor qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_hist, grad_scale, token;
};

class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2d, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& sink,
                            const Extra& e) {
    (void)sink;
    auto& sd = ctx->saved_data;
    const bool has_bias = e.flags & kHasBias;
    sd["f"] = e.flags;
    sd["c"] = (int64_t)(e.grad_fmt | (e.scaling << 4) | (e.algo << 8));
    sd["m"] = e.mdiv;
    sd["d"] = (int64_t)((int64_t)x2d.scalar_type() | ((int64_t)weight.scalar_type() << 8) |
                        ((int64_t)(has_bias ? bias->scalar_type() : at::kFloat) << 16));
    // The grad state is read and written by the backward's quantize kernel
    // (raw pointers, as the Python path does): kept without version checks.
    sd["gh"] = e.grad_hist;
    sd["gs"] = e.grad_scale;
    if (e.token.defined()) sd["tok"] = e.token;
    sd["qxt"] = e.qxt;
    sd["qwb"] = e.qw_bwd;
    sd["sx"] = e.sx;
    sd["sw"] = e.sw;
    return fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, bias_as(bias, x2d.scalar_type()), x2d.scalar_type(), true,
                    e.flags & kAutotune);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& sd = ctx->saved_data;
    const int64_t f = sd["f"].toInt();
    const int64_t c = sd["c"].toInt();
    const int grad_fmt = (int)(c & 15), scaling = (int)((c >> 4) & 15), algo = (int)((c >> 8) & 15);
    const double mdiv = sd["m"].toDouble();
    const int64_t d = sd["d"].toInt();
    const auto x_dtype = (at::ScalarType)(d & 255), w_dtype = (at::ScalarType)((d >> 8) & 255);
    const auto b_dtype = (at::ScalarType)((d >> 16) & 255);
    const bool in_out = f & kInOut, has_bias = f & kHasBias, has_sink = f & kHasSink;
    const bool record_grad = f & kRecordGrad, autotune = f & kAutotune;
    const at::Tensor grad_hist = sd["gh"].toTensor(), grad_scale = sd["gs"].toTensor();
    // Edges: x2d 0, weight 1, bias (if given), sink (if given).
    const bool need_dx = (f & kNeedDx) && ctx->needs_input_grad(0);
    const bool need_dw = (f & kNeedDw) && ctx->needs_input_grad(1);
    const bool need_db = has_bias && ctx->needs_input_grad(2);
    at::Tensor g2d = grads[0].contiguous();
    at::Tensor dx, dw, db, dsink;
    // The sink's gradient buffer receives the gradient-channel value directly
    // from the gradient's quantize (its last block emits it: QuantizeExtras).
    QuantizeExtras emit;
    if (has_sink) {
      dsink = (f & kSinkVec) ? at::empty({3}, g2d.options().dtype(at::kFloat))
                             : at::empty({}, g2d.options().dtype(at::kFloat));
      emit.emit_n = (int)dsink.numel();
      auto it = sd.find("tok");
      if (it != sd.end()) emit.emit_token = it->second.toTensor().data_ptr<float>();
    }
    if (need_dx || need_dw || record_grad || has_sink) {
      // Current scaling never writes the gradient's scale (the forward's fold
      // or the state's owner does).
      Q qg = quant(g2d, grad_hist, grad_scale, grad_fmt, scaling, mdiv, algo, need_dw,
                   record_grad && scaling == kDelayed, need_dx, dsink, &emit);
      if (need_dx) {
        dx = fp8_gemm(qg.q, sd["qwb"].toTensor(), qg.scale_used, sd["sw"].toTensor(), c10::nullopt, x_dtype, false,
                      autotune);
        qg.q.reset();  // the row-major copy is done: the weight gradient's GEMM runs without it (peak memory)
      }
      if (need_dw) {
        const at::Tensor qxt = sd["qxt"].toTensor(), sx = sd["sx"].toTensor();
        dw = in_out ? fp8_gemm(qxt, qg.qt, sx, qg.scale_used, c10::nullopt, w_dtype, false, autotune)
                    : fp8_gemm(qg.qt, qxt, qg.scale_used, sx, c10::nullopt, w_dtype, false, autotune);
      }
    }
    // One record per forward: a second backward through this node
    // (retain_graph, two losses) quantizes with the state's scale.
    sd["f"] = f & ~(int64_t)kRecordGrad;
    if (need_db) {
      db = g2d.sum(0, false, at::kFloat);
      if ((f & kRoundDb) && x_dtype != b_dtype) db = db.to(x_dtype);
      db = db.to(b_dtype);
    }
    return {dx, dw, db, dsink, at::Tensor()};
  }
};

const char* dname(const at::Tensor& t) { return t.is_cuda() ? "cuda" : "cpu"; }

void check_float(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kBFloat16 || s == at::kHalf || s == at::kFloat, name,
                   ": expected bfloat16, float16 or float32, got ", s);
}

// A dense tensor of no subclass and no Python dispatch (not fake, functional
// or batched): what the launches may read by raw pointer. Undefined is fine.
bool plain(const at::Tensor& t) {
  if (!t.defined()) return true;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(c10::TensorImpl) && !t.key_set().has(c10::DispatchKey::Python);
}

bool plain(const c10::optional<at::Tensor>& t) { return !t.has_value() || plain(*t); }

bool all_plain(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (!plain(t)) return false;
  return true;
}

// The checked arguments of one call (the same conditions and messages as
// torch_ops/linear.py's _check).
struct Args {
  long long K = 0, N = 0;
  c10::optional<at::Tensor> bias, sink;
};

Args check_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                const std::vector<at::Tensor>& state, bool in_out) {
  Args a;
  TORCH_CHECK_VALUE(x.dim() >= 2, "x: expected a tensor of rank >= 2, got ", shape_str(x));
  check_float(x, "x");
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight: expected a 2-D tensor, got ", shape_str(weight));
  check_float(weight, "weight");
  TORCH_CHECK_VALUE(weight.device() == x.device(), "weight: expected device ", x.device(), ", got ",
                    weight.device());
  a.K = x.size(-1);
  const long long k_w = in_out ? weight.size(0) : weight.size(1);
  TORCH_CHECK_VALUE(k_w == a.K, "weight: shape ", shape_str(weight), " with weight_layout=",
                    in_out ? "'in_out'" : "'out_in'", " does not match x's last dimension ", std::to_string(a.K));
  a.N = in_out ? weight.size(1) : weight.size(0);
  if (bias_in.has_value() && bias_in->defined()) {
    a.bias = *bias_in;
    TORCH_CHECK_VALUE(a.bias->dim() == 1 && a.bias->size(0) == a.N && a.bias->device() == x.device(),
                      "bias: expected shape (", std::to_string(a.N), ",) on ", x.device(), ", got ",
                      shape_str(*a.bias), " on ", a.bias->device());
  }
  static const char* kNames[6] = {"input_scale", "input_amax_history", "kernel_scale",
                                  "kernel_amax_history", "grad_scale", "grad_amax_history"};
  TORCH_CHECK(state.size() == 6, "state: expected 6 tensors");
  for (int i = 0; i < 6; ++i) {
    const at::Tensor& t = state[i];
    TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == at::kFloat && t.device() == x.device(), "state.",
                      kNames[i], ": expected a float32 tensor on ", x.device(), ", got ",
                      t.defined() ? c10::toString(t.scalar_type()) : "undefined", " on ",
                      t.defined() ? dname(t) : "?");
    const bool scalar = (i % 2) == 0;
    TORCH_CHECK_VALUE(t.is_contiguous() && (scalar ? (t.numel() == 1 && t.dim() <= 1) : (t.dim() == 1 && t.numel() >= 1)),
                      "state.", kNames[i],
                      scalar ? ": expected a scale of shape () or (1,)" : ": expected a contiguous, non-empty 1-D history (H,)",
                      ", got ", shape_str(t));
  }
  TORCH_CHECK_VALUE(x.is_cuda(), "x: expected a CUDA tensor here, got device ", x.device());
  return a;
}

// The call after check_args. `sink`: none, a 0-d sink (linear) or the (3,)
// pending vector (linear_folded, with its fold token, undefined when not
// training). `fold`: null, or the gradient channel's fold (linear_folded's
// training calls), done by the last block of x's quantize.
// `record_inputs` false: a forward recomputed inside a backward (activation
// checkpointing) records no amax of x or the weight a second time.
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const Args& a, const std::vector<at::Tensor>& state,
               int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo, bool in_out, bool training,
               bool record_inputs, int64_t sink_flags, const at::Tensor& token, const FoldJob* fold, bool autotune) {
  const long long K = a.K, N = a.N;
  const c10::optional<at::Tensor>& bias = a.bias;
  const c10::optional<at::Tensor>& sink = a.sink;
  const bool grad_on = at::GradMode::is_enabled();
  const bool need_dx = grad_on && x.requires_grad();
  const bool need_dw = grad_on && weight.requires_grad();
  const bool needs_graph =
      grad_on && (x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad()) || sink.has_value());
  at::Tensor x2d = x.dim() == 2 ? x : x.reshape({-1, K});
  if (!x2d.is_contiguous()) x2d = x2d.contiguous();
  const bool record = training && record_inputs;

  Extra e;
  e.flags = (in_out ? kInOut : 0) | (need_dx ? kNeedDx : 0) | (need_dw ? kNeedDw : 0) |
            ((training && !sink.has_value()) ? kRecordGrad : 0) | (bias.has_value() ? kHasBias : 0) |
            (sink.has_value() ? (kHasSink | sink_flags) : (sink_flags & kRoundDb)) | (autotune ? kAutotune : 0);
  e.grad_fmt = (int)grad_fmt;
  e.scaling = (int)scaling;
  e.algo = (int)algo;
  e.mdiv = mdiv;
  e.grad_hist = state[5];
  e.grad_scale = state[4];
  e.token = token;
  {
    at::NoGradGuard ng;
    // The weight as the kernels read it (contiguous; a copy made without
    // recording autograd history).
    const at::Tensor wd = weight.is_contiguous() ? weight : weight.contiguous();
    QuantizeExtras with_fold;
    if (fold) with_fold.fold = *fold;
    Q qx = quant(x2d, state[1], state[0], kE4M3, (int)scaling, mdiv, (int)algo, need_dw, record, true, at::Tensor(),
                 fold ? &with_fold : nullptr);
    // The forward wants the weight as (N, K), the dX GEMM as (K, N); out_in stores (N, K).
    Q qw = quant(wd, state[3], state[2], kE4M3, (int)scaling, mdiv, (int)algo, in_out || need_dx, record,
                 (!in_out) || need_dx);
    e.qx = qx.q;
    e.qxt = qx.qt;
    e.sx = qx.scale_used;
    e.sw = qw.scale_used;
    e.qw_fwd = in_out ? qw.qt : qw.q;
    e.qw_bwd = in_out ? qw.q : qw.qt;
  }
  at::Tensor out;
  if (needs_graph) {
    out = LinearFn::apply(x2d, weight, bias, sink, e);
  } else {
    at::NoGradGuard ng;
    out = fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, bias_as(bias, x2d.scalar_type()), x2d.scalar_type(), true, autotune);
  }
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return out.reshape(shape);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                  const std::vector<at::Tensor>& state, int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo,
                  bool in_out, bool training, bool record_inputs, const c10::optional<at::Tensor>& sink_in,
                  bool autotune) {
  if (!plain(x) || !plain(weight) || !plain(bias_in) || !plain(sink_in) || !all_plain(state)) return at::Tensor();
  Args a = check_args(x, weight, bias_in, state, in_out);
  if (sink_in.has_value() && sink_in->defined()) {
    a.sink = *sink_in;
    TORCH_CHECK_VALUE(a.sink->dim() == 0 && a.sink->scalar_type() == at::kFloat,
                      "grad_amax_sink: expected a 0-d float32 tensor with requires_grad=True");
  }
  return run(x, weight, a, state, grad_fmt, scaling, mdiv, algo, in_out, training, record_inputs, 0, at::Tensor(),
             nullptr, autotune);
}

at::Tensor linear_folded(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                         const at::Tensor& pending, const at::Tensor& fold_state, const std::vector<at::Tensor>& state,
                         int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo, int64_t window, bool in_out,
                         bool training, bool record_inputs, bool autotune) {
  if (!plain(x) || !plain(weight) || !plain(bias_in) || !plain(pending) || !plain(fold_state) || !all_plain(state))
    return at::Tensor();
  Args a = check_args(x, weight, bias_in, state, in_out);
  for (const at::Tensor* t : {&pending, &fold_state}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == 3 && t->is_contiguous() &&
                          t->device() == x.device(),
                      t == &pending ? "pending" : "fold_state",
                      ": expected a contiguous float32 tensor of shape (3,) on ", x.device());
  }
  std::vector<at::Tensor> st = state;
  FoldOutputs folded;
  if (training) {
    // The fold's copies are this call's grad state: they stay valid for its
    // backward even when a later call folds into the variables again.
    // Launched by x's quantize (run), before anything reads them.
    const double fmax = grad_fmt == kE5M2 ? 57344.0 : 448.0;
    folded = prepare_fold_grad_amax(pending, fold_state, state[5], state[4], 1.0 / fmax, mdiv, (int)algo,
                                    window > 0 ? window : state[5].numel(), scaling == kDelayed);
    st[4] = folded.scale;
    st[5] = folded.history;
  }
  if (at::GradMode::is_enabled() && pending.requires_grad()) a.sink = pending;
  return run(x, weight, a, st, grad_fmt, scaling, mdiv, algo, in_out, training, record_inputs, kSinkVec | kRoundDb,
             folded.token, training ? &folded.job : nullptr, autotune);
}

}  // namespace torch_ops
