// Helpers shared by the FFI handler files: CUDA/cuBLAS status -> ffi::Error.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

inline xla::ffi::Error CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string("te_jax ") + what + ": CUDA error " +
                                   cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace te_jax
