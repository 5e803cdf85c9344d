// Blockwise FP8 GEMM variant (gemm_sm90.cuh): as vecblk_coop_128x128_c1x2
// with CUTLASS's stream-K scheduler, for shapes whose tile count leaves the
// last wave part-empty (e.g. 4096 x 7168: 1,792 tiles on 132 SMs, 13.6 waves).
#include "kernels/blockwise_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_BLOCKWISE(kVecBlkCoop128x128C1x2StreamK, 128, 128, 1, 2, false, 1, 128, true)
