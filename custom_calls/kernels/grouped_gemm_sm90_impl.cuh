// CUTLASS 4.x instantiation of te_jax's grouped GEMM (sm_90a: FP8, and bf16
// for the FP8-off layers) and its setup kernel. Included only by
// grouped_gemm_sm90_<variant>.cu; callers use gemm_sm90.cuh.
//
// CUTLASS's pointer-array grouped kernels (KernelPtrArrayTmaWarpSpecialized
// Cooperative[FP8FastAccum | FP8Blockwise]; the plain one for FP8 split
// accumulation and for bf16) read every group's problem shape, operand
// pointers, strides (and scale pointers / layouts, or the per-group alpha)
// from device arrays and rewrite their TMA descriptors on the device when a
// CTA moves to another group; the persistent grid is sized from the SM count
// alone. So nothing here depends on group_sizes on the host: SetupKernel
// fills those arrays from group_sizes on the stream, right before the GEMM.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/gemm_sm90.cuh"
#include "kernels/grouped_gemm_sm90_table.cuh"
#include "kernels/sm90_common.cuh"

namespace te_jax {
namespace sm90 {

template <OperandType kType>
using OperandElement = cute::conditional_t<
    kType == OperandType::kE4M3, cutlass::float_e4m3_t,
    cute::conditional_t<kType == OperandType::kE5M2, cutlass::float_e5m2_t, cutlass::bfloat16_t>>;

// One grouped kernel configuration: 128x128 CTA tiles whose K step is 128
// bytes of the operands (128 FP8, 64 bf16 elements: one 128-byte swizzled
// row of shared memory per step), cooperative schedule, clusters of
// kClusterN CTAs along N. kScaling: kBlockwise, CUTLASS's blockwise mainloop
// with kGranA / kGranB rows per scale (as BlockwiseConfig); kTensor, FP8
// with one alpha per group; kNone, bf16 with alpha 1 (kGranA / kGranB
// unused). kMnMajor: A contiguous along M and B along N (CUTLASS's
// ColumnMajor A, RowMajor B), the layout of the row-major wgrad operands
// a (m, k) and b (m, n) seen as A = a^T (k x tokens) and B = b (tokens x
// n): GroupedAxis::kContractionRowMajor only; else both contiguous along K
// ("TN", the rows and contraction axes). wgmma reads MN-major operands
// of 16-bit types only, so kMnMajor is bf16's. kOut: the element the
// epilogue writes (float32: the FP8 wgrad of float32 weights).
template <GroupedScaling kScaling, OperandType kTypeA, OperandType kTypeB, bool kFastAccum,
          int kGranA, int kGranB, int kClusterN, bool kMnMajorOperands = false,
          OutputType kOut = OutputType::kBF16>
struct GroupedConfig {
  static constexpr bool kMnMajor = kMnMajorOperands;
  static constexpr bool kIsBlockwise = kScaling == GroupedScaling::kBlockwise;
  static constexpr bool kAlphaPerGroup = kScaling == GroupedScaling::kTensor;
  static constexpr int kScaleGranB = kGranB;  // 128: rows-grouped blockwise; 1: contraction
  static_assert(OperandBytes(kTypeA) == OperandBytes(kTypeB),
                "one K step of 128 bytes must hold the same elements of a and b");
  static_assert((kScaling == GroupedScaling::kNone) == (kTypeA == OperandType::kBF16),
                "bf16 operands take no scales; FP8 operands take scales");
  static_assert(!kFastAccum || kScaling == GroupedScaling::kTensor,
                "fast accumulation is the per-tensor FP8 mainloop's");
  static_assert(!kMnMajor || kTypeA == OperandType::kBF16,
                "wgmma reads 8-bit operands K-major only");
  using ElementA = OperandElement<kTypeA>;
  using ElementB = OperandElement<kTypeB>;
  using ElementD = cute::conditional_t<kOut == OutputType::kF32, float, cutlass::bfloat16_t>;
  // CUTLASS's A is (M, K), its B (N, K): RowMajor A and ColumnMajor B are
  // contiguous along K, ColumnMajor A along M, RowMajor B along N.
  using LayoutA = cute::conditional_t<kMnMajor, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>;
  using LayoutB = cute::conditional_t<kMnMajor, cutlass::layout::RowMajor,
                                      cutlass::layout::ColumnMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kTileK = 128 / OperandBytes(kTypeA);
  // 16-byte TMA rows, in elements (of the contiguous dim: K, or M and N)
  static constexpr int kAlignAB = 16 / OperandBytes(kTypeA);
  static constexpr int kAlignD = 16 / OutputBytes(kOut);  // 16-byte rows of the output
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::_1, cute::Int<kClusterN>, cute::_1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      kGranA, kGranB, 128, kGranA == 1 ? cute::GMMA::Major::MN : cute::GMMA::Major::K,
      kGranB == 1 ? cute::GMMA::Major::MN : cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using MainloopSchedule = cute::conditional_t<
      kIsBlockwise, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
      cute::conditional_t<kFastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using OperandA = cute::conditional_t<kIsBlockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using OperandB = cute::conditional_t<kIsBlockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, OperandA, kAlignAB,
      ElementB, OperandB, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-group arrays, carved from the workspace after the GroupTable.
  struct Arrays {
    Shape3* shapes;
    const ElementA** ptr_a;
    const ElementB** ptr_b;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    const float** ptr_sfa;
    const float** ptr_sfb;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    float* alpha;
    const float** alpha_ptr;
    void* cutlass_workspace;
  };

