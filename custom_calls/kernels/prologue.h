// The elementwise prologue of the fused kernels (kernels/act_quantize.cu):
// computes a thread's 8x8 values of v = act(h), dact(dz, h), the
// concatenation of separate parts, or the normalization of x from its row
// statistics, from the inputs, one row of 8 at a time; for dact(dz, h)
// optionally act(h) as well (and both halves of a gated dact), from the
// same activation values. Device code, included by act_quantize_common.cuh,
// normalization.cu (NormValue) and tile.cuh (for kSub).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/act_quantize.h"
#include "kernels/activation.h"
#include "kernels/quantize.h"

namespace te_jax {
namespace prologue {

constexpr int kSub = 8;  // a thread's sub-tile is kSub x kSub (tile.cuh)

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

// Raw bits of 8 consecutive elements of one row of a row-major InT matrix.
template <typename InT>
struct RawRow {
  static constexpr int kVec = 16 / sizeof(InT);  // elements per 16-byte vector
  uint4 w[kSub / kVec];

  // Row `row` of `base` (`ld` elements per row, `rows` rows), columns
  // [col, col + 8); elements at row >= rows or column >= col_end read 0.
  // `col` is a multiple of 8 (and XLA buffers are >= 16-byte aligned), so
  // ld % kVec == 0 makes the 16-byte loads aligned.
  __device__ __forceinline__ void Load(const InT* __restrict__ base, int64_t ld, int64_t rows,
                                       int64_t row, int64_t col, int64_t col_end) {
    const InT* p = base + row * ld + col;
    if (row < rows && ld % kVec == 0 && col + kSub <= col_end) {
#pragma unroll
      for (int v = 0; v < kSub / kVec; ++v) w[v] = __ldg(reinterpret_cast<const uint4*>(p) + v);
    } else {
      InT tmp[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) tmp[j] = (row < rows && col + j < col_end) ? p[j] : InT(0.f);
      memcpy(w, tmp, sizeof(tmp));
    }
  }
  // Load without checks from `p`, 16-byte aligned: the caller knows the row
  // and columns are in bounds.
  __device__ __forceinline__ void LoadVec(const InT* __restrict__ p) {
#pragma unroll
    for (int v = 0; v < kSub / kVec; ++v) w[v] = __ldg(reinterpret_cast<const uint4*>(p) + v);
  }
  __device__ __forceinline__ float operator[](int j) const {
    if constexpr (std::is_same_v<InT, __nv_bfloat16>) {
      // bf16 -> f32 is a bit placement: the high half of a word by a mask,
      // the low half by a shift (one instruction each; the conversion
      // intrinsic took a byte permute and a shift for the high half).
      const unsigned word = reinterpret_cast<const unsigned*>(&w[j / kVec])[(j % kVec) / 2];
      return __uint_as_float(j % 2 ? word & 0xFFFF0000u : word << 16);
    } else {
      return ToFloat(reinterpret_cast<const InT*>(&w[j / kVec])[j % kVec]);
    }
  }
};

// 8 consecutive E4M3 elements of one row of h (Fp8HInput) and their tile's
// scale: operator[] gives float(byte) * scale rounded to InT, the value of
// h dequantized to dz's element type InT. The 8 columns lie in one 1x128
// tile (col % 8 == 0).
template <typename InT>
struct Fp8Row {
  uint2 w;
  float s;

