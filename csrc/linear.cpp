// fp8_linear's eager fast path in C++: the quantize launches, the GEMMs and
// an autograd Function whose backward runs without Python. Same algorithm,
// same kernels and the same state updates as torch_ops/linear.py (which stays
// the path of torch.compile and of the emulation; tests compare the two).
//
// linear(x, weight, bias, <6 state tensors>, grad_fmt, scaling, mdiv, algo,
//        in_out, training, sink, min_gemm_size) -> out (x's leading dims, N)
// linear_folded(x, weight, bias, pending, fold_state, <6 state tensors>,
//        grad_fmt, mdiv, algo, window, in_out, training, min_gemm_size)
//   -> out: fold_pending_grad_amax + fp8_linear(delayed) with `pending` as
//   the gradient channel: its gradient is [amax (0 if not finite), token, 0]
//   (torch_ops.fp8_linear_folded; the Keras layers' call).
// Both return None (an undefined tensor) where a tensor is not a plain dense
// CUDA tensor (tensor subclasses, fake or functional tensors): the caller
// then takes the Python path.

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <tuple>
#include <typeinfo>
#include <utility>

#include "common.h"

namespace torch_ops {
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode, const at::Tensor& scale_in,
                     const at::Tensor& scale_used, const at::Tensor& amax_out, const at::Tensor& history,
                     const at::Tensor& scale_state, const at::Tensor& hist_for_empty, const at::Tensor& q,
                     long long ldq, const at::Tensor& qt, long long ldqt, int algo, double mdiv, bool skip_zero,
                     const QuantizeExtras* extras);
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum);
void record_amax_launch(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt, int algo,
                        double mdiv, bool skip_zero, const at::Tensor* scale_used);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kE4M3 = 0;
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

// = _ops.quantize_delayed / quantize_current with pad=True (GEMM-ready
// layouts). Outputs not asked for stay undefined; the amax goes to `amax_out`
// when given (a gradient-channel buffer), else to a new 0-d tensor. `extras`:
// the launch's last block also folds or emits (common.h).
Q quant(const at::Tensor& x, const at::Tensor& hist, const at::Tensor& scale, int fmt, int scaling, double mdiv,
        int algo, bool transpose, bool record, bool write_q, const at::Tensor& amax_out = at::Tensor(),
        const QuantizeExtras* extras = nullptr) {
  const long long R = x.size(0), C = x.size(1);
  const auto opts = x.options().dtype(fmt == 1 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
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
  }
  return o;
}

// The weight's quantize done ahead of this call (torch_ops.prequantize_weight:
// quantize_delayed(record=False, transpose=True, pad=True, write_q=True) with
// this call's kernel state, on a side stream the caller has waited for):
// checked against the weight, then its amax is recorded as the quantize here
// would have (history shift, next scale from the scale it used).
Q take_prequantized(const std::vector<at::Tensor>& pre, const at::Tensor& w, const at::Tensor& hist,
                    const at::Tensor& scale, int algo, double mdiv) {
  TORCH_CHECK_VALUE(pre.size() == 4, "prequantized: expected (q, qt, scale_used, amax), got ",
                    std::to_string(pre.size()), " tensors");
  const long long R = w.size(0), C = w.size(1);
  const auto ok_fp8 = [&](const at::Tensor& t, long long rows, long long ld) {
    return t.scalar_type() == at::kFloat8_e4m3fn && t.dim() == 2 && t.size(0) == rows && t.size(1) == ld &&
           t.is_contiguous() && t.device() == w.device();
  };
  const auto ok_f32 = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == w.device();
  };
  TORCH_CHECK_VALUE(ok_fp8(pre[0], R, r16(C)) && ok_fp8(pre[1], C, r16(R)) && ok_f32(pre[2]) && ok_f32(pre[3]),
                    "prequantized: expected float8_e4m3fn (", std::to_string(R), ", ", std::to_string(r16(C)),
                    ") and (", std::to_string(C), ", ", std::to_string(r16(R)),
                    ") tensors and two float32 scalars on the weight's device");
  record_amax_launch(hist, scale, pre[3], kE4M3, algo, mdiv, false, &pre[2]);
  return Q{pre[0], pre[1], pre[2], pre[3]};
}