  // Byte offsets of the arrays; the same on host and device.
  static size_t Carve(void* base, int64_t groups, Arrays* out) {
    char* p = static_cast<char*>(base);
    size_t off = GroupTableBytes(groups);
    auto take = [&](auto** field, size_t elem) {
      if (out) *field = reinterpret_cast<cute::remove_pointer_t<decltype(field)>>(p + off);
      off = AlignUp(off + elem * groups);
    };
    Arrays a{};
    Arrays* t = out ? out : &a;
    take(&t->shapes, sizeof(Shape3));
    take(&t->ptr_a, sizeof(void*));
    take(&t->ptr_b, sizeof(void*));
    take(&t->ptr_d, sizeof(void*));
    take(&t->stride_a, sizeof(StrideA));
    take(&t->stride_b, sizeof(StrideB));
    take(&t->stride_d, sizeof(StrideD));
    take(&t->ptr_sfa, sizeof(void*));
    take(&t->ptr_sfb, sizeof(void*));
    take(&t->layout_sfa, sizeof(LayoutSFA));
    take(&t->layout_sfb, sizeof(LayoutSFB));
    take(&t->alpha, sizeof(float));
    take(&t->alpha_ptr, sizeof(void*));
    if (out) out->cutlass_workspace = p + off;
    return off;
  }

  static Arguments MakeArguments(const GroupedGemmArgs& p, const Arrays& t, int sm_count) {
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = sm_count;
    Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(p.groups), t.shapes, nullptr};  // shapes on device only
    if constexpr (kIsBlockwise) {
      args.mainloop = {t.ptr_a, t.stride_a, t.ptr_b, t.stride_b, t.ptr_sfa, t.layout_sfa,
                       t.ptr_sfb, t.layout_sfb};
    } else {
      args.mainloop = {t.ptr_a, t.stride_a, t.ptr_b, t.stride_b};
    }
    args.epilogue = {{}, nullptr, nullptr, t.ptr_d, t.stride_d};
    auto& fusion = args.epilogue.thread;
    fusion.beta = 0.0f;
    if constexpr (kAlphaPerGroup) {
      fusion.alpha_ptr_array = t.alpha_ptr;  // a_sinv * b_sinv of the group
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
    } else {
      fusion.alpha = 1.0f;  // blockwise: scaled in the mainloop; bf16: no scales
    }
    args.hw_info = hw;
    args.scheduler.raster_order = RasterOrder(p.order.raster);
    args.scheduler.max_swizzle_size = p.order.swizzle;
    return args;
  }

