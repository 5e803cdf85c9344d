// Blockwise FP8 GEMM variant (gemm_sm90.cuh): 1x128 a x 128x128 b,
// cooperative schedule (two consumer warpgroups of 64 rows), 128x128 CTA
// tile, clusters of 2 CTAs along N sharing a's tile by TMA multicast.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecBlkCoop128x128C1x2, 128, 128, 1, 2, false, 1, 128, false)
