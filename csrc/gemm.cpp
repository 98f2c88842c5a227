// FP8 GEMM through cuBLASLt: out (M, N) = (a @ b^T) * scale_a * scale_b (+ bias)
// a (M, K) and b (N, K) are fp8 with K contiguous ("TN" layout, the only one
// cuBLASLt takes for FP8 on Hopper). Scales are device pointers, so nothing
// here reads a tensor value on the host: CUDA-graph safe.
//
// Column-major trick: row-major out (M, N) is column-major D (N x M), and
// D = op(A) op(B) with A = b stored (K x N) col-major, op T, and B = a stored
// (K x M) col-major, op N.
//
// Algorithm choice (`autotune`, torch_ops.Settings.gemm_autotune): on the
// first call of a plan key we ask cuBLASLt for up to kMaxCandidates heuristic
// algorithms and time each on the call's own operands (output written into the
// call's `out`, which the real GEMM then overwrites), and variants of the
// top-1 and of the fastest candidate (CTA swizzling, custom options, cluster
// shapes: variants_of), keeping the fastest. Without it the heuristic's top-1
// runs (what torch._scaled_mm does). A first call made while the current
// stream is capturing a CUDA graph never times (no synchronization during
// capture): it uses the top-1 and the plan is tuned on the next call outside
// capture.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"

#define TORCH_OPS_CUBLAS_CHECK(expr)                                                      \
  do {                                                                                    \
    cublasStatus_t st__ = (expr);                                                         \
    TORCH_CHECK(st__ == CUBLAS_STATUS_SUCCESS, "torch_ops: cuBLASLt error in ", #expr,   \
                ": status ", std::to_string((int)st__), " (", __FILE__, ":", std::to_string(__LINE__), ")");              \
  } while (0)

namespace torch_ops {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int kMaxCandidates = 16;

cudaDataType_t fp8_type(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat8_e4m3fn) return CUDA_R_8F_E4M3;
  if (t.scalar_type() == at::kFloat8_e5m2) return CUDA_R_8F_E5M2;
  TORCH_CHECK(false, name, ": expected torch.float8_e4m3fn or torch.float8_e5m2, got ", t.scalar_type());
}

cudaDataType_t out_type(at::ScalarType s) {
  switch (s) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "out_dtype: expected bfloat16, float16 or float32, got ", s);
  }
}

long long round16(long long v) { return (v + 15) / 16 * 16; }

// fp8 operand ready for cuBLASLt: row stride (ld) a multiple of 16 bytes,
// K a multiple of 16 (zero padded), base 16-byte aligned. Copies only when
// the input does not already satisfy this.
at::Tensor prepare_operand(const at::Tensor& t, long long Kp) {
  const long long K = t.size(1);
  const bool ok = t.stride(1) == 1 && t.stride(0) % 16 == 0 && t.stride(0) >= Kp && K == Kp &&
                  (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
  if (ok) return t;
  at::Tensor u = t.contiguous().view(at::kByte);
  if (Kp != K) u = at::constant_pad_nd(u, {0, Kp - K}, 0);
  return u.contiguous().view(t.scalar_type());
}

struct Descs;
struct Plan {
  cublasLtMatmulAlgo_t algo;  // heuristic top-1 until tuned
  bool bias_fused;
  bool tuned;  // algo final: timed, or autotuning off, or a single candidate
  std::shared_ptr<Descs> ds;  // kept per shape: only the pointers change per call
};

// Plan cache key: plain integers (no iostreams in this library: an
// ostringstream here crashed inside libstdc++ on the H200 image).
using Key = std::array<int64_t, 12>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ std::hash<int64_t>()(v)) * 1099511628211ull;
    return h;
  }
};

std::mutex g_mu;
std::unordered_map<Key, Plan, KeyHash> g_plans;
std::unordered_map<int, cublasLtHandle_t> g_handles;
// cuBLASLt workspace, one per (device, stream) and kept (as PyTorch does for
// its cuBLAS workspaces): no allocation per call. GEMMs on one stream run in
// order; another stream gets its own.
std::map<std::pair<int, cudaStream_t>, at::Tensor> g_workspaces;