  static size_t Workspace(const GroupedGemmArgs& p, int sm_count) {
    Arrays t{};
    const size_t arrays = Carve(nullptr, p.groups, nullptr);
    return arrays + AlignUp(Gemm::get_workspace_size(MakeArguments(p, t, sm_count)));
  }
};

// Fills the GroupTable and the per-group arrays from group_sizes: one block;
// the sizes go to shared memory, thread 0 scans them, then one thread per
// group writes its entries. The grouped axis: the rows m of a (kRows and
// kContractionRowMajor) or its columns k (kContraction). Group g's slice of it is
// [start, start + size), start = sum of the previous sizes (negative ones
// count as 0), clamped to the buffer; a group that is negative, overruns the
// buffer, or whose size or start breaks the alignment `multiple` is
// kGroupInvalid and computes nothing (the fill kernel NaNs its output).
//
// Blockwise scales: CUTLASS's grouped mainloop builds each group's scale
// layout from the group's problem shape (load_init:
// Sm90BlockwiseScaleConfig::tile_atom_to_shape_SFA/SFB), not from the
// layout_sfa / layout_sfb arrays, so the scales must be compact per group
// from the group's pointer: 1x128 (row i, k-block j) at i + j * rows,
// 128x128 (row block r, k-block j) at r * ceil(k/128) + j. The Python side
// lays them out so (grouped_gemm_cuda.rows_operands / contraction_operands:
// rows, a: one block per group at start * kb (and a tail block past the
// last group); b: (G, nb, kb); contraction: (ceil(k/128), m) and
// (ceil(k/128), n)). The layouts written here say the same thing.
template <class Cfg>
__global__ void GroupedSetupKernel(GroupedGemmArgs p, GroupTable table,
                                   typename Cfg::Arrays t, int multiple) {
  extern __shared__ int64_t smem_sizes[];
  const int groups = static_cast<int>(p.groups);
  const bool rows = p.axis == GroupedAxis::kRows;
  const int64_t extent = p.axis == GroupedAxis::kContraction ? p.k : p.m;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) smem_sizes[g] = p.group_sizes[g];
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t start = 0;
    int32_t any_invalid = 0;
    for (int g = 0; g < groups; ++g) {
      const int64_t size = smem_sizes[g];
      const int64_t end = start + (size > 0 ? size : 0);
      // A slice must also start aligned: an invalid size before it shifts it.
      const bool invalid = size < 0 || end > extent || size % multiple != 0 || start % multiple;
      table.bounds[g] = start;
      table.status[g] = invalid ? kGroupInvalid : (size == 0 ? kGroupEmpty : kGroupOk);
      any_invalid |= invalid;
      start = end < extent ? end : extent;
    }
    table.bounds[groups] = start;
    *table.any_invalid = any_invalid;
  }
  __syncthreads();
  using namespace cute;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int64_t start = table.bounds[g];
    const int size = table.status[g] == kGroupOk ? static_cast<int>(smem_sizes[g]) : 0;
    const auto* a = static_cast<const typename Cfg::ElementA*>(p.a);
    const auto* b = static_cast<const typename Cfg::ElementB*>(p.b);
    auto* d = static_cast<typename Cfg::ElementD*>(p.out);
    if constexpr (Cfg::kMnMajor) {  // rows [start, start + size) of a (m, k) and b (m, n)
      // Group g: A = a[rows]^T (k x size, M contiguous), B = b[rows]
      // (size x n, N contiguous), block g of out (G, k, n). Its rows start at
      // start * k and start * n elements: 16-byte aligned for any sizes when
      // k and n are multiples of 8 (CheckGroupedGemm); TMA fills the K
      // tail of a group (size rows) with zeros, so no tile reads the next.
      t.shapes[g] = make_shape(size ? k : 0, n, size);  // no tiles for an empty group
      t.ptr_a[g] = a + start * k;
      t.ptr_b[g] = b + start * n;
      t.ptr_d[g] = d + int64_t(g) * k * n;
      t.stride_a[g] = make_stride(_1{}, int64_t(k), _0{});
      t.stride_b[g] = make_stride(_1{}, int64_t(n), _0{});
      t.stride_d[g] = make_stride(int64_t(n), _1{}, _0{});
    } else if (rows) {  // rows [start, start + size) of a and out; expert g's b
      t.shapes[g] = make_shape(size, n, k);
      t.ptr_a[g] = a + start * k;
      t.ptr_b[g] = b + int64_t(g) * n * k;
      t.ptr_d[g] = d + start * n;
      t.stride_a[g] = make_stride(int64_t(k), _1{}, _0{});
      t.stride_b[g] = make_stride(int64_t(k), _1{}, _0{});
      t.stride_d[g] = make_stride(int64_t(n), _1{}, _0{});
      if constexpr (Cfg::kAlphaPerGroup) t.alpha[g] = p.a_sinv[0] * p.b_sinv[g];
      if constexpr (Cfg::kIsBlockwise && Cfg::kScaleGranB == 128) {
        // Compact per group (see the note above the kernel): a's block of
        // this group's rows at start * kb, k-block stride = its rows; b's
        // grid at g * nb * kb, row-block stride kb.
        const int kb = KBlocks(k), nb = (n + 127) / 128;
        t.ptr_sfa[g] = p.a_sinv + start * kb;
        t.ptr_sfb[g] = p.b_sinv + int64_t(g) * nb * kb;
        t.layout_sfa[g] = NativeScaleLayout<typename Cfg::LayoutSFA, 1>(size, k, size);
        t.layout_sfb[g] = NativeScaleLayout<typename Cfg::LayoutSFB, 128>(n, k, kb);
      }
    } else {  // columns [start, start + size) of a (m, k) and b (n, k); block g of out
      t.shapes[g] = make_shape(size ? m : 0, n, size);  // no tiles for an empty group
      t.ptr_a[g] = a + start;
      t.ptr_b[g] = b + start;
      t.ptr_d[g] = d + int64_t(g) * m * n;
      t.stride_a[g] = make_stride(int64_t(k), _1{}, _0{});
      t.stride_b[g] = make_stride(int64_t(k), _1{}, _0{});
      t.stride_d[g] = make_stride(int64_t(n), _1{}, _0{});
      if constexpr (Cfg::kAlphaPerGroup) t.alpha[g] = p.a_sinv[0] * p.b_sinv[0];
      if constexpr (Cfg::kIsBlockwise && Cfg::kScaleGranB == 1) {
        // Compact (ceil(k/128), m) and (ceil(k/128), n) grids: k-block
        // stride exactly m (n), the group's first k-block at start / 128.
        t.ptr_sfa[g] = p.a_sinv + (start / 128) * m;
        t.ptr_sfb[g] = p.b_sinv + (start / 128) * n;
        t.layout_sfa[g] = NativeScaleLayout<typename Cfg::LayoutSFA, 1>(m, size, m);
        t.layout_sfb[g] = NativeScaleLayout<typename Cfg::LayoutSFB, 1>(n, size, n);
      }
    }
    t.alpha_ptr[g] = &t.alpha[g];
  }
}

