// Grouped FP8 GEMM variant (gemm_sm90.cuh): per-tensor scaling, E5M2 gradient
// x E4M3 (HYBRID dgrad and wgrad), fp32 promotion every 128 of K.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kTensorE5M2E4M3Split, GroupedScaling::kTensor, OperandType::kE5M2,
                           OperandType::kE4M3, false, 1, 1, 2)
