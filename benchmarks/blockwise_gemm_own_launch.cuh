// Host side of te_jax's own sm_90a blockwise GEMM (blockwise_gemm_own.cuh):
// the TMA maps, the shape checks, the persistent launch and the
// configurations the harness (blockwise_gemm_own.cu) checks and times.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; the encoder is fetched at run time)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "blockwise_gemm_own.cuh"

namespace te_jax {
namespace own {

// ------------------------------------------------------------------ host --

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's tensor-map encoder, fetched through the runtime so that
// nothing links libcuda directly.
inline EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// TMA map of a (rows, k) e4m3 row-major matrix: boxes of 128 (K, = one
// 128-byte swizzle row) x box_rows, zero fill past the edges.
inline bool MakeMap(CUtensorMap* map, const void* ptr, long rows, long k, int box_rows) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k)};
  const cuuint32_t box[2] = {128, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box,
             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA map of a scale grid, `outer` rows of `ld` floats (te_jax's native
// layouts: ld a multiple of 4, rows 16-byte aligned), boxes of box_inner x
// box_outer floats, no swizzle, zero fill past the edges.
inline bool MakeScaleMap(CUtensorMap* map, const float* ptr, long outer, long ld, int box_inner,
                         int box_outer) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(ld), cuuint64_t(outer)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 4};
  const cuuint32_t box[2] = {cuuint32_t(box_inner), cuuint32_t(box_outer)};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(ptr), dims, strides, box,
             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA map of the (m, n) bf16 output for stores of 64 x 64 boxes, 128B
// swizzle (one box row = 128 B), clipped at the edges.
inline bool MakeOutMap(CUtensorMap* map, void* ptr, long m, long n) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(n), cuuint64_t(m)};
  const cuuint64_t strides[1] = {cuuint64_t(n) * 2};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// nullptr when a configuration of cluster size `cluster` (TMA-loaded scales
// when `tma_scales`, TMA-stored output when `tma_store`) can run p, else why not.
inline const char* CheckShape(const GemmArgs& p, int cluster, bool tma_scales = false,
                              bool tma_store = false, bool b_vec = false) {
  if (p.b_vec != b_vec)
    return b_vec ? "this configuration scales b per 1x128 (wgrad); the operands' b is 128x128"
                 : "this configuration scales b per 128x128; the operands' b is 1x128 (wgrad)";
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return "empty problem";
  if (p.m % 128 || p.n % 128 || p.k % 128) return "M, N and K must be multiples of 128";
  if (cluster == 2 && p.m % 256) return "cluster 2 needs M % 256 == 0";
  if (p.m >= (1L << 31) || p.n >= (1L << 31) || p.k >= (1L << 31)) return "a dimension >= 2^31";
  if (p.a_ld < p.m || p.b_ld < (b_vec ? p.n : p.k / 128)) return "scale grid smaller than the problem";
  if (reinterpret_cast<uintptr_t>(p.a) % 16 || reinterpret_cast<uintptr_t>(p.b) % 16 ||
      reinterpret_cast<uintptr_t>(p.out) % 4)
    return "a, b must be 16-byte aligned, out 4-byte aligned";
  if (tma_scales && (p.a_ld % 4 || p.b_ld % 4 || reinterpret_cast<uintptr_t>(p.a_sinv) % 16 ||
                     reinterpret_cast<uintptr_t>(p.b_sinv) % 16))
    return "TMA-loaded scales need a_ld, b_ld % 4 == 0 and 16-byte aligned scale grids";
  if (tma_store && reinterpret_cast<uintptr_t>(p.out) % 16)
    return "a TMA-stored output must be 16-byte aligned";
  if (p.group < 1) return "group must be >= 1";
  return nullptr;
}

// The launch configuration of C (its grid left to the caller): 384 threads,
// C's shared memory, clusters of C::kCluster along x. `attr` must outlive it.
template <class C>
cudaLaunchConfig_t LaunchConfig(cudaLaunchAttribute (&attr)[1], cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C::kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(384);
  cfg.dynamicSmemBytes = C::kSmem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = C::kCluster > 1 ? 1 : 0;
  return cfg;
}

