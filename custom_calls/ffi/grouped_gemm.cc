// XLA FFI handler of te_jax/ops/grouped_gemm.py (Python side:
// grouped_gemm_cuda.py): the grouped GEMMs of mixture-of-experts layers (FP8,
// and bf16 for FP8-off layers) on te_jax's own sm_90a kernels
// (kernels/gemm_sm90.cuh, built on CUTLASS; compiled only when CMake found
// the CUTLASS headers: TE_JAX_HAVE_SM90).
//
// Operands (axes 0 and 1 CUTLASS's "TN": both operands contiguous along the
// contraction):
//   axis 0, rows (fprop, dgrad):  a (m, k), b (G, n, k), out (m, n):
//     out[rows_g] = a[rows_g] @ b[g]^T, rows after the last group 0.
//   axis 1, contraction (wgrad):  a (m, k), b (n, k), out (G, m, n):
//     out[g] = a[:, cols_g] @ b[:, cols_g]^T, an empty group's block 0.
//   axis 2, contraction over row-major operands (the FP8-off wgrad, bfloat16
//   only): a (m, k), b (m, n), out (G, k, n): out[g] = a[rows_g]^T @
//   b[rows_g], an empty group's block 0; any group sizes (each group's rows
//   start 16-byte aligned as k and n are multiples of 8).
//   group_sizes (G,) int32, read on the device only.
//   a and b: both FP8 (float8_e4m3fn / float8_e5m2) with scaling 0 or 1, or
//   both bfloat16 with scaling 2 (none: the FP8-off GEMMs, alpha 1).
//   Scales (float32). Scaling 2, none: a_sinv and b_sinv are (1,) dummies,
//   checked for that shape and never read. Scaling 0, per tensor: a_sinv
//   (1,), b_sinv (G,) for rows (one per expert weight) or (1,) for the
//   contraction. Scaling 1, blockwise, arrays of the native layouts' shapes
//   (te_jax/ops/tiling.py): rows: a 1x128 (ceil(k/128), roundup(m, 4)), b
//   128x128 per expert (G, ceil(n/128), roundup(ceil(k/128), 4));
//   contraction: a and b 1x128 along the grouped contraction, (ceil(k/128),
//   roundup(m, 4)) and (ceil(k/128), roundup(n, 4)). Their contents are
//   compact per group, as CUTLASS's grouped mainloop reads them
//   (grouped_gemm_cuda.py lays them out), zeros after.
//   out is bfloat16, or, along axis 1 with FP8 operands, float32 (the wgrad
//   of float32 weights, written once in its dtype: kernels e4m3 x e4m3 and
//   e4m3 x e5m2 per tensor, e4m3 x e4m3 blockwise, split accumulation).
//   fast_accum 1: the tensor cores' own accumulation where a variant has it
//   (per-tensor E4M3 x E4M3 with a bfloat16 output); elsewhere split
//   accumulation, the more exact (bf16: the tensor cores' fp32 accumulation,
//   its only one).
//
// Group sizes that cannot describe the buffer (a negative one, a sum past
// it, or, along axis 1, a group that does not start and end on a
// multiple of 16 bytes of the operand (16 FP8, 8 bf16 elements) or, blockwise,
// of 128) make the whole output NaN (InvalidFill::kAll), as the reference
// (grouped_gemm_reference) does for the first two: the device cannot raise.
//
// The workspace is a result sized by the Python wrapper from static things
// (grouped_gemm_cuda.workspace_bytes: G only, generously); the handler skips
// to its first 256-byte boundary and checks that what is left holds what
// the variant needs for this device's SM count (GroupedGemmWorkspace),
// else returns InvalidArgument with both numbers.
//
// Command buffers: three kernel launches on XLA's stream (setup, CUTLASS's
// grouped GEMM, fill) into XLA's buffers; no allocation, no synchronization,
// no stream query; the SM count and compute capability are cached per
// device (device attributes, which capture allows).
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "ffi/common.h"
#include "kernels/gemm_sm90.cuh"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;
using sm90::GroupedAxis;
using sm90::OperandType;
using sm90::GroupedScaling;
using sm90::GroupedVariant;

constexpr uintptr_t kWorkspaceAlign = 256;

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("te_jax grouped_gemm: " + msg);
}

