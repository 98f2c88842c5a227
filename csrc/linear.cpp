// fp8_linear's eager fast path in C++: the quantize launches, the GEMMs and
// an autograd Function whose backward runs without Python. Same algorithm,
// same kernels and the same state updates as torch_ops/linear.py (which stays
// the path of torch.compile and of the emulation; tests compare the two).
//
// linear(x, weight, bias, <6 state tensors>, grad_fmt, scaling, mdiv, algo,
//        in_out, training, sink, min_gemm_size) -> out (x's leading dims, N)

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <string>

#include "common.h"

namespace torch_ops {
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode, const at::Tensor& scale_in,
                     const at::Tensor& scale_used, const at::Tensor& amax_out, const at::Tensor& history,
                     const at::Tensor& scale_state, const at::Tensor& hist_for_empty, const at::Tensor& q,
                     long long ldq, const at::Tensor& qt, long long ldqt, int algo, double mdiv, bool skip_zero);
void amax_record2_launch(const at::Tensor& x0, const at::Tensor& hist0, const at::Tensor& scale0,
                         const at::Tensor& x1, const at::Tensor& hist1, const at::Tensor& scale1, int fmt, int algo,
                         double mdiv);
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kE4M3 = 0;
constexpr int kDelayed = 1;  // scaling: 1 delayed, 2 current (quantize_launch's scale_mode)

long long r16(long long v) { return (v + 15) / 16 * 16; }

struct Q {
  at::Tensor q, qt, scale_used, amax;
};

