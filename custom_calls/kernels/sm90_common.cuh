// Helpers shared by te_jax's CUTLASS-based sm_90a GEMMs (dense blockwise and
// grouped): te_jax's native scale layouts as CuTe layouts, and the
// scheduler's raster order. Device-independent; includes CuTe.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"

namespace te_jax {
namespace sm90 {

// Rows padded as te_jax's VEC128 scale grid pads them (custom_calls/README.md).
CUTE_HOST_DEVICE int RoundUp4(int x) { return (x + 3) / 4 * 4; }
CUTE_HOST_DEVICE int KBlocks(int k) { return (k + 127) / 128; }

// The CuTe layout of te_jax's native scale grid of an operand with `rows`
// rows (CUTLASS's M or N) and contraction length k, for CUTLASS's scale
// layout type LayoutSF with `kGran` rows per scale:
//   kGran 1   (VEC128): scale (r, kb) at kb * ld + r, ld = roundup(rows, 4)
//   kGran 128 (BLK):    scale (r, kb) at (r / 128) * ld + kb, ld = roundup(ceil(k/128), 4)
// `ld` < 0 takes those defaults; the grouped GEMM passes its compact
// per-group ld (CUTLASS's grouped mainloop reads each group's scales compact,
// whatever layout it is given). The layout claims exactly `rows` rows; the dense
// GEMM passes roundup(rows, 4) for a 1x128 operand, because CUTLASS's bulk
// copy of those scales asks for a multiple of 4 (the padding rows exist in
// te_jax's grid; their results are never stored).
template <class LayoutSF, int kGran>
CUTE_HOST_DEVICE LayoutSF NativeScaleLayout(int rows, int k, int ld = -1) {
  using namespace cute;
  const int kb = KBlocks(k);
  if constexpr (kGran == 1) {
    if (ld < 0) ld = RoundUp4(rows);
    return LayoutSF(make_shape(make_shape(Int<1>{}, rows), make_shape(Int<128>{}, kb), 1),
                    make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * kb));
  } else {
    static_assert(kGran == 128, "te_jax scales are 1x128 or 128x128");
    const int rb = (rows + 127) / 128;
    if (ld < 0) ld = RoundUp4(kb);
    return LayoutSF(make_shape(make_shape(Int<128>{}, rb), make_shape(Int<128>{}, kb), 1),
                    make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * rb));
  }
}

// TileOrder::raster (0 heuristic, 1 along M, 2 along N) as CUTLASS's enum.
inline cutlass::gemm::kernel::detail::RasterOrderOptions RasterOrder(int raster) {
  using R = cutlass::gemm::kernel::detail::RasterOrderOptions;
  return raster == 1 ? R::AlongM : raster == 2 ? R::AlongN : R::Heuristic;
}

// Initializes and enqueues a CUTLASS device-level GEMM (GemmUniversalAdapter)
// on `stream`: argument errors as cudaErrorInvalidValue, launch errors as
// CUDA reports them.
template <class Gemm>
cudaError_t RunCutlass(const typename Gemm::Arguments& args, void* workspace,
                       cudaStream_t stream) {
  Gemm gemm;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? cudaErrorLaunchFailure : e;
  }
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace te_jax
