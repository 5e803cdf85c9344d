// Fused activation + FP8 quantize kernels of the FP8 MLP (ffi/act_quantize.cc),
// also used for concatenations (ffi/concat_quantize.cc) and normalizations
// (ffi/normalization.cc): they quantize v = act(h), dact(dz, h),
// [part0 | part1 | ...] or norm(x) (kernels/prologue.h),
// computed from the inputs they load, so v is never written in 16 or 32
// bits: ActQuantizeTensorKernel for one scale (delayed and current scaling),
// ActQuantizeVec128Kernel for 1x128 + 128x1 scales, and TileAmaxKernel for
// current scaling's amax pass. The activation loop (prologue::ActLoop:
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
// The per-tensor backward of a gated activation with F % 128 == 0 runs one
// block per column tile of h that writes both halves of dh (template
// parameter kPaired), reading dz, h0 and h1 and evaluating the activations
// once for both.
//
// dact(dz, h) also reads h as E4M3 bytes with 1x128 tile scales (template
// parameter kFp8H; Fp8HInput in kernels/act_quantize.h), the copy of h that
// store_act_input_in_fp8 keeps, instead of a 16-bit h dequantized first;
// act(h) also writes that copy (kOut bit kOutH; Fp8HOutput) from the h
// values it loads, instead of a quantize pass of its own over h.
#include "kernels/act_quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/prologue.h"
#include "kernels/quantize.h"
#include "kernels/tile.cuh"