// = _ops.quantize_delayed / quantize_current with pad=True (GEMM-ready layouts).
Q quant(const at::Tensor& x, const at::Tensor& hist, const at::Tensor& scale, int fmt, int scaling, double mdiv,
        int algo, bool transpose, bool record, bool write_q) {
  const long long R = x.size(0), C = x.size(1);
  const auto opts = x.options().dtype(fmt == 1 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  const long long ldq = r16(C), ldqt = r16(R);
  Q o;
  o.q = write_q ? at::empty({R, ldq}, opts) : at::empty({0}, opts);
  o.qt = transpose ? at::empty({C, ldqt}, opts) : at::empty({0}, opts);
  const auto fo = x.options().dtype(at::kFloat);
  o.amax = at::empty({}, fo);
  o.scale_used = at::empty({}, fo);
  at::Tensor none;
  if (scaling == kDelayed) {
    quantize_launch(x, R, C, fmt, 1, scale, o.scale_used, o.amax, record ? hist : none, record ? scale : none, hist,
                    write_q ? o.q : none, ldq, transpose ? o.qt : none, ldqt, algo, mdiv, false);
  } else {
    quantize_launch(x, R, C, fmt, 2, scale, o.scale_used, o.amax, none, none, none, write_q ? o.q : none, ldq,
                    transpose ? o.qt : none, ldqt, 0, mdiv, false);
  }
  return o;
}

// Everything the Function needs besides its differentiable inputs.
struct Extra {
  bool small, in_out, need_dx, need_dw, record_grad, has_bias, has_sink;
  int grad_fmt, scaling, algo;
  double mdiv;
  at::Tensor qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_hist, grad_scale;
};

class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2d, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& sink,
                            const Extra& e) {
    (void)sink;
    auto& sd = ctx->saved_data;
    sd["small"] = e.small;
    sd["in_out"] = e.in_out;
    sd["need_dx"] = e.need_dx;
    sd["need_dw"] = e.need_dw;
    sd["record_grad"] = e.record_grad;
    sd["has_bias"] = e.has_bias;
    sd["has_sink"] = e.has_sink;
    sd["grad_fmt"] = (int64_t)e.grad_fmt;
    sd["scaling"] = (int64_t)e.scaling;
    sd["algo"] = (int64_t)e.algo;
    sd["mdiv"] = e.mdiv;
    sd["x_dtype"] = x2d.scalar_type();
    sd["w_dtype"] = weight.scalar_type();
    sd["b_dtype"] = e.has_bias ? bias->scalar_type() : at::kFloat;
    // The grad state is read and written by the backward's quantize kernel
    // (raw pointers, as the Python path does): kept without version checks.
    sd["grad_hist"] = e.grad_hist;
    sd["grad_scale"] = e.grad_scale;
    at::Tensor out;
    if (e.small) {
      at::Tensor w_nk = (e.in_out ? weight.t() : weight).to(x2d.scalar_type());
      c10::optional<at::Tensor> b;
      if (e.has_bias) b = bias->to(x2d.scalar_type());
      out = at::linear(x2d, w_nk, b);
      ctx->save_for_backward({x2d, weight});
    } else {
      out = fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, bias, x2d.scalar_type(), true);
      sd["qxt"] = e.qxt;
      sd["qw_bwd"] = e.qw_bwd;
      sd["sx"] = e.sx;
      sd["sw"] = e.sw;
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& sd = ctx->saved_data;
    const bool small = sd["small"].toBool(), in_out = sd["in_out"].toBool();
    const bool has_bias = sd["has_bias"].toBool(), has_sink = sd["has_sink"].toBool();
    const bool record_grad = sd["record_grad"].toBool();
    const int grad_fmt = (int)sd["grad_fmt"].toInt(), scaling = (int)sd["scaling"].toInt();
    const int algo = (int)sd["algo"].toInt();
    const double mdiv = sd["mdiv"].toDouble();
    const auto x_dtype = sd["x_dtype"].toScalarType(), w_dtype = sd["w_dtype"].toScalarType();
    const auto b_dtype = sd["b_dtype"].toScalarType();
    const at::Tensor grad_hist = sd["grad_hist"].toTensor(), grad_scale = sd["grad_scale"].toTensor();
    // Edges: x2d 0, weight 1, bias (if given), sink (if given).
    const bool need_dx = sd["need_dx"].toBool() && ctx->needs_input_grad(0);
    const bool need_dw = sd["need_dw"].toBool() && ctx->needs_input_grad(1);
    const bool need_db = has_bias && ctx->needs_input_grad(2);
    at::Tensor g2d = grads[0].contiguous();
    at::Tensor dx, dw, db, dsink, ga;
    if (small) {
      auto saved = ctx->get_saved_variables();
      const at::Tensor& x2d = saved[0];
      const at::Tensor& weight = saved[1];
      if (record_grad || has_sink)
        ga = quant(g2d, grad_hist, grad_scale, grad_fmt, scaling, mdiv, algo, false, record_grad, false).amax;
      at::Tensor w = weight.to(g2d.scalar_type());
      if (need_dx) dx = g2d.mm(in_out ? w.t() : w);
      if (need_dw) {
        at::Tensor gw = g2d.t().mm(x2d.to(g2d.scalar_type()));  // (N, K)
        dw = (in_out ? gw.t() : gw).to(w_dtype);
      }
    } else if (need_dx || need_dw || record_grad || has_sink) {
      Q qg = quant(g2d, grad_hist, grad_scale, grad_fmt, scaling, mdiv, algo, need_dw, record_grad, need_dx);
      ga = qg.amax;
      if (need_dx) dx = fp8_gemm(qg.q, sd["qw_bwd"].toTensor(), qg.scale_used, sd["sw"].toTensor(), c10::nullopt,
                                 x_dtype, false);
      if (need_dw) {
        const at::Tensor qxt = sd["qxt"].toTensor(), sx = sd["sx"].toTensor();
        dw = in_out ? fp8_gemm(qxt, qg.qt, sx, qg.scale_used, c10::nullopt, w_dtype, false)
                    : fp8_gemm(qg.qt, qxt, qg.scale_used, sx, c10::nullopt, w_dtype, false);
      }
    }
    if (need_db) db = g2d.sum(0, false, at::kFloat).to(b_dtype);
    if (has_sink) dsink = at::where(at::isfinite(ga), ga, at::zeros_like(ga));
    return {dx, dw, db, dsink, at::Tensor()};
  }
};

const char* dname(const at::Tensor& t) { return t.is_cuda() ? "cuda" : "cpu"; }

// "(4, 7)" / "(5,)" as Python prints a shape tuple (built by hand: streaming
// an IntArrayRef into an error message crashed the H200 build, run 3).
std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  if (t.dim() == 1) s += ",";
  return s + ")";
}

