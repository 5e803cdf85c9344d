// What the activation-quantize units share (act_quantize.cu, the host side;
// act_quantize_tensor.cu, the per-tensor kernels; act_quantize_blockwise.cu,
// the 1x128 kernel of everything but the activation backward;
// act_quantize_blockwise_bwd.cu, the backward's 1x128 kernel): the output
// bits, the row loop and its helpers, the launch bounds, the compile-time
// dispatch over loops, outputs and input types, and the entry point of each
// scale mode's kernels. The kernels live in three units so that they compile
// in parallel (one unit was the build's last and longest step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/act_quantize.h"
#include "kernels/prologue.h"
#include "kernels/quantize.h"
#include "kernels/tile.cuh"

namespace te_jax {

// The kernels of one scale mode for `a` (checked by the host side first)
// with the outputs `out` (kOut bits below); h E4M3 (kDAct) with fp8_h.
cudaError_t LaunchActTensorMode(const QuantizeArgs& a, const PrologueArgs& q,
                                const QuantizeArgs& z, const Fp8HInput& hs,
                                const Fp8HOutput& ho, int out, bool fp8_h, cudaStream_t stream);
// kVec128: the backward (kDAct, z act(h)'s copy with kOutActCols, h E4M3
// with fp8_h) and the other prologues (kAct, kConcat, kNorm).
cudaError_t LaunchDActVec128Mode(const QuantizeArgs& a, const PrologueArgs& q,
                                 const QuantizeArgs& z, const Fp8HInput& hs, int out, bool fp8_h,
                                 cudaStream_t stream);
cudaError_t LaunchActVec128Mode(const QuantizeArgs& a, const PrologueArgs& q,
                                const Fp8HOutput& ho, int out, cudaStream_t stream);
// Current scaling's amax pass over a prologue's output into b.amax_out
// (zeroed by the caller); h E4M3 with h_fp8 (kDAct only).
cudaError_t LaunchActTileAmax(const QuantizeArgs& b, const PrologueArgs& q,
                              const Fp8HInput* h_fp8, cudaStream_t stream);

namespace {

// kOut bits: what a prologue kernel writes.
constexpr int kOutRows = 1;     // the rowwise copy (data; sinv for kVec128)
constexpr int kOutCols = 2;     // the columnwise copy (data_t; sinv_t)
constexpr int kOutActCols = 4;  // kDAct: also act(h)'s columnwise copy (act_quantize.h)
constexpr int kOutH = 8;        // kAct: also h's E4M3 copy (Fp8HOutput, act_quantize.h)
constexpr int kOutBoth = kOutRows | kOutCols;

// The one scale of a kTensor quantization: given, or derived from the amax
// on the device (current scaling).
__device__ __forceinline__ float TensorScale(const QuantizeArgs& p, const Fp8Out& fmt) {
  return p.amax_in != nullptr ? ComputeScale(*p.amax_in, fmt.max, p.pow2) : *p.scale;
}

// A thread's FP8 bytes of its 8 columns over its 8 rows, for a columnwise
// copy, collected in registers as the rows come: column j's bytes move down
// one place per row, the oldest of hi[j] to the top of lo[j], this row's
// byte into the top of hi[j] (constant byte_perm selectors, whatever the
// row). After the 8 rows byte r % 4 of lo[j] / hi[j] holds row r / r + 4.
struct ColumnBytes {
  unsigned lo[kSub], hi[kSub];