// CTAs a persistent launch of configuration C runs on `sms` SMs (before the
// cap at one per tile): every SM, or for clusters of 2 as many clusters as
// the occupancy API says fit at once (GPCs with an odd SM count fit fewer
// than sms / 2; a grid beyond that would run a second, tail wave).
template <class C>
int ResidentCtas(int sms) {
  static int units = -1;  // one per configuration (template)
  if (units >= 0) return units * C::kCluster;
  auto* kernel = BlockwiseGemmKernel<C>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(C::kSmem)) != cudaSuccess)
    return -1;
  units = sms;
  if (C::kCluster > 1) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = LaunchConfig<C>(attr, 0);
    cfg.gridDim = dim3(sms / C::kCluster * C::kCluster);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      units = -1;
      return -1;
    }
    units = clusters > 0 ? clusters : sms / C::kCluster;
    // TE_JAX_OWN_CLUSTERS=N overrides the query (N clusters), to time the
    // cluster-2 configurations on every SM whatever it answered.
    if (const char* force = std::getenv("TE_JAX_OWN_CLUSTERS")) units = std::atoi(force);
  }
  return units * C::kCluster;
}

template <class C>
cudaError_t Launch(const GemmArgs& p, int sms, cudaStream_t stream) {
  if (CheckShape(p, C::kCluster, C::kScaleTma, C::kTmaStore, C::kBVec)) return cudaErrorInvalidValue;
  CUtensorMap map_a, map_b, map_sa{}, map_sb{}, map_out{};
  if (!MakeMap(&map_a, p.a, p.m, p.k, 128) ||
      !MakeMap(&map_b, p.b, p.n, p.k, C::kCluster == 1 ? C::BN : C::BN / 2))
    return cudaErrorInvalidValue;
  // a's scales: (K/128, a_ld), a box of the tile's 128 rows of one k-block;
  // b's: (ceil(N/128), b_ld), a box of 4 k-blocks (from a multiple of 4:
  // b_ld % 4 == 0 keeps it inside the grid) x the tile's 2 block rows,
  // or (kBVec) (K/128, b_ld), a box of the tile's BN columns of one k-block.
  if (C::kScaleTma &&
      (!MakeScaleMap(&map_sa, p.a_sinv, p.k / 128, p.a_ld, 128, 1) ||
       !(C::kBVec ? MakeScaleMap(&map_sb, p.b_sinv, p.k / 128, p.b_ld, C::BN, 1)
                  : MakeScaleMap(&map_sb, p.b_sinv, (p.n + 127) / 128, p.b_ld, 4, 2))))
    return cudaErrorInvalidValue;
  if (C::kTmaStore && !MakeOutMap(&map_out, p.out, p.m, p.n)) return cudaErrorInvalidValue;
  const int ctas = ResidentCtas<C>(sms);
  if (ctas <= 0) return cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = LaunchConfig<C>(attr, stream);
  const long tiles = (p.m / 128 / C::kCluster) * ((p.n + C::BN - 1) / C::BN);
  cfg.gridDim = dim3(static_cast<unsigned>(std::min<long>(tiles, ctas / C::kCluster) * C::kCluster));
  return cudaLaunchKernelEx(&cfg, BlockwiseGemmKernel<C>, map_a, map_b, map_sa, map_sb, map_out,
                            p);
}

