#pragma once
// The per-tensor-scaled FP8 GEMM through cuBLASLt, with no framework in it:
// descriptors, the plan cache (the heuristic's candidates and, with
// autotuning, the fastest of them timed on the first call's operands) and
// the launch. Both callers run their GEMMs through `scaled_gemm`:
// gemm.cpp (torch_ops, tensors from PyTorch's allocator) and jax_ffi.cpp
// (keras_fp8's JAX backend, buffers from XLA). docs/design.md, "Execution
// paths".
//
// out (M, N) = (a @ b^T) * scale_a * scale_b (+ bias), a (M, K) and b (N, K)
// fp8 with K contiguous ("TN", the only layout cuBLASLt takes for FP8 on
// Hopper). Scales are device pointers: nothing reads a value on the host,
// so a launch is CUDA-graph safe.
//
// Column-major view: row-major out (M, N) is column-major D (N x M), and
// D = op(A) op(B) with A = b stored (K x N) col-major, op T, and B = a
// stored (K x M) col-major, op N.
//
// Autotuning: on the first call of a plan key we ask cuBLASLt for up to
// kMaxCandidates heuristic algorithms and time each on the call's own
// operands (into the call's `out`, which the real GEMM then overwrites),
// and variants of the top-1 and of the fastest candidate (CTA swizzling,
// custom options, cluster shapes: variants_of), keeping the fastest.
// Without it the heuristic's top-1 runs (what torch._scaled_mm does). A
// first call made while its stream captures a CUDA graph never times (no
// synchronization during capture): it uses the top-1 and the plan is tuned
// on the next call outside capture.
//
// Errors throw fp8_kernels::cublaslt::Error (a std::runtime_error); callers turn it into
// their framework's error.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace fp8_kernels::cublaslt {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int kMaxCandidates = 16;

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void check(cublasStatus_t status, const char* what, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLASLt error in ") + what + ": status " + std::to_string((int)status) +
                " (lt_gemm.h:" + std::to_string(line) + ")");
}
#define CUBLASLT_CHECK(expr) ::fp8_kernels::cublaslt::check((expr), #expr, __LINE__)

// One lock for the plan caches and the descriptors they share.
inline std::mutex& lock() {
  static std::mutex mu;
  return mu;
}

// Our own cuBLASLt handle per device (created with the cuBLASLt this
// library links), rather than a framework's handle reinterpreted: the two
// libraries need not be the same build.
inline cublasLtHandle_t handle(int device) {
  static std::unordered_map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lk(lock());
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  CUBLASLT_CHECK(cublasLtCreate(&h));
  handles[device] = h;
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
inline void set_call_pointers(Descs& ds, const float* sa, const float* sb, const void* bias) {
  CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof(sb)));
  CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof(sa)));
  if (bias) CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
}

// `ta`, `tb`: the types of our b and our a (cuBLASLt's A and B). `mode_a`,
// `mode_b`: cuBLASLt's scale modes of our a and our b (scalar for the
// per-tensor GEMM; VEC128 / BLK128x128 for the block-scaled one).
inline void make_descs(Descs& ds, cudaDataType_t ta, cudaDataType_t tb, cudaDataType_t td, long long M, long long N,
                       long long K, long long lda, long long ldb, long long ldd, bool fast, const float* sa,
                       const float* sb, const void* bias, cudaDataType_t tbias,
                       int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
                       int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
  CUBLASLT_CHECK(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  int8_t fa = fast ? 1 : 0;
  CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)));
  if (mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F || mode_b != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
    // cuBLASLt's A is our b, its B our a.
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_b, sizeof(mode_b)));
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_a, sizeof(mode_a)));
  }
  if (bias) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &tbias, sizeof(tbias)));
  }
  set_call_pointers(ds, sa, sb, bias);
  CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&ds.a, ta, K, N, ldb));
  CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&ds.b, tb, K, M, lda));
  CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&ds.d, td, N, M, ldd));
  CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&ds.pref));
  size_t ws = kWorkspaceBytes;
  CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                   sizeof(ws)));
}

// True when `stream` is capturing a CUDA graph (or its state cannot be read:
// then callers behave as under capture: no timing, no eager-only work).
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
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
inline float time_algo(cublasLtHandle_t h, Descs& ds, const cublasLtMatmulAlgo_t& algo, const void* A, const void* B,
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

inline int algo_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;  // every attribute read here is a 32-bit integer (or smaller)
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
  return (int)v;
}

