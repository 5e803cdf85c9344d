// Blockwise FP8 GEMM variant (gemm_sm90.cuh) for wgrad: 1x128 a x 1x128 b
// (both operands are transposed activations / gradients tiled along tokens),
// cooperative, 128x128 CTA tile, clusters of 2 along N.
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecVecCoop128x128C1x2, 128, 128, 1, 2, false, 1, 1, false)
