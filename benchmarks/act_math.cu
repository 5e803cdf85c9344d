// What bounds the fused activation kernels: an amax-only pass over gelu(h)
// (the first pass of current scaling, kernels/quantize.cu TileAmaxKernel)
// over a 16384 x 16384 bf16 h, timed in variants that change one thing at a
// time:
//   real_tile<L>  the te_jax prologue (prologue::ComputeRows) with its gelu
//                 loop (L = gelu) or the runtime-switch loop (L = any);
//   tile<M>       the same 8x8-per-thread tiling written plainly, gelu math M;
//   flat<M>       a grid-stride loop over 16-byte vectors, gelu math M;
// with M one of
//   identity      no activation: the memory-bound floor;
//   ship          te_jax::Activate (expf, __frcp_rn, no FMA contraction);
//   fast_rcp      as ship with 1/(1+e) by the approximate reciprocal;
//   fast_exp      as ship with __expf;
//   fast          both, and FMA contraction allowed.
// Build (flags as the te_jax module) and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -prec-div=true -ftz=false -Icustom_calls -o /tmp/act_math benchmarks/act_math.cu
//   /tmp/act_math
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/activation.h"
#include "kernels/prologue.h"

namespace {

using te_jax::prologue::kSub;
constexpr int kThreads = 256, kTile = 128;
constexpr long kM = 16384, kF = 16384;

#define CHECK_CUDA(x)                                                    \
  do {                                                                   \
    cudaError_t e_ = (x);                                                \
    if (e_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

__device__ __forceinline__ unsigned AbsBits(float v) { return __float_as_uint(fabsf(v)); }

struct Identity {
  __device__ float operator()(float x) const { return x; }
};
struct Ship {
  __device__ float operator()(float x) const {
    float f, df;
    te_jax::Activate(te_jax::kActGelu, x, &f, &df);
    return f;
  }
};
// gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), as activation.h.
template <bool kFastExp, bool kFastRcp, bool kContract>
struct Variant {
  __device__ float operator()(float x) const {
    float u, e;
    if (kContract) {
      u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    } else {
      u = __fmul_rn(0.7978845608028654f, __fadd_rn(x, __fmul_rn(0.044715f, __fmul_rn(__fmul_rn(x, x), x))));
    }
    const float a = -fabsf(2.f * u);
    e = kFastExp ? __expf(a) : expf(a);
    const float den = 1.f + e;
    const float r = kFastRcp ? __fdividef(1.f, den) : __frcp_rn(den);
    const float er = kContract ? e * r : __fmul_rn(e, r);
    return kContract ? x * (u >= 0.f ? r : er) : __fmul_rn(x, u >= 0.f ? r : er);
  }
};
using FastRcp = Variant<false, true, false>;
using FastExp = Variant<true, false, false>;
using Fast = Variant<true, true, true>;

__device__ void BlockMaxAtomic(unsigned v, unsigned* out) {
  __shared__ unsigned red[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) v = max(v, red[w]);
    atomicMax(out, v);
  }
}

template <te_jax::prologue::ActLoop kLoop>
__global__ void __launch_bounds__(kThreads) RealTile(te_jax::PrologueArgs q, unsigned* out) {
  unsigned amax = 0;
  const int t = threadIdx.x;
  te_jax::prologue::ComputeRows<__nv_bfloat16, te_jax::Prologue::kAct, kLoop>(
      q, kM, static_cast<int64_t>(blockIdx.y) * kTile + (t / 16) * kSub,
      static_cast<int64_t>(blockIdx.x) * kTile + (t % 16) * kSub,
      [&](int, const float (&y)[kSub]) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) amax = max(amax, AbsBits(y[j]));
      });
  BlockMaxAtomic(amax, out);
}

