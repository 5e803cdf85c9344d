// CUTLASS 4.x instantiation of te_jax's blockwise-scaled FP8 GEMM (sm_90a).
// Included only by the per-configuration translation units
// blockwise_gemm_sm90_<variant>.cu; callers use gemm_sm90.cuh.
//
// Built on CUTLASS's Hopper blockwise mainloop
// (KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise): TMA loads of
// the FP8 tiles, warp-specialized producer / consumer warpgroups, wgmma into
// a temporary accumulator that is scaled by scale_a * scale_b and added into
// the fp32 accumulator after every 128 of K.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "kernels/gemm_sm90.cuh"
#include "kernels/sm90_common.cuh"

namespace te_jax {
namespace sm90 {

// One kernel configuration. kGranA / kGranB: rows per scale of a and b
// (1 = a VEC128 operand, 128 = a BLK128x128 operand); kStreamK: CUTLASS's
// stream-K tile scheduler (splits the K loop of the last wave's tiles over
// idle CTAs; needs workspace) instead of the persistent data-parallel one.
// CUTLASS's A is te_jax's a, B its b, D its out, all as laid out in memory.
template <int kTileM, int kTileN, int kClusterM, int kClusterN, bool kPingpong, int kGranA,
          int kGranB, bool kStreamK>
struct BlockwiseConfig {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major = (N, K) row-major
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  // A VEC128 operand's scales are rows-contiguous (MN-major), a BLK128x128
  // operand's K-contiguous (K-major): te_jax's native layouts.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      kGranA, kGranB, 128,
      kGranA == 1 ? cute::GMMA::Major::MN : cute::GMMA::Major::K,
      kGranB == 1 ? cute::GMMA::Major::MN : cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopSchedule =
      cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule =
      cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                          cutlass::epilogue::TmaWarpSpecializedCooperative>;
  static constexpr int kAlignD = 8;  // 16 bytes of bfloat16

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignD,  // no C operand: D = accumulator
      ElementD, LayoutD, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, 16,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Scheduler = cute::conditional_t<kStreamK, cutlass::gemm::StreamKScheduler,
                                        cutlass::gemm::PersistentScheduler>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;

  // The CUTLASS arguments of te_jax's problem (no device access).
  static Arguments MakeArguments(const BlockwiseGemmArgs& p, int sm_count) {
    const int M = static_cast<int>(p.m), N = static_cast<int>(p.n), K = static_cast<int>(p.k);
    const StrideA stride_a = cute::make_stride(int64_t(K), cute::_1{}, int64_t(0));
    const StrideB stride_b = cute::make_stride(int64_t(K), cute::_1{}, int64_t(0));
    const StrideD stride_d = cute::make_stride(int64_t(N), cute::_1{}, int64_t(0));
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = sm_count;
    Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                   {M, N, K, 1},
                   {static_cast<const ElementA*>(p.a), stride_a,
                    static_cast<const ElementB*>(p.b), stride_b, p.a_sinv,
                    NativeScaleLayout<LayoutSFA, kGranA>(kGranA == 1 ? RoundUp4(M) : M, K),
                    p.b_sinv,
                    NativeScaleLayout<LayoutSFB, kGranB>(kGranB == 1 ? RoundUp4(N) : N, K)},
                   {{}, nullptr, stride_d, static_cast<ElementD*>(p.out), stride_d},
                   hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.scheduler.raster_order = RasterOrder(p.order.raster);
    args.scheduler.max_swizzle_size = p.order.swizzle;
    return args;
  }

  static const char* Check(const BlockwiseGemmArgs& p) {
    if (p.m < 1 || p.n < 1 || p.k < 1) return "m, n and k must be >= 1";
    if (p.k % 16) return "k must be a multiple of 16 (16-byte rows for TMA)";
    if (p.n % 8) return "n must be a multiple of 8 (16-byte output rows)";
    if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) return "dimensions exceed int32";
    if (Gemm::can_implement(MakeArguments(p, 1)) != cutlass::Status::kSuccess)
      return "CUTLASS can_implement rejected the problem";
    return nullptr;
  }

  static size_t Workspace(const BlockwiseGemmArgs& p, int sm_count) {
    return Gemm::get_workspace_size(MakeArguments(p, sm_count));
  }

  static cudaError_t Launch(const BlockwiseGemmArgs& p, void* workspace, size_t workspace_bytes,
                            int sm_count, cudaStream_t stream) {
    const Arguments args = MakeArguments(p, sm_count);
    if (Gemm::get_workspace_size(args) > workspace_bytes) return cudaErrorInvalidValue;
    return RunCutlass<Gemm>(args, workspace, stream);
  }
};

}  // namespace sm90
}  // namespace te_jax

// Defines the three entry points of one variant (declared by
// blockwise_gemm_sm90.cu's table) for a BlockwiseConfig.
#define TE_JAX_SM90_DEFINE_BLOCKWISE(id, ...)                                                 \
  namespace te_jax {                                                                          \
  namespace sm90 {                                                                            \
  namespace variants {                                                                        \
  using id##Config = BlockwiseConfig<__VA_ARGS__>;                                            \
  const char* id##Check(const BlockwiseGemmArgs& p) { return id##Config::Check(p); }          \
  size_t id##Workspace(const BlockwiseGemmArgs& p, int sms) {                                 \
    return id##Config::Workspace(p, sms);                                                     \
  }                                                                                           \
  cudaError_t id##Launch(const BlockwiseGemmArgs& p, void* ws, size_t bytes, int sms,         \
                         cudaStream_t s) {                                                    \
    return id##Config::Launch(p, ws, bytes, sms, s);                                          \
  }                                                                                           \
  }                                                                                           \
  }                                                                                           \
  }
