// The fused FP8 quantize kernels and their launch on raw device pointers
// (quantize_run, record_amax_run: fp8_kernels.h), with no framework in them:
// torch_ops's extension (quantize.cu) and keras_fp8's JAX custom call
// (jax_quantize.cu) run them. One pass over x writes q and/or its transpose
// q_t, the amax, and (delayed scaling) the history shift and the next scale,
// which the launch's last block finalizes on the device (finalize.cuh).
//
// Numerics: torch_ops/reference.py, byte for byte (docs/numerics.md):
// q = cvt_rn_satfinite(float(x) * (1 / scale)) with an IEEE reciprocal (never
// build this file with --use_fast_math); NaN and +-inf quantize to NaN. The amax is a max over the float bits of |x| as unsigned integers:
// for non-negative floats that order is the float order, and NaN's bits
// (> 0x7f800000) win over inf's, so NaN and inf propagate with no special case.
//
// Which kernel runs (quantize_run):
//   quant_flat_kernel      no transpose and q unpadded (or the amax alone);
//   quant_lean_kernel,     rows and columns multiples of 64, outputs unpadded:
//   quant_lean_f32_kernel  a warp per 64 x 64 tile, registers only;
//   quant_tile3_kernel     other 16-bit x with 8-column vector access;
//   quant_tile2_kernel     any other shape and alignment;
//   amax_prepass_kernel    before the quantize where its scale needs this
//                          call's amax first (current scaling; delayed
//                          scaling outside the lean kernels, where it also
//                          settles the seed of an empty history).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "cuda_common.h"
#include "finalize.cuh"
#include "fold_block.cuh"

namespace fp8_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTileC = 128;   // input columns per tile of the two tile kernels

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Two floats -> two fp8 bytes (a in the low byte). `inv` is 1/scale, one IEEE
// division per thread: XLA turns x / scale into x * (1/scale), so the
// reference multiplies by the exact reciprocal too (docs/numerics.md).
// A non-finite input (+-inf; NaN is NaN anyway) becomes NaN before the
// saturating convert: inf must not saturate into a finite value.
template <bool kE5M2>
__device__ __forceinline__ unsigned short q2(float a, float b, float inv) {
  const float nan = __int_as_float(0x7fffffff);
  float2 v = make_float2(isinf(a) ? nan : a * inv, isinf(b) ? nan : b * inv);
  return __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// Two 16-bit elements packed in a word: to floats; the f32 bits of the larger
// of two packed |x| values.
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  static __device__ __forceinline__ float2 f32(unsigned w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ unsigned amax_bits(unsigned m2) { return max(m2 & 0xffffu, m2 >> 16) << 16; }
};
template <>
struct Pair<__half> {
  static __device__ __forceinline__ float2 f32(unsigned w) {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
  }
  static __device__ __forceinline__ unsigned amax_bits(unsigned m2) {
    const unsigned short b = (unsigned short)max(m2 & 0xffffu, m2 >> 16);
    return abs_bits(__half2float(__ushort_as_half(b)));
  }
};

// Load 8 consecutive elements as floats (16 bytes for bf16/fp16: one load;
// 32 bytes for fp32: two loads).
template <typename T>
struct Vec8 {
  static_assert(sizeof(T) == 2, "Vec8: 16-bit types here, float below");
  static __device__ __forceinline__ void load(const T* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = Pair<T>::f32(w[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};
template <>
struct Vec8<float> {
  static __device__ __forceinline__ void load(const float* p, float* f) {
    float4 a = reinterpret_cast<const float4*>(p)[0];
    float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
};

// Raw 8-element vector: kept packed in registers between the load and the
// convert (4 registers for 16-bit inputs instead of 8 floats).
template <typename T>
struct Raw8 {
  static constexpr int kWords = sizeof(T) * 8 / 16;
  union {
    uint4 u[kWords];
    T t[8];
  };
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int j = 0; j < kWords; ++j) u[j] = reinterpret_cast<const uint4*>(p)[j];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < kWords; ++j) u[j] = make_uint4(0u, 0u, 0u, 0u);
  }
  // Row r, columns c..c+7 of a row-major (R, C) tensor: one vector load where
  // the group lies inside and rows are 16-byte aligned (vec), else element
  // by element with zeros outside.
  __device__ __forceinline__ void load_guarded(const T* x, long long r, long long c, long long R, long long C,
                                               bool vec) {
    if (vec && r < R && c + 8 <= C) {
      load(x + r * C + c);
      return;
    }
    zero();
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (r < R && c + i < C) t[i] = x[r * C + c + i];
  }
};

// ---------------------------------------------------------------------------
// Pre-pass: amax only, then scale_used = compute_scale(amax, prev).
// Delayed mode: every block first checks whether the history is empty
// (max == 0); if not, the blocks exit at once and block 0 copies the state
// scale into scale_used.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_prepass_kernel(
    const T* __restrict__ x, long long n, bool vec, const float* history, long long H, bool delayed,
    const float* prev_scale, float* scale_used, unsigned* ws, float fmax, float mdiv) {
  __shared__ unsigned smem[kRedWords];
  pdl_launch_dependents();
  if (delayed) {
    unsigned m = 0u;
    for (long long i = threadIdx.x; i < H; i += blockDim.x) m = max(m, abs_bits(history[i]) ? 1u : 0u);
    // max(history) == 0 <=> every entry is +-0 (we only record >= 0 values;
    // a negative or NaN entry makes max != 0 too, so any nonzero bit pattern counts).
    m = block_reduce_max(m, smem);
    if (m) {
      if (blockIdx.x == 0 && threadIdx.x == 0) *scale_used = *prev_scale;
      return;
    }
  }
  unsigned local = 0u;
  const long long stride = (long long)gridDim.x * blockDim.x;
  if (vec) {
    const long long nv = n / 8;
    for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += stride) {
      float f[8];
      Vec8<T>::load(x + v * 8, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) local = max(local, abs_bits(f[i]));
    }
    for (long long i = nv * 8 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
      local = max(local, abs_bits(to_f32(x[i])));
  } else {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
      local = max(local, abs_bits(to_f32(x[i])));
  }
  unsigned bm = block_reduce_max(local, smem);
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    if (bm) atomicMax(&ws[0], bm);
    __threadfence();
    unsigned prev = atomicAdd(&ws[1], 1u);
    is_last = (prev == gridDim.x - 1);
  }
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    __threadfence();
    float a = __uint_as_float(atomicAdd(&ws[0], 0u));
    float prev = prev_scale ? *prev_scale : 1.0f;
    *scale_used = compute_scale(a, prev, fmax, mdiv);
    ws[0] = 0u;
    ws[1] = 0u;
  }
}

