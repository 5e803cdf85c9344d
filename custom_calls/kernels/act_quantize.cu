// Fused activation + FP8 quantize kernels of the FP8 MLP (ffi/act_quantize.cc),
// also used for concatenations (ffi/concat_quantize.cc) and normalizations
// (ffi/normalization.cc): they quantize v = act(h), dact(dz, h),
// [part0 | part1 | ...] (widths multiples of 8) or norm(x) (kernels/prologue.h),
// computed from the inputs they load, so v is never written in 16 or 32
// bits: ActQuantizeTensorKernel for one scale (delayed and current scaling)
// and TileAmaxKernel for current scaling's amax pass
// (kernels/act_quantize_tensor.cu), DActQuantizeVec128Kernel for the
// backward's 1x128 + 128x1 scales (kernels/act_quantize_blockwise_bwd.cu)
// and ActQuantizeVec128Kernel for the other prologues'
// (kernels/act_quantize_blockwise.cu); this unit checks the arguments and
// picks the mode's kernels. The activation loop (prologue::ActLoop:
// gelu, silu, relu, SwiGLU, or any by runtime switches) is a template
// parameter chosen on the host, so that each kernel gets the registers of
// its own loop. Same tiles, casts and bytes as the quantize kernels
// (kernels/quantize.cu, kernels/tile.cuh) would give for v.
//
// Outputs (template parameter kOut, chosen on the host from the pointers
// set): the rowwise copy, the columnwise copy, or both; and for dact(dz, h)
// also the columnwise copy of act(h) (kernels/act_quantize.h), which the
// backward's wgrad GEMM reads and the forward then need not keep.
//
// The backward of a gated activation with F % 128 == 0 and 16-bit dz runs
// one block per column tile of h that writes both halves of dh (template
// parameter kPaired), reading dz, h0 and h1 and evaluating the activations
// once for both, in both scale modes.
//
// dact(dz, h) also reads h as E4M3 bytes with 1x128 tile scales (template
// parameter kFp8H; Fp8HInput in kernels/act_quantize.h), the copy of h that
// store_act_input_in_fp8 keeps, instead of a 16-bit h dequantized first;
// act(h) also writes that copy (kOut bit kOutH; Fp8HOutput) from the h
// values it loads, instead of a quantize pass of its own over h.
#include "kernels/act_quantize.h"

#include "kernels/act_quantize_common.cuh"

