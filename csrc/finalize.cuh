#pragma once
// The state update of an amax by the last block of a launch: `Finalize`
// describes it (workspace counters, history, scales, the seed rule), each
// block calls `block_done` with its amax bits at its end, and the last one
// records the amax (history shift, next scale; docs/numerics.md), seeds a
// scale where there was none, and runs the launch's extras (fold_block.cuh).
// Used by the quantize kernels (quantize.cu). Every thread of the block must call
// block_done; any block of whole warps (up to 1024 threads).

#include <cuda_runtime.h>

#include "cuda_common.h"
#include "fold_block.cuh"

namespace fp8_kernels {
namespace {

constexpr int kRedWords = 64;  // shared words of the block reductions (two values)
constexpr int kHistPer = 8;    // history entries per thread in the one-pass finalize

__device__ __forceinline__ unsigned abs_bits(float v) {
  return __float_as_uint(v) & 0x7fffffffu;
}

struct Finalize {
  unsigned* ws;            // [0] amax bits, [1] block counter (zero before the launch; the last block resets them)
  float* amax_out;         // 0-d, may be null
  float* history;          // null: do not record
  long long H;
  float* scale_state;      // next scale is written here when recording
  const float* scale_used; // the scale this call quantized with
  int algo;                // kAmaxMax or kAmaxMostRecent
  float fmax;
  float mdiv;              // the margin's factor, 2**margin as float32
  int skip_zero;
  // Amax-only calls (no fp8 output) skip the pre-pass: the last block derives
  // scale_used itself. 0: scale_used is given; 1: delayed seed rule (from
  // amax iff max(history) == 0, else *prev_scale); 2: current (from amax).
  int seed_mode;
  const float* prev_scale;   // may be null (current scaling: 1.0)
  const float* seed_history;  // mode 1: the history as it was before this call
  long long seed_H;
  float* scale_used_out;
  // Delayed scaling without a pre-pass (the lean kernels, seed_mode 1):
  // 0: off (scale_used is given or comes from a pre-pass);
  // 1: the main launch: each warp reads the history itself; not empty (every
  //    call after the first): it quantizes with *prev_scale, the state's
  //    scale, and the last block finalizes as usual; empty: no fp8 output,
  //    the last block only publishes the amax in `seed` for the fallback;
  // 2: the fallback launched after it: returns at once unless `seed` says the
  //    history was empty, else quantizes with the scale seeded from that amax
  //    and finalizes (then clears `seed`).
  int split = 0;
  unsigned* seed = nullptr;  // [0] amax bits, [1] 1 when the fallback must run (zero otherwise)
  QuantizeExtras extras;     // the last block's extra work (common.h)
};

// max(window * f32(1/fmax), 2**-126) * f32(2**margin) for a finite, positive
// window, else `prev` (torch_ops/reference.py's compute_scale); `mdiv`
// carries 2**margin.
__device__ __forceinline__ float compute_scale(float window, float prev, float fmax, float mdiv) {
  if (isfinite(window) && window > 0.f) return fmaxf(window * (1.0f / fmax), kMinScale) * mdiv;
  return prev;
}

__device__ __forceinline__ unsigned block_reduce_max(unsigned v, unsigned* smem) {
  v = __reduce_max_sync(0xffffffffu, v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // smem may be in use by a previous reduction
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned w = lane < (int)(blockDim.x >> 5) ? smem[lane] : 0u;
    w = __reduce_max_sync(0xffffffffu, w);
    if (lane == 0) smem[0] = w;
  }
  __syncthreads();
  unsigned r = smem[0];
  return r;
}

// As torch.amax over a history: NaN wins (its bits are above inf's); a
// negative entry (never written by us) counts as 0.
__device__ __forceinline__ unsigned window_bits(float h) {
  const unsigned b = __float_as_uint(h);
  return isnan(h) ? 0x7fc00000u : ((b & 0x80000000u) ? 0u : b);
}

// History update by all threads of one block: shift toward higher index,
// write slot 0, then next scale from the window. Only called when recording.
__device__ void record_in_block(float amax, const Finalize& f, unsigned* smem) {
  bool ok = isfinite(amax);
  if (f.skip_zero) ok = ok && amax > 0.f;
  const long long H = f.H;
  if (ok && H > 0) {
    // Descending chunks: each chunk is read completely before it is written,
    // and the element it overwrites above has already moved.
    const long long B = blockDim.x;
    for (long long base = ((H - 2) / B) * B; base >= 0; base -= B) {
      long long i = base + threadIdx.x;
      float v = 0.f;
      bool mv = i < H - 1;
      if (mv) v = f.history[i];
      __syncthreads();
      if (mv) f.history[i + 1] = v;
      __syncthreads();
      if (base == 0) break;
    }
    if (threadIdx.x == 0) f.history[0] = amax;
    __syncthreads();
  }
  float window;
  if (f.algo == kAmaxMostRecent) {
    window = H > 0 ? f.history[0] : 0.f;
  } else {
    unsigned m = 0u;
    for (long long i = threadIdx.x; i < H; i += blockDim.x) m = max(m, window_bits(f.history[i]));
    m = block_reduce_max(m, smem);
    window = __uint_as_float(m);
  }
  if (threadIdx.x == 0) *f.scale_state = compute_scale(window, *f.scale_used, f.fmax, f.mdiv);
}

// Max of two values over the block (warp maxima in smem[0..31] and
// smem[32..63]); every thread gets both. Also a barrier.
__device__ __forceinline__ void block_reduce_max2(unsigned& a, unsigned& b, unsigned* smem) {
  a = __reduce_max_sync(0xffffffffu, a);
  b = __reduce_max_sync(0xffffffffu, b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    smem[warp] = a;
    smem[32 + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const bool in = lane < (int)(blockDim.x >> 5);
    unsigned wa = in ? smem[lane] : 0u, wb = in ? smem[32 + lane] : 0u;
    wa = __reduce_max_sync(0xffffffffu, wa);
    wb = __reduce_max_sync(0xffffffffu, wb);
    if (lane == 0) {
      smem[0] = wa;
      smem[32] = wb;
    }
  }
  __syncthreads();
  a = smem[0];
  b = smem[32];
}

// The record's two scale rules (finalize_one_pass). The scale this call quantized
// with: from its amax where it seeds (`from_amax`: current scaling, or an
// empty history), else the state's `prev`.
__device__ __forceinline__ float record_scale_used(float amax, float prev, bool from_amax, const Finalize& f) {
  return from_amax ? compute_scale(amax, prev, f.fmax, f.mdiv) : prev;
}
// The next scale from the history of H entries after this call: most_recent
// (algo 1) its newest entry (`amax` where it was shifted in, else the
// newest before, `newest`), max (algo 0) the window's maximum bits `m`.
__device__ __forceinline__ float record_next_scale(float amax, bool shifted, float newest, unsigned m, long long H,
                                                   float used, const Finalize& f) {
  const float window = f.algo == kAmaxMostRecent ? (H > 0 ? (shifted ? amax : newest) : 0.f) : __uint_as_float(m);
  return compute_scale(window, used, f.fmax, f.mdiv);
}

// The last block's seed + record in one pass over the history: each thread
// holds up to kHistPer entries in registers, one two-value reduction gives
// "history not empty" (seed rule) and the window max after the shift, then
// the shifted history is written back. Same results as block_done's seed
// check + record_in_block (which remain for histories longer than
// kHistPer * blockDim.x, or a seed history other than the recorded one).
// Returns false where it does not apply (nothing done then).
__device__ bool finalize_one_pass(float amax, const Finalize& f, unsigned* smem) {
  if (f.seed_mode == 1 && f.history && f.seed_history != f.history) return false;
  const float* h = f.history ? f.history : (f.seed_mode == 1 ? f.seed_history : nullptr);
  const long long H = f.history ? f.H : (f.seed_mode == 1 ? f.seed_H : 0);
  if (H > (long long)kHistPer * blockDim.x) return false;
  bool ok = isfinite(amax);
  if (f.skip_zero) ok = ok && amax > 0.f;
  const bool shift = f.history != nullptr && ok && H > 0;
  float v[kHistPer];
  unsigned nonzero = 0u, m = 0u;
#pragma unroll
  for (int k = 0; k < kHistPer; ++k) {
    const long long i = threadIdx.x + (long long)k * blockDim.x;
    v[k] = 0.f;
    if (h && i < H) {
      v[k] = h[i];
      nonzero |= abs_bits(v[k]) ? 1u : 0u;
      if (!shift || i < H - 1) m = max(m, window_bits(v[k]));  // entries that stay in the window
    }
  }
  if (shift && threadIdx.x == 0) m = max(m, window_bits(amax));
  block_reduce_max2(nonzero, m, smem);  // every read is done before the writes below
  if (shift) {
#pragma unroll
    for (int k = 0; k < kHistPer; ++k) {
      const long long i = threadIdx.x + (long long)k * blockDim.x;
      if (i < H - 1) f.history[i + 1] = v[k];
    }
    if (threadIdx.x == 0) f.history[0] = amax;
  }
  if (threadIdx.x == 0) {
    float used;
    if (f.seed_mode) {
      const float prev = f.prev_scale ? *f.prev_scale : 1.0f;
      used = record_scale_used(amax, prev, f.seed_mode == 2 || nonzero == 0u, f);
      *f.scale_used_out = used;
    } else {
      used = *f.scale_used;
    }
    // v[0] of thread 0 is the newest entry before this call.
    if (f.history) *f.scale_state = record_next_scale(amax, shift, v[0], m, H, used, f);
  }
  return true;
}

// Programmatic dependent launch (sm_90 and later): the delayed pre-pass lets
// the lean quantize kernel launched after it start at once; that kernel
// issues its first loads (x is complete: the pre-pass, launched normally,
// started after x's producer finished) and waits for the pre-pass's grid
// to complete and its writes to be visible before it reads scale_used.
// Without a pre-pass (Finalize::split), the lean kernel's fallback launch
// is the early one: resident before the main launch ends, it waits for it
// and (nearly always) returns at once.
// Both instructions do nothing where the launch did not ask for it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether every entry of the history is +-0 (the seed rule: max(history) ==
// 0, as the pre-pass and finalize_one_pass read it); the same answer in
// every lane of the warp. The newest entry first: nonzero on nearly every
// call after the first, then nothing else is read.
__device__ __forceinline__ bool history_empty(const float* h, long long H) {
  if (H > 0 && abs_bits(h[0])) return false;
  unsigned nonzero = 0u;
  for (long long i = threadIdx.x & 31; i < H; i += 32) nonzero |= abs_bits(h[i]);
  return !__any_sync(0xffffffffu, nonzero != 0u);
}

// The scale a lean kernel's warp quantizes with, and whether it writes fp8
// output at all (false: the split main launch found the history empty).
__device__ __forceinline__ float lean_scale(const Finalize& f, bool& write) {
  write = true;
  if (f.split == 0) return *f.scale_used;
  const float prev = *f.prev_scale;
  if (f.split == 2) return compute_scale(__uint_as_float(f.seed[0]), prev, f.fmax, f.mdiv);
  write = !history_empty(f.seed_history, f.seed_H);
  return prev;
}

// The split fallback launch (Finalize::split == 2): after the main launch
// has completed, whether this launch has anything to do (the same answer in
// every thread). Other launches: true.
__device__ __forceinline__ bool lean_fallback_needed(const Finalize& f) {
  if (f.split != 2) return true;
  pdl_wait();
  return *reinterpret_cast<volatile unsigned*>(f.seed + 1) != 0u;
}

// Called by every block at its end with the block's amax bits (thread 0's
// value is the block max). The last block finalizes.
__device__ void block_done(unsigned block_max, const Finalize& f, unsigned* smem, unsigned nblocks) {
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    if (block_max) atomicMax(&f.ws[0], block_max);
    __threadfence();
    unsigned prev = atomicAdd(&f.ws[1], 1u);
    is_last = (prev == nblocks - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  float amax = __uint_as_float(atomicAdd(&f.ws[0], 0u));
  if (f.split == 1 && history_empty(f.seed_history, f.seed_H)) {
    // Nothing was quantized: the fallback launch seeds the scale from this
    // amax and does the whole call (amax_out, history and scales included).
    if (threadIdx.x == 0) {
      f.seed[0] = __float_as_uint(amax);
      f.seed[1] = 1u;
      f.ws[0] = 0u;
      f.ws[1] = 0u;
    }
    return;
  }
  if (threadIdx.x == 0 && f.amax_out) {
    const QuantizeExtras& e = f.extras;
    if (e.emit_n == 0) {
      *f.amax_out = amax;
    } else {
      f.amax_out[0] = isfinite(amax) ? amax : 0.0f;
      if (e.emit_n == 3) {
        f.amax_out[1] = e.emit_token ? *e.emit_token : 0.0f;
        f.amax_out[2] = 0.0f;
      }
    }
  }
  if (!finalize_one_pass(amax, f, smem)) {
    if (f.seed_mode) {
      bool from_amax = true;
      if (f.seed_mode == 1) {
        unsigned m = 0u;
        for (long long i = threadIdx.x; i < f.seed_H; i += blockDim.x)
          m = max(m, abs_bits(f.seed_history[i]) ? 1u : 0u);
        from_amax = block_reduce_max(m, smem) == 0u;
      }
      if (threadIdx.x == 0) {
        const float prev = f.prev_scale ? *f.prev_scale : 1.0f;
        *f.scale_used_out = from_amax ? compute_scale(amax, prev, f.fmax, f.mdiv) : prev;
      }
      __syncthreads();
    }
    if (f.history) record_in_block(amax, f, smem);
  }
  __syncthreads();
  if (f.extras.fold.pending) fold_block(f.extras.fold);
  if (threadIdx.x == 0) {
    f.ws[0] = 0u;
    f.ws[1] = 0u;
    if (f.split == 2) {
      // Every block of this launch read the flag before it counted itself in.
      f.seed[0] = 0u;
      f.seed[1] = 0u;
    }
  }
}

// The largest finite value of an FP8 format (0 E4M3, 1 E5M2).
inline float fmax_of(int fmt) { return (float)(fmt == kE5M2 ? kE5M2Max : kE4M3Max); }

}  // namespace
}  // namespace fp8_kernels