// ---------------------------------------------------------------------------
// Flat kernel: no transpose, no padding (q contiguous like x), q may be null
// (amax/history only).
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads) quant_flat_kernel(
    const T* __restrict__ x, long long n, bool vec, uint8_t* __restrict__ q, Finalize f) {
  __shared__ unsigned smem[kRedWords];
  const float s = 1.0f / *f.scale_used;  // reciprocal: docs/numerics.md
  unsigned local = 0u;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long start_scalar = 0;
  if (vec) {
    const long long nv = n / 8;
    // Two independent 16-byte loads in flight per thread per iteration.
    for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += 2 * stride) {
      float e[2][8];
      const bool second = v + stride < nv;
      Vec8<T>::load(x + v * 8, e[0]);
      if (second) Vec8<T>::load(x + (v + stride) * 8, e[1]);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (u == 1 && !second) break;
#pragma unroll
        for (int i = 0; i < 8; ++i) local = max(local, abs_bits(e[u][i]));
        if (q) {
          uint2 o;
          o.x = (unsigned)q2<kE5M2>(e[u][0], e[u][1], s) | ((unsigned)q2<kE5M2>(e[u][2], e[u][3], s) << 16);
          o.y = (unsigned)q2<kE5M2>(e[u][4], e[u][5], s) | ((unsigned)q2<kE5M2>(e[u][6], e[u][7], s) << 16);
          reinterpret_cast<uint2*>(q)[v + u * stride] = o;
        }
      }
    }
    start_scalar = nv * 8;
  }
  for (long long i = start_scalar + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float e = to_f32(x[i]);
    local = max(local, abs_bits(e));
    if (q) q[i] = (uint8_t)(q2<kE5M2>(e, 0.f, s) & 0xff);
  }
  unsigned bm = block_reduce_max(local, smem);
  block_done(bm, f, smem, gridDim.x);
}

// ---------------------------------------------------------------------------
// Tile kernel: q (R, ldq >= C) and/or qt (C, ldqt >= R), padding
// columns written as zero bytes, in tiles of 64 x 128 input elements,
// arranged for the transposed store. Each thread owns
// 4 consecutive rows x 8 columns: it turns its four 8-byte fp8 rows into
// eight 4-byte columns in registers (byte permutes), stores them as words
// into a column-major shared tile (128 rows of qt x 64 bytes, 16-byte chunks
// XOR-swizzled against bank conflicts), and the qt tile leaves as 16-byte
// chunks with 4 consecutive lanes per 64-byte row segment (coalesced).
__device__ __forceinline__ void transpose4x4(unsigned a, unsigned b, unsigned c, unsigned d, unsigned* w) {
  // a..d: 4 bytes (columns 0..3) of rows 0..3; w[i]: column i, row 0 in the low byte.
  const unsigned t0 = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
  const unsigned t1 = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
  const unsigned t2 = __byte_perm(c, d, 0x5140);  // c0 d0 c1 d1
  const unsigned t3 = __byte_perm(c, d, 0x7362);  // c2 d2 c3 d3
  w[0] = __byte_perm(t0, t2, 0x5410);  // a0 b0 c0 d0
  w[1] = __byte_perm(t0, t2, 0x7632);  // a1 b1 c1 d1
  w[2] = __byte_perm(t1, t3, 0x5410);
  w[3] = __byte_perm(t1, t3, 0x7632);
}