void* lt_workspace(const at::Tensor& like, cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto key = std::make_pair((int)like.get_device(), stream);
  auto it = g_workspaces.find(key);
  if (it == g_workspaces.end())
    it = g_workspaces.emplace(key, at::empty({(long long)kWorkspaceBytes}, like.options().dtype(at::kByte))).first;
  return it->second.data_ptr();
}

// Our own cuBLASLt handle per device (created with the cuBLASLt this
// extension links), rather than torch's cuBLAS handle reinterpreted: the two
// libraries need not be the same build.
cublasLtHandle_t lt_handle(int device) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_handles.find(device);
  if (it != g_handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  TORCH_OPS_CUBLAS_CHECK(cublasLtCreate(&h));
  g_handles[device] = h;
  return h;
}

struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // usable heuristic results, in order; [0] is the top-1
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// This call's scale pointers (and the fused bias, where not null) on a
// descriptor shared by every call of its shape. cuBLASLt's A is our b and its
// B our a (the column-major view of our row-major operands).
void set_call_pointers(Descs& ds, const float* sa, const float* sb, const void* bias) {
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof(sb)));
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof(sa)));
  if (bias)
    TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
}

// `mode_a`, `mode_b`: cuBLASLt's scale modes of our a and our b (scalar for
// the per-tensor GEMM; VEC128 / BLK128x128 for the block-scaled one).
void make_descs(Descs& ds, cudaDataType_t ta, cudaDataType_t tb, cudaDataType_t td, long long M, long long N,
                long long K, long long lda, long long ldb, long long ldd, bool fast, const float* sa,
                const float* sb, const void* bias, cudaDataType_t tbias,
                int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
                int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  int8_t fa = fast ? 1 : 0;
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)));
  if (mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F || mode_b != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    // cuBLASLt's A is our b, its B our a.
    TORCH_OPS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_b, sizeof(mode_b)));
    TORCH_OPS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_a, sizeof(mode_a)));
  }
  if (bias) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
    TORCH_OPS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &tbias, sizeof(tbias)));
  }
  set_call_pointers(ds, sa, sb, bias);
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.a, ta, K, N, ldb));
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.b, tb, K, M, lda));
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.d, td, N, M, ldd));
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&ds.pref));
  size_t ws = kWorkspaceBytes;
  TORCH_OPS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &ws, sizeof(ws)));
}

// Switches this thread to relaxed stream-capture mode for its lifetime, so the
// event synchronization of the timing below is legal even while another
// thread captures a graph in global mode (PyTorch does the same around its
// allocations).
struct RelaxedCaptureMode {
  cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
  bool ok;
  RelaxedCaptureMode() { ok = cudaThreadExchangeStreamCaptureMode(&prev) == cudaSuccess; }
  ~RelaxedCaptureMode() {
    if (ok) cudaThreadExchangeStreamCaptureMode(&prev);
  }
};

// Mean milliseconds of one GEMM with `algo`: `warm` untimed launches, then
// `reps` launches between two events on `stream`. Negative when a launch or
// an event call failed (the error is cleared; the candidate is skipped).
float time_algo(cublasLtHandle_t h, Descs& ds, const cublasLtMatmulAlgo_t& algo, const void* A, const void* B,
                void* D, void* ws, cudaStream_t stream, cudaEvent_t e0, cudaEvent_t e1, int warm, int reps) {
  const float alpha = 1.0f, beta = 0.0f;
  auto launch = [&]() {
    return cublasLtMatmul(h, ds.op, &alpha, A, ds.a, B, ds.b, &beta, D, ds.d, D, ds.d, &algo, ws, kWorkspaceBytes,
                          stream) == CUBLAS_STATUS_SUCCESS &&
           cudaPeekAtLastError() == cudaSuccess;
  };
  bool ok = true;
  for (int i = 0; i < warm && ok; ++i) ok = launch();
  ok = ok && cudaEventRecord(e0, stream) == cudaSuccess;
  for (int i = 0; i < reps && ok; ++i) ok = launch();
  ok = ok && cudaEventRecord(e1, stream) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess;
  float ms = -1.0f;
  ok = ok && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    cudaStreamSynchronize(stream);  // let anything already queued finish before the next candidate
    (void)cudaGetLastError();
    return -1.0f;
  }
  return ms / reps;
}

