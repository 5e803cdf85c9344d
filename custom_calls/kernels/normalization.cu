// LayerNorm / RMSNorm kernels of te_jax/ops/normalization.py (FFI handlers:
// ffi/normalization.cc).
//
// Forward (norm + FP8 quantize) in two kernels:
//   1. NormStatsRowKernel: one block per row (H <= 8192) holds the row in
//      registers and computes mean, rstd and, for current scaling, max|v| of
//      the normalized output v from them (NormStatsKernel, a warp per row
//      re-reading the row for each pass, takes larger H);
//   2. the 128x128-tile quantize kernels of act_quantize.cu with
//      Prologue::kNorm (prologue::NormRows): each thread computes its 8x8
//      values of v from x, the row statistics, gamma and beta, and the
//      kernel writes the rowwise and the transposed FP8 copies (per-tensor
//      scale, or 1x128 + 128x1 tiles) as it does for an activation.
// Why not one kernel: a 128-row tile does not own whole rows once H > 128,
// and the statistics need whole rows; a block owning whole rows (128 rows x
// 4096 bf16 = 1 MB) could not keep them on chip to write the transposed
// copy. So x is read twice from HBM (statistics, then the tile pass) and v
// is never written in 16 or 32 bits. The tile pass takes most of the time;
// its per-row statistics loads are the next thing to look at (timings:
// docs/custom-calls-log-2026-12.md).
//
// Numerics: v and the amax are bit-identical to ops/normalization.py's
// norm_apply_reference given the same statistics (prologue::NormValue
// follows it operation for operation, with the fused multiply-add XLA forms
// for `* gamma + beta`). The statistics are float32 sums in another order than
// XLA's reduction (each lane adds its columns in order, then a butterfly
// over the warp), and rstd is 1 / sqrt (both IEEE) where XLA:CPU's rsqrt is
// approximate: they agree with the reference to a few float32 ulps, not bit
// for bit.
//
// Backward: NormBwdKernel, one block of up to 1024 threads per row at a time
// (each thread 8 columns), a grid of `blocks` CUDA blocks striding
// over the rows: per row, the two sums c1, c2 (a block reduction), then dx;
// the dgamma/dbeta partial sums stay in registers over the block's rows and
// are written once per block, then NormBwdFinalizeKernel sums them in a fixed
// order. Reads x and dy once and writes dx once, the least memory traffic
// a norm backward can have. dx differs from the reference only
// through c1 and c2 (summation order): with equal c1, c2 the formula is the
// same operation for operation (u - xhat * c2 fused, as XLA contracts it).
#include "kernels/normalization.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/prologue.h"
#include "kernels/tile.cuh"  // kThreads (256), kSub, MaxAbs, BlockMaxU

namespace te_jax {
namespace {

using prologue::NormColumns;
using prologue::NormValue;
using prologue::RawRow;

constexpr int kStatsRows = kThreads / 32;  // one warp per row

__device__ __forceinline__ float WarpSum(float v) {
  // Butterfly: lanes i and i ^ o add the same two values (in either order,
  // which float addition does not see), so every lane ends with the same bits.
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum over row `row` of x (M, H) of step(acc, value), by the 32 lanes of
// a warp: lane l takes columns [8l, 8l + 8) of every 256, four 16-byte loads
// in flight, and adds its values in column order; then WarpSum.
template <typename InT, typename Step>
__device__ __forceinline__ float RowSum(const InT* __restrict__ x, int64_t M, int64_t H,
                                        int64_t row, int lane, Step step) {
  constexpr int kUnroll = 4;
  constexpr int kStride = 32 * kSub;
  float acc = 0.f;
  for (int64_t c0 = static_cast<int64_t>(lane) * kSub; c0 < H; c0 += kUnroll * kStride) {
    RawRow<InT> r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + u * kStride < H) r[u].Load(x, H, M, row, c0 + u * kStride, H);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kStride;
      if (c >= H) break;
#pragma unroll
      for (int j = 0; j < kSub; ++j)
        if (c + j < H) acc = step(acc, r[u][j]);
    }
  }
  return WarpSum(acc);
}

template <typename InT>
__global__ void __launch_bounds__(kThreads) NormStatsKernel(NormStatsArgs a) {
  __shared__ unsigned warp_red[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kStatsRows + threadIdx.x / 32;
  const int64_t M = a.M, H = a.H;
  const InT* x = static_cast<const InT*>(a.x);
  const bool center = a.mean != nullptr;
  float amax = 0.f;
  if (row < M) {  // warp-uniform
    const float h = static_cast<float>(H);
    float mean = 0.f, ss;
    if (center) {
      mean = __fdiv_rn(RowSum(x, M, H, row, lane, [](float s, float v) { return __fadd_rn(s, v); }),
                       h);
      ss = RowSum(x, M, H, row, lane, [mean](float s, float v) {
        const float d = __fsub_rn(v, mean);
        return __fmaf_rn(d, d, s);
      });
    } else {
      ss = RowSum(x, M, H, row, lane, [](float s, float v) { return __fmaf_rn(v, v, s); });
    }
    const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, h), a.epsilon)));
    if (lane == 0) {
      if (center) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
    if (a.amax_out != nullptr) {
      const bool has_beta = a.beta != nullptr;
#pragma unroll 2
      for (int64_t c = static_cast<int64_t>(lane) * kSub; c < H; c += 32 * kSub) {
        RawRow<InT> r;
        r.Load(x, H, M, row, c, H);
        float g[kSub], b[kSub];
        NormColumns(a.gamma, a.beta, a.zero_centered, H, c, g, b);
#pragma unroll
        for (int j = 0; j < kSub; ++j)
          if (c + j < H) amax = MaxAbs(amax, NormValue(r[j], mean, rstd, g[j], b[j], center, has_beta));
      }
    }
  }
  if (a.amax_out != nullptr) {  // block-uniform: every thread reaches the barrier
    const unsigned m = BlockMaxU(__float_as_uint(amax), warp_red);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned*>(a.amax_out), m);
  }
}