void check_float(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kBFloat16 || s == at::kHalf || s == at::kFloat, name,
                   ": expected bfloat16, float16 or float32, got ", s);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                  const std::vector<at::Tensor>& state, int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo,
                  bool in_out, bool training, const c10::optional<at::Tensor>& sink_in, int64_t min_gemm_size) {
  // Argument checks (the same conditions and messages as linear.py's _check).
  TORCH_CHECK_VALUE(x.dim() >= 2, "x: expected a tensor of rank >= 2, got ", shape_str(x));
  check_float(x, "x");
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight: expected a 2-D tensor, got ", shape_str(weight));
  check_float(weight, "weight");
  TORCH_CHECK_VALUE(weight.device() == x.device(), "weight: expected device ", x.device(), ", got ",
                    weight.device());
  const long long K = x.size(-1);
  const long long k_w = in_out ? weight.size(0) : weight.size(1);
  TORCH_CHECK_VALUE(k_w == K, "weight: shape ", shape_str(weight), " with weight_layout=",
                    in_out ? "'in_out'" : "'out_in'", " does not match x's last dimension ", K);
  const long long N = in_out ? weight.size(1) : weight.size(0);
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = *bias_in;
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->device() == x.device(),
                      "bias: expected shape (", N, ",) on ", x.device(), ", got ", shape_str(*bias), " on ",
                      bias->device());
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
    TORCH_CHECK_VALUE(t.is_contiguous() && (scalar ? t.numel() == 1 : t.dim() == 1), "state.", kNames[i],
                      scalar ? ": expected one element" : ": expected a contiguous 1-D history (H,)", ", got shape ",
                      shape_str(t));
  }
  c10::optional<at::Tensor> sink;
  if (sink_in.has_value() && sink_in->defined()) {
    sink = *sink_in;
    TORCH_CHECK_VALUE(sink->dim() == 0 && sink->scalar_type() == at::kFloat,
                      "grad_amax_sink: expected a 0-d float32 tensor with requires_grad=True");
  }
  TORCH_CHECK_VALUE(x.is_cuda(), "x: expected a CUDA tensor here, got device ", x.device());

  const bool grad_on = at::GradMode::is_enabled();
  const bool need_dx = grad_on && x.requires_grad();
  const bool need_dw = grad_on && weight.requires_grad();
  const bool needs_graph =
      grad_on && (x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad()) || sink.has_value());
  at::Tensor x2d = x.dim() == 2 ? x : x.reshape({-1, K});
  if (!x2d.is_contiguous()) x2d = x2d.contiguous();
  const long long M = x2d.size(0);
  const bool small = (double)M * (double)N * (double)K < (double)min_gemm_size;
  const bool record = training && scaling == kDelayed;

  Extra e;
  e.small = small;
  e.in_out = in_out;
  e.need_dx = need_dx;
  e.need_dw = need_dw;
  e.record_grad = record && !sink.has_value();
  e.has_bias = bias.has_value();
  e.has_sink = sink.has_value();
  e.grad_fmt = (int)grad_fmt;
  e.scaling = (int)scaling;
  e.algo = (int)algo;
  e.mdiv = mdiv;
  e.grad_hist = state[5];
  e.grad_scale = state[4];
  {
    at::NoGradGuard ng;
    const at::Tensor wd = weight.is_contiguous() ? weight : weight.contiguous();
    if (small) {
      // Only the state updates matter here (no fp8 operand is used): one
      // launch for x and the weight. Without recording nothing is updated.
      if (record) amax_record2_launch(x2d, state[1], state[0], wd, state[3], state[2], kE4M3, (int)algo, mdiv);
    } else {
      Q qx = quant(x2d, state[1], state[0], kE4M3, (int)scaling, mdiv, (int)algo, need_dw, record, true);
      // The forward wants (N, K), the dX GEMM (K, N); out_in stores (N, K).
      Q qw = quant(wd, state[3], state[2], kE4M3, (int)scaling, mdiv, (int)algo, in_out || need_dx, record,
                   (!in_out) || need_dx);
      e.qx = qx.q;
      e.qxt = qx.qt;
      e.sx = qx.scale_used;
      e.sw = qw.scale_used;
      e.qw_fwd = in_out ? qw.qt : qw.q;
      e.qw_bwd = in_out ? qw.q : qw.qt;
    }
  }
  at::Tensor out;
  if (needs_graph) {
    out = LinearFn::apply(x2d, weight, bias, sink, e);
  } else {
    at::NoGradGuard ng;
    if (small) {
      at::Tensor w_nk = (in_out ? weight.t() : weight).to(x2d.scalar_type());
      c10::optional<at::Tensor> b;
      if (bias) b = bias->to(x2d.scalar_type());
      out = at::linear(x2d, w_nk, b);
    } else {
      out = fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, bias, x2d.scalar_type(), true);
    }
  }
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return out.reshape(shape);
}

}  // namespace torch_ops
