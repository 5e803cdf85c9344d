// The 1x128 kernel (blockwise scaling) of the activation backward and its
// launch: dh = dact(dz, h) quantized rowwise (1x128 tiles) and columnwise
// (128x1 tiles), and, when asked (kOutActCols), act(h)'s columnwise copy
// from the same evaluation (kernels/act_quantize.cu says what they compute;
// the forward's 1x128 kernel is in act_quantize_blockwise.cu). Every
// backward of ScaleMode::kVec128 runs here: 16- and 32-bit h, an E4M3 h
// (kFp8H, Fp8HInput), every activation loop, with or without act(h)'s copy.
//
// Per 128x128 tile. A row's 1x128 scale is a max over the 16 lanes that
// share the row, so the rowwise copy is stored from the row loop
// (prologue::ComputeRows, two rows of inputs in flight). A column's 128x1
// scale needs all 128 rows, so every value of each columnwise output (dh;
// dh's act1' half when paired; act(h)) is parked in shared memory until the
// column maxima are reduced, then cast with its column's scale into a
// swizzled byte tile (TileChunk) that replaces the parked values, and
// stored transposed (StoreTransposedTile).
//
// Parking at 16 bits. Each parked value u is v rounded to odd to 16 bits
// (bf16's bits, the lowest set when any dropped bit was set): 32 KB per
// output per tile, so that both halves of a gated dh and act(h) (96 KB) fit
// 2 blocks per SM, and dh with act(h) (64 KB) 3. The columnwise bytes cast
// from u equal those cast from v when the column scale s is a power of two
// (pow2) and s <= 2^100 (kSafeScale):
//  - v * s and u * s are then exact float32 products (a power-of-two
//    factor; no overflow, as |v * s| <= fp8_max, and a product below
//    float32's normal range is far below FP8's smallest subnormal in both
//    forms, so both cast to a zero of the same sign);
//  - u keeps 8 significant bits, at least 2 more than E4M3's 4 and E5M2's 3,
//    and rounding to odd at p + 2 or more bits followed by
//    round-to-nearest-even at p bits equals rounding v to p bits directly
//    (the double-rounding property of round-to-odd: Boldo & Melquiond,
//    "Emulation of FMA and correctly rounded sums: proved algorithms using
//    rounding to odd", IEEE TC 2008). Float32 subnormal v, where bf16 keeps
//    fewer bits, lie on a 2^-133 grid that s <= 2^100 maps to 2^-33, far
//    below FP8's finest step (E5M2's 2^-16);
//  - saturation agrees: |v * s| <= fp8_max and |u * s| < fp8_max * (1 +
//    2^-7), which rounds to fp8_max.
// A block with an in-range column outside that (pow2 off, a column scale
// above 2^100 from a column amax at most 1.75 x 2^-86 for E5M2 or 2^-93
// for E4M3, or a non-finite column) takes the exact path: it evaluates the
// values again from dz and h (the same row loop, so the same bits), one
// output at a time, and casts those.
//
// Gated backward with F % 128 == 0 (kPaired, 16-bit dz): one block per
// column tile of h writes both halves of dh and act(h) from one load of dz,
// h0 and h1 and one evaluation of the activations. Other widths (F % 128 !=
// 0: a tile of dh may straddle h0's and h1's columns) and float32 dz run one
// block per tile of dh, and the blocks of dh's act1' half (columns >= F)
// leave act(h)'s copy alone (its F columns are the other blocks').
//
// Column maxima: a shuffle between the two row groups of a warp that share
// columns, then a shared-memory atomicMax per column and warp.
#include "kernels/act_quantize_common.cuh"

