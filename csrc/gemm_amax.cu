// A bf16 GEMM of our own for fp8_linear's small path (below min_gemm_size):
// out = A . B in fp32 accumulation, bf16 out, that also takes the amax of
// its operands as they pass through shared memory and records them into
// their FP8 state (history shift and next scale by the last CTA, the same
// Finalize / block_done as the quantize kernels: finalize.cuh). So the small
// path keeps the FP8 state warm without reading x, W and the gradient again
// and without a state launch of its own (docs/torch_ops.md). Its GPU time
// is 0.90-0.94x of cuBLAS's at 4096x1024x1024 and 0.62-0.93x at
// 1024x2048x1024 (CUDA-graph replay, no records; sessions 18-20); eagerly,
// where these shapes are host-bound, its shorter host path makes the small
// path 1.13-1.25x of nn.Linear (docs/benchmarks.md, session 18).
//
// Hopper only (sm_90a: TMA, wgmma, clusters). 384 threads per CTA:
// warpgroup 0 is the producer (one lane issues the TMA loads into a ring of
// stages) and three amax warps; warpgroups 1 and 2 each compute 64 rows x
// BN columns with wgmma from 128-byte-swizzled shared memory; the epilogue
// goes through swizzled shared memory and TMA stores (clipped at the edges).
// The amax work is spread over the CTAs: a row block's A tiles over the
// CTAs of that row (ceil(k steps / n_tiles) each), a column block's B tiles
// over the CTAs of that column, every element read once more from shared
// memory in all; each CTA's k loop is rotated so that its amax tiles come
// first, and the amax warps count the CTA in (and the last CTA records)
// while the consumers still multiply: the record's chain of atomics is off
// the kernel's tail (the record cost 1.9-2.6 us of graph replay at the
// small shapes when it came after the last k step, session 18; the sum
// order of the k steps changes with the rotation, not the result's
// determinism). 16-bit |x| maxima as packed unsigned
// halves (NaN > inf > finite, as the quantize kernels). Split-K over a
// two-CTA cluster (rank 1 sends its partial sums into rank 0's shared
// memory by st.async) where the output has too few tiles to fill the GPU.
//
// gemm_amax_pair: the small path's backward, dX and dW, in one launch (one
// CTA per tile of either GEMM, the same body), up to three records (g, W,
// x). Where the two GEMMs' 128 x 256 tiles fill one wave (1024x2048x1024:
// 64 + 64 CTAs) it reads fewer bytes per multiply-add than cuBLAS's two
// GEMMs' and takes one launch: 15.6 us against 17.0-17.4 without records,
// 17.5 with the three (CUDA-graph replay, session 20). A persistent
// version with 128 x 128 tiles (a ring of stages through each CTA's tiles)
// took 21.1 (commit bee097b). Where dX's tiles fill one wave but dW's do
// not fit beside them (4096x1024x1024: 128 + 32 tiles, dW's 64 k steps
// long), gemm_amax_chain_kernel (below) takes the pair's place: every CTA
// two items of equal length in a row (two dX tiles, or dX tile and a part
// of a dW tile), dW's parts summed over 2-CTA clusters. 1.3-1.8 us slower
// than cuBLAS's two GEMMs with the three records (28.7 us against 27.4
// of the captured step's timeline, session 22), where the records would
// otherwise cost a launch or our slower forward.
//
// Layouts (all row-major, contiguous): 0: out (M, N) = a (M, K) . b (N, K)^T
// (the forward, out_in weight); 1: a (M, K) . b (K, N) (the forward of an
// in_out weight, dX of an out_in one); 2: a (K, M)^T . b (K, N).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "common.h"
#include "finalize.cuh"
#include "sm90_ptx.cuh"
#include "wgmma_bf16.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define TORCH_OPS_GEMM_AMAX_STUB 1  // device code for targets without wgmma: never launched
#endif

namespace torch_ops {
unsigned* state_workspace(const at::Tensor& like, cudaStream_t stream);  // quantize.cu

namespace {

constexpr int kGemmThreads = 384, kBM = 128, kBK = 64;
constexpr int kRecordPer = 12;  // history entries per amax warp thread in record_by_amax_warps: H <= 1152

// The state updates of one launch (A's amax: job 0, B's: job 1) and the
// bias added to each output row (bf16, N; null: none).
struct GemmAmaxJobs {
  Finalize f[2];
  int on[2];
  // 1: the amax warps record (record_by_amax_warps: every history has at
  // most kRecordPer * 96 entries); 0: block_done by the whole last CTA.
  int fast;
  const __nv_bfloat16* bias;
};

#ifndef TORCH_OPS_GEMM_AMAX_STUB
using namespace sm90;  // NOLINT: the PTX wrappers

// One amax warp thread's share (thread `at` of 96) of a tile's |x| maxima,
// all its 16-byte loads issued before the first max: the stage is held
// until they return (four at a time cost up to 5 us per GEMM, session 17).
template <int kBytes>
__device__ __forceinline__ uint32_t amax_tile(const uint8_t* tile, int at, uint32_t acc) {
  const uint4* p = reinterpret_cast<const uint4*>(tile);
  constexpr int kVecs = kBytes / 16, kN = (kVecs + 95) / 96;
  static_assert(kN <= 24, "too many loads in flight");
  uint4 v[kN];
#pragma unroll
  for (int q = 0; q < kN; ++q) v[q] = (at + 96 * q < kVecs) ? p[at + 96 * q] : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int q = 0; q < kN; ++q) acc = amax16(acc, v[q]);
  return acc;
}

// The records by the three amax warps alone (96 threads, `at` 0..95), in
// parallel with the consumers' k loop (or epilogue): each CTA's warps preload the
// histories and scales (before any CTA can write them: the writes come
// after the last CTA's counter update, which every CTA's preload precedes),
// publish the CTA's amaxes, count the CTA in (one counter for both jobs),
// and the last CTA's warps record both jobs with what they preloaded: no
// global load after the counter but the two amaxes. The same results as
// finalize_one_pass with seed_mode 1 (finalize.cuh), which block_done runs.
template <int J, typename Jobs>
__device__ __forceinline__ void record_by_amax_warps(const Jobs& jobs, const unsigned (&bits)[J], int at,
                                                     unsigned* red) {
  const int lane = at & 31, w = at >> 5;
  float v[J][kRecordPer], prev[J];
  unsigned nonzero[J];
  pdl_wait();  // the state's last writer is done
#pragma unroll
  for (int j = 0; j < J; ++j) {
    nonzero[j] = 0u;
    const Finalize& f = jobs.f[j];
    prev[j] = 1.0f;
    if (!jobs.on[j]) continue;
    prev[j] = *f.prev_scale;
#pragma unroll
    for (int k = 0; k < kRecordPer; ++k) {
      const long long i = at + 96LL * k;
      v[j][k] = i < f.H ? f.history[i] : 0.f;
      nonzero[j] |= abs_bits(v[j][k]) ? 1u : 0u;
    }
  }
  // This CTA's amaxes and its count; thread 0 learns whether it is the last.
  if (at == 0) {
    unsigned* counter = nullptr;  // the first job's: one count for all
#pragma unroll
    for (int j = J - 1; j >= 0; --j)
      if (jobs.on[j]) counter = jobs.f[j].ws + 1;
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (jobs.on[j] && bits[j]) atomicMax(jobs.f[j].ws, bits[j]);
    unsigned prior;
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(prior) : "l"(counter) : "memory");
    const bool last = prior == gridDim.x - 1;
    red[0] = last;
    if (last) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        red[1 + j] = jobs.on[j] ? atomicAdd(jobs.f[j].ws, 0u) : 0u;
        if (jobs.on[j]) jobs.f[j].ws[0] = 0u;  // the workspace left at zero for the next launch
      }
      *counter = 0u;
    }
  }
  named_sync(5, 96);
  if (!red[0]) return;
  float amax[J];
  bool shift[J];
  unsigned m[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const Finalize& f = jobs.f[j];
    amax[j] = __uint_as_float(red[1 + j]);
    m[j] = 0u;
    shift[j] = jobs.on[j] && isfinite(amax[j]) && f.H > 0;
    if (!jobs.on[j]) continue;
#pragma unroll
    for (int k = 0; k < kRecordPer; ++k) {
      const long long i = at + 96LL * k;
      if (i < f.H && (!shift[j] || i < f.H - 1)) m[j] = max(m[j], window_bits(v[j][k]));
    }
    if (shift[j] && at == 0) m[j] = max(m[j], window_bits(amax[j]));
    nonzero[j] = __reduce_max_sync(0xFFFFFFFFu, nonzero[j]);
    m[j] = __reduce_max_sync(0xFFFFFFFFu, m[j]);
  }
  // Across the three warps (red[8 + ...]: free here), every read of the
  // histories done before the writes below.
  static_assert(8 + 6 * J <= kRedWords, "too many jobs for the reduction words");
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < J; ++j) red[8 + 3 * j + w] = nonzero[j], red[8 + 3 * J + 3 * j + w] = m[j];
  }
  named_sync(5, 96);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const Finalize& f = jobs.f[j];
    if (!jobs.on[j]) continue;
    const unsigned nz = red[8 + 3 * j] | red[9 + 3 * j] | red[10 + 3 * j];
    const unsigned mm = max(max(red[8 + 3 * J + 3 * j], red[9 + 3 * J + 3 * j]), red[10 + 3 * J + 3 * j]);
    if (shift[j]) {
#pragma unroll
      for (int k = 0; k < kRecordPer; ++k) {
        const long long i = at + 96LL * k;
        if (i < f.H - 1) f.history[i + 1] = v[j][k];
      }
      if (at == 0) f.history[0] = amax[j];
    }
    if (at == 0) {  // v[j][0] of thread 0: the newest entry before this call
      const float used = record_scale_used(amax[j], prev[j], nz == 0u, f);
      *f.scale_used_out = used;
      *f.scale_state = record_next_scale(amax[j], shift[j], v[j][0], mm, f.H, used, f);
    }
  }
}