  // As RawRow::Load, with the scale of the row's tile from `hs`.
  __device__ __forceinline__ void Load(const uint8_t* __restrict__ base, int64_t ld, int64_t rows,
                                       int64_t row, int64_t col, int64_t col_end,
                                       const Fp8HInput& hs) {
    const uint8_t* p = base + row * ld + col;
    if (row >= rows) {
      w = make_uint2(0, 0);
      s = 0.f;
      return;
    }
    s = __ldg(hs.scale + row * hs.scale_ld + col / 128);
    if (ld % 8 == 0 && col + kSub <= col_end) {
      w = __ldg(reinterpret_cast<const uint2*>(p));
    } else {
      uint8_t tmp[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) tmp[j] = col + j < col_end ? p[j] : 0;
      memcpy(&w, tmp, sizeof(tmp));
    }
  }
  // Without checks: `p` 8-byte aligned and in bounds, `scale` its tile's scale.
  __device__ __forceinline__ void LoadVec(const uint8_t* __restrict__ p,
                                          const float* __restrict__ scale) {
    w = __ldg(reinterpret_cast<const uint2*>(p));
    s = __ldg(scale);
  }
  // Value j is computed with its neighbour j ^ 1 by the same expressions
  // for both, so that the unrolled row loop converts each pair once: two
  // bytes per E4M3 -> half conversion (cvt.rn.f16x2.e4m3x2) and one packed
  // rounding of two values to a 16-bit InT, where each value used to be
  // converted and rounded alone.
  __device__ __forceinline__ float operator[](int j) const {
    const unsigned word = j < 4 ? w.x : w.y;
    const auto two = static_cast<__nv_fp8x2_storage_t>((word >> (16 * ((j % 4) / 2))) & 0xFFFFu);
    // E4M3 -> half is exact; each product is exact in float32 (a
    // power-of-two scale) and rounds to InT as the reference's dequantize
    // does (round to nearest even, value by value, in the pair forms too).
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
    const float lo = f.x * s, hi = f.y * s;  // the lower byte is the lower half
    if constexpr (std::is_same_v<InT, float>) {
      return j % 2 ? hi : lo;
    } else if constexpr (std::is_same_v<InT, __nv_bfloat16>) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
      const unsigned bits = reinterpret_cast<const unsigned&>(b);
      return __uint_as_float(j % 2 ? bits & 0xFFFF0000u : bits << 16);
    } else {
      const __half2 h2 = __floats2half2_rn(lo, hi);
      return j % 2 ? __high2float(h2) : __low2float(h2);
    }
  }
};

// One row of a thread's inputs: h0 (a), h1 (b, gated only), dz (d, kDAct);
// with kFp8H h0 and h1 are E4M3 (Fp8Row).
template <typename InT, bool kFp8H = false>
struct RowInputs {
  using HRow = std::conditional_t<kFp8H, Fp8Row<InT>, RawRow<InT>>;
  HRow a, b;
  RawRow<InT> d;
};

// Which activation loop a prologue kernel is compiled for. Kernels take it as
// a template parameter and the host picks it (ChooseLoop), so that every
// kernel's registers are those of its own loop: with the choice made inside
// one kernel, all loops shared the register budget of the largest (the
// runtime switch over 8 activations for a gated pair), which cost 2 of 3
// blocks per SM and made an amax pass over gelu(h) several times slower than
// the same math in a kernel of its own (benchmarks/act_math.cu; timings in
// docs/benchmarks-log-2026-11.md).
enum class ActLoop : int {
  kGelu,    // act0 = gelu, not gated
  kSilu,    // act0 = silu, not gated
  kRelu,    // act0 = relu, not gated
  kSwiGlu,  // ("silu", "linear"), gated
  kAny,     // any act0/act1, gated or not: runtime switches
  kNone,    // no activation: Prologue::kConcat, Prologue::kNorm
};

// kLoop -> (act0 id or kActAny, gated: 1 yes / 0 no / -1 runtime, act1 id or kActAny).
template <ActLoop kLoop>
struct LoopSpec {
  static constexpr int kAct0 = kLoop == ActLoop::kGelu ? kActGelu
                               : kLoop == ActLoop::kRelu ? kActRelu
                               : kLoop == ActLoop::kAny  ? kActAny
                               : kLoop == ActLoop::kNone ? kActLinear
                                                         : kActSilu;
  static constexpr int kGated = kLoop == ActLoop::kSwiGlu ? 1 : kLoop == ActLoop::kAny ? -1 : 0;
  static constexpr int kAct1 = kLoop == ActLoop::kSwiGlu ? kActLinear : kActAny;
};

// The specialized loop for `q`, or kAny. 32-bit inputs always take kAny:
// they are not the hot path and each loop is another set of kernels to
// compile. kConcat and kNorm have no activation: kNone.
inline ActLoop ChooseLoop(const PrologueArgs& q, bool sixteen_bit) {
  if (q.kind == Prologue::kConcat || q.kind == Prologue::kNorm) return ActLoop::kNone;
  if (!sixteen_bit) return ActLoop::kAny;
  if (q.act1 < 0) {
    if (q.act0 == kActGelu) return ActLoop::kGelu;
    if (q.act0 == kActSilu) return ActLoop::kSilu;
    if (q.act0 == kActRelu) return ActLoop::kRelu;
  } else if (q.act0 == kActSilu && q.act1 == kActLinear) {
    return ActLoop::kSwiGlu;
  }
  return ActLoop::kAny;
}

// ComputeRows (at the end of this file) for kAct, kDAct and kConcat.
//
// A rolled loop over the rows with the inputs of the next two rows in
// flight; interior sub-tiles (all but the edges of a large tensor) run it
// without bounds checks. (Unrolling by two and letting the compiler schedule
// the loads instead was up to 2% faster in the amax pass but 20-25% slower
// in the per-tensor quantize kernels: custom_calls/NOTES.md.) Rolled: the activation
// code is emitted for 8 elements instead of 64
// (nvcc took minutes on the fully unrolled kernels), and at most three rows
// of inputs occupy registers (fully unrolled, the three 8x8 inputs of a gated
// backward alone need 96 registers and the kernels spilled).
//
// kWithAct (kDAct only): emit also gets z[j] = act(h) at the row and source
// column of y[j] (sc below), the product the forward's kAct loop computes,
// from the same activation values: the same bits. For the act1' half of a
// gated backward (columns >= F) that is act(h) of column col - F, which the
// caller does not use (its act(h) tile holds columns < F only).
//
// kFp8H: h is E4M3 with per-tile scales `hs` (Fp8HInput), dz of type InT.
//
// kWithH (kAct only): emit also gets the row's inputs as loaded (RowInputs:
// r.a[j] = h0, r.b[j] = h1 when gated, at the row and column col + j; 0 past
// M), so that the caller can write h's own FP8 copy from the values it has
// loaded anyway (Fp8HOutput in act_quantize.h).
//
// kPaired (kDAct of a gated activation only; col < F): emit(i, y0, y1, z)
// gets both output halves of h's columns col + j, y0 the act0' half (output
// column col + j) and y1 the act1' half (column F + col + j), beside z =
// act(h): one load of dz, h0 and h1 and one evaluation of both activations
// serve both halves, where a caller asking for one output column at a time
// gets each half from its own loads and evaluations. The same operations as
// the unpaired loop, so the same bits.
template <typename InT, Prologue kPro, ActLoop kLoop, bool kWithAct, bool kFp8H, bool kWithH,
          bool kPaired, typename Emit>
__device__ __forceinline__ void ActRows(const PrologueArgs& q, const Fp8HInput& hs, int64_t M,
                                        int64_t row, int64_t col, Emit&& emit) {
  static_assert(kPro != Prologue::kNone && kPro != Prologue::kNorm, "an activation prologue");
  static_assert(!kWithAct || kPro == Prologue::kDAct, "act(h) beside dact(dz, h) only");
  static_assert(!kFp8H || kPro != Prologue::kConcat, "an FP8 h is an activation input");
  static_assert(!kWithH || (kPro == Prologue::kAct && !kFp8H), "h's rows: a 16/32-bit kAct h");
  static_assert(!kPaired || (kPro == Prologue::kDAct && LoopSpec<kLoop>::kGated != 0 && !kWithH),
                "both halves: the backward of a gated activation");
  using HT = std::conditional_t<kFp8H, uint8_t, InT>;
  constexpr bool kCat = kPro == Prologue::kConcat;
  static_assert(kCat == (kLoop == ActLoop::kNone), "kConcat runs the kNone loop, and only it");
  using Spec = LoopSpec<kLoop>;
  // kConcat: a thread's 8 columns lie in the first part that ends past col
  // (the host guarantees every width F_i % 8 == 0); F becomes that part's
  // width (its row stride and column bound) and c0 its first column of v.
  // Columns past the last part (edge tiles) stay in the last part at
  // sc >= F, which the checked loop reads as 0. Select chains, not
  // parts[part]: a dynamic index into the parameter array may make the
  // compiler copy it to local memory (not measured; the chains cost a few
  // compares and selects per thread).
  int64_t F = q.F, c0 = 0;
  const void* src = q.h;
  if constexpr (kCat) {
    const int n = q.n_parts;
    const int64_t e0 = q.part_end[0], e1 = q.part_end[1], e2 = q.part_end[2];
    const bool in0 = n == 1 || col < e0, in1 = n == 2 || col < e1, in2 = n == 3 || col < e2;
    src = in0 ? q.parts[0] : in1 ? q.parts[1] : in2 ? q.parts[2] : q.parts[3];
    c0 = in0 ? 0 : in1 ? e0 : in2 ? e1 : e2;
    F = (in0 ? e0 : in1 ? e1 : in2 ? e2 : q.part_end[3]) - c0;
  }
  const HT* h = static_cast<const HT*>(src);
  const InT* dz = static_cast<const InT*>(q.dz);
  const bool gated = kPaired || (!kCat && (Spec::kGated < 0 ? q.act1 >= 0 : Spec::kGated == 1));
  const int act0 = Spec::kAct0 == kActAny ? q.act0 : Spec::kAct0;
  const int act1 = Spec::kAct1 == kActAny ? q.act1 : Spec::kAct1;
  const int64_t ldh = gated ? 2 * F : F;
  // Output columns [F, 2F) of the gated backward are the act1' branch and
  // read dz, h0, h1 at column col - F. The host guarantees F % 8 == 0 when
  // gated, so a thread's 8 columns never straddle the two halves.
  const bool right = !kPaired && kPro == Prologue::kDAct && gated && col >= F;
  const int64_t sc = kCat ? col - c0 : right ? col - F : col;

  // The values of one row from its inputs (and with kWithAct or kPaired
  // act(h) in z, with kPaired the act1' half in y1); `in(j)`: column j exists.
  auto compute = [&](const RowInputs<InT, kFp8H>& r, auto&& in, float (&y)[kSub],
                     float (&z)[kSub], float (&y1)[kSub]) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if constexpr (kCat) {
        y[j] = in(j) ? r.a[j] : 0.f;
        continue;
      }
      float f0, d0, f1 = 1.f, d1 = 0.f;
      Activate(act0, r.a[j], &f0, &d0);
      if (gated) Activate(act1, r.b[j], &f1, &d1);
      const float act = gated ? __fmul_rn(f0, f1) : f0;  // the kAct value
      float val;
      if (kPro == Prologue::kAct) {
        val = act;
      } else {  // (dz * g0) * g1: the association of ops/act_quantize.py
        const float g = __fmul_rn(r.d[j], right ? f0 : d0);
        val = gated ? __fmul_rn(g, right ? d1 : f1) : g;
      }
      y[j] = in(j) ? val : 0.f;
      if constexpr (kWithAct || kPaired) z[j] = in(j) ? act : 0.f;
      if constexpr (kPaired) y1[j] = in(j) ? __fmul_rn(__fmul_rn(r.d[j], f0), d1) : 0.f;
    }
  };
  // kChecked: bounds-checked loads and values (edge sub-tiles).
  auto prefetch_loop = [&](auto checked) {
    constexpr bool kChecked = decltype(checked)::value;
    // Unchecked loads walk pointers down the rows (one add per row and
    // input instead of a 64-bit row * ld + col each time).
    const HT* pa = h + row * ldh + sc;
    const InT* pd = kPro == Prologue::kDAct ? dz + row * F + sc : nullptr;
    // kFp8H: the scales of h0's and h1's tiles in this row (walked likewise).
    [[maybe_unused]] const float* ps = kFp8H ? hs.scale + row * hs.scale_ld : nullptr;
    [[maybe_unused]] const int64_t tile_a = sc / 128, tile_b = (F + sc) / 128;
    auto load = [&](int i, RowInputs<InT, kFp8H>& r) {
      if constexpr (kChecked) {
        if constexpr (kFp8H) {
          r.a.Load(h, ldh, M, row + i, sc, F, hs);
          if (gated) r.b.Load(h, ldh, M, row + i, F + sc, 2 * F, hs);
        } else {
          r.a.Load(h, ldh, M, row + i, sc, F);
          if (gated) r.b.Load(h, ldh, M, row + i, F + sc, 2 * F);
        }
        if (kPro == Prologue::kDAct) r.d.Load(dz, F, M, row + i, sc, F);
      } else {  // rows are loaded in order 0, 1, ..., 7
        if constexpr (kFp8H) {
          r.a.LoadVec(pa, ps + tile_a);
          if (gated) r.b.LoadVec(pa + F, ps + tile_b);
          ps += hs.scale_ld;
        } else {
          r.a.LoadVec(pa);
          if (gated) r.b.LoadVec(pa + F);
        }
        pa += ldh;
        if (kPro == Prologue::kDAct) {
          r.d.LoadVec(pd);
          pd += F;
        }
      }
    };
    RowInputs<InT, kFp8H> cur, nxt;
    load(0, cur);
    load(1, nxt);
#pragma unroll 1
    for (int i = 0; i < kSub; ++i) {
      RowInputs<InT, kFp8H> next2;
      if (i + 2 < kSub) load(i + 2, next2);
      const bool row_in = row + i < M;
      float y[kSub], z[kSub], y1[kSub];
      compute(cur, [&](int j) { return !kChecked || (row_in && sc + j < F); }, y, z, y1);
      if constexpr (kPaired) {
        emit(i, y, y1, z);
      } else if constexpr (kWithAct) {
        emit(i, y, z);
      } else if constexpr (kWithH) {
        emit(i, y, cur);
      } else {
        emit(i, y);
      }
      cur = nxt;
      nxt = next2;
    }
  };

  // Decided per warp, so that every lane runs the same loop and emit may use
  // warp shuffles (ActQuantizeVec128Kernel): a warp with any edge sub-tile
  // takes the checked loop. All 32 lanes of a warp must call ComputeRows.
  // (F % 8 == 0 also aligns the 8-byte loads of an FP8 h.)
  const bool interior = __all_sync(0xffffffffu, row + kSub <= M && sc + kSub <= F &&
                                                    F % RawRow<InT>::kVec == 0 &&
                                                    (!kFp8H || F % kSub == 0));
  if (interior) {
    prefetch_loop(std::false_type{});
  } else {
    prefetch_loop(std::true_type{});
  }
}

