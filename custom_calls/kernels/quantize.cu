// FP8 quantize kernels: per-tensor (given or current scale) and blockwise
// (1x128 + 128x1, or 128x128), each writing the rowwise copy and, in the same
// pass, the transposed (columnwise) copy.
//
// Numerics follow te_jax/ops/quantize.py bit for bit:
//   v = float(x) * scale        (fp32 multiply, RN)
//   q = fp8(clip(v, -max, max)) (RNE; NaN stays NaN) == __nv_cvt_float_to_fp8
//                                 with __NV_SATFINITE
//   scale = fp8_max / amax, 1 when amax is 0 or not finite, <= FLT_MAX,
//   optionally with the mantissa bits cleared (power of 2, rounded down).
//
// Work split: one 256-thread block per 128x128 tile of x. Thread t owns an
// 8x8 sub-tile (rows 8*(t/16).., cols 8*(t%16)..) held in registers, so the
// row amax is a shuffle over the 16 lanes that share rows and the column amax
// a small shared-memory reduction. The transposed copy goes through a 16 KB
// shared byte tile (XOR-swizzled in 8-byte chunks to avoid bank conflicts) so
// that both FP8 outputs are written with coalesced stores.
//
// With a prologue (Prologue::kAct / kDAct, kernels/prologue.h) these kernels
// quantize v = act(h) or dact(dz, h), computed from the inputs they load, so
// the fused MLP never writes v in bf16: ActQuantizeVec128Kernel for 1x128
// scales and ActQuantizeTensorKernel (no float tile) for one scale. The
// prologue and the activation loop (prologue::ActLoop: gelu, silu, relu,
// SwiGLU, or any by runtime switches) are template parameters chosen on the
// host, so that each kernel gets the registers of its own loop.
#include "kernels/quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <type_traits>

#include "kernels/prologue.h"

namespace te_jax {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kSub = prologue::kSub;  // each thread owns kSub x kSub elements
using prologue::ToFloat;

// Bits of |v|: for non-negative floats (and NaN after fabs) unsigned integer
// order is float order with NaN above +inf, so a max over the bits is a
// NaN-propagating float max (as jnp.max).
__device__ __forceinline__ unsigned AbsBits(float v) { return __float_as_uint(fabsf(v)); }

// compute_scale() of ops/quantize.py.
__device__ __forceinline__ float ComputeScale(float amax, float fp8_max, bool pow2) {
  const bool valid = isfinite(amax) && amax > 0.f;
  float s = fp8_max / (valid ? amax : 1.f);  // IEEE division (-prec-div=true)
  s = fminf(s, FLT_MAX);
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  return valid ? s : 1.f;
}

__device__ __forceinline__ uint8_t Cast(float v, __nv_fp8_interpretation_t t) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, t));
}

// Cast(a) in bits 0-7 and Cast(b) in bits 8-15, by one cvt instruction
// (each value rounded on its own: the same bytes as two Casts).
__device__ __forceinline__ unsigned Cast2(float a, float b, __nv_fp8_interpretation_t t) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, t);
}

// The 4 bytes of two Cast2 pairs: lo's in bytes 0-1, hi's in bytes 2-3.
__device__ __forceinline__ unsigned PackPairs(unsigned lo, unsigned hi) {
  return __byte_perm(lo, hi, 0x5410);
}

