// Grouped FP8 GEMM variant (gemm_sm90.cuh): per-tensor scaling, E4M3 x E4M3,
// the tensor cores' own accumulation (te_jax's fast_accum, fprop).
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kTensorE4M3Fast, GroupedScaling::kTensor, OperandType::kE4M3,
                           OperandType::kE4M3, true, 1, 1, 2)