std::string ShapeText(const ffi::AnyBuffer& b) {
  std::string s = "(";
  const auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// b has exactly the dimensions `want`; else an error naming both.
ffi::Error CheckDims(const char* name, const ffi::AnyBuffer& b,
                     std::initializer_list<int64_t> want) {
  const auto d = b.dimensions();
  bool same = d.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) same = same && d[i++] == w;
  if (same) return ffi::Error::Success();
  std::string w = "(";
  i = 0;
  for (int64_t x : want) w += (i++ ? ", " : "") + std::to_string(x);
  return Invalid(std::string(name) + " must have shape " + w + (want.size() == 1 ? ",)" : ")") +
                 ", got " + ShapeText(b));
}

bool AsOperandType(ffi::DataType t, OperandType* out) {
  if (t == ffi::F8E4M3FN) { *out = OperandType::kE4M3; return true; }
  if (t == ffi::F8E5M2) { *out = OperandType::kE5M2; return true; }
  if (t == ffi::BF16) { *out = OperandType::kBF16; return true; }
  return false;
}

// The compiled float32-output variant (axis 1, FP8), or why none is.
const char* ChooseF32Variant(GroupedAxis axis, GroupedScaling scaling, OperandType ta,
                             OperandType tb, GroupedVariant* v) {
  if (axis != GroupedAxis::kContraction || ta == OperandType::kBF16 || tb == OperandType::kBF16)
    return "a float32 out is compiled for axis 1 (contraction) with FP8 operands only; the "
           "other calls write bfloat16";
  if (ta != OperandType::kE4M3 || (scaling == GroupedScaling::kBlockwise && tb != OperandType::kE4M3))
    return "float32-output wgrads are compiled for e4m3 x e4m3 and, per tensor, e4m3 (a) x e5m2 "
           "(b) only";
  *v = scaling == GroupedScaling::kBlockwise ? GroupedVariant::kBlockwiseContractionF32
       : tb == OperandType::kE4M3            ? GroupedVariant::kTensorE4M3SplitF32
                                             : GroupedVariant::kTensorE4M3E5M2SplitF32;
  return nullptr;
}

// The compiled variant for these operands and output, or why none is.
const char* ChooseVariant(GroupedAxis axis, GroupedScaling scaling, OperandType ta,
                          OperandType tb, bool fast, bool f32_out, GroupedVariant* v) {
  const bool bf16 = ta == OperandType::kBF16 && tb == OperandType::kBF16;
  if ((scaling == GroupedScaling::kNone) != bf16)
    return scaling == GroupedScaling::kNone
               ? "scaling 2 (none) takes bfloat16 x bfloat16 operands only"
               : "bfloat16 operands take scaling 2 (none); FP8 operands scaling 0 or 1, and "
                 "a and b must both be FP8 or both bfloat16";
  if (axis == GroupedAxis::kContractionRowMajor && !bf16)
    return "axis 2 (row-major wgrad operands) takes bfloat16 operands only (Hopper's FP8 "
           "tensor cores read operands contiguous along the contraction: pass the FP8 wgrad's "
           "(k, m) and (n, m) copies with axis 1)";
  if (f32_out) return ChooseF32Variant(axis, scaling, ta, tb, v);
  if (bf16) {  // one accumulation, fp32 (fast_accum: see the top of the file)
    *v = axis == GroupedAxis::kContractionRowMajor ? GroupedVariant::kBf16MnMajor
                                                   : GroupedVariant::kBf16;
    return nullptr;
  }
  if (scaling == GroupedScaling::kBlockwise) {
    if (ta != OperandType::kE4M3 || tb != OperandType::kE4M3)
      return "blockwise grouped GEMMs are compiled for float8_e4m3fn x float8_e4m3fn only";
    *v = axis == GroupedAxis::kRows ? GroupedVariant::kBlockwiseRows
                                    : GroupedVariant::kBlockwiseContraction;
    return nullptr;
  }
  if (ta == OperandType::kE4M3 && tb == OperandType::kE4M3) {
    *v = fast ? GroupedVariant::kTensorE4M3Fast : GroupedVariant::kTensorE4M3Split;
    return nullptr;
  }
  if (ta == OperandType::kE5M2 && tb == OperandType::kE4M3) {
    *v = GroupedVariant::kTensorE5M2E4M3Split;
    return nullptr;
  }
  return "per-tensor grouped GEMMs are compiled for e4m3 x e4m3 and e5m2 (a) x e4m3 (b) only";
}

