// Blockwise FP8 GEMM variant (gemm_sm90.cuh): 1x128 a x 128x128 b, ping-pong
// schedule (each consumer warpgroup owns a 64x128 tile; one's epilogue runs
// while the other computes), clusters of 2 along N.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecBlkPing64x128C1x2, 64, 128, 1, 2, true, 1, 128, false)