// The configurations the harness times (one template instance each).
// `diagnostic`: times one part of the design, computes no correct GEMM (the
// harness neither checks nor ranks it).
struct Config {
  const char* name;
  int bn, stages, cluster;
  bool double_acc;
  int scale_load;  // ScaleLoad
  bool tma_store, b_vec;
  int diagnostic;
  cudaError_t (*launch)(const GemmArgs&, int sms, cudaStream_t);
  int (*resident_ctas)(int sms);
  bool tma_scales() const { return scale_load != kScalesGlobal; }  // any scale by TMA
};
inline std::vector<Config> Configs() {
// name, BN, stages, two accumulators, cluster, scale load (ScaleLoad),
// TMA stores, diagnostic; _VEC: b scaled per 1x128 (wgrad).
#define TE_JAX_OWN_CFG(name, bn, st, dbl, cl, scales, store, diag)                             \
  {name, bn, st, cl, dbl, scales, store, false, diag,                                         \
   Launch<Cfg<bn, st, dbl, cl, scales, diag, store>>,                                         \
   ResidentCtas<Cfg<bn, st, dbl, cl, scales, diag, store>>}
#define TE_JAX_OWN_CFG_VEC(name, bn, st, dbl, cl, store)                                      \
  {name, bn, st, cl, dbl, kScalesTma, store, true, kNone,                                     \
   Launch<Cfg<bn, st, dbl, cl, kScalesTma, kNone, store, true>>,                              \
   ResidentCtas<Cfg<bn, st, dbl, cl, kScalesTma, kNone, store, true>>}
  return {
      TE_JAX_OWN_CFG("n128_s6_dbl", 128, 6, true, 1, kScalesGlobal, false, kNone),
      TE_JAX_OWN_CFG("n128_s6_dbl_tma", 128, 6, true, 1, kScalesTma, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_dbl_tma_st", 128, 5, true, 1, kScalesTma, true, kNone),
      TE_JAX_OWN_CFG("n128_s6_dbl_st", 128, 6, true, 1, kScalesGlobal, true, kNone),
      // a's scales by TMA, b's two from global memory.
      TE_JAX_OWN_CFG("n128_s6_dbl_tmaa", 128, 6, true, 1, kScalesTmaA, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_dbl_tmaa_st", 128, 5, true, 1, kScalesTmaA, true, kNone),
      TE_JAX_OWN_CFG("n128_s6", 128, 6, false, 1, kScalesGlobal, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_tma_st", 128, 5, false, 1, kScalesTma, true, kNone),
      TE_JAX_OWN_CFG("n160_s6", 160, 6, false, 1, kScalesGlobal, false, kNone),
      TE_JAX_OWN_CFG("n160_s6_tma", 160, 6, false, 1, kScalesTma, false, kNone),
      TE_JAX_OWN_CFG("n192_s4_tma_st", 192, 4, false, 1, kScalesTma, true, kNone),
      TE_JAX_OWN_CFG("n128_s6_dbl_c2", 128, 6, true, 2, kScalesGlobal, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_dbl_tma_st_c2", 128, 5, true, 2, kScalesTma, true, kNone),
      // Diagnostics: the pipeline without the promotion.
      TE_JAX_OWN_CFG("diag_nopromote_n128", 128, 6, false, 1, kScalesGlobal, false, kNoPromote),
      TE_JAX_OWN_CFG("diag_nopromote_n128_s5_st", 128, 5, false, 1, kScalesGlobal, true,
                     kNoPromote),
      TE_JAX_OWN_CFG("diag_nopromote_n128_c2", 128, 6, false, 2, kScalesGlobal, false, kNoPromote),
      // ... and the math warps without data: promotion with one and two accumulators.
      TE_JAX_OWN_CFG("diag_noload_n128", 128, 6, false, 1, kScalesGlobal, false, kNoLoad),
      TE_JAX_OWN_CFG("diag_noload_n128_dbl", 128, 6, true, 1, kScalesGlobal, false, kNoLoad),
      // wgrad: 1x128 x 1x128.
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s6_dbl", 128, 6, true, 1, false),
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s5_dbl_st", 128, 5, true, 1, true),
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s5_st", 128, 5, false, 1, true),
  };
#undef TE_JAX_OWN_CFG
#undef TE_JAX_OWN_CFG_VEC
}

}  // namespace own
}  // namespace te_jax
