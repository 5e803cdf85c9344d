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
// The shared tile helpers are in kernels/tile.cuh; the kernels with an
// activation prologue (the fused MLP) in kernels/act_quantize.cu.
#include "kernels/quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/tile.cuh"

namespace te_jax {
namespace {

// Min blocks per SM: 3 for 16-bit inputs caps registers at 80 (no spills);
// fp32 inputs (not the hot path) need up to ~150 registers in the 1x128 mode.
template <typename InT>
constexpr int MinBlocks() {
  return sizeof(InT) == 4 ? 1 : 3;
}

// The work of one block: the 128x128 tile (blockIdx.x, blockIdx.y) of the
// (p.M, p.K) tensor p describes. A device function so that the 2-D kernel
// and the stack kernel (one entry per blockIdx.z) share it; force-inlined,
// so QuantizeTileKernel compiles to what it was as a kernel body.
template <typename InT, ScaleMode kMode, bool kCols>
__device__ __forceinline__ void QuantizeTile(const QuantizeArgs& p) {
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
  // kTensor: the one scale is known before the tile is read (given, or from
  // the amax an earlier launch wrote), so its load goes out with the tile's
  // instead of after the block's amax barrier, where every block waited on it.
  float tensor_s = 1.f;
  if constexpr (kMode == ScaleMode::kTensor)
    tensor_s = p.amax_in != nullptr ? ComputeScale(*p.amax_in, fp8_max, p.pow2) : *p.scale;

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
      ColumnScales(p, st, cmax, fp8_max, col_part, col_scale);
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
      s = tensor_s;
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
    // tbuf[c][m] for column c (a row of the transposed tile), placed by
    // TileChunk (tile.cuh).
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      uint8_t q[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) q[i] = Cast(v(i, j) * my_col_s[j], interp);
      TileChunk(tbuf, c0 + j, rg) = *reinterpret_cast<const uint2*>(q);
    }
    __syncthreads();
    StoreTransposedTile(p, tbuf, m0, k0, t);
  }
}

template <typename InT, ScaleMode kMode, bool kCols>
__global__ void __launch_bounds__(kThreads, MinBlocks<InT>()) QuantizeTileKernel(QuantizeArgs p) {
  QuantizeTile<InT, kMode, kCols>(p);
}

// `ptr` advanced by `n` elements; null (an output not asked for) stays null.
template <typename T>
__device__ __forceinline__ T* EntryPtr(T* ptr, int64_t n) {
  return ptr == nullptr ? ptr : ptr + n;
}

// Entry e of the stack `s` (quantize.h: StackArgs) as a 2-D problem: p with
// every pointer moved to that entry's part of its (E, ...) array. (Moving x
// and data without the null check, or only the pointers an instance uses,
// made ptxas spill more in the 16-bit instances, nvcc 13.0.)
template <typename InT>
__device__ __forceinline__ QuantizeArgs AtEntry(QuantizeArgs p, const StackArgs& s, int64_t e) {
  const int64_t mk = p.M * p.K;  // elements of x, bytes of data and data_t
  p.x = EntryPtr(static_cast<const InT*>(p.x), e * mk);
  p.data = EntryPtr(p.data, e * mk);
  p.data_t = EntryPtr(p.data_t, e * mk);
  p.scale = EntryPtr(p.scale, e);
  p.amax_in = EntryPtr(p.amax_in, e);
  p.amax_out = EntryPtr(p.amax_out, e);
  p.scale_inv = EntryPtr(p.scale_inv, e);
  p.sinv = EntryPtr(p.sinv, e * s.sinv_stride);
  p.sinv_t = EntryPtr(p.sinv_t, e * s.sinv_t_stride);
  return p;
}

// One launch over a stack of E tensors (blockIdx.z = entry), each tile
// quantized exactly as QuantizeTileKernel quantizes it in its own tensor:
// entry strides are M*K elements, so every 16- and 8-byte access that is
// aligned in entry 0 is aligned in every entry. Its own instances: the 2-D
// kernels above keep their code and registers.
template <typename InT, ScaleMode kMode, bool kCols>
__global__ void __launch_bounds__(kThreads, MinBlocks<InT>())
    QuantizeStackKernel(QuantizeArgs p, StackArgs s) {
  QuantizeTile<InT, kMode, kCols>(AtEntry<InT>(p, s, blockIdx.z));
}

// max(|x|) over a flat array: 16-byte loads, 4 in flight per thread.
// kStack: x is (gridDim.y, n) and block row blockIdx.y reduces entry
// blockIdx.y into out[blockIdx.y] (LaunchAmaxStack).
template <typename InT, bool kStack = false>
__global__ void __launch_bounds__(512) AmaxKernel(const InT* __restrict__ x, int64_t n,
                                                  unsigned* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(InT);
  constexpr int kUnroll = 4;
  unsigned m = 0;
  if constexpr (kStack) {
    x += static_cast<int64_t>(blockIdx.y) * n;
    out += blockIdx.y;
    // An entry starts 16-byte aligned only when n * sizeof(InT) is a
    // multiple of 16: its elements before the first 16-byte boundary are
    // read one by one, the vector loop below starts at that boundary.
    const int64_t skew = static_cast<int64_t>(
        (16 - reinterpret_cast<uintptr_t>(x) % 16) % 16 / sizeof(InT));
    const int64_t head = skew < n ? skew : n;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < head;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x)
      m = max(m, AbsBits(ToFloat(x[j])));
    x += head;
    n -= head;
  }
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