namespace te_jax {
namespace {

using prologue::ActLoop;

constexpr int kParkWords = kTile * kTile * 2 / 16;  // uint4s of one parked output (32 KB)
static_assert(kParkWords * 16 >= kTile * kTile, "a byte tile replaces an output's parked values");
// Largest column scale whose parked values give exact casts (see the top).
constexpr float kSafeScale = 0x1p100f;

// The parked outputs: region o (kParkWords uint4s) holds output o; thread t
// owns uint4s [8t, 8t + 8) of each region, one per row of its sub-tile, at
// slot row ^ (t & 7) so that the 8 lanes of a 16-byte access phase (slices
// 128 bytes apart: all on the same banks) hit 8 distinct 16-byte bank groups.
// After a region has been read back it is that output's transposed byte tile
// (TileChunk layout, 16 KB).
extern __shared__ uint4 dact_park[];

// Two floats rounded to odd to 16 bits each (a in bits 0-15, b in 16-31):
// the high half of each, with its lowest bit set when the dropped low half
// was not zero. NaN stays NaN (a payload only in the low half sets the low
// bit), infinities and zeros stay exact, the sign is kept.
__device__ __forceinline__ unsigned PackRoundOdd16(float a, float b) {
  const unsigned ua = __float_as_uint(a), ub = __float_as_uint(b);
  const unsigned hi = __byte_perm(ua, ub, 0x7632);
  const unsigned lo = __byte_perm(ua, ub, 0x5410);
  return hi | __vminu2(lo, 0x00010001u);  // per half: 1 if any low bit was set
}

// Value j (0-7) of a parked row.
__device__ __forceinline__ float UnpackRow(const uint4& w, int j) {
  const unsigned word = j / 2 == 0 ? w.x : j / 2 == 1 ? w.y : j / 2 == 2 ? w.z : w.w;
  return __uint_as_float(j % 2 ? word & 0xFFFF0000u : word << 16);
}

// Launch bound: 3 blocks per SM (80 registers) for the 16-bit gelu, silu
// and relu loops (dh and act(h) parked: 64 KB + 1 KB static per block):
// with bf16 gelu and act(h) at 16k x 16k on the H100, 0.913 ms against
// 0.963 with 2, although 80 registers spill there (ptxas -v, nvcc 13.0:
// 104 bytes stored, 168 loaded, 2 spill instructions in the interior row
// loop; 216 / 312 with an E4M3 h, not yet timed). 2 (128 registers) for
// the paired kernel (96 KB parked with act(h)), the unpaired SwiGLU (150-480
// bytes of spills at 80), the "any" loop and float32 dz; their spills (up
// to 328 / 488 bytes, float32 dz with act(h)) lie on the exact path and at
// the tail, at most one spill instruction in the interior row loop.
template <typename InT, ActLoop kLoop, bool kPaired>
constexpr int DActMinBlocks() {
  return (kPaired || sizeof(InT) != 2 || kLoop == ActLoop::kAny ||
          prologue::LoopSpec<kLoop>::kGated != 0)
             ? 2
             : 3;
}

// Outputs: o = 0 dh (its act0' half when kPaired), o = 1 dh's act1' half
// (kPaired only, F columns to the right), o = kZ act(h) (kAct). Grid: one
// block per 128x128 tile of dh, or of h's F columns (kPaired).
// kMinBlocks: the launch bound (DActMinBlocks; benchmarks/act_math.cu times
// others).
template <typename InT, ActLoop kLoop, bool kFp8H, bool kAct, bool kPaired,
          int kMinBlocks = DActMinBlocks<InT, kLoop, kPaired>()>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DActQuantizeVec128Kernel(QuantizeArgs p, PrologueArgs q, QuantizeArgs z, Fp8HInput hs) {
  constexpr int kDh = kPaired ? 2 : 1, kOuts = kDh + (kAct ? 1 : 0);
  constexpr int kZ = kAct ? kDh : -1;
  // Column maxima (AbsBits), then, in place, the column scales (float bits).
  __shared__ unsigned col_max[kOuts][kTile];

  const int64_t M = p.M, K = p.K, F = q.F;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p), zfmt = OutFormat(z);
  const int swz = st.t & 7;
  uint4* const mine = dact_park + st.t * kSub;  // + o * kParkWords: output o's slice
  auto region = [](int o) { return reinterpret_cast<uint8_t*>(dact_park + o * kParkWords); };
  if (st.t < kTile) {
#pragma unroll
    for (int o = 0; o < kOuts; ++o) col_max[o][st.t] = 0u;
  }
  __syncthreads();  // zeroed before any atomicMax (after the row loop)

  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = p.data + first_row * K + st.gc;  // a row per emit
  float cmax[kOuts][kSub];
#pragma unroll
  for (int o = 0; o < kOuts; ++o) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) cmax[o][j] = 0.f;
  }
  // Row i of output o: its column maxima and parked values.
  auto park = [&](int o, int i, const float (&v)[kSub]) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) cmax[o][j] = MaxAbs(cmax[o][j], v[j]);
    mine[o * kParkWords + (i ^ swz)] =
        make_uint4(PackRoundOdd16(v[0], v[1]), PackRoundOdd16(v[2], v[3]),
                   PackRoundOdd16(v[4], v[5]), PackRoundOdd16(v[6], v[7]));
  };
  // Row i of dh's half o: the rowwise copy (row scale by a 16-lane shuffle,
  // 1/s by lane cg 0, Cast2 pairs, one 8-byte store), then parked.
  auto dh_row = [&](int o, int i, const float (&y)[kSub]) {
    const int64_t off = o * F;  // o = 1: the act1' half
    float rmax = 0.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) rmax = MaxAbs(rmax, y[j]);
    const float s =
        ComputeScale(__uint_as_float(WarpMaxU(__float_as_uint(rmax), 16)), fmt.max, p.pow2);
    const int64_t gr = first_row + i;
    if (gr < M) {
      // sinv native layout: (ceil(K/128), roundup(M, 4)), M contiguous.
      if (st.cg == 0) p.sinv[((st.k0 + off) / kTile) * p.sinv_ld + gr] = 1.f / s;
      unsigned pair[kSub / 2];
#pragma unroll
      for (int k = 0; k < kSub / 2; ++k)
        pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
      const int64_t gc = st.gc + off;
      StoreRowWords(out_row + off, PackPairs(pair), (K % 8 == 0) && (gc + kSub <= K), K - gc);
    }
    park(o, i, y);
  };
  // The row loop (all 32 lanes of a warp together: dh_row shuffles). body
  // gets y0 = dh (its act0' half when kPaired), zv = act(h) (kAct or
  // kPaired) and y1 = dh's act1' half (kPaired, else a NoRow).
  auto rows = [&](auto&& body) {
    ForRows<InT, Prologue::kDAct, kLoop, kAct && !kPaired, kFp8H, false, kPaired>(
        q, hs, M, first_row, st.gc, body);
  };
  rows([&](int i, const float (&y0)[kSub], const float (&zv)[kSub], const auto& y1) {
    dh_row(0, i, y0);
    if constexpr (kPaired) dh_row(1, i, y1);
    out_row += K;
    if constexpr (kAct) park(kZ, i, zv);
  });

  // Column maxima over the 16 row groups: lanes l and l ^ 16 of a warp are
  // row groups 2w and 2w + 1 with the same columns; then one atomicMax per
  // column per warp. Bits of non-negative floats (or the canonical NaN of
  // MaxAbs): the unsigned max is the NaN-propagating float max.
  const int lane = st.t & 31;
