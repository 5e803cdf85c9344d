// Grouped FP8 GEMM variant (gemm_sm90.cuh): blockwise, contraction grouped
// (wgrad): both operands 1x128 along tokens, float32 output (the wgrad of
// float32 weights).
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kBlockwiseContractionF32, GroupedScaling::kBlockwise,
                           OperandType::kE4M3, OperandType::kE4M3, false, 1, 1, 2, false,
                           OutputType::kF32)
