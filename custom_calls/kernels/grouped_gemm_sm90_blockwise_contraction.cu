// Grouped FP8 GEMM variant (gemm_sm90.cuh): blockwise, contraction grouped
// (wgrad): both operands 1x128 along tokens.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kBlockwiseContraction, Fp8::kE4M3, Fp8::kE4M3, true, false, 1, 1, 2)