int algo_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;  // every attribute printed below is a 32-bit integer (or smaller)
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
  return (int)v;
}

uint16_t cluster_attr(const cublasLtMatmulAlgo_t& algo) {
  uint16_t v = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return 0xffff;
  return v;
}

// Variants of `base` (the same kernel family): CTA swizzling toggled, each
// custom option, a few cluster shapes; kept where cublasLtMatmulAlgoCheck
// accepts them for these descriptors within our workspace: the knobs
// cuBLASLt's heuristic leaves at one value across the configurations it
// returns for FP8 shapes.
std::vector<cublasLtMatmulAlgo_t> variants_of(cublasLtHandle_t h, const Descs& ds, const cublasLtMatmulAlgo_t& base) {
  std::vector<cublasLtMatmulAlgo_t> out;
  auto keep_if_valid = [&](const cublasLtMatmulAlgo_t& a) {
    cublasLtMatmulHeuristicResult_t r{};
    if (cublasLtMatmulAlgoCheck(h, ds.op, ds.a, ds.b, ds.d, ds.d, &a, &r) == CUBLAS_STATUS_SUCCESS &&
        r.state == CUBLAS_STATUS_SUCCESS && r.workspaceSize <= kWorkspaceBytes)
      out.push_back(a);
  };
  auto with = [&](cublasLtMatmulAlgoConfigAttributes_t attr, const void* v, size_t size) {
    cublasLtMatmulAlgo_t a = base;
    if (cublasLtMatmulAlgoConfigSetAttribute(&a, attr, v, size) == CUBLAS_STATUS_SUCCESS) keep_if_valid(a);
  };
  size_t written = 0;
  uint32_t swizzle_ok = 0;
  const int swizzle = algo_attr(base, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swizzle_ok,
                                        sizeof(swizzle_ok), &written) == CUBLAS_STATUS_SUCCESS &&
      swizzle_ok && swizzle >= 0) {
    const uint32_t v = swizzle ? 0u : 1u;
    with(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &v, sizeof(v));
  }
  int32_t custom_max = 0;
  const int custom = algo_attr(base, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max, sizeof(custom_max),
                                        &written) == CUBLAS_STATUS_SUCCESS)
    for (uint32_t v = 0; v <= (uint32_t)std::min(custom_max, 7); ++v)
      if ((int)v != custom) with(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &v, sizeof(v));
  const uint16_t cluster = cluster_attr(base);
  for (uint16_t v : {(uint16_t)CUBLASLT_CLUSTER_SHAPE_1x1x1, (uint16_t)CUBLASLT_CLUSTER_SHAPE_2x1x1,
                     (uint16_t)CUBLASLT_CLUSTER_SHAPE_1x2x1, (uint16_t)CUBLASLT_CLUSTER_SHAPE_2x2x1,
                     (uint16_t)CUBLASLT_CLUSTER_SHAPE_4x1x1, (uint16_t)CUBLASLT_CLUSTER_SHAPE_1x4x1})
    if (v != cluster) with(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &v, sizeof(v));
  return out;
}

