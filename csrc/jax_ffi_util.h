// Helpers the XLA FFI custom calls share (jax_ffi.cpp, jax_quantize.cu).
#pragma once

#include <cstddef>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace keras_fp8_ffi {

// A buffer's dimensions as Python writes a shape, for error messages:
// "(2, 3)", "(5,)".
inline std::string dims_str(const xla::ffi::AnyBuffer& b) {
  std::string s = "(";
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

}  // namespace keras_fp8_ffi