// One stage's TMA loads: A's 128 x 64 tile (m_blk, kt) and B's BN x 64 tile
// (n_blk, kt), 128-byte swizzled, completing `bar`'s transaction bytes.
template <int BN, int LAYOUT>
__device__ __forceinline__ void load_stage(uint8_t* sA, uint8_t* sB, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                           uint64_t* bar, int m_blk, int n_blk, int kt) {
  if (LAYOUT == 2) {  // A MN-major: two 64 x 64 boxes along M
    tma_load(sA, tmA, bar, m_blk * kBM, kt * kBK);
    tma_load(sA + 8192, tmA, bar, m_blk * kBM + 64, kt * kBK);
  } else {
    tma_load(sA, tmA, bar, kt * kBK, m_blk * kBM);
  }
  if (LAYOUT >= 1) {  // B MN-major: BN / 64 boxes along N
#pragma unroll
    for (int b = 0; b < BN / 64; ++b) tma_load(sB + b * 8192, tmB, bar, n_blk * BN + b * 64, kt * kBK);
  } else {
    tma_load(sB, tmB, bar, kt * kBK, n_blk * BN);
  }
}

// One stage's multiply-adds of consumer warpgroup `c` (its 64 rows of A):
// d (64 x BN, wgmma's fragment) += A . B over the stage's 64 k.
template <int BN, int LAYOUT>
__device__ __forceinline__ void mma_stage(float* d, const uint8_t* sA, const uint8_t* sB, int c) {
  const uint32_t a0 = smem_u32(sA + c * 64 * 128), b0 = smem_u32(sB);
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    if (LAYOUT == 2) {  // this warpgroup's 64 rows are the stage's c-th 64 x 64 box
      Wgmma<BN, 1, 1>::mma(d, desc_mn_major(a0 + kk * 2048, 8192), desc_mn_major(b0 + kk * 2048, 8192));
    } else if (LAYOUT == 1) {
      Wgmma<BN, 0, 1>::mma(d, desc_k_major(a0 + kk * 32), desc_mn_major(b0 + kk * 2048, 8192));
    } else {
      Wgmma<BN, 0, 0>::mma(d, desc_k_major(a0 + kk * 32), desc_k_major(b0 + kk * 32));
    }
  }
}

// Consumer warpgroup `c`'s 64 x BN of the tile (m_blk, n_blk) out of its
// fragment `d` (+ `bias` per column, may be null) into `sC` (its 64 x BN
// bf16 as 128-byte-swizzled 64 x 64 sub-tiles, 8 KB per 64 columns, free
// for writing), then one TMA store per sub-tile by its first thread (who
// waits until the stores have read sC). Named barrier 2 + c.
template <int BN>
__device__ __forceinline__ void store_tile(float* d, uint8_t* sC, const CUtensorMap* tmC, const __nv_bfloat16* bias,
                                           int N, int m_blk, int n_blk, int c, int tid) {
  const int lane = tid % 32, w = (tid / 32) % 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    if (bias) {  // added in float32 before the rounding, as cuBLAS's bias epilogue
      const int col = n_blk * BN + j * 8 + (lane % 4) * 2;  // even; N is a multiple of 8
      if (col < N) {
        const float2 bv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
        d[j * 4] += bv.x, d[j * 4 + 1] += bv.y, d[j * 4 + 2] += bv.x, d[j * 4 + 3] += bv.y;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = w * 16 + lane / 4 + 8 * h;
      const uint32_t off = (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) * 16) + (lane % 4) * 4;
      __nv_bfloat162 v = __floats2bfloat162_rn(d[j * 4 + 2 * h], d[j * 4 + 2 * h + 1]);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(sC + off)), "r"(*reinterpret_cast<uint32_t*>(&v))
                   : "memory");
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  named_sync(2 + c, 128);
  if (tid % 128 == 0) {
#pragma unroll
    for (int sub = 0; sub < BN / 64; ++sub) tma_store(tmC, sC + sub * 8192, n_blk * BN + sub * 64, m_blk * kBM + c * 64);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}
#endif  // TORCH_OPS_GEMM_AMAX_STUB

#ifndef TORCH_OPS_GEMM_AMAX_STUB
// Job j's amax bits from the three amax warps' (red[4 j + 1..3]).
template <int J>
__device__ __forceinline__ void job_bits(const unsigned* red, unsigned (&bits)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) bits[j] = max(max(red[4 * j + 1], red[4 * j + 2]), red[4 * j + 3]);
}

// One CTA's share of a GEMM's output tile (row-major over the tiles of
// 128 x BN): split-K rank `rank` of `split` takes k steps [k0, k0 + KL).
// The amax tiles come first in its k loop, so that the amax warps finish
// (and the last CTA records) while the consumers still multiply. Position
// p of the loop is k step k0 + (p + rot) % KL. A's tile (m_blk, kt) is
// read at positions p < a_count by the CTAs of its row: the n_tiles CTAs
// take ca steps each (n_blk * ca + p < KL); B's tile (n_blk, kt) likewise
// by the CTAs of its column, cb steps each. With rot = m_blk * cb + n_blk *
// ca each operand's tiles are covered exactly once (the other term is a
// shift common to the row / column). The producer waits for the amax warps
// (amax_free) only at positions p < held; elsewhere the consumers alone
// release a stage.
struct TilePlan {
  int m_blk, n_blk, k0, KL, a_count, b_count, held, rot;
};

template <int BN>
__device__ __forceinline__ TilePlan plan_tile(int M, int N, int K, int tile, int rank, int split, bool amax_a,
                                              bool amax_b) {
  TilePlan p;
  const int n_tiles = (N + BN - 1) / BN, m_tiles = (M + kBM - 1) / kBM;
  p.m_blk = tile / n_tiles;
  p.n_blk = tile % n_tiles;
  const int kt_all = (K + kBK - 1) / kBK, per_split = (kt_all + split - 1) / split;
  p.k0 = rank * per_split;
  p.KL = max(0, min(kt_all, p.k0 + per_split) - p.k0);
  const int ca = (p.KL + n_tiles - 1) / n_tiles, cb = (p.KL + m_tiles - 1) / m_tiles;
  p.a_count = amax_a ? max(0, min(ca, p.KL - p.n_blk * ca)) : 0;
  p.b_count = amax_b ? max(0, min(cb, p.KL - p.m_blk * cb)) : 0;
  p.held = max(p.a_count, p.b_count);
  p.rot = p.KL > 0 ? (int)(((long long)(amax_b ? p.m_blk * cb : 0) + (amax_a ? p.n_blk * ca : 0)) % p.KL) : 0;
  return p;
}

