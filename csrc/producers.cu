// Fused producers: the op before an FP8 linear writes its output in the
// compute dtype and, in the same pass, the output's FP8 copy (the GEMM-ready
// row layout) and its amax, for the linear that reads it
// (docs/numerics.md, "Fused producers"; docs/design.md).
//
//   scaled rows   y = round((float(x) * row_mul[r]) * w[c])       a norm's last step
//   gated         y = round(float(up) * float(round(act(gate))))  SwiGLU, GeGLU; GELU without up
//   both          q = quantize(float(y), scale), amax = max|float(y)|
//
// Numerics: torch_ops/reference.py (scaled_rows, gated, producer_quantize),
// byte for byte: each product is its own float32 rounding (__fmul_rn: never
// contracted into a fused multiply-add), the rounding to the output dtype is
// round-to-nearest-even, and q is quantize_kernels.cuh's quantize of the
// rounded y. The activations are written as torch's CUDA kernels write them.
//
// The scale: given, or a linear's delayed-scaling state (history, scale).
// Then the scale a linear's own quantize would use is the state's, unless
// the history is empty (its first call), where it is seeded from this
// output's amax, which only the whole launch knows. The main kernel checks
// the history: not empty (every call after the first), it quantizes with
// the state's scale; empty, it writes y and the amax only, and the seed
// kernel after it quantizes y with the seeded scale. Otherwise the seed
// kernel only reads the history and exits. No host synchronization.
//
// One row per block iteration (grid-stride over rows), eight columns per
// thread; the amax is an atomic max over the float bits of |y| (NaN's bits
// win over inf's), into a zeroed 0-d output.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "finalize.cuh"

namespace torch_ops {
namespace {

using fp8_kernels::abs_bits;
using fp8_kernels::block_reduce_max;
using fp8_kernels::compute_scale;
using fp8_kernels::kRedWords;

constexpr int kThreads = 256;
constexpr int kActIdentity = 0, kActSilu = 1, kActGeluTanh = 2, kActGelu = 3;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Rounds to T (round-to-nearest-even) and stores.
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// v rounded to T, read back as float32.
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  T t;
  put(&t, v);
  return to_f32(t);
}

// One element to one FP8 byte (quantize_kernels.cuh's rule: inf -> NaN,
// then the saturating RNE convert).
template <bool kE5M2>
__device__ __forceinline__ uint8_t q1(float v, float inv) {
  const float nan = __int_as_float(0x7fffffff);
  const float y = isinf(v) ? nan : v * inv;
  return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// The activations in float32, as torch's CUDA kernels compute them
// (ActivationSiluKernel.cu, ActivationGeluKernel.cu), so that the gated
// producer's round(act(gate)) is the bits F.silu / F.gelu give.
template <int kAct>
__device__ __forceinline__ float activate(float x) {
  if constexpr (kAct == kActSilu) {
    return x / (1.0f + ::expf(-x));
  } else if constexpr (kAct == kActGeluTanh) {
    constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * 0.5;
    constexpr float kKappa = 0.044715f;
    const float x_cube = x * x * x;
    const float inner = kBeta * (x + kKappa * x_cube);
    return 0.5f * x * (1.0f + ::tanhf(inner));
  } else if constexpr (kAct == kActGelu) {
    constexpr float kAlpha = M_SQRT1_2;
    return x * 0.5f * (1.0f + ::erff(x * kAlpha));
  } else {
    return x;
  }
}

// The value a producer writes at (r, c), before its rounding to the output.
template <typename T>
struct ScaledRows {
  const T* x;
  const float* row_mul;
  const float* w;
  __device__ __forceinline__ float operator()(long long r, long long c, long long C) const {
    return __fmul_rn(__fmul_rn(to_f32(x[r * C + c]), row_mul[r]), w[c]);
  }
};

template <typename T, int kAct>
struct Gated {
  const T* gate;
  const T* up;  // null: act(gate) alone
  __device__ __forceinline__ float operator()(long long r, long long c, long long C) const {
    const float a = rounded<T>(activate<kAct>(to_f32(gate[r * C + c])));
    return up ? __fmul_rn(to_f32(up[r * C + c]), a) : a;
  }
};

// Whether the delayed-scaling history is empty (every entry +-0), for the
// whole block; no history: false (a given scale).
__device__ __forceinline__ bool history_empty(const float* history, long long H, unsigned* smem) {
  if (!history) return false;
  unsigned m = 0u;
  for (long long i = threadIdx.x; i < H; i += blockDim.x) m |= abs_bits(history[i]) ? 1u : 0u;
  return block_reduce_max(m, smem) == 0u;
}

// y, and q where the scale is known (a given scale, or a history that is not
// empty); the amax always; q's padding columns [C, ldq) always zero.
template <typename O, bool kE5M2, typename F>
__global__ void __launch_bounds__(kThreads) producer_kernel(F f, long long R, long long C, O* __restrict__ y,
                                                             uint8_t* __restrict__ q, long long ldq,
                                                             const float* history, long long H, const float* scale_in,
                                                             float* scale_used, unsigned* amax_bits) {
  __shared__ unsigned smem[kRedWords];
  const bool quantize = !history_empty(history, H, smem);
  const float inv = quantize ? 1.0f / *scale_in : 0.f;  // reciprocal: docs/numerics.md
  if (quantize && blockIdx.x == 0 && threadIdx.x == 0) *scale_used = *scale_in;
  unsigned local = 0u;
  for (long long r = blockIdx.x; r < R; r += gridDim.x) {
    for (long long c0 = 8LL * threadIdx.x; c0 < C; c0 += 8LL * blockDim.x) {
      uint8_t b[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const long long c = c0 + i;
        if (c < C) {
          O t;
          put(&t, f(r, c, C));
          y[r * C + c] = t;
          const float v = to_f32(t);
          local = max(local, abs_bits(v));
          b[i] = quantize ? q1<kE5M2>(v, inv) : 0;
        }
      }
      if (quantize) {
        if (c0 + 8 <= C && (ldq & 7) == 0) {
          uint2 o;
          o.x = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned)b[3] << 24);
          o.y = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned)b[7] << 24);
          *reinterpret_cast<uint2*>(q + r * ldq + c0) = o;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (c0 + i < C) q[r * ldq + c0 + i] = b[i];
        }
      }
    }
    for (long long c = C + threadIdx.x; c < ldq; c += blockDim.x) q[r * ldq + c] = 0;
  }
  const unsigned bm = block_reduce_max(local, smem);
  if (threadIdx.x == 0 && bm) atomicMax(amax_bits, bm);
}