  __device__ __forceinline__ ColumnBytes() {
#pragma unroll
    for (int j = 0; j < kSub; ++j) lo[j] = hi[j] = 0;
  }
  // One row, as Cast2 pairs: columns 2k (bits 0-7) and 2k + 1 (bits 8-15) in pair[k].
  __device__ __forceinline__ void Push(const unsigned (&pair)[kSub / 2]) {
#pragma unroll
    for (int k = 0; k < kSub / 2; ++k) {
      lo[2 * k] = __byte_perm(lo[2 * k], hi[2 * k], 0x4321);
      lo[2 * k + 1] = __byte_perm(lo[2 * k + 1], hi[2 * k + 1], 0x4321);
      hi[2 * k] = __byte_perm(hi[2 * k], pair[k], 0x4321);          // pair byte 0
      hi[2 * k + 1] = __byte_perm(hi[2 * k + 1], pair[k], 0x5321);  // pair byte 1
    }
  }
  // Into the transposed byte tile, for StoreTransposedTile after a barrier.
  __device__ __forceinline__ void ToTile(uint8_t* tbuf, const SubTile& st) const {
#pragma unroll
    for (int j = 0; j < kSub; ++j) TileChunk(tbuf, st.c0 + j, st.rg) = make_uint2(lo[j], hi[j]);
  }
};

// Stands for the row inputs that body (ForRows) gets without kWithH.
struct NoRow {};

// Runs the prologue's row loop with body(i, y, z, extra): z = act(h) beside
// y = dact(dz, h) with kWithAct or kPaired, else y again (unused); extra
// the row's h as loaded (prologue::RowInputs) with kWithH, the act1' half
// of a gated dact with kPaired (y then the act0' half; col < F: see
// prologue::ActRows), else a NoRow (unused). kFp8H: h is E4M3 with the tile
// scales `hs` (Fp8HInput).
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, bool kWithAct, bool kFp8H,
          bool kWithH, bool kPaired, typename Body>
__device__ __forceinline__ void ForRows(const PrologueArgs& q, const Fp8HInput& hs, int64_t M,
                                        int64_t row, int64_t col, Body&& body) {
  if constexpr (kPaired) {
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H, false, true>(
        q, M, row, col,
        [&](int i, const float (&y0)[kSub], const float (&y1)[kSub], const float (&z)[kSub]) {
          body(i, y0, z, y1);
        },
        hs);
  } else if constexpr (kWithAct) {
    prologue::ComputeRows<InT, kPro, kLoop, true, kFp8H>(
        q, M, row, col,
        [&](int i, const float (&y)[kSub], const float (&z)[kSub]) { body(i, y, z, NoRow{}); },
        hs);
  } else if constexpr (kWithH) {
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H, true>(
        q, M, row, col, [&](int i, const float (&y)[kSub], const auto& r) { body(i, y, y, r); },
        hs);
  } else {
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H>(
        q, M, row, col, [&](int i, const float (&y)[kSub]) { body(i, y, y, NoRow{}); }, hs);
  }
}

// h's E4M3 copy (kOutH, Fp8HOutput), one row at a time from the row loop:
// where it goes, walked down the rows as the rowwise copy's pointer is.
struct HCopyRow {
  uint8_t* data;     // h0's 8 bytes of this thread's columns; h1's are F further
  float* scale_inv;  // h0's tile scale of this row; h1's is F / 128 further
  int64_t width;     // n_act * F: the row pitch of data