// One item of a chain CTA: GEMM `g`'s share `p` (g -1: none).
struct ChainItem {
  int g;
  TilePlan p;
};

// One CTA's work on the output tile `tile` (row-major over the tiles of 128
// x BN) of one GEMM, split-K rank `rank`: gemm_amax_kernel's and
// gemm_amax_pair_kernel's body. `ja` / `jb`: the job (of jobs.f / on,
// J of them) that A's / B's amax goes to, -1: none. `smem_raw`: the
// kernel's dynamic shared memory (the stages from its first 1024-byte
// boundary).
template <int BN, int STAGES, int LAYOUT, int SPLIT, int J, typename Jobs>
__device__ __forceinline__ void gemm_tile(const CUtensorMap& tmA, const CUtensorMap& tmB, const CUtensorMap& tmC,
                                          int M, int N, int K, int tile, int rank, int ja, int jb, const Jobs& jobs,
                                          const __nv_bfloat16* bias, uint8_t* smem_raw) {
  // [4 j + 1..3]: the amax warps' maxima of job j; from 16: the records'.
  __shared__ unsigned red[16 + kRedWords];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int A_BYTES = kBM * kBK * 2, B_BYTES = BN * kBK * 2;
  uint8_t* sA = smem;
  uint8_t* sB = smem + STAGES * A_BYTES;
  // Split-K: rank 1's partial sums land here in rank 0 (st.async), counted
  // by red_full's transaction bytes.
  float4* red_area = reinterpret_cast<float4*>(sB + STAGES * B_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(sB + STAGES * B_BYTES + (SPLIT > 1 ? kBM * BN * 4 : 0));
  uint64_t* empty = full + STAGES;
  uint64_t* amax_free = empty + STAGES;
  uint64_t* red_full = amax_free + STAGES;

  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
  const TilePlan pl = plan_tile<BN>(M, N, K, tile, rank, SPLIT, ja >= 0, jb >= 0);
  const int m_blk = pl.m_blk, n_blk = pl.n_blk, k0 = pl.k0, KL = pl.KL;
  const int a_count = pl.a_count, b_count = pl.b_count, held = pl.held, rot = pl.rot;
  const bool amax_a = ja >= 0, amax_b = jb >= 0;  // this tile's
  bool any_job = false;  // any CTA's
#pragma unroll
  for (int j = 0; j < J; ++j) any_job |= jobs.on[j] != 0;

  if (tid == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);      // the consumer warps release a stage
      mbar_init(&amax_free[s], 3);  // and, at positions p < held, the amax warps
    }
    if (SPLIT > 1) {
      mbar_init(red_full, 1);
      if (rank == 0) mbar_expect_tx(red_full, kBM * BN * 4);  // all of rank 1's partial sums
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tid < 16) red[tid] = 0u;
  __syncthreads();
  // Split-K: rank 0's red_full initialized before rank 1 stores into it
  // (rank 1's consumers wait for this barrier before their st.async,
  // every other thread at the end).
  if (SPLIT > 1) cluster_arrive_relaxed();

  if (wg == 0) {
    if (warp == 0) {
      if (lane == 0) {
        pdl_wait();  // the operands' producer is done
        for (int i = 0; i < KL; ++i) {
          const int s = i % STAGES, kt = k0 + (i + rot) % KL;
          if (i >= STAGES) mbar_wait(&empty[s], ((i / STAGES) + 1) & 1);
          if (i >= STAGES && i - STAGES < held) mbar_wait(&amax_free[s], ((i / STAGES) + 1) & 1);
          mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
          load_stage<BN, LAYOUT>(sA + s * A_BYTES, sB + s * B_BYTES, &tmA, &tmB, &full[s], m_blk, n_blk, kt);
        }
      }
    } else {
      // The amax warps: the positions p < held pass through them (they
      // release those stages too); then they record while the consumers
      // still multiply.
      const int at = tid - 32;  // 0..95
      uint32_t a_max = 0, b_max = 0;
      for (int i = 0; i < held; ++i) {
        const int s = i % STAGES;
        mbar_wait(&full[s], (i / STAGES) & 1);
        if (i < a_count) a_max = amax_tile<A_BYTES>(sA + s * A_BYTES, at, a_max);
        if (i < b_count) b_max = amax_tile<B_BYTES>(sB + s * B_BYTES, at, b_max);
        __syncwarp();
        if (lane == 0) mbar_arrive(&amax_free[s]);
      }
      a_max = __reduce_max_sync(0xFFFFFFFFu, max(a_max & 0xFFFFu, a_max >> 16));
      b_max = __reduce_max_sync(0xFFFFFFFFu, max(b_max & 0xFFFFu, b_max >> 16));
      if (lane == 0) {  // bf16 bits -> float32 bits
        if (amax_a) red[4 * ja + warp] = a_max << 16;
        if (amax_b) red[4 * jb + warp] = b_max << 16;
      }
      named_arrive(1, 352);  // the consumers may reuse the stages
      if (jobs.fast && any_job) {
        named_sync(5, 96);
        unsigned bits[J];
        job_bits(red, bits);
        named_sync(5, 96);  // red[] is reused below
        record_by_amax_warps<J>(jobs, bits, at, red + 16);
      }
    }
  } else {
    // The consumers.
    const int c = wg - 1;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    for (int i = 0; i < KL; ++i) {
      const int s = i % STAGES;
      mbar_wait(&full[s], (i / STAGES) & 1);
      wgmma_fence();
      mma_stage<BN, LAYOUT>(d, sA + s * A_BYTES, sB + s * B_BYTES, c);
      wgmma_commit();
      wgmma_wait<1>();
      if (i > 0 && lane == 0) mbar_arrive(&empty[(i - 1) % STAGES]);
    }
    wgmma_wait<0>();
    bool store = true;
    if (SPLIT > 1) {
      // Rank 1 sends its partial sums into rank 0's red_area (one float4
      // per thread and 4 registers, thread-minor; st.async, counted by
      // rank 0's red_full), rank 0 adds them up: no cluster barrier
      // between the k loop and the store (two cost ~2.8 us, session 19).
      const int ct = tid - 128;  // 0..255
      if (rank == 1) {
        cluster_wait();  // rank 0's red_full initialized
        const uint32_t area = mapa_u32(smem_u32(red_area), 0), bar = mapa_u32(smem_u32(red_full), 0);
#pragma unroll
        for (int q = 0; q < BN / 8; ++q)
          st_async_v4(area + (q * 256 + ct) * 16, d[4 * q], d[4 * q + 1], d[4 * q + 2], d[4 * q + 3], bar);
        store = false;
      } else {
        mbar_wait(red_full, 0);
#pragma unroll
        for (int q = 0; q < BN / 8; ++q) {
          const float4 v = red_area[q * 256 + ct];
          d[4 * q] += v.x;
          d[4 * q + 1] += v.y;
          d[4 * q + 2] += v.z;
          d[4 * q + 3] += v.w;
        }
      }
    }
    pdl_launch_dependents();
    named_sync(1, 352);  // the amax warps are done with the stages (also where nothing is stored: rank 1)
    if (store) {
      // Through shared memory (the stages, free once both warpgroups and
      // the amax warps are done with them): 128-byte swizzled 64 x 64
      // sub-tiles, one TMA store each.
      store_tile<BN>(d, smem + c * (64 * BN * 2), &tmC, bias, N, m_blk, n_blk, c, tid);
    }
  }
  // Otherwise every thread of every CTA: the amaxes into the state (the
  // last CTA records them; block_done needs the whole block).
  if (!jobs.fast && any_job) {
    __syncthreads();
    unsigned bits[J];
    job_bits(red, bits);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (!jobs.on[j]) continue;
      block_done(bits[j], jobs.f[j], red + 16, gridDim.x);
      __syncthreads();  // block_done's is_last flag, read by all, before the next call writes it
    }
  }
  if (SPLIT > 1 && !(rank == 1 && wg > 0)) {  // the start's cluster barrier (rank 1's consumers waited)
    __syncwarp();
    cluster_wait();
  }
}
#endif  // TORCH_OPS_GEMM_AMAX_STUB