namespace te_jax {
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

// Whether the activation of loop kLoop is gated (the runtime ids for kAny).
template <prologue::ActLoop kLoop>
__device__ __forceinline__ bool Gated(const PrologueArgs& q) {
  constexpr int kGated = prologue::LoopSpec<kLoop>::kGated;
  return kGated < 0 ? q.act1 >= 0 : kGated == 1;
}

// The prologue kernels. Both compute v = act(h) or dact(dz, h) one row of
// a thread's 8x8 sub-tile at a time (prologue::ComputeRows) and cast and
// store each row of the rowwise copy as soon as it is computed; they differ
// in what the columnwise copy needs. Same bytes as QuantizeTileKernel would
// write for v. They are bound by instruction issue, so the casts go two
// per cvt (Cast2) and bytes are placed by byte_perm: per-element casts,
// shifts and selects were a sixth of the instructions per element
// (profile and timings: docs/benchmarks-log-2026-11.md).

// Launch bound of ActQuantizeTensorKernel and ActQuantizeVec128Kernel: 3
// blocks per SM (at most 80 registers) wherever the loop fits that without
// spilling (ptxas -v, nvcc 13.0): every 16-bit loop except "any" (up to 110
// registers) and the fp16 SwiGLU backward (36-40 bytes of spills at 80).
// 2 blocks (up to 128 registers) for those, for fp32 inputs, and for the
// backward that also writes act(h)'s columnwise copy (its column bytes or
// maxima and the act(h) values of the row spilled 16-220 bytes at 80), and
// the forward that writes both copies of z and h's E4M3 copy (SwiGLU and
// the fp16 gelu spilled 12-44 bytes at 80; z's rowwise copy and h's fit in
// 58-80 registers with every 16-bit specialized loop).
// The paired backward (both halves of a gated dh, three column byte sets)
// takes 2 as well.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut, bool kPaired = false>
constexpr int ActMinBlocks() {
  if (sizeof(InT) != 2 || kLoop == prologue::ActLoop::kAny || (kOut & kOutActCols) || kPaired)
    return 2;
  if ((kOut & kOutH) && (kOut & kOutCols)) return 2;
  if (std::is_same_v<InT, __half> && kPro == Prologue::kDAct &&
      kLoop == prologue::ActLoop::kSwiGlu)
    return 2;
  return 3;
}

// ScaleMode::kTensor (delayed and current scaling): the one scale is known
// before the tile is read, so the bytes for the columnwise copy are collected
// in registers as well (ColumnBytes, 16 words): no float tile, no dynamic
// shared memory. With kOutActCols the bytes of act(h)'s columnwise copy are
// collected the same way from the act(h) values of the same loop, with
// act(h)'s own scale, in the tiles of act(h)'s F columns (all tiles when not
// gated, the left half of a gated dh).
//
// kPaired (a gated backward with F % 128 == 0; the grid spans h's F columns,
// not dh's 2F): the block writes the tile of dh at its columns and the tile
// F columns to the right, from one load of dz, h0 and h1 and one evaluation
// of the activations. Split, the two tiles are two blocks that each load
// all three inputs and evaluate both activations and their derivatives.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut, bool kFp8H,
          bool kPaired>
__global__ void __launch_bounds__(kThreads, ActMinBlocks<InT, kPro, kLoop, kOut, kPaired>())
    ActQuantizeTensorKernel(QuantizeArgs p, PrologueArgs q, QuantizeArgs z, Fp8HInput hs,
                            Fp8HOutput ho) {
  constexpr bool kRows = kOut & kOutRows, kCols = kOut & kOutCols, kAct = kOut & kOutActCols;
  constexpr bool kH = kOut & kOutH;
  __shared__ unsigned warp_red[kThreads / 32];
  __shared__ __align__(16) uint8_t tbuf[kCols || kAct ? kTile * kTile : 16];  // transposed bytes

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const bool block0 = st.t == 0 && blockIdx.x == 0 && blockIdx.y == 0;
  const Fp8Out fmt = OutFormat(p);
  const float s = TensorScale(p, fmt);
  if (p.scale_inv != nullptr && block0) *p.scale_inv = 1.f / s;
  const Fp8Out zfmt = OutFormat(z);
  float zs = 1.f;
  const bool z_tile = kAct && st.k0 < z.K;  // block-uniform
  if constexpr (kAct) {
    zs = TensorScale(z, zfmt);
    if (z.scale_inv != nullptr && block0) *z.scale_inv = 1.f / zs;
  }

  // Paired, the right tile's rows are whole 8-byte words as well: F % 128 == 0.
  const bool vec_out = (K % 8 == 0) && (st.gc + kSub <= K);
  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = kRows ? p.data + first_row * K + st.gc : nullptr;  // a row per emit
  [[maybe_unused]] const bool gated = Gated<kLoop>(q);
  [[maybe_unused]] HCopyRow h_at = kH ? HCopyRow(ho, q, gated, first_row, st) : HCopyRow{};
  unsigned amax = 0;  // bits: two elements per 3-input integer max (MaxAbs took more here)
  ColumnBytes cols, zcols;
  [[maybe_unused]] ColumnBytes cols_right;  // kPaired: the right tile's
  // Row i of one output tile: its amax and casts, the rowwise store at `at`
  // (output column gc), the bytes for the columnwise copy into `c`.
  auto quantize_row = [&](int i, const float (&y)[kSub], uint8_t* at, int64_t gc,
                          ColumnBytes& c) {
    unsigned pair[kSub / 2];  // columns 2k (bits 0-7) and 2k + 1 (bits 8-15)
#pragma unroll
    for (int k = 0; k < kSub / 2; ++k) {
      amax = max(amax, max(AbsBits(y[2 * k]), AbsBits(y[2 * k + 1])));
      pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
    }
    if constexpr (kRows) {
      if (first_row + i < M) StoreRowWords(at, PackPairs(pair), vec_out, K - gc);
    }
    if constexpr (kCols) c.Push(pair);
  };
  ForRows<InT, kPro, kLoop, kAct, kFp8H, kH, kPaired>(
      q, hs, M, first_row, st.gc,
      [&](int i, const float (&y)[kSub], const float (&zv)[kSub], const auto& extra) {
        quantize_row(i, y, out_row, st.gc, cols);
        if constexpr (kPaired) quantize_row(i, extra, out_row + q.F, st.gc + q.F, cols_right);
        if constexpr (kRows) out_row += K;
        if constexpr (kAct) {
          if (z_tile) {
            unsigned zpair[kSub / 2];
#pragma unroll
            for (int k = 0; k < kSub / 2; ++k)
              zpair[k] = Cast2(zv[2 * k] * zs, zv[2 * k + 1] * zs, zfmt.interp);
            zcols.Push(zpair);
          }
        }
        if constexpr (kH) StoreHRow(extra, h_at, q, gated, first_row + i < M, st, ho.scale_ld);
      });
  if (p.amax_out != nullptr) {
    amax = BlockMaxU(amax, warp_red);
    if (st.t == 0) atomicMax(reinterpret_cast<unsigned*>(p.amax_out), amax);
  }
  // The columnwise copies, through tbuf as in QuantizeTileKernel.
  if constexpr (kCols) {
    cols.ToTile(tbuf, st);
    __syncthreads();
    StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);
    if constexpr (kPaired) {
      __syncthreads();  // the store above has read tbuf
      cols_right.ToTile(tbuf, st);
      __syncthreads();
      StoreTransposedTile(p, tbuf, st.m0, st.k0 + q.F, st.t);
    }
  }
  if constexpr (kAct) {
    if (z_tile) {
      if constexpr (kCols) __syncthreads();  // the store above has read tbuf
      zcols.ToTile(tbuf, st);
      __syncthreads();
      StoreTransposedTile(z, tbuf, st.m0, st.k0, st.t);
    }
  }
}