// Times the plan's candidates on this call's operands (D = the call's out) and
// keeps the fastest in p.algo. Two rounds: every candidate once (1 warm-up, 3
// timed), then the 4 fastest plus the top-1, interleaved, 3 x 2 timed runs
// each, so that clock drift does not favour one. The top-1 stays unless
// another is faster by more than 0.5%. Synchronizes the stream: never call
// under graph capture.
void tune_plan(Plan& p, cublasLtHandle_t h, const void* A, const void* B, void* D, void* ws, cudaStream_t stream) {
  p.tuned = true;  // whatever happens below, tune once
  std::vector<cublasLtMatmulAlgo_t> c = p.ds->candidates;
  const int n_heuristic = (int)c.size();
  RelaxedCaptureMode relaxed;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
    (void)cudaGetLastError();
    if (e0) cudaEventDestroy(e0);
    return;
  }
  std::vector<float> t1(n_heuristic, -1.0f);
  for (int i = 0; i < n_heuristic; ++i) t1[i] = time_algo(h, *p.ds, c[i], A, B, D, ws, stream, e0, e1, 1, 3);
  {
    // Variants of the top-1 and of the fastest heuristic candidate.
    int fastest = 0;
    for (int i = 1; i < n_heuristic; ++i)
      if (t1[i] >= 0 && (t1[fastest] < 0 || t1[i] < t1[fastest])) fastest = i;
    std::vector<int> bases = {0};
    if (fastest != 0) bases.push_back(fastest);
    for (int base : bases)
      for (const auto& v : variants_of(h, *p.ds, c[base])) {
        c.push_back(v);
        t1.push_back(time_algo(h, *p.ds, v, A, B, D, ws, stream, e0, e1, 1, 3));
      }
  }
  const int n = (int)c.size();
  std::vector<int> fin;
  if (t1[0] >= 0) fin.push_back(0);
  {
    std::vector<int> order;
    for (int i = 1; i < n; ++i)
      if (t1[i] >= 0) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](int x, int y) { return t1[x] < t1[y]; });
    for (size_t j = 0; j < order.size() && j < 4; ++j) fin.push_back(order[j]);
  }
  std::vector<float> t2(n, 0.0f);
  for (int r = 0; r < 3; ++r)
    for (int i : fin) {
      if (t2[i] < 0) continue;
      const float t = time_algo(h, *p.ds, c[i], A, B, D, ws, stream, e0, e1, 0, 2);
      t2[i] = t < 0 ? -1.0f : t2[i] + t / 3;
    }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  int best = -1;
  for (int i : fin)
    if (t2[i] > 0 && (best < 0 || t2[i] < t2[best])) best = i;
  if (best < 0) return;  // nothing timed: keep the top-1
  if (best != 0 && t2[0] > 0 && t2[0] <= t2[best] * 1.005f) best = 0;
  p.algo = c[best];
}

// The bias in the dtype the epilogue takes (the output's; float32 for a
// float32 output), after checking its shape.
c10::optional<at::Tensor> checked_bias(const c10::optional<at::Tensor>& bias, long long N, at::ScalarType od) {
  if (!bias.has_value() || !bias->defined()) return c10::nullopt;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias: expected shape (", std::to_string(N), ",), got ",
              shape_str(*bias));
  return bias->to(od == at::kFloat ? at::kFloat : od).contiguous();
}

// The (M, N) product when M, N or K is 0: the bias broadcast (or empty).
at::Tensor empty_product(const at::Tensor& a, long long M, long long N, const c10::optional<at::Tensor>& bias,
                         at::ScalarType od) {
  if (M == 0 || N == 0) return at::empty({M, N}, a.options().dtype(od));
  at::Tensor z = at::zeros({M, N}, a.options().dtype(at::kFloat));
  if (bias) z = z + bias->to(at::kFloat);
  return z.to(od);
}

at::Tensor fallback_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                         const c10::optional<at::Tensor>& bias, at::ScalarType od) {
  // Correct for any shape/dtype, slow: float32 products of the fp8 values.
  at::Tensor acc = at::matmul(a.to(at::kFloat), b.to(at::kFloat).t());
  acc = acc * (sa.reshape({}) * sb.reshape({}));
  if (bias.has_value() && bias->defined()) acc = acc + bias->to(at::kFloat);
  return acc.to(od);
}

}  // namespace

// True when `stream` is capturing a CUDA graph (or its state cannot be read:
// then callers behave as under capture: no timing, no eager-only work).
bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
}