template <int BN, int STAGES, int LAYOUT, int SPLIT>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_amax_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                     const __grid_constant__ CUtensorMap tmC, int M, int N, int K, const GemmAmaxJobs jobs) {
#ifdef TORCH_OPS_GEMM_AMAX_STUB
  __trap();
#else
  extern __shared__ uint8_t smem_raw[];
  gemm_tile<BN, STAGES, LAYOUT, SPLIT, 2>(tmA, tmB, tmC, M, N, K, blockIdx.x / SPLIT, blockIdx.x % SPLIT,
                                          jobs.on[0] ? 0 : -1, jobs.on[1] ? 1 : -1, jobs, jobs.bias, smem_raw);
#endif
}

// Two GEMMs in one launch (the small path's backward: dX and dW, both
// reading the gradient): GEMM 0's tiles of 128 x BN on CTAs 0 .. T0 - 1,
// GEMM 1's on the CTAs after them, each CTA as gemm_amax_kernel's (no
// split-K, no bias). Up to three records: job[g][0 / 1] is the job of
// GEMM g's A / B (-1: none), so that a tensor both GEMMs read is recorded
// once; one count of all CTAs for all jobs. GEMM 0 in layout L0, GEMM 1 in
// L1.
struct PairJobs {
  Finalize f[3];
  int on[3];
  int fast;  // as GemmAmaxJobs's
  int job[2][2];
};
struct PairDims {
  int M[2], N[2], K[2];
};

template <int BN, int STAGES, int L0, int L1>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_amax_pair_kernel(const __grid_constant__ CUtensorMap tmA0, const __grid_constant__ CUtensorMap tmB0,
                          const __grid_constant__ CUtensorMap tmC0, const __grid_constant__ CUtensorMap tmA1,
                          const __grid_constant__ CUtensorMap tmB1, const __grid_constant__ CUtensorMap tmC1,
                          const __grid_constant__ PairDims dims, const __grid_constant__ PairJobs jobs) {
#ifdef TORCH_OPS_GEMM_AMAX_STUB
  __trap();
#else
  extern __shared__ uint8_t smem_raw[];
  const int t0 = ((dims.M[0] + kBM - 1) / kBM) * ((dims.N[0] + BN - 1) / BN);
  if ((int)blockIdx.x < t0) {
    gemm_tile<BN, STAGES, L0, 1, 3>(tmA0, tmB0, tmC0, dims.M[0], dims.N[0], dims.K[0], blockIdx.x, 0, jobs.job[0][0],
                                    jobs.job[0][1], jobs, nullptr, smem_raw);
  } else {
    gemm_tile<BN, STAGES, L1, 1, 3>(tmA1, tmB1, tmC1, dims.M[1], dims.N[1], dims.K[1], blockIdx.x - t0, 0,
                                    jobs.job[1][0], jobs.job[1][1], jobs, nullptr, smem_raw);
  }
#endif
}

