// torch_ops's fused FP8 quantize (quantize_kernels.cuh) as an XLA FFI custom
// call, for keras_fp8's JAX backend (keras_fp8/backends/jax_gemm.py builds it
// with nvcc, loads and registers it). One read of x writes q, its transpose
// q_t, the amax, and the scale the call used: the byte-exact rule of
// docs/design.md (numerics), the same kernels as the torch backend.
//
// Operands: x (R, C) bfloat16, float16 or float32, row-major;
//   scale_in: float32, one element (mode 0: the scale; 1: the state's scale;
//     2: the fallback where the amax is not usable);
//   history: float32 (H,), mode 1's empty check (another mode ignores it).
// Results: q (R, C) and q_t (C, R) in float8_e4m3fn or float8_e5m2 (the
//   format), amax and scale_used (float32, one element each).
// Attributes: scale_mode (int32: 0 given scale, 1 delayed, 2 current) and
//   mdiv (float32: the margin's factor 2**margin).
// Nothing is recorded: the state update stays with the caller (keras_fp8's
// numerics), which reads amax.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "fp8_kernels.h"
#include "jax_ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using keras_fp8_ffi::dims_str;

namespace {

// The amax reductions' workspace for (device, stream): allocated and zeroed
// (on that stream, so before any kernel of it) at the first use, kept for the
// process; every launch leaves it zero again, and launches on one stream run
// in order.
unsigned* stream_workspace(int device, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, unsigned*> table;
  std::lock_guard<std::mutex> lock(mu);
  unsigned*& ws = table[std::make_pair(device, stream)];
  if (ws == nullptr) {
    void* p = nullptr;
    FP8_KERNELS_CUDA_CHECK(cudaMalloc(&p, fp8_kernels::kWsWords * sizeof(unsigned)));
    FP8_KERNELS_CUDA_CHECK(cudaMemsetAsync(p, 0, fp8_kernels::kWsWords * sizeof(unsigned), stream));
    ws = static_cast<unsigned*>(p);
  }
  return ws;
}

ffi::Error QuantizeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale_in,
                        ffi::Buffer<ffi::F32> history, ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale_used, int32_t scale_mode, float mdiv) {
  fp8_kernels::QuantizeCall c;
  switch (x.element_type()) {
    case ffi::DataType::BF16: c.x_type = fp8_kernels::InType::kBF16; break;
    case ffi::DataType::F16: c.x_type = fp8_kernels::InType::kF16; break;
    case ffi::DataType::F32: c.x_type = fp8_kernels::InType::kF32; break;
    default: return ffi::Error::InvalidArgument("x: expected bfloat16, float16 or float32");
  }
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x: expected a 2-D (R, C) array, got " + dims_str(x));
  const long long R = xd[0], C = xd[1];
  if (q->element_type() == ffi::DataType::F8E4M3FN) {
    c.fmt = fp8_kernels::kE4M3;
  } else if (q->element_type() == ffi::DataType::F8E5M2) {
    c.fmt = fp8_kernels::kE5M2;
  } else {
    return ffi::Error::InvalidArgument("q: expected float8_e4m3fn or float8_e5m2");
  }
  const auto qd = q->dimensions(), qtd = q_t->dimensions();
  if (qd.size() != 2 || qd[0] != R || qd[1] != C || qtd.size() != 2 || qtd[0] != C || qtd[1] != R ||
      q_t->element_type() != q->element_type())
    return ffi::Error::InvalidArgument("q, q_t: expected (R, C) and (C, R) of one FP8 type for x " + dims_str(x) +
                                       ", got " + dims_str(*q) + " and " + dims_str(*q_t));
  if (scale_mode < 0 || scale_mode > 2)
    return ffi::Error::InvalidArgument("scale_mode: expected 0, 1 or 2, got " + std::to_string(scale_mode));
  if (scale_in.element_count() != 1 || amax->element_count() != 1 || scale_used->element_count() != 1)
    return ffi::Error::InvalidArgument("scale_in, amax, scale_used: expected one float32 element each");
  if (scale_mode == 1 && history.element_count() == 0)
    return ffi::Error::InvalidArgument("history: expected at least one element for delayed scaling");
  try {
    int current = -1;
    FP8_KERNELS_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) FP8_KERNELS_CUDA_CHECK(cudaSetDevice(device));
    float* used = scale_used->typed_data();
    if (scale_mode == 0 || R * C == 0) {
      // The given scale is the one used; an empty x has no usable amax, so
      // every mode keeps scale_in (numerics' compute_scale).
      FP8_KERNELS_CUDA_CHECK(
          cudaMemcpyAsync(used, scale_in.typed_data(), sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    if (R * C == 0) {
      FP8_KERNELS_CUDA_CHECK(cudaMemsetAsync(amax->typed_data(), 0, sizeof(float), stream));
      return ffi::Error::Success();
    }
    c.x = x.untyped_data();
    c.R = R;
    c.C = C;
    c.scale_mode = scale_mode;
    c.scale_in = scale_in.typed_data();
    c.scale_used = used;
    c.amax_out = amax->typed_data();
    c.hist_for_empty = scale_mode == 1 ? history.typed_data() : nullptr;
    c.hist_for_empty_n = scale_mode == 1 ? (long long)history.element_count() : 0;
    c.q = static_cast<uint8_t*>(q->untyped_data());
    c.ldq = C;
    c.qt = static_cast<uint8_t*>(q_t->untyped_data());
    c.ldqt = R;
    c.mdiv = mdiv;
    c.device = device;
    c.stream = stream;
    c.workspace = stream_workspace(device, stream);
    fp8_kernels::quantize_run(c);
  } catch (const fp8_kernels::CudaError& e) {
    return ffi::Error::Internal(e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KerasFp8Quantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale_in
                                  .Arg<ffi::Buffer<ffi::F32>>()    // history
                                  .Ret<ffi::AnyBuffer>()           // q
                                  .Ret<ffi::AnyBuffer>()           // q_t
                                  .Ret<ffi::Buffer<ffi::F32>>()    // amax
                                  .Ret<ffi::Buffer<ffi::F32>>()    // scale_used
                                  .Attr<int32_t>("scale_mode")
                                  .Attr<float>("mdiv"));
