// Hopper (sm_90a) FP8 GEMMs (and the bf16 grouped GEMM) built on CUTLASS: the
// plain interface.
//
// This header includes no CUTLASS: the kernels live in
// blockwise_gemm_sm90_*.cu and grouped_gemm_sm90_*.cu (one translation unit
// per kernel configuration, so they compile in parallel), and callers (the
// benchmark harnesses now, an FFI handler later) see only these functions.
//
// Layouts are te_jax's (custom_calls/README.md, "Scale layouts"): row-major
// a (M, K) and b (N, K), both K-contiguous ("TN"), out (M, N) row-major
// bfloat16, out = a @ b^T. Block scales are the native layouts the quantize
// kernels write and cuBLASLt reads, so no relayout is needed:
//   VEC128 (1x128 along K):  (ceil(K/128), roundup(rows, 4)) floats, rows contiguous;
//   BLK128x128:               (ceil(rows/128), roundup(ceil(K/128), 4)), K-blocks contiguous.
// Numerics: the tensor cores' partial sums are scaled and added into fp32
// accumulators once per 128 of K (CUTLASS's blockwise mainloop), as
// DeepSeek-V3 prescribes; the output is rounded to bfloat16 once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace te_jax {
namespace sm90 {

// The numbers of custom_calls/ffi/gemm.cc's a_mode / b_mode attributes.
enum class ScaleMode : int { kTensor = 0, kVec128 = 1, kBlk128x128 = 2 };

// Element type of a grouped GEMM operand: FP8 (E4M3, E5M2) or, for the
// FP8-off grouped GEMM, bfloat16.
enum class OperandType : int { kE4M3 = 0, kE5M2 = 1, kBF16 = 2 };
constexpr int OperandBytes(OperandType t) { return t == OperandType::kBF16 ? 2 : 1; }

// Element type of a grouped GEMM's output.
enum class OutputType : int { kBF16 = 0, kF32 = 1 };
constexpr int OutputBytes(OutputType t) { return t == OutputType::kF32 ? 4 : 2; }

// Scheduler knobs read at run time (no recompilation): the order in which a
// persistent CTA walks output tiles and the width of the swizzled band.
struct TileOrder {
  int raster = 0;   // 0 heuristic, 1 along M, 2 along N
  int swizzle = 1;  // 1, 2, 4 or 8
};

// ---------------------------------------------------------------- dense ----

// out (m, n) = a (m, k) @ b (n, k)^T with block scales. m, n, k >= 1;
// k % 16 == 0 and n % 8 == 0 (16-byte rows for the bulk copies); pointers
// 16-byte aligned.
struct BlockwiseGemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;       // (m, k) E4M3
  const void* b = nullptr;       // (n, k) E4M3
  const float* a_sinv = nullptr;
  const float* b_sinv = nullptr;
  ScaleMode a_mode = ScaleMode::kVec128;
  ScaleMode b_mode = ScaleMode::kBlk128x128;
  void* out = nullptr;           // (m, n) bfloat16
  TileOrder order;
};

// One compiled kernel configuration each. Names: scale kinds of a and b
// ("vec" 1x128, "blk" 128x128), schedule, CTA tile (M x N), cluster,
// tile scheduler (persistent data-parallel unless "streamk").
#define TE_JAX_SM90_BLOCKWISE_VARIANTS(X)                                                   \
  X(kVecBlkCoop128x128C1x2, "vecblk_coop_128x128_c1x2", kVec128, kBlk128x128)               \
  X(kVecBlkCoop128x128C2x1, "vecblk_coop_128x128_c2x1", kVec128, kBlk128x128)               \
  X(kVecBlkPing64x128C1x2, "vecblk_ping_64x128_c1x2", kVec128, kBlk128x128)                 \
  X(kVecBlkCoop128x128C1x2StreamK, "vecblk_coop_128x128_c1x2_streamk", kVec128, kBlk128x128) \
  X(kVecVecCoop128x128C1x2, "vecvec_coop_128x128_c1x2", kVec128, kVec128)

enum class BlockwiseVariant : int {
#define TE_JAX_X(id, name, a_mode, b_mode) id,
  TE_JAX_SM90_BLOCKWISE_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
  kCount
};

const char* BlockwiseVariantName(BlockwiseVariant v);