// Flags of one call, kept in the autograd context as one integer.
enum : int64_t {
  kSmall = 1,
  kInOut = 2,
  kNeedDx = 4,
  kNeedDw = 8,
  kRecordGrad = 16,
  kHasBias = 32,
  kHasSink = 64,
  kSinkVec = 128,   // the sink is the (3,) pending vector: its gradient is [amax, token, 0]
  kRoundDb = 256,   // the bias gradient is rounded to x's dtype first (the bias was cast to it)
};

// Everything the Function needs besides its differentiable inputs.
struct Extra {
  int64_t flags = 0;
  int grad_fmt = 1, scaling = kDelayed, algo = 0;
  double mdiv = 1.0;
  at::Tensor qx, qw_fwd, sx, sw, qxt, qw_bwd, grad_hist, grad_scale, token;
};

// The small path's weight gradient in the gradient's dtype, in the weight's
// own layout (no transposing copy, and the gradient obeys AccumulateGrad's
// layout contract): in_out (K, N) = x^T g, out_in (N, K) = g^T x.
at::Tensor small_weight_grad(const at::Tensor& x2d, const at::Tensor& g2d, bool in_out, at::ScalarType w_dtype) {
  const at::Tensor xg = x2d.to(g2d.scalar_type());
  return (in_out ? xg.t().mm(g2d) : g2d.t().mm(xg)).to(w_dtype);
}

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
    const auto xt = x2d.scalar_type();
    const c10::optional<at::Tensor> b = bias_as(bias, xt);
    at::Tensor out;
    if (e.flags & kSmall) {
      // The weight in x's dtype, (N, K); kept for the backward's dX.
      at::Tensor w_nk = ((e.flags & kInOut) ? weight.t() : weight).to(xt);
      out = at::linear(x2d, w_nk, b);
      ctx->save_for_backward({x2d, w_nk});
    } else {
      out = fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, b, xt, true);
      sd["qxt"] = e.qxt;
      sd["qwb"] = e.qw_bwd;
      sd["sx"] = e.sx;
      sd["sw"] = e.sw;
    }
    return out;
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
    const bool small = f & kSmall, in_out = f & kInOut, has_bias = f & kHasBias, has_sink = f & kHasSink;
    const bool record_grad = f & kRecordGrad;
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
    if (small) {
      auto saved = ctx->get_saved_variables();
      const at::Tensor& x2d = saved[0];
      at::Tensor w_nk = saved[1];
      if (record_grad || has_sink)
        quant(g2d, grad_hist, grad_scale, grad_fmt, scaling, mdiv, algo, false, record_grad, false, dsink, &emit);
      if (w_nk.scalar_type() != g2d.scalar_type()) w_nk = w_nk.to(g2d.scalar_type());
      if (need_dx) dx = g2d.mm(w_nk);
      if (need_dw) dw = small_weight_grad(x2d, g2d, in_out, w_dtype);
    } else if (need_dx || need_dw || record_grad || has_sink) {
      Q qg = quant(g2d, grad_hist, grad_scale, grad_fmt, scaling, mdiv, algo, need_dw, record_grad, need_dx, dsink,
                   &emit);
      if (need_dx) dx = fp8_gemm(qg.q, sd["qwb"].toTensor(), qg.scale_used, sd["sw"].toTensor(), c10::nullopt,
                                 x_dtype, false);
      if (need_dw) {
        const at::Tensor qxt = sd["qxt"].toTensor(), sx = sd["sx"].toTensor();
        dw = in_out ? fp8_gemm(qxt, qg.qt, sx, qg.scale_used, c10::nullopt, w_dtype, false)
                    : fp8_gemm(qg.qt, qxt, qg.scale_used, sx, c10::nullopt, w_dtype, false);
      }
    }
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
// linear.py's _check).
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
                      "bias: expected shape (", std::to_string(a.N), ",) on ", x.device(), ", got ", shape_str(*a.bias), " on ",
                      a.bias->device());
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
  TORCH_CHECK_VALUE(x.is_cuda(), "x: expected a CUDA tensor here, got device ", x.device());
  return a;
}

// The small path's GEMM in x's dtype, with PyTorch's own autograd (the same
// GEMMs nn.Linear runs forward and backward): out_in (N, K) via at::linear,
// in_out (K, N) as x @ W, so that dW comes out in the weight's own layout.
at::Tensor small_linear(const at::Tensor& x2d, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        bool in_out) {
  const auto xt = x2d.scalar_type();
  const at::Tensor w = weight.scalar_type() == xt ? weight : weight.to(xt);
  const c10::optional<at::Tensor> b = bias_as(bias, xt);
  if (!in_out) return at::linear(x2d, w, b);
  return b ? at::addmm(*b, x2d, w) : at::mm(x2d, w);
}