__device__ __forceinline__ unsigned WarpMaxU(unsigned v, int width) {
  for (int o = width / 2; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ int Swz(int c) { return ((c / 8) ^ (c % 8)) % 16; }

// Max over the block of one value per thread, returned to every thread.
__device__ __forceinline__ unsigned BlockMaxU(unsigned v, unsigned* warp_red) {
  v = WarpMaxU(v, 32);
  if (threadIdx.x % 32 == 0) warp_red[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) v = max(v, warp_red[w]);
  return v;
}

// Thread t's place in its block's 128x128 tile (block (x, y) covers rows
// m0.., columns k0..): it owns the 8x8 sub-tile at rows m0 + r0.., columns
// gc = k0 + c0..; rg = t / 16 is its row group (16 lanes share the rows),
// cg = t % 16 its column group.
struct SubTile {
  int64_t m0, k0, gc;
  int t, cg, rg, r0, c0;
};

__device__ __forceinline__ SubTile ThisSubTile() {
  SubTile st;
  st.m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  st.k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  st.t = threadIdx.x;
  st.cg = st.t % 16;
  st.rg = st.t / 16;
  st.r0 = st.rg * kSub;
  st.c0 = st.cg * kSub;
  st.gc = st.k0 + st.c0;
  return st;
}

// The FP8 format of the output: cvt interpretation and largest finite value.
struct Fp8Out {
  __nv_fp8_interpretation_t interp;
  float max;
};

__device__ __forceinline__ Fp8Out OutFormat(const QuantizeArgs& p) {
  return p.out == Fp8Type::kE5M2 ? Fp8Out{__NV_E5M2, 57344.f} : Fp8Out{__NV_E4M3, 448.f};
}

// Min blocks per SM: 3 for 16-bit inputs caps registers at 80 (no spills);
// fp32 inputs (not the hot path) need up to ~150 registers in the 1x128 mode.
template <typename InT>
constexpr int MinBlocks() {
  return sizeof(InT) == 4 ? 1 : 3;
}

// Stores a thread's 8 FP8 bytes of one row (w.x: columns 0-3, w.y: 4-7) at
// dst: one 8-byte store when `vec` (all 8 columns exist and dst is 8-byte
// aligned), else the first `valid` bytes one by one.
__device__ __forceinline__ void StoreRowWords(uint8_t* dst, uint2 w, bool vec, int64_t valid) {
  if (vec) {
    *reinterpret_cast<uint2*>(dst) = w;
  } else {
#pragma unroll
    for (int j = 0; j < kSub; ++j)
      if (j < valid) dst[j] = static_cast<uint8_t>((j < 4 ? w.x : w.y) >> (8 * (j % 4)));
  }
}

__device__ __forceinline__ void StoreRowBytes(uint8_t* dst, const uint8_t (&q)[kSub], bool vec,
                                              int64_t valid) {
  StoreRowWords(dst, *reinterpret_cast<const uint2*>(q), vec, valid);
}

// Writes the transposed 128x128 byte tile `tbuf` (filled as described in
// QuantizeTileKernel, after a __syncthreads) to data_t: 128 rows x 8
// 16-byte pieces = 1024 stores, 4 per thread; 8 consecutive lanes write one
// 128-byte row of data_t.
__device__ __forceinline__ void StoreTransposedTile(const QuantizeArgs& p, const uint8_t* tbuf,
                                                    int64_t m0, int64_t k0, int t) {
  const int64_t M = p.M, K = p.K;
  const bool vec_t = (M % 16 == 0);
#pragma unroll
  for (int it = 0; it < (kTile * kTile / 16) / kThreads; ++it) {
    const int idx = it * kThreads + t;
    const int c = idx / 8, piece = idx % 8;  // row of the transposed tile, 16-byte piece
    const int64_t gk = k0 + c, gm = m0 + piece * 16;
    if (gk >= K || gm >= M) continue;
    const int sw = Swz(c);
    const uint2 lo = *reinterpret_cast<const uint2*>(&tbuf[c * kTile + ((2 * piece) ^ sw) * 8]);
    const uint2 hi = *reinterpret_cast<const uint2*>(&tbuf[c * kTile + ((2 * piece + 1) ^ sw) * 8]);
    uint8_t* dst = p.data_t + gk * M + gm;
    if (vec_t && gm + 16 <= M) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else {
      const unsigned w[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
      for (int e = 0; e < 16; ++e)
        if (gm + e < M) dst[e] = static_cast<uint8_t>(w[e / 4] >> (8 * (e % 4)));
    }
  }
}

template <typename InT, ScaleMode kMode, bool kCols>
__global__ void __launch_bounds__(kThreads, MinBlocks<InT>()) QuantizeTileKernel(QuantizeArgs p) {
  __shared__ unsigned col_part[kThreads / 16][kTile];  // per-row-group column amax
  __shared__ float col_scale[kTile];
  __shared__ unsigned warp_red[kThreads / 32];
  __shared__ __align__(16) uint8_t tbuf[kCols ? kTile * kTile : 16];  // transposed bytes

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const int64_t m0 = st.m0, k0 = st.k0, gc = st.gc;
  const int t = st.t, cg = st.cg, rg = st.rg, r0 = st.r0, c0 = st.c0;
  const bool e5m2 = p.out == Fp8Type::kE5M2;
  const __nv_fp8_interpretation_t interp = e5m2 ? __NV_E5M2 : __NV_E4M3;
  const float fp8_max = e5m2 ? 57344.f : 448.f;

  // ---- load the 8x8 sub-tile (16-byte loads when the row allows it) ----
  // Kept as the raw input bits (32 registers for 16-bit inputs) and widened
  // on use: fewer registers -> more resident blocks -> more loads in flight.
  // (Inline here: moving it into a struct or helper made ptxas spill the
  // 16-bit 1x128 kernels at their 80-register cap.)
  constexpr int kVec = 16 / sizeof(InT);  // elements per 16-byte vector
  constexpr int kVpr = kSub / kVec;        // vectors per sub-tile row
  uint4 raw[kSub][kVpr];
  {
    const InT* __restrict__ x = static_cast<const InT*>(p.x);
    const bool vec_cols = (K % kVec == 0) && (gc + kSub <= K);
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      const int64_t gr = m0 + r0 + i;
      const InT* row = x + gr * K + gc;
      if (gr < M && vec_cols) {
#pragma unroll
        for (int h = 0; h < kVpr; ++h) raw[i][h] = __ldg(reinterpret_cast<const uint4*>(row) + h);
      } else {
        InT tmp[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j)  // padding: |0| never raises an amax
          tmp[j] = (gr < M && gc + j < K) ? row[j] : InT(0.f);
        memcpy(&raw[i][0], tmp, sizeof(tmp));
      }
    }
  }
  auto v = [&](int i, int j) -> float {
    return ToFloat(reinterpret_cast<const InT*>(&raw[i][j / kVec])[j % kVec]);
  };

  // ---- amax and scales ----
  float row_s[kSub];  // scale of each of my rows (rowwise copy)
  float my_col_s[kSub];  // scale of each of my columns (columnwise copy)
#pragma unroll
  for (int j = 0; j < kSub; ++j) my_col_s[j] = 1.f;
  if constexpr (kMode == ScaleMode::kVec128) {
    unsigned cmax[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) cmax[j] = 0;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      unsigned rmax = 0;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const unsigned b = AbsBits(v(i, j));
        rmax = max(rmax, b);
        cmax[j] = max(cmax[j], b);
      }
      rmax = WarpMaxU(rmax, 16);  // the 16 lanes sharing these rows
      row_s[i] = ComputeScale(__uint_as_float(rmax), fp8_max, p.pow2);
    }
    if (kCols) {
#pragma unroll
      for (int j = 0; j < kSub; ++j) col_part[rg][c0 + j] = cmax[j];
      __syncthreads();
      if (t < kTile) {
        unsigned c = 0;
#pragma unroll
        for (int g = 0; g < kThreads / 16; ++g) c = max(c, col_part[g][t]);
        const float s = ComputeScale(__uint_as_float(c), fp8_max, p.pow2);
        col_scale[t] = s;
        if (k0 + t < K)  // sinv_t native layout: (ceil(M/128), roundup(K, 4)), K contiguous
          p.sinv_t[(m0 / kTile) * p.sinv_t_ld + k0 + t] = 1.f / s;
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kSub; ++j) my_col_s[j] = col_scale[c0 + j];
    }
    // sinv native layout: (ceil(K/128), roundup(M, 4)), M contiguous.
    if (cg == 0) {
#pragma unroll
      for (int i = 0; i < kSub; ++i)
        if (m0 + r0 + i < M) p.sinv[(k0 / kTile) * p.sinv_ld + m0 + r0 + i] = 1.f / row_s[i];
    }
  } else {
    // One scale for the tile (kBlock128) or the tensor (kTensor).
    unsigned amax = 0;
    if (kMode == ScaleMode::kBlock128 || p.amax_out != nullptr) {
#pragma unroll
      for (int i = 0; i < kSub; ++i)
#pragma unroll
        for (int j = 0; j < kSub; ++j) amax = max(amax, AbsBits(v(i, j)));
      amax = BlockMaxU(amax, warp_red);
    }
    float s;
    if constexpr (kMode == ScaleMode::kBlock128) {
      s = ComputeScale(__uint_as_float(amax), fp8_max, p.pow2);
      if (t == 0) {
        // sinv: (ceil(M/128), roundup(ceil(K/128), 4)); sinv_t: the transpose
        // grid (ceil(K/128), roundup(ceil(M/128), 4)).
        p.sinv[(m0 / kTile) * p.sinv_ld + k0 / kTile] = 1.f / s;
        if (kCols) p.sinv_t[(k0 / kTile) * p.sinv_t_ld + m0 / kTile] = 1.f / s;
      }
    } else {
      if (p.amax_out != nullptr && t == 0)
        atomicMax(reinterpret_cast<unsigned*>(p.amax_out), amax);
      s = p.amax_in != nullptr ? ComputeScale(*p.amax_in, fp8_max, p.pow2) : *p.scale;
      // IEEE 1/s on the device (XLA:GPU's division is not correctly rounded).
      if (p.scale_inv != nullptr && t == 0 && blockIdx.x == 0 && blockIdx.y == 0)
        *p.scale_inv = 1.f / s;
    }
#pragma unroll
    for (int i = 0; i < kSub; ++i) row_s[i] = s;
#pragma unroll
    for (int j = 0; j < kSub; ++j) my_col_s[j] = s;
  }

  // ---- rowwise copy: 8 bytes per row, 16 lanes cover 128 contiguous bytes ----
  const bool vec_out = (K % 8 == 0) && (gc + kSub <= K);
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t gr = m0 + r0 + i;
    if (gr >= M) break;
    uint8_t q[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) q[j] = Cast(v(i, j) * row_s[i], interp);
    StoreRowBytes(p.data + gr * K + gc, q, vec_out, K - gc);
  }

  // ---- columnwise copy through the swizzled shared byte tile ----
  if constexpr (kCols) {
    // tbuf[c][m] for column c (a row of the transposed tile); the 8-byte
    // chunk holding m in [8*g, 8*g+8) sits at chunk g ^ Swz(c). Swz(c) is
    // distinct over the 16 lanes that write one j (c/8 varies) and spreads
    // the 4 rows c that one warp reads (c%8 varies) over both chunk parities.
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      uint8_t q[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) q[i] = Cast(v(i, j) * my_col_s[j], interp);
      const int c = c0 + j;
      const int chunk = rg ^ Swz(c);
      *reinterpret_cast<uint2*>(&tbuf[c * kTile + chunk * 8]) = *reinterpret_cast<const uint2*>(q);
    }
    __syncthreads();
    StoreTransposedTile(p, tbuf, m0, k0, t);
  }
}

