// Bias fallback: one pass over the GEMM output, adding in float32 and
// rounding once to the output type.
#include "kernels/bias.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace te_jax {
namespace {

__device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float Load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ void Store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void Store(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }

template <typename OutT, typename BiasT>
__global__ void AddBiasKernel(OutT* out, const BiasT* bias, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    Store(out, i, Load(out, i) + Load(bias, i % N));
}

template <typename OutT>
cudaError_t Dispatch(OutT* out, const void* bias, int bias_dtype, int64_t M, int64_t N,
                     cudaStream_t s) {
  const int64_t blocks64 = (M * N + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65536 ? blocks64 : 65536);
  switch (bias_dtype) {
    case 0: AddBiasKernel<<<blocks, 256, 0, s>>>(out, static_cast<const float*>(bias), M, N); break;
    case 1: AddBiasKernel<<<blocks, 256, 0, s>>>(out, static_cast<const __nv_bfloat16*>(bias), M, N); break;
    case 2: AddBiasKernel<<<blocks, 256, 0, s>>>(out, static_cast<const __half*>(bias), M, N); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAddBias(void* out, int out_dtype, const void* bias, int bias_dtype,
                          int64_t M, int64_t N, cudaStream_t stream) {
  if (M * N == 0) return cudaSuccess;
  switch (out_dtype) {
    case 0: return Dispatch(static_cast<float*>(out), bias, bias_dtype, M, N, stream);
    case 1: return Dispatch(static_cast<__nv_bfloat16*>(out), bias, bias_dtype, M, N, stream);
    case 2: return Dispatch(static_cast<__half*>(out), bias, bias_dtype, M, N, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace te_jax