// One 128-thread block per row for H <= 8192 (every shape the Python op
// sends: the backward's limit): each thread keeps its kVecs x 8 elements of
// the row in registers, so x is read from HBM once and the variance and
// amax passes cost no memory traffic. (The warp-per-row kernel above
// re-reads the row for each pass, and those reads go to HBM: L1/L2 do not
// keep the row between passes.)
constexpr int kRowThreads = 128;
constexpr int64_t kRowKernelMaxH = 8 * kRowThreads * kSub;  // kVecs <= 8

// Sum over the block of one float per thread, in a fixed order (every
// thread gets the same bits); `red` holds a value per warp and is not
// reused by the caller afterwards (one __syncthreads).
__device__ __forceinline__ float RowBlockSum(float v, float* red) {
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) s = __fadd_rn(s, red[w]);
  return s;
}

template <typename InT, int kVecs>
__global__ void __launch_bounds__(kRowThreads) NormStatsRowKernel(NormStatsArgs a) {
  __shared__ float red[3][kRowThreads / 32];
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int64_t M = a.M, H = a.H;
  const InT* x = static_cast<const InT*>(a.x);
  const bool center = a.mean != nullptr;
  const float h = static_cast<float>(H);
  auto col = [&](int k) { return (static_cast<int64_t>(k) * kRowThreads + t) * kSub; };
  RawRow<InT> r[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k)
    if (col(k) < H) r[k].Load(x, H, M, row, col(k), H);

  float mean = 0.f;
  if (center) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k)
#pragma unroll
      for (int j = 0; j < kSub; ++j)
        if (col(k) + j < H) s = __fadd_rn(s, r[k][j]);
    mean = __fdiv_rn(RowBlockSum(s, red[0]), h);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k)
#pragma unroll
    for (int j = 0; j < kSub; ++j)
      if (col(k) + j < H) {
        const float d = center ? __fsub_rn(r[k][j], mean) : r[k][j];
        ss = __fmaf_rn(d, d, ss);
      }
  const float var = __fdiv_rn(RowBlockSum(ss, red[1]), h);
  const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(var, a.epsilon)));
  if (t == 0) {
    if (center) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  if (a.amax_out != nullptr) {
    const bool has_beta = a.beta != nullptr;
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (col(k) >= H) break;
      float g[kSub], b[kSub];
      NormColumns(a.gamma, a.beta, a.zero_centered, H, col(k), g, b);
#pragma unroll
      for (int j = 0; j < kSub; ++j)
        if (col(k) + j < H)
          amax = MaxAbs(amax, NormValue(r[k][j], mean, rstd, g[j], b[j], center, has_beta));
    }
    // Max over the block of the amax bits (NaN, as 0x7FFFFFFF, above +inf).
    unsigned m = WarpMaxU(__float_as_uint(amax), 32);
    unsigned* redu = reinterpret_cast<unsigned*>(red[2]);
    if (t % 32 == 0) redu[t / 32] = m;
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int w = 1; w < kRowThreads / 32; ++w) m = max(m, redu[w]);
      atomicMax(reinterpret_cast<unsigned*>(a.amax_out), max(m, redu[0]));
    }
  }
}

