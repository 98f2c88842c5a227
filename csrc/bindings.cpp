// pybind11 bindings: the Python face of common.h's API. The argument checks
// of the quantize entries live here, so that every error names the argument;
// torch_ops/ops.py wraps these in torch.library custom ops.

#include <ATen/ATen.h>
#include <torch/extension.h>

#include "common.h"

#include <tuple>
#include <utility>

namespace {

using Out4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

long long round16(long long v) { return (v + 15) / 16 * 16; }

at::ScalarType fp8_of(int fmt) { return fmt == 1 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; }

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "x: expected a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "x: expected a 2-D (rows, cols) tensor here, got ", std::to_string(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), "x: expected a contiguous tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat,
              "x: expected bfloat16, float16 or float32, got ", t);
}

// A scale (one element) or an amax history (1-D) next to x.
void check_f32(const at::Tensor& t, const char* name, const at::Tensor& x, bool scalar) {
  torch_ops::check_f32_state(t, name, x, scalar ? 1 : -1, !scalar);
}

// Allocates q (R, ldq) and qt (C, ldqt) (empty when not requested).
std::tuple<at::Tensor, long long, at::Tensor, long long> alloc_outputs(const at::Tensor& x, int fmt, bool transpose,
                                                                       bool pad, bool write_q) {
  const long long R = x.size(0), C = x.size(1);
  const auto opts = x.options().dtype(fp8_of(fmt));
  long long ldq = pad ? round16(C) : C, ldqt = pad ? round16(R) : R;
  at::Tensor q = write_q ? at::empty({R, ldq}, opts) : at::empty({0}, opts);
  at::Tensor qt = transpose ? at::empty({C, ldqt}, opts) : at::empty({0}, opts);
  return {q, ldq, qt, ldqt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x, const at::Tensor& scale, int fmt,
                                                        bool transpose, bool pad, bool write_q) {
  check_x(x);
  check_f32(scale, "scale", x, true);
  auto [q, ldq, qt, ldqt] = alloc_outputs(x, fmt, transpose, pad, write_q);
  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor none;
  torch_ops::quantize_launch(x, x.size(0), x.size(1), fmt, 0, scale, scale, amax, none, none, none,
                             write_q ? q : none, ldq, transpose ? qt : none, ldqt, 0, 1.0, false, nullptr);
  return {q, qt, amax};
}

Out4 quantize_delayed(const at::Tensor& x, const at::Tensor& history, const at::Tensor& scale, int fmt, double mdiv,
                      int algo, bool transpose, bool record, bool pad, bool write_q) {
  check_x(x);
  check_f32(history, "amax_history", x, false);
  check_f32(scale, "scale", x, true);
  auto [q, ldq, qt, ldqt] = alloc_outputs(x, fmt, transpose, pad, write_q);
  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor scale_used = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor none;
  torch_ops::quantize_launch(x, x.size(0), x.size(1), fmt, 1, scale, scale_used, amax, record ? history : none,
                             record ? scale : none, history, write_q ? q : none, ldq, transpose ? qt : none, ldqt,
                             algo, mdiv, false, nullptr);
  return {q, qt, scale_used, amax};
}

Out4 quantize_current(const at::Tensor& x, const c10::optional<at::Tensor>& prev_scale, int fmt, double mdiv,
                      bool transpose, bool pad, bool write_q) {
  check_x(x);
  at::Tensor prev;
  if (prev_scale.has_value() && prev_scale->defined()) {
    check_f32(*prev_scale, "prev_scale", x, true);
    prev = *prev_scale;
  }
  auto [q, ldq, qt, ldqt] = alloc_outputs(x, fmt, transpose, pad, write_q);
  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor scale_used = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor none;
  torch_ops::quantize_launch(x, x.size(0), x.size(1), fmt, 2, prev, scale_used, amax, none, none, none,
                             write_q ? q : none, ldq, transpose ? qt : none, ldqt, 0, mdiv, false, nullptr);
  return {q, qt, scale_used, amax};
}

void record_amax(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt, double mdiv,
                 int algo, bool skip_zero) {
  TORCH_CHECK(history.is_cuda(), "amax_history: expected a CUDA tensor, got device ", history.device());
  check_f32(history, "amax_history", history, false);
  check_f32(scale, "scale", history, true);
  check_f32(amax, "amax", history, true);
  torch_ops::record_amax_launch(history, scale, amax, fmt, algo, mdiv, skip_zero);
}

// The optional delayed-scaling history of a producer call: float32, 1-D,
// contiguous, non-empty, next to x.
void check_history(const c10::optional<at::Tensor>& history, const at::Tensor& x) {
  if (history.has_value() && history->defined()) {
    check_f32(*history, "amax_history", x, false);
    TORCH_CHECK(history->numel() > 0, "amax_history: expected a non-empty history");
  }
}

using Out4y = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Out4y scaled_rows_quantize(const at::Tensor& x, const at::Tensor& row_mul, const at::Tensor& weight,
                           at::ScalarType out_dtype, const c10::optional<at::Tensor>& history,
                           const at::Tensor& scale, int fmt, double mdiv, bool pad) {
  check_x(x);
  torch_ops::check_f32_state(row_mul, "row_mul", x, x.size(0), true);
  torch_ops::check_f32_state(weight, "weight", x, x.size(1), true);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "out_dtype: expected bfloat16, float16 or float32, got ", out_dtype);
  check_history(history, x);
  check_f32(scale, "scale", x, true);
  return torch_ops::scaled_rows_quantize_launch(x, row_mul, weight, out_dtype, history, scale, fmt, mdiv, pad);
}