// The prologue kernels. Both compute v = act(h) or dact(dz, h) one row of
// a thread's 8x8 sub-tile at a time (prologue::ComputeRows) and cast and
// store each row of the rowwise copy as soon as it is computed; they differ
// in what the columnwise copy needs. Same bytes as QuantizeTileKernel would
// write for v. They issue an instruction on 77-91% of cycles (Nsight
// Compute, H200), so the casts go two per cvt (Cast2) and bytes are placed
// by byte_perm: per-element casts, shifts and selects took ~7 of the ~46
// instructions per element (per-tensor gelu forward 0.510 -> 0.415 ms on
// 16384^2 bf16, benchmarks/act_math.cu).

// Launch bound of ActQuantizeTensorKernel: 3 blocks per SM (at most 80
// registers) for the 16-bit forward kernels of one activation, which fit
// that without spilling; 2 (up to 128 registers) for the rest, whose loops
// take up to 115 and spilled under a cap of 80.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
constexpr int TensorMinBlocks() {
  return sizeof(InT) == 2 && kPro == Prologue::kAct && kLoop != prologue::ActLoop::kSwiGlu &&
                 kLoop != prologue::ActLoop::kAny
             ? 3
             : 2;
}

// ScaleMode::kTensor (delayed and current scaling): the one scale is known
// before the tile is read, so the bytes for the columnwise copy are collected
// in registers as well (8 columns x 8 rows = 16 words): no float tile, no
// dynamic shared memory.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads, TensorMinBlocks<InT, kPro, kLoop>())
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
  unsigned amax = 0;
  unsigned col_lo[kSub], col_hi[kSub];  // column j: bytes of rows 0-3 / 4-7