namespace te_jax {
namespace {

// Host-side guard of the prologue fields. The FFI handlers check them first
// with messages; this keeps any other caller from reading out of bounds.
bool PrologueValid(const QuantizeArgs& a, const PrologueArgs& q) {
  if (q.kind == Prologue::kNone) return true;
  if (q.kind == Prologue::kConcat) {
    // Increasing column ends (every width > 0, a multiple of 8) that add up to K.
    if (q.n_parts < 1 || q.n_parts > kMaxConcatParts) return false;
    int64_t start = 0;
    for (int i = 0; i < q.n_parts; ++i) {
      const int64_t end = q.part_end[i];
      if (q.parts[i] == nullptr || end <= start || (end - start) % 8 != 0) return false;
      start = end;
    }
    return start == a.K;
  }
  if (q.kind == Prologue::kNorm)
    return q.h != nullptr && q.rstd != nullptr && q.gamma != nullptr && q.F > 0 && a.K == q.F;
  const bool gated = q.act1 >= 0;
  if (q.h == nullptr || q.F <= 0 || q.act0 < 0 || q.act0 >= kNumAct || q.act1 >= kNumAct)
    return false;
  if (gated && q.F % 8 != 0) return false;
  if (q.kind == Prologue::kAct) return a.K == q.F;
  return q.dz != nullptr && a.K == (gated ? 2 : 1) * q.F;
}

// The FP8 h of a kDAct prologue (Fp8HInput): a scale row per row of h.
bool Fp8HValid(const PrologueArgs& q, const Fp8HInput& hs) {
  const int64_t width = (q.act1 >= 0 ? 2 : 1) * q.F;
  return q.kind == Prologue::kDAct && hs.scale != nullptr && hs.scale_ld >= (width + 127) / 128;
}

// The act(h) output of LaunchPrologueQuantize (kernels/act_quantize.h).
bool ActColumnsValid(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs& z) {
  if (q.kind != Prologue::kDAct || z.data_t == nullptr || z.data != nullptr || z.M != a.M ||
      z.K != q.F || z.mode != a.mode)
    return false;
  if (z.mode == ScaleMode::kTensor) return (z.scale == nullptr) != (z.amax_in == nullptr);
  return z.sinv_t != nullptr && z.sinv_t_ld >= (z.K + 3) / 4 * 4;
}

// h's E4M3 copy of a kAct prologue (Fp8HOutput): whole 1x128 tiles in h0
// and h1, a scale row per row of h.
bool HCopyValid(const QuantizeArgs& a, const PrologueArgs& q, const Fp8HOutput& ho) {
  const int64_t width = (q.act1 >= 0 ? 2 : 1) * q.F;
  return q.kind == Prologue::kAct && q.F % 128 == 0 && a.data != nullptr && ho.data != nullptr &&
         ho.scale_inv != nullptr && ho.scale_ld >= width / 128;
}

// The kernels for `a` (checked grid, amax_out zeroed) with the outputs its
// pointers (and `act`, `h_out`) select; h E4M3 with `h_fp8` (kDAct).
cudaError_t LaunchSelected(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs* act,
                           const Fp8HInput* h_fp8, const Fp8HOutput* h_out,
                           cudaStream_t stream) {
  if (q.kind == Prologue::kNone || !PrologueValid(a, q)) return cudaErrorInvalidValue;
  if (h_fp8 != nullptr && !Fp8HValid(q, *h_fp8)) return cudaErrorInvalidValue;
  if (h_out != nullptr && !HCopyValid(a, q, *h_out)) return cudaErrorInvalidValue;
  if (a.data == nullptr && a.data_t == nullptr) return cudaErrorInvalidValue;
  if (act != nullptr && !ActColumnsValid(a, q, *act)) return cudaErrorInvalidValue;
  if (a.mode == ScaleMode::kTensor) {
    if ((a.scale == nullptr) == (a.amax_in == nullptr)) return cudaErrorInvalidValue;
  } else if (a.mode == ScaleMode::kVec128) {
    if ((a.data != nullptr && a.sinv == nullptr) || (a.data_t != nullptr && a.sinv_t == nullptr))
      return cudaErrorInvalidValue;
  } else {  // 128x128 blocks are never asked of a prologue
    return cudaErrorInvalidValue;
  }
  const int out = (a.data != nullptr ? kOutRows : 0) | (a.data_t != nullptr ? kOutCols : 0) |
                  (act != nullptr ? kOutActCols : 0) | (h_out != nullptr ? kOutH : 0);
  const QuantizeArgs none;
  const QuantizeArgs& z = act != nullptr ? *act : none;
  const Fp8HInput hs = h_fp8 != nullptr ? *h_fp8 : Fp8HInput();
  const Fp8HOutput ho = h_out != nullptr ? *h_out : Fp8HOutput();
  if (a.mode == ScaleMode::kTensor)
    return LaunchActTensorMode(a, q, z, hs, ho, out, h_fp8 != nullptr, stream);
  return q.kind == Prologue::kDAct
             ? LaunchDActVec128Mode(a, q, z, hs, out, h_fp8 != nullptr, stream)
             : LaunchActVec128Mode(a, q, ho, out, stream);
}

}  // namespace

cudaError_t LaunchActQuantize(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  // LaunchQuantize's contract (quantize.h): both copies.
  if (a.data == nullptr || a.data_t == nullptr) return cudaErrorInvalidValue;
  return LaunchSelected(a, q, nullptr, nullptr, nullptr, stream);
}

cudaError_t LaunchPrologueQuantize(const QuantizeArgs& a, const PrologueArgs& q,
                                   const QuantizeArgs* act, cudaStream_t stream,
                                   const Fp8HInput* h_fp8, const Fp8HOutput* h_out) {
  if (a.M <= 0 || a.K <= 0) return cudaSuccess;
  if (!GridValid(a)) return cudaErrorInvalidConfiguration;
  if (a.mode == ScaleMode::kTensor && a.amax_out != nullptr) {
    cudaError_t e = cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  return LaunchSelected(a, q, act, h_fp8, h_out, stream);
}

namespace {

// LaunchPrologueAmax, with h E4M3 when h_fp8 is set.
cudaError_t PrologueAmax(const QuantizeArgs& a, const PrologueArgs& q, const Fp8HInput* h_fp8,
                         float* amax_out, cudaStream_t stream) {
  if (q.kind == Prologue::kNone) return cudaErrorInvalidValue;  // flat x: LaunchAmax
  cudaError_t e = cudaMemsetAsync(amax_out, 0, sizeof(float), stream);
  if (e != cudaSuccess || a.M <= 0 || a.K <= 0) return e;
  if (!GridValid(a)) return cudaErrorInvalidConfiguration;
  if (!PrologueValid(a, q)) return cudaErrorInvalidValue;
  if (h_fp8 != nullptr && !Fp8HValid(q, *h_fp8)) return cudaErrorInvalidValue;
  QuantizeArgs b = a;
  b.amax_out = amax_out;
  return LaunchActTileAmax(b, q, h_fp8, stream);
}

}  // namespace

cudaError_t LaunchPrologueAmax(const QuantizeArgs& a, const PrologueArgs& q, float* amax_out,
                               cudaStream_t stream) {
  return PrologueAmax(a, q, nullptr, amax_out, stream);
}

cudaError_t LaunchPrologueAmax(const QuantizeArgs& a, const PrologueArgs& q,
                               const Fp8HInput& h_fp8, float* amax_out, cudaStream_t stream) {
  return PrologueAmax(a, q, &h_fp8, amax_out, stream);
}

}  // namespace te_jax
