// What bounds the fused activation kernels, on a 16384 x 16384 bf16 h (and
// dz): first the shipped kernels of kernels/act_quantize*.cu (included below)
// for gelu (amax pass, per-tensor and 1x128 quantize, forward and backward);
// then an amax-only pass over gelu(h) (the first pass of current scaling)
// in variants that change one thing at a time:
//   tile<M>       the same 8x8-per-thread tiling written plainly, gelu math M;
//   flat<M>       a grid-stride loop over 16-byte vectors, gelu math M;
// with M one of
//   identity      no activation: the memory-bound floor;
//   ship          te_jax::Activate as shipped (ExpNegAbs, RcpOnePlus, no
//                 FMA contraction; it used __frcp_rn until the Gelu
//                 variants below showed the cost, expf until 2026-12-01);
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

// The kernels themselves (one translation unit: they live in an anonymous
// namespace there).
#include "kernels/act_quantize.cu"
#include "kernels/act_quantize_blockwise.cu"
#include "kernels/act_quantize_tensor.cu"
#include "check_cuda.h"

namespace {

using te_jax::prologue::kSub;
constexpr int kThreads = 256, kTile = 128;
constexpr long kM = 16384, kF = 16384;

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
// Considered for activation.h: RcpOnePlus(d) for d in [1, 2]: the hardware
// reciprocal estimate and one Newton step with FMA, no special cases (d is
// never 0, subnormal, huge or infinite there); checked against __frcp_rn on
// every float in [1, 2] below. ExpNonPos(a) for a <= 0: ex2.approx of the
// rounded a*log2(e), corrected by the rounding residual (exact by FMA) so the
// error stays a few ulps at a = -80 (plain __expf's grows with |a|).
__device__ __forceinline__ float RcpOnePlus(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.f), r);
}
__device__ __forceinline__ float ExpNonPos(float a) {
  constexpr float kLog2e = 1.44269502f, kLog2eLo = 1.925963e-8f, kLn2 = 0.693147182f;
  const float t = a * kLog2e;
  const float c = fmaf(a, kLog2e, -t) + a * kLog2eLo;
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(t));
  return fmaf(r, c * kLn2, r);
}
// gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), as
// activation.h, with a choice of exp and reciprocal; kContract lets nvcc
// form FMAs (plain operators) where the rest rounds every operation.
enum class Exp { kExpf, kFast, kNonPos };   // expf, __expf, ExpNonPos
enum class Rcp { kIeee, kApprox, kNewton };  // __frcp_rn, __fdividef, RcpOnePlus
template <Exp kExp, Rcp kRcp, bool kContract = false>
struct Gelu {
  __device__ float operator()(float x) const {
    const float u = kContract ? 0.7978845608028654f * (x + 0.044715f * (x * x * x))
                              : __fmul_rn(0.7978845608028654f,
                                          __fadd_rn(x, __fmul_rn(0.044715f, __fmul_rn(__fmul_rn(x, x), x))));
    const float a = -fabsf(2.f * u);
    const float e = kExp == Exp::kExpf ? expf(a) : kExp == Exp::kFast ? __expf(a) : ExpNonPos(a);
    const float den = 1.f + e;
    const float r = kRcp == Rcp::kIeee     ? __frcp_rn(den)
                    : kRcp == Rcp::kApprox ? __fdividef(1.f, den)
                                           : RcpOnePlus(den);
    const float er = kContract ? e * r : __fmul_rn(e, r);
    return kContract ? x * (u >= 0.f ? r : er) : __fmul_rn(x, u >= 0.f ? r : er);
  }
};
using FastRcp = Gelu<Exp::kExpf, Rcp::kApprox>;
using FastExp = Gelu<Exp::kFast, Rcp::kIeee>;
using Fast = Gelu<Exp::kFast, Rcp::kApprox, true>;

// Every float d in [1, 2]: RcpOnePlus(d) != __frcp_rn(d) counted.
__global__ void CheckRcp(unsigned* mismatches) {
  const unsigned n = 1u << 23;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i <= n; i += gridDim.x * blockDim.x) {
    const float d = __uint_as_float(0x3F800000u + i);  // 1 .. 2 inclusive
    if (__float_as_uint(RcpOnePlus(d)) != __float_as_uint(__frcp_rn(d))) atomicAdd(mismatches, 1u);
  }
}