// One value of the kNorm prologue, as te_jax/ops/normalization.py's
// norm_apply_reference computes it under XLA: v = (x - mean) * rstd (x * rstd
// for rmsnorm, `center` false), each operation rounded, then
// fma(v, gamma, beta): XLA contracts the reference's `v * gamma + beta` into
// one fused multiply-add (checked on XLA:CPU, where the tests evaluate the
// reference), and v * gamma without beta (adding 0 would turn -0 into +0).
// So NormStatsKernel's amax, the tile kernels and the reference given the
// same statistics see the same float32 values bit for bit.
__device__ __forceinline__ float NormValue(float x, float mean, float rstd, float gamma,
                                           float beta, bool center, bool has_beta) {
  const float v = __fmul_rn(center ? __fsub_rn(x, mean) : x, rstd);
  return has_beta ? __fmaf_rn(v, gamma, beta) : __fmul_rn(v, gamma);
}

// gamma' (1 + gamma when zero-centered) and beta of columns [col, col + 8)
// of an F-column normalization (float32 (F,) buffers, beta may be null);
// 0 past F.
__device__ __forceinline__ void NormColumns(const float* __restrict__ gamma,
                                            const float* __restrict__ beta, int zero_centered,
                                            int64_t F, int64_t col, float (&g)[kSub],
                                            float (&b)[kSub]) {
  if (col + kSub <= F && F % 4 == 0) {  // col % 8 == 0: 16-byte aligned float4s
    const float4* gv = reinterpret_cast<const float4*>(gamma + col);
    const float4 g0 = __ldg(gv), g1 = __ldg(gv + 1);
    g[0] = g0.x; g[1] = g0.y; g[2] = g0.z; g[3] = g0.w;
    g[4] = g1.x; g[5] = g1.y; g[6] = g1.z; g[7] = g1.w;
    if (beta != nullptr) {
      const float4* bv = reinterpret_cast<const float4*>(beta + col);
      const float4 b0 = __ldg(bv), b1 = __ldg(bv + 1);
      b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w;
      b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
    } else {
#pragma unroll
      for (int j = 0; j < kSub; ++j) b[j] = 0.f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const bool in = col + j < F;
      g[j] = in ? __ldg(gamma + col + j) : 0.f;
      b[j] = in && beta != nullptr ? __ldg(beta + col + j) : 0.f;
    }
  }
  if (zero_centered) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) g[j] = __fadd_rn(g[j], 1.f);
  }
}