// One 64 x 128 tile of quant_tile2_kernel / quant_tile3_kernel after its
// loads: `raw` holds rows r0 + 4g .. r0 + 4g + 3, columns c0 + 8 lv .. + 7
// (zeros outside x). Quantizes, accumulates the amax bits into `local`,
// stores q and (through the shared tile) qt. Ends with a barrier when qt is
// written.
template <typename T, bool kE5M2>
__device__ __forceinline__ void quant_store_tile2(const Raw8<T>* raw, long long r0, long long c0, long long R,
                                                  long long C, uint8_t* __restrict__ q, long long ldq,
                                                  uint8_t* __restrict__ qt, long long ldqt, float s, int lv, int g,
                                                  unsigned& local, unsigned* tile_t) {
  constexpr int TR = 64;
  const long long c = c0 + lv * 8;
  uint2 o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const long long r = r0 + 4 * g + j;
    float e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = to_f32(raw[j].t[i]);
#pragma unroll
    for (int i = 0; i < 8; ++i) local = max(local, abs_bits(e[i]));
    o[j].x = (unsigned)q2<kE5M2>(e[0], e[1], s) | ((unsigned)q2<kE5M2>(e[2], e[3], s) << 16);
    o[j].y = (unsigned)q2<kE5M2>(e[4], e[5], s) | ((unsigned)q2<kE5M2>(e[6], e[7], s) << 16);
    // Elements outside x are padding: exact zero bytes, whatever the scale.
    if (!(r < R && c + 8 <= C)) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (!(r < R && c + i < C)) {
          if (i < 4) o[j].x &= ~(0xffu << (8 * i));
          else o[j].y &= ~(0xffu << (8 * (i - 4)));
        }
      }
    }
    if (q && r < R) {
      if (c + 8 <= ldq && (ldq & 7) == 0) {
        *reinterpret_cast<uint2*>(q + r * ldq + c) = o[j];
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (c + i < ldq) q[r * ldq + c + i] = (uint8_t)(((i < 4 ? o[j].x : o[j].y) >> (8 * (i & 3))) & 0xffu);
      }
    }
  }
  if (qt) {
    unsigned w[8];
    transpose4x4(o[0].x, o[1].x, o[2].x, o[3].x, w);
    transpose4x4(o[0].y, o[1].y, o[2].y, o[3].y, w + 4);
    const int k = g >> 2, jw = g & 3;  // chunk and word of rows 4g..4g+3
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int cc = lv * 8 + i;
      tile_t[cc * (TR / 4) + 4 * (k ^ ((cc >> 3) & 3)) + jw] = w[i];
    }
    __syncthreads();
    // kTileC rows x 4 chunks = 512 chunks, 2 per thread, 4 lanes per row.
#pragma unroll
    for (int it = 0; it < (kTileC * (TR / 16)) / kThreads; ++it) {
      const int slot = threadIdx.x + it * kThreads;
      const int cc = slot >> 2;                   // qt row within the tile
      const int kp = slot & 3;                    // chunk position in shared memory
      const int kl = kp ^ ((cc >> 3) & 3);        // logical chunk: x rows r0 + 16 kl ..
      const long long orow = c0 + cc;
      const long long ocol = r0 + 16 * kl;
      if (orow < C) {
        const uint4 v = *reinterpret_cast<const uint4*>(&tile_t[cc * (TR / 4) + 4 * kp]);
        if (ocol + 16 <= ldqt && (ldqt & 15) == 0) {
          *reinterpret_cast<uint4*>(qt + orow * ldqt + ocol) = v;
        } else {
          const unsigned wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int i = 0; i < 16; ++i)
            if (ocol + i < ldqt) qt[orow * ldqt + ocol + i] = (uint8_t)((wv[i >> 2] >> (8 * (i & 3))) & 0xffu);
        }
      }
    }
    __syncthreads();  // the next tile reuses the shared tile
  }
}

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 4) quant_tile2_kernel(
    const T* __restrict__ x, long long R, long long C, bool vec, uint8_t* __restrict__ q, long long ldq,
    uint8_t* __restrict__ qt, long long ldqt, long long ext_r, long long ext_c, Finalize f) {
  constexpr int TR = 64;
  __shared__ unsigned smem[kRedWords];
  // qt tile: kTileC rows of TR bytes = 16 words; chunk k (rows 16k..16k+15 of
  // x) of qt row cc sits at chunk position k ^ ((cc >> 3) & 3).
  __shared__ __align__(16) unsigned tile_t[kTileC * (TR / 4)];
  const float s = 1.0f / *f.scale_used;  // reciprocal: docs/numerics.md
  unsigned local = 0u;
  const int lv = threadIdx.x & 15;  // 8-column group of the tile
  const int g = threadIdx.x >> 4;   // 4-row group of the tile (0..15)
  const long long ntx = (ext_c + kTileC - 1) / kTileC;
  const long long ntiles = ntx * ((ext_r + TR - 1) / TR);
  for (long long tile_id = blockIdx.x; tile_id < ntiles; tile_id += gridDim.x) {
    const long long r0 = (tile_id / ntx) * TR;
    const long long c0 = (tile_id % ntx) * kTileC;
    const long long c = c0 + lv * 8;
    Raw8<T> raw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) raw[j].load_guarded(x, r0 + 4 * g + j, c, R, C, vec);
    quant_store_tile2<T, kE5M2>(raw, r0, c0, R, C, q, ldq, qt, ldqt, s, lv, g, local, tile_t);
  }  // tiles
  unsigned bm = block_reduce_max(local, smem);
  block_done(bm, f, smem, gridDim.x);
}

