// The per-tensor-scaled FP8 GEMM as an XLA FFI custom call, for keras_fp8's
// JAX backend (keras_fp8/backends/jax_gemm.py builds, loads and registers
// it). The launch is lt_gemm.h's `scaled_gemm`, the one torch_ops runs:
// the scales and the bias go into cuBLASLt's epilogue, so the product is
// rounded once to the output dtype (XLA's own FP8 dot writes its output
// dtype and the scale is a second pass).
//
// Operands (all row-major, as XLA lays them out by default):
//   a (M, K) and b (N, K): float8_e4m3fn or float8_e5m2 (not both E5M2),
//     K a multiple of 16;
//   scale_a, scale_b: float32 scalars (device memory);
//   bias: (N,) in the output dtype, read where has_bias is 1.
// Results: out (M, N) in bfloat16, float16 or float32 (N a multiple of 8),
// and a uint8 workspace of fp8_kernels::cublaslt::kWorkspaceBytes (XLA's buffer, so that
// its lifetime follows the stream).
// Attributes (int32): fast_accum, autotune, has_bias (0 or 1).

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fp8_kernels.h"
#include "jax_ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using keras_fp8_ffi::dims_str;

namespace {

bool fp8_data_type(ffi::DataType t, cudaDataType_t* out) {
  if (t == ffi::DataType::F8E4M3FN) {
    *out = CUDA_R_8F_E4M3;
    return true;
  }
  if (t == ffi::DataType::F8E5M2) {
    *out = CUDA_R_8F_E5M2;
    return true;
  }
  return false;
}

bool out_data_type(ffi::DataType t, cudaDataType_t* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return true;
    case ffi::DataType::F16: *out = CUDA_R_16F; return true;
    case ffi::DataType::F32: *out = CUDA_R_32F; return true;
    default: return false;
  }
}

ffi::Error ScaledGemmImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::F32> scale_a, ffi::Buffer<ffi::F32> scale_b, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                          int32_t fast_accum, int32_t autotune, int32_t has_bias) {
  fp8_kernels::cublaslt::GemmCall call;
  if (!fp8_data_type(a.element_type(), &call.a_type) || !fp8_data_type(b.element_type(), &call.b_type))
    return ffi::Error::InvalidArgument("a, b: expected float8_e4m3fn or float8_e5m2 operands");
  if (call.a_type == CUDA_R_8F_E5M2 && call.b_type == CUDA_R_8F_E5M2)
    return ffi::Error::InvalidArgument("a, b: E5M2 x E5M2 is not supported by cuBLASLt");
  if (!out_data_type(out->element_type(), &call.out_type))
    return ffi::Error::InvalidArgument("out: expected bfloat16, float16 or float32");
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1])
    return ffi::Error::InvalidArgument("a, b: expected (M, K) and (N, K), got " + dims_str(a) + " and " +
                                       dims_str(b));
  const long long M = ad[0], N = bd[0], K = ad[1];
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return ffi::Error::InvalidArgument("out: expected (" + std::to_string(M) + ", " + std::to_string(N) + "), got " +
                                       dims_str(*out));
  if (K % 16 != 0 || N % 8 != 0)
    return ffi::Error::InvalidArgument("a, b: expected K a multiple of 16 and N of 8, got K " + std::to_string(K) +
                                       ", N " + std::to_string(N));
  if (workspace->element_count() < fp8_kernels::cublaslt::kWorkspaceBytes)
    return ffi::Error::InvalidArgument("workspace: expected " + std::to_string(fp8_kernels::cublaslt::kWorkspaceBytes) + " bytes");
  if (has_bias && (bias.element_type() != out->element_type() || bias.element_count() != (size_t)N ||
                   out->element_type() == ffi::DataType::F32))
    return ffi::Error::InvalidArgument("bias: expected (" + std::to_string(N) +
                                       ",) in the 16-bit output dtype, got " + dims_str(bias));
  if (M == 0 || N == 0) return ffi::Error::Success();
  call.device = device;
  call.stream = stream;
  call.a = a.untyped_data();
  call.b = b.untyped_data();
  call.out = out->untyped_data();
  call.workspace = workspace->untyped_data();
  call.M = M;
  call.N = N;
  call.K = K;
  call.lda = K;
  call.ldb = K;
  call.ldd = N;
  call.scale_a = scale_a.typed_data();
  call.scale_b = scale_b.typed_data();
  call.bias = has_bias ? bias.untyped_data() : nullptr;
  call.bias_type = out->element_type() == ffi::DataType::F16 ? CUDA_R_16F : CUDA_R_16BF;
  call.fast_accum = fast_accum != 0;
  call.autotune = autotune != 0;
  try {
    switch (fp8_kernels::cublaslt::scaled_gemm(call)) {
      case fp8_kernels::cublaslt::GemmStatus::kDone: return ffi::Error::Success();
      // The Python side asks for the epilogue only where the per-tensor
      // GEMM takes it (a 16-bit output); a refusal is an error, not a
      // silently missing bias.
      case fp8_kernels::cublaslt::GemmStatus::kBiasNotAdded:
        return ffi::Error::Internal("cuBLASLt refused the bias epilogue for this FP8 GEMM");
      case fp8_kernels::cublaslt::GemmStatus::kNoKernel:
        return ffi::Error::Internal("cuBLASLt has no FP8 kernel for this GEMM on this GPU");
    }
  } catch (const fp8_kernels::cublaslt::Error& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasFp8ScaledGemm, ScaledGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()           // a
                                  .Arg<ffi::AnyBuffer>()           // b
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale_a
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale_b
                                  .Arg<ffi::AnyBuffer>()           // bias
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Ret<ffi::Buffer<ffi::U8>>()     // workspace
                                  .Attr<int32_t>("fast_accum")
                                  .Attr<int32_t>("autotune")
                                  .Attr<int32_t>("has_bias"));