inline uint16_t cluster_attr(const cublasLtMatmulAlgo_t& algo) {
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
inline std::vector<cublasLtMatmulAlgo_t> variants_of(cublasLtHandle_t h, const Descs& ds,
                                                     const cublasLtMatmulAlgo_t& base) {
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

struct Plan {
  cublasLtMatmulAlgo_t algo;  // heuristic top-1 until tuned
  bool bias_fused;
  bool tuned;  // algo final: timed, or autotuning off, or a single candidate
  std::shared_ptr<Descs> ds;  // kept per shape: only the pointers change per call
};

// Times the plan's candidates on this call's operands (D = the call's out) and
// keeps the fastest in p.algo. Two rounds: every candidate once (1 warm-up, 3
// timed), then the 4 fastest plus the top-1, interleaved, 3 x 2 timed runs
// each, so that clock drift does not favour one. The top-1 stays unless
// another is faster by more than 0.5%. Synchronizes the stream: never call
// under graph capture.
inline void tune_plan(Plan& p, cublasLtHandle_t h, const void* A, const void* B, void* D, void* ws,
                      cudaStream_t stream) {
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

// One per-tensor-scaled GEMM. Operands as cuBLASLt takes them: `a` (M, K)
// and `b` (N, K) row-major with row strides `lda`, `ldb` (elements, and
// bytes: fp8) multiples of 16, K a multiple of 16, 16-byte aligned bases;
// `out` (M, N) with row stride `ldd`, 16-byte aligned. `bias` (N,) in
// `bias_type` (the output's 16-bit type) or null: then no bias epilogue is
// asked for. `workspace`: kWorkspaceBytes, used by this stream only.
struct GemmCall {
  int device = 0;
  cudaStream_t stream = nullptr;
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  void* workspace = nullptr;
  cudaDataType_t a_type = CUDA_R_8F_E4M3, b_type = CUDA_R_8F_E4M3, out_type = CUDA_R_16BF;
  long long M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldd = 0;
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  const void* bias = nullptr;
  cudaDataType_t bias_type = CUDA_R_16BF;
  bool fast_accum = false;
  bool autotune = false;
};

// What `scaled_gemm` did.
enum class GemmStatus {
  kDone,           // out holds the product (with the bias, where one was given)
  kBiasNotAdded,   // out holds the product; the bias epilogue was refused: the caller adds it
  kNoKernel,       // no cuBLASLt FP8 kernel for this combination on this GPU: nothing launched
};

// Plan cache key: plain integers. No iostreams in this library: a key built
// with std::ostringstream depends on the libstdc++ the host process loaded,
// which need not be the one the extension was built against.
using Key = std::array<int64_t, 12>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ std::hash<int64_t>()(v)) * 1099511628211ull;
    return h;
  }
};

// Enqueues `call` on its stream (see GemmCall); the plan of its key is made
// on the key's first call and, with `autotune`, tuned on the first call
// outside graph capture.
inline GemmStatus scaled_gemm(const GemmCall& call) {
  static std::unordered_map<Key, Plan, KeyHash> plans;
  const bool want_bias_fused = call.bias != nullptr;
  const Key key = {(int64_t)call.device, call.M, call.N, call.K, call.lda, call.ldb, call.ldd, (int64_t)call.b_type,
                   (int64_t)call.a_type, (int64_t)call.out_type, (int64_t)want_bias_fused, (int64_t)call.fast_accum};
  cublasLtHandle_t h = handle(call.device);
  Plan plan;
  bool have = false;
  {
    std::lock_guard<std::mutex> lk(lock());
    auto it = plans.find(key);
    if (it != plans.end()) {
      plan = it->second;
      have = true;
    }
  }
  if (!have) {
    const int want = call.autotune ? kMaxCandidates : 1;
    for (int attempt = 0; attempt < 2 && !have; ++attempt) {
      const bool fused = want_bias_fused && attempt == 0;
      if (attempt == 1 && !want_bias_fused) break;
      auto ds = std::make_shared<Descs>();
      make_descs(*ds, call.b_type, call.a_type, call.out_type, call.M, call.N, call.K, call.lda, call.ldb, call.ldd,
                 call.fast_accum, call.scale_a, call.scale_b, fused ? call.bias : nullptr, call.bias_type);
      cublasLtMatmulHeuristicResult_t res[kMaxCandidates];
      int count = 0;
      if (cublasLtMatmulAlgoGetHeuristic(h, ds->op, ds->a, ds->b, ds->d, ds->d, ds->pref, want, res, &count) !=
          CUBLAS_STATUS_SUCCESS)
        continue;
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
    if (!have) return GemmStatus::kNoKernel;
    std::lock_guard<std::mutex> lk(lock());
    plan = plans.emplace(key, plan).first->second;  // another thread may have made it first
  }

  const float alpha = 1.0f, beta = 0.0f;
  // Not tuned yet: time the candidates now unless the stream is capturing a
  // graph (then this call, and the graph, use the top-1; a later call outside
  // capture tunes the plan).
  const bool tune_now = !plan.tuned && !stream_capturing(call.stream);
  {
    // The cached descriptor is shared by every call of this shape: set this
    // call's scale and bias pointers and enqueue under the lock. This call's
    // pointers first: a tuning call times the candidates on the real operands.
    std::lock_guard<std::mutex> lk(lock());
    set_call_pointers(*plan.ds, call.scale_a, call.scale_b, plan.bias_fused ? call.bias : nullptr);
    if (tune_now) {
      Plan& p = plans[key];  // references into an unordered_map stay valid
      if (!p.tuned) tune_plan(p, h, call.b, call.a, call.out, call.workspace, call.stream);
      plan = p;  // the same descriptor, now with the chosen algorithm
    }
    Descs& ds = *plan.ds;
    CUBLASLT_CHECK(cublasLtMatmul(h, ds.op, &alpha, call.b, ds.a, call.a, ds.b, &beta, call.out, ds.d, call.out, ds.d,
                               &plan.algo, call.workspace, kWorkspaceBytes, call.stream));
  }
  return want_bias_fused && !plan.bias_fused ? GemmStatus::kBiasNotAdded : GemmStatus::kDone;
}

}  // namespace fp8_kernels::cublaslt