template <typename Math>
__global__ void __launch_bounds__(kThreads) Tile(const __nv_bfloat16* h, unsigned* out) {
  const int t = threadIdx.x;
  const long row = static_cast<long>(blockIdx.y) * kTile + (t / 16) * kSub;
  const long col = static_cast<long>(blockIdx.x) * kTile + (t % 16) * kSub;
  unsigned amax = 0;
  const Math math;
#pragma unroll 2
  for (int i = 0; i < kSub; ++i) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(h + (row + i) * kF + col));
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int j = 0; j < kSub; ++j) amax = max(amax, AbsBits(math(__bfloat162float(e[j]))));
  }
  BlockMaxAtomic(amax, out);
}

template <typename Math>
__global__ void __launch_bounds__(kThreads) Flat(const __nv_bfloat16* h, unsigned* out) {
  const long n = kM * kF / 8;
  const long stride = static_cast<long>(gridDim.x) * kThreads;
  unsigned amax = 0;
  const Math math;
  for (long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(h) + i);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = max(amax, AbsBits(math(__bfloat162float(e[j]))));
  }
  BlockMaxAtomic(amax, out);
}

// h = 3 * (approximately normal) from a hash: sum of 4 uniforms, centred.
__global__ void Fill(__nv_bfloat16* h, long n) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u + 12345u;
    float s = 0.f;
    for (int k = 0; k < 4; ++k) {
      x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
      s += (x & 0xFFFFFF) / 16777216.f;
    }
    h[i] = __float2bfloat16(3.f * 1.7320508f * (s - 2.f));
  }
}

template <typename Launch>
void Time(const char* name, Launch launch, unsigned* d_out) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) launch();
  CHECK_CUDA(cudaMemset(d_out, 0, sizeof(unsigned)));
  const int reps = 20;
  CHECK_CUDA(cudaEventRecord(e0));
  for (int r = 0; r < reps; ++r) launch();
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  CHECK_CUDA(cudaGetLastError());
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  unsigned bits = 0;
  CHECK_CUDA(cudaMemcpy(&bits, d_out, sizeof(bits), cudaMemcpyDeviceToHost));
  float amax;
  memcpy(&amax, &bits, sizeof(amax));
  std::printf("%-20s %7.3f ms  %5.2f TB/s  amax %.9g\n", name, ms / reps,
              kM * kF * 2 / (ms / reps * 1e-3) * 1e-12, amax);
}

}  // namespace

int main() {
  __nv_bfloat16* h;
  unsigned* out;
  CHECK_CUDA(cudaMalloc(&h, kM * kF * 2));
  CHECK_CUDA(cudaMalloc(&out, sizeof(unsigned)));
  Fill<<<4096, 256>>>(h, kM * kF);
  CHECK_CUDA(cudaDeviceSynchronize());
  te_jax::PrologueArgs q;
  q.kind = te_jax::Prologue::kAct;
  q.h = h;
  q.F = kF;
  q.act0 = te_jax::kActGelu;
  const dim3 tiles(kF / kTile, kM / kTile);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int flat_blocks = sms * 8;
  using te_jax::prologue::ActLoop;
  Time("real_tile<gelu>", [&] { RealTile<ActLoop::kGelu><<<tiles, kThreads>>>(q, out); }, out);
  Time("real_tile<any>", [&] { RealTile<ActLoop::kAny><<<tiles, kThreads>>>(q, out); }, out);
  Time("tile<identity>", [&] { Tile<Identity><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<ship>", [&] { Tile<Ship><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast_rcp>", [&] { Tile<FastRcp><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast_exp>", [&] { Tile<FastExp><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast>", [&] { Tile<Fast><<<tiles, kThreads>>>(h, out); }, out);
  Time("flat<identity>", [&] { Flat<Identity><<<flat_blocks, kThreads>>>(h, out); }, out);
  Time("flat<ship>", [&] { Flat<Ship><<<flat_blocks, kThreads>>>(h, out); }, out);
  Time("flat<fast>", [&] { Flat<Fast><<<flat_blocks, kThreads>>>(h, out); }, out);
  return 0;
}