// ComputeRows (below) for kNorm: v = NormValue of x = q.h (M, F) with the
// row statistics q.mean, q.rstd and the column parameters q.gamma, q.beta
// (a thread's 8 columns are fixed, so those are loaded once). The same
// rolled row loop as ActRows, with the next two rows (x and statistics) in
// flight, and the same warp-uniform interior / checked split.
template <typename InT, typename Emit>
__device__ __forceinline__ void NormRows(const PrologueArgs& q, int64_t M, int64_t row,
                                         int64_t col, Emit&& emit) {
  const int64_t F = q.F;
  const InT* x = static_cast<const InT*>(q.h);
  const bool center = q.mean != nullptr;
  const bool has_beta = q.beta != nullptr;
  float g[kSub], b[kSub];
  NormColumns(q.gamma, q.beta, q.zero_centered, F, col, g, b);

  struct Row {
    RawRow<InT> x;
    float mean, rstd;
  };
  auto loop = [&](auto checked) {
    constexpr bool kChecked = decltype(checked)::value;
    const InT* px = x + row * F + col;  // unchecked loads walk down the rows
    auto load = [&](int i, Row& r) {
      const int64_t gr = row + i;
      if constexpr (kChecked) {
        r.x.Load(x, F, M, gr, col, F);
        const bool in = gr < M;
        r.mean = center && in ? __ldg(q.mean + gr) : 0.f;
        r.rstd = in ? __ldg(q.rstd + gr) : 0.f;
      } else {
        r.x.LoadVec(px);
        px += F;
        r.mean = center ? __ldg(q.mean + gr) : 0.f;
        r.rstd = __ldg(q.rstd + gr);
      }
    };
    Row cur, nxt;
    load(0, cur);
    load(1, nxt);
#pragma unroll 1
    for (int i = 0; i < kSub; ++i) {
      Row next2;
      if (i + 2 < kSub) load(i + 2, next2);
      const bool row_in = row + i < M;
      float y[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const bool in = !kChecked || (row_in && col + j < F);
        y[j] = in ? NormValue(cur.x[j], cur.mean, cur.rstd, g[j], b[j], center, has_beta) : 0.f;
      }
      emit(i, y);
      cur = nxt;
      nxt = next2;
    }
  };
  const bool interior = __all_sync(0xffffffffu, row + kSub <= M && col + kSub <= F &&
                                                    F % RawRow<InT>::kVec == 0);
  if (interior) {
    loop(std::false_type{});
  } else {
    loop(std::true_type{});
  }
}