// 16-byte asynchronous global -> shared copy (zero-filled when !valid).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, bool valid) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------
// Double-buffered tile kernel (16-bit inputs with 8-column vector access):
// quant_tile2_kernel's tiles, outputs and shared-memory transpose, with the
// input tile brought in by cp.async into a double buffer, so that the next
// tile's 16 KB are in flight while this one is quantized and stored.
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 4) quant_tile3_kernel(
    const T* __restrict__ x, long long R, long long C, uint8_t* __restrict__ q, long long ldq,
    uint8_t* __restrict__ qt, long long ldqt, long long ext_r, long long ext_c, Finalize f) {
  static_assert(sizeof(T) == 2, "quant_tile3_kernel: 16-bit inputs");
  constexpr int TR = 64;
  constexpr int kRowBytes = kTileC * 2;            // 256
  constexpr int kChunksPerRow = kRowBytes / 16;    // 16
  constexpr int kChunks = TR * kChunksPerRow;      // 1024: 4 per thread
  __shared__ unsigned smem[kRedWords];
  __shared__ __align__(16) unsigned tile_t[kTileC * (TR / 4)];
  __shared__ __align__(16) uint8_t in_buf[2][TR * kRowBytes];
  const float s = 1.0f / *f.scale_used;  // reciprocal: docs/numerics.md
  unsigned local = 0u;
  const int lv = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const long long ntx = (ext_c + kTileC - 1) / kTileC;
  const long long nty = (ext_r + TR - 1) / TR;
  const long long ntiles = ntx * nty;
  auto row0 = [&](long long tile_id) { return (tile_id / ntx) * TR; };
  auto col0 = [&](long long tile_id) { return (tile_id % ntx) * kTileC; };
  auto issue = [&](long long tile_id, int b) {
    const long long r0 = row0(tile_id);
    const long long c0 = col0(tile_id);
#pragma unroll
    for (int it = 0; it < kChunks / kThreads; ++it) {
      const int k = threadIdx.x + it * kThreads;
      const int rr = k / kChunksPerRow, cc = k % kChunksPerRow;
      const long long r = r0 + rr, c = c0 + cc * 8;
      const bool valid = r < R && c < C;  // C % 8 == 0: a chunk is all in or all out
      cp_async16(&in_buf[b][rr * kRowBytes + cc * 16], valid ? (const void*)(x + r * C + c) : (const void*)x, valid);
    }
    cp_async_commit();
  };
  int b = 0;
  if ((long long)blockIdx.x < ntiles) issue(blockIdx.x, 0);
  for (long long tile_id = blockIdx.x; tile_id < ntiles; tile_id += gridDim.x, b ^= 1) {
    const long long next = tile_id + gridDim.x;
    if (next < ntiles) {
      issue(next, b ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const long long r0 = row0(tile_id);
    const long long c0 = col0(tile_id);
    Raw8<T> raw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) raw[j].u[0] = *reinterpret_cast<const uint4*>(&in_buf[b][(4 * g + j) * kRowBytes + lv * 16]);
    quant_store_tile2<T, kE5M2>(raw, r0, c0, R, C, q, ldq, qt, ldqt, s, lv, g, local, tile_t);
    if (!qt) __syncthreads();  // in_buf[b] is refilled in the next iteration
  }
  unsigned bm = block_reduce_max(local, smem);
  block_done(bm, f, smem, gridDim.x);
}

// ---------------------------------------------------------------------------
// Lean tile kernel: 16-bit input (float32:
// quant_lean_f32_kernel below), R and C multiples of 64, q (if written) and
// q_t unpadded. No shared memory and no bounds checks: a warp owns a 64 x 64 tile; lane (lv, gq) loads rows
// r0 + 16 gq .. + 15, columns c0 + 8 lv .. + 7 (sixteen 16-byte loads in
// flight), quantizes, stores its eight q bytes per row, and transposes its
// 16 x 8 bytes in registers into eight 16-byte pieces of q_t rows (four
// lanes write 64 contiguous bytes of each q_t row). The amax is a max over
// the packed 16-bit |x| bits, converted once at the end. Numerics as every
// other kernel here (q2 on the float value), so the bytes are the same.
__device__ __forceinline__ unsigned max_u16x2(unsigned a, unsigned b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));  // PTX: sm_90 and later
  return d;