// ScaleMode::kVec128 (blockwise): a row's 1x128 scale is a max over the 16
// lanes that share the row, available in the row loop; a column's 128x1
// scale needs all 128 rows of the tile. So the rowwise copy is stored from
// the row loop, and the values are parked in the thread's 256-byte slice of
// dynamic shared memory (16 float4 slots, 64 KB per block) until the column
// scales are known; the slot index is XOR-swizzled by the lane's low 3 bits
// so that the 8 lanes of each 16-byte access phase hit distinct banks (the
// 256-byte stride alone would put all 8 on the same ones). Once every thread
// has read its values back, the transposed bytes reuse that memory: 64 KB +
// 8.5 KB static fit 3 blocks per SM (ActMinBlocks), where a byte tile of its
// own would fit 2 and run slower (benchmarks/act_math.cu; the timings of
// this layout against the others are in docs/benchmarks-log-2026-11.md).
constexpr int kScratchF4 = kSub * kSub / 4;
constexpr int kScratchBytes = kThreads * kScratchF4 * 16;
static_assert(kScratchBytes >= kTile * kTile, "the transposed bytes reuse the scratch");
extern __shared__ float4 act_scratch[];

template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut, bool kFp8H>
__global__ void __launch_bounds__(kThreads, ActMinBlocks<InT, kPro, kLoop, kOut>())
    ActQuantizeVec128Kernel(QuantizeArgs p, PrologueArgs q, QuantizeArgs z, Fp8HInput hs,
                            Fp8HOutput ho) {
  constexpr bool kRows = kOut & kOutRows, kCols = kOut & kOutCols, kAct = kOut & kOutActCols;
  constexpr bool kH = kOut & kOutH;
  static_assert(!kAct || kCols, "act(h)'s transposed bytes reuse the scratch of v's");
  __shared__ unsigned col_part[kThreads / 16][kTile];  // per-row-group column amax
  __shared__ float col_scale[kTile];

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p);
  float4* mine = act_scratch + st.t * kScratchF4;  // kCols only: dynamic shared memory
  const int swz = st.t & 7;  // slot k of this thread is mine[k ^ swz]

  const bool vec_out = (K % 8 == 0) && (st.gc + kSub <= K);
  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = kRows ? p.data + first_row * K + st.gc : nullptr;  // a row per emit
  [[maybe_unused]] const bool gated = Gated<kLoop>(q);
  [[maybe_unused]] HCopyRow h_at = kH ? HCopyRow(ho, q, gated, first_row, st) : HCopyRow{};
  float cmax[kSub], zmax[kSub];  // column maxima of v and (kAct) of act(h)