// After producer_kernel, with a history: exits unless the history is empty;
// then quantizes y with the scale seeded from the launch's amax.
template <typename O, bool kE5M2>
__global__ void __launch_bounds__(kThreads) producer_seed_kernel(const O* __restrict__ y, long long R, long long C,
                                                                  uint8_t* __restrict__ q, long long ldq,
                                                                  const float* history, long long H,
                                                                  const float* scale_in, float* scale_used,
                                                                  const unsigned* amax_bits, float fmax, float mdiv) {
  __shared__ unsigned smem[kRedWords];
  if (!history_empty(history, H, smem)) return;
  const float s = compute_scale(__uint_as_float(*amax_bits), *scale_in, fmax, mdiv);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_used = s;
  const float inv = 1.0f / s;  // reciprocal: docs/numerics.md
  for (long long r = blockIdx.x; r < R; r += gridDim.x)
    for (long long c = threadIdx.x; c < C; c += blockDim.x) q[r * ldq + c] = q1<kE5M2>(to_f32(y[r * C + c]), inv);
}

long long round16(long long v) { return (v + 15) / 16 * 16; }

int sm_count(const at::Tensor& t) { return fp8_kernels::device_sm_count((int)t.get_device()); }

struct Outputs {
  at::Tensor y, q, scale_used, amax;
  long long ldq;
};

Outputs alloc(const at::Tensor& like, at::ScalarType out_dtype, int fmt, bool pad, const at::Tensor& scale) {
  const long long R = like.size(0), C = like.size(1);
  Outputs o;
  o.ldq = pad ? round16(C) : C;
  o.y = at::empty({R, C}, like.options().dtype(out_dtype));
  o.q = at::empty({R, o.ldq}, like.options().dtype(fmt == 1 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn));
  // Written by the kernels where a history is given; a copy of the given scale otherwise.
  o.scale_used = scale.reshape({}).clone();
  o.amax = at::zeros({}, like.options().dtype(at::kFloat));
  return o;
}

