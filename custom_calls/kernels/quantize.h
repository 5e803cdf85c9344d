// FP8 quantize kernels (plain CUDA, no XLA headers). See quantize.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {

enum class InType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };

// How scales are chosen; each CUDA block handles one 128x128 tile of x.
enum class ScaleMode : int {
  kTensor = 0,    // one scale for the whole tensor (given or from amax_in)
  kVec128 = 1,    // 1x128 rowwise tiles (+ 128x1 tiles for the columnwise copy)
  kBlock128 = 2,  // 128x128 blocks (the columnwise copy reuses the scale)
};

struct QuantizeArgs {
  const void* x = nullptr;  // (M, K) row-major
  int64_t M = 0, K = 0;
  InType in = InType::kBF16;
  Fp8Type out = Fp8Type::kE4M3;
  ScaleMode mode = ScaleMode::kTensor;
  bool pow2 = false;             // blockwise: round scales down to 2^n
  uint8_t* data = nullptr;       // (M, K) FP8
  uint8_t* data_t = nullptr;     // (K, M) FP8, or null for no columnwise copy
  // kTensor: exactly one of `scale` (given) or `amax_in` (current scaling:
  // scale computed on device) is set.
  const float* scale = nullptr;
  const float* amax_in = nullptr;
  float* amax_out = nullptr;     // kTensor: atomicMax target (zeroed by caller)
  float* scale_inv = nullptr;    // kTensor+amax_in: 1/scale written by block 0
  // Blockwise scale_inv in the layouts cuBLASLt reads (see quantize.cu).
  float* sinv = nullptr;
  float* sinv_t = nullptr;
  int64_t sinv_ld = 0, sinv_t_ld = 0;
};

// Launches the tiled quantize (+ transpose) kernel on `stream`.
cudaError_t LaunchQuantize(const QuantizeArgs& args, cudaStream_t stream);

// amax_out = max(|x|) over n elements (NaN-propagating); zeroes it first.
cudaError_t LaunchAmax(const void* x, int64_t n, InType in, float* amax_out,
                       cudaStream_t stream);

}  // namespace te_jax