#pragma unroll
  for (int j = 0; j < kSub; ++j) cmax[j] = zmax[j] = 0.f;
  // ComputeRows runs its row loop warp-uniformly (prologue.h), so the
  // 16-lane shuffles below are reached by all 32 lanes together.
  ForRows<InT, kPro, kLoop, kAct, kFp8H, kH, false>(
      q, hs, M, first_row, st.gc,
      [&](int i, const float (&y)[kSub], const float (&zv)[kSub], const auto& hr) {
        if constexpr (kRows) {
          float rmax = 0.f;
#pragma unroll
          for (int j = 0; j < kSub; ++j) rmax = MaxAbs(rmax, y[j]);
          const float s = ComputeScale(__uint_as_float(WarpMaxU(__float_as_uint(rmax), 16)),
                                       fmt.max, p.pow2);
          const int64_t gr = first_row + i;
          if (gr < M) {
            // sinv native layout: (ceil(K/128), roundup(M, 4)), M contiguous.
            if (st.cg == 0) p.sinv[(st.k0 / kTile) * p.sinv_ld + gr] = 1.f / s;
            unsigned pair[kSub / 2];
#pragma unroll
            for (int k = 0; k < kSub / 2; ++k)
              pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
            StoreRowWords(out_row, PackPairs(pair), vec_out, K - st.gc);
          }
          out_row += K;
        }
        if constexpr (kCols) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) cmax[j] = MaxAbs(cmax[j], y[j]);
          mine[(2 * i) ^ swz] = make_float4(y[0], y[1], y[2], y[3]);
          mine[(2 * i + 1) ^ swz] = make_float4(y[4], y[5], y[6], y[7]);
        }
        if constexpr (kAct) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) zmax[j] = MaxAbs(zmax[j], zv[j]);
        }
        if constexpr (kH) StoreHRow(hr, h_at, q, gated, first_row + i < M, st, ho.scale_ld);
      });
  if constexpr (kCols) {  // the rest writes the columnwise copies
    unsigned cmax_bits[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) cmax_bits[j] = __float_as_uint(cmax[j]);
    ColumnScales(p, st, cmax_bits, fmt.max, col_part, col_scale);

    // The columnwise copy from the parked values, through tbuf as in
    // QuantizeTileKernel; tbuf is the scratch, free once all threads have
    // read their values.
    float v[kSub][kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      const float4 lo = mine[(2 * i) ^ swz], hi = mine[(2 * i + 1) ^ swz];
      v[i][0] = lo.x; v[i][1] = lo.y; v[i][2] = lo.z; v[i][3] = lo.w;
      v[i][4] = hi.x; v[i][5] = hi.y; v[i][6] = hi.z; v[i][7] = hi.w;
    }
    __syncthreads();
    uint8_t* tbuf = reinterpret_cast<uint8_t*>(act_scratch);
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const float cs = col_scale[st.c0 + j];
      unsigned pair[kSub / 2];  // rows 2k and 2k + 1 of column j
#pragma unroll
      for (int k = 0; k < kSub / 2; ++k)
        pair[k] = Cast2(v[2 * k][j] * cs, v[2 * k + 1][j] * cs, fmt.interp);
      const int c = st.c0 + j;
      TileChunk(tbuf, c, st.rg) = PackPairs(pair);
    }
    __syncthreads();
    StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);

    // act(h)'s columnwise copy (kAct, the tiles of its F columns): its 128x1
    // scales from the column maxima gathered above, then the values again
    // from h (the forward's kAct loop, the same bits; h was just read, so
    // mostly from L2) cast with them. Parking them as well would take a
    // second 64 KB of shared memory and one block per SM.
    if constexpr (kAct) {
      if (st.k0 >= z.K) return;  // block-uniform: a tile of the act1' half of a gated dh
      const Fp8Out zfmt = OutFormat(z);
      unsigned zmax_bits[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) zmax_bits[j] = __float_as_uint(zmax[j]);
      // Its barriers also order the store above (reads of tbuf) before the
      // writes below.
      ColumnScales(z, st, zmax_bits, zfmt.max, col_part, col_scale);
      float zs[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) zs[j] = col_scale[st.c0 + j];
      ColumnBytes zcols;
      prologue::ComputeRows<InT, Prologue::kAct, kLoop, false, kFp8H>(
          q, M, first_row, st.gc,
          [&](int, const float (&a)[kSub]) {
            unsigned pair[kSub / 2];
#pragma unroll
            for (int k = 0; k < kSub / 2; ++k)
              pair[k] = Cast2(a[2 * k] * zs[2 * k], a[2 * k + 1] * zs[2 * k + 1], zfmt.interp);
            zcols.Push(pair);
          },
          hs);
      zcols.ToTile(tbuf, st);
      __syncthreads();
      StoreTransposedTile(z, tbuf, st.m0, st.k0, st.t);
    }
  }
}