#pragma unroll
  for (int j = 0; j < kSub; ++j) col_lo[j] = col_hi[j] = 0;
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, M, st.m0 + st.r0, st.gc, [&](int i, const float (&y)[kSub]) {
        unsigned pair[kSub / 2];  // columns 2k (bits 0-7) and 2k + 1 (bits 8-15)
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          amax = max(amax, max(AbsBits(y[2 * k]), AbsBits(y[2 * k + 1])));
          pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
        }
        const int64_t gr = st.m0 + st.r0 + i;
        if (gr < M)
          StoreRowWords(p.data + gr * K + st.gc,
                        make_uint2(PackPairs(pair[0], pair[1]), PackPairs(pair[2], pair[3])),
                        vec_out, K - st.gc);
        // Column j's byte of this row goes to byte i % 4 of col_hi[j] (a
        // byte_perm keeping the other three); after row 3, rows 0-3 move to
        // col_lo and rows 4-7 overwrite them in col_hi.
        const unsigned keep = 0x3210u & ~(0xFu << (4 * (i % 4)));
        const unsigned sel_even = keep | (4u << (4 * (i % 4)));  // byte 0 of the pair
        const unsigned sel_odd = keep | (5u << (4 * (i % 4)));   // byte 1 of the pair
#pragma unroll
        for (int k = 0; k < kSub / 2; ++k) {
          col_hi[2 * k] = __byte_perm(col_hi[2 * k], pair[k], sel_even);
          col_hi[2 * k + 1] = __byte_perm(col_hi[2 * k + 1], pair[k], sel_odd);
        }
        if (i == 3) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) col_lo[j] = col_hi[j];
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
    *reinterpret_cast<uint2*>(&tbuf[c * kTile + (st.rg ^ Swz(c)) * 8]) =
        make_uint2(col_lo[j], col_hi[j]);
  }
  __syncthreads();
  StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);
}

