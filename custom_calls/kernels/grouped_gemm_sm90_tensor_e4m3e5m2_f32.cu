// Grouped FP8 GEMM variant (gemm_sm90.cuh): per-tensor scaling, E4M3 (a: x.T)
// x E5M2 (b: HYBRID's grad.T), fp32 promotion every 128 of K, float32 output
// (the wgrad of float32 weights, in its (G, k, n) order).
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kTensorE4M3E5M2SplitF32, GroupedScaling::kTensor, OperandType::kE4M3,
                           OperandType::kE5M2, false, 1, 1, 2, false, OutputType::kF32)
