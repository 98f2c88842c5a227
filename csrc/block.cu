// torch_ops's block-scaling quantize (block_kernels.cuh has the kernels):
// PyTorch's checks, allocation, device and stream around their launches.
// Tile scales are returned as a (rows, tiles) strided view of the storage
// cuBLASLt's VEC128 mode reads (block_kernels.cuh).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.h"
#include "fp8_kernels.h"

namespace torch_ops {
namespace {

using fp8_kernels::block_scaling::kTile;
using fp8_kernels::block_scaling::quantize_blocks_kernel;
using fp8_kernels::block_scaling::quantize_tile_columns_kernel;
using fp8_kernels::block_scaling::quantize_tile_rows_kernel;

template <typename Fn>
void dispatch_input(const at::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kBFloat16: fn((const __nv_bfloat16*)x.data_ptr()); break;
    case at::kHalf: fn((const __half*)x.data_ptr()); break;
    case at::kFloat: fn((const float*)x.data_ptr()); break;
    default: TORCH_CHECK(false, "x: expected bfloat16, float16 or float32, got ", x.scalar_type());
  }
}

void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, ": expected a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, name, ": expected a 2-D tensor, got shape ", shape_str(x));
  TORCH_CHECK(x.is_contiguous(), name, ": expected a contiguous tensor");
}

long long round4(long long v) { return (v + 3) / 4 * 4; }

at::ScalarType fp8_of(int fmt) { return fmt == kE5M2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; }
float fmax_of(int fmt) { return (float)(fmt == kE5M2 ? kE5M2Max : kE4M3Max); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_tiles(const at::Tensor& x, int64_t fmt, bool transposed, double mult,
                                                  bool power_of_two) {
  check_input(x, "x");
  const DeviceScope device_scope(x);
  const long long R = x.size(0), C = x.size(1);
  const auto q_options = x.options().dtype(fp8_of((int)fmt));
  const auto f_options = x.options().dtype(at::kFloat);
  const float inv_max = 1.0f / fmax_of((int)fmt);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor q, scales;
  if (!transposed) {
    const long long tiles_c = (C + kTile - 1) / kTile;
    q = at::empty({R, C}, q_options);
    const long long ld = round4(R);
    scales = at::empty({tiles_c, ld}, f_options).narrow(1, 0, R).t();
    const long long warps = R * tiles_c;
    if (warps == 0) return {q, scales};
    const unsigned blocks = (unsigned)((warps + 7) / 8);
    dispatch_input(x, [&](auto* xp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      auto kernel = fmt == kE5M2 ? quantize_tile_rows_kernel<T, true> : quantize_tile_rows_kernel<T, false>;
      kernel<<<blocks, 256, 0, stream>>>(xp, R, C, tiles_c, reinterpret_cast<uint8_t*>(q.data_ptr()),
                                         scales.data_ptr<float>(), ld, inv_max, (float)mult, power_of_two ? 1 : 0);
    });
  } else {
    const long long tiles_r = (R + kTile - 1) / kTile;
    q = at::empty({C, R}, q_options);
    const long long ld = round4(C);
    scales = at::empty({tiles_r, ld}, f_options).narrow(1, 0, C).t();
    if (R == 0 || C == 0) return {q, scales};
    const dim3 grid((unsigned)((C + 31) / 32), (unsigned)tiles_r);
    dispatch_input(x, [&](auto* xp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      auto kernel = fmt == kE5M2 ? quantize_tile_columns_kernel<T, true> : quantize_tile_columns_kernel<T, false>;
      kernel<<<grid, 256, 0, stream>>>(xp, R, C, tiles_r, reinterpret_cast<uint8_t*>(q.data_ptr()),
                                       scales.data_ptr<float>(), ld, inv_max, (float)mult, power_of_two ? 1 : 0);
    });
  }
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
  return {q, scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& w, int64_t fmt, double mult,
                                                               bool power_of_two) {
  check_input(w, "w");
  const DeviceScope device_scope(w);
  const long long R = w.size(0), C = w.size(1);
  const long long blocks_r = (R + kTile - 1) / kTile, blocks_c = (C + kTile - 1) / kTile;
  const auto q_options = w.options().dtype(fp8_of((int)fmt));
  at::Tensor q = at::empty({R, C}, q_options), qt = at::empty({C, R}, q_options);
  at::Tensor scales = at::empty({blocks_r, blocks_c}, w.options().dtype(at::kFloat));
  if (R == 0 || C == 0) return {q, qt, scales};
  const float inv_max = 1.0f / fmax_of((int)fmt);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((unsigned)blocks_c, (unsigned)blocks_r);
  dispatch_input(w, [&](auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    auto kernel = fmt == kE5M2 ? quantize_blocks_kernel<T, true> : quantize_blocks_kernel<T, false>;
    kernel<<<grid, 256, 0, stream>>>(wp, R, C, blocks_c, reinterpret_cast<uint8_t*>(q.data_ptr()),
                                     reinterpret_cast<uint8_t*>(qt.data_ptr()), scales.data_ptr<float>(), inv_max,
                                     (float)mult, power_of_two ? 1 : 0);
  });
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
  return {q, qt, scales};
}

}  // namespace torch_ops
