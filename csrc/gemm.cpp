// FP8 GEMMs through cuBLASLt for torch_ops: the per-tensor-scaled GEMM
// (`fp8_gemm`: PyTorch's checks, operand padding and allocation around
// lt_gemm.h's `scaled_gemm`, the one launch path it shares with the JAX
// backend's custom call) and the block-scaled GEMM (`block_gemm`).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "common.h"
#include "fp8_kernels.h"

namespace torch_ops {
namespace {

using fp8_kernels::cublaslt::kWorkspaceBytes;

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

// cuBLASLt workspace, one per (device, stream) and kept (as PyTorch does for
// its cuBLAS workspaces): no allocation per call. GEMMs on one stream run in
// order; another stream gets its own.
std::mutex g_workspace_mu;
std::map<std::pair<int, cudaStream_t>, at::Tensor> g_workspaces;

void* lt_workspace(const at::Tensor& like, cudaStream_t stream) {
  std::lock_guard<std::mutex> lk(g_workspace_mu);
  auto key = std::make_pair((int)like.get_device(), stream);
  auto it = g_workspaces.find(key);
  if (it == g_workspaces.end())
    it = g_workspaces.emplace(key, at::empty({(long long)kWorkspaceBytes}, like.options().dtype(at::kByte))).first;
  return it->second.data_ptr();
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

  // FP8 bias epilogue: bias in the output's 16-bit type; for float32 output we
  // add it afterwards (one small pass) instead of relying on a combination
  // some cuBLASLt versions reject.
  const bool want_bias_fused = bias.has_value() && od != at::kFloat;
  fp8_kernels::cublaslt::GemmCall call;
  call.device = (int)a.get_device();
  call.stream = c10::cuda::getCurrentCUDAStream();
  call.a = a.data_ptr();
  call.b = b.data_ptr();
  call.out = out.data_ptr();
  call.workspace = lt_workspace(a, call.stream);
  call.a_type = tb;
  call.b_type = ta;
  call.out_type = td;
  call.M = M;
  call.N = N;
  call.K = Kp;
  call.lda = lda;
  call.ldb = ldb;
  call.ldd = ldd;
  call.scale_a = scale_a.data_ptr<float>();
  call.scale_b = scale_b.data_ptr<float>();
  call.bias = want_bias_fused ? bias->data_ptr() : nullptr;
  call.bias_type = od == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  call.fast_accum = fast_accum;
  call.autotune = autotune;
  fp8_kernels::cublaslt::GemmStatus status = fp8_kernels::cublaslt::GemmStatus::kNoKernel;
  try {
    status = fp8_kernels::cublaslt::scaled_gemm(call);
  } catch (const fp8_kernels::cublaslt::Error& e) {
    TORCH_CHECK(false, "torch_ops: ", e.what());
  }
  // No cuBLASLt FP8 kernel for this combination on this GPU: stay correct.
  if (status == fp8_kernels::cublaslt::GemmStatus::kNoKernel) return fallback_gemm(a_in, b_in, scale_a, scale_b, bias, od);
  if (Np != N) out = out.narrow(1, 0, N).contiguous();
  const bool bias_added = want_bias_fused && status == fp8_kernels::cublaslt::GemmStatus::kDone;
  if (bias.has_value() && !bias_added) out.add_(bias->to(od));
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
  std::shared_ptr<fp8_kernels::cublaslt::Descs> ds;
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
  cublasLtHandle_t handle = fp8_kernels::cublaslt::handle(a_in.get_device());
  BlockPlan plan;
  bool have = false;
  {
    std::lock_guard<std::mutex> lk(fp8_kernels::cublaslt::lock());
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
        auto ds = std::make_shared<fp8_kernels::cublaslt::Descs>();
        fp8_kernels::cublaslt::make_descs(*ds, ta, tb, td, Mp, Nr, Kp, a.stride(0), b.stride(0), round16(Nr), false, sa_p.data_ptr<float>(),
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
    std::lock_guard<std::mutex> lk(fp8_kernels::cublaslt::lock());
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
    std::lock_guard<std::mutex> lk(fp8_kernels::cublaslt::lock());
    fp8_kernels::cublaslt::Descs& ds = *plan.ds;
    fp8_kernels::cublaslt::set_call_pointers(ds, sa_p.data_ptr<float>(), sb_p.data_ptr<float>(),
                      plan.bias_fused ? bias->data_ptr() : nullptr);
    CUBLASLT_CHECK(cublasLtMatmul(handle, ds.op, &alpha, b.data_ptr(), ds.a, a.data_ptr(), ds.b, &beta, out.data_ptr(),
                               ds.d, out.data_ptr(), ds.d, &plan.algo, ws, kWorkspaceBytes, stream));
  }
  if (Mp != M || ldd != N) out = out.narrow(0, 0, M).narrow(1, 0, N).contiguous();
  if (bias.has_value() && !plan.bias_fused) out.add_(bias->to(od));
  return out;
}

}  // namespace torch_ops