#else
  return __vmaxu2(a, b);
#endif
}

constexpr unsigned kAbs16x2 = 0x7fff7fffu;

// A lean kernel's register transpose of four rows: lo[j] and hi[j] are the
// fp8 bytes of row j (columns 0..3 and 4..7 of the lane's eight); column i
// of the four rows goes to ot[i][jg] (row 0 in the low byte), the jg-th
// 4-byte piece of the lane's 16-byte q_t store for column i.
__device__ __forceinline__ void transpose_into(const unsigned (&lo)[4], const unsigned (&hi)[4], unsigned (&ot)[8][4],
                                               int jg) {
  unsigned w[8];
  transpose4x4(lo[0], lo[1], lo[2], lo[3], w);
  transpose4x4(hi[0], hi[1], hi[2], hi[3], w + 4);
#pragma unroll
  for (int i = 0; i < 8; ++i) ot[i][jg] = w[i];
}

// Which 64 x 64 tile a warp of a lean kernel takes. The block's eight warps
// cover kRows x (8 / kRows) tiles of one "unit"; unit u is the block's
// (u / gridDim.x)-th. kRows 1: eight tiles side by side (any tile count: the
// last unit may be short, `t` says where a warp's tile falls in row-major
// tile order). kRows 2 or 4: two or four tile rows, so that the q_t row
// pieces of vertically adjacent tiles (one 128-byte line for two) are
// written together; needs whole units (tiles_c % (8 / kRows) == 0 and the
// tile rows a multiple of kRows). Returns false where the warp has no tile.
template <int kRows>
__device__ __forceinline__ bool lean_tile(unsigned u, unsigned tiles_c, unsigned ntiles, long long& tile_r,
                                          long long& tile_c) {
  constexpr unsigned kCols = 8 / kRows;
  const unsigned w = threadIdx.x >> 5;
  if constexpr (kRows == 1) {
    const unsigned t = u * 8u + w;
    tile_r = t / tiles_c;
    tile_c = t % tiles_c;
    return t < ntiles;
  } else {
    const unsigned units_c = tiles_c / kCols;
    tile_r = (long long)(u / units_c) * kRows + w / kCols;
    tile_c = (long long)(u % units_c) * kCols + w % kCols;
    return true;
  }
}

template <typename T, bool kE5M2, int kRows>
__global__ void __launch_bounds__(kThreads, 2) quant_lean_kernel(const T* __restrict__ x, long long R, long long C,
                                                                 unsigned tiles_c, unsigned ntiles,
                                                                 uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                                                                 Finalize f) {
  static_assert(sizeof(T) == 2, "quant_lean_kernel: 16-bit inputs");
  __shared__ unsigned smem[kRedWords];
  if (!lean_fallback_needed(f)) return;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int lv = lane & 7, gq = lane >> 3;
  const unsigned nunits = (ntiles + 7u) / 8u;
  const long long row_vecs = C / 8;
  unsigned m2 = 0u;
  float s = 0.0f;
  bool waited = false, write = true;
  for (unsigned u = blockIdx.x; u < nunits; u += gridDim.x) {
    long long tile_r, tile_c;
    if (!lean_tile<kRows>(u, tiles_c, ntiles, tile_r, tile_c)) break;
    const long long r0 = tile_r * 64 + 16 * gq;  // this lane's first row
    const long long c0 = tile_c * 64 + 8 * lv;   // and first column
    const uint4* src = reinterpret_cast<const uint4*>(x + r0 * C + c0);
    uint4 in[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) in[j] = __ldg(src + j * row_vecs);
    if (!waited) {
      // x is complete before this kernel starts; only scale_used may still be
      // in the making (a programmatic launch after the pre-pass): wait for it
      // with the first tile's loads already in flight. Without a pre-pass, the
      // state's scale and the history are read here instead.
      pdl_wait();
      s = 1.0f / lean_scale(f, write);  // reciprocal: docs/numerics.md
      waited = true;
    }
    unsigned ot[8][4];
#pragma unroll
    for (int jg = 0; jg < 4; ++jg) {
      unsigned lo[4], hi[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const uint4 v = in[4 * jg + jj];
        m2 = max_u16x2(m2, max_u16x2(v.x & kAbs16x2, v.y & kAbs16x2));
        m2 = max_u16x2(m2, max_u16x2(v.z & kAbs16x2, v.w & kAbs16x2));
        const float2 a = Pair<T>::f32(v.x), b = Pair<T>::f32(v.y), c = Pair<T>::f32(v.z), d = Pair<T>::f32(v.w);
        lo[jj] = (unsigned)q2<kE5M2>(a.x, a.y, s) | ((unsigned)q2<kE5M2>(b.x, b.y, s) << 16);
        hi[jj] = (unsigned)q2<kE5M2>(c.x, c.y, s) | ((unsigned)q2<kE5M2>(d.x, d.y, s) << 16);
        if (q && write) *reinterpret_cast<uint2*>(q + (r0 + 4 * jg + jj) * C + c0) = make_uint2(lo[jj], hi[jj]);
      }
      transpose_into(lo, hi, ot, jg);
    }
    if (write) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<uint4*>(qt + (c0 + i) * R + r0) = make_uint4(ot[i][0], ot[i][1], ot[i][2], ot[i][3]);
    }
  }
  if (!waited) pdl_wait();  // a warp without a tile: the block's finish still comes after the pre-pass
  const unsigned bm = block_reduce_max(Pair<T>::amax_bits(m2), smem);
  block_done(bm, f, smem, gridDim.x);
}