// ---------------------------------------------------------------- backward --

constexpr int kBwdThreads = 1024;  // H <= 8 x 1024

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

// Stores 8 values of one row at dst (16-byte stores when `vec`), else the
// first `valid` one by one.
template <typename OutT>
__device__ __forceinline__ void StoreEight(OutT* dst, const float (&v)[kSub], bool vec,
                                           int64_t valid) {
  OutT tmp[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) tmp[j] = FromFloat<OutT>(v[j]);
  if (vec) {
    constexpr int kVec = 16 / sizeof(OutT);
#pragma unroll
    for (int k = 0; k < kSub / kVec; ++k)
      reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(tmp)[k];
  } else {
#pragma unroll
    for (int j = 0; j < kSub; ++j)
      if (j < valid) dst[j] = tmp[j];
  }
}

// a + b elementwise, each sum rounded to InT: what XLA's add of the two
// InT arrays gives (a float32 sum of two bf16 or fp16 values rounds to them
// as the exact sum does).
template <typename InT>
__device__ __forceinline__ RawRow<InT> SumRounded(const RawRow<InT>& a, const RawRow<InT>& b) {
  InT sum[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) sum[j] = static_cast<InT>(__fadd_rn(a[j], b[j]));
  RawRow<InT> r;
  memcpy(r.w, sum, sizeof(sum));
  return r;
}