// Where the small path's state launch runs while autograd records
// (set_small_record_stream; TORCH_OPS_SMALL_RECORD_STREAM, read once,
// otherwise):
//   0: on the backward's stream, after the backward's GEMMs (in the step's
//      tail);
//   1: on a side stream beside the backward's GEMMs: the node's pre-hook
//      marks the point where the gradient is ready (an event), the post-hook
//      launches the state kernel on the side stream after that point and
//      makes the backward's stream wait for it (a join, so that everything
//      after the node, and a CUDA graph's capture, sees the updated state).
//      Its GPU time hides behind the GEMMs (partly: they leave few SMs
//      free), at the price of two event records and two waits of host time;
//   2 (default): 1 where the forward is captured into a CUDA graph (the
//      host time is spent once, at capture), 0 otherwise.
constexpr int kRecordTail = 0, kRecordSide = 1, kRecordAuto = 2;
std::atomic<int> g_small_record_stream{-1};
int small_record_stream() {
  const int o = g_small_record_stream.load(std::memory_order_relaxed);
  if (o >= 0) return o;
  static const int v = [] {
    const int i = env_choice("TORCH_OPS_SMALL_RECORD_STREAM", {"0", "1", "2"}, 2);
    return i == 0 ? kRecordTail : (i == 1 ? kRecordSide : kRecordAuto);
  }();
  return v;
}

// This thread's side stream and its two events on `device` (created on first
// use). The autograd engine runs a device's backward on one thread, and a
// node's pre-hook and post-hook run on it back to back: one pair of events
// per thread and device is enough.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
SideStream& side_stream(int device) {
  thread_local SideStream side[kMaxDevices];
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "fp8_linear: device index ", std::to_string(device),
              " out of range");
  SideStream& s = side[device];
  if (!s.stream) {
    const c10::cuda::CUDAGuard device_guard((c10::DeviceIndex)device);
    s.stream = c10::cuda::getStreamFromPool(false, (c10::DeviceIndex)device).stream();
    TORCH_OPS_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
    TORCH_OPS_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  }
  return s;
}

// The state launch of `recs` on the side stream after the point `s.fork`
// marks on `main`, then `main` waits for it. The tensors read on the side
// stream are freed after this point (the caller holds them), so whatever
// reuses their memory on `main` comes after the launch.
void record_on_side(SideStream& s, cudaStream_t main, int device, const AmaxRecord* recs, int n, int algo,
                    double mdiv) {
  TORCH_OPS_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.fork, 0));
  {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(s.stream, (c10::DeviceIndex)device));
    amax_record_launch(recs, n, algo, mdiv);
  }
  TORCH_OPS_CUDA_CHECK(cudaEventRecord(s.join, s.stream));
  TORCH_OPS_CUDA_CHECK(cudaStreamWaitEvent(main, s.join, 0));
}

// The side stream's pre-hook: the gradient is ready on the backward's stream here.
struct MarkBeforeBackward : torch::autograd::FunctionPreHook {
  explicit MarkBeforeBackward(int device) : device(device) {}
  variable_list operator()(const variable_list& grads) override {
    SideStream& s = side_stream(device);
    TORCH_OPS_CUDA_CHECK(cudaEventRecord(s.fork, c10::cuda::getCurrentCUDAStream(device).stream()));
    return grads;
  }
  int device;
};

// The small path's state update while autograd records: one launch, when
// the backward has run the GEMM's node, records the amaxes of x, the weight
// and the output gradient (each history and scale as quantize_delayed with
// record=True would). Instead of a launch in the forward and another in the
// backward: at the small sizes the host time of a launch is the cost. A
// post-hook of the node (not a tensor hook: register_hook builds a hook list
// and two wrappers per call), so that the backward's GEMMs are launched
// first: measured 1.6-2.4 us per step less than a pre-hook (session 7).
struct RecordAfterBackward : torch::autograd::FunctionPostHook {
  RecordAfterBackward(const at::Tensor& x, const at::Tensor& w, const std::vector<at::Tensor>& state, int grad_fmt,
                      int algo, double mdiv, uint32_t output_nr, bool on_side)
      : x(x), w(w), xs(state[0]), xh(state[1]), ws(state[2]), wh(state[3]), gs(state[4]), gh(state[5]),
        grad_fmt(grad_fmt), algo(algo), mdiv(mdiv), output_nr(output_nr), on_side(on_side) {}

