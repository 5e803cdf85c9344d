// Grouped GEMM variant (gemm_sm90.cuh): bf16 x bf16, no scales, fp32
// accumulation, 128x128x64 tiles; rows grouped (fprop, dgrad) and
// contraction grouped (wgrad): the FP8-off layers' grouped GEMMs.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kBf16, GroupedScaling::kNone, OperandType::kBF16, OperandType::kBF16,
                           false, 1, 1, 2)