template <typename InT, ScaleMode kMode>
cudaError_t LaunchTyped(const QuantizeArgs& a, cudaStream_t stream) {
  const dim3 grid = TileGrid(a);
  if (a.data_t != nullptr) {
    QuantizeTileKernel<InT, kMode, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    QuantizeTileKernel<InT, kMode, false><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename InT>
cudaError_t LaunchMode(const QuantizeArgs& a, cudaStream_t stream) {
  switch (a.mode) {
    case ScaleMode::kTensor: return LaunchTyped<InT, ScaleMode::kTensor>(a, stream);
    case ScaleMode::kVec128: return LaunchTyped<InT, ScaleMode::kVec128>(a, stream);
    case ScaleMode::kBlock128: return LaunchTyped<InT, ScaleMode::kBlock128>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename InT, ScaleMode kMode>
cudaError_t LaunchStackTyped(const QuantizeArgs& a, const StackArgs& s, cudaStream_t stream) {
  dim3 grid = TileGrid(a);
  grid.z = static_cast<unsigned>(s.E);
  if (a.data_t != nullptr) {
    QuantizeStackKernel<InT, kMode, true><<<grid, kThreads, 0, stream>>>(a, s);
  } else {
    QuantizeStackKernel<InT, kMode, false><<<grid, kThreads, 0, stream>>>(a, s);
  }
  return cudaGetLastError();
}

template <typename InT>
cudaError_t LaunchStackMode(const QuantizeArgs& a, const StackArgs& s, cudaStream_t stream) {
  switch (a.mode) {
    case ScaleMode::kTensor: return LaunchStackTyped<InT, ScaleMode::kTensor>(a, s, stream);
    case ScaleMode::kVec128: return LaunchStackTyped<InT, ScaleMode::kVec128>(a, s, stream);
    case ScaleMode::kBlock128: return LaunchStackTyped<InT, ScaleMode::kBlock128>(a, s, stream);
  }
  return cudaErrorInvalidValue;
}

// Blocks of 512 threads for an amax pass over `entries` tensors of n
// elements each: enough to fill the GPU (4 per SM) together, no more (each
// block ends with one atomic), and none idle on a small tensor.
unsigned AmaxBlocks(int64_t n, int64_t entries) {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int64_t want = (n / 8 + 511) / 512 + 1;
  const int64_t fill = (4 * static_cast<int64_t>(sms) + entries - 1) / entries;
  return static_cast<unsigned>(want < fill ? want : fill);
}

}  // namespace

cudaError_t LaunchQuantize(const QuantizeArgs& a, cudaStream_t stream, const PrologueArgs& q) {
  if (a.M <= 0 || a.K <= 0) return cudaSuccess;
  if (!GridValid(a)) return cudaErrorInvalidConfiguration;
  if (a.mode == ScaleMode::kTensor && a.amax_out != nullptr) {
    cudaError_t e = cudaMemsetAsync(a.amax_out, 0, sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  if (q.kind != Prologue::kNone) return LaunchActQuantize(a, q, stream);
  switch (a.in) {
    case InType::kF32: return LaunchMode<float>(a, stream);
    case InType::kBF16: return LaunchMode<__nv_bfloat16>(a, stream);
    case InType::kF16: return LaunchMode<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAmax(const void* x, int64_t n, InType in, float* amax_out,
                       cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(amax_out, 0, sizeof(float), stream);
  if (e != cudaSuccess || n <= 0) return e;
  const unsigned blocks = AmaxBlocks(n, 1);
  unsigned* out = reinterpret_cast<unsigned*>(amax_out);
  switch (in) {
    case InType::kF32: AmaxKernel<float><<<blocks, 512, 0, stream>>>(static_cast<const float*>(x), n, out); break;
    case InType::kBF16: AmaxKernel<__nv_bfloat16><<<blocks, 512, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), n, out); break;
    case InType::kF16: AmaxKernel<__half><<<blocks, 512, 0, stream>>>(static_cast<const __half*>(x), n, out); break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeStack(const QuantizeArgs& a, const StackArgs& s, cudaStream_t stream) {
  if (s.E <= 0) return cudaSuccess;
  if (s.E > kMaxStackEntries || !GridValid(a)) return cudaErrorInvalidConfiguration;
  if (a.mode == ScaleMode::kTensor && a.amax_out != nullptr) {
    cudaError_t e = cudaMemsetAsync(a.amax_out, 0, s.E * sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  if (a.M <= 0 || a.K <= 0) return cudaSuccess;
  switch (a.in) {
    case InType::kF32: return LaunchStackMode<float>(a, s, stream);
    case InType::kBF16: return LaunchStackMode<__nv_bfloat16>(a, s, stream);
    case InType::kF16: return LaunchStackMode<__half>(a, s, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAmaxStack(const void* x, int64_t n, int64_t E, InType in, float* amax_out,
                            cudaStream_t stream) {
  if (E <= 0) return cudaSuccess;
  if (E > kMaxStackEntries) return cudaErrorInvalidConfiguration;
  cudaError_t e = cudaMemsetAsync(amax_out, 0, E * sizeof(float), stream);
  if (e != cudaSuccess || n <= 0) return e;
  const dim3 grid(AmaxBlocks(n, E), static_cast<unsigned>(E));
  unsigned* out = reinterpret_cast<unsigned*>(amax_out);
  switch (in) {
    case InType::kF32: AmaxKernel<float, true><<<grid, 512, 0, stream>>>(static_cast<const float*>(x), n, out); break;
    case InType::kBF16: AmaxKernel<__nv_bfloat16, true><<<grid, 512, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), n, out); break;
    case InType::kF16: AmaxKernel<__half, true><<<grid, 512, 0, stream>>>(static_cast<const __half*>(x), n, out); break;
  }
  return cudaGetLastError();
}

}  // namespace te_jax
