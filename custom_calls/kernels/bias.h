// out[m, n] += bias[n] in place (fallback when cuBLASLt has no BIAS epilogue
// for the GEMM's types). Plain CUDA, no XLA headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {

// dtype codes: 0 float32, 1 bfloat16, 2 float16 (same as InType).
cudaError_t LaunchAddBias(void* out, int out_dtype, const void* bias, int bias_dtype,
                          int64_t M, int64_t N, cudaStream_t stream);

}  // namespace te_jax
