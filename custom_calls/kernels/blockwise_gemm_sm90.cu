// The variant table of gemm_sm90.cuh's dense blockwise GEMM: maps each
// BlockwiseVariant to the entry points its translation unit defines
// (blockwise_gemm_sm90_<variant>.cu). No CUTLASS here.
#include "kernels/gemm_sm90.cuh"

namespace te_jax {
namespace sm90 {
namespace variants {
#define TE_JAX_X(id, name, a_mode, b_mode)                                           \
  const char* id##Check(const BlockwiseGemmArgs& p);                                 \
  size_t id##Workspace(const BlockwiseGemmArgs& p, int sms);                         \
  cudaError_t id##Launch(const BlockwiseGemmArgs& p, void* ws, size_t bytes, int sms, \
                         cudaStream_t s);
TE_JAX_SM90_BLOCKWISE_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
}  // namespace variants

namespace {

struct Entry {
  const char* name;
  ScaleMode a_mode, b_mode;
  const char* (*check)(const BlockwiseGemmArgs&);
  size_t (*workspace)(const BlockwiseGemmArgs&, int);
  cudaError_t (*launch)(const BlockwiseGemmArgs&, void*, size_t, int, cudaStream_t);
};

const Entry kEntries[] = {
#define TE_JAX_X(id, name, a_mode, b_mode)                                              \
  {name, ScaleMode::a_mode, ScaleMode::b_mode, variants::id##Check, variants::id##Workspace, \
   variants::id##Launch},
    TE_JAX_SM90_BLOCKWISE_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
};

const Entry* Find(BlockwiseVariant v) {
  const int i = static_cast<int>(v);
  return i >= 0 && i < static_cast<int>(BlockwiseVariant::kCount) ? &kEntries[i] : nullptr;
}

}  // namespace

const char* BlockwiseVariantName(BlockwiseVariant v) {
  const Entry* e = Find(v);
  return e ? e->name : "?";
}

const char* CheckBlockwiseGemm(BlockwiseVariant v, const BlockwiseGemmArgs& args) {
  const Entry* e = Find(v);
  if (!e) return "unknown variant";
  if (args.a_mode != e->a_mode || args.b_mode != e->b_mode)
    return "the variant is compiled for other scale modes";
  if (!args.a || !args.b || !args.a_sinv || !args.b_sinv || !args.out) return "null pointer";
  return e->check(args);
}

size_t BlockwiseGemmWorkspace(BlockwiseVariant v, const BlockwiseGemmArgs& args, int sm_count) {
  const Entry* e = Find(v);
  return e ? e->workspace(args, sm_count) : 0;
}

cudaError_t LaunchBlockwiseGemm(BlockwiseVariant v, const BlockwiseGemmArgs& args,
                                void* workspace, size_t workspace_bytes, int sm_count,
                                cudaStream_t stream) {
  if (CheckBlockwiseGemm(v, args) != nullptr) return cudaErrorInvalidValue;
  return Find(v)->launch(args, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace sm90
}  // namespace te_jax