// gemm_amax_chain_kernel: the two GEMMs of gemm_amax_pair where one CTA per
// tile of either does not fit one wave, as one wave of CTAs that each take
// two items in a row: with `doubles` 0, CTA b computes GEMM 0's tile b,
// then the part b % S of the k steps of GEMM 1's tile b / S (S = M / N of
// the layer, 1 or 2: both items as long); otherwise (4096x1024x1024's
// backward: 128 dX tiles of 16 k steps, 32 dW tiles of 64) the first
// `doubles` CTAs each compute two of GEMM 0's tiles (2b, 2b + 1) and the
// others one half of the k steps of one of GEMM 1's tiles (S = 2). A first
// item's tile goes straight from the registers to global memory (the
// stores drain while the CTA goes on). The S CTAs of a GEMM 1 tile are one
// cluster and add up their partial tiles in shared memory: each rank the
// columns of its part, the peers' partial sums of them sent by st.async
// once its stages are free. The amax warps walk every position up to the
// last amax tile of the second item (so that no stage's phase passes them
// by); the records as gemm_amax_pair's.
#ifndef TORCH_OPS_GEMM_AMAX_STUB
// Consumer warpgroup c's 64 x BN of GEMM 0's tile (m_blk, n_blk) from its
// fragment `d` to `out` (bf16, M x N row-major, N a multiple of 8), 16 bytes
// per store: each quad's four threads trade the 4-byte pieces they hold of
// four 8-column groups (a 4 x 4 transpose by two xor shuffles), so that
// each writes one group's eight columns.
template <int BN>
__device__ __forceinline__ void store_direct(const float* d, __nv_bfloat16* out, int M, int N, int m_blk, int n_blk,
                                             int c, int ct) {
  const int lane = ct % 32, w = (ct / 32) % 4, p = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long row = (long long)m_blk * kBM + c * 64 + w * 16 + lane / 4 + 8 * h;
#pragma unroll
    for (int j0 = 0; j0 < BN / 8; j0 += 4) {
      uint32_t v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        __nv_bfloat162 b = __floats2bfloat162_rn(d[(j0 + e) * 4 + 2 * h], d[(j0 + e) * 4 + 2 * h + 1]);
        v[e] = *reinterpret_cast<uint32_t*>(&b);
      }
      {  // swap the 2 x 2 blocks off the diagonal (lanes p and p ^ 2)
        const bool hi = p & 2;
        const uint32_t s0 = __shfl_xor_sync(0xFFFFFFFFu, hi ? v[0] : v[2], 2);
        const uint32_t s1 = __shfl_xor_sync(0xFFFFFFFFu, hi ? v[1] : v[3], 2);
        if (hi) v[0] = s0, v[1] = s1;
        else v[2] = s0, v[3] = s1;
      }
      {  // transpose each 2 x 2 block (lanes p and p ^ 1)
        const bool odd = p & 1;
        const uint32_t s0 = __shfl_xor_sync(0xFFFFFFFFu, odd ? v[0] : v[1], 1);
        const uint32_t s1 = __shfl_xor_sync(0xFFFFFFFFu, odd ? v[2] : v[3], 1);
        if (odd) v[0] = s0, v[2] = s1;
        else v[1] = s0, v[3] = s1;
      }
      const int col = n_blk * BN + (j0 + p) * 8;
      if (row < M && col < N) *reinterpret_cast<uint4*>(out + row * N + col) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// A consumer warpgroup's k loop over positions [i0, i0 + n) of the ring of
// stages, accumulating into `d`; every position's stage released
// (the last one too: the ring goes on past it).
template <int BN, int STAGES, int LAYOUT>
__device__ __forceinline__ void consume(float* d, uint8_t* sA, uint8_t* sB, uint64_t* full, uint64_t* empty, int i0,
                                        int n, int c, int lane) {
  constexpr int A_BYTES = kBM * kBK * 2, B_BYTES = BN * kBK * 2;
  for (int i = i0; i < i0 + n; ++i) {
    const int s = i % STAGES;
    mbar_wait(&full[s], (i / STAGES) & 1);
    wgmma_fence();
    mma_stage<BN, LAYOUT>(d, sA + s * A_BYTES, sB + s * B_BYTES, c);
    wgmma_commit();
    wgmma_wait<1>();
    if (i > i0 && lane == 0) mbar_arrive(&empty[(i - 1) % STAGES]);
  }
  wgmma_wait<0>();
  if (n > 0 && lane == 0) mbar_arrive(&empty[(i0 + n - 1) % STAGES]);
}
#endif  // TORCH_OPS_GEMM_AMAX_STUB

template <int BN, int STAGES, int L0, int S>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_amax_chain_kernel(const __grid_constant__ CUtensorMap tmA0, const __grid_constant__ CUtensorMap tmB0,
                           const __grid_constant__ CUtensorMap tmC0, const __grid_constant__ CUtensorMap tmA1,
                           const __grid_constant__ CUtensorMap tmB1, const __grid_constant__ CUtensorMap tmC1,
                           __nv_bfloat16* out0, int doubles, const __grid_constant__ PairDims dims,
                           const __grid_constant__ PairJobs jobs) {
#ifdef TORCH_OPS_GEMM_AMAX_STUB
  __trap();
#else
  constexpr int L1 = 2, A_BYTES = kBM * kBK * 2, B_BYTES = BN * kBK * 2;
  constexpr int PART = BN / S, JQ = PART / 8;  // a rank's columns, its 8-column groups
  constexpr int SLOT = kBM * PART * 4;         // one peer's partial sums of them (bytes)
  extern __shared__ uint8_t smem_raw[];
  __shared__ unsigned red[16 + kRedWords];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sA = smem;
  uint8_t* sB = smem + STAGES * A_BYTES;
  uint64_t* full = reinterpret_cast<uint64_t*>(sB + STAGES * B_BYTES);
  uint64_t* empty = full + STAGES;
  uint64_t* amax_free = empty + STAGES;
  uint64_t* red_full = amax_free + STAGES;  // the peers' partial sums have landed
  uint64_t* peers_free = red_full + 1;      // the peers' stages are free for ours

  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
  const int b = blockIdx.x;
  const int rank = b % S;  // the CTA's rank in its cluster: its part of a GEMM 1 tile
  auto plan = [&](int g, int tile, int r, int split) {
    return plan_tile<BN>(dims.M[g], dims.N[g], dims.K[g], tile, r, split, jobs.job[g][0] >= 0,
                         jobs.job[g][1] >= 0);
  };
  ChainItem ia, ib;  // the first item and the second (g -1: none)
  if (doubles == 0) {
    ia = {0, plan(0, b, 0, 1)};
    ib = {1, plan(1, b / S, rank, S)};
  } else if (b < doubles) {
    ia = {0, plan(0, 2 * b, 0, 1)};
    ib = {0, plan(0, 2 * b + 1, 0, 1)};
  } else {
    ia = {1, plan(1, (b - doubles) / S, rank, S)};
    ib = {-1, TilePlan{}};
  }
  const int KLa = ia.p.KL, total = KLa + (ib.g >= 0 ? ib.p.KL : 0);
  const int held_b = ib.g >= 0 ? ib.p.held : 0;
  const int walk = held_b > 0 ? KLa + held_b : ia.p.held;  // the positions the amax warps pass through
  const ChainItem last = ib.g >= 0 ? ib : ia;
  bool any_job = false;
#pragma unroll
  for (int j = 0; j < 3; ++j) any_job |= jobs.on[j] != 0;

  if (tid == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(ia.g == 0 ? &tmA0 : &tmA1)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(ia.g == 0 ? &tmB0 : &tmB1)) : "memory");
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);
      mbar_init(&amax_free[s], 3);
    }
    mbar_init(red_full, 1);
    mbar_init(peers_free, S > 1 ? S - 1 : 1);
    if (S > 1 && last.g == 1) mbar_expect_tx(red_full, (S - 1) * SLOT);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tid < 16) red[tid] = 0u;
  __syncthreads();
  if (S > 1) cluster_arrive_relaxed();  // the peers' barriers initialized: waited for before any remote access
  bool cluster_waited = false;

  if (wg == 0) {
    if (warp == 0) {
      if (lane == 0) {
        pdl_wait();
        for (int i = 0; i < total; ++i) {
          const int s = i % STAGES;
          if (i >= STAGES) mbar_wait(&empty[s], ((i / STAGES) + 1) & 1);
          if (i >= STAGES && i - STAGES < walk) mbar_wait(&amax_free[s], ((i / STAGES) + 1) & 1);
          mbar_expect_tx(&full[s], A_BYTES + B_BYTES);
          const bool first = i < KLa;
          const int g = first ? ia.g : ib.g, m_blk = first ? ia.p.m_blk : ib.p.m_blk;
          const int n_blk = first ? ia.p.n_blk : ib.p.n_blk;
          const int kt = first ? ia.p.k0 + (i + ia.p.rot) % KLa : ib.p.k0 + (i - KLa + ib.p.rot) % ib.p.KL;
          if (g == 0) {
            load_stage<BN, L0>(sA + s * A_BYTES, sB + s * B_BYTES, &tmA0, &tmB0, &full[s], m_blk, n_blk, kt);
          } else {
            load_stage<BN, L1>(sA + s * A_BYTES, sB + s * B_BYTES, &tmA1, &tmB1, &full[s], m_blk, n_blk, kt);
          }
        }
      }
    } else {
      // The amax warps: A's and B's maxima of the first item, then of the second.
      const int at = tid - 32;
      uint32_t m0 = 0u, m1 = 0u, m2 = 0u, m3 = 0u;
      for (int i = 0; i < walk; ++i) {
        const int s = i % STAGES;
        mbar_wait(&full[s], (i / STAGES) & 1);
        if (i < ia.p.a_count) m0 = amax_tile<A_BYTES>(sA + s * A_BYTES, at, m0);
        if (i < ia.p.b_count) m1 = amax_tile<B_BYTES>(sB + s * B_BYTES, at, m1);
        if (i >= KLa && i - KLa < ib.p.a_count) m2 = amax_tile<A_BYTES>(sA + s * A_BYTES, at, m2);
        if (i >= KLa && i - KLa < ib.p.b_count) m3 = amax_tile<B_BYTES>(sB + s * B_BYTES, at, m3);
        __syncwarp();
        if (lane == 0) mbar_arrive(&amax_free[s]);
      }
      // Per job, this warp's maximum (both items of GEMM 0 may feed one job).
      const int ja = jobs.job[ia.g][0], jb = jobs.job[ia.g][1];
      const int jc = ib.g >= 0 ? jobs.job[ib.g][0] : -1, jd = ib.g >= 0 ? jobs.job[ib.g][1] : -1;
      m0 = __reduce_max_sync(0xFFFFFFFFu, max(m0 & 0xFFFFu, m0 >> 16)) << 16;  // bf16 bits -> float32 bits
      m1 = __reduce_max_sync(0xFFFFFFFFu, max(m1 & 0xFFFFu, m1 >> 16)) << 16;
      m2 = __reduce_max_sync(0xFFFFFFFFu, max(m2 & 0xFFFFu, m2 >> 16)) << 16;
      m3 = __reduce_max_sync(0xFFFFFFFFu, max(m3 & 0xFFFFu, m3 >> 16)) << 16;
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          const unsigned v = max(max(ja == j ? m0 : 0u, jb == j ? m1 : 0u), max(jc == j ? m2 : 0u, jd == j ? m3 : 0u));
          red[4 * j + warp] = v;
        }
      }
      named_arrive(1, 352);
      if (jobs.fast && any_job) {
        named_sync(5, 96);
        unsigned bits[3];
        job_bits(red, bits);
        named_sync(5, 96);
        record_by_amax_warps<3>(jobs, bits, at, red + 16);
      }
    }
  } else {
    const int c = wg - 1, ct = tid - 128;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    if (ia.g == 0) consume<BN, STAGES, L0>(d, sA, sB, full, empty, 0, KLa, c, lane);
    else consume<BN, STAGES, L1>(d, sA, sB, full, empty, 0, KLa, c, lane);
    if (ib.g >= 0) {  // the first item is GEMM 0's
      store_direct<BN>(d, out0, dims.M[0], dims.N[0], ia.p.m_blk, ia.p.n_blk, c, ct);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
      if (ib.g == 0) consume<BN, STAGES, L0>(d, sA, sB, full, empty, KLa, ib.p.KL, c, lane);
      else consume<BN, STAGES, L1>(d, sA, sB, full, empty, KLa, ib.p.KL, c, lane);
    }
    pdl_launch_dependents();
    named_sync(1, 352);  // both warpgroups and the amax warps are done with the stages
    if (last.g == 0) {
      store_tile<BN>(d, smem + c * (64 * BN * 2), &tmC0, nullptr, dims.N[0], last.p.m_blk, last.p.n_blk, c, tid);
    } else if (S == 1) {
      store_tile<BN>(d, smem + c * (64 * BN * 2), &tmC1, nullptr, dims.N[1], last.p.m_blk, last.p.n_blk, c, tid);
    } else {
      // Our stages are free for the peers' partial sums: say so to each,
      // and send ours of their parts once all of theirs are free.
      cluster_wait();
      cluster_waited = true;
      if (ct == 0) {
#pragma unroll
        for (int q = 0; q < S; ++q)
          if (q != rank) mbar_arrive_cluster(mapa_u32(smem_u32(peers_free), q));
      }
      mbar_wait_cluster(peers_free, 0);
#pragma unroll
      for (int q = 0; q < S; ++q) {
        if (q == rank) continue;
        const int slot = rank < q ? rank : rank - 1;  // ours among q's peers
        const uint32_t area = mapa_u32(smem_u32(smem), q) + slot * SLOT, bar = mapa_u32(smem_u32(red_full), q);
#pragma unroll
        for (int jj = 0; jj < JQ; ++jj) {
          const int j = q * JQ + jj;
          st_async_v4(area + (jj * 256 + ct) * 16, d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3], bar);
        }
      }
      mbar_wait(red_full, 0);
      // Our part: the peers' sums added, through swizzled 64 x 64 sub-tiles
      // after the receive area, one TMA store each.
      const float4* recv = reinterpret_cast<const float4*>(smem);
      uint8_t* sC = smem + (S - 1) * SLOT + c * (64 * PART * 2);
      const int w = (ct / 32) % 4;
#pragma unroll
      for (int q = 0; q < S; ++q) {
        if (q != rank) continue;
#pragma unroll
        for (int jj = 0; jj < JQ; ++jj) {
          const int j = q * JQ + jj;
#pragma unroll
          for (int sl = 0; sl < S - 1; ++sl) {
            const float4 v = recv[sl * (SLOT / 16) + jj * 256 + ct];
            d[4 * j] += v.x, d[4 * j + 1] += v.y, d[4 * j + 2] += v.z, d[4 * j + 3] += v.w;
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = w * 16 + lane / 4 + 8 * h;
            const uint32_t off = (jj / 8) * 8192 + r * 128 + (((jj % 8) ^ (r & 7)) * 16) + (lane % 4) * 4;
            __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(sC + off)), "r"(*reinterpret_cast<uint32_t*>(&v))
                         : "memory");
          }
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      named_sync(2 + c, 128);
      if (ct % 128 == 0) {
#pragma unroll
        for (int sub = 0; sub < PART / 64; ++sub)
          tma_store(&tmC1, sC + sub * 8192, last.p.n_blk * BN + rank * PART + sub * 64, last.p.m_blk * kBM + c * 64);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      }
    }
  }
  if (!jobs.fast && any_job) {  // as gemm_tile's
    __syncthreads();
    unsigned bits[3];
    job_bits(red, bits);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (!jobs.on[j]) continue;
      block_done(bits[j], jobs.f[j], red + 16, gridDim.x);
      __syncthreads();
    }
  }
  if (S > 1 && !cluster_waited) {  // the start's cluster barrier (reducing consumers waited before their remote accesses)
    __syncwarp();
    cluster_wait();
  }