#pragma unroll
  for (int o = 0; o < kOuts; ++o) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      unsigned b = __float_as_uint(cmax[o][j]);
      b = max(b, __shfl_xor_sync(0xffffffffu, b, 16));
      if (lane < 16) atomicMax(&col_max[o][st.c0 + j], b);
    }
  }
  __syncthreads();
  // Column scales as ColumnScales computes them (sinv_t written by thread
  // c < 128), and whether the parked values give exact casts for them.
  // Columns past the output's width are never stored: they need not be
  // exact (act(h)'s columns in the blocks of dh's act1' half).
  bool exact_needed = false;
  if (st.t < kTile) {
    auto col_scale = [&](int o, const QuantizeArgs& a, float fp8_max, int64_t col_off) {
      const float s = ComputeScale(__uint_as_float(col_max[o][st.t]), fp8_max, a.pow2);
      col_max[o][st.t] = __float_as_uint(s);
      const int64_t gk = col_off + st.k0 + st.t;
      if (gk >= a.K) return true;
      a.sinv_t[(st.m0 / kTile) * a.sinv_t_ld + gk] = 1.f / s;
      return a.pow2 && s <= kSafeScale;  // false for a NaN s too
    };
    bool ok = col_scale(0, p, fmt.max, 0);
    if constexpr (kPaired) ok = col_scale(1, p, fmt.max, F) && ok;
    if constexpr (kAct) ok = col_scale(kZ, z, zfmt.max, 0) && ok;
    exact_needed = !ok;
  }
  exact_needed = __syncthreads_or(exact_needed);  // block-uniform from here

  if (!exact_needed) {
    // Output by output: read the slice back (8 x 16 bytes), wait until every
    // thread has, then cast the 8 columns with their scales into the byte
    // tile that replaces the region.
#pragma unroll
    for (int o = 0; o < kOuts; ++o) {
      uint4 w[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) w[i] = mine[o * kParkWords + (i ^ swz)];
      float cs[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) cs[j] = __uint_as_float(col_max[o][st.c0 + j]);
      __syncthreads();
      const __nv_fp8_interpretation_t interp = o == kZ ? zfmt.interp : fmt.interp;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        unsigned pair[kSub / 2];  // rows 2k and 2k + 1 of column j
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k)
          pair[k] = Cast2(UnpackRow(w[2 * k], j) * cs[j], UnpackRow(w[2 * k + 1], j) * cs[j],
                          interp);
        TileChunk(region(o), st.c0 + j, st.rg) = PackPairs(pair);
      }
    }
  } else {
    // Exact path: the values again from dz and h, one output per row loop,
    // cast with the column scales. Nobody reads the parked values now, so
    // the regions are free for the byte tiles.
#pragma unroll 1
    for (int o = 0; o < kOuts; ++o) {
      float cs[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) cs[j] = __uint_as_float(col_max[o][st.c0 + j]);
      const __nv_fp8_interpretation_t interp = o == kZ ? zfmt.interp : fmt.interp;
      ColumnBytes cb;
      rows([&](int, const float (&y0)[kSub], const float (&zv)[kSub], const auto& y1) {
        float v[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          float right = y0[j];
          if constexpr (kPaired) right = y1[j];
          v[j] = o == kZ ? zv[j] : o == 1 ? right : y0[j];
        }
        unsigned pair[kSub / 2];
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k)
          pair[k] = Cast2(v[2 * k] * cs[2 * k], v[2 * k + 1] * cs[2 * k + 1], interp);
        cb.Push(pair);
      });
      cb.ToTile(region(o), st);
    }
  }
  __syncthreads();
  StoreTransposedTile(p, region(0), st.m0, st.k0, st.t);
  if constexpr (kPaired) StoreTransposedTile(p, region(1), st.m0, F + st.k0, st.t);
  if constexpr (kAct) StoreTransposedTile(z, region(kZ), st.m0, st.k0, st.t);
}