template <typename O, typename F>
void launch(const F& f, const at::Tensor& like, Outputs& o, int fmt, const c10::optional<at::Tensor>& history,
            const at::Tensor& scale, double mdiv) {
  const long long R = o.y.size(0), C = o.y.size(1);
  if (R == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = (unsigned)std::max<long long>(1, std::min<long long>(R, 8LL * sm_count(like)));
  const bool has_h = history.has_value() && history->defined();
  const float* h = has_h ? history->data_ptr<float>() : nullptr;
  const long long H = has_h ? history->numel() : 0;
  O* y = o.y.data_ptr<O>();
  auto* q = reinterpret_cast<uint8_t*>(o.q.data_ptr());
  auto* amax_bits = reinterpret_cast<unsigned*>(o.amax.data_ptr<float>());
  float* su = o.scale_used.data_ptr<float>();
  const float* sin = scale.data_ptr<float>();
  if (fmt == 1)
    producer_kernel<O, true><<<blocks, kThreads, 0, stream>>>(f, R, C, y, q, o.ldq, h, H, sin, su, amax_bits);
  else
    producer_kernel<O, false><<<blocks, kThreads, 0, stream>>>(f, R, C, y, q, o.ldq, h, H, sin, su, amax_bits);
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
  if (!has_h) return;
  const float fmax = (float)(fmt == 1 ? kE5M2Max : kE4M3Max);
  if (fmt == 1)
    producer_seed_kernel<O, true><<<blocks, kThreads, 0, stream>>>(y, R, C, q, o.ldq, h, H, sin, su, amax_bits,
                                                                   fmax, (float)mdiv);
  else
    producer_seed_kernel<O, false><<<blocks, kThreads, 0, stream>>>(y, R, C, q, o.ldq, h, H, sin, su, amax_bits,
                                                                    fmax, (float)mdiv);
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
}

// Calls fn with a null pointer of x's element type (bfloat16, float16, float32).
template <typename Fn>
void dispatch_float(at::ScalarType t, const char* name, Fn&& fn) {
  switch (t) {
    case at::kBFloat16: fn((__nv_bfloat16*)nullptr); break;
    case at::kHalf: fn((__half*)nullptr); break;
    case at::kFloat: fn((float*)nullptr); break;
    default: TORCH_CHECK(false, name, ": expected bfloat16, float16 or float32, got ", t);
  }
}

template <typename T>
T* typed(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack(const Outputs& o) {
  return {o.y, o.q, o.scale_used, o.amax};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> scaled_rows_quantize_launch(
    const at::Tensor& x, const at::Tensor& row_mul, const at::Tensor& weight, at::ScalarType out_dtype,
    const c10::optional<at::Tensor>& history, const at::Tensor& scale, int fmt, double mdiv, bool pad) {
  const DeviceScope device_scope(x);
  Outputs o = alloc(x, out_dtype, fmt, pad, scale);
  dispatch_float(x.scalar_type(), "x", [&](auto* xp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    ScaledRows<T> f{typed<T>(x), row_mul.data_ptr<float>(), weight.data_ptr<float>()};
    dispatch_float(out_dtype, "out_dtype", [&](auto* op) {
      using O = std::remove_pointer_t<decltype(op)>;
      launch<O>(f, x, o, fmt, history, scale, mdiv);
    });
  });
  return pack(o);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_quantize_launch(
    const at::Tensor& gate, const c10::optional<at::Tensor>& up, int activation,
    const c10::optional<at::Tensor>& history, const at::Tensor& scale, int fmt, double mdiv, bool pad) {
  const DeviceScope device_scope(gate);
  Outputs o = alloc(gate, gate.scalar_type(), fmt, pad, scale);
  const bool has_up = up.has_value() && up->defined();
  dispatch_float(gate.scalar_type(), "gate", [&](auto* gp) {
    using T = std::remove_pointer_t<decltype(gp)>;
    const T* upp = has_up ? typed<T>(*up) : nullptr;
    auto run = [&](auto act) {
      constexpr int kAct = decltype(act)::value;
      Gated<T, kAct> f{typed<T>(gate), upp};
      launch<T>(f, gate, o, fmt, history, scale, mdiv);
    };
    switch (activation) {
      case kActIdentity: run(std::integral_constant<int, kActIdentity>{}); break;
      case kActSilu: run(std::integral_constant<int, kActSilu>{}); break;
      case kActGeluTanh: run(std::integral_constant<int, kActGeluTanh>{}); break;
      case kActGelu: run(std::integral_constant<int, kActGelu>{}); break;
      default: TORCH_CHECK(false, "activation: expected an id from 0 to 3, got ", std::to_string(activation));
    }
  });
  return pack(o);
}

}  // namespace torch_ops