  HCopyRow() = default;
  __device__ __forceinline__ HCopyRow(const Fp8HOutput& ho, const PrologueArgs& q, bool gated,
                                      int64_t first_row, const SubTile& st)
      : width((gated ? 2 : 1) * q.F) {
    data = ho.data + first_row * width + st.gc;
    scale_inv = ho.scale_inv + first_row * ho.scale_ld + st.k0 / kTile;
  }
};

// One row of one 1x128 tile of h's E4M3 copy: this thread's 8 values `h`
// (RawRow) and, in the 15 other lanes of its half-warp, the other 120 (the
// 16 lanes of a row group share a row and a 128-column tile: F % 128 == 0).
// As QuantizeTileKernel's 1x128 rowwise copy (kernels/quantize.cu): the
// tile's max by a 16-lane shuffle, its power-of-two ComputeScale, Cast2
// pairs, one 8-byte store; the lane of column group 0 writes 1 / scale. All
// 32 lanes of the warp call it (the shuffle); rows at or past M store nothing.
template <typename HRow>
__device__ __forceinline__ void StoreHTileRow(const HRow& h, uint8_t* data, float* scale_inv,
                                              bool row_in, bool scale_lane) {
  unsigned amax = 0;
#pragma unroll
  for (int j = 0; j < kSub; ++j) amax = max(amax, AbsBits(h[j]));
  const float s = ComputeScale(__uint_as_float(WarpMaxU(amax, 16)), 448.f, true);
  if (!row_in) return;
  if (scale_lane) *scale_inv = 1.f / s;
  unsigned pair[kSub / 2];
#pragma unroll
  for (int k = 0; k < kSub / 2; ++k) pair[k] = Cast2(h[2 * k] * s, h[2 * k + 1] * s, __NV_E4M3);
  *reinterpret_cast<uint2*>(data) = PackPairs(pair);
}

// Row i of h's copy from the row's inputs r (h0 in r.a, h1 in r.b when
// gated), then `at` moves to the next row.
template <typename Row>
__device__ __forceinline__ void StoreHRow(const Row& r, HCopyRow& at, const PrologueArgs& q,
                                          bool gated, bool row_in, const SubTile& st,
                                          int64_t scale_ld) {
  StoreHTileRow(r.a, at.data, at.scale_inv, row_in, st.cg == 0);
  if (gated) StoreHTileRow(r.b, at.data + q.F, at.scale_inv + q.F / kTile, row_in, st.cg == 0);
  at.data += at.width;
  at.scale_inv += scale_ld;
}

// Lets `kernel` take `bytes` of dynamic shared memory (more than 48 KB needs
// an opt-in, which holds per device: set at every launch, a host-side call,
// instead of tracking devices) with the largest shared-memory carveout (the
// 1x128 kernels' blocks take ~65-100 KB each, 2 or 3 per SM).
template <typename Kernel>
cudaError_t AllowDynamicShared(Kernel* kernel, int bytes) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  return e;
}

// Whether the activation of loop kLoop is gated (the runtime ids for kAny).
template <prologue::ActLoop kLoop>
__device__ __forceinline__ bool Gated(const PrologueArgs& q) {
  constexpr int kGated = prologue::LoopSpec<kLoop>::kGated;
  return kGated < 0 ? q.act1 >= 0 : kGated == 1;
}

// The prologue kernels. All compute v = act(h) or dact(dz, h) one row of
// a thread's 8x8 sub-tile at a time (prologue::ComputeRows) and cast and
// store each row of the rowwise copy as soon as it is computed; they differ
// in what the columnwise copy needs. Same bytes as QuantizeTileKernel would
// write for v. They are bound by instruction issue, so the casts go two
// per cvt (Cast2) and bytes are placed by byte_perm: per-element casts,
// shifts and selects were a sixth of the instructions per element
// (profile and timings: docs/benchmarks-log-2026-11.md).

// Launch bound of ActQuantizeTensorKernel and ActQuantizeVec128Kernel (the
// 1x128 backward has its own, DActMinBlocks): 3 blocks per SM (at most 80
// registers) wherever the loop fits that without spilling (ptxas -v, nvcc
// 13.0): every 16-bit loop except "any" (up to 110 registers) and the fp16
// SwiGLU backward (36-40 bytes of spills at 80). 2 blocks (up to 128
// registers) for those, for fp32 inputs, and for the backward that also
// writes act(h)'s columnwise copy (its column bytes and the act(h) values
// of the row spilled 16-220 bytes at 80).
// The forward that writes both copies of z and h's E4M3 copy takes 3 too,
// though its SwiGLU loops spill at 80 (1x128 kernel 28-36 bytes, per tensor
// 16-44) and the fp16 gelu 12 (bf16 gelu, silu and relu fit): at 2 blocks
// (96-111 registers, 25% occupancy) the 1x128 kernel was the slower one in
// act_math, by 14% for gelu and 2% for SwiGLU (run AS, H100).
// The paired backward (both halves of a gated dh, three column byte sets)
// takes 2 as well.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut, bool kPaired = false>
constexpr int ActMinBlocks() {
  if (sizeof(InT) != 2 || kLoop == prologue::ActLoop::kAny || (kOut & kOutActCols) || kPaired)
    return 2;
  if (std::is_same_v<InT, __half> && kPro == Prologue::kDAct &&
      kLoop == prologue::ActLoop::kSwiGlu)
    return 2;
  return 3;
}

// Calls launch(std::integral_constant<ActLoop, L>) for the loop L that
// prologue::ChooseLoop picks for q; only kAny is instantiated for fp32
// inputs, only kNone for kConcat and kNorm. An FP8 h (kFp8H, the fused MLP's
// backward with store_act_input_in_fp8) has the MLP's loops, SwiGLU and
// gelu, with bf16 dz, and kAny for everything else.
template <typename InT, Prologue kPro, bool kFp8H, typename Launch>
cudaError_t WithLoop(const PrologueArgs& q, Launch&& launch) {
  using prologue::ActLoop;
  constexpr bool kAll = !kFp8H;  // every specialized loop
  if constexpr (kPro == Prologue::kConcat || kPro == Prologue::kNorm) {
    return launch(std::integral_constant<ActLoop, ActLoop::kNone>{});
  } else if constexpr (sizeof(InT) == 4 || (kFp8H && !std::is_same_v<InT, __nv_bfloat16>)) {
    return launch(std::integral_constant<ActLoop, ActLoop::kAny>{});
  } else {
    switch (prologue::ChooseLoop(q, true)) {
      case ActLoop::kGelu: return launch(std::integral_constant<ActLoop, ActLoop::kGelu>{});
      case ActLoop::kSilu:
        if constexpr (kAll) return launch(std::integral_constant<ActLoop, ActLoop::kSilu>{});
        break;
      case ActLoop::kRelu:
        if constexpr (kAll) return launch(std::integral_constant<ActLoop, ActLoop::kRelu>{});
        break;
      case ActLoop::kSwiGlu: return launch(std::integral_constant<ActLoop, ActLoop::kSwiGlu>{});
      case ActLoop::kAny:
      case ActLoop::kNone: break;
    }
    return launch(std::integral_constant<ActLoop, ActLoop::kAny>{});
  }
}

// Whether loop kLoop of prologue kPro can be a gated backward: the loops
// built with the paired kernels (kPaired). 16-bit dz only: with float32
// inputs the paired quantize kernel spilled 44-140 bytes (ptxas -v, nvcc
// 13.0), where the 16-bit ones fit 128 registers without.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
constexpr bool CanPair() {
  return sizeof(InT) == 2 && kPro == Prologue::kDAct && prologue::LoopSpec<kLoop>::kGated != 0;
}

// A gated backward whose right half starts on a tile boundary: one block per
// column tile of h writes both halves (kPaired). Other widths (F % 128 != 0,
// a tile of dh straddling h0's and h1's columns) keep one block per tile of
// dh. The grid for `a` (M, 2F) that spans h's F columns instead.
bool Paired(const PrologueArgs& q) {
  return q.kind == Prologue::kDAct && q.act1 >= 0 && q.F % kTile == 0;
}
dim3 PairedGrid(const QuantizeArgs& a, const PrologueArgs& q) {
  dim3 grid = TileGrid(a);
  grid.x = static_cast<unsigned>(q.F / kTile);
  return grid;
}

// Calls fn(std::integral_constant<int, kOut>) for the output set `out`
// (kOut bits) among those built for prologue kPro: both copies for every
// prologue, the rowwise or the columnwise copy alone for kAct and kNorm,
// both plus act(h)'s columnwise copy for kDAct, and for kAct the rowwise
// copy alone or both copies plus h's E4M3 copy (the forward of the fused
// MLP always writes z rowwise; the columnwise z alone would be 22 more
// kernels to compile for no caller). cudaErrorInvalidValue for the others.
template <Prologue kPro, typename Fn>
cudaError_t WithOutputs(int out, Fn&& fn) {
  constexpr bool kSingle = kPro == Prologue::kAct || kPro == Prologue::kNorm;
  switch (out) {
    case kOutBoth: return fn(std::integral_constant<int, kOutBoth>{});
    case kOutRows:
      if constexpr (kSingle) return fn(std::integral_constant<int, kOutRows>{});
      break;
    case kOutCols:
      if constexpr (kSingle) return fn(std::integral_constant<int, kOutCols>{});
      break;
    case kOutBoth | kOutActCols:
      if constexpr (kPro == Prologue::kDAct)
        return fn(std::integral_constant<int, kOutBoth | kOutActCols>{});
      break;
    case kOutRows | kOutH:
      if constexpr (kPro == Prologue::kAct) return fn(std::integral_constant<int, kOutRows | kOutH>{});
      break;
    case kOutBoth | kOutH:
      if constexpr (kPro == Prologue::kAct) return fn(std::integral_constant<int, kOutBoth | kOutH>{});
      break;
    default: break;
  }
  return cudaErrorInvalidValue;
}

// Calls fn(std::integral_constant<Prologue, kind>) for a prologue kind.
template <typename Fn>
cudaError_t WithPrologue(Prologue kind, Fn&& fn) {
  switch (kind) {
    case Prologue::kAct: return fn(std::integral_constant<Prologue, Prologue::kAct>{});
    case Prologue::kDAct: return fn(std::integral_constant<Prologue, Prologue::kDAct>{});
    case Prologue::kConcat: return fn(std::integral_constant<Prologue, Prologue::kConcat>{});
    case Prologue::kNorm: return fn(std::integral_constant<Prologue, Prologue::kNorm>{});
    case Prologue::kNone: break;
  }
  return cudaErrorInvalidValue;
}

// Calls fn(InT{}, prologue, fp8_h) with the element type of `in`, the
// prologue kind as std::integral_constant and whether h is E4M3 as
// std::bool_constant (kDAct only: the one prologue built for an FP8 h).
template <typename Fn>
cudaError_t WithTypes(InType in, Prologue kind, bool fp8_h, Fn&& fn) {
  if (fp8_h && kind != Prologue::kDAct) return cudaErrorInvalidValue;
  auto typed = [&](auto in_type) {
    return WithPrologue(kind, [&](auto pro) {
      if constexpr (decltype(pro)::value == Prologue::kDAct) {
        if (fp8_h) return fn(in_type, pro, std::true_type{});
      }
      return fn(in_type, pro, std::false_type{});
    });
  };
  switch (in) {
    case InType::kF32: return typed(float{});
    case InType::kBF16: return typed(__nv_bfloat16{});
    case InType::kF16: return typed(__half{});
  }
  return cudaErrorInvalidValue;
}

// The compile-time choices of one kernel instance.
template <typename In, Prologue kPro_, prologue::ActLoop kLoop_, int kOut_, bool kFp8H_>
struct Variant {
  using InT = In;
  static constexpr Prologue kPro = kPro_;
  static constexpr prologue::ActLoop kLoop = kLoop_;
  static constexpr int kOut = kOut_;
  static constexpr bool kFp8H = kFp8H_;
  static constexpr bool kCanPair = CanPair<In, kPro_, kLoop_>();
};

// Calls fn(Variant<...>{}) for `a`'s element type, q's prologue and the
// loop WithLoop picks for it, the outputs `out` and whether h is E4M3.
template <typename Fn>
cudaError_t WithVariant(const QuantizeArgs& a, const PrologueArgs& q, int out, bool fp8_h,
                        Fn&& fn) {
  return WithTypes(a.in, q.kind, fp8_h, [&](auto in, auto pro, auto fp8) {
    using InT = decltype(in);
    constexpr Prologue kPro = decltype(pro)::value;
    constexpr bool kFp8H = decltype(fp8)::value;
    return WithOutputs<kPro>(out, [&](auto outs) {
      return WithLoop<InT, kPro, kFp8H>(q, [&](auto loop) {
        return fn(Variant<InT, kPro, decltype(loop)::value, decltype(outs)::value, kFp8H>{});
      });
    });
  });
}

}  // namespace
}  // namespace te_jax