// ScaleMode::kVec128 for a paired gated backward (F % 128 == 0, 16-bit
// inputs; the grid spans h's F columns): the tile of dh at the block's
// columns, the tile F columns to the right and act(h)'s tile, in passes over
// the same inputs instead of ActQuantizeVec128Kernel's parked values. Pass 1
// stores both halves' rowwise copies from the row loop and gathers the three
// tiles' column maxima; pass 2 evaluates dh again (the inputs now mostly in
// L2) and casts it with the column scales into ColumnBytes, as the
// per-tensor kernel does; pass 3 act(h) likewise, as ActQuantizeVec128Kernel
// does. Split, the two halves' blocks each load all three inputs and
// evaluate both activations (the left one act(h) again): the same reads and
// evaluations, here without the 64 KB scratch that each tile's values pass
// through there. Same values (prologue::ActRows) and casts, so the same bytes.
template <typename InT, prologue::ActLoop kLoop, int kOut, bool kFp8H>
__global__ void __launch_bounds__(kThreads, 2)
    ActQuantizeVec128PairedKernel(QuantizeArgs p, PrologueArgs q, QuantizeArgs z,
                                  Fp8HInput hs) {
  static_assert((kOut & kOutBoth) == kOutBoth && !(kOut & kOutH), "dh both ways");
  constexpr bool kAct = kOut & kOutActCols;
  constexpr Prologue kPro = Prologue::kDAct;
  __shared__ unsigned col_part[kThreads / 16][kTile];  // per-row-group column amax
  __shared__ float col_scale[3][kTile];  // left, right, act(h)
  __shared__ __align__(16) uint8_t tbuf[kTile * kTile];

  const int64_t M = p.M, K = p.K, F = q.F;
  const SubTile st = ThisSubTile();
  SubTile right = st;  // the same sub-tile F columns to the right
  right.k0 += F;
  right.gc += F;
  const Fp8Out fmt = OutFormat(p);
  const int64_t first_row = st.m0 + st.r0;

  // Row i of one half: its 1x128 scale (a max over the 16 lanes of the row),
  // the scale's inverse and the rowwise bytes.
  auto store_row = [&](int i, const float (&y)[kSub], uint8_t* at, const SubTile& t) {
    float rmax = 0.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) rmax = MaxAbs(rmax, y[j]);
    const float s = ComputeScale(__uint_as_float(WarpMaxU(__float_as_uint(rmax), 16)), fmt.max,
                                 p.pow2);
    const int64_t gr = first_row + i;
    if (gr >= M) return;
    if (t.cg == 0) p.sinv[(t.k0 / kTile) * p.sinv_ld + gr] = 1.f / s;  // (K/128, M) layout
    unsigned pair[kSub / 2];
#pragma unroll
    for (int k = 0; k < kSub / 2; ++k) pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
    StoreRowWords(at, PackPairs(pair), true, K - t.gc);  // F % 128 == 0: whole words
  };
  float cmax[kSub], cmax_right[kSub], zmax[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) cmax[j] = cmax_right[j] = zmax[j] = 0.f;
  uint8_t* out_row = p.data + first_row * K + st.gc;
  prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H, false, true>(
      q, M, first_row, st.gc,
      [&](int i, const float (&y)[kSub], const float (&y_right)[kSub], const float (&zv)[kSub]) {
        store_row(i, y, out_row, st);
        store_row(i, y_right, out_row + F, right);
        out_row += K;
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          cmax[j] = MaxAbs(cmax[j], y[j]);
          cmax_right[j] = MaxAbs(cmax_right[j], y_right[j]);
          if constexpr (kAct) zmax[j] = MaxAbs(zmax[j], zv[j]);
        }
      },
      hs);

  // The 128x1 scales (each call's barriers also order its reads of col_part
  // before the next call's writes).
  unsigned bits[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) bits[j] = __float_as_uint(cmax[j]);
  ColumnScales(p, st, bits, fmt.max, col_part, col_scale[0]);
#pragma unroll
  for (int j = 0; j < kSub; ++j) bits[j] = __float_as_uint(cmax_right[j]);
  ColumnScales(p, right, bits, fmt.max, col_part, col_scale[1]);
  const Fp8Out zfmt = OutFormat(z);
  if constexpr (kAct) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) bits[j] = __float_as_uint(zmax[j]);
    ColumnScales(z, st, bits, zfmt.max, col_part, col_scale[2]);
  }

  // Pass 2: dh's columnwise copies (pass 3: act(h)'s, from h alone as the
  // forward computes it; in pass 2 a third ColumnBytes spilled 92 bytes).
  auto push = [](ColumnBytes& c, const float (&v)[kSub], const float* scale,
                 __nv_fp8_interpretation_t interp) {
    unsigned pair[kSub / 2];
#pragma unroll
    for (int k = 0; k < kSub / 2; ++k)
      pair[k] = Cast2(v[2 * k] * scale[2 * k], v[2 * k + 1] * scale[2 * k + 1], interp);
    c.Push(pair);
  };
  {
    const float* cs = col_scale[0] + st.c0;
    const float* cs_right = col_scale[1] + st.c0;
    ColumnBytes cols, cols_right;
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H, false, true>(
        q, M, first_row, st.gc,
        [&](int, const float (&y)[kSub], const float (&y_right)[kSub], const float (&)[kSub]) {
          push(cols, y, cs, fmt.interp);
          push(cols_right, y_right, cs_right, fmt.interp);
        },
        hs);
    cols.ToTile(tbuf, st);
    __syncthreads();
    StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);
    __syncthreads();  // the store above has read tbuf
    cols_right.ToTile(tbuf, st);
    __syncthreads();
    StoreTransposedTile(p, tbuf, st.m0, right.k0, st.t);
  }
  if constexpr (kAct) {
    const float* zs = col_scale[2] + st.c0;
    ColumnBytes zcols;
    prologue::ComputeRows<InT, Prologue::kAct, kLoop, false, kFp8H>(
        q, M, first_row, st.gc,
        [&](int, const float (&a)[kSub]) { push(zcols, a, zs, zfmt.interp); }, hs);
    __syncthreads();  // the store above has read tbuf
    zcols.ToTile(tbuf, st);
    __syncthreads();
    StoreTransposedTile(z, tbuf, st.m0, st.k0, st.t);
  }
}