  // grad_outputs: the gradients flowing into the node (the output's is ours).
  variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
    const at::Tensor& grad = grad_outputs[output_nr];
    const at::Tensor g = grad.defined() ? grad.contiguous() : at::Tensor();
    const AmaxRecord recs[3] = {{&x, &xh, &xs, kE4M3}, {&w, &wh, &ws, kE4M3}, {&g, &gh, &gs, grad_fmt}};
    const int n = g.defined() ? 3 : 2;
    if (!on_side) {
      amax_record_launch(recs, n, algo, mdiv);
      return grad_inputs;
    }
    const int device = (int)x.get_device();
    SideStream& s = side_stream(device);
    const cudaStream_t main = c10::cuda::getCurrentCUDAStream(device).stream();
    // contiguous() copied a strided gradient on the backward's stream: the
    // side stream starts after that copy (and the GEMMs launched before it).
    if (g.defined() && !g.is_same(grad)) TORCH_OPS_CUDA_CHECK(cudaEventRecord(s.fork, main));
    record_on_side(s, main, device, recs, n, algo, mdiv);
    return grad_inputs;
  }

  at::Tensor x, w, xs, xh, ws, wh, gs, gh;
  int grad_fmt, algo;
  double mdiv;
  uint32_t output_nr;
  bool on_side;
};

// The small path's GEMM while autograd records, with the state launch in its
// backward where small_record_stream puts it.
at::Tensor small_linear_recorded(const at::Tensor& x2d, const at::Tensor& weight, const at::Tensor& wd,
                                 const c10::optional<at::Tensor>& bias, bool in_out,
                                 const std::vector<at::Tensor>& state, int grad_fmt, int algo, double mdiv) {
  at::Tensor out = small_linear(x2d, weight, bias, in_out);
  const int mode = small_record_stream();
  const int device = (int)x2d.get_device();
  const bool on_side = mode == kRecordSide ||
                       (mode == kRecordAuto && stream_capturing(c10::cuda::getCurrentCUDAStream(device).stream()));
  const auto& node = out.grad_fn();  // at::linear's / mm's node: out requires grad here
  TORCH_CHECK(node, "fp8_linear: the small path's output has no autograd node");
  if (on_side) node->add_pre_hook(std::make_unique<MarkBeforeBackward>(device));
  node->add_post_hook(
      std::make_unique<RecordAfterBackward>(x2d, wd, state, grad_fmt, algo, mdiv, out.output_nr(), on_side));
  return out;
}

// The small path's GEMMs while captured into a CUDA graph, for a forward
// output of (M, N) from (M, K) on `device` (set_gemm_amax_in_graphs;
// otherwise TORCH_OPS_GEMM_AMAX_GRAPHS, read once): mode 0 cuBLAS's GEMMs
// and the state kernel on a side stream (kCublas); 1 our GEMMs as eagerly
// (kOurs: the forward records x and W); 3 our backward and cuBLAS's forward
// (kOursCublasForward: x and W are recorded by the backward's launch); 2
// (auto, the default) 3 where the backward is one launch of ours
// (gemm_amax_pair_fits, both gradients needed) or gemm_amax's forward would
// take narrow tiles, else 1. In graph replay host time is free and what
// counts is GPU time: our forward is slower than cuBLAS's (1024x2048x1024:
// 14.3 against 8.9 us; 4096x1024x1024: 16.4 against 14.1 with its
// records), which pays where the backward's one launch records x and W
// beside the gradient at little cost (4096x1024x1024 as gemm_amax_pair's
// chain: step 43.2-43.7 us against 44.3-44.4 with our forward, session 22)
// and where nothing else records them (sessions 18-22,
// scripts/gemm_amax_graph_probe.py, scripts/graph_kernels.py).
enum class GraphGemms { kCublas, kOurs, kOursCublasForward };
std::atomic<int> g_gemm_amax_in_graphs{-1};
GraphGemms gemm_amax_in_graphs(long long M, long long K, long long N, bool in_out, bool both_grads, int device) {
  int mode = g_gemm_amax_in_graphs.load(std::memory_order_relaxed);
  if (mode < 0) {
    static const int env =
        std::array<int, 4>{2, 0, 1, 3}[env_choice("TORCH_OPS_GEMM_AMAX_GRAPHS", {"auto", "0", "1", "3"}, 0)];
    mode = env;
  }
  if (mode == 0) return GraphGemms::kCublas;
  if (mode == 1) return GraphGemms::kOurs;
  if (mode == 3 || (both_grads && gemm_amax_pair_fits(M, K, N, in_out, device)) || !gemm_amax_wide(M, N, device))
    return GraphGemms::kOursCublasForward;
  return GraphGemms::kOurs;
}

