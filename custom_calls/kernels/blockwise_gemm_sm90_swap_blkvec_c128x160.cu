// Blockwise FP8 GEMM variant (gemm_sm90.cuh): out^T = b @ a^T, so CUTLASS's
// M is the weight dimension (128x128 scales force a tile multiple of 128
// there) and its N the token dimension (1x128 scales: any tile), which takes
// a 160-wide tile: 128x160 per CTA, cooperative, clusters of 2 along M.
// (192 wide spills in the mainloop: 96 + 96 accumulator registers per thread
// plus 48 token scales exceed the consumers' 232.)
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kSwapBlkVecCoop128x160C2x1, 128, 160, 2, 1, false, 128, 1, true)