#endif
}

// ------------------------------------------------------------------ host

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeFn encode_fn() {
  static const EncodeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    TORCH_OPS_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(p != nullptr && found == cudaDriverEntryPointSuccess,
                "torch_ops: no cuTensorMapEncodeTiled in the CUDA driver");
    return reinterpret_cast<EncodeFn>(p);
  }();
  return fn;
}

// A 2-D bf16 row-major (outer, inner) tensor's map, 128-byte-swizzled boxes
// of (box_outer, box_inner) elements; out-of-bounds reads are zeros.
CUtensorMap tensor_map(const at::Tensor& t, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, elem,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "gemm_amax: cuTensorMapEncodeTiled failed (", std::to_string((int)r), ")");
  return m;
}


// Shared memory of gemm_amax_kernel<BN, STAGES, *, SPLIT> (and the pair's):
// the stages, split-K's partial sums, the mbarriers, the 1024 alignment.
template <int BN, int STAGES, int SPLIT>
constexpr int gemm_smem_bytes() {
  return STAGES * (kBM * kBK * 2 + BN * kBK * 2) + (SPLIT > 1 ? kBM * BN * 4 + 8 : 0) + 3 * STAGES * 8 + 1024;
}

// Launches `Kernel` (kGemmThreads threads, `smem` bytes of dynamic shared
// memory, allowed once per device) on `blocks` CTAs in clusters of
// `cluster` along x, as a programmatic dependent launch (the kernels wait
// for their operands' producer before their first load).
template <auto Kernel, typename... Args>
void launch_gemm(int device, cudaStream_t stream, unsigned blocks, int smem, int cluster, const Args&... args) {
  static std::atomic<bool> configured[kMaxDevices];
  if (device >= 0 && device < kMaxDevices && !configured[device].load(std::memory_order_acquire)) {
    TORCH_OPS_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured[device].store(true, std::memory_order_release);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kGemmThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  int n = 1;
  if (cluster > 1) {
    attrs[1].id = cudaLaunchAttributeClusterDimension;
    attrs[1].val.clusterDim.x = cluster;
    attrs[1].val.clusterDim.y = 1;
    attrs[1].val.clusterDim.z = 1;
    n = 2;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  TORCH_OPS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, Kernel, args...));
}

template <int BN, int STAGES, int LAYOUT, int SPLIT>
void launch(int device, cudaStream_t stream, const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tc,
            int M, int N, int K, const GemmAmaxJobs& jobs) {
  const unsigned blocks = (unsigned)(((M + kBM - 1) / kBM) * ((N + BN - 1) / BN) * SPLIT);
  launch_gemm<gemm_amax_kernel<BN, STAGES, LAYOUT, SPLIT>>(device, stream, blocks,
                                                           gemm_smem_bytes<BN, STAGES, SPLIT>(), SPLIT, ta, tb, tc, M,
                                                           N, K, jobs);
}

template <int LAYOUT>
void launch_for(int device, cudaStream_t stream, const CUtensorMap& ta, const CUtensorMap& tb,
                const CUtensorMap& tc, int M, int N, int K, int bn, int split, const GemmAmaxJobs& jobs) {
  if (bn == 256) launch<256, 4, LAYOUT, 1>(device, stream, ta, tb, tc, M, N, K, jobs);
  else if (split == 2) launch<128, 5, LAYOUT, 2>(device, stream, ta, tb, tc, M, N, K, jobs);
  else launch<128, 4, LAYOUT, 1>(device, stream, ta, tb, tc, M, N, K, jobs);
}

// The two GEMMs of gemm_amax_pair in one launch, one CTA per tile.
template <int BN, int L0>
void launch_pair(int device, cudaStream_t stream, const CUtensorMap (&maps)[6], const PairDims& dims,
                 const PairJobs& jobs, int tiles) {
  constexpr int kStages = 4;
  launch_gemm<gemm_amax_pair_kernel<BN, kStages, L0, 2>>(device, stream, (unsigned)tiles,
                                                         gemm_smem_bytes<BN, kStages, 1>(), 1, maps[0], maps[1],
                                                         maps[2], maps[3], maps[4], maps[5], dims, jobs);
}

// Record job `i`'s Finalize in the state workspace `wsp`, as
// amax_record_launch lays it out: its counters at wsp + 2 + 2i, its
// scale_used at wsp + 2 + 2 * kMaxRecordJobs + i.
Finalize job_finalize(const AmaxRecord& r, unsigned* wsp, int i, int algo, double mdiv) {
  float* scratch = reinterpret_cast<float*>(wsp + 2 + 2 * kMaxRecordJobs);
  return record_finalize(r, wsp + 2 + 2 * i, scratch + i, algo, mdiv);
}

