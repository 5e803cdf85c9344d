// The variant table and the fill kernel of gemm_sm90.cuh's grouped GEMM.
// No CUTLASS here: each variant's setup + GEMM is in its own translation
// unit (grouped_gemm_sm90_<variant>.cu).
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/gemm_sm90.cuh"
#include "kernels/grouped_gemm_sm90_table.cuh"

namespace te_jax {
namespace sm90 {
namespace variants {
#define TE_JAX_X(id, name, scaling, a_type, b_type, out_type)                          \
  const char* id##Check(const GroupedGemmArgs& p);                                    \
  size_t id##Workspace(const GroupedGemmArgs& p, int sms);                            \
  cudaError_t id##Launch(const GroupedGemmArgs& p, void* ws, size_t bytes, int sms,   \
                         int multiple, cudaStream_t s);
TE_JAX_SM90_GROUPED_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
}  // namespace variants

namespace {

constexpr unsigned Bit(GroupedAxis a) { return 1u << static_cast<int>(a); }

// The grouped axes a variant's kernel serves (a bit per GroupedAxis): the
// blockwise kernels one each (their scale layouts differ), the MN-major bf16
// kernel the row-major wgrad only, the float32-output ones the FP8 wgrad
// only, the others rows and contraction.
constexpr unsigned ServedAxes(GroupedVariant v, OutputType out) {
  return v == GroupedVariant::kBlockwiseRows           ? Bit(GroupedAxis::kRows)
         : v == GroupedVariant::kBlockwiseContraction  ? Bit(GroupedAxis::kContraction)
         : v == GroupedVariant::kBf16MnMajor           ? Bit(GroupedAxis::kContractionRowMajor)
         : out == OutputType::kF32                     ? Bit(GroupedAxis::kContraction)
                                                       : Bit(GroupedAxis::kRows) |
                                                             Bit(GroupedAxis::kContraction);
}

struct Entry {
  const char* name;
  GroupedScaling scaling;
  int operand_bytes;  // of one element of a and b
  OutputType out;
  unsigned axes;      // ServedAxes
  const char* (*check)(const GroupedGemmArgs&);
  size_t (*workspace)(const GroupedGemmArgs&, int);
  cudaError_t (*launch)(const GroupedGemmArgs&, void*, size_t, int, int, cudaStream_t);
};

const Entry kEntries[] = {
#define TE_JAX_X(id, name, scaling, a_type, b_type, out_type)                               \
  {name, GroupedScaling::scaling, OperandBytes(OperandType::a_type), OutputType::out_type,  \
   ServedAxes(GroupedVariant::id, OutputType::out_type), variants::id##Check,               \
   variants::id##Workspace, variants::id##Launch},
    TE_JAX_SM90_GROUPED_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
};

const Entry* Find(GroupedVariant v) {
  const int i = static_cast<int>(v);
  return i >= 0 && i < static_cast<int>(GroupedVariant::kCount) ? &kEntries[i] : nullptr;
}

// Alignment of a group's slice of the grouped axis, in elements: rows take
// any size (kRows, kContractionRowMajor: a group's rows of 16-byte rows
// start 16-byte aligned); a slice of kContraction's columns must start on
// a 16-byte boundary (TMA: 16 FP8 or 8 bf16 elements) and, blockwise, on a
// scale block.
int Multiple(const Entry& e, const GroupedGemmArgs& p) {
  if (p.axis != GroupedAxis::kContraction) return 1;
  return p.scaling == GroupedScaling::kBlockwise ? 128 : 16 / e.operand_bytes;
}

constexpr int kFillRows = 16;  // output rows per block of the rows fill

// One value in all 16 bytes at p (8 bfloat16 or 4 float32).
__device__ inline void Store16(__nv_bfloat16* p, __nv_bfloat16 v) {
  const __nv_bfloat162 v2 = __halves2bfloat162(v, v);
  uint4 u;
  u.x = u.y = u.z = u.w = *reinterpret_cast<const uint32_t*>(&v2);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ inline void Store16(float* p, float v) {
  *reinterpret_cast<float4*>(p) = make_float4(v, v, v, v);
}
__device__ inline __nv_bfloat16 FromFloat(float v, __nv_bfloat16*) { return __float2bfloat16(v); }
__device__ inline float FromFloat(float v, float*) { return v; }

// kRows: rows past the last group get 0, rows of an invalid group NaN (every
// row when poison_all and some group is invalid). A block whose rows all lie
// in valid groups returns at once (the usual case).
__global__ void FillRowsKernel(__nv_bfloat16* out, int64_t m, int64_t n, int groups,
                               GroupTable table, bool poison_all) {
  const int64_t r0 = int64_t(blockIdx.x) * kFillRows;
  const int64_t covered = table.bounds[groups];
  const bool any_invalid = *table.any_invalid != 0;
  if (r0 + kFillRows <= covered && !any_invalid) return;
  const bool all_nan = poison_all && any_invalid;
  const __nv_bfloat16 zero = __float2bfloat16(0.0f), nan = __float2bfloat16(NAN);
  for (int64_t r = r0; r < r0 + kFillRows && r < m; ++r) {
    bool fill_nan = all_nan;
    if (!all_nan && r < covered) {
      int lo = 0, hi = groups - 1;  // the group holding row r: last g with bounds[g] <= r
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table.bounds[mid] <= r) lo = mid; else hi = mid - 1;
      }
      if (table.status[lo] != kGroupInvalid) continue;
      fill_nan = true;
    }
    for (int64_t c = threadIdx.x * 8; c < n; c += blockDim.x * 8)
      Store16(out + r * n + c, fill_nan ? nan : zero);
  }
}

// kContraction (kContractionRowMajor): an empty group's (m, n) ((k, n))
// block gets 0, an invalid one's NaN
// (every block when poison_all and some group is invalid). T: the output's
// element (bfloat16, or float32 for the f32 variants); block_elems is a
// multiple of 8 (n is), so every 16-byte store stays inside the block.
template <class T>
__global__ void FillBlocksKernel(T* out, int64_t block_elems, GroupTable table, bool poison_all) {
  constexpr int kPerStore = 16 / sizeof(T);
  const int g = blockIdx.y;
  const int32_t status = table.status[g];
  const bool all_nan = poison_all && *table.any_invalid != 0;
  if (status == kGroupOk && !all_nan) return;
  const T v = FromFloat(status == kGroupEmpty && !all_nan ? 0.0f : NAN, out);
  T* block = out + int64_t(g) * block_elems;
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPerStore; i < block_elems;
       i += int64_t(gridDim.x) * blockDim.x * kPerStore)
    Store16(block + i, v);
}

}  // namespace