// SM count and compute capability, queried once per device.
struct DeviceInfo {
  int sms = 0, major = 0, minor = 0;
};
ffi::Error GetDeviceInfo(DeviceInfo* info) {
  static std::mutex mu;
  static std::map<int, DeviceInfo>* cache = new std::map<int, DeviceInfo>;  // leaked on purpose
  int dev = 0;
  // XLA makes the stream's device current before calling a handler.
  if (auto e = CudaError(cudaGetDevice(&dev), "grouped_gemm (cudaGetDevice)"); e.failure()) return e;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(dev);
  if (it == cache->end()) {
    DeviceInfo d;
    for (auto [attr, field] : {std::pair{cudaDevAttrMultiProcessorCount, &d.sms},
                               std::pair{cudaDevAttrComputeCapabilityMajor, &d.major},
                               std::pair{cudaDevAttrComputeCapabilityMinor, &d.minor}}) {
      if (auto e = CudaError(cudaDeviceGetAttribute(field, attr, dev),
                             "grouped_gemm (cudaDeviceGetAttribute)");
          e.failure())
        return e;
    }
    it = cache->emplace(dev, d).first;
  }
  *info = it->second;
  return ffi::Error::Success();
}

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           ffi::AnyBuffer a_sinv, ffi::AnyBuffer b_sinv,
                           ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace, int64_t axis_attr,
                           int64_t scaling_attr, int64_t fast_accum) {
  // ---- attributes and operands ----
  if (axis_attr < 0 || axis_attr > 2 || scaling_attr < 0 || scaling_attr > 2 ||
      (fast_accum != 0 && fast_accum != 1))
    return Invalid("axis must be 0 (rows), 1 (contraction) or 2 (contraction over row-major "
                   "operands), fast_accum 0 or 1, scaling 0 (per "
                   "tensor), 1 (blockwise) or 2 (none, bfloat16), got " +
                   std::to_string(axis_attr) + ", " + std::to_string(scaling_attr) + ", " +
                   std::to_string(fast_accum));
  const auto axis = static_cast<GroupedAxis>(axis_attr);
  const auto scaling = static_cast<GroupedScaling>(scaling_attr);
  const bool rows = axis == GroupedAxis::kRows;
  const bool row_major_wgrad = axis == GroupedAxis::kContractionRowMajor;
  OperandType ta, tb;
  if (!AsOperandType(a.element_type(), &ta) || !AsOperandType(b.element_type(), &tb))
    return Invalid("a and b must be float8_e4m3fn, float8_e5m2 or bfloat16");
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1)
    return Invalid("group_sizes must be a 1-D int32 array (G,), got shape " +
                   ShapeText(group_sizes));
  const int64_t groups = group_sizes.dimensions()[0];
  if (a.dimensions().size() != 2)
    return Invalid("a must be 2-D (m, k), got shape " + ShapeText(a));
  const int64_t m = a.dimensions()[0], k = a.dimensions()[1];
  if (b.dimensions().size() != (rows ? 3u : 2u))
    return Invalid(std::string("b must be ") +
                   (rows ? "3-D (G, n, k)" : row_major_wgrad ? "2-D (m, n)" : "2-D (n, k)") +
                   ", got shape " + ShapeText(b));
  const int64_t n = b.dimensions()[rows || row_major_wgrad ? 1 : 0];
  if (rows) {
    if (auto e = CheckDims("b", b, {groups, n, k}); e.failure()) return e;
    if (auto e = CheckDims("out", *out, {m, n}); e.failure()) return e;
  } else if (row_major_wgrad) {  // a (m, k) and b (m, n) share their grouped rows
    if (auto e = CheckDims("b", b, {m, n}); e.failure()) return e;
    if (auto e = CheckDims("out", *out, {groups, k, n}); e.failure()) return e;
  } else {
    if (auto e = CheckDims("b", b, {n, k}); e.failure()) return e;
    if (auto e = CheckDims("out", *out, {groups, m, n}); e.failure()) return e;
  }
  if (out->element_type() != ffi::BF16 && out->element_type() != ffi::F32)
    return Invalid("out must be bfloat16 (or float32 for an FP8 wgrad along axis 1)");
  const bool f32_out = out->element_type() == ffi::F32;
  if (a_sinv.element_type() != ffi::F32 || b_sinv.element_type() != ffi::F32)
    return Invalid("a_sinv and b_sinv must be float32");
  GroupedVariant variant;
  if (const char* why = ChooseVariant(axis, scaling, ta, tb, fast_accum != 0, f32_out, &variant))
    return Invalid(why);
  const int64_t kb = (k + 127) / 128, m4 = (m + 3) / 4 * 4;
  if (scaling == GroupedScaling::kNone) {  // dummies, never read
    if (auto e = CheckDims("a_sinv", a_sinv, {1}); e.failure()) return e;
    if (auto e = CheckDims("b_sinv", b_sinv, {1}); e.failure()) return e;
  } else if (scaling == GroupedScaling::kTensor) {
    if (auto e = CheckDims("a_sinv", a_sinv, {1}); e.failure()) return e;
    if (auto e = CheckDims("b_sinv", b_sinv, {rows ? groups : 1}); e.failure()) return e;
  } else {
    if (auto e = CheckDims("a_sinv", a_sinv, {kb, m4}); e.failure()) return e;
    const ffi::Error eb = rows ? CheckDims("b_sinv", b_sinv, {groups, (n + 127) / 128, (kb + 3) / 4 * 4})
                               : CheckDims("b_sinv", b_sinv, {kb, (n + 3) / 4 * 4});
    if (eb.failure()) return eb;
  }

  sm90::GroupedGemmArgs args;
  args.axis = axis;
  args.scaling = scaling;
  args.groups = groups;
  args.m = m;
  args.n = n;
  args.k = k;
  args.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  if (scaling != GroupedScaling::kNone) {  // bf16: no scales (null: nothing may read them)
    args.a_sinv = static_cast<const float*>(a_sinv.untyped_data());
    args.b_sinv = static_cast<const float*>(b_sinv.untyped_data());
  }
  args.out = out->untyped_data();
  args.invalid_fill = sm90::InvalidFill::kAll;
  if (const char* why = sm90::CheckGroupedGemm(variant, args))
    return Invalid(std::string(sm90::GroupedVariantName(variant)) + ": " + why);

  // ---- device ----
  DeviceInfo dev;
  if (auto e = GetDeviceInfo(&dev); e.failure()) return e;
  if (dev.major != 9 || dev.minor != 0)
    return Invalid("the sm90 grouped GEMM runs on Hopper (compute capability 9.0) only, this "
                   "device is " + std::to_string(dev.major) + "." + std::to_string(dev.minor));
  const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  const uintptr_t skip = (kWorkspaceAlign - raw % kWorkspaceAlign) % kWorkspaceAlign;
  const size_t total = workspace->size_bytes();
  const size_t avail = total > skip ? total - skip : 0;
  const size_t need = sm90::GroupedGemmWorkspace(variant, args, dev.sms);
  if (avail < need)
    return Invalid("workspace too small: " + std::to_string(avail) + " usable bytes of " +
                   std::to_string(total) + ", the " + sm90::GroupedVariantName(variant) +
                   " kernel needs " + std::to_string(need) + " for G=" + std::to_string(groups) +
                   " on " + std::to_string(dev.sms) + " SMs");
  return CudaError(sm90::LaunchGroupedGemm(variant, args, reinterpret_cast<void*>(raw + skip),
                                           avail, dev.sms, stream),
                   "grouped_gemm");
}

}  // namespace

// Command-buffer compatible: see the top of the file.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxGroupedGemm, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()        // a (m, k) fp8 / bf16
                                  .Arg<ffi::AnyBuffer>()        // b (G, n, k), (n, k), (m, n)
                                  .Arg<ffi::AnyBuffer>()        // a_sinv f32 ((1,) dummy: bf16)
                                  .Arg<ffi::AnyBuffer>()        // b_sinv f32 ((1,) dummy: bf16)
                                  .Arg<ffi::AnyBuffer>()        // group_sizes (G,) int32
                                  .Ret<ffi::AnyBuffer>()        // out bf16 (f32: FP8 wgrad)
                                  .Ret<ffi::AnyBuffer>()        // workspace uint8 scratch
                                  .Attr<int64_t>("axis")        // 0 rows, 1 / 2 contraction
                                  .Attr<int64_t>("scaling")     // 0 tensor, 1 blockwise, 2 none
                                  .Attr<int64_t>("fast_accum"),  // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
