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
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/prologue.h"
#include "kernels/quantize.h"
#include "kernels/tile.cuh"

namespace te_jax {
namespace {

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
// 2 blocks (up to 128 registers) for those and for fp32 inputs.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
constexpr int ActMinBlocks() {
  if (sizeof(InT) != 2 || kLoop == prologue::ActLoop::kAny) return 2;
  if (std::is_same_v<InT, __half> && kPro == Prologue::kDAct &&
      kLoop == prologue::ActLoop::kSwiGlu)
    return 2;
  return 3;
}

// ScaleMode::kTensor (delayed and current scaling): the one scale is known
// before the tile is read, so the bytes for the columnwise copy are collected
// in registers as well (8 columns x 8 rows = 16 words): no float tile, no
// dynamic shared memory.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads, ActMinBlocks<InT, kPro, kLoop>())
    ActQuantizeTensorKernel(QuantizeArgs p, PrologueArgs q) {
  __shared__ unsigned warp_red[kThreads / 32];
  __shared__ __align__(16) uint8_t tbuf[kTile * kTile];  // transposed bytes

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p);
  const float s = p.amax_in != nullptr ? ComputeScale(*p.amax_in, fmt.max, p.pow2) : *p.scale;
  if (p.scale_inv != nullptr && st.t == 0 && blockIdx.x == 0 && blockIdx.y == 0)
    *p.scale_inv = 1.f / s;

  const bool vec_out = (K % 8 == 0) && (st.gc + kSub <= K);
  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = p.data + first_row * K + st.gc;  // advanced by a row per emit
  unsigned amax = 0;  // bits: two elements per 3-input integer max (MaxAbs took more here)
  unsigned col_lo[kSub], col_hi[kSub];  // column j: bytes of rows 0-3 / 4-7
#pragma unroll
  for (int j = 0; j < kSub; ++j) col_lo[j] = col_hi[j] = 0;
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, M, first_row, st.gc, [&](int i, const float (&y)[kSub]) {
        unsigned pair[kSub / 2];  // columns 2k (bits 0-7) and 2k + 1 (bits 8-15)
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          amax = max(amax, max(AbsBits(y[2 * k]), AbsBits(y[2 * k + 1])));
          pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
        }
        if (first_row + i < M) StoreRowWords(out_row, PackPairs(pair), vec_out, K - st.gc);
        out_row += K;
        // Column j's bytes move down one place per row: the oldest of col_hi[j]
        // to the top of col_lo[j], this row's byte into the top of col_hi[j]
        // (constant byte_perm selectors, whatever the row). After the 8 rows
        // byte r % 4 of col_lo[j] / col_hi[j] holds row r / r + 4.
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          col_lo[2 * k] = __byte_perm(col_lo[2 * k], col_hi[2 * k], 0x4321);
          col_lo[2 * k + 1] = __byte_perm(col_lo[2 * k + 1], col_hi[2 * k + 1], 0x4321);
          col_hi[2 * k] = __byte_perm(col_hi[2 * k], pair[k], 0x4321);          // pair byte 0
          col_hi[2 * k + 1] = __byte_perm(col_hi[2 * k + 1], pair[k], 0x5321);  // pair byte 1
        }
      });
  if (p.amax_out != nullptr) {
    amax = BlockMaxU(amax, warp_red);
    if (st.t == 0) atomicMax(reinterpret_cast<unsigned*>(p.amax_out), amax);
  }
  // The columnwise copy, through tbuf as in QuantizeTileKernel.
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    const int c = st.c0 + j;
    TileChunk(tbuf, c, st.rg) = make_uint2(col_lo[j], col_hi[j]);
  }
  __syncthreads();
  StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);
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

template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads, ActMinBlocks<InT, kPro, kLoop>())
    ActQuantizeVec128Kernel(QuantizeArgs p, PrologueArgs q) {
  __shared__ unsigned col_part[kThreads / 16][kTile];  // per-row-group column amax
  __shared__ float col_scale[kTile];

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p);
  float4* mine = act_scratch + st.t * kScratchF4;
  const int swz = st.t & 7;  // slot k of this thread is mine[k ^ swz]

  const bool vec_out = (K % 8 == 0) && (st.gc + kSub <= K);
  const int64_t first_row = st.m0 + st.r0;
  uint8_t* out_row = p.data + first_row * K + st.gc;  // advanced by a row per emit
  float cmax[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) cmax[j] = 0.f;
  // ComputeRows runs its row loop warp-uniformly (prologue.h), so the
  // 16-lane shuffle below is reached by all 32 lanes together.
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, M, first_row, st.gc, [&](int i, const float (&y)[kSub]) {
        float rmax = 0.f;
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          rmax = MaxAbs(rmax, y[j]);
          cmax[j] = MaxAbs(cmax[j], y[j]);
        }
        const float s =
            ComputeScale(__uint_as_float(WarpMaxU(__float_as_uint(rmax), 16)), fmt.max, p.pow2);
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
        mine[(2 * i) ^ swz] = make_float4(y[0], y[1], y[2], y[3]);
        mine[(2 * i + 1) ^ swz] = make_float4(y[4], y[5], y[6], y[7]);
      });

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

// max|v| of a prologue's output, computed by the same prologue::ComputeRows
// (so the same values bit for bit) on the same tiles, without the scratch;
// one atomicMax per 128x128 tile.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads) TileAmaxKernel(QuantizeArgs p, PrologueArgs q) {
  __shared__ unsigned warp_red[kThreads / 32];
  const int t = threadIdx.x;
  float amax = 0.f;
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, p.M, static_cast<int64_t>(blockIdx.y) * kTile + (t / 16) * kSub,
      static_cast<int64_t>(blockIdx.x) * kTile + (t % 16) * kSub,
      [&](int, const float (&y)[kSub]) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) amax = MaxAbs(amax, y[j]);
      });
  const unsigned block_amax = BlockMaxU(__float_as_uint(amax), warp_red);
  if (t == 0) atomicMax(reinterpret_cast<unsigned*>(p.amax_out), block_amax);
}