const char* GroupedVariantName(GroupedVariant v) {
  const Entry* e = Find(v);
  return e ? e->name : "?";
}

bool GroupedVariantServes(GroupedVariant v, GroupedAxis a) {
  const Entry* e = Find(v);
  return e && (e->axes & Bit(a));
}

const char* CheckGroupedGemm(GroupedVariant v, const GroupedGemmArgs& p) {
  const Entry* e = Find(v);
  if (!e) return "unknown variant";
  if (p.scaling != e->scaling) return "the variant is compiled for the other scaling";
  if (!GroupedVariantServes(v, p.axis)) return "the variant does not serve this grouped axis";
  if (p.groups < 1 || p.groups > 6144) return "groups must be in [1, 6144]";
  if (p.m < 1 || p.n < 1 || p.k < 1) return "m, n and k must be >= 1";
  if ((p.k * e->operand_bytes) % 16)
    return e->operand_bytes == 1 ? "k must be a multiple of 16 (16-byte rows for TMA)"
                                 : "k must be a multiple of 8 (16-byte bf16 rows for TMA)";
  if (p.n % 8) return "n must be a multiple of 8 (16-byte output rows)";
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) return "dimensions exceed int32";
  if (!p.group_sizes || !p.a || !p.b || !p.out) return "null pointer";
  if (p.scaling != GroupedScaling::kNone && (!p.a_sinv || !p.b_sinv)) return "null scale pointer";
  return e->check(p);
}

size_t GroupedGemmWorkspace(GroupedVariant v, const GroupedGemmArgs& p, int sm_count) {
  const Entry* e = Find(v);
  return e ? e->workspace(p, sm_count) : 0;
}

cudaError_t LaunchGroupedGemm(GroupedVariant v, const GroupedGemmArgs& p, void* workspace,
                              size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (CheckGroupedGemm(v, p) != nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign) return cudaErrorInvalidValue;
  const Entry* entry = Find(v);
  cudaError_t e = entry->launch(p, workspace, workspace_bytes, sm_count, Multiple(*entry, p),
                                stream);
  if (e != cudaSuccess) return e;
  const GroupTable table = CarveGroupTable(workspace, p.groups);
  const bool poison_all = p.invalid_fill == InvalidFill::kAll;
  if (p.axis == GroupedAxis::kRows) {  // bfloat16 (ServedAxes)
    const unsigned blocks = static_cast<unsigned>((p.m + kFillRows - 1) / kFillRows);
    FillRowsKernel<<<blocks, 128, 0, stream>>>(static_cast<__nv_bfloat16*>(p.out), p.m, p.n,
                                               static_cast<int>(p.groups), table, poison_all);
  } else {
    const int64_t elems = (p.axis == GroupedAxis::kContraction ? p.m : p.k) * p.n;
    const unsigned chunks = static_cast<unsigned>(std::min<int64_t>((elems / 8 + 255) / 256, 64));
    const dim3 grid(chunks, static_cast<unsigned>(p.groups));
    if (entry->out == OutputType::kF32)
      FillBlocksKernel<<<grid, 256, 0, stream>>>(static_cast<float*>(p.out), elems, table,
                                                 poison_all);
    else
      FillBlocksKernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p.out), elems,
                                                 table, poison_all);
  }
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace te_jax
