// Hopper (sm_90a) FP8 GEMMs built on CUTLASS: the plain interface.
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

// FP8 element type of an operand.
enum class Fp8 : int { kE4M3 = 0, kE5M2 = 1 };

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

// One compiled kernel configuration each. Names: scale kinds of CUTLASS's A
// and B ("Vec" 1x128, "Blk" 128x128), schedule, CTA tile (M x N of CUTLASS's
// problem), cluster. "Swap" variants compute out^T = b @ a^T (CUTLASS's A is
// te_jax's b, the output is written column-major), which lets the token
// dimension take a tile that is not a multiple of 128.
#define TE_JAX_SM90_BLOCKWISE_VARIANTS(X)                                      \
  X(kVecBlkCoop128x128C1x2, "vecblk_coop_128x128_c1x2", kVec128, kBlk128x128) \
  X(kVecBlkCoop128x128C2x1, "vecblk_coop_128x128_c2x1", kVec128, kBlk128x128) \
  X(kVecBlkPing64x128C1x2, "vecblk_ping_64x128_c1x2", kVec128, kBlk128x128)   \
  X(kSwapBlkVecCoop128x192C2x1, "swap_blkvec_coop_128x192_c2x1", kVec128, kBlk128x128) \
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
// scheduler these variants use); the caller provides them.
size_t BlockwiseGemmWorkspace(BlockwiseVariant v, const BlockwiseGemmArgs& args, int sm_count);

// Enqueues the GEMM on `stream`; allocates nothing and never synchronizes.
// sm_count: the device's multiprocessor count (the persistent grid's size).
cudaError_t LaunchBlockwiseGemm(BlockwiseVariant v, const BlockwiseGemmArgs& args,
                                void* workspace, size_t workspace_bytes, int sm_count,
                                cudaStream_t stream);

}  // namespace sm90
}  // namespace te_jax
