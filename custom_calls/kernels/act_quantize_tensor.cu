// The per-tensor kernels (delayed and current scaling) of the activation
// quantize (kernels/act_quantize.cu says what they compute): the quantize
// kernel, current scaling's amax pass, and their launches.
#include "kernels/act_quantize_common.cuh"

namespace te_jax {
namespace {

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
}  // namespace

cudaError_t LaunchActTensorMode(const QuantizeArgs& a, const PrologueArgs& q,
                                const QuantizeArgs& z, const Fp8HInput& hs,
                                const Fp8HOutput& ho, int out, bool fp8_h, cudaStream_t stream) {
  return WithVariant(a, q, out, fp8_h, [&](auto v) {
    using V = decltype(v);
    if constexpr (V::kCanPair) {
      if (Paired(q)) {
        ActQuantizeTensorKernel<typename V::InT, V::kPro, V::kLoop, V::kOut, V::kFp8H, true>
            <<<PairedGrid(a, q), kThreads, 0, stream>>>(a, q, z, hs, ho);
        return cudaGetLastError();
      }
    }
    ActQuantizeTensorKernel<typename V::InT, V::kPro, V::kLoop, V::kOut, V::kFp8H, false>
        <<<TileGrid(a), kThreads, 0, stream>>>(a, q, z, hs, ho);
    return cudaGetLastError();
  });
}

cudaError_t LaunchActTileAmax(const QuantizeArgs& b, const PrologueArgs& q,
                              const Fp8HInput* h_fp8, cudaStream_t stream) {
  const Fp8HInput hs = h_fp8 != nullptr ? *h_fp8 : Fp8HInput();
  return WithTypes(b.in, q.kind, h_fp8 != nullptr, [&](auto in, auto pro, auto fp8) {
    using InT = decltype(in);
    constexpr Prologue kPro = decltype(pro)::value;
    constexpr bool kFp8H = decltype(fp8)::value;
    // The norm's amax comes from its statistics pass (kernels/normalization.cu).
    if constexpr (kPro == Prologue::kNorm) {
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
        TileAmaxKernel<InT, kPro, kLoop, kFp8H, false>
            <<<TileGrid(b), kThreads, 0, stream>>>(b, q, hs);
        return cudaGetLastError();
      });
    }
  });
}

}  // namespace te_jax