// The (M, N, K) of `a` . `b` in `layout`.
void gemm_dims(const at::Tensor& a, const at::Tensor& b, int layout, int& M, int& N, int& K) {
  M = (int)(layout == 2 ? a.size(1) : a.size(0));
  K = (int)(layout == 2 ? a.size(0) : a.size(1));
  N = (int)(layout == 0 ? b.size(0) : b.size(1));
}

// The TMA maps of `a`, `b` and `out` for 128 x 64 (A) and bn x 64 (B) boxes.
void gemm_maps(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int layout, int bn, int M, int N,
               int K, CUtensorMap* maps) {
  maps[0] = layout == 2 ? tensor_map(a, M, K, 64, 64) : tensor_map(a, K, M, 64, 128);
  maps[1] = layout == 0 ? tensor_map(b, K, N, 64, bn) : tensor_map(b, N, K, 64, 64);
  maps[2] = tensor_map(out, N, M, 64, 64);
}

bool is_sm90(int device) { return device >= 0 && device_capability(device) == 90; }

bool tma_ready(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous() && t.is_cuda() &&
         t.size(0) > 0 && t.size(1) > 0 && t.size(1) % 8 == 0 && t.size(0) < (1LL << 31) &&
         t.size(1) < (1LL << 31) && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

}  // namespace

// Whether gemm_amax runs `a`, `b` in `layout` here: bf16, 2-D, contiguous,
// 16-byte aligned, row lengths a multiple of 8 (TMA), on an sm_90 device
// (TORCH_OPS_GEMM_AMAX=0, read once, turns it off: the cuBLAS GEMMs and the
// separate state launch of before).
bool gemm_amax_applies(const at::Tensor& a, const at::Tensor& b, int layout) {
  static const bool enabled = env_choice("TORCH_OPS_GEMM_AMAX", {"0", "1"}, 1) == 1;
  if (!enabled || layout < 0 || layout > 2 || !tma_ready(a) || !tma_ready(b) || a.device() != b.device())
    return false;
  const long long k_a = layout == 2 ? a.size(0) : a.size(1);
  const long long k_b = layout == 0 ? b.size(1) : b.size(0);
  const long long n = layout == 0 ? b.size(0) : b.size(1);
  if (k_a != k_b || n % 8 != 0) return false;  // the output's rows too are TMA rows
  return is_sm90((int)a.get_device());
}

// Whether gemm_amax's output of (M, N) takes tiles of 128 x 256: where those
// fill most of the GPU (three quarters of its SMs or more).
bool gemm_amax_wide(long long M, long long N, int device) {
  const long long tiles256 = ((M + 127) / 128) * ((N + 255) / 256);
  return tiles256 * 4 >= 3LL * device_sm_count(device);
}

// Whether gemm_amax adds `bias` to an output of `n` columns like `like`'s.
bool gemm_amax_bias_applies(const at::Tensor& bias, long long n, const at::Tensor& like) {
  return bias.scalar_type() == at::kBFloat16 && bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous() &&
         bias.device() == like.device() && (reinterpret_cast<uintptr_t>(bias.data_ptr()) & 3) == 0;
}

// out (M, N) bf16 = the product of `a` and `b` in `layout` (see the top of
// this file) + `bias` (may be null: none) on each row; rec_a / rec_b (may
// be null): record that operand's amax into its history and scale as
// amax_record_launch would (delayed scaling, seeding an empty history).
// Callers check gemm_amax_applies (and gemm_amax_bias_applies) first.
at::Tensor gemm_amax(const at::Tensor& a, const at::Tensor& b, int layout, const AmaxRecord* rec_a,
                     const AmaxRecord* rec_b, int algo, double mdiv, const at::Tensor* bias) {
  TORCH_CHECK(gemm_amax_applies(a, b, layout), "gemm_amax: operands it does not take (see gemm_amax_applies)");
  int M, N, K;
  gemm_dims(a, b, layout, M, N, K);
  const c10::cuda::CUDAGuard guard(a.device());
  const int device = (int)a.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  at::Tensor out = at::empty({M, N}, a.options());

  GemmAmaxJobs jobs{};
  if (bias && bias->defined()) {
    TORCH_CHECK(gemm_amax_bias_applies(*bias, N, a), "bias: expected a contiguous bfloat16 (", std::to_string(N),
                ",) tensor on the operands' device, 4-byte aligned");
    jobs.bias = reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr());
  }
  const AmaxRecord* recs[2] = {rec_a, rec_b};
  if (rec_a || rec_b) {
    unsigned* wsp = state_workspace(a, stream);
    for (int i = 0; i < 2; ++i) {
      if (!recs[i]) continue;
      jobs.f[i] = job_finalize(*recs[i], wsp, i, algo, mdiv);
      jobs.on[i] = 1;
    }
    jobs.fast = 1;
    for (int i = 0; i < 2; ++i)
      if (jobs.on[i] && jobs.f[i].H > 96LL * kRecordPer) jobs.fast = 0;
  }
  // Tiles of 128 x 256 where they fill most of the GPU, else 128 x 128, with
  // split-K over two CTAs where those leave half of it idle and K is long.
  const int sms = device_sm_count(device);
  const long long tiles128 = (long long)((M + 127) / 128) * ((N + 127) / 128);
  const int bn = gemm_amax_wide(M, N, device) ? 256 : 128;
  const int split = (bn == 128 && tiles128 * 2 < sms && (K + 63) / 64 >= 16) ? 2 : 1;

  CUtensorMap maps[3];
  gemm_maps(a, b, out, layout, bn, M, N, K, maps);
  if (layout == 0) launch_for<0>(device, stream, maps[0], maps[1], maps[2], M, N, K, bn, split, jobs);
  else if (layout == 1) launch_for<1>(device, stream, maps[0], maps[1], maps[2], M, N, K, bn, split, jobs);
  else launch_for<2>(device, stream, maps[0], maps[1], maps[2], M, N, K, bn, split, jobs);
  return out;
}

namespace {
// The tile width of gemm_amax_pair for its GEMMs of `dims` on a GPU of
// `sms` SMs, 0 where it does not run: all tiles in one wave (one CTA per
// SM), 128 x 256 where those fill three quarters of the GPU or more (the
// fewest bytes read per multiply-add), else 128 x 128.
int pair_bn(const PairDims& dims, int sms) {
  long long t[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const int bn = 128 << i;
    for (int g = 0; g < 2; ++g) t[i] += (long long)((dims.M[g] + kBM - 1) / kBM) * ((dims.N[g] + bn - 1) / bn);
  }
  if (t[1] <= sms && t[1] * 4 >= 3LL * sms) return 256;
  return t[0] <= sms ? 128 : 0;
}

bool pair_dims(const at::Tensor& a0, const at::Tensor& b0, int layout0, const at::Tensor& a1, const at::Tensor& b1,
               PairDims& dims) {
  if ((layout0 != 0 && layout0 != 1) || !gemm_amax_applies(a0, b0, layout0) || !gemm_amax_applies(a1, b1, 2) ||
      a0.device() != a1.device())
    return false;
  gemm_dims(a0, b0, layout0, dims.M[0], dims.N[0], dims.K[0]);
  gemm_dims(a1, b1, 2, dims.M[1], dims.N[1], dims.K[1]);
  return true;
}

// gemm_amax_chain_kernel's shared memory: the pair's and two mbarriers.
constexpr int kChainSmem = gemm_smem_bytes<256, 4, 1>() + 16;

// How many clusters of `S` CTAs of gemm_amax_chain_kernel can be resident
// at once on `device` (queried once per device).
template <int S>
int chain_max_clusters(int device) {
  static std::atomic<int> cached[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 0;
  int n = cached[device].load(std::memory_order_acquire);
  if (n > 0) return n - 1;
  auto kernel = gemm_amax_chain_kernel<256, 4, 0, S>;
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  TORCH_OPS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kChainSmem));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(S * device_sm_count(device));
  cfg.blockDim = dim3(kGemmThreads);
  cfg.dynamicSmemBytes = kChainSmem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = S;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not taken then
    clusters = 0;
  }
  cached[device].store(clusters + 1, std::memory_order_release);
  return clusters;
}