at::Tensor fp8_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& scale_a,
                    const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias_in, at::ScalarType od,
                    bool fast_accum, bool autotune) {
  TORCH_CHECK(a_in.dim() == 2, "a: expected a 2-D fp8 tensor (M, K), got shape ", shape_str(a_in));
  TORCH_CHECK(b_in.dim() == 2, "b: expected a 2-D fp8 tensor (N, K), got shape ", shape_str(b_in));
  TORCH_CHECK(a_in.size(1) == b_in.size(1), "a, b: K mismatch: a is ", shape_str(a_in), ", b is ", shape_str(b_in));
  TORCH_CHECK(a_in.is_cuda() && b_in.is_cuda(), "a, b: expected CUDA tensors");
  TORCH_CHECK(scale_a.is_cuda() && scale_a.scalar_type() == at::kFloat && scale_a.numel() == 1,
              "scale_a: expected a 1-element float32 CUDA tensor");
  TORCH_CHECK(scale_b.is_cuda() && scale_b.scalar_type() == at::kFloat && scale_b.numel() == 1,
              "scale_b: expected a 1-element float32 CUDA tensor");
  const cudaDataType_t ta = fp8_type(b_in, "b"), tb = fp8_type(a_in, "a");
  TORCH_CHECK(!(ta == CUDA_R_8F_E5M2 && tb == CUDA_R_8F_E5M2), "a, b: E5M2 x E5M2 is not supported by cuBLASLt");
  const cudaDataType_t td = out_type(od);
  const DeviceScope device_scope(a_in);

  const long long M = a_in.size(0), N = b_in.size(0), K = a_in.size(1);
  const c10::optional<at::Tensor> bias = checked_bias(bias_in, N, od);
  if (M == 0 || N == 0 || K == 0) return empty_product(a_in, M, N, bias, od);
  const long long Kp = round16(K);
  at::Tensor a = prepare_operand(a_in, Kp);
  at::Tensor b = prepare_operand(b_in, Kp);
  const long long lda = a.stride(0), ldb = b.stride(0);
  const long long Np = round16(N);
  at::Tensor out = at::empty({M, Np}, a.options().dtype(od));
  const long long ldd = Np;

  const float* sa = scale_a.data_ptr<float>();
  const float* sb = scale_b.data_ptr<float>();
  // FP8 bias epilogue: bias in the output's 16-bit type; for float32 output we
  // add it afterwards (one small pass) instead of relying on a combination
  // some cuBLASLt versions reject.
  const bool want_bias_fused = bias.has_value() && od != at::kFloat;
  const cudaDataType_t tbias = od == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;

  const Key key = {(int64_t)a.get_device(), M, N, Kp, lda, ldb, ldd, (int64_t)ta, (int64_t)tb, (int64_t)td,
                   (int64_t)want_bias_fused, (int64_t)fast_accum};
  cublasLtHandle_t handle = lt_handle(a.get_device());

  Plan plan;
  bool have = false;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      plan = it->second;
      have = true;
    }
  }
  if (!have) {
    const int want = autotune ? kMaxCandidates : 1;
    for (int attempt = 0; attempt < 2 && !have; ++attempt) {
      const bool fused = want_bias_fused && attempt == 0;
      if (attempt == 1 && !want_bias_fused) break;
      auto ds = std::make_shared<Descs>();
      make_descs(*ds, ta, tb, td, M, N, Kp, lda, ldb, ldd, fast_accum, sa, sb, fused ? bias->data_ptr() : nullptr,
                 tbias);
      cublasLtMatmulHeuristicResult_t res[kMaxCandidates];
      int count = 0;
      cublasStatus_t st =
          cublasLtMatmulAlgoGetHeuristic(handle, ds->op, ds->a, ds->b, ds->d, ds->d, ds->pref, want, res, &count);
      if (st != CUBLAS_STATUS_SUCCESS) continue;
      for (int i = 0; i < count; ++i)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= kWorkspaceBytes)
          ds->candidates.push_back(res[i].algo);
      if (!ds->candidates.empty()) {
        plan.algo = ds->candidates[0];
        plan.bias_fused = fused;
        plan.tuned = ds->candidates.size() == 1;
        plan.ds = ds;
        have = true;
      }
    }
    if (!have) {
      // No cuBLASLt FP8 kernel for this combination on this GPU: stay correct.
      return fallback_gemm(a_in, b_in, scale_a, scale_b, bias, od);
    }
    std::lock_guard<std::mutex> lk(g_mu);
    plan = g_plans.emplace(key, plan).first->second;  // another thread may have made it first
  }

  const float alpha = 1.0f, beta = 0.0f;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  void* ws = lt_workspace(a, stream);
  // Not tuned yet: time the candidates now unless the stream is capturing a
  // graph (then this call, and the graph, use the top-1; a later call outside
  // capture tunes the plan).
  const bool tune_now = !plan.tuned && !stream_capturing(stream);
  {
    // The cached descriptor is shared by every call of this shape: set this
    // call's scale and bias pointers and enqueue under the lock.
    std::lock_guard<std::mutex> lk(g_mu);
    // plan.ds is the map's descriptor (a shared_ptr copy). This call's
    // pointers first: a tuning call times the candidates on the real operands.
    set_call_pointers(*plan.ds, sa, sb, plan.bias_fused ? bias->data_ptr() : nullptr);
    if (tune_now) {
      Plan& p = g_plans[key];  // references into an unordered_map stay valid
      if (!p.tuned) tune_plan(p, handle, b.data_ptr(), a.data_ptr(), out.data_ptr(), ws, stream);
      plan = p;  // the same descriptor, now with the chosen algorithm
    }
    Descs& ds = *plan.ds;
    TORCH_OPS_CUBLAS_CHECK(cublasLtMatmul(handle, ds.op, &alpha, b.data_ptr(), ds.a, a.data_ptr(), ds.b, &beta,
                                          out.data_ptr(), ds.d, out.data_ptr(), ds.d, &plan.algo, ws,
                                          kWorkspaceBytes, stream));
  }
  if (Np != N) out = out.narrow(1, 0, N).contiguous();
  if (bias.has_value() && !plan.bias_fused) out.add_(bias->to(od));
  return out;
}