// One launch of DActQuantizeVec128Kernel for `a` (the tiles of h's F
// columns when kPaired).
template <typename InT, ActLoop kLoop, bool kFp8H, bool kAct, bool kPaired,
          int kMinBlocks = DActMinBlocks<InT, kLoop, kPaired>()>
cudaError_t LaunchDActKernel(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs& z,
                             const Fp8HInput& hs, cudaStream_t stream) {
  auto* kernel = DActQuantizeVec128Kernel<InT, kLoop, kFp8H, kAct, kPaired, kMinBlocks>;
  constexpr int kDynamic = ((kPaired ? 2 : 1) + (kAct ? 1 : 0)) * kParkWords * 16;
  if (cudaError_t e = AllowDynamicShared(kernel, kDynamic); e != cudaSuccess) return e;
  kernel<<<kPaired ? PairedGrid(a, q) : TileGrid(a), kThreads, kDynamic, stream>>>(a, q, z, hs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchDActVec128Mode(const QuantizeArgs& a, const PrologueArgs& q,
                                 const QuantizeArgs& z, const Fp8HInput& hs, int out, bool fp8_h,
                                 cudaStream_t stream) {
  if (q.kind != Prologue::kDAct) return cudaErrorInvalidValue;
  return WithVariant(a, q, out, fp8_h, [&](auto v) -> cudaError_t {
    using V = decltype(v);
    if constexpr (V::kPro != Prologue::kDAct) {
      return cudaErrorInvalidValue;
    } else {
      static_assert((V::kOut & kOutBoth) == kOutBoth, "the backward writes both copies of dh");
      using InT = typename V::InT;
      constexpr prologue::ActLoop kLoop = V::kLoop;
      constexpr bool kFp8H = V::kFp8H, kAct = V::kOut & kOutActCols;
      if constexpr (V::kCanPair) {
        if (Paired(q)) return LaunchDActKernel<InT, kLoop, kFp8H, kAct, true>(a, q, z, hs, stream);
      }
      return LaunchDActKernel<InT, kLoop, kFp8H, kAct, false>(a, q, z, hs, stream);
    }
  });
}

}  // namespace te_jax
