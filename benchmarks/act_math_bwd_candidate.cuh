// EXPERIMENTAL, benchmarks only (issue 43): a candidate for the 1x128
// (ScaleMode::kVec128) activation backward, dh = dact(dz, h) both ways plus
// act(h)'s columnwise copy, meant to write the same bytes as the shipped
// ActQuantizeVec128Kernel<..., kOutBoth | kOutActCols> (act_math.cu compares
// every output). Included by benchmarks/act_math.cu after the shipped kernel
// units, whose helpers (tile.cuh, act_quantize_common.cuh, prologue.h) it
// reuses so that the values and casts are the same code.
//
// What the shipped kernel does per 128x128 tile of dh (act_math.cu's header
// comment has the analysis), and what this one changes:
//  1. act(h)'s columnwise copy. Shipped: after dh's columnwise copy, a second
//     row loop re-reads h from L2 and evaluates act(h) again (ExpNegAbs and
//     RcpOnePlus per element: about a third more instructions for gelu), with
//     two more __syncthreads rounds and no DRAM loads of its own in flight.
//     Here: act(h) comes from the same evaluation as dh (ComputeRows
//     kWithAct / kPaired) and is parked beside it.
//  2. The gated backward (SwiGLU). Shipped: one block per tile of dh, so
//     the left and the right tile of the same h columns are two blocks that
//     each load dz, h0 and h1 and evaluate silu and its derivative (and the
//     left one evaluates silu a third time for act(h)). Here: one block per
//     tile of h's columns writes both halves of dh and act(h) (kPaired, as
//     the per-tensor kernel does), from one load and one evaluation.
//  3. What is parked. Shipped: dh as float32 (64 KB per tile). Here: each
//     value rounded to odd to 16 bits (bf16 bits, the low bit set when any
//     dropped bit was set; 32 KB per tile per output), so that dh and act(h)
//     (96 KB for both halves and act(h)) fit 2 blocks per SM. Exact for the
//     columnwise casts when the column scale s is a power of two (pow2) and
//     s <= 2^100: then v * s and u * s (u the parked value) are exact
//     products, and rounding to odd at 8 significant bits (>= 2 more than
//     E4M3's 4 and E5M2's 3) followed by round-to-nearest-even to FP8 gives
//     the same result as rounding v directly (the double-rounding theorem of
//     round-to-odd, Boldo & Melquiond 2008). Float32 subnormal v (where
//     bf16 keeps fewer bits) lie on a 2^-133 grid, which s <= 2^100 maps to
//     2^-33, far below FP8's finest step (E5M2's 2^-16). Saturation is the
//     same as |v * s| and |u * s| are both below fp8_max * (1 + 2^-7), which
//     rounds to fp8_max. A block with a column outside that (pow2 off, a
//     column amax below about 2^-85, or a non-finite one) takes an exact path
//     instead: it recomputes the values from dz and h as the shipped second
//     pass does, one output at a time.
//  4. Column maxima: a shuffle between the two row groups of a warp, then
//     shared-memory atomicMax (1.5 KB) instead of the 8 KB col_part table.
// Unchanged: the 8x8 sub-tile per thread, the rolled row loop with two rows
// of inputs in flight (prologue::ComputeRows), the row scales by a 16-lane
// shuffle, the rowwise 8-byte stores, the swizzled byte tile and
// StoreTransposedTile for the columnwise copies.
//
// Not measured on a GPU yet. Supports 16-bit dz/h (bf16 instantiated), the
// gelu loop (not gated) and SwiGLU with F % 128 == 0; anything else:
// cudaErrorNotSupported.
#pragma once

