#pragma once
// The framework-free FP8 kernels: the one header their callers include.
// Namespace fp8_kernels; no PyTorch, no XLA. The torch bindings (common.h,
// quantize.cu, fold.cu, block.cu, gemm.cpp, linear.cpp) and the JAX FFI
// entries (jax_quantize.cu, jax_ffi.cpp) call these entry points on raw
// device pointers. Numerics: torch_ops/reference.py is the reference of
// every rule, byte for byte where they quantize, bit for bit where they
// update state (docs/numerics.md); the constants (FP8 maxima, the minimum
// scale, the history limit, the format and algorithm ids) are in
// cuda_common.h, and torch_ops's extension checks them against the
// reference's when it loads.
//
// Every entry point enqueues work on the given stream and returns at once
// (nothing is read back on the host: CUDA-graph capturable); every pointer
// is device memory on the current device; CUDA errors throw
// fp8_kernels::CudaError, cuBLASLt errors fp8_kernels::cublaslt::Error.
//
// quantize_run(const QuantizeCall& call)                (quantize_kernels.cuh)
//   Quantizes a contiguous row-major x (R, C) (bfloat16, float16 or
//   float32: `x_type`) to FP8 (`fmt`: kE4M3 or kE5M2) with one read of x:
//   q (R, ldq) and/or q_t (C, ldqt) (null: not written; columns past C or R
//   up to ldq/ldqt are written as zero bytes), its amax (float32, `amax_out`;
//   NaN or inf where x holds one) and the scale it used (`scale_used`).
//   `scale_mode` 0: quantize with *scale_in; 1 (delayed): *scale_in, or a
//   scale seeded from this call's amax while `hist_for_empty` holds only
//   zeros; 2 (current): a scale from this call's amax (*scale_in, may be
//   null for 1.0, where that amax is 0 or not finite). With `history`
//   (H entries) and `scale_state`, records the amax (iff finite) and writes
//   the next scale, margin factor `mdiv` (2**margin), algorithm `algo`
//   (kAmaxMax, kAmaxMostRecent). `extras`: a FoldJob the launch's last
//   block runs after the update, or the gradient channel written into
//   amax_out instead of the amax. Requires `workspace`: kWsWords zeroed
//   32-bit words for the stream (left zero again).
//
// record_amax_run(history, H, scale, amax, fmt, algo, mdiv, skip_zero, stream)
//                                                       (quantize_kernels.cuh)
//   Records *amax into history (H entries, newest first) iff finite (and
//   > 0 with skip_zero), then writes the next scale into *scale. One block.
//
// fold_run(const FoldJob& job, cudaStream_t stream)     (fold_block.cuh)
//   Folds a pending output-gradient amax into the gradient's scaling state
//   (reference: fold_pending_grad_amax): updates job.history (H <=
//   kMaxHistoryLen), job.scale and job.fold_state in place and writes the
//   token and copies of the new scale and history. One block.
//
// block_scaling::quantize_tile_rows_kernel, quantize_tile_columns_kernel,
// quantize_blocks_kernel                                (block_kernels.cuh)
//   Block-scaling quantize: a scale per 1 x 128 tile or 128 x 128 block,
//   in the layouts cuBLASLt's block-scaled GEMMs read; the launch shapes
//   are in block_kernels.cuh.
//
// cublaslt::scaled_gemm(const GemmCall& call) -> GemmStatus   (lt_gemm.h)
//   out (M, N) = (a @ b^T) * *scale_a * *scale_b (+ bias) for FP8 a (M, K)
//   and b (N, K), K contiguous, rows 16-byte aligned, through cuBLASLt with
//   float32 accumulation (`fast_accum`: cuBLASLt's fast FP8 accumulation)
//   and one rounding to the output type. Requires a workspace of
//   kWorkspaceBytes per stream. Returns kDone, kBiasNotAdded (the caller
//   adds the bias) or kNoKernel (nothing launched).
//
// The device code is compiled by nvcc only: a host-compiler translation
// unit gets the constants, the call descriptions and the GEMM, an nvcc one
// the constants, the call descriptions and the kernels.

#include "cuda_common.h"

// The GEMM is host code, for host-compiler translation units (gemm.cpp,
// jax_ffi.cpp; they need cuBLASLt's headers).
#ifndef __CUDACC__
#include "lt_gemm.h"
#endif

namespace fp8_kernels {
namespace {
inline void quantize_run(const QuantizeCall& call);
inline void record_amax_run(float* history, long long H, float* scale, const float* amax, int fmt, int algo,
                            float mdiv, bool skip_zero, cudaStream_t stream);
inline void fold_run(const FoldJob& job, cudaStream_t stream);
}  // namespace
}  // namespace fp8_kernels

#ifdef __CUDACC__
#include "block_kernels.cuh"
#include "fold_block.cuh"
#include "quantize_kernels.cuh"
#endif