// Calls emit(i, y) for i = 0..7 in order, where y[j] = v[row + i][col + j] in float32,
// v being the (M, K) output of the prologue (K = F for kAct and kNorm,
// n_act*F for kDAct, the sum of the part widths for kConcat), and 0 outside
// it (padding must not raise an amax, and act(0) need not be 0: sigmoid). `q` must match
// kLoop (ChooseLoop). All 32 lanes of a warp must call it: the row loop runs
// warp-uniformly, so emit may use warp shuffles. With kWithAct (kDAct only)
// it calls emit(i, y, z) with z[j] = act(h)[row + i][col + j] for the
// columns col + j < F (see ActRows). With kFp8H (kAct, kDAct) h is E4M3
// with the tile scales `hs` (Fp8HInput) and InT is dz's element type. With
// kWithH (kAct only) it calls emit(i, y, r), r the row's RowInputs<InT>.
// With kPaired (kDAct, gated, col < F) it calls emit(i, y0, y1, z) with
// both output halves of h's columns and act(h) (see ActRows).
template <typename InT, Prologue kPro, ActLoop kLoop, bool kWithAct = false,
          bool kFp8H = false, bool kWithH = false, bool kPaired = false, typename Emit>
__device__ __forceinline__ void ComputeRows(const PrologueArgs& q, int64_t M, int64_t row,
                                            int64_t col, Emit&& emit,
                                            const Fp8HInput& hs = Fp8HInput()) {
  if constexpr (kPro == Prologue::kNorm) {
    static_assert(kLoop == ActLoop::kNone && !kWithAct && !kFp8H && !kWithH && !kPaired,
                  "kNorm runs the kNone loop");
    NormRows<InT>(q, M, row, col, emit);
  } else {
    ActRows<InT, kPro, kLoop, kWithAct, kFp8H, kWithH, kPaired>(q, hs, M, row, col, emit);
  }
}

}  // namespace prologue
}  // namespace te_jax

