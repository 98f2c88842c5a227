#pragma once
// Block-scaling quantize kernels, with no framework in them: a scale per
// 1 x 128 tile (activations, output gradients) or per 128 x 128 block
// (weights), from the tile's own values. torch_ops/reference.py
// (block_scale, quantize_tiles, quantize_blocks) is the reference, byte for
// byte; the block-scaled GEMMs themselves are cuBLASLt's.
//
//   quantize_tile_rows_kernel     x (R, C) -> q (R, C), scales (R, ceil(C/128)):
//                                 one warp per 1 x 128 tile of a row; 256
//                                 threads a block, ceil(R * ceil(C/128) / 8)
//                                 blocks;
//   quantize_tile_columns_kernel  x (R, C) -> q_t (C, R), scales (C, ceil(R/128)):
//                                 the tiles of x's columns, written transposed
//                                 (the layout the weight-gradient GEMM reads),
//                                 through a shared-memory slab of 128 rows x
//                                 32 columns; grid (ceil(C/32), ceil(R/128)),
//                                 256 threads;
//   quantize_blocks_kernel        w (R, C) -> q (R, C), q_t (C, R), scales
//                                 (ceil(R/128), ceil(C/128)): one CTA of 256
//                                 threads per block, grid (blocks_c, blocks_r).
// Tile scales are stored the way cuBLASLt's VEC128 mode reads them: for
// each tile index, the rows' scales side by side, rows padded to a multiple
// of 4 (16 bytes; `ld` the padded row count). Ragged edges: elements past R
// or C are neither read nor written. `inv_max` is 1 / the format's maximum,
// `mult` the margin's factor 2**margin.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.h"

// Their own namespace: the helpers below are named as the quantize kernels' are.
namespace fp8_kernels::block_scaling {
namespace {


constexpr int kTile = 128;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// |v|'s bits: for non-negative floats the unsigned order is the float order,
// and NaN's bits win over inf's (as torch.amax propagates NaN).
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ unsigned warp_max(unsigned v) { return __reduce_max_sync(0xffffffffu, v); }

// torch_ops/reference.py's block_scale.
__device__ __forceinline__ float block_scale(float amax, float inv_max, float mult, int power_of_two) {
  if (!(isfinite(amax) && amax > 0.0f)) return 1.0f;
  float s = fmaxf(amax * inv_max, kMinScale) * mult;
  if (power_of_two) {
    int e = 0;
    const float m = frexpf(s, &e);  // s = m * 2**e, m in [0.5, 1)
    if (m == 0.5f) e -= 1;
    s = ldexpf(1.0f, min(e, 127));
  }
  return s;
}

// One FP8 byte of v with the reciprocal inv; a non-finite v becomes NaN
// (quantize.cu's q2, for one value).
template <bool kE5M2>
__device__ __forceinline__ uint8_t q1(float v, float inv) {
  const float y = isinf(v) ? __int_as_float(0x7fffffff) : v * inv;
  return (uint8_t)(__nv_cvt_float2_to_fp8x2(make_float2(y, 0.0f), __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3) &
                   0xff);
}

template <typename T, bool kE5M2>
__global__ void quantize_tile_rows_kernel(const T* __restrict__ x, long long R, long long C, long long tiles_c,
                                          uint8_t* __restrict__ q, float* __restrict__ scales, long long ld_scales,
                                          float inv_max, float mult, int power_of_two) {
  const int lane = threadIdx.x & 31;
  const long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tile >= R * tiles_c) return;  // whole warps leave together
  const long long r = tile / tiles_c, t = tile % tiles_c;
  float v[4];
  unsigned m = 0u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const long long c = t * kTile + lane * 4 + j;
    v[j] = c < C ? to_float(x[r * C + c]) : 0.0f;
    m = max(m, abs_bits(v[j]));
  }
  const float scale = block_scale(__uint_as_float(warp_max(m)), inv_max, mult, power_of_two);
  const float inv = 1.0f / scale;  // reciprocal: docs/numerics.md
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const long long c = t * kTile + lane * 4 + j;
    if (c < C) q[r * C + c] = q1<kE5M2>(v[j], inv);
  }
  if (lane == 0) scales[t * ld_scales + r] = scale;
}

