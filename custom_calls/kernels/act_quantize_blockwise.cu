// The 1x128 kernel (blockwise scaling) of the activation forward, the
// concatenation and the normalization quantize (kernels/act_quantize.cu says
// what they compute) and its launch; the backward's 1x128 kernel is in
// act_quantize_blockwise_bwd.cu.
#include "kernels/act_quantize_common.cuh"

namespace te_jax {
namespace {

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

// kMinBlocks: the launch bound (ActMinBlocks; benchmarks/act_math.cu times
// others).
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut,
          int kMinBlocks = ActMinBlocks<InT, kPro, kLoop, kOut>()>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ActQuantizeVec128Kernel(QuantizeArgs p, PrologueArgs q, Fp8HOutput ho) {
  static_assert(kPro != Prologue::kDAct, "the backward's kernel: act_quantize_blockwise_bwd.cu");
  constexpr bool kRows = kOut & kOutRows, kCols = kOut & kOutCols, kH = kOut & kOutH;
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
  float cmax[kSub];  // column maxima of v
#pragma unroll
  for (int j = 0; j < kSub; ++j) cmax[j] = 0.f;
  // ComputeRows runs its row loop warp-uniformly (prologue.h), so the
  // 16-lane shuffles below are reached by all 32 lanes together.
  ForRows<InT, kPro, kLoop, false, false, kH, false>(
      q, Fp8HInput(), M, first_row, st.gc,
      [&](int i, const float (&y)[kSub], const float (&)[kSub], const auto& hr) {
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
        if constexpr (kH) StoreHRow(hr, h_at, q, gated, first_row + i < M, st, ho.scale_ld);
      });
  if constexpr (kCols) {  // the rest writes the columnwise copy
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
  }
}

// One launch of ActQuantizeVec128Kernel for `a`.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop, int kOut,
          int kMinBlocks = ActMinBlocks<InT, kPro, kLoop, kOut>()>
cudaError_t LaunchActKernel(const QuantizeArgs& a, const PrologueArgs& q, const Fp8HOutput& ho,
                            cudaStream_t stream) {
  auto* kernel = ActQuantizeVec128Kernel<InT, kPro, kLoop, kOut, kMinBlocks>;
  // Only the columnwise copy parks values in the scratch.
  constexpr int kDynamic = (kOut & kOutCols) ? kScratchBytes : 0;
  if constexpr (kDynamic > 0) {  // 3 blocks take ~220 KB
    if (cudaError_t e = AllowDynamicShared(kernel, kDynamic); e != cudaSuccess) return e;
  }
  kernel<<<TileGrid(a), kThreads, kDynamic, stream>>>(a, q, ho);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchActVec128Mode(const QuantizeArgs& a, const PrologueArgs& q,
                                const Fp8HOutput& ho, int out, cudaStream_t stream) {
  if (q.kind == Prologue::kDAct) return cudaErrorInvalidValue;  // LaunchDActVec128Mode
  return WithVariant(a, q, out, false, [&](auto v) -> cudaError_t {
    using V = decltype(v);
    if constexpr (V::kPro == Prologue::kDAct) {
      return cudaErrorInvalidValue;
    } else {
      return LaunchActKernel<typename V::InT, V::kPro, V::kLoop, V::kOut>(a, q, ho, stream);
    }
  });
}

}  // namespace te_jax