// The small path on our own bf16 GEMMs (gemm_amax.cu), which record the
// amaxes as they read their operands. The backward is one launch
// (gemm_amax_pair: dX and dW, recording the gradient's amax); the forward
// either our GEMM recording x's and W's amaxes (as the FP8 path's
// quantizes do, in the forward) or, where `fwd_records` is false, cuBLAS's
// GEMM, and then the backward's launch records x and W too (as the cuBLAS
// small path's state launch does). No state kernel reads x, W and the
// gradient again, and no hooks. Where an operand does not suit the kernels
// (or only one gradient is needed), dX on gemm_amax or cuBLAS, dW on
// cuBLAS, and what is left to record by a launch of its own.
struct SmallAmax {
  at::Tensor wd;  // the weight as the kernels read it (contiguous, bf16)
  at::Tensor xs, xh, ws, wh, gs, gh;
  bool in_out = false, fwd_records = true;
  int grad_fmt = 1, algo = 0;
  double mdiv = 1.0;
};

// SmallAmaxFn's flags beside kInOut and kHasBias: x's and W's records are
// the backward's.
constexpr int64_t kRecordInBackward = 512;

class SmallAmaxFn : public torch::autograd::Function<SmallAmaxFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2d, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const SmallAmax& s) {
    (void)weight;  // s.wd holds its values
    const at::Tensor* b = (bias.has_value() && bias->defined()) ? &*bias : nullptr;
    at::Tensor out;
    auto& sd = ctx->saved_data;
    if (s.fwd_records) {
      const AmaxRecord rx{&x2d, &s.xh, &s.xs, kE4M3}, rw{&s.wd, &s.wh, &s.ws, kE4M3};
      out = gemm_amax(x2d, s.wd, s.in_out ? 1 : 0, &rx, &rw, s.algo, s.mdiv, b);
    } else {
      out = small_linear(x2d, s.wd, bias, s.in_out);
      sd["xs"] = s.xs;
      sd["xh"] = s.xh;
      sd["ws"] = s.ws;
      sd["wh"] = s.wh;
    }
    ctx->save_for_backward({x2d, s.wd});
    // The grad state is written by the kernels through raw pointers (as in
    // LinearFn): kept without version checks.
    sd["gs"] = s.gs;
    sd["gh"] = s.gh;
    sd["f"] = (int64_t)((s.in_out ? kInOut : 0) | (b ? kHasBias : 0) | (s.fwd_records ? 0 : kRecordInBackward));
    sd["c"] = (int64_t)(s.grad_fmt | (s.algo << 8));  // as LinearFn's (no scaling: delayed)
    sd["m"] = s.mdiv;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x2d = saved[0], &wd = saved[1];
    auto& sd = ctx->saved_data;
    const int64_t f = sd["f"].toInt(), c = sd["c"].toInt();
    const int grad_fmt = (int)(c & 15), algo = (int)((c >> 8) & 15);
    const bool in_out = f & kInOut, has_bias = f & kHasBias, xw_here = f & kRecordInBackward;
    const double mdiv = sd["m"].toDouble();
    at::Tensor dx, dw, db;
    if (!grads[0].defined()) return {dx, dw, db, at::Tensor()};
    const at::Tensor g2d = grads[0].contiguous();
    const at::Tensor gs = sd["gs"].toTensor(), gh = sd["gh"].toTensor();
    at::Tensor xs, xh, ws, wh;
    if (xw_here) xs = sd["xs"].toTensor(), xh = sd["xh"].toTensor(), ws = sd["ws"].toTensor(), wh = sd["wh"].toTensor();
    const AmaxRecord rg{&g2d, &gh, &gs, grad_fmt}, rx{&x2d, &xh, &xs, kE4M3}, rw{&wd, &wh, &ws, kE4M3};
    const AmaxRecord* rxp = xw_here ? &rx : nullptr;
    const AmaxRecord* rwp = xw_here ? &rw : nullptr;
    const int dx_layout = in_out ? 0 : 1;  // g . W^T for a (K, N) weight, g . W for (N, K)
    // dW in the weight's layout: out_in (N, K) = g^T x, in_out (K, N) = x^T g.
    const at::Tensor& a1 = in_out ? x2d : g2d;
    const at::Tensor& b1 = in_out ? g2d : x2d;
    if (ctx->needs_input_grad(0) && ctx->needs_input_grad(1) && gemm_amax_pair_applies(g2d, wd, dx_layout, a1, b1)) {
      const AmaxRecord* recs[4] = {&rg, rwp, in_out ? rxp : nullptr, in_out ? nullptr : rxp};
      std::tie(dx, dw) = gemm_amax_pair(g2d, wd, dx_layout, a1, b1, recs, algo, mdiv);
    } else {
      // What no GEMM below records, in one launch of its own.
      AmaxRecord left[3];
      int n_left = 0;
      bool g_done = false, w_done = false;
      if (ctx->needs_input_grad(0)) {
        if (gemm_amax_applies(g2d, wd, dx_layout)) {
          dx = gemm_amax(g2d, wd, dx_layout, &rg, rwp, algo, mdiv);
          g_done = w_done = true;
        } else {
          const at::Tensor w = wd.to(g2d.scalar_type());
          dx = in_out ? g2d.mm(w.t()) : g2d.mm(w);
        }
      }
      if (!g_done) left[n_left++] = rg;
      if (xw_here) {
        left[n_left++] = rx;
        if (!w_done) left[n_left++] = rw;
      }
      if (n_left) amax_record_launch(left, n_left, algo, mdiv);
      if (ctx->needs_input_grad(1)) dw = small_weight_grad(x2d, g2d, in_out, wd.scalar_type());
    }
    // needs_input_grad counts the defined tensor inputs only: index 2 exists
    // only with a bias. The bias is in x's dtype, as at::linear's.
    if (has_bias && ctx->needs_input_grad(2)) db = g2d.sum(0);
    return {dx, dw, db, at::Tensor()};
  }
};

