#pragma once
// Error checks shared by the extension's translation units.
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#define TORCH_OPS_CUDA_CHECK(expr)                                                     \
  do {                                                                                 \
    cudaError_t err__ = (expr);                                                        \
    TORCH_CHECK(err__ == cudaSuccess, "torch_ops: CUDA error in ", #expr, ": ",        \
                cudaGetErrorString(err__), " (", __FILE__, ":", __LINE__, ")");       \
  } while (0)