// One thread per 8 columns of a row (blocks of up to 1024 threads, H <=
// 8192), so its dgamma/dbeta partial sums are 16 registers; with the row's
// x and dy, the next row's in flight (16-bit inputs) and gamma', ptxas fits
// it in the 64 registers that 1024 threads per SM allow (two blocks of 512
// at H = 4096). More columns per thread spilled at 128 registers (tried: 2
// and 4 chunks of 8), hence the H limit.
// kAdd: the cotangent is dy + dy_add (NormBwdArgs), summed as the rows are
// loaded; its own instance, so that the kernel without it keeps its
// registers (with it, the 16-bit kernels fit the 64 without spills and the
// float32 one spills 8 / 20 bytes, against 8 / 8 without).
// kDxAdd: dx_add is added to dx as it is stored (a residual branch's
// cotangent), each row's load issued before the block reduction so that the
// barrier hides its latency.
template <typename InT, bool kAdd, bool kDxAdd>
__global__ void __launch_bounds__(kBwdThreads, 1) NormBwdKernel(NormBwdArgs a) {
  // float32 rows take twice the registers: no prefetch there (not the hot path).
  constexpr bool kPrefetch = sizeof(InT) == 2;
  __shared__ float red[2][2][kBwdThreads / 32];  // [row parity][c1, c2][warp]
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int nwarps = blockDim.x / 32;
  const int64_t M = a.M;
  const int H = static_cast<int>(a.H);
  const float h = static_cast<float>(H);
  const InT* x = static_cast<const InT*>(a.x);
  const InT* dy = static_cast<const InT*>(a.dy);
  const InT* dy_add = static_cast<const InT*>(a.dy_add);
  InT* dx = static_cast<InT*>(a.dx);
  const bool center = a.mean != nullptr;
  const int c = t * kSub;  // this thread's columns [c, c + 8)
  const bool has_cols = c < H;

  float ge[kSub];
  {
    float unused[kSub];
    NormColumns(a.gamma, nullptr, a.zero_centered, has_cols ? H : 0, c, ge, unused);
  }
  float dg[kSub], db[kSub];
#pragma unroll
  for (int j = 0; j < kSub; ++j) dg[j] = db[j] = 0.f;

  struct Rows {
    RawRow<InT> x, d;
  };
  auto load = [&](int64_t row, Rows& r) {  // zeros past M or H
    r.x.Load(x, H, M, row, c, H);
    r.d.Load(dy, H, M, row, c, H);
    if constexpr (kAdd) {
      RawRow<InT> e;
      e.Load(dy_add, H, M, row, c, H);
      r.d = SumRounded(r.d, e);
    }
  };

  Rows cur;
  int64_t row = blockIdx.x;
  if constexpr (kPrefetch) load(row, cur);
  for (int it = 0; row < M; row += gridDim.x, ++it) {  // block-uniform
    Rows nxt;
    if constexpr (kPrefetch) {
      load(row + gridDim.x, nxt);
    } else {
      load(row, cur);
    }
    const float mu = center ? __ldg(a.mean + row) : 0.f;
    const float rs = __ldg(a.rstd + row);
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if (c + j < H) {
        const float xv = cur.x[j], dv = cur.d[j];
        const float xh = __fmul_rn(center ? __fsub_rn(xv, mu) : xv, rs);
        const float gv = __fmul_rn(dv, ge[j]);
        s1 = __fadd_rn(s1, gv);
        s2 = __fmaf_rn(gv, xh, s2);
        dg[j] = __fmaf_rn(dv, xh, dg[j]);
        db[j] = __fadd_rn(db[j], dv);
      }
    }
    RawRow<InT> res;   // the row of dx_add, in flight during the reduction
    if constexpr (kDxAdd) res.Load(static_cast<const InT*>(a.dx_add), H, M, row, c, H);
    // Block sums of s1, s2; double-buffered by row parity, so one barrier
    // per row suffices (a thread writing buffer p again two rows later has
    // passed the barrier of the row between, which every thread reaches
    // only after reading buffer p).
    s1 = WarpSum(s1);
    s2 = WarpSum(s2);
    const int p = it & 1;
    if (lane == 0) {
      red[p][0][warp] = s1;
      red[p][1][warp] = s2;
    }
    __syncthreads();
    float t1 = 0.f, t2 = 0.f;
    for (int w = 0; w < nwarps; ++w) {  // the same order in every thread
      t1 = __fadd_rn(t1, red[p][0][w]);
      t2 = __fadd_rn(t2, red[p][1][w]);
    }
    const float c1 = __fdiv_rn(t1, h), c2 = __fdiv_rn(t2, h);
    if (has_cols) {
      float v[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const float xv = cur.x[j], dv = cur.d[j];
        const float xh = __fmul_rn(center ? __fsub_rn(xv, mu) : xv, rs);
        const float gv = __fmul_rn(dv, ge[j]);
        const float u = center ? __fsub_rn(gv, c1) : gv;
        // u - xh * c2 as one fused multiply-add, as XLA contracts the
        // reference's expression.
        v[j] = __fmul_rn(__fmaf_rn(-xh, c2, u), rs);
        // dx rounded to InT, then the sum rounded again: XLA's add of the
        // norm's dx and the residual cotangent, bit for bit.
        if constexpr (kDxAdd)
          v[j] = __fadd_rn(static_cast<float>(FromFloat<InT>(v[j])), res[j]);
      }
      StoreEight(dx + row * H + c, v, H % (16 / sizeof(InT)) == 0 && c + kSub <= H, H - c);
    }
    if constexpr (kPrefetch) cur = nxt;
  }

  // This block's partial sums: partial[0][blockIdx.x][:] (dgamma) and
  // partial[1][blockIdx.x][:] (dbeta).
  if (!has_cols) return;
  float* pg = a.partial + static_cast<int64_t>(blockIdx.x) * H;
  float* pb = a.dbeta != nullptr ? pg + static_cast<int64_t>(gridDim.x) * H : nullptr;
  if (c + kSub <= H && H % 4 == 0) {  // 16-byte aligned: two float4 each
    float4* g4 = reinterpret_cast<float4*>(pg + c);
    g4[0] = make_float4(dg[0], dg[1], dg[2], dg[3]);
    g4[1] = make_float4(dg[4], dg[5], dg[6], dg[7]);
    if (pb != nullptr) {
      float4* b4 = reinterpret_cast<float4*>(pb + c);
      b4[0] = make_float4(db[0], db[1], db[2], db[3]);
      b4[1] = make_float4(db[4], db[5], db[6], db[7]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if (c + j < H) {
        pg[c + j] = dg[j];
        if (pb != nullptr) pb[c + j] = db[j];
      }
    }
  }
}

// out[p][c] = sum over b of partial[p][b][c], b in increasing order within
// each of 8 strided groups, then the 8 group sums in order: deterministic.
// Block (32 columns) x (8 groups), grid (ceil(H/32), P).
__global__ void __launch_bounds__(256) NormBwdFinalizeKernel(const float* __restrict__ partial,
                                                             int64_t blocks, int64_t H,
                                                             float* dgamma, float* dbeta) {
  __shared__ float red[8][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx;
  const float* src = partial + static_cast<int64_t>(blockIdx.y) * blocks * H;
  float s = 0.f;
  if (c < H)
    for (int64_t b = ty; b < blocks; b += 8) s = __fadd_rn(s, __ldg(src + b * H + c));
  red[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < H) {
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < 8; ++g) total = __fadd_rn(total, red[g][tx]);
    (blockIdx.y == 0 ? dgamma : dbeta)[c] = total;
  }
}

}  // namespace

