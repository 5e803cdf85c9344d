// Blockwise FP8 GEMM variant (gemm_sm90.cuh): as vecblk_coop_128x128_c1x2,
// with clusters of 2 CTAs along M sharing b's (the weight's) tile.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecBlkCoop128x128C2x1, 128, 128, 2, 1, false, 1, 128, false)