// ---------------------------------------------------------------------------
// Block-scaled FP8 GEMM (recipes.BlockScaling; sm_90, cuBLASLt 12.9+):
// out (M, N) = a @ b^T, a (M, K) in 1 x 128 tiles along K (VEC128 scales),
// b (N, K) in 1 x 128 tiles (VEC128) or 128 x 128 blocks (BLK128x128). Each
// 128-long stretch of K is multiplied by its two scales inside the kernel
// (float32 accumulation; no fast accumulation in these modes). Scale
// layouts cuBLASLt reads: VEC128, for each K tile the rows' scales side by
// side, the row count padded to a multiple of 4; BLK128x128, for each block
// row its K blocks side by side, padded to a multiple of 4.
namespace {

long long round4(long long v) { return (v + 3) / 4 * 4; }

// (rows, tiles) tile scales as cuBLASLt's VEC128 storage: tiles x round4(rows)
// float32 (what csrc/block.cu writes: then no copy).
at::Tensor vec128_scales(const at::Tensor& s, long long rows, long long tiles, const char* name) {
  TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kFloat && s.dim() == 2 && s.size(0) == rows &&
                  s.size(1) == tiles,
              name, ": expected float32 CUDA scales of shape (", std::to_string(rows), ", ", std::to_string(tiles),
              "), got ", shape_str(s));
  const long long ld = round4(rows);
  if (s.stride(0) == 1 && s.stride(1) == ld && (reinterpret_cast<uintptr_t>(s.data_ptr()) & 15) == 0) return s;
  at::Tensor out = at::ones({tiles, ld}, s.options());
  out.narrow(1, 0, rows).copy_(s.t());
  return out.narrow(1, 0, rows).t();
}

// (block rows, K blocks) block scales as cuBLASLt's BLK128x128 storage.
at::Tensor blk128_scales(const at::Tensor& s, long long rows, long long blocks, const char* name) {
  TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kFloat && s.dim() == 2 && s.size(0) == rows &&
                  s.size(1) == blocks,
              name, ": expected float32 CUDA scales of shape (", std::to_string(rows), ", ",
              std::to_string(blocks), "), got ", shape_str(s));
  const long long ld = round4(blocks);
  if (s.stride(1) == 1 && s.stride(0) == ld && (reinterpret_cast<uintptr_t>(s.data_ptr()) & 15) == 0) return s;
  at::Tensor out = at::ones({rows, ld}, s.options());
  out.narrow(1, 0, blocks).copy_(s);
  return out.narrow(1, 0, blocks);
}