// nullptr when variant v can run args, else why not (a static string).
const char* CheckBlockwiseGemm(BlockwiseVariant v, const BlockwiseGemmArgs& args);

// Scratch bytes the launch needs (0 for the persistent data-parallel
// scheduler; stream-K's partial tiles); the caller provides them.
size_t BlockwiseGemmWorkspace(BlockwiseVariant v, const BlockwiseGemmArgs& args, int sm_count);

// Enqueues the GEMM on `stream`; allocates nothing and never synchronizes.
// sm_count: the device's multiprocessor count (the persistent grid's size).
cudaError_t LaunchBlockwiseGemm(BlockwiseVariant v, const BlockwiseGemmArgs& args,
                                void* workspace, size_t workspace_bytes, int sm_count,
                                cudaStream_t stream);

// -------------------------------------------------------------- grouped ----

// Grouped GEMM over consecutive groups (mixture of experts), FP8 or bf16
// operands (fp32 accumulation, bfloat16 output), with the group sizes read
// from the device (jax.lax.ragged_dot's `group_sizes`), so the launch has
// no data-dependent shapes and no host synchronization: a
// setup kernel turns group_sizes into the per-group problem shapes and
// pointers CUTLASS's grouped GEMM reads from device memory, and a fill
// kernel writes what no group covers.
//
// kRows (fprop, dgrad): out (m, n) = for each group g, its rows of a (m, k)
//   @ b[g]^T, b (G, n, k). Rows after the last group are written as 0 (as
//   ragged_dot does). Group g's rows start at sum(group_sizes[:g]).
// kContraction (wgrad): out (G, m, n) = for each group g, a[:, cols_g] @
//   b[:, cols_g]^T over its columns (tokens) of a (m, k) and b (n, k); an
//   empty group's (m, n) block is written as 0.
// kContractionRowMajor (wgrad, bf16 only): out (G, k, n) = for each group
//   g, a[rows_g]^T @ b[rows_g] over its rows (tokens) of the row-major a
//   (m, k) and b (m, n): the activations and gradients as stored, read
//   contiguous along k and n (MN-major, which wgmma takes for 16-bit
//   operands only); an empty group's (k, n) block is written as 0.
//
// Scales:
//   kNone (bf16 x bf16, the FP8-off GEMMs): none; a_sinv and b_sinv are
//     ignored (may be null); alpha 1.
//   kTensor: a_sinv (1,); b_sinv (G,) one per expert weight for kRows, (1,)
//     for kContraction (both operands are activations / gradients).
//   kBlockwise, kRows: a VEC128, group g's (rows, k-blocks) compact from
//     start_g * kb with k-block stride size_g; b BLK128x128 per expert,
//     compact (G, ceil(n/128), ceil(k/128)).
//   kBlockwise, kContraction: a and b VEC128 along the contraction (tokens),
//     compact (ceil(k/128), m) and (ceil(k/128), n).
//   (In buffers of the native layouts' sizes; grouped_gemm_cuda.py lays them
//   out: CUTLASS's grouped mainloop reads each group's scales compact.)
// Group sizes: any size >= 0 for kRows and kContractionRowMajor (a group's
// rows start at start * k and start * n elements: 16-byte aligned whenever
// k and n are multiples of 8); for kContraction multiples of 16
// bytes of the operand (16 FP8 or 8 bf16 elements: each group's slice of a
// row must start on a 16-byte boundary for TMA) and, blockwise, of 128 (so
// no scale block straddles two groups); the caller pads each group to the
// recipe's token block (FP8-off layers pad none: their wgrad takes
// kContractionRowMajor). A group that breaks this (by its size, or
// by its start after such a group), a negative size, or sizes summing past
// the buffer make that group's output NaN (the kernel
// cannot raise from the device; NaN surfaces); with InvalidFill::kAll the
// whole output is NaN then, as te_jax's reference has it (a negative size
// owns no rows, so only kAll makes it visible along the rows).
enum class GroupedAxis : int { kRows = 0, kContraction = 1, kContractionRowMajor = 2 };
enum class GroupedScaling : int { kTensor = 0, kBlockwise = 1, kNone = 2 };
enum class InvalidFill : int { kGroup = 0, kAll = 1 };

