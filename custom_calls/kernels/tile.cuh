// The 128x128-tile layout and the FP8 helpers shared by the quantize
// kernels (kernels/quantize.cu) and the fused activation-quantize kernels
// (kernels/act_quantize.cu): one 256-thread block per 128x128 tile, each
// thread an 8x8 sub-tile; casts, amax bits, and the stores of the rowwise and
// (through a swizzled shared byte tile) the transposed copy. Numerics: see
// quantize.cu. Included by those two files only (an unnamed namespace: each
// gets its own copy of these inline helpers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "kernels/prologue.h"
#include "kernels/quantize.h"

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

// max(m, |v|) for m >= 0 (or NaN), NaN-propagating like the max over AbsBits:
// one float max with an |operand| (max.NaN, sm_80+) instead of a sign mask
// and an integer max. A NaN result is the canonical NaN 0x7FFFFFFF, still
// above +inf as bits, so AbsBits-style unsigned reductions may follow.
__device__ __forceinline__ float MaxAbs(float m, float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
}

// compute_scale() of ops/quantize.py. An amax of 0 gives scale 1; a
// non-finite amax (an Inf or NaN in the tile or tensor) gives a NaN scale, so
// every FP8 value of it and its scale_inv are NaN and the GEMM that reads it
// returns non-finite values, as the unquantized product would: saturation
// must not turn an Inf into +-fp8_max.
__device__ __forceinline__ float ComputeScale(float amax, float fp8_max, bool pow2) {
  const bool valid = isfinite(amax) && amax > 0.f;
  float s = fp8_max / (valid ? amax : 1.f);  // IEEE division (-prec-div=true)
  s = fminf(s, FLT_MAX);
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  return valid ? s : (isfinite(amax) ? 1.f : __uint_as_float(0x7FC00000u));
}

__device__ __forceinline__ uint8_t Cast(float v, __nv_fp8_interpretation_t t) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, t));
}

// Cast(a) in bits 0-7 and Cast(b) in bits 8-15, by one cvt instruction
// (each value rounded on its own: the same bytes as two Casts).
__device__ __forceinline__ unsigned Cast2(float a, float b, __nv_fp8_interpretation_t t) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, t);
}

// The 8 bytes of four Cast2 pairs, in order (pair k in bytes 2k, 2k + 1).
__device__ __forceinline__ uint2 PackPairs(const unsigned (&pair)[kSub / 2]) {
  return make_uint2(__byte_perm(pair[0], pair[1], 0x5410), __byte_perm(pair[2], pair[3], 0x5410));
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

// The 128x1 column scales of a tile (blockwise 1x128 mode, columnwise copy):
// each thread passes the AbsBits maxima of its 8 columns; the max over the 16
// row groups goes through `col_part`, and thread c < 128 writes column c's
// ComputeScale to `col_scale` (for the whole block to read after the return)
// and 1/scale to sinv_t (native layout: (ceil(M/128), roundup(K, 4)), K
// contiguous). Two __syncthreads: every thread of the block must call it.
__device__ __forceinline__ void ColumnScales(const QuantizeArgs& p, const SubTile& st,
                                             const unsigned (&cmax)[kSub], float fp8_max,
                                             unsigned (*col_part)[kTile], float* col_scale) {
#pragma unroll
  for (int j = 0; j < kSub; ++j) col_part[st.rg][st.c0 + j] = cmax[j];
  __syncthreads();
  if (st.t < kTile) {
    unsigned c = 0;
#pragma unroll
    for (int g = 0; g < kThreads / 16; ++g) c = max(c, col_part[g][st.t]);
    const float s = ComputeScale(__uint_as_float(c), fp8_max, p.pow2);
    col_scale[st.t] = s;
    if (st.k0 + st.t < p.K) p.sinv_t[(st.m0 / kTile) * p.sinv_t_ld + st.k0 + st.t] = 1.f / s;
  }
  __syncthreads();
}

// The FP8 format of the output: cvt interpretation and largest finite value.
struct Fp8Out {
  __nv_fp8_interpretation_t interp;
  float max;
};

__device__ __forceinline__ Fp8Out OutFormat(const QuantizeArgs& p) {
  return p.out == Fp8Type::kE5M2 ? Fp8Out{__NV_E5M2, 57344.f} : Fp8Out{__NV_E4M3, 448.f};
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

// The 8 bytes of the transposed byte tile `tbuf` that hold rows 8*rg ..
// 8*rg + 7 of column c (a row of the transposed tile): chunk rg ^ Swz(c) of
// its 16. Swz(c) is distinct over the 16 lanes that write one sub-tile
// column (c/8 varies) and spreads the 4 rows c that one warp reads (c%8
// varies) over both chunk parities.
__device__ __forceinline__ uint2& TileChunk(uint8_t* tbuf, int c, int rg) {
  return *reinterpret_cast<uint2*>(&tbuf[c * kTile + (rg ^ Swz(c)) * 8]);
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

inline dim3 TileGrid(const QuantizeArgs& a) {
  return dim3(static_cast<unsigned>((a.K + kTile - 1) / kTile),
              static_cast<unsigned>((a.M + kTile - 1) / kTile));
}

// The tile grid fits CUDA's limits (grid.y <= 65535).
inline bool GridValid(const QuantizeArgs& a) {
  return (a.M + kTile - 1) / kTile <= 65535 && (a.K + kTile - 1) / kTile <= 2147483647;
}

}  // namespace
}  // namespace te_jax