// ScaleMode::kVec128 (blockwise): a row's 1x128 scale is a max over the 16
// lanes that share the row, available in the row loop; a column's 128x1
// scale needs all 128 rows of the tile. So the rowwise copy is stored from
// the row loop, and the values are parked in the thread's slice of dynamic
// shared memory (16 float4 + 1 of padding per thread: the 272-byte stride
// puts the 8 lanes of each 16-byte access phase on distinct banks; 68 KB
// per block) until the column scales are known. Launch bound: 2 blocks per
// SM, which the scratch allows anyway. (Casting both copies after the tile
// was complete, as QuantizeTileKernel does, took 0.625 / 0.749 ms on a
// 16384^2 bf16 gelu forward / backward on the H200, this kernel 0.620 /
// 0.725 with one cast per element and 0.582 / 0.696 with Cast2.)
constexpr int kScratchF4 = kSub * kSub / 4 + 1;
constexpr int kScratchBytes = kThreads * kScratchF4 * 16;
extern __shared__ float4 act_scratch[];

template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads, 2)
    ActQuantizeVec128Kernel(QuantizeArgs p, PrologueArgs q) {
  __shared__ unsigned col_part[kThreads / 16][kTile];  // per-row-group column amax
  __shared__ float col_scale[kTile];
  __shared__ __align__(16) uint8_t tbuf[kTile * kTile];  // transposed bytes

  const int64_t M = p.M, K = p.K;
  const SubTile st = ThisSubTile();
  const Fp8Out fmt = OutFormat(p);
  float4* mine = act_scratch + st.t * kScratchF4;

  const bool vec_out = (K % 8 == 0) && (st.gc + kSub <= K);
  unsigned cmax[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) cmax[j] = 0;
  // ComputeRows runs its row loop warp-uniformly (prologue.h), so the
  // 16-lane shuffle below is reached by all 32 lanes together.
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, M, st.m0 + st.r0, st.gc, [&](int i, const float (&y)[kSub]) {
        unsigned rmax = 0;
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          const unsigned b = AbsBits(y[j]);
          rmax = max(rmax, b);
          cmax[j] = max(cmax[j], b);
        }
        const float s = ComputeScale(__uint_as_float(WarpMaxU(rmax, 16)), fmt.max, p.pow2);
        const int64_t gr = st.m0 + st.r0 + i;
        if (gr < M) {
          // sinv native layout: (ceil(K/128), roundup(M, 4)), M contiguous.
          if (st.cg == 0) p.sinv[(st.k0 / kTile) * p.sinv_ld + gr] = 1.f / s;
          unsigned pair[kSub / 2];
#pragma unroll
          for (int k = 0; k < kSub / 2; ++k)
            pair[k] = Cast2(y[2 * k] * s, y[2 * k + 1] * s, fmt.interp);
          StoreRowWords(p.data + gr * K + st.gc,
                        make_uint2(PackPairs(pair[0], pair[1]), PackPairs(pair[2], pair[3])),
                        vec_out, K - st.gc);
        }
        mine[2 * i] = make_float4(y[0], y[1], y[2], y[3]);
        mine[2 * i + 1] = make_float4(y[4], y[5], y[6], y[7]);
      });

  // Column scales: block-wide max over the 16 row groups.