// Calls launch(std::integral_constant<ActLoop, L>) for the loop L that
// prologue::ChooseLoop picks for q; only kAny is instantiated for fp32
// inputs, only kNone for kConcat and kNorm.
template <typename InT, Prologue kPro, typename Launch>
cudaError_t WithLoop(const PrologueArgs& q, Launch&& launch) {
  using prologue::ActLoop;
  if constexpr (kPro == Prologue::kConcat || kPro == Prologue::kNorm) {
    return launch(std::integral_constant<ActLoop, ActLoop::kNone>{});
  } else if constexpr (sizeof(InT) == 4) {
    return launch(std::integral_constant<ActLoop, ActLoop::kAny>{});
  } else {
    switch (prologue::ChooseLoop(q, true)) {
      case ActLoop::kGelu: return launch(std::integral_constant<ActLoop, ActLoop::kGelu>{});
      case ActLoop::kSilu: return launch(std::integral_constant<ActLoop, ActLoop::kSilu>{});
      case ActLoop::kRelu: return launch(std::integral_constant<ActLoop, ActLoop::kRelu>{});
      case ActLoop::kSwiGlu: return launch(std::integral_constant<ActLoop, ActLoop::kSwiGlu>{});
      case ActLoop::kAny:
      case ActLoop::kNone: break;
    }
    return launch(std::integral_constant<ActLoop, ActLoop::kAny>{});
  }
}

template <typename InT, ScaleMode kMode, Prologue kPro, prologue::ActLoop kLoop>
cudaError_t LaunchWithLoop(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  if constexpr (kMode == ScaleMode::kTensor) {
    ActQuantizeTensorKernel<InT, kPro, kLoop><<<TileGrid(a), kThreads, 0, stream>>>(a, q);
  } else {
    auto* kernel = ActQuantizeVec128Kernel<InT, kPro, kLoop>;
    // More than 48 KB of dynamic shared memory needs an opt-in, which holds
    // per device: set it at every launch (a host-side call) instead of
    // tracking devices.
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kScratchBytes);
    // Ask for the largest shared-memory carveout: 3 blocks take ~220 KB.
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return e;
    kernel<<<TileGrid(a), kThreads, kScratchBytes, stream>>>(a, q);
  }
  return cudaGetLastError();
}

template <typename InT, ScaleMode kMode, Prologue kPro>
cudaError_t LaunchWithPrologue(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  return WithLoop<InT, kPro>(q, [&](auto loop) {
    return LaunchWithLoop<InT, kMode, kPro, decltype(loop)::value>(a, q, stream);
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

template <typename InT>
cudaError_t LaunchTileAmax(const QuantizeArgs& b, const PrologueArgs& q, cudaStream_t stream) {
  return WithPrologue(q.kind, [&](auto pro) {
    constexpr Prologue kPro = decltype(pro)::value;
    // The norm's amax comes from its statistics pass (kernels/normalization.cu).
    if constexpr (kPro == Prologue::kNorm) {
      return cudaErrorInvalidValue;
    } else {
      return WithLoop<InT, kPro>(q, [&](auto loop) {
        constexpr prologue::ActLoop kLoop = decltype(loop)::value;
        TileAmaxKernel<InT, kPro, kLoop><<<TileGrid(b), kThreads, 0, stream>>>(b, q);
        return cudaGetLastError();
      });
    }
  });
}

}  // namespace

cudaError_t LaunchActQuantize(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  if (q.kind == Prologue::kNone || !PrologueValid(a, q)) return cudaErrorInvalidValue;
  // The fused MLP and the concatenations always want the columnwise copy and
  // never 128x128 blocks: only those variants are built (per input type,
  // prologue and activation loop).
  if (a.data_t == nullptr || (a.mode != ScaleMode::kTensor && a.mode != ScaleMode::kVec128))
    return cudaErrorInvalidValue;
  auto typed = [&](auto in) {
    using InT = decltype(in);
    return WithPrologue(q.kind, [&](auto pro) {
      constexpr Prologue kPro = decltype(pro)::value;
      return a.mode == ScaleMode::kTensor
                 ? LaunchWithPrologue<InT, ScaleMode::kTensor, kPro>(a, q, stream)
                 : LaunchWithPrologue<InT, ScaleMode::kVec128, kPro>(a, q, stream);
    });
  };
  switch (a.in) {
    case InType::kF32: return typed(float{});
    case InType::kBF16: return typed(__nv_bfloat16{});
    case InType::kF16: return typed(__half{});
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchPrologueAmax(const QuantizeArgs& a, const PrologueArgs& q, float* amax_out,
                               cudaStream_t stream) {
  if (q.kind == Prologue::kNone) return cudaErrorInvalidValue;  // flat x: LaunchAmax
  cudaError_t e = cudaMemsetAsync(amax_out, 0, sizeof(float), stream);
  if (e != cudaSuccess || a.M <= 0 || a.K <= 0) return e;
  if (!GridValid(a)) return cudaErrorInvalidConfiguration;
  if (!PrologueValid(a, q)) return cudaErrorInvalidValue;
  QuantizeArgs b = a;
  b.amax_out = amax_out;
  switch (a.in) {
    case InType::kF32: return LaunchTileAmax<float>(b, q, stream);
    case InType::kBF16: return LaunchTileAmax<__nv_bfloat16>(b, q, stream);
    case InType::kF16: return LaunchTileAmax<__half>(b, q, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace te_jax