// The same for float32 input (the weights of mixed-precision models): a lane
// owns columns c0 + 4 lv .. + 3 and c0 + 32 + 4 lv .. + 3 of its sixteen rows,
// so that each warp load reads whole 128-byte row pieces; loaded four rows
// at a time (two 16-byte loads per row).
template <bool kE5M2, int kRows>
__global__ void __launch_bounds__(kThreads, 2) quant_lean_f32_kernel(const float* __restrict__ x, long long R,
                                                                     long long C, unsigned tiles_c, unsigned ntiles,
                                                                     uint8_t* __restrict__ q,
                                                                     uint8_t* __restrict__ qt, Finalize f) {
  __shared__ unsigned smem[kRedWords];
  if (!lean_fallback_needed(f)) return;
  pdl_launch_dependents();
  pdl_wait();  // launched early after a pre-pass: its scale_used first
  bool write;
  const float s = 1.0f / lean_scale(f, write);  // reciprocal: docs/numerics.md
  const int lane = threadIdx.x & 31;
  const int lv = lane & 7, gq = lane >> 3;
  const unsigned nunits = (ntiles + 7u) / 8u;
  unsigned local = 0u;
  for (unsigned u = blockIdx.x; u < nunits; u += gridDim.x) {
    long long tile_r, tile_c;
    if (!lean_tile<kRows>(u, tiles_c, ntiles, tile_r, tile_c)) break;
    const long long r0 = tile_r * 64 + 16 * gq;
    const long long ca = tile_c * 64 + 4 * lv;  // and cb = ca + 32
    const float4* src = reinterpret_cast<const float4*>(x + r0 * C + ca);
    const long long row_vecs = C / 4;
    unsigned ot[8][4];
#pragma unroll
    for (int jg = 0; jg < 4; ++jg) {
      float4 in[4][2];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        in[jj][0] = __ldg(src + (4 * jg + jj) * row_vecs);
        in[jj][1] = __ldg(src + (4 * jg + jj) * row_vecs + 8);
      }
      unsigned lo[4], hi[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float4 a = in[jj][0], b = in[jj][1];
        local = max(local, max(max(abs_bits(a.x), abs_bits(a.y)), max(abs_bits(a.z), abs_bits(a.w))));
        local = max(local, max(max(abs_bits(b.x), abs_bits(b.y)), max(abs_bits(b.z), abs_bits(b.w))));
        lo[jj] = (unsigned)q2<kE5M2>(a.x, a.y, s) | ((unsigned)q2<kE5M2>(a.z, a.w, s) << 16);
        hi[jj] = (unsigned)q2<kE5M2>(b.x, b.y, s) | ((unsigned)q2<kE5M2>(b.z, b.w, s) << 16);
        if (q && write) {
          uint8_t* row = q + (r0 + 4 * jg + jj) * C + ca;
          *reinterpret_cast<unsigned*>(row) = lo[jj];
          *reinterpret_cast<unsigned*>(row + 32) = hi[jj];
        }
      }
      transpose_into(lo, hi, ot, jg);
    }
    if (write) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const long long col = ca + (i < 4 ? i : 32 + i - 4);
        *reinterpret_cast<uint4*>(qt + col * R + r0) = make_uint4(ot[i][0], ot[i][1], ot[i][2], ot[i][3]);
      }
    }
  }
  const unsigned bm = block_reduce_max(local, smem);
  block_done(bm, f, smem, gridDim.x);
}

__global__ void record_amax_kernel(const float* amax, Finalize f) {
  __shared__ unsigned smem[kRedWords];
  const float a = *amax;
  if (!finalize_one_pass(a, f, smem)) record_in_block(a, f, smem);
}

// The current device's SM count (the launches below run under a
// DeviceScope of their tensor).
int num_sms() {
  int dev;
  FP8_KERNELS_CUDA_CHECK(cudaGetDevice(&dev));
  return device_sm_count(dev);
}

// Whether a launch may start early after the one before it (programmatic
// dependent launch: compute capability 9.0 and later; cached per device).
bool pdl_enabled(int device) { return device >= 0 && device_capability(device) >= 90; }