#pragma unroll
  for (int j = 0; j < kSub; ++j) col_part[st.rg][st.c0 + j] = cmax[j];
  __syncthreads();
  if (st.t < kTile) {
    unsigned c = 0;
#pragma unroll
    for (int g = 0; g < kThreads / 16; ++g) c = max(c, col_part[g][st.t]);
    const float s = ComputeScale(__uint_as_float(c), fmt.max, p.pow2);
    col_scale[st.t] = s;
    if (st.k0 + st.t < K)  // sinv_t native layout: (ceil(M/128), roundup(K, 4)), K contiguous
      p.sinv_t[(st.m0 / kTile) * p.sinv_t_ld + st.k0 + st.t] = 1.f / s;
  }
  __syncthreads();

  // The columnwise copy from the parked values, through tbuf as in
  // QuantizeTileKernel.
  float v[kSub][kSub];
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const float4 lo = mine[2 * i], hi = mine[2 * i + 1];
    v[i][0] = lo.x; v[i][1] = lo.y; v[i][2] = lo.z; v[i][3] = lo.w;
    v[i][4] = hi.x; v[i][5] = hi.y; v[i][6] = hi.z; v[i][7] = hi.w;
  }
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    const float cs = col_scale[st.c0 + j];
    unsigned pair[kSub / 2];  // rows 2k and 2k + 1 of column j
#pragma unroll
    for (int k = 0; k < kSub / 2; ++k)
      pair[k] = Cast2(v[2 * k][j] * cs, v[2 * k + 1][j] * cs, fmt.interp);
    const int c = st.c0 + j;
    *reinterpret_cast<uint2*>(&tbuf[c * kTile + (st.rg ^ Swz(c)) * 8]) =
        make_uint2(PackPairs(pair[0], pair[1]), PackPairs(pair[2], pair[3]));
  }
  __syncthreads();
  StoreTransposedTile(p, tbuf, st.m0, st.k0, st.t);
}

// max(|x|) over a flat array: 16-byte loads, 4 in flight per thread.
template <typename InT>
__global__ void __launch_bounds__(512) AmaxKernel(const InT* __restrict__ x, int64_t n,
                                                  unsigned* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(InT);
  constexpr int kUnroll = 4;
  unsigned m = 0;
  const int64_t nvec = n / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldg(xv + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const InT* e = reinterpret_cast<const InT*>(&raw[u]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) m = max(m, AbsBits(ToFloat(e[j])));
    }
  }
  for (; i < nvec; i += stride) {
    uint4 raw = __ldg(xv + i);
    const InT* e = reinterpret_cast<const InT*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = max(m, AbsBits(ToFloat(e[j])));
  }
  // Tail that does not fill a 16-byte vector.
  for (int64_t j = nvec * kVec + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < n; j += stride)
    m = max(m, AbsBits(ToFloat(x[j])));
  __shared__ unsigned red[512 / 32];
  m = WarpMaxU(m, 32);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0u;
    m = WarpMaxU(m, 32);
    if (threadIdx.x == 0) atomicMax(out, m);
  }
}

