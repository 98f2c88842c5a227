// pybind11 bindings. Argument checks live here so that every error names the
// argument; torch_ops/_ops.py wraps these in torch.library custom ops.

#include <ATen/ATen.h>
#include <torch/extension.h>

#include "common.h"

#include <stdexcept>
#include <tuple>
#include <utility>

namespace torch_ops {
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode, const at::Tensor& scale_in,
                     const at::Tensor& scale_used, const at::Tensor& amax_out, const at::Tensor& history,
                     const at::Tensor& scale_state, const at::Tensor& hist_for_empty, const at::Tensor& q,
                     long long ldq, const at::Tensor& qt, long long ldqt, int algo, double mdiv, bool skip_zero,
                     const QuantizeExtras* extras);
int set_tile_version(int version);
std::tuple<int, int, int> set_lean_options(int tiles_per_warp, int rows, int pdl);
int set_delayed_prepass(int mode);
int set_small_record_stream(int mode);
int set_gemm_amax_in_graphs(int mode);
void record_amax_launch(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt, int algo,
                        double mdiv, bool skip_zero, const at::Tensor* scale_used);
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const std::vector<at::Tensor>& state, int64_t grad_fmt, int64_t scaling, double mdiv, int64_t algo,
                  bool in_out, bool training, const c10::optional<at::Tensor>& sink, int64_t min_gemm_size);
at::Tensor linear_folded(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const at::Tensor& pending, const at::Tensor& fold_state, const std::vector<at::Tensor>& state,
                         int64_t grad_fmt, double mdiv, int64_t algo, int64_t window, bool in_out, bool training,
                         int64_t min_gemm_size, const std::vector<at::Tensor>& prequantized);
std::vector<std::vector<at::Tensor>> prequantize(const std::vector<at::Tensor>& weights,
                                                 const std::vector<at::Tensor>& scales,
                                                 const std::vector<at::Tensor>& hists, double mdiv, int64_t algo,
                                                 int64_t consumer);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_grad_amax(const at::Tensor& pending, const at::Tensor& fold_state,
                                                              const at::Tensor& history, const at::Tensor& scale,
                                                              double inv_max, double mdiv, int algo,
                                                              long long window, bool update_scale);
}  // namespace torch_ops

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
  torch_ops::record_amax_launch(history, scale, amax, fmt, algo, mdiv, skip_zero, nullptr);
}

int set_tile_version(int64_t version) {
  TORCH_CHECK_VALUE(version == 0 || version == 2 || version == 3 || version == 5,
                    "version: expected 0 (default), 2, 3 or 5 (1 and 4 were removed), got ",
                    std::to_string(version));
  return torch_ops::set_tile_version((int)version);
}

std::tuple<int, int, int> set_lean_options(int64_t tiles_per_warp, int64_t rows, int64_t pdl) {
  TORCH_CHECK_VALUE(tiles_per_warp >= 0 && tiles_per_warp <= 1024,
                    "tiles_per_warp: expected 0 (one resident wave) to 1024, got ", std::to_string(tiles_per_warp));
  TORCH_CHECK_VALUE(pdl >= -1 && pdl <= 1, "pdl: expected -1 (as TORCH_OPS_PDL says), 0 or 1, got ",
                    std::to_string(pdl));
  TORCH_CHECK_VALUE(rows == 1 || rows == 2 || rows == 4, "rows: expected 1, 2 or 4 tile rows per block, got ",
                    std::to_string(rows));
  return torch_ops::set_lean_options((int)tiles_per_warp, (int)rows, (int)pdl);
}

int set_delayed_prepass(int64_t mode) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 1,
                    "mode: expected -1 (as TORCH_OPS_DELAYED_PREPASS says), 0 (the history checked in the kernel) or "
                    "1 (a pre-pass), got ", std::to_string(mode));
  return torch_ops::set_delayed_prepass((int)mode);
}

// The record arguments of the test bindings below: each FP8 format 0
// (E4M3) or 1 (E5M2), the history rule 0 (max) or 1 (most recent).
void check_record_args(std::initializer_list<int64_t> fmts, int64_t algo) {
  for (const int64_t fmt : fmts)
    TORCH_CHECK_VALUE(fmt == 0 || fmt == 1, "fmt: expected 0 (E4M3) or 1 (E5M2), got ", std::to_string(fmt));
  TORCH_CHECK_VALUE(algo == 0 || algo == 1, "algo: expected 0 (max) or 1 (most_recent), got ", std::to_string(algo));
}

