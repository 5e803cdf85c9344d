// Blockwise FP8 GEMM variant (gemm_sm90.cuh): out^T = b @ a^T, so CUTLASS's
// M is the weight dimension (128x128 scales force a tile multiple of 128
// there) and its N the token dimension (1x128 scales: any tile), which takes
// a 192-wide tile: 128x192 per CTA, cooperative, clusters of 2 along M.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kSwapBlkVecCoop128x192C2x1, 128, 192, 2, 1, false, 128, 1, true)
