// LayerNorm / RMSNorm kernels (plain CUDA, no XLA headers): the row
// statistics pass of the fused normalization + FP8 quantize (whose FP8
// output the tile kernels of kernels/act_quantize.cu write through
// Prologue::kNorm, kernels/prologue.h) and the fused backward. See
// normalization.cu; the FFI handlers are in ffi/normalization.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/quantize.h"

namespace te_jax {

// Row statistics of x (M, H), in float32:
//   layernorm (mean != nullptr): mean = sum(x) / H,
//     rstd = 1 / sqrt(sum((x - mean)^2) / H + epsilon);
//   rmsnorm (mean == nullptr): rstd = 1 / sqrt(sum(x^2) / H + epsilon).
// With amax_out also max|v| over v = prologue::NormValue(x, mean, rstd,
// gamma', beta) (current scaling's amax, the same values the kNorm tile
// kernels quantize, bit for bit); zeroed first.
struct NormStatsArgs {
  const void* x = nullptr;  // (M, H) row-major, element type `in`
  int64_t M = 0, H = 0;
  InType in = InType::kBF16;
  float epsilon = 0.f;
  float* mean = nullptr;  // (M,), or nullptr for rmsnorm
  float* rstd = nullptr;  // (M,)
  // Only with amax_out: float32 (H,) gamma and beta (or nullptr); the
  // scale is 1 + gamma when zero_centered != 0.
  const float* gamma = nullptr;
  const float* beta = nullptr;
  int zero_centered = 0;
  float* amax_out = nullptr;
};

cudaError_t LaunchNormStats(const NormStatsArgs& a, cudaStream_t stream);

// The largest H the backward kernel takes (1024 threads x 8 columns).
constexpr int64_t kNormBwdMaxHidden = 8192;

// Backward of v = norm(x) given dy = dL/dv (M, H), float32 arithmetic:
//   xhat = (x - mean) * rstd (layernorm) or x * rstd (rmsnorm),
//   g = dy * gamma', c1 = sum(g) / H, c2 = sum(g * xhat) / H (per row),
//   dx = ((g - c1) - xhat * c2) * rstd  (rmsnorm: (g - xhat * c2) * rstd),
//   dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy.
// `blocks` CUDA blocks each take the rows b, b + blocks, ... and write their
// partial dgamma (and dbeta) sums to partial (P, blocks, H), P = 2 with
// dbeta, else 1; a second kernel sums those in a fixed order. Deterministic.
struct NormBwdArgs {
  const void* dy = nullptr;  // (M, H), element type `in`
  // (M, H) `in` or nullptr: the cotangent is dy + dy_add, summed in `in` (the
  // two uses of a normalized input, e.g. a query projection's and the keys'
  // and values'), so the sum is never written.
  const void* dy_add = nullptr;
  // (M, H) `in` or nullptr: added to dx (dx rounded to `in` first, then the
  // sum: as an add of the two arrays would), e.g. the cotangent of a
  // residual connection around the normalized branch.
  const void* dx_add = nullptr;
  const void* x = nullptr;   // (M, H), element type `in`
  InType in = InType::kBF16;
  int64_t M = 0, H = 0;
  const float* gamma = nullptr;  // (H,)
  const float* mean = nullptr;   // (M,), or nullptr for rmsnorm
  const float* rstd = nullptr;   // (M,)
  int zero_centered = 0;
  void* dx = nullptr;          // (M, H), element type `in`
  float* dgamma = nullptr;     // (H,)
  float* dbeta = nullptr;      // (H,), or nullptr (rmsnorm)
  float* partial = nullptr;    // (P, blocks, H) scratch
  int64_t blocks = 0;          // 1 .. 65535
};

cudaError_t LaunchNormBackward(const NormBwdArgs& a, cudaStream_t stream);

}  // namespace te_jax