namespace te_jax {
namespace bwd_candidate {

using prologue::ActLoop;

constexpr int kParkWords = kTile * kTile * 2 / 16;  // uint4s of one parked output (32 KB)
// Largest column scale whose parked values give exact casts (see 3. above).
constexpr float kSafeScale = 0x1p100f;

// The parked outputs: region o (kParkWords uint4s) holds output o; thread t
// owns uint4s [8t, 8t + 8) of each region, one per row of its sub-tile, at
// slot row ^ (t & 7) so that the 8 lanes of a 16-byte access phase (slices
// 128 bytes apart: all on the same banks) hit 8 distinct 16-byte bank groups.
// After a region has been read back it is that output's transposed byte tile
// (TileChunk layout, 16 KB).
extern __shared__ uint4 cand_park[];

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

// Outputs: o = 0 dh (the act0' half when kPaired), o = 1 dh's act1' half
// (kPaired only, F columns to the right), o = kOuts - 1 act(h). Grid: one
// block per 128x128 tile of dh (not gated) or of h's F columns (kPaired).
template <typename InT, ActLoop kLoop, bool kPaired, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ActQuantizeVec128BwdCandidateKernel(QuantizeArgs p, PrologueArgs q, QuantizeArgs z) {
  constexpr int kOuts = kPaired ? 3 : 2, kZ = kOuts - 1, kDh = kPaired ? 2 : 1;
  // Column maxima (AbsBits), then, in place, the column scales (float bits).
  __shared__ unsigned col_max[kOuts][kTile];

  const int64_t M = p.M, K = p.K, F = q.F;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p), zfmt = OutFormat(z);
  const int swz = st.t & 7;
  uint4* const mine = cand_park + st.t * kSub;  // + o * kParkWords: output o's slice
  auto region = [](int o) { return reinterpret_cast<uint8_t*>(cand_park + o * kParkWords); };
  if (st.t < kTile) {
#pragma unroll
    for (int o = 0; o < kOuts; ++o) col_max[o][st.t] = 0u;
  }
  __syncthreads();  // zeroed before any atomicMax (after the row loop)

  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = p.data + first_row * K + st.gc;  // a row per emit
  float cmax[kDh][kSub], zmax[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    zmax[j] = 0.f;
#pragma unroll
    for (int o = 0; o < kDh; ++o) cmax[o][j] = 0.f;
  }
  auto park = [&](int o, int i, const float (&v)[kSub]) {
    mine[o * kParkWords + (i ^ swz)] =
        make_uint4(PackRoundOdd16(v[0], v[1]), PackRoundOdd16(v[2], v[3]),
                   PackRoundOdd16(v[4], v[5]), PackRoundOdd16(v[6], v[7]));
  };
  // Row i of dh's half o: the rowwise copy exactly as the shipped kernel
  // writes it (row scale by a 16-lane shuffle, 1/s by lane cg 0, Cast2
  // pairs, one 8-byte store), then the column maxima and the parked values.
  auto dh_row = [&](int o, int i, const float (&y)[kSub]) {
    const int64_t off = o * F;  // o = 1: the act1' half
    float rmax = 0.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) rmax = MaxAbs(rmax, y[j]);
    const float s =
        ComputeScale(__uint_as_float(WarpMaxU(__float_as_uint(rmax), 16)), fmt.max, p.pow2);
    const int64_t gr = first_row + i;
    if (gr < M) {
      if (st.cg == 0) p.sinv[((st.k0 + off) / kTile) * p.sinv_ld + gr] = 1.f / s;
      unsigned pair[kSub / 2];
#pragma unroll
      for (int k = 0; k < kSub / 2; ++k)
        pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
      const int64_t gc = st.gc + off;
      StoreRowWords(out_row + off, PackPairs(pair), (K % 8 == 0) && (gc + kSub <= K), K - gc);
    }
#pragma unroll
    for (int j = 0; j < kSub; ++j) cmax[o][j] = MaxAbs(cmax[o][j], y[j]);
    park(o, i, y);
  };
  // The row loop (all 32 lanes of a warp together: dh_row shuffles). y1 is
  // dh's act1' half with kPaired, else a NoRow.
  auto rows = [&](auto&& body) {
    ForRows<InT, Prologue::kDAct, kLoop, !kPaired, false, false, kPaired>(
        q, Fp8HInput(), M, first_row, st.gc, body);
  };
  rows([&](int i, const float (&y0)[kSub], const float (&zv)[kSub], const auto& y1) {
    dh_row(0, i, y0);
    if constexpr (kPaired) dh_row(1, i, y1);
    out_row += K;
#pragma unroll
    for (int j = 0; j < kSub; ++j) zmax[j] = MaxAbs(zmax[j], zv[j]);
    park(kZ, i, zv);
  });

  // Column maxima over the 16 row groups: lanes l and l ^ 16 of a warp are
  // row groups 2w and 2w + 1 with the same columns; then one atomicMax per
  // column per warp. Bits of non-negative floats (or the canonical NaN of
  // MaxAbs): the unsigned max is the shipped col_part max.
  const int lane = st.t & 31;
  auto reduce_cols = [&](int o, const float (&m)[kSub]) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      unsigned b = __float_as_uint(m[j]);
      b = max(b, __shfl_xor_sync(0xffffffffu, b, 16));
      if (lane < 16) atomicMax(&col_max[o][st.c0 + j], b);
    }
  };
