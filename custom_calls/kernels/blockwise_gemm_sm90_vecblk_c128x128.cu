// Blockwise FP8 GEMM variants (gemm_sm90.cuh): 1x128 a x 128x128 b,
// cooperative schedule, 128x128 CTA tile, clusters of 2 along N or M.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecBlkCoop128x128C1x2, 128, 128, 1, 2, false, 1, 128, false)
