// Grouped FP8 GEMM variant (gemm_sm90.cuh): blockwise, rows grouped (fprop,
// dgrad): 1x128 activation / gradient x 128x128 expert weight blocks.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kBlockwiseRows, GroupedScaling::kBlockwise, OperandType::kE4M3,
                           OperandType::kE4M3, false, 1, 128, 2)
