// Grouped GEMM variants (gemm_sm90.cuh): bf16 x bf16, no scales, fp32
// accumulation, 128x128x64 tiles. kBf16: both operands contiguous along K,
// rows grouped (fprop, dgrad) and contraction grouped (wgrad over (k, m) and
// (n, m) operands). kBf16MnMajor: the FP8-off wgrad over the row-major
// activations (m, k) and gradients (m, n) as stored, grouped over m
// (GroupedAxis::kContractionRowMajor), read contiguous along k and n.
#include "kernels/grouped_gemm_sm90_impl.cuh"

TE_JAX_SM90_DEFINE_GROUPED(kBf16, GroupedScaling::kNone, OperandType::kBF16, OperandType::kBF16,
                           false, 1, 1, 2)
TE_JAX_SM90_DEFINE_GROUPED(kBf16MnMajor, GroupedScaling::kNone, OperandType::kBF16,
                           OperandType::kBF16, false, 1, 1, 2, true)
