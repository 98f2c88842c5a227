// Fused FP8 quantize kernels: cast (+ optional transpose) + amax + (delayed
// scaling) history shift and next scale, finalized on device by the last block.
//
// Numerics follow DESIGN.md exactly (the emulation in torch_ops/emulation.py is
// the reference): q = cvt_rn_satfinite(float(x) / scale) with IEEE division
// (this file must not be built with --use_fast_math), NaN stays NaN, +-inf
// saturates to +-max. amax is a max over the float bits of |x| as unsigned
// ints: for non-negative floats that order is the float order, and NaN bits
// (> 0x7f800000) win over inf, so NaN and inf propagate without special cases.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "common.h"
#include "finalize.cuh"
#include "fold_block.cuh"

namespace torch_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kTileC = 128;   // input cols per tile of the v2 and v3 kernels

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Two floats -> two fp8 bytes (a in the low byte). `inv` is 1/scale, one IEEE
// division per thread: XLA turns x / scale into x * (1/scale), so the
// reference multiplies by the exact reciprocal too (docs/numerics.md).
template <bool kE5M2>
__device__ __forceinline__ unsigned short q2(float a, float b, float inv) {
  float2 v = make_float2(a * inv, b * inv);
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
// Tile kernel, v2: q (R, ldq >= C) and/or qt (C, ldqt >= R), padding
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
// Tile kernel, v3 (default for 16-bit inputs with 8-column vector access):
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
// Lean tile kernel, v5 (default where it applies): 16-bit input (float32:
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

// ---------------------------------------------------------------------------
// Amax + history/scale update of two tensors in one launch (no fp8 output):
// blockIdx.y picks the job, each job has its own workspace and last block.
// The state updates of fp8_linear's small-GEMM path (x and weight).
struct AmaxJob {
  const void* x;
  long long n;
  int dtype;  // 0 bf16, 1 fp16, 2 fp32
  int vec;
  Finalize f;
};

// |x| max bits of one 16-byte piece: 16-bit inputs as a packed max over
// their |x| bits (converted once at the end, as in quant_lean_kernel),
// float32 as the max of the four |x| bits.
template <typename T>
struct AbsMax16B {
  unsigned m2 = 0u;
  __device__ __forceinline__ void add(const uint4& v) {
    m2 = max_u16x2(m2, max_u16x2(v.x & kAbs16x2, v.y & kAbs16x2));
    m2 = max_u16x2(m2, max_u16x2(v.z & kAbs16x2, v.w & kAbs16x2));
  }
  __device__ __forceinline__ unsigned bits() const { return Pair<T>::amax_bits(m2); }
};
template <>
struct AbsMax16B<float> {
  unsigned m = 0u;
  __device__ __forceinline__ void add(const uint4& v) {
    m = max(m, max(max(v.x & 0x7fffffffu, v.y & 0x7fffffffu), max(v.z & 0x7fffffffu, v.w & 0x7fffffffu)));
  }
  __device__ __forceinline__ unsigned bits() const { return m; }
};

// This block's share of |x|'s max bits: 16-byte loads, four in flight per
// thread, where x is 16-byte aligned (vec); the elements after the last
// whole piece (or all of them otherwise) one by one.
template <typename T>
__device__ __forceinline__ unsigned amax_part(const T* __restrict__ x, long long n, bool vec) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long start = 0;
  unsigned local = 0u;
  if (vec) {
    constexpr int kPer = 16 / sizeof(T);
    const long long nv = n / kPer;
    const uint4* p = reinterpret_cast<const uint4*>(x);
    AbsMax16B<T> acc;
    long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; v + 3 * stride < nv; v += 4 * stride) {
      uint4 a[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = __ldg(p + v + k * stride);
#pragma unroll
      for (int k = 0; k < 4; ++k) acc.add(a[k]);
    }
    for (; v < nv; v += stride) acc.add(__ldg(p + v));
    local = acc.bits();
    start = nv * kPer;
  }
  for (long long i = start + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    local = max(local, abs_bits(to_f32(x[i])));
  return local;
}

__device__ __forceinline__ void amax_record_job(const AmaxJob& j, unsigned* smem) {
  unsigned local;
  if (j.dtype == 0) local = amax_part(static_cast<const __nv_bfloat16*>(j.x), j.n, j.vec);
  else if (j.dtype == 1) local = amax_part(static_cast<const __half*>(j.x), j.n, j.vec);
  else local = amax_part(static_cast<const float*>(j.x), j.n, j.vec);
  unsigned bm = block_reduce_max(local, smem);
  block_done(bm, j.f, smem, gridDim.x);
}

// Up to kMaxRecordJobs amax + state updates in one launch, one job per blockIdx.y.
struct AmaxJobs {
  AmaxJob j[kMaxRecordJobs];
};

__global__ void __launch_bounds__(kThreads) amax_record_kernel(AmaxJobs jobs) {
  __shared__ unsigned smem[kRedWords];
  if (blockIdx.y == 0) amax_record_job(jobs.j[0], smem);
  else if (blockIdx.y == 1) amax_record_job(jobs.j[1], smem);
  else amax_record_job(jobs.j[2], smem);
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
  TORCH_OPS_CUDA_CHECK(cudaGetDevice(&dev));
  return device_sm_count(dev);
}

// Whether the lean kernels may start early after the delayed pre-pass
// (programmatic dependent launch: compute capability 9.0 or later;
// TORCH_OPS_PDL=0 turns it off, read once; set_lean_options overrides it).
// Per device, cached.
int pdl_from_env() {
  static const int v = [] {
    return env_choice("TORCH_OPS_PDL", {"0", "1"}, 1);
  }();
  return v;
}
std::atomic<int> g_lean_pdl{-1};  // -1: as TORCH_OPS_PDL says

bool pdl_enabled(int device) {
  int allowed = g_lean_pdl.load(std::memory_order_relaxed);
  if (allowed < 0) allowed = pdl_from_env();
  if (allowed == 0 || device < 0) return false;
  return device_capability(device) >= 90;
}

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
  TORCH_OPS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Transposing tile kernel: 5 (default: quant_lean_kernel where it applies,
// else as 3), 3 (quant_tile3_kernel where the input is 16-bit with 8-column
// vector access, else quant_tile2_kernel) or 2 (quant_tile2_kernel); from
// TORCH_OPS_QTILE=v2|v3|v5. Benchmarks and tests override it per process
// with set_tile_version (bindings). Versions 1 (the first, shared-memory
// transpose) and 4 (v3 with tiles down the column bands) were removed in
// the tenth session: slower than v5 and reachable only by override.
std::atomic<int> g_tile_override{0};
// The lean kernels' grid (tiles per warp; 0: one resident wave) and block
// layout (lean_tile's kRows: 1, 2 or 4 tile rows per block). Defaults 1 and
// 2, the fastest in benchmarks/quantize.py (ninth session, call 3: 76.9 us
// against 78.1 for 2 and 1 at 16384 x 4096 bfloat16; 108.1 against 109.1
// for float32); the environment (TORCH_OPS_LEAN="tiles_per_warp,rows", read
// once) or set_lean_options (benchmarks) choose others.
std::pair<int, int> lean_from_env() {
  static const std::pair<int, int> v = [] {
    std::pair<int, int> d{1, 2};
    const char* e = std::getenv("TORCH_OPS_LEAN");
    int tpw = 0, rows = 0;
    if (e && std::sscanf(e, "%d,%d", &tpw, &rows) == 2 && tpw >= 0 && tpw <= 1024 &&
        (rows == 1 || rows == 2 || rows == 4))
      d = {tpw, rows};
    else if (e && e[0])
      TORCH_WARN("TORCH_OPS_LEAN='", std::string(e),
                 "' is not \"tiles_per_warp,rows\" (tiles_per_warp 0 to 1024, rows 1, 2 or 4); using \"1,2\"");
    return d;
  }();
  return v;
}
std::atomic<int> g_lean_tiles_per_warp{-1};  // -1: as the environment says
std::atomic<int> g_lean_rows{-1};
int lean_tiles_per_warp() {
  const int v = g_lean_tiles_per_warp.load(std::memory_order_relaxed);
  return v < 0 ? lean_from_env().first : v;
}
int lean_rows() {
  const int v = g_lean_rows.load(std::memory_order_relaxed);
  return v < 0 ? lean_from_env().second : v;
}

int tile_version() {
  const int o = g_tile_override.load(std::memory_order_relaxed);
  if (o) return o;
  static const int v = [] {
    const int i = env_choice("TORCH_OPS_QTILE", {"v2", "v3", "v5"}, 2);
    return i == 0 ? 2 : (i == 1 ? 3 : 5);
  }();
  return v;
}

// Whether delayed scaling through the lean kernels runs the pre-pass (1) or
// checks the history in the kernel with a fallback launch (0, the default:
// 0.4-1.5 us less per call at 16384 x 4096, docs/benchmarks.md, session 11);
// TORCH_OPS_DELAYED_PREPASS=1 (read once) or set_delayed_prepass (tests,
// benchmarks) choose the pre-pass.
std::atomic<int> g_delayed_prepass{-1};  // -1: as the environment says
bool delayed_prepass() {
  const int o = g_delayed_prepass.load(std::memory_order_relaxed);
  if (o >= 0) return o == 1;
  static const bool v = [] {
    return env_choice("TORCH_OPS_DELAYED_PREPASS", {"0", "1"}, 0) == 1;
  }();
  return v;
}

// Resident blocks per SM of a kernel at kThreads threads (for grid sizes).
template <typename K>
int blocks_per_sm(K kernel) {
  int n = 0;
  TORCH_OPS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return std::max(n, 1);
}

// Persistent workspace of the amax reductions, one per (device, stream):
// zeroed once when created; every kernel that uses a slot pair leaves it zero
// again (its last block resets it), so no memset per call. Kernels on one
// stream run in order, so they can share it; another stream gets its own.
// Under CUDA-graph capture each capture gets its own workspace: one of the
// device's reserve slots, zeroed before any capture (the kernels leave their
// counters at zero when they finish), or, past those, one zeroed by a memset
// captured into that graph at its first use (so once per replay, not per
// call): a workspace first zeroed inside a graph that is never replayed must
// not be used by anything else.
// Slots: [0,1] pre-pass, [2,3] main kernel, [2..7] the jobs of the state
// kernel, [8..10] float scratch (scale_used of state-only updates), [12,13]
// the seed of the lean kernels' fallback launch (Finalize::split).
constexpr int kWsWords = 16;
struct Ws {
  unsigned long long capture_id;  // 0: not captured
  at::Tensor t;
};
std::mutex g_ws_mu;
std::map<std::pair<int, cudaStream_t>, Ws> g_ws;
// Per device: workspaces zeroed outside any capture for the first
// kReserveSlots (capture, stream) pairs (a slot is never handed out twice;
// later captures zero their own inside the graph).
constexpr int kReserveSlots = 64;
struct WsReserve {
  at::Tensor t;
  int next = 0;
};
std::map<int, WsReserve> g_ws_reserve;
std::atomic<unsigned long long> g_ws_generation{0};  // +1 whenever an entry gets a new tensor

unsigned* workspace_lookup(const at::Tensor& like, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  TORCH_OPS_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
  if (status != cudaStreamCaptureStatusActive) id = 0;
  const int device = (int)like.get_device();
  std::lock_guard<std::mutex> lk(g_ws_mu);
  Ws& w = g_ws[std::make_pair(device, stream)];
  if (!w.t.defined() || w.capture_id != id) {
    WsReserve& r = g_ws_reserve[device];
    if (id != 0 && r.t.defined() && r.next < kReserveSlots) {
      // A capture: a slot zeroed ahead (no memset node in the graph).
      w.t = r.t.narrow(0, (int64_t)r.next++ * kWsWords, kWsWords);
    } else {
      // at::zeros runs on the current stream (= stream): ordered before the
      // first kernel that uses it (inside a capture: a node of that graph,
      // the memory from the graph's pool).
      w.t = at::zeros({kWsWords}, like.options().dtype(at::kInt));
    }
    if (id == 0 && !r.t.defined()) {
      // The device's first workspace outside a capture: zero the slots for
      // later captures too, and wait for it once, so that a graph replayed
      // on any stream finds them zeroed.
      // (Relaxed: another thread's capture in global mode does not forbid
      // this thread's one synchronization of a stream it is not capturing.)
      r.t = at::zeros({(int64_t)kReserveSlots * kWsWords}, like.options().dtype(at::kInt));
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      TORCH_OPS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      const cudaError_t synced = cudaStreamSynchronize(stream);
      TORCH_OPS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      TORCH_OPS_CUDA_CHECK(synced);
    }
    w.capture_id = id;
    g_ws_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  return reinterpret_cast<unsigned*>(w.t.data_ptr<int>());
}

// workspace_lookup with a per-thread memo of the last eager (device, stream):
// outside capture a call costs one cudaStreamIsCapturing, no lock. The memo
// is dropped whenever any entry gets a new tensor (the generation moved).
unsigned* workspace(const at::Tensor& like, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TORCH_OPS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return workspace_lookup(like, stream);
  struct Memo {
    int device = -1;
    cudaStream_t stream = nullptr;
    unsigned long long generation = ~0ull;
    unsigned* ws = nullptr;
  };
  thread_local Memo memo;
  const int device = (int)like.get_device();
  const unsigned long long generation = g_ws_generation.load(std::memory_order_acquire);
  if (memo.device == device && memo.stream == stream && memo.generation == generation) return memo.ws;
  // The generation read before the lookup: a replacement since then misses
  // next time instead of being memoized as current.
  memo = Memo{device, stream, generation, workspace_lookup(like, stream)};
  return memo.ws;
}

template <typename Fn>
void dispatch_in(const at::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kBFloat16: fn((const __nv_bfloat16*)x.data_ptr()); break;
    case at::kHalf: fn((const __half*)x.data_ptr()); break;
    case at::kFloat: fn((const float*)x.data_ptr()); break;
    default:
      TORCH_CHECK(false, "x: expected a bfloat16, float16 or float32 tensor, got ", x.scalar_type());
  }
}

}  // namespace

// x: contiguous (R, C) on CUDA. Writes outputs, returns nothing (allocation
// happens in the caller, bindings.cpp).
//   scale_mode: 0 = given scale (scale_used is read, never written here)
//               1 = delayed (scale_used seeded from the amax when the history
//                   is empty: by a pre-pass, or where the lean kernels apply
//                   by their own check and a fallback launch)
//               2 = current (pre-pass always computes scale_used from amax)
//   extras: null, or work for the last block after the state update (common.h).
void quantize_launch(const at::Tensor& x, long long R, long long C, int fmt, int scale_mode,
                     const at::Tensor& scale_in,        // mode 0: the scale; mode 1: state scale; mode 2: prev (may be undefined)
                     const at::Tensor& scale_used,      // 0-d float32 output (mode 0: same as scale_in)
                     const at::Tensor& amax_out,
                     const at::Tensor& history,         // undefined: no record
                     const at::Tensor& scale_state,     // where the next scale goes when recording
                     const at::Tensor& hist_for_empty,  // mode 1: history (for the empty check)
                     const at::Tensor& q, long long ldq, const at::Tensor& qt, long long ldqt, int algo,
                     double mdiv_d, bool skip_zero, const QuantizeExtras* extras) {
  const DeviceScope device_scope(x);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float fmax = fmax_of(fmt);
  const float mdiv = (float)mdiv_d;
  unsigned* wsp = workspace(x, stream);
  const long long n = R * C;
  const bool vec = (C % 8 == 0) && ((reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) == 0);

  const bool fused_seed = scale_mode != 0 && !q.defined() && !qt.defined();
  // v5 where it applies: whole 64 x 64 tiles, no padding, aligned outputs.
  const bool lean = tile_version() == 5 && vec && qt.defined() && R % 64 == 0 && C % 64 == 0 && ldqt == R &&
                    (!q.defined() || ldq == C) && (reinterpret_cast<uintptr_t>(qt.data_ptr()) & 15) == 0 &&
                    (!q.defined() || (reinterpret_cast<uintptr_t>(q.data_ptr()) & 7) == 0) &&
                    (R / 64) * (C / 64) < (1LL << 31);
  // Delayed scaling through the lean kernels checks the history in the kernel
  // (Finalize::split) instead of a pre-pass, unless told otherwise.
  const bool split = scale_mode == 1 && !fused_seed && lean && !delayed_prepass();
  const bool prepass = scale_mode != 0 && !fused_seed && !split;
  if (prepass) {
    // Delayed scaling with a non-empty history (every call after the first):
    // each block only reads the history and exits, so keep the grid small.
    long long blocks = (n / 8 + kThreads - 1) / kThreads;
    blocks = std::max<long long>(1, std::min<long long>(blocks, (scale_mode == 1 ? 2LL : 4LL) * num_sms()));
    const float* prev = scale_in.defined() ? scale_in.data_ptr<float>() : nullptr;
    const float* hist = scale_mode == 1 ? hist_for_empty.data_ptr<float>() : nullptr;
    const long long H = scale_mode == 1 ? hist_for_empty.numel() : 0;
    dispatch_in(x, [&](auto* xp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      amax_prepass_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(
          xp, n, vec, hist, H, scale_mode == 1, prev, scale_used.data_ptr<float>(), wsp, fmax, mdiv);
    });
    TORCH_OPS_CUDA_CHECK(cudaGetLastError());
  }

  Finalize f;
  f.ws = wsp + 2;
  f.amax_out = amax_out.data_ptr<float>();
  f.history = history.defined() ? history.data_ptr<float>() : nullptr;
  f.H = history.defined() ? history.numel() : 0;
  f.scale_state = scale_state.defined() ? scale_state.data_ptr<float>() : nullptr;
  f.scale_used = scale_used.data_ptr<float>();
  f.algo = algo;
  f.fmax = fmax;
  f.mdiv = mdiv;
  f.skip_zero = skip_zero ? 1 : 0;
  // The launch seeds the scale itself (no pre-pass): a fused amax-only call,
  // or a split delayed call (always scale_mode 1 with a defined scale_in).
  const bool seeds_itself = fused_seed || split;
  f.seed_mode = seeds_itself ? scale_mode : 0;
  f.prev_scale = (seeds_itself && scale_in.defined()) ? scale_in.data_ptr<float>() : nullptr;
  f.seed_history = (seeds_itself && scale_mode == 1) ? hist_for_empty.data_ptr<float>() : nullptr;
  f.seed_H = (seeds_itself && scale_mode == 1) ? hist_for_empty.numel() : 0;
  f.scale_used_out = seeds_itself ? scale_used.data_ptr<float>() : nullptr;
  f.split = split ? 1 : 0;
  f.seed = split ? wsp + 12 : nullptr;
  if (extras) {
    TORCH_CHECK(extras->emit_n == 0 || (amax_out.defined() && amax_out.numel() == extras->emit_n),
                "quantize_launch: the gradient channel's size does not match emit_n");
    f.extras = *extras;
  }
  uint8_t* qp = q.defined() ? reinterpret_cast<uint8_t*>(q.data_ptr()) : nullptr;
  uint8_t* qtp = qt.defined() ? reinterpret_cast<uint8_t*>(qt.data_ptr()) : nullptr;
  const bool flat = qtp == nullptr && (qp == nullptr || ldq == C);
  dispatch_in(x, [&](auto* xp) {
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
      const int version = tile_version();
      if (lean) {
        const unsigned tiles_c = (unsigned)(C / 64), ntiles = (unsigned)((R / 64) * (C / 64));
        // Block layout: kRows tile rows of 8 / kRows tiles where they divide
        // the tile grid, else eight tiles side by side.
        int rows = lean_rows();
        if (tiles_c % (8 / rows) != 0 || (R / 64) % rows != 0) rows = 1;
        // A grid of many short blocks by default (one tile per warp): blocks
        // are scheduled as SMs free up, so the tail stays short.
        const int tpw = lean_tiles_per_warp();
        const unsigned nunits = (ntiles + 7u) / 8u, per_block = (unsigned)std::max(tpw, 1);
        unsigned nb = std::max(1u, (nunits + per_block - 1u) / per_block);
        if (tpw == 0) nb = std::min(nb, 2u * (unsigned)num_sms());  // persistent: one resident wave
        const int layout = rows == 4 ? 2 : rows - 1;  // 1, 2, 4 rows -> 0, 1, 2
        // After a pre-pass, a programmatic dependent launch (pdl_wait).
        const bool pdl = pdl_enabled(x.get_device());
        auto kernel = [&] {
          if constexpr (sizeof(T) == 2) {
            using K = decltype(&quant_lean_kernel<T, true, 1>);
            static constexpr K kernels[2][3] = {
                {quant_lean_kernel<T, false, 1>, quant_lean_kernel<T, false, 2>, quant_lean_kernel<T, false, 4>},
                {quant_lean_kernel<T, true, 1>, quant_lean_kernel<T, true, 2>, quant_lean_kernel<T, true, 4>}};
            return kernels[fmt == 1 ? 1 : 0][layout];
          } else {
            using K = decltype(&quant_lean_f32_kernel<true, 1>);
            static constexpr K kernels[2][3] = {
                {quant_lean_f32_kernel<false, 1>, quant_lean_f32_kernel<false, 2>, quant_lean_f32_kernel<false, 4>},
                {quant_lean_f32_kernel<true, 1>, quant_lean_f32_kernel<true, 2>, quant_lean_f32_kernel<true, 4>}};
            return kernels[fmt == 1 ? 1 : 0][layout];
          }
        }();
        launch_maybe_early(kernel, nb, stream, prepass && pdl, xp, R, C, tiles_c, ntiles, qp, qtp, f);
        if (split) {
          // The fallback: one resident wave at most (it nearly always only
          // reads the flag), launched early where it may be.
          TORCH_OPS_CUDA_CHECK(cudaGetLastError());
          Finalize fb = f;
          fb.split = 2;
          launch_maybe_early(kernel, std::min(nb, (unsigned)num_sms()), stream, pdl, xp, R, C, tiles_c, ntiles, qp,
                             qtp, fb);
        }
        return;
      }
      if constexpr (sizeof(T) == 2) {
        if (version >= 3 && vec) {
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
  TORCH_OPS_CUDA_CHECK(cudaGetLastError());
}

// The transposing tile kernel (0: back to TORCH_OPS_QTILE; 1, 2, 3: that
// version; checked in bindings.cpp). Returns the previous override. For
// tests and benchmarks.
int set_tile_version(int version) { return g_tile_override.exchange(version); }

// -1: as TORCH_OPS_DELAYED_PREPASS says; 0: in-kernel check; 1: pre-pass.
// Returns the previous override. For tests and benchmarks.
int set_delayed_prepass(int mode) { return g_delayed_prepass.exchange(mode); }

std::tuple<int, int, int> set_lean_options(int tiles_per_warp, int rows, int pdl) {
  // Arguments checked in bindings.cpp.
  const int tpw_was = lean_tiles_per_warp(), rows_was = lean_rows();
  const int pdl_was = g_lean_pdl.exchange(pdl);
  g_lean_tiles_per_warp.store(tiles_per_warp);
  g_lean_rows.store(rows);
  return {tpw_was, rows_was, pdl_was < 0 ? pdl_from_env() : pdl_was};
}

namespace {
// Launches `Kernel` (a __global__ function of this file, no dynamic shared
// memory) through the driver's cuLaunchKernel with the kernel's function
// handle for `device`, looked up once per device. The small path's one launch
// per step is on the critical host path: this way measured 3-5 us less host
// time per step than <<<>>> on the H200 host (docs/benchmarks.md, sixth
// session).

PFN_cuLaunchKernel_v4000 driver_launch_fn() {
  static const PFN_cuLaunchKernel_v4000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    TORCH_OPS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuLaunchKernel", &p, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(p != nullptr && found == cudaDriverEntryPointSuccess, "torch_ops: no cuLaunchKernel in the driver");
    return reinterpret_cast<PFN_cuLaunchKernel_v4000>(p);
  }();
  return fn;
}

template <auto* Kernel>
void launch_by_driver(int device, dim3 grid, dim3 block, cudaStream_t stream, void** params) {
  static std::array<std::atomic<cudaFunction_t>, kMaxDevices> handles{};  // one table per kernel
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "torch_ops: device index ", std::to_string(device),
              " out of range");
  cudaFunction_t f = handles[device].load(std::memory_order_acquire);
  if (f == nullptr) {
    // For the current device, which the caller's DeviceScope made `device`.
    TORCH_OPS_CUDA_CHECK(cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(Kernel)));
    handles[device].store(f, std::memory_order_release);
  }
  const CUresult r = driver_launch_fn()(reinterpret_cast<CUfunction>(f), grid.x, grid.y, grid.z, block.x, block.y,
                                        block.z, 0, reinterpret_cast<CUstream>(stream), params, nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "torch_ops: cuLaunchKernel failed with CUresult ", std::to_string((int)r));
}
}  // namespace

// Delayed-scaling state update of `n` (1..kMaxRecordJobs) tensors
// (fp8_linear's small path): for each, amax -> scale_used (seeded iff the
// history is empty) -> history shift -> next scale, exactly as
// quantize_delayed(record=True, write_q=False, transpose=False), in one
// launch. The tensors: contiguous CUDA tensors (any shape) of
// bf16/fp16/fp32 on one device; each record names its format.
// The state launches' workspace of (like's device, stream): zeroed counters
// that each launch leaves at zero (gemm_amax.cu takes job slots 0 and 1).
unsigned* state_workspace(const at::Tensor& like, cudaStream_t stream) { return workspace(like, stream); }

void amax_record_launch(const AmaxRecord* recs, int n, int algo, double mdiv_d, const FoldJob* fold) {
  TORCH_CHECK(n >= 1 && n <= kMaxRecordJobs, "amax_record_launch: expected 1 to ",
              std::to_string(kMaxRecordJobs), " tensors, got ", std::to_string(n));
  const at::Tensor& x0 = *recs[0].x;
  const DeviceScope device_scope(x0);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  unsigned* wsp = workspace(x0, stream);
  // Per job: two counter words at wsp + 2 + 2i, its scale_used at wsp + 8 + i.
  float* scratch = reinterpret_cast<float*>(wsp + 2 + 2 * kMaxRecordJobs);
  AmaxJobs jobs;
  long long nmax_bytes = 16;
  for (int i = 0; i < n; ++i) {
    const at::Tensor& x = *recs[i].x;
    AmaxJob& j = jobs.j[i];
    const auto t = x.scalar_type();
    TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat,
                "x: expected bfloat16, float16 or float32, got ", t);
    j.x = x.data_ptr();
    j.n = x.numel();
    j.dtype = t == at::kBFloat16 ? 0 : (t == at::kHalf ? 1 : 2);
    j.vec = (reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) == 0 ? 1 : 0;
    nmax_bytes = std::max(nmax_bytes, j.n * (long long)x.element_size());
    j.f = record_finalize(recs[i], wsp + 2 + 2 * i, scratch + i, algo, mdiv_d);
  }
  if (fold) jobs.j[0].f.extras.fold = *fold;  // block_done's last block folds
  // About eight 16-byte loads per thread for the largest tensor, at most two
  // blocks per SM per job: one wave at the small path's sizes (a third of
  // the blocks of the grid before session 8, whose ~10 us of GPU time for
  // 18 MB were mostly block scheduling and finalizing).
  long long blocks = (nmax_bytes / 16 + 8LL * kThreads - 1) / (8LL * kThreads);
  blocks = std::max<long long>(1, std::min<long long>(blocks, 2LL * num_sms()));
  void* params[] = {&jobs};
  launch_by_driver<&amax_record_kernel>(x0.get_device(), dim3((unsigned)blocks, (unsigned)n), dim3(kThreads), stream,
                                        params);
}

// `scale_used`: the scale the amax's tensor was quantized with, for the
// next-scale rule's fallback (null: the state's scale, read before it is
// written).
void record_amax_launch(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& amax, int fmt,
                        int algo, double mdiv_d, bool skip_zero, const at::Tensor* scale_used) {
  const DeviceScope device_scope(history);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The kernel reads scale (as scale_used) and writes it: one thread does both
  // in order, so the read happens before the write.
  Finalize f;
  f.ws = nullptr;
  f.amax_out = nullptr;
  f.history = history.data_ptr<float>();
  f.H = history.numel();
  f.scale_state = scale.data_ptr<float>();
  f.scale_used = scale_used ? scale_used->data_ptr<float>() : scale.data_ptr<float>();
  f.algo = algo;
  f.fmax = fmax_of(fmt);
  f.mdiv = (float)mdiv_d;
  f.skip_zero = skip_zero ? 1 : 0;
  f.seed_mode = 0;
  f.prev_scale = nullptr;
  f.seed_history = nullptr;
  f.seed_H = 0;
  f.scale_used_out = nullptr;
  record_amax_kernel<<<1, 1024, 0, stream>>>(amax.data_ptr<float>(), f);
  TORCH_OPS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torch_ops