// The call after check_args. `sink`: none, a 0-d sink (linear) or the (3,)
// pending vector (linear_folded, with its fold token, undefined when not
// training). `fold`: null, or the gradient channel's fold (linear_folded's
// training calls), done by the last block of x's quantize where there is one.
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const Args& a, const std::vector<at::Tensor>& state,
               int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo, bool in_out, bool training,
               int64_t min_gemm_size, int64_t sink_flags, const at::Tensor& token, const FoldJob* fold,
               const std::vector<at::Tensor>& pre) {
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
  const long long M = x2d.size(0);
  const bool small = (double)M * (double)N * (double)K < (double)min_gemm_size;
  const bool record = training && scaling == kDelayed;
  // Small and recording a graph without a gradient channel: PyTorch's own
  // autograd node (no custom Function) and one state launch in the backward.
  // A bias of another dtype than x keeps LinearFn (its gradient is summed in
  // float32, not rounded to x's dtype).
  const bool native_small = small && needs_graph && !sink.has_value() &&
                            (!bias.has_value() || bias->scalar_type() == x2d.scalar_type());

  const bool record_after_gemm = small && record && !native_small;

  Extra e;
  e.flags = (small ? kSmall : 0) | (in_out ? kInOut : 0) | (need_dx ? kNeedDx : 0) | (need_dw ? kNeedDw : 0) |
            ((record && !sink.has_value()) ? kRecordGrad : 0) | (bias.has_value() ? kHasBias : 0) |
            (sink.has_value() ? (kHasSink | sink_flags) : (sink_flags & kRoundDb));
  e.grad_fmt = (int)grad_fmt;
  e.scaling = (int)scaling;
  e.algo = (int)algo;
  e.mdiv = mdiv;
  e.grad_hist = state[5];
  e.grad_scale = state[4];
  e.token = token;
  // The weight as the kernels read it (contiguous; a copy made without
  // recording autograd history).
  at::Tensor wd;
  {
    at::NoGradGuard ng;
    wd = weight.is_contiguous() ? weight : weight.contiguous();
    // Small: only the state updates matter (no fp8 operand is used); they
    // are launched after the GEMM, below.
    QuantizeExtras with_fold;
    if (fold) with_fold.fold = *fold;
    // Small: the fold rides on the x/weight record launch after the GEMM
    // where there is one (one launch fewer per step); on its own otherwise
    // (not recording, or PyTorch's autograd node recording in the backward).
    if (small && fold && !record_after_gemm) fold_launch(x2d, *fold);
    if (!small) {
      Q qx = quant(x2d, state[1], state[0], kE4M3, (int)scaling, mdiv, (int)algo, need_dw, record, true, at::Tensor(),
                   fold ? &with_fold : nullptr);
      // The forward wants (N, K), the dX GEMM (K, N); out_in stores (N, K).
      Q qw = (record && scaling == kDelayed && !pre.empty())
                 ? take_prequantized(pre, wd, state[3], state[2], (int)algo, mdiv)
                 : quant(wd, state[3], state[2], kE4M3, (int)scaling, mdiv, (int)algo, in_out || need_dx, record,
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
  // Our GEMMs that record the amaxes (SmallAmaxFn): bf16 x, weight and
  // bias, delayed scaling while training, shapes the kernel takes, sm_90;
  // while the stream is captured into a CUDA graph, where
  // gemm_amax_in_graphs says (elsewhere cuBLAS's GEMMs with the state
  // kernel on a side stream take less GPU time).
  const bool small_amax_fits = native_small && record && x2d.scalar_type() == at::kBFloat16 &&
                               (!bias.has_value() || gemm_amax_bias_applies(*bias, N, x2d)) &&
                               wd.scalar_type() == at::kBFloat16 && gemm_amax_applies(x2d, wd, in_out ? 1 : 0);
  // (The mode is looked up on every such call: an unknown value of its
  // environment variable warns at the first, captured or not.)
  const GraphGemms graph_mode =
      small_amax_fits ? gemm_amax_in_graphs(x2d.size(0), K, N, in_out, need_dx && need_dw, (int)x2d.get_device())
                      : GraphGemms::kOurs;
  const GraphGemms graph_gemms =
      small_amax_fits && stream_capturing(c10::cuda::getCurrentCUDAStream(x2d.get_device()).stream())
          ? graph_mode
          : GraphGemms::kOurs;
  if (small_amax_fits && graph_gemms != GraphGemms::kCublas) {
    SmallAmax s;
    s.fwd_records = graph_gemms == GraphGemms::kOurs;
    s.wd = wd;
    s.xs = state[0], s.xh = state[1], s.ws = state[2], s.wh = state[3], s.gs = state[4], s.gh = state[5];
    s.in_out = in_out;
    s.grad_fmt = (int)grad_fmt;
    s.algo = (int)algo;
    s.mdiv = mdiv;
    out = SmallAmaxFn::apply(x2d, weight, bias, s);
  } else if (native_small) {
    out = record ? small_linear_recorded(x2d, weight, wd, bias, in_out, state, (int)grad_fmt, (int)algo, mdiv)
                 : small_linear(x2d, weight, bias, in_out);
  } else if (needs_graph) {
    out = LinearFn::apply(x2d, weight, bias, sink, e);
  } else {
    at::NoGradGuard ng;
    if (small) {
      out = small_linear(x2d, weight, bias, in_out);
    } else {
      out = fp8_gemm(e.qx, e.qw_fwd, e.sx, e.sw, bias_as(bias, x2d.scalar_type()), x2d.scalar_type(), true);
    }
  }
  if (record_after_gemm) {
    // x's and the weight's record after the GEMM's launch (which it does not
    // delay); the gradient's is in LinearFn's backward. With PyTorch's
    // autograd (native_small) small_linear_recorded places them. Without recording
    // nothing is updated.
    const AmaxRecord recs[2] = {{&x2d, &state[1], &state[0], kE4M3}, {&wd, &state[3], &state[2], kE4M3}};
    amax_record_launch(recs, 2, (int)algo, mdiv, fold);
  }
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return out.reshape(shape);
}

}  // namespace

int set_small_record_stream(int mode) { return g_small_record_stream.exchange(mode); }

int set_gemm_amax_in_graphs(int mode) { return g_gemm_amax_in_graphs.exchange(mode); }

// Weights quantized ahead of their next training call, all in one call
// (torch_ops.linear.prequantize_weights: at the end of a training step the
// host, not the GPU, is the bottleneck, so the host time is the point).
// For each: quantize_delayed(record=False, transpose=True, pad=True,
// write_q=True) with its kernel scale and history, launched on the current
// stream (the caller's side stream); the outputs are marked for the caching
// allocator as used by `consumer` (a cudaStream_t), the stream that will
// read them. Returns (q, qt, scale_used, amax) per weight.
std::vector<std::vector<at::Tensor>> prequantize(const std::vector<at::Tensor>& weights,
                                                 const std::vector<at::Tensor>& scales,
                                                 const std::vector<at::Tensor>& hists, double mdiv, int64_t algo,
                                                 int64_t consumer) {
  TORCH_CHECK_VALUE(weights.size() == scales.size() && weights.size() == hists.size(),
                    "weights, scales, hists: expected lists of one length, got ", std::to_string(weights.size()),
                    ", ", std::to_string(scales.size()), " and ", std::to_string(hists.size()));
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(weights.size());
  at::NoGradGuard ng;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const auto t = w.scalar_type();
    TORCH_CHECK_VALUE(w.is_cuda() && w.dim() == 2 && w.is_contiguous() &&
                          (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat),
                      "weights[", std::to_string(i), "]: expected a contiguous 2-D bfloat16, float16 or float32 "
                      "CUDA tensor");
    check_f32_state(scales[i], "scales", w, 1, false);
    check_f32_state(hists[i], "hists", w, -1, true);
    const c10::cuda::CUDAStream reader =
        c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(consumer), w.get_device());
    Q q = quant(w, hists[i], scales[i], kE4M3, kDelayed, mdiv, (int)algo, true, false, true);
    for (const at::Tensor* o : {&q.q, &q.qt, &q.scale_used, &q.amax}) {
      c10::cuda::CUDACachingAllocator::recordStream(o->storage().data_ptr(), reader);
    }
    out.push_back({q.q, q.qt, q.scale_used, q.amax});
  }
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                  const std::vector<at::Tensor>& state, int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo,
                  bool in_out, bool training, const c10::optional<at::Tensor>& sink_in, int64_t min_gemm_size) {
  if (!plain(x) || !plain(weight) || !plain(bias_in) || !plain(sink_in) || !all_plain(state)) return at::Tensor();
  Args a = check_args(x, weight, bias_in, state, in_out);
  if (sink_in.has_value() && sink_in->defined()) {
    a.sink = *sink_in;
    TORCH_CHECK_VALUE(a.sink->dim() == 0 && a.sink->scalar_type() == at::kFloat,
                      "grad_amax_sink: expected a 0-d float32 tensor with requires_grad=True");
  }
  return run(x, weight, a, state, grad_fmt, scaling, mdiv, algo, in_out, training, min_gemm_size, 0, at::Tensor(),
             nullptr, {});
}