// Max error in ulps of expf, __expf and ExpNonPos against double exp over
// 2^24 points of [-104, 0] (exp underflows below); out[0..2]. out[3]: the
// shipped te_jax::act_detail::ExpNegAbs on [-87, 0], where exp is a normal
// float (below, it returns 0 by design: activation.h).
__global__ void CheckExp(unsigned* out) {
  const unsigned n = 1u << 24;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float a = -104.f * (i / static_cast<float>(n));
    const double want = exp(static_cast<double>(a));
    const float got[4] = {expf(a), __expf(a), ExpNonPos(a), te_jax::act_detail::ExpNegAbs(a)};
    for (int k = 0; k < 4; ++k) {
      if (k == 3 && a < -87.f) continue;
      const double ulp = want < 1.17549435e-38 ? 1.40129846e-45
                                                : ldexp(1.0, ilogb(want) - 23);
      const unsigned err = static_cast<unsigned>(fmin(fabs(got[k] - want) / ulp * 100.0, 4e9));
      atomicMax(out + k, err);  // in hundredths of an ulp
    }
  }
}

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
  te_jax::PrologueArgs qd = q;  // backward: dz * gelu'(h)
  qd.kind = te_jax::Prologue::kDAct;
  __nv_bfloat16* dz;
  CHECK_CUDA(cudaMalloc(&dz, kM * kF * 2));
  Fill<<<4096, 256>>>(dz, kM * kF);
  qd.dz = dz;
  const dim3 tiles(kF / kTile, kM / kTile);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int flat_blocks = sms * 8;

  // The shipped kernels, gelu, both row loops (M = F = 16384, bf16 in).
  te_jax::QuantizeArgs a;
  a.M = kM;
  a.K = kF;
  float* scalars;  // scale 1, amax out
  CHECK_CUDA(cudaMalloc(&scalars, 2 * sizeof(float)));
  const float one = 1.f;
  CHECK_CUDA(cudaMemcpy(scalars, &one, sizeof(one), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&a.data, kM * kF));
  CHECK_CUDA(cudaMalloc(&a.data_t, kM * kF));
  CHECK_CUDA(cudaMalloc(&a.sinv, kM * (kF / 128) * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&a.sinv_t, kM * (kF / 128) * sizeof(float)));
  a.sinv_ld = kM;
  a.sinv_t_ld = kF;
  a.scale = scalars;
  a.amax_out = scalars + 1;
  te_jax::QuantizeArgs ad = a;
  ad.out = te_jax::Fp8Type::kE5M2;
  te_jax::QuantizeArgs av = a, avd = ad;
  av.mode = avd.mode = te_jax::ScaleMode::kVec128;
  av.scale = avd.scale = nullptr;
  av.amax_out = avd.amax_out = nullptr;
  using te_jax::Prologue;
  using te_jax::prologue::ActLoop;
  using Bf = __nv_bfloat16;
  constexpr ActLoop G = ActLoop::kGelu;
  unsigned* amax_bits = reinterpret_cast<unsigned*>(scalars + 1);
#define TIME_KERNEL(name, kernel, smem, args, pro) \
  Time(name, [&] { kernel<<<tiles, 256, smem>>>(args, pro); }, amax_bits)
  TIME_KERNEL("amax fwd", (te_jax::TileAmaxKernel<Bf, Prologue::kAct, G>), 0, a, q);
  TIME_KERNEL("amax bwd", (te_jax::TileAmaxKernel<Bf, Prologue::kDAct, G>), 0, ad, qd);
  TIME_KERNEL("tensor fwd", (te_jax::ActQuantizeTensorKernel<Bf, Prologue::kAct, G>), 0, a, q);
  TIME_KERNEL("tensor bwd", (te_jax::ActQuantizeTensorKernel<Bf, Prologue::kDAct, G>), 0, ad, qd);
  auto vec = [&](auto kernel) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    te_jax::kScratchBytes));
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));  // as LaunchWithLoop
    int blocks = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads,
                                                             te_jax::kScratchBytes));
    std::printf("1x128 kernel: %d blocks per SM\n", blocks);
    return kernel;
  };
  auto vf = vec(te_jax::ActQuantizeVec128Kernel<Bf, Prologue::kAct, G>);
  auto vb = vec(te_jax::ActQuantizeVec128Kernel<Bf, Prologue::kDAct, G>);
  TIME_KERNEL("1x128 fwd", vf, te_jax::kScratchBytes, av, q);
  TIME_KERNEL("1x128 bwd", vb, te_jax::kScratchBytes, avd, qd);
#undef TIME_KERNEL

  Time("tile<identity>", [&] { Tile<Identity><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<ship>", [&] { Tile<Ship><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast_rcp>", [&] { Tile<FastRcp><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast_exp>", [&] { Tile<FastExp><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<fast>", [&] { Tile<Fast><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<expf,newton>", [&] { Tile<Gelu<Exp::kExpf, Rcp::kNewton>><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<ex2c,frcp_rn>", [&] { Tile<Gelu<Exp::kNonPos, Rcp::kIeee>><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<ex2c,newton>", [&] { Tile<Gelu<Exp::kNonPos, Rcp::kNewton>><<<tiles, kThreads>>>(h, out); }, out);
  Time("tile<__expf,newton>", [&] { Tile<Gelu<Exp::kFast, Rcp::kNewton>><<<tiles, kThreads>>>(h, out); }, out);
  Time("flat<identity>", [&] { Flat<Identity><<<flat_blocks, kThreads>>>(h, out); }, out);
  Time("flat<ship>", [&] { Flat<Ship><<<flat_blocks, kThreads>>>(h, out); }, out);
  Time("flat<fast>", [&] { Flat<Fast><<<flat_blocks, kThreads>>>(h, out); }, out);
  unsigned* counts;
  CHECK_CUDA(cudaMalloc(&counts, 5 * sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(counts, 0, 5 * sizeof(unsigned)));
  CheckRcp<<<1024, 256>>>(counts);
  CheckExp<<<1024, 256>>>(counts + 1);
  unsigned c[5];
  CHECK_CUDA(cudaMemcpy(c, counts, sizeof(c), cudaMemcpyDeviceToHost));
  std::printf("RcpOnePlus vs __frcp_rn on all of [1, 2]: %u mismatches\n", c[0]);
  std::printf("max error vs double exp on [-104, 0], ulps: expf %.2f  __expf %.2f  ExpNonPos %.2f\n",
              c[1] / 100.0, c[2] / 100.0, c[3] / 100.0);
  std::printf("max error vs double exp on [-87, 0], ulps: ExpNegAbs (shipped) %.2f\n", c[4] / 100.0);
  return 0;
}