// `kernel<<<blocks, kThreads, 0, stream>>>(args...)`, with the programmatic
// stream serialization attribute where `early` (the kernel must call
// pdl_wait before it reads what the previous kernel wrote).
template <typename... Params, typename... Args>
void launch_maybe_early(void (*kernel)(Params...), unsigned blocks, cudaStream_t stream, bool early,
                        Args... args) {
  if (!early) {
    kernel<<<blocks, kThreads, 0, stream>>>(args...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  FP8_KERNELS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// The lean kernels' block layout: two 64 x 64 tile rows of four tiles per
// block where they divide the tile grid (vertically adjacent tiles write
// their q_t row pieces together), else eight tiles side by side; one tile
// per warp (many short blocks, scheduled as SMs free up: a short tail).
constexpr int kLeanRows = 2;

// Resident blocks per SM of a kernel at kThreads threads (for grid sizes).
template <typename K>
int blocks_per_sm(K kernel) {
  int n = 0;
  FP8_KERNELS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return std::max(n, 1);
}


template <typename Fn>
void dispatch_in(const QuantizeCall& c, Fn&& fn) {
  switch (c.x_type) {
    case InType::kBF16: fn(static_cast<const __nv_bfloat16*>(c.x)); break;
    case InType::kF16: fn(static_cast<const __half*>(c.x)); break;
    case InType::kF32: fn(static_cast<const float*>(c.x)); break;
  }
}

// Launches the quantize `c` describes (fp8_kernels.h; the kernel choice:
// the top of this file).
inline void quantize_run(const QuantizeCall& c) {
  const long long R = c.R, C = c.C, ldq = c.ldq, ldqt = c.ldqt;
  const int fmt = c.fmt, scale_mode = c.scale_mode;
  cudaStream_t stream = c.stream;
  const float fmax = fmax_of(fmt);
  unsigned* wsp = c.workspace;
  const long long n = R * C;
  const bool vec = (C % 8 == 0) && ((reinterpret_cast<uintptr_t>(c.x) & 15) == 0);
  uint8_t* qp = c.q;
  uint8_t* qtp = c.qt;

  const bool fused_seed = scale_mode != 0 && !qp && !qtp;
  // The lean kernels where they apply: whole 64 x 64 tiles, no padding, aligned outputs.
  const bool lean = vec && qtp && R % 64 == 0 && C % 64 == 0 && ldqt == R && (!qp || ldq == C) &&
                    (reinterpret_cast<uintptr_t>(qtp) & 15) == 0 && (!qp || (reinterpret_cast<uintptr_t>(qp) & 7) == 0) &&
                    (R / 64) * (C / 64) < (1LL << 31);
  // Delayed scaling through the lean kernels checks the history in the kernel
  // (Finalize::split) instead of a pre-pass, unless told otherwise.
  const bool split = scale_mode == 1 && !fused_seed && lean;
  const bool prepass = scale_mode != 0 && !fused_seed && !split;
  if (prepass) {
    // Delayed scaling with a non-empty history (every call after the first):
    // each block only reads the history and exits, so keep the grid small.
    long long blocks = (n / 8 + kThreads - 1) / kThreads;
    blocks = std::max<long long>(1, std::min<long long>(blocks, (scale_mode == 1 ? 2LL : 4LL) * num_sms()));
    const float* hist = scale_mode == 1 ? c.hist_for_empty : nullptr;
    const long long H = scale_mode == 1 ? c.hist_for_empty_n : 0;
    dispatch_in(c, [&](auto* xp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      amax_prepass_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(
          xp, n, vec, hist, H, scale_mode == 1, c.scale_in, c.scale_used, wsp, fmax, c.mdiv);
    });
    FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
  }

  Finalize f;
  f.ws = wsp + 2;
  f.amax_out = c.amax_out;
  f.history = c.history;
  f.H = c.history ? c.H : 0;
  f.scale_state = c.scale_state;
  f.scale_used = c.scale_used;
  f.algo = c.algo;
  f.fmax = fmax;
  f.mdiv = c.mdiv;
  f.skip_zero = c.skip_zero ? 1 : 0;
  // The launch seeds the scale itself (no pre-pass): a fused amax-only call,
  // or a split delayed call (always scale_mode 1 with a given scale_in).
  const bool seeds_itself = fused_seed || split;
  f.seed_mode = seeds_itself ? scale_mode : 0;
  f.prev_scale = seeds_itself ? c.scale_in : nullptr;
  f.seed_history = (seeds_itself && scale_mode == 1) ? c.hist_for_empty : nullptr;
  f.seed_H = (seeds_itself && scale_mode == 1) ? c.hist_for_empty_n : 0;
  f.scale_used_out = seeds_itself ? c.scale_used : nullptr;
  f.split = split ? 1 : 0;
  f.seed = split ? wsp + 12 : nullptr;
  if (c.extras) f.extras = *c.extras;
  const bool flat = qtp == nullptr && (qp == nullptr || ldq == C);
  dispatch_in(c, [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    if (flat) {
      long long blocks = (std::max<long long>(n, 1) / 8 + kThreads - 1) / kThreads;
      blocks = std::max<long long>(1, std::min<long long>(blocks, 8LL * num_sms()));
      if (fmt == 1)
        quant_flat_kernel<T, true><<<(unsigned)blocks, kThreads, 0, stream>>>(xp, n, vec, qp, f);
      else
        quant_flat_kernel<T, false><<<(unsigned)blocks, kThreads, 0, stream>>>(xp, n, vec, qp, f);
    } else {
      // Cover the padded extents too, so that padding bytes get written.
      const long long ext_c = std::max<long long>(C, qp ? ldq : C);
      const long long ext_r = std::max<long long>(R, qtp ? ldqt : R);
      if (lean) {
        const unsigned tiles_c = (unsigned)(C / 64), ntiles = (unsigned)((R / 64) * (C / 64));
        const bool two_rows = tiles_c % (8 / kLeanRows) == 0 && (R / 64) % kLeanRows == 0;
        const unsigned nb = std::max(1u, (ntiles + 7u) / 8u);  // one tile per warp
        // After a pre-pass, a programmatic dependent launch (pdl_wait).
        const bool pdl = pdl_enabled(c.device);
        auto kernel = [&] {
          if constexpr (sizeof(T) == 2) {
            using K = decltype(&quant_lean_kernel<T, true, 1>);
            static constexpr K kernels[2][2] = {
                {quant_lean_kernel<T, false, 1>, quant_lean_kernel<T, false, kLeanRows>},
                {quant_lean_kernel<T, true, 1>, quant_lean_kernel<T, true, kLeanRows>}};
            return kernels[fmt == 1 ? 1 : 0][two_rows ? 1 : 0];
          } else {
            using K = decltype(&quant_lean_f32_kernel<true, 1>);
            static constexpr K kernels[2][2] = {
                {quant_lean_f32_kernel<false, 1>, quant_lean_f32_kernel<false, kLeanRows>},
                {quant_lean_f32_kernel<true, 1>, quant_lean_f32_kernel<true, kLeanRows>}};
            return kernels[fmt == 1 ? 1 : 0][two_rows ? 1 : 0];
          }
        }();
        launch_maybe_early(kernel, nb, stream, prepass && pdl, xp, R, C, tiles_c, ntiles, qp, qtp, f);
        if (split) {
          // The fallback: one resident wave at most (it nearly always only
          // reads the flag), launched early where it may be.
          FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
          Finalize fb = f;
          fb.split = 2;
          launch_maybe_early(kernel, std::min(nb, (unsigned)num_sms()), stream, pdl, xp, R, C, tiles_c, ntiles, qp,
                             qtp, fb);
        }
        return;
      }
      if constexpr (sizeof(T) == 2) {
        if (vec) {
          const long long nt3 = ((ext_c + kTileC - 1) / kTileC) * ((ext_r + 63) / 64);
          auto kernel = fmt == 1 ? quant_tile3_kernel<T, true> : quant_tile3_kernel<T, false>;
          static const int per_sm = blocks_per_sm(kernel);  // same for both
          const unsigned nb3 = (unsigned)std::max<long long>(1, std::min<long long>(nt3, (long long)per_sm * num_sms()));
          kernel<<<nb3, kThreads, 0, stream>>>(xp, R, C, qp, ldq, qtp, ldqt, ext_r, ext_c, f);
          return;
        }
      }
      const long long nt2 = ((ext_c + kTileC - 1) / kTileC) * ((ext_r + 63) / 64);
      const unsigned nb2 = (unsigned)std::max<long long>(1, std::min<long long>(nt2, 4LL * num_sms()));
      if (fmt == 1)
        quant_tile2_kernel<T, true><<<nb2, kThreads, 0, stream>>>(xp, R, C, vec, qp, ldq, qtp, ldqt, ext_r, ext_c, f);
      else
        quant_tile2_kernel<T, false><<<nb2, kThreads, 0, stream>>>(xp, R, C, vec, qp, ldq, qtp, ldqt, ext_r, ext_c, f);
    }
  });
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
}

// Records `*amax` into `history` (H entries) and publishes the next scale
// into `scale` (one block on `stream`).
inline void record_amax_run(float* history, long long H, float* scale, const float* amax, int fmt, int algo,
                            float mdiv, bool skip_zero, cudaStream_t stream) {
  // The kernel reads scale (as scale_used) and writes it: one thread does both
  // in order, so the read happens before the write.
  Finalize f;
  f.ws = nullptr;
  f.amax_out = nullptr;
  f.history = history;
  f.H = H;
  f.scale_state = scale;
  f.scale_used = scale;
  f.algo = algo;
  f.fmax = fmax_of(fmt);
  f.mdiv = mdiv;
  f.skip_zero = skip_zero ? 1 : 0;
  f.seed_mode = 0;
  f.prev_scale = nullptr;
  f.seed_history = nullptr;
  f.seed_H = 0;
  f.scale_used_out = nullptr;
  record_amax_kernel<<<1, 1024, 0, stream>>>(amax, f);
  FP8_KERNELS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace fp8_kernels