// max|v| of a prologue's output, computed by the same prologue::ComputeRows
// (so the same values bit for bit) on the same tiles, without the scratch;
// one atomicMax per 128x128 tile.
template <typename InT, Prologue kPro, prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads) TileAmaxKernel(QuantizeArgs p, PrologueArgs q) {
  __shared__ unsigned warp_red[kThreads / 32];
  const int t = threadIdx.x;
  unsigned amax = 0;
  prologue::ComputeRows<InT, kPro, kLoop>(
      q, p.M, static_cast<int64_t>(blockIdx.y) * kTile + (t / 16) * kSub,
      static_cast<int64_t>(blockIdx.x) * kTile + (t % 16) * kSub,
      [&](int, const float (&y)[kSub]) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) amax = max(amax, AbsBits(y[j]));
      });
  amax = BlockMaxU(amax, warp_red);
  if (t == 0) atomicMax(reinterpret_cast<unsigned*>(p.amax_out), amax);
}

dim3 TileGrid(const QuantizeArgs& a) {
  return dim3(static_cast<unsigned>((a.K + kTile - 1) / kTile),
              static_cast<unsigned>((a.M + kTile - 1) / kTile));
}

// Calls launch(std::integral_constant<ActLoop, L>) for the loop L that
// prologue::ChooseLoop picks for q; only kAny is instantiated for fp32 inputs.
template <typename InT, typename Launch>
cudaError_t WithLoop(const PrologueArgs& q, Launch&& launch) {
  using prologue::ActLoop;
  if constexpr (sizeof(InT) == 4) {
    return launch(std::integral_constant<ActLoop, ActLoop::kAny>{});
  } else {
    switch (prologue::ChooseLoop(q, true)) {
      case ActLoop::kGelu: return launch(std::integral_constant<ActLoop, ActLoop::kGelu>{});
      case ActLoop::kSilu: return launch(std::integral_constant<ActLoop, ActLoop::kSilu>{});
      case ActLoop::kRelu: return launch(std::integral_constant<ActLoop, ActLoop::kRelu>{});
      case ActLoop::kSwiGlu: return launch(std::integral_constant<ActLoop, ActLoop::kSwiGlu>{});
      case ActLoop::kAny: break;
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
    if (e != cudaSuccess) return e;
    kernel<<<TileGrid(a), kThreads, kScratchBytes, stream>>>(a, q);
  }
  return cudaGetLastError();
}

template <typename InT, ScaleMode kMode, Prologue kPro>
cudaError_t LaunchWithPrologue(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  return WithLoop<InT>(q, [&](auto loop) {
    return LaunchWithLoop<InT, kMode, kPro, decltype(loop)::value>(a, q, stream);
  });
}

template <typename InT, ScaleMode kMode>
cudaError_t LaunchTyped(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  const dim3 grid = TileGrid(a);
  switch (q.kind) {
    case Prologue::kNone:
      if (a.data_t != nullptr) {
        QuantizeTileKernel<InT, kMode, true><<<grid, kThreads, 0, stream>>>(a);
      } else {
        QuantizeTileKernel<InT, kMode, false><<<grid, kThreads, 0, stream>>>(a);
      }
      return cudaGetLastError();
    case Prologue::kAct:
    case Prologue::kDAct:
      // The fused MLP always wants the columnwise copy and never 128x128
      // blocks: only those variants are built (per input type and
      // activation loop: ActQuantizeVec128Kernel and ActQuantizeTensorKernel,
      // each forward and backward).
      if constexpr (kMode == ScaleMode::kBlock128) {
        return cudaErrorInvalidValue;
      } else {
        if (a.data_t == nullptr) return cudaErrorInvalidValue;
        return q.kind == Prologue::kAct ? LaunchWithPrologue<InT, kMode, Prologue::kAct>(a, q, stream)
                                        : LaunchWithPrologue<InT, kMode, Prologue::kDAct>(a, q, stream);
      }
  }
  return cudaErrorInvalidValue;
}

template <typename InT>
cudaError_t LaunchMode(const QuantizeArgs& a, const PrologueArgs& q, cudaStream_t stream) {
  switch (a.mode) {
    case ScaleMode::kTensor: return LaunchTyped<InT, ScaleMode::kTensor>(a, q, stream);
    case ScaleMode::kVec128: return LaunchTyped<InT, ScaleMode::kVec128>(a, q, stream);
    case ScaleMode::kBlock128: return LaunchTyped<InT, ScaleMode::kBlock128>(a, q, stream);
  }
  return cudaErrorInvalidValue;
}

bool GridValid(const QuantizeArgs& a) {
  return (a.M + kTile - 1) / kTile <= 65535 && (a.K + kTile - 1) / kTile <= 2147483647;
}

// Host-side guard of the prologue fields. The FFI handlers check them first
// with messages; this keeps any other caller from reading out of bounds.
bool PrologueValid(const QuantizeArgs& a, const PrologueArgs& q) {
  if (q.kind == Prologue::kNone) return true;
  const bool gated = q.act1 >= 0;
  if (q.h == nullptr || q.F <= 0 || q.act0 < 0 || q.act0 >= kNumAct || q.act1 >= kNumAct)
    return false;
  if (gated && q.F % 8 != 0) return false;
  if (q.kind == Prologue::kAct) return a.K == q.F;
  return q.dz != nullptr && a.K == (gated ? 2 : 1) * q.F;
}

template <typename InT>
cudaError_t LaunchTileAmax(const QuantizeArgs& b, const PrologueArgs& q, cudaStream_t stream) {
  return WithLoop<InT>(q, [&](auto loop) {
    constexpr prologue::ActLoop kLoop = decltype(loop)::value;
    if (q.kind == Prologue::kAct)
      TileAmaxKernel<InT, Prologue::kAct, kLoop><<<TileGrid(b), kThreads, 0, stream>>>(b, q);
    else
      TileAmaxKernel<InT, Prologue::kDAct, kLoop><<<TileGrid(b), kThreads, 0, stream>>>(b, q);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchQuantize(const QuantizeArgs& a, cudaStream_t stream, const PrologueArgs& q) {
  if (a.M <= 0 || a.K <= 0) return cudaSuccess;
  if (!GridValid(a)) return cudaErrorInvalidConfiguration;
  if (!PrologueValid(a, q)) return cudaErrorInvalidValue;
  if (a.mode == ScaleMode::kTensor && a.amax_out != nullptr) {
    cudaError_t e = cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  switch (a.in) {
    case InType::kF32: return LaunchMode<float>(a, q, stream);
    case InType::kBF16: return LaunchMode<__nv_bfloat16>(a, q, stream);
    case InType::kF16: return LaunchMode<__half>(a, q, stream);
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

cudaError_t LaunchAmax(const void* x, int64_t n, InType in, float* amax_out,
                       cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(amax_out, 0, sizeof(float), stream);
  if (e != cudaSuccess || n <= 0) return e;
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  // Enough blocks to fill the GPU (4 x 512 threads per SM), no more: each
  // block ends with one atomic.
  const int64_t want = (n / 8 + 511) / 512 + 1;
  const unsigned blocks = static_cast<unsigned>(want < 4 * sms ? want : 4 * sms);
  unsigned* out = reinterpret_cast<unsigned*>(amax_out);
  switch (in) {
    case InType::kF32: AmaxKernel<float><<<blocks, 512, 0, stream>>>(static_cast<const float*>(x), n, out); break;
    case InType::kBF16: AmaxKernel<__nv_bfloat16><<<blocks, 512, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), n, out); break;
    case InType::kF16: AmaxKernel<__half><<<blocks, 512, 0, stream>>>(static_cast<const __half*>(x), n, out); break;
  }
  return cudaGetLastError();
}

}  // namespace te_jax
