// Grouped FP8 GEMM variant (gemm_sm90.cuh): per-tensor scaling, E4M3 x E4M3,
// fp32 promotion every 128 of K, float32 output (the wgrad of float32 weights).
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kTensorE4M3SplitF32, GroupedScaling::kTensor, OperandType::kE4M3,
                           OperandType::kE4M3, false, 1, 1, 2, false, OutputType::kF32)
