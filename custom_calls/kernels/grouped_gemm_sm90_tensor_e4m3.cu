// Grouped FP8 GEMM variant (gemm_sm90.cuh): per-tensor scaling, E4M3 x E4M3,
// fp32 promotion every 128 of K.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kTensorE4M3Split, GroupedScaling::kTensor, OperandType::kE4M3,
                           OperandType::kE4M3, false, 1, 1, 2)