// How gemm_amax_chain_kernel runs GEMMs of `dims` on `device` (S 0: it
// does not): one CTA per GEMM 0 tile followed by a part of a GEMM 1 tile
// (doubles 0; S = T0 / T1 parts, 1 or 2), or `doubles` CTAs with two GEMM 0
// tiles each beside the halves of GEMM 1's tiles (S 2) where T0 / T1 is
// larger. Either way every CTA resident at once (one wave, three quarters of
// the GPU or more, and the clusters of S), each part at least one k step,
// and the CTAs' items about as long (within 3 / 4). Tiles of 128 x 256.
// TORCH_OPS_GEMM_AMAX_CHAIN=0 (read once) turns it off.
struct ChainPlan {
  int S = 0, doubles = 0, blocks = 0;
};

ChainPlan chain_plan(const PairDims& dims, int device) {
  static const bool enabled = env_flag("TORCH_OPS_GEMM_AMAX_CHAIN", true);
  ChainPlan none;
  if (!enabled) return none;
  const int sms = device_sm_count(device);
  long long t[2], kt[2];
  for (int g = 0; g < 2; ++g) {
    t[g] = (long long)((dims.M[g] + kBM - 1) / kBM) * ((dims.N[g] + 255) / 256);
    kt[g] = (dims.K[g] + kBK - 1) / kBK;
  }
  auto fits = [&](long long blocks, long long w0, long long w1, int S) {
    return blocks <= sms && blocks * 4 >= 3LL * sms && 4 * std::min(w0, w1) >= 3 * std::max(w0, w1) &&
           kt[1] >= S && (S == 1 || chain_max_clusters<2>(device) >= blocks / 2);
  };
  if (t[0] % t[1] == 0 && (t[0] / t[1] == 1 || t[0] / t[1] == 2)) {
    const int S = (int)(t[0] / t[1]);
    if (fits(t[0], kt[0], (kt[1] + S - 1) / S, S)) return {S, 0, (int)t[0]};
    return none;
  }
  if (t[0] % 4 == 0 && fits(t[0] / 2 + 2 * t[1], 2 * kt[0], (kt[1] + 1) / 2, 2))
    return {2, (int)(t[0] / 2), (int)(t[0] / 2 + 2 * t[1])};
  return none;
}

template <int L0>
void launch_chain(int device, cudaStream_t stream, const CUtensorMap (&maps)[6], __nv_bfloat16* out0,
                  const PairDims& dims, const PairJobs& jobs, const ChainPlan& plan) {
  if (plan.S == 1)
    launch_gemm<gemm_amax_chain_kernel<256, 4, L0, 1>>(device, stream, (unsigned)plan.blocks, kChainSmem, 1, maps[0],
                                                        maps[1], maps[2], maps[3], maps[4], maps[5], out0,
                                                        plan.doubles, dims, jobs);
  else
    launch_gemm<gemm_amax_chain_kernel<256, 4, L0, 2>>(device, stream, (unsigned)plan.blocks, kChainSmem, 2, maps[0],
                                                        maps[1], maps[2], maps[3], maps[4], maps[5], out0,
                                                        plan.doubles, dims, jobs);
}
}  // namespace

// Whether gemm_amax_pair runs a0 . b0 in layout0 (0 or 1) and a1 . b1 in
// layout 2: as gemm_amax_applies for each, on one device, where all their
// tiles fit in one wave (pair_bn) or GEMM 0's do and GEMM 1's split into
// as many parts (chain_plan).
bool gemm_amax_pair_applies(const at::Tensor& a0, const at::Tensor& b0, int layout0, const at::Tensor& a1,
                            const at::Tensor& b1) {
  PairDims dims;
  if (!pair_dims(a0, b0, layout0, a1, b1, dims)) return false;
  const int device = (int)a0.get_device();
  return pair_bn(dims, device_sm_count(device)) > 0 || chain_plan(dims, device).S > 0;
}

bool gemm_amax_pair_fits(long long M, long long K, long long N, bool in_out, int device) {
  if (M >= (1LL << 31) || K >= (1LL << 31) || N >= (1LL << 31)) return false;
  // dX (M, K) = g (M, N) . W; dW = g^T x (N, K) or x^T g (K, N), over M.
  const PairDims dims{{(int)M, (int)(in_out ? K : N)}, {(int)K, (int)(in_out ? N : K)}, {(int)N, (int)M}};
  return pair_bn(dims, device_sm_count(device)) > 0 || chain_plan(dims, device).S > 0;
}

// (out0, out1) = (a0 . b0 in layout0, a1 . b1 in layout 2) in one launch
// (gemm_amax_pair_kernel), each bf16; recs: the records of a0, b0, a1, b1
// (null: none; at most three), as gemm_amax's. Callers check
// gemm_amax_pair_applies first.
std::pair<at::Tensor, at::Tensor> gemm_amax_pair(const at::Tensor& a0, const at::Tensor& b0, int layout0,
                                                 const at::Tensor& a1, const at::Tensor& b1,
                                                 const AmaxRecord* const (&recs)[4], int algo, double mdiv) {
  PairDims dims;
  const bool fits = pair_dims(a0, b0, layout0, a1, b1, dims);
  const int device = (int)a0.get_device();
  const int bn = fits ? pair_bn(dims, device_sm_count(device)) : 0;
  const ChainPlan chain = fits && bn == 0 ? chain_plan(dims, device) : ChainPlan{};
  TORCH_CHECK(bn > 0 || chain.S > 0, "gemm_amax_pair: operands it does not take (see gemm_amax_pair_applies)");
  const c10::cuda::CUDAGuard guard(a0.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  at::Tensor out0 = at::empty({dims.M[0], dims.N[0]}, a0.options());
  at::Tensor out1 = at::empty({dims.M[1], dims.N[1]}, a1.options());

  PairJobs jobs{};
  int n = 0;
  unsigned* wsp = nullptr;
  jobs.fast = 1;  // the amax warps record, unless a history is longer than they take (or nothing is recorded)
  for (int q = 0; q < 4; ++q) {
    int& slot = jobs.job[q / 2][q % 2];
    slot = -1;
    if (!recs[q]) continue;
    TORCH_CHECK(n < 3, "gemm_amax_pair: at most three records, got four");
    if (!wsp) wsp = state_workspace(a0, stream);
    jobs.f[n] = job_finalize(*recs[q], wsp, n, algo, mdiv);
    jobs.on[n] = 1;
    if (jobs.f[n].H > 96LL * kRecordPer) jobs.fast = 0;
    slot = n++;
  }
  if (n == 0) jobs.fast = 0;
  CUtensorMap maps[6];
  if (chain.S > 0) {  // gemm_amax_chain_kernel
    gemm_maps(a0, b0, out0, layout0, 256, dims.M[0], dims.N[0], dims.K[0], maps);
    gemm_maps(a1, b1, out1, 2, 256, dims.M[1], dims.N[1], dims.K[1], maps + 3);
    auto* o0 = reinterpret_cast<__nv_bfloat16*>(out0.data_ptr());
    if (layout0 == 0) launch_chain<0>(device, stream, maps, o0, dims, jobs, chain);
    else launch_chain<1>(device, stream, maps, o0, dims, jobs, chain);
    return {out0, out1};
  }
  gemm_maps(a0, b0, out0, layout0, bn, dims.M[0], dims.N[0], dims.K[0], maps);
  gemm_maps(a1, b1, out1, 2, bn, dims.M[1], dims.N[1], dims.K[1], maps + 3);
  int tiles = 0;
  for (int g = 0; g < 2; ++g) tiles += ((dims.M[g] + kBM - 1) / kBM) * ((dims.N[g] + bn - 1) / bn);
  if (bn == 256) {
    if (layout0 == 0) launch_pair<256, 0>(device, stream, maps, dims, jobs, tiles);
    else launch_pair<256, 1>(device, stream, maps, dims, jobs, tiles);
  } else {
    if (layout0 == 0) launch_pair<128, 0>(device, stream, maps, dims, jobs, tiles);
    else launch_pair<128, 1>(device, stream, maps, dims, jobs, tiles);
  }
  return {out0, out1};
}

}  // namespace torch_ops