// An operand's record for the test bindings: `state` empty (none) or
// (history, scale) of float32 on `like`'s device.
bool test_record(const at::Tensor& x, const std::vector<at::Tensor>& state, int64_t fmt, const at::Tensor& like,
                 torch_ops::AmaxRecord& r) {
  TORCH_CHECK(state.empty() || state.size() == 2, "state: expected [] or [history, scale], got ",
              std::to_string(state.size()), " tensors");
  if (state.empty()) return false;
  torch_ops::check_f32_state(state[0], "state history", like, -1, true);
  torch_ops::check_f32_state(state[1], "state scale", like, 1, false);
  r = {&x, &state[0], &state[1], (int)fmt};
  return true;
}

// gemm_amax for tests: state_a / state_b empty (not recorded) or
// (history, scale); fmt_a / fmt_b their FP8 formats (0 E4M3, 1 E5M2).
at::Tensor gemm_amax(const at::Tensor& a, const at::Tensor& b, int64_t layout, const std::vector<at::Tensor>& state_a,
                     const std::vector<at::Tensor>& state_b, int64_t fmt_a, int64_t fmt_b, int64_t algo, double mdiv,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "layout: expected 0, 1 or 2, got ", std::to_string(layout));
  check_record_args({fmt_a, fmt_b}, algo);
  TORCH_CHECK(torch_ops::gemm_amax_applies(a, b, (int)layout),
              "a, b: expected contiguous 16-byte-aligned bfloat16 matrices with rows a multiple of 8 elements and "
              "matching inner dimensions, on an sm_90 device");
  torch_ops::AmaxRecord ra{}, rb{};
  const bool on_a = test_record(a, state_a, fmt_a, a, ra), on_b = test_record(b, state_b, fmt_b, a, rb);
  const at::Tensor* bp = (bias.has_value() && bias->defined()) ? &*bias : nullptr;
  return torch_ops::gemm_amax(a, b, (int)layout, on_a ? &ra : nullptr, on_b ? &rb : nullptr, (int)algo, mdiv, bp);
}

// gemm_amax_pair for tests: states[q] / fmts[q] of a0, b0, a1, b1 as
// gemm_amax's state_a / fmt_a (at most three states non-empty).
std::vector<at::Tensor> gemm_amax_pair(const at::Tensor& a0, const at::Tensor& b0, int64_t layout0,
                                       const at::Tensor& a1, const at::Tensor& b1,
                                       const std::vector<std::vector<at::Tensor>>& states,
                                       const std::vector<int64_t>& fmts, int64_t algo, double mdiv) {
  TORCH_CHECK_VALUE(layout0 == 0 || layout0 == 1, "layout0: expected 0 or 1, got ", std::to_string(layout0));
  TORCH_CHECK_VALUE(states.size() == 4 && fmts.size() == 4, "states, fmts: expected four entries each (a0, b0, a1, "
                    "b1), got ", std::to_string(states.size()), " and ", std::to_string(fmts.size()));
  check_record_args({fmts[0], fmts[1], fmts[2], fmts[3]}, algo);
  const at::Tensor* xs[4] = {&a0, &b0, &a1, &b1};
  torch_ops::AmaxRecord r[4] = {};
  const torch_ops::AmaxRecord* recs[4] = {};
  for (int q = 0; q < 4; ++q)
    if (test_record(*xs[q], states[q], fmts[q], a0, r[q])) recs[q] = &r[q];
  TORCH_CHECK(torch_ops::gemm_amax_pair_applies(a0, b0, (int)layout0, a1, b1),
              "a0, b0, a1, b1: expected contiguous 16-byte-aligned bfloat16 matrices with rows a multiple of 8 "
              "elements and matching inner dimensions, on one sm_90 device, whose tiles fit one wave (or dX's do and dW's "
              "split into as many parts)");
  auto out = torch_ops::gemm_amax_pair(a0, b0, (int)layout0, a1, b1, recs, (int)algo, mdiv);
  return {out.first, out.second};
}

int set_small_record_stream(int64_t mode) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 2,
                    "mode: expected -1 (as TORCH_OPS_SMALL_RECORD_STREAM says), 0 (the backward's stream), 1 (a side "
                    "stream beside the backward's GEMMs) or 2 (1 while a CUDA graph is captured, 0 otherwise), got ",
                    std::to_string(mode));
  return torch_ops::set_small_record_stream((int)mode);
}