#pragma unroll
  for (int o = 0; o < kDh; ++o) reduce_cols(o, cmax[o]);
  reduce_cols(kZ, zmax);
  __syncthreads();
  // Column scales as ColumnScales computes them (sinv_t written by thread
  // c < 128), and whether the parked values give exact casts for them.
  bool exact_needed = false;
  if (st.t < kTile) {
    auto col_scale = [&](int o, const QuantizeArgs& a, float fp8_max, int64_t col_off) {
      const float s = ComputeScale(__uint_as_float(col_max[o][st.t]), fp8_max, a.pow2);
      col_max[o][st.t] = __float_as_uint(s);
      const int64_t gk = col_off + st.k0 + st.t;
      if (gk < a.K) a.sinv_t[(st.m0 / kTile) * a.sinv_t_ld + gk] = 1.f / s;
      return a.pow2 && s <= kSafeScale;  // false for a NaN s too
    };
    bool ok = col_scale(0, p, fmt.max, 0);
    if constexpr (kPaired) ok = col_scale(1, p, fmt.max, F) && ok;
    ok = col_scale(kZ, z, zfmt.max, 0) && ok;
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
    // Exact path (rare): the values again from dz and h, one output per row
    // loop (the shipped kernel's second pass, for every output), cast with
    // the column scales. Nobody reads the parked values now, so the regions
    // are free for the byte tiles.
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
  StoreTransposedTile(z, region(kZ), st.m0, st.k0, st.t);
}

template <typename InT, ActLoop kLoop, bool kPaired, int kMinBlocks>
cudaError_t LaunchCandidate(const QuantizeArgs& a, const PrologueArgs& q, const QuantizeArgs& z,
                            cudaStream_t stream) {
  constexpr int kDynamic = (kPaired ? 3 : 2) * kParkWords * 16;
  auto* kernel = ActQuantizeVec128BwdCandidateKernel<InT, kLoop, kPaired, kMinBlocks>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamic);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  dim3 grid = TileGrid(a);
  if (kPaired) grid.x = static_cast<unsigned>(q.F / kTile);
  kernel<<<grid, kThreads, kDynamic, stream>>>(a, q, z);
  return cudaGetLastError();
}

// The candidate in place of LaunchPrologueQuantize(a, q, &z, stream) for a
// 1x128 backward with both copies of dh and act(h)'s columnwise copy.
// gelu_blocks: the gelu instance's launch bound, 2 blocks per SM (122
// registers, no spills with nvcc 13.0) or 3, which its 64 KB of parked
// values would allow in shared memory but which spills at 80 registers (104
// bytes stored, 172 loaded): both are timed. SwiGLU (96 KB parked) runs 2
// (128 registers, no spills).
inline cudaError_t LaunchActVec128BwdCandidate(const QuantizeArgs& a, const PrologueArgs& q,
                                               const QuantizeArgs& z, cudaStream_t stream,
                                               int gelu_blocks = 2) {
  const bool gated = q.act1 >= 0;
  if (a.mode != ScaleMode::kVec128 || q.kind != Prologue::kDAct || a.in != InType::kBF16 ||
      a.data == nullptr || a.data_t == nullptr || a.sinv == nullptr || a.sinv_t == nullptr ||
      z.data_t == nullptr || z.sinv_t == nullptr || z.M != a.M || z.K != q.F ||
      a.K != (gated ? 2 : 1) * q.F || a.M <= 0 || q.F <= 0 || !GridValid(a))
    return cudaErrorNotSupported;
  switch (prologue::ChooseLoop(q, true)) {
    case ActLoop::kGelu:
      return gelu_blocks == 3
                 ? LaunchCandidate<__nv_bfloat16, ActLoop::kGelu, false, 3>(a, q, z, stream)
                 : LaunchCandidate<__nv_bfloat16, ActLoop::kGelu, false, 2>(a, q, z, stream);
    case ActLoop::kSwiGlu:
      if (q.F % kTile == 0)
        return LaunchCandidate<__nv_bfloat16, ActLoop::kSwiGlu, true, 2>(a, q, z, stream);
      break;
    default: break;
  }
  return cudaErrorNotSupported;
}

}  // namespace bwd_candidate
}  // namespace te_jax