// A CTA of 256 threads takes rows r0 .. r0 + 127 (one tile of each column)
// and columns c0 .. c0 + 31.
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(256) quantize_tile_columns_kernel(const T* __restrict__ x, long long R, long long C,
                                                                    long long tiles_r, uint8_t* __restrict__ qt,
                                                                    float* __restrict__ scales, long long ld_scales,
                                                                    float inv_max, float mult, int power_of_two) {
  __shared__ float slab[32][kTile + 1];  // [column][row]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long c0 = (long long)blockIdx.x * 32, r0 = (long long)blockIdx.y * kTile;
  for (int i = warp; i < kTile; i += 8) {
    const long long r = r0 + i, c = c0 + lane;
    slab[lane][i] = (r < R && c < C) ? to_float(x[r * C + c]) : 0.0f;
  }
  __syncthreads();
  for (int k = 0; k < 4; ++k) {
    const int cc = warp * 4 + k;
    const long long c = c0 + cc;
    float v[4];
    unsigned m = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = slab[cc][lane * 4 + j];
      m = max(m, abs_bits(v[j]));
    }
    const float scale = block_scale(__uint_as_float(warp_max(m)), inv_max, mult, power_of_two);
    const float inv = 1.0f / scale;
    if (c < C) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long r = r0 + lane * 4 + j;
        if (r < R) qt[c * R + r] = q1<kE5M2>(v[j], inv);
      }
      if (lane == 0) scales[blockIdx.y * ld_scales + c] = scale;
    }
  }
}

// One CTA (256 threads) per 128 x 128 block: the block's amax, then its
// bytes, row-major into q and, through shared memory, transposed into q_t.
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(256) quantize_blocks_kernel(const T* __restrict__ w, long long R, long long C,
                                                              long long blocks_c, uint8_t* __restrict__ q,
                                                              uint8_t* __restrict__ qt, float* __restrict__ scales,
                                                              float inv_max, float mult, int power_of_two) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // [column][row]
  __shared__ unsigned warp_maxima[8];
  __shared__ float block_scale_value;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long r0 = (long long)blockIdx.y * kTile, c0 = (long long)blockIdx.x * kTile;
  // Thread layout over the block: 128 columns as 32 lanes x 4, rows by warp.
  unsigned m = 0u;
  for (int i = warp; i < kTile; i += 8) {
    const long long r = r0 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long c = c0 + lane * 4 + j;
      if (r < R && c < C) m = max(m, abs_bits(to_float(w[r * C + c])));
    }
  }
  m = warp_max(m);
  if (lane == 0) warp_maxima[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = 0u;
    for (int k = 0; k < 8; ++k) b = max(b, warp_maxima[k]);
    block_scale_value = block_scale(__uint_as_float(b), inv_max, mult, power_of_two);
    scales[blockIdx.y * blocks_c + blockIdx.x] = block_scale_value;
  }
  __syncthreads();
  const float inv = 1.0f / block_scale_value;
  for (int i = warp; i < kTile; i += 8) {
    const long long r = r0 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int cc = lane * 4 + j;
      const long long c = c0 + cc;
      uint8_t b = 0;
      if (r < R && c < C) {
        b = q1<kE5M2>(to_float(w[r * C + c]), inv);
        q[r * C + c] = b;
      }
      tile[cc][i] = b;
    }
  }
  __syncthreads();
  for (int cc = warp; cc < kTile; cc += 8) {
    const long long c = c0 + cc;
    if (c >= C) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane * 4 + j;
      const long long r = r0 + i;
      if (r < R) qt[c * R + r] = tile[cc][i];
    }
  }
}

}  // namespace
}  // namespace fp8_kernels::block_scaling