cudaError_t LaunchNormStats(const NormStatsArgs& a, cudaStream_t stream) {
  if (a.amax_out != nullptr) {
    cudaError_t e = cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  if (a.M <= 0 || a.H <= 0) return cudaSuccess;
  if (a.x == nullptr || a.rstd == nullptr || (a.amax_out != nullptr && a.gamma == nullptr))
    return cudaErrorInvalidValue;
  if (a.H <= kRowKernelMaxH) {   // one block per row, the row in registers
    if (a.M > 2147483647) return cudaErrorInvalidConfiguration;
    const int64_t vecs = (a.H + kRowThreads * kSub - 1) / (kRowThreads * kSub);
    const int kv = vecs <= 1 ? 1 : vecs <= 2 ? 2 : vecs <= 4 ? 4 : 8;
    auto typed = [&](auto in) {
      using InT = decltype(in);
      const dim3 grid(static_cast<unsigned>(a.M));
      switch (kv) {
        case 1: NormStatsRowKernel<InT, 1><<<grid, kRowThreads, 0, stream>>>(a); break;
        case 2: NormStatsRowKernel<InT, 2><<<grid, kRowThreads, 0, stream>>>(a); break;
        case 4: NormStatsRowKernel<InT, 4><<<grid, kRowThreads, 0, stream>>>(a); break;
        default: NormStatsRowKernel<InT, 8><<<grid, kRowThreads, 0, stream>>>(a); break;
      }
      return cudaGetLastError();
    };
    switch (a.in) {
      case InType::kF32: return typed(float{});
      case InType::kBF16: return typed(__nv_bfloat16{});
      case InType::kF16: return typed(__half{});
    }
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (a.M + kStatsRows - 1) / kStatsRows;
  if (blocks > 2147483647) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (a.in) {
    case InType::kF32: NormStatsKernel<float><<<grid, kThreads, 0, stream>>>(a); break;
    case InType::kBF16: NormStatsKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    case InType::kF16: NormStatsKernel<__half><<<grid, kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

namespace {

// NormBwdKernel's instance for a.dy_add and a.dx_add (each set or not).
template <typename InT>
void LaunchBwd(const NormBwdArgs& a, dim3 grid, int threads, cudaStream_t stream) {
  const bool dy_add = a.dy_add != nullptr, dx_add = a.dx_add != nullptr;
  if (dy_add && dx_add) {
    NormBwdKernel<InT, true, true><<<grid, threads, 0, stream>>>(a);
  } else if (dy_add) {
    NormBwdKernel<InT, true, false><<<grid, threads, 0, stream>>>(a);
  } else if (dx_add) {
    NormBwdKernel<InT, false, true><<<grid, threads, 0, stream>>>(a);
  } else {
    NormBwdKernel<InT, false, false><<<grid, threads, 0, stream>>>(a);
  }
}

}  // namespace

cudaError_t LaunchNormBackward(const NormBwdArgs& a, cudaStream_t stream) {
  if (a.H <= 0 || a.H > kNormBwdMaxHidden || a.M < 0 || a.blocks < 1 || a.blocks > 65535 ||
      a.gamma == nullptr || a.rstd == nullptr || a.dgamma == nullptr || a.partial == nullptr)
    return cudaErrorInvalidValue;
  if (a.M == 0) {  // no rows: zero parameter gradients
    cudaError_t e = cudaMemsetAsync(a.dgamma, 0, a.H * sizeof(float), stream);
    if (e == cudaSuccess && a.dbeta != nullptr)
      e = cudaMemsetAsync(a.dbeta, 0, a.H * sizeof(float), stream);
    return e;
  }
  if (a.x == nullptr || a.dy == nullptr || a.dx == nullptr) return cudaErrorInvalidValue;
  // One thread per 8 columns, a multiple of 32 threads.
  const dim3 grid(static_cast<unsigned>(a.blocks));
  const int threads = static_cast<int>(((a.H + kSub - 1) / kSub + 31) / 32 * 32);
  switch (a.in) {
    case InType::kF32: LaunchBwd<float>(a, grid, threads, stream); break;
    case InType::kBF16: LaunchBwd<__nv_bfloat16>(a, grid, threads, stream); break;
    case InType::kF16: LaunchBwd<__half>(a, grid, threads, stream); break;
    default: return cudaErrorInvalidValue;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 fgrid(static_cast<unsigned>((a.H + 31) / 32), a.dbeta != nullptr ? 2u : 1u);
  NormBwdFinalizeKernel<<<fgrid, 256, 0, stream>>>(a.partial, a.blocks, a.H, a.dgamma, a.dbeta);
  return cudaGetLastError();
}

}  // namespace te_jax