using BlockKey = std::array<int64_t, 10>;
struct BlockPlan {
  cublasLtMatmulAlgo_t algo;
  bool bias_fused;
  bool pad_rows;  // M and N padded to multiples of 128 (some shapes need it)
  std::shared_ptr<Descs> ds;
};
std::map<BlockKey, BlockPlan> g_block_plans;
std::map<BlockKey, bool> g_block_unsupported;

long long round128(long long v) { return (v + 127) / 128 * 128; }

// `t` (rows, K) with zero rows appended up to `rows`.
at::Tensor pad_rows_to(const at::Tensor& t, long long rows) {
  if (t.size(0) == rows) return t;
  at::Tensor u = at::constant_pad_nd(t.view(at::kByte), {0, 0, 0, rows - t.size(0)}, 0);
  return u.view(t.scalar_type());
}

}  // namespace

at::Tensor block_gemm(const at::Tensor& a_in, const at::Tensor& a_scales, const at::Tensor& b_in,
                      const at::Tensor& b_scales, bool b_tiles, const c10::optional<at::Tensor>& bias_in,
                      at::ScalarType od) {
  TORCH_CHECK(a_in.dim() == 2, "a: expected a 2-D fp8 tensor (M, K), got shape ", shape_str(a_in));
  TORCH_CHECK(b_in.dim() == 2, "b: expected a 2-D fp8 tensor (N, K), got shape ", shape_str(b_in));
  TORCH_CHECK(a_in.size(1) == b_in.size(1), "a, b: K mismatch: a is ", shape_str(a_in), ", b is ", shape_str(b_in));
  TORCH_CHECK(a_in.is_cuda() && b_in.is_cuda(), "a, b: expected CUDA tensors");
  const cudaDataType_t ta = fp8_type(b_in, "b"), tb = fp8_type(a_in, "a");
  TORCH_CHECK(!(ta == CUDA_R_8F_E5M2 && tb == CUDA_R_8F_E5M2), "a, b: E5M2 x E5M2 is not supported by cuBLASLt");
  const cudaDataType_t td = out_type(od);
  const DeviceScope device_scope(a_in);
  const long long M = a_in.size(0), N = b_in.size(0), K = a_in.size(1);
  const long long kt = (K + 127) / 128;
  // Validated in the layout given (a view where csrc/block.cu wrote them).
  at::Tensor sa = vec128_scales(a_scales, M, kt, "a_scales");
  at::Tensor sb = b_tiles ? vec128_scales(b_scales, N, kt, "b_scales")
                          : blk128_scales(b_scales, (N + 127) / 128, kt, "b_scales");
  const c10::optional<at::Tensor> bias = checked_bias(bias_in, N, od);
  if (M == 0 || N == 0 || K == 0) return empty_product(a_in, M, N, bias, od);
  // cuBLASLt's block-scaled kernels take K in whole 128-long tiles: a ragged
  // K is zero padded (zeros add nothing; the tile count is unchanged).
  const long long Kp = kt * 128;
  const bool want_bias_fused = bias.has_value() && od != at::kFloat;
  const cudaDataType_t tbias = od == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  const at::Tensor a0 = prepare_operand(a_in, Kp), b0 = prepare_operand(b_in, Kp);
  const BlockKey key = {(int64_t)a_in.get_device(), M, N, Kp, a0.stride(0), b0.stride(0), (int64_t)ta, (int64_t)tb,
                        (int64_t)td, (int64_t)want_bias_fused * 2 + (int64_t)b_tiles};
  const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t mode_b =
      b_tiles ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  cublasLtHandle_t handle = lt_handle(a_in.get_device());
  BlockPlan plan;
  bool have = false;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_block_unsupported.count(key)) return at::Tensor();
    auto it = g_block_plans.find(key);
    if (it != g_block_plans.end()) {
      plan = it->second;
      have = true;
    }
  }
  // The operands as this plan lays them out (padded rows where it needs them).
  auto operands = [&](bool pad, at::Tensor& a, at::Tensor& b, at::Tensor& sa_p, at::Tensor& sb_p, long long& Mp,
                      long long& Nr) {
    Mp = pad ? round128(M) : M;
    Nr = pad ? round128(N) : N;
    a = pad_rows_to(a0, Mp);
    b = pad_rows_to(b0, Nr);
    sa_p = Mp == M ? sa : vec128_scales(at::constant_pad_nd(a_scales, {0, 0, 0, Mp - M}, 1.0), Mp, kt, "a_scales");
    sb_p = sb;
    if (b_tiles && Nr != N)
      sb_p = vec128_scales(at::constant_pad_nd(b_scales, {0, 0, 0, Nr - N}, 1.0), Nr, kt, "b_scales");
  };
  at::Tensor a, b, sa_p, sb_p;
  long long Mp = M, Nr = N;
  if (!have) {
    for (int pad = 0; pad < 2 && !have; ++pad) {
      operands(pad == 1, a, b, sa_p, sb_p, Mp, Nr);
      for (int attempt = 0; attempt < 2 && !have; ++attempt) {
        const bool fused = want_bias_fused && attempt == 0;
        if (attempt == 1 && !want_bias_fused) break;
        auto ds = std::make_shared<Descs>();
        make_descs(*ds, ta, tb, td, Mp, Nr, Kp, a.stride(0), b.stride(0), round16(Nr), false, sa_p.data_ptr<float>(),
                   sb_p.data_ptr<float>(), fused ? bias->data_ptr() : nullptr, tbias, mode_a, mode_b);
        cublasLtMatmulHeuristicResult_t res{};
        int count = 0;
        if (cublasLtMatmulAlgoGetHeuristic(handle, ds->op, ds->a, ds->b, ds->d, ds->d, ds->pref, 1, &res, &count) !=
                CUBLAS_STATUS_SUCCESS ||
            count < 1 || res.state != CUBLAS_STATUS_SUCCESS || res.workspaceSize > kWorkspaceBytes)
          continue;
        plan.algo = res.algo;
        plan.bias_fused = fused;
        plan.pad_rows = pad == 1;
        plan.ds = ds;
        have = true;
      }
    }
    std::lock_guard<std::mutex> lk(g_mu);
    if (!have) {
      // No block-scaled kernel for this combination here: the caller runs
      // the reference (torch_ops/ops.py warns once).
      g_block_unsupported[key] = true;
      return at::Tensor();
    }
    plan = g_block_plans.emplace(key, plan).first->second;
  } else {
    operands(plan.pad_rows, a, b, sa_p, sb_p, Mp, Nr);
  }
  // Without a fused bias the GEMM writes float32 and the bias is added
  // before the one rounding to the output dtype.
  if (bias.has_value() && !plan.bias_fused && od != at::kFloat) {
    at::Tensor acc = block_gemm(a_in, a_scales, b_in, b_scales, b_tiles, c10::nullopt, at::kFloat);
    if (!acc.defined()) return acc;
    return (acc + bias->to(at::kFloat)).to(od);
  }
  const long long ldd = round16(Nr);
  at::Tensor out = at::empty({Mp, ldd}, a.options().dtype(od));
  const float alpha = 1.0f, beta = 0.0f;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  void* ws = lt_workspace(a, stream);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    Descs& ds = *plan.ds;
    set_call_pointers(ds, sa_p.data_ptr<float>(), sb_p.data_ptr<float>(),
                      plan.bias_fused ? bias->data_ptr() : nullptr);
    TORCH_OPS_CUBLAS_CHECK(cublasLtMatmul(handle, ds.op, &alpha, b.data_ptr(), ds.a, a.data_ptr(), ds.b, &beta,
                                          out.data_ptr(), ds.d, out.data_ptr(), ds.d, &plan.algo, ws,
                                          kWorkspaceBytes, stream));
  }
  if (Mp != M || ldd != N) out = out.narrow(0, 0, M).narrow(1, 0, N).contiguous();
  if (bias.has_value() && !plan.bias_fused) out.add_(bias->to(od));
  return out;
}

}  // namespace torch_ops