int set_gemm_amax_in_graphs(int64_t mode) {
  TORCH_CHECK_VALUE(mode >= -1 && mode <= 3,
                    "mode: expected -1 (as TORCH_OPS_GEMM_AMAX_GRAPHS says), 0 (cuBLAS's GEMMs and the state kernel "
                    "while captured), 1 (our GEMMs), 2 (auto: 3 where the backward is one launch of ours or our forward "
                    "would take narrow tiles, else 1) or 3 (ours, the forward on cuBLAS), got ",
                    std::to_string(mode));
  return torch_ops::set_gemm_amax_in_graphs((int)mode);
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
  m.def("set_tile_version", &set_tile_version,
        "version (0 default, 2, 3, 5): the transposing quantize kernel of this process -> previous override");
  m.def("set_lean_options", &set_lean_options,
        "tiles_per_warp (default 1; 0: one resident wave), rows (tile rows per block: 1, 2 or 4; default 2), "
        "pdl (programmatic launch after the pre-pass on sm_90: 1 on, 0 off, -1 TORCH_OPS_PDL): the lean quantize "
        "kernels' launch, for benchmarks -> previous (tiles_per_warp, rows, pdl)");
  m.def("set_delayed_prepass", &set_delayed_prepass,
        "mode (-1 TORCH_OPS_DELAYED_PREPASS, 0 the lean kernels check the history themselves, 1 a pre-pass): "
        "delayed scaling's seed check in this process -> previous override");
  m.def("set_small_record_stream", &set_small_record_stream,
        "mode (-1 TORCH_OPS_SMALL_RECORD_STREAM, 0 the backward's stream, 1 a side stream beside the backward's "
        "GEMMs, 2 (default) 1 while a CUDA graph is captured and 0 otherwise): where the small path's state launch "
        "runs in this process -> previous override");
  m.def("gemm_amax", &gemm_amax,
        "a, b, layout, state_a, state_b, fmt_a, fmt_b, algo, mdiv, bias=None -> out (bf16 GEMM recording its "
        "operands' amax)",
        py::arg("a"), py::arg("b"), py::arg("layout"), py::arg("state_a"), py::arg("state_b"), py::arg("fmt_a"),
        py::arg("fmt_b"), py::arg("algo"), py::arg("mdiv"), py::arg("bias") = py::none());
  m.def("gemm_amax_pair", &gemm_amax_pair,
        "a0, b0, layout0, a1, b1, states[4], fmts[4], algo, mdiv -> [a0 . b0 in layout0, a1 . b1 in layout 2] "
        "(one launch, recording the operands with a state)");
  m.def("set_gemm_amax_in_graphs", &set_gemm_amax_in_graphs,
        "mode (-1: TORCH_OPS_GEMM_AMAX_GRAPHS, 0: cuBLAS and the state kernel while captured, 1: our GEMMs, "
        "2: auto, 3: ours, the forward on cuBLAS) -> the previous mode");
  m.def("gemm_amax_applies", [](const at::Tensor& a, const at::Tensor& b, int64_t layout) {
    return torch_ops::gemm_amax_applies(a, b, (int)layout);
  });
  m.def("gemm_amax_pair_applies",
        [](const at::Tensor& a0, const at::Tensor& b0, int64_t layout0, const at::Tensor& a1, const at::Tensor& b1) {
          return torch_ops::gemm_amax_pair_applies(a0, b0, (int)layout0, a1, b1);
        });
  m.def("gemm", &torch_ops::fp8_gemm, "a, b, scale_a, scale_b, bias, out_dtype, fast_accum -> out");
  m.def("linear", &torch_ops::linear,
        "x, weight, bias, state[6], grad_fmt, scaling, mdiv, algo, in_out, training, sink, min_gemm_size -> out "
        "(None: a tensor is not plain, take the Python path)");
  m.def("linear_folded", &torch_ops::linear_folded,
        "x, weight, bias, pending, fold_state, state[6], grad_fmt, mdiv, algo, window, in_out, training, "
        "min_gemm_size, prequantized (none, or the weight's quantize_delayed(record=False, transpose, pad) outputs) "
        "-> out (None: a tensor is not plain)");
  m.def("prequantize", &torch_ops::prequantize,
        "weights, scales, hists, mdiv, algo, consumer stream -> [(q, qt, scale_used, amax)] (the current stream)");
  m.def("fold_grad_amax", &torch_ops::fold_grad_amax,
        "pending, fold_state, history, scale, inv_max, mdiv, algo, window, update_scale -> (token, scale, history)");
}