at::Tensor linear_folded(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in,
                         const at::Tensor& pending, const at::Tensor& fold_state, const std::vector<at::Tensor>& state,
                         int64_t grad_fmt, double mdiv, int64_t algo, int64_t window, bool in_out, bool training,
                         int64_t min_gemm_size, const std::vector<at::Tensor>& prequantized) {
  if (!plain(x) || !plain(weight) || !plain(bias_in) || !plain(pending) || !plain(fold_state) || !all_plain(state))
    return at::Tensor();
  Args a = check_args(x, weight, bias_in, state, in_out);
  for (const at::Tensor* t : {&pending, &fold_state}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == 3 && t->is_contiguous() &&
                          t->device() == x.device(),
                      t == &pending ? "pending" : "fold_state", ": expected a contiguous float32 tensor of shape (3,) on ",
                      x.device());
  }
  std::vector<at::Tensor> st = state;
  FoldOutputs folded;
  if (training) {
    // The fold's snapshots are this call's grad state: they stay valid for
    // its backward even when a later call folds into the variables again.
    // Launched by x's quantize (run), before anything reads them.
    const double fmax = grad_fmt == 1 ? 57344.0 : 448.0;
    folded = prepare_fold_grad_amax(pending, fold_state, state[5], state[4], 1.0 / fmax, mdiv, (int)algo,
                                    window > 0 ? window : state[5].numel(), true);
    st[4] = folded.scale;
    st[5] = folded.history;
  }
  if (at::GradMode::is_enabled() && pending.requires_grad()) a.sink = pending;
  return run(x, weight, a, st, grad_fmt, kDelayed, mdiv, algo, in_out, training, min_gemm_size, kSinkVec | kRoundDb,
             folded.token, training ? &folded.job : nullptr, prequantized);
}

}  // namespace torch_ops