// max|v| of a prologue's output, computed by the same prologue::ComputeRows
// (so the same values bit for bit) on the same tiles, without the scratch;
// one atomicMax per 128x128 tile (kPaired: per pair of tiles F columns
// apart, as ActQuantizeTensorKernel's).
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, bool kFp8H, bool kPaired>
__global__ void __launch_bounds__(kThreads)
    TileAmaxKernel(QuantizeArgs p, PrologueArgs q, Fp8HInput hs) {
  __shared__ unsigned warp_red[kThreads / 32];
  const int t = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kTile + (t / 16) * kSub;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + (t % 16) * kSub;
  float amax = 0.f;
  if constexpr (kPaired) {
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H, false, true>(
        q, p.M, row, col,
        [&](int, const float (&y0)[kSub], const float (&y1)[kSub], const float (&)[kSub]) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) amax = MaxAbs(MaxAbs(amax, y0[j]), y1[j]);
        },
        hs);
  } else {
    prologue::ComputeRows<InT, kPro, kLoop, false, kFp8H>(
        q, p.M, row, col,
        [&](int, const float (&y)[kSub]) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) amax = MaxAbs(amax, y[j]);
        },
        hs);
  }
  const unsigned block_amax = BlockMaxU(__float_as_uint(amax), warp_red);
  if (t == 0) atomicMax(reinterpret_cast<unsigned*>(p.amax_out), block_amax);
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

template <typename InT, ScaleMode kMode, Prologue kPro, prologue::ActLoop kLoop, int kOut,
          bool kFp8H>
cudaError_t LaunchVariant(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs& z,
                          const Fp8HInput& hs, const Fp8HOutput& ho, cudaStream_t stream) {
  if constexpr (kMode == ScaleMode::kTensor) {
    if constexpr (CanPair<InT, kPro, kLoop>()) {
      if (Paired(q)) {
        ActQuantizeTensorKernel<InT, kPro, kLoop, kOut, kFp8H, true>
            <<<PairedGrid(a, q), kThreads, 0, stream>>>(a, q, z, hs, ho);
        return cudaGetLastError();
      }
    }
    ActQuantizeTensorKernel<InT, kPro, kLoop, kOut, kFp8H, false>
        <<<TileGrid(a), kThreads, 0, stream>>>(a, q, z, hs, ho);
  } else {
    if constexpr (CanPair<InT, kPro, kLoop>()) {
      if (Paired(q)) {
        ActQuantizeVec128PairedKernel<InT, kLoop, kOut, kFp8H>
            <<<PairedGrid(a, q), kThreads, 0, stream>>>(a, q, z, hs);
        return cudaGetLastError();
      }
    }
    auto* kernel = ActQuantizeVec128Kernel<InT, kPro, kLoop, kOut, kFp8H>;
    // Only the columnwise copy parks values in the scratch.
    constexpr int kDynamic = (kOut & kOutCols) ? kScratchBytes : 0;
    if constexpr (kDynamic > 0) {
      // More than 48 KB of dynamic shared memory needs an opt-in, which holds
      // per device: set it at every launch (a host-side call) instead of
      // tracking devices.
      cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamic);
      // Ask for the largest shared-memory carveout: 3 blocks take ~220 KB.
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
      if (e != cudaSuccess) return e;
    }
    kernel<<<TileGrid(a), kThreads, kDynamic, stream>>>(a, q, z, hs, ho);
  }
  return cudaGetLastError();
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