// Setup + GEMM of one configuration (the fill runs in the dispatcher).
template <class Cfg>
struct GroupedKernel {
  static const char* Check(const GroupedGemmArgs& p) {
    using Gemm = typename Cfg::Gemm;
    typename Cfg::Arrays t{};
    if (Gemm::can_implement(Cfg::MakeArguments(p, t, 1)) != cutlass::Status::kSuccess)
      return "CUTLASS can_implement rejected the problem";
    return nullptr;
  }

  static cudaError_t Launch(const GroupedGemmArgs& p, void* workspace, size_t workspace_bytes,
                            int sm_count, int multiple, cudaStream_t stream) {
    using Gemm = typename Cfg::Gemm;
    if (Cfg::Workspace(p, sm_count) > workspace_bytes) return cudaErrorInvalidValue;
    typename Cfg::Arrays t;
    Cfg::Carve(workspace, p.groups, &t);
    const GroupTable table = CarveGroupTable(workspace, p.groups);
    const size_t smem = sizeof(int64_t) * static_cast<size_t>(p.groups);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;  // > 6144 groups
    GroupedSetupKernel<Cfg><<<1, 256, smem, stream>>>(p, table, t, multiple);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    return RunCutlass<Gemm>(Cfg::MakeArguments(p, t, sm_count), t.cutlass_workspace, stream);
  }
};

}  // namespace sm90
}  // namespace te_jax

// Defines one grouped variant's entry points (declared by the table in
// grouped_gemm_sm90.cu) for a GroupedConfig.
#define TE_JAX_SM90_DEFINE_GROUPED(id, ...)                                                    \
  namespace te_jax {                                                                           \
  namespace sm90 {                                                                             \
  namespace variants {                                                                         \
  using id##Config = GroupedConfig<__VA_ARGS__>;                                               \
  const char* id##Check(const GroupedGemmArgs& p) {                                            \
    return GroupedKernel<id##Config>::Check(p);                                                \
  }                                                                                            \
  size_t id##Workspace(const GroupedGemmArgs& p, int sms) {                                    \
    return id##Config::Workspace(p, sms);                                                      \
  }                                                                                            \
  cudaError_t id##Launch(const GroupedGemmArgs& p, void* ws, size_t bytes, int sms,            \
                         int multiple, cudaStream_t s) {                                       \
    return GroupedKernel<id##Config>::Launch(p, ws, bytes, sms, multiple, s);                  \
  }                                                                                            \
  }                                                                                            \
  }                                                                                            \
  }