struct GroupedGemmArgs {
  GroupedAxis axis = GroupedAxis::kRows;
  GroupedScaling scaling = GroupedScaling::kTensor;
  int64_t groups = 0;                   // G >= 1
  int64_t m = 0, n = 0, k = 0;          // see above; k * element bytes % 16 == 0, n % 8 == 0
                                        // (kContractionRowMajor: m the grouped rows)
  const int32_t* group_sizes = nullptr;  // (G,) on the device
  const void* a = nullptr;
  const void* b = nullptr;
  const float* a_sinv = nullptr;       // unused (may be null) for kNone
  const float* b_sinv = nullptr;
  void* out = nullptr;                  // bfloat16, float32 for the f32 variants
  TileOrder order;
  InvalidFill invalid_fill = InvalidFill::kGroup;  // what an invalid group poisons
};

// Each: element types of a and b, scaling, accumulation, output. "split": partial
// sums promoted to fp32 every 128 of K (per-tensor: CUTLASS's promotion
// interval of 4 wgmma k-steps); "fast": the tensor cores' own accumulation
// (per-tensor fprop only, as te_jax's fast_accum). HYBRID gradients are E5M2
// (a = the gradient in dgrad). "bf16": bf16 x bf16, no scales, the
// tensor cores' fp32 accumulation (the reduced-precision accumulation that
// split promotion corrects is FP8 wgmma's), kRows and kContraction;
// "bf16_mn_major": the same arithmetic, kContractionRowMajor only. The
// "_f32" variants write float32 (kContraction only): an FP8 wgrad of float32
// weights, whose gradient a bfloat16 output would round and a separate pass
// widen (reading 2 and writing 4 bytes an element of every expert's weight);
// e4m3 (a) x e5m2 (b) is HYBRID's x.T and grad.T in their own order, so the
// (G, k, n) result needs no transpose either.
#define TE_JAX_SM90_GROUPED_VARIANTS(X)                                                     \
  X(kTensorE4M3Split, "tensor_e4m3_split", kTensor, kE4M3, kE4M3, kBF16)                    \
  X(kTensorE4M3Fast, "tensor_e4m3_fast", kTensor, kE4M3, kE4M3, kBF16)                      \
  X(kTensorE5M2E4M3Split, "tensor_e5m2xe4m3_split", kTensor, kE5M2, kE4M3, kBF16)           \
  X(kBlockwiseRows, "blockwise_rows_vecblk", kBlockwise, kE4M3, kE4M3, kBF16)               \
  X(kBlockwiseContraction, "blockwise_contraction_vecvec", kBlockwise, kE4M3, kE4M3, kBF16) \
  X(kBf16, "bf16", kNone, kBF16, kBF16, kBF16)                                              \
  X(kBf16MnMajor, "bf16_mn_major", kNone, kBF16, kBF16, kBF16)                              \
  X(kTensorE4M3SplitF32, "tensor_e4m3_split_f32", kTensor, kE4M3, kE4M3, kF32)              \
  X(kTensorE4M3E5M2SplitF32, "tensor_e4m3xe5m2_split_f32", kTensor, kE4M3, kE5M2, kF32)     \
  X(kBlockwiseContractionF32, "blockwise_contraction_vecvec_f32", kBlockwise, kE4M3, kE4M3, \
    kF32)

enum class GroupedVariant : int {
#define TE_JAX_X(id, name, scaling, a_type, b_type, out_type) id,
  TE_JAX_SM90_GROUPED_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
  kCount
};

const char* GroupedVariantName(GroupedVariant v);

// Whether variant v's kernel serves grouped axis a.
bool GroupedVariantServes(GroupedVariant v, GroupedAxis a);

// nullptr when variant v can run args (host-visible checks only: shapes,
// pointers, the variant's scaling and axis), else why not.
const char* CheckGroupedGemm(GroupedVariant v, const GroupedGemmArgs& args);

// Scratch bytes: the per-group arrays the setup kernel writes plus CUTLASS's
// own (TMA descriptors per SM). Depends on G, the variant and sm_count only.
size_t GroupedGemmWorkspace(GroupedVariant v, const GroupedGemmArgs& args, int sm_count);

// Enqueues setup, GEMM and fill on `stream`: three kernels, no allocation,
// no synchronization (valid under stream capture).
cudaError_t LaunchGroupedGemm(GroupedVariant v, const GroupedGemmArgs& args, void* workspace,
                              size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace sm90
}  // namespace te_jax