Out4y gated_quantize(const at::Tensor& gate, const c10::optional<at::Tensor>& up, int activation,
                     const c10::optional<at::Tensor>& history, const at::Tensor& scale, int fmt, double mdiv,
                     bool pad) {
  check_x(gate);
  if (up.has_value() && up->defined()) {
    TORCH_CHECK(up->device() == gate.device(), "up: expected device ", gate.device(), ", got ", up->device());
    TORCH_CHECK(up->scalar_type() == gate.scalar_type(), "up: expected ", gate.scalar_type(), " like gate, got ",
                up->scalar_type());
    TORCH_CHECK(up->sizes() == gate.sizes(), "up: expected gate's shape ", torch_ops::shape_str(gate), ", got ",
                torch_ops::shape_str(*up));
    TORCH_CHECK(up->is_contiguous(), "up: expected a contiguous tensor");
  }
  check_history(history, gate);
  check_f32(scale, "scale", gate, true);
  return torch_ops::gated_quantize_launch(gate, up, activation, history, scale, fmt, mdiv, pad);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "keras-fp8 torch_ops CUDA kernels (fused FP8 quantize, cuBLASLt FP8 GEMM)";
  m.def("quantize", &quantize, "x, scale, fmt, transpose, pad, write_q -> (q, qt, amax)");
  m.def("quantize_delayed", &quantize_delayed,
        "x, history, scale, fmt, mdiv, algo, transpose, record, pad, write_q -> (q, qt, scale_used, amax)");
  m.def("quantize_current", &quantize_current,
        "x, prev_scale, fmt, mdiv, transpose, pad, write_q -> (q, qt, scale_used, amax)");
  m.def("record_amax", &record_amax, "history, scale, amax, fmt, mdiv, algo, skip_zero");
  m.def("gemm", &torch_ops::fp8_gemm, "a, b, scale_a, scale_b, bias, out_dtype, fast_accum, autotune -> out");
  py::class_<torch_ops::LinearOptions>(m, "LinearOptions",
                                       "torch_ops.LinearConfig as the eager entry reads it (common.h)")
      .def(py::init<>())
      .def_readwrite("grad_dtype", &torch_ops::LinearOptions::grad_dtype)
      .def_readwrite("current_scaling", &torch_ops::LinearOptions::current_scaling)
      .def_readwrite("margin_multiplier", &torch_ops::LinearOptions::margin_multiplier)
      .def_readwrite("amax_algorithm", &torch_ops::LinearOptions::amax_algorithm)
      .def_readwrite("fold_window", &torch_ops::LinearOptions::fold_window)
      .def_readwrite("in_out", &torch_ops::LinearOptions::in_out)
      .def_readwrite("fast_accum_forward", &torch_ops::LinearOptions::fast_accum_forward)
      .def_readwrite("fast_accum_dgrad", &torch_ops::LinearOptions::fast_accum_dgrad)
      .def_readwrite("fast_accum_wgrad", &torch_ops::LinearOptions::fast_accum_wgrad);
  m.def("linear", &torch_ops::linear,
        "x, weight, bias, state[6], grad_amax_pending, grad_fold_state, options, training, record_inputs, "
        "autotune, x_fp8, return_x_fp8 -> [out] (+ x's q, q_t, scale_used, amax with return_x_fp8; every "
        "argument checked by torch_ops/linear.py)");
  m.def(
      "constants",
      []() {
        py::dict d;
        d["fp8_format_ids"] = py::make_tuple(fp8_kernels::kE4M3, fp8_kernels::kE5M2);
        d["fp8_max"] = py::make_tuple(fp8_kernels::kE4M3Max, fp8_kernels::kE5M2Max);
        d["amax_compute_algo_ids"] = py::make_tuple(fp8_kernels::kAmaxMax, fp8_kernels::kAmaxMostRecent);
        d["min_scale"] = (double)fp8_kernels::kMinScale;
        d["fold_count_period"] = (double)fp8_kernels::kFoldCountPeriod;
        d["max_history_len"] = fp8_kernels::kMaxHistoryLen;
        return d;
      },
      "the numerics constants the kernels are built with (torch_ops/extension.py compares them with "
      "torch_ops/reference.py's at load)");
  m.def("quantize_tiles", &torch_ops::quantize_tiles,
        "x, fmt, transposed, mult, power_of_two -> (q, scales): 1 x 128 tiles of x's rows (or columns, transposed)");
  m.def("quantize_blocks", &torch_ops::quantize_blocks,
        "w, fmt, mult, power_of_two -> (q, q_t, scales): 128 x 128 blocks");
  m.def(
      "block_gemm",
      [](const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b, const at::Tensor& b_scales,
         bool b_tiles, const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) -> py::object {
        at::Tensor out = torch_ops::block_gemm(a, a_scales, b, b_scales, b_tiles, bias, out_dtype);
        if (!out.defined()) return py::none();
        return py::cast(out);
      },
      "a, a_scales, b, b_scales, b_tiles, bias, out_dtype -> a @ b^T block-scaled (None: no cuBLASLt kernel)");
  m.def("scaled_rows_quantize", &scaled_rows_quantize,
        "x, row_mul, weight, out_dtype, history, scale, fmt, mdiv, pad -> (y, q, scale_used, amax)");
  m.def("gated_quantize", &gated_quantize,
        "gate, up, activation, history, scale, fmt, mdiv, pad -> (y, q, scale_used, amax)");
  m.def("fold_grad_amax", &torch_ops::fold_grad_amax,
        "pending, fold_state, history, scale, inv_max, mdiv, algo, window, update_scale -> (token, scale, history)");
}