template <typename InT, ScaleMode kMode, Prologue kPro, bool kFp8H>
cudaError_t LaunchWithPrologue(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs& z,
                               const Fp8HInput& hs, const Fp8HOutput& ho, int out,
                               cudaStream_t stream) {
  return WithOutputs<kPro>(out, [&](auto outs) {
    return WithLoop<InT, kPro, kFp8H>(q, [&](auto loop) {
      return LaunchVariant<InT, kMode, kPro, decltype(loop)::value, decltype(outs)::value, kFp8H>(
          a, q, z, hs, ho, stream);
    });
  });
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

// Host-side guard of the prologue fields. The FFI handlers check them first
// with messages; this keeps any other caller from reading out of bounds.
bool PrologueValid(const QuantizeArgs& a, const PrologueArgs& q) {
  if (q.kind == Prologue::kNone) return true;
  if (q.kind == Prologue::kConcat) {
    if (q.n_parts < 1 || q.n_parts > kMaxConcatParts || q.F <= 0 || q.F % 8 != 0 ||
        a.K != q.n_parts * q.F)
      return false;
    for (int i = 0; i < q.n_parts; ++i)
      if (q.parts[i] == nullptr) return false;
    return true;
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

// With kFp8H only kDAct (FP8 h) is built; `hs` is ignored otherwise.
template <typename InT, bool kFp8H>
cudaError_t LaunchTileAmax(const QuantizeArgs& b, const PrologueArgs& q, const Fp8HInput& hs,
                           cudaStream_t stream) {
  return WithPrologue(q.kind, [&](auto pro) {
    constexpr Prologue kPro = decltype(pro)::value;
    // The norm's amax comes from its statistics pass (kernels/normalization.cu).
    if constexpr (kPro == Prologue::kNorm || (kFp8H && kPro != Prologue::kDAct)) {
      return cudaErrorInvalidValue;
    } else {
      return WithLoop<InT, kPro, kFp8H>(q, [&](auto loop) {
        constexpr prologue::ActLoop kLoop = decltype(loop)::value;
        if constexpr (CanPair<InT, kPro, kLoop>()) {
          if (Paired(q)) {
            TileAmaxKernel<InT, kPro, kLoop, kFp8H, true>
                <<<PairedGrid(b, q), kThreads, 0, stream>>>(b, q, hs);
            return cudaGetLastError();
          }
        }
        TileAmaxKernel<InT, kPro, kLoop, kFp8H, false><<<TileGrid(b), kThreads, 0, stream>>>(b, q, hs);
        return cudaGetLastError();
      });
    }
  });
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
  auto typed = [&](auto in) {
    using InT = decltype(in);
    return WithPrologue(q.kind, [&](auto pro) {
      constexpr Prologue kPro = decltype(pro)::value;
      auto launch = [&](auto fp8_h) {
        constexpr bool kFp8H = decltype(fp8_h)::value;
        return a.mode == ScaleMode::kTensor
                   ? LaunchWithPrologue<InT, ScaleMode::kTensor, kPro, kFp8H>(a, q, z, hs, ho,
                                                                              out, stream)
                   : LaunchWithPrologue<InT, ScaleMode::kVec128, kPro, kFp8H>(a, q, z, hs, ho,
                                                                              out, stream);
      };
      if constexpr (kPro == Prologue::kDAct) {  // the only prologue built for an FP8 h
        if (h_fp8 != nullptr) return launch(std::true_type{});
      }
      return launch(std::false_type{});
    });
  };
  switch (a.in) {
    case InType::kF32: return typed(float{});
    case InType::kBF16: return typed(__nv_bfloat16{});
    case InType::kF16: return typed(__half{});
  }
  return cudaErrorInvalidValue;
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
  auto typed = [&](auto in) {
    using InT = decltype(in);
    return h_fp8 != nullptr ? LaunchTileAmax<InT, true>(b, q, *h_fp8, stream)
                            : LaunchTileAmax<InT, false>(b, q, Fp8HInput(), stream);
  };
  switch (a.in) {
    case InType::kF32: return typed(float{});
    case InType::kBF16: return typed(__nv_bfloat16{});
    case InType::kF16: return typed(__half{});
  }
  return cudaErrorInvalidValue;
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
