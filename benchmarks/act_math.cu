// What bounds the fused activation kernels. First the shipped kernels of
// kernels/act_quantize*.cu (included below), through their public launchers
// as the FFI calls them, per tensor and 1x128, forward (z rowwise) and
// backward (dh both ways and act(h)'s columnwise copy): gelu on a 16384 x
// 16384 bf16 h, and the Llama preset's SwiGLU MLP (32768 x 2 x 5632), whose
// 1x128 backward is issue 43's largest te_jax kernel (small enough for
// Nsight Compute: tools/gpu_kernels.sh act). Then, on the gelu h, an
// amax-only pass over gelu(h) (the first pass of current scaling)
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
//        -prec-div=true -ftz=false -Icustom_calls -Ibenchmarks -o /tmp/act_math \
//        benchmarks/act_math.cu
//   /tmp/act_math            (or: OUT=... bash tools/gpu_kernels.sh act)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// The kernels themselves (one translation unit: they live in an anonymous
// namespace there).
#include "kernels/act_quantize.cu"
#include "kernels/act_quantize_blockwise.cu"
#include "kernels/act_quantize_tensor.cu"
#include "kernels/act_quantize.h"
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
void Time(const char* name, Launch launch, unsigned* d_out, double bytes = kM * kF * 2.0) {
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
  std::printf("%-28s %7.3f ms  %5.2f TB/s  amax %.9g\n", name, ms / reps,
              bytes / (ms / reps * 1e-3) * 1e-12, amax);
}

// The shipped activation-quantize kernels through their public launchers
// (kernels/act_quantize.h, as the FFI calls them), on an (m, n_act * f) bf16
// h and (m, f) dz: the forward (z = act(h) rowwise, the fused MLP's memory
// plan) and the backward (dh both ways plus act(h)'s columnwise copy for the
// wgrad of wo), per tensor (a given scale: delayed scaling) and 1x128
// (blockwise). TB/s counts the bytes each pass must move once.
struct ActCase {
  const char* name;
  long m, f;
  int act0, act1;  // act1 < 0: not gated
};

void TimeShipped(const ActCase& c, unsigned* amax_bits) {
  using te_jax::Prologue;
  using te_jax::QuantizeArgs;
  using te_jax::ScaleMode;
  const long n_act = c.act1 >= 0 ? 2 : 1, w = n_act * c.f, m4 = (c.m + 3) / 4 * 4;
  __nv_bfloat16 *h, *dz;
  uint8_t *z, *z_t, *dh, *dh_t;
  float *sinv, *sinv_t, *zs_t, *scalars;
  CHECK_CUDA(cudaMalloc(&h, c.m * w * 2));
  CHECK_CUDA(cudaMalloc(&dz, c.m * c.f * 2));
  CHECK_CUDA(cudaMalloc(&z, c.m * c.f));
  CHECK_CUDA(cudaMalloc(&z_t, c.m * c.f));
  CHECK_CUDA(cudaMalloc(&dh, c.m * w));
  CHECK_CUDA(cudaMalloc(&dh_t, c.m * w));
  CHECK_CUDA(cudaMalloc(&sinv, (w + 127) / 128 * m4 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&sinv_t, (c.m + 127) / 128 * ((w + 3) / 4 * 4) * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&zs_t, (c.m + 127) / 128 * ((c.f + 3) / 4 * 4) * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&scalars, 4 * sizeof(float)));  // scale 1 (x2), amax out (x2)
  const float one[2] = {1.f, 1.f};
  CHECK_CUDA(cudaMemcpy(scalars, one, sizeof(one), cudaMemcpyHostToDevice));
  Fill<<<4096, 256>>>(h, c.m * w);
  Fill<<<4096, 256>>>(dz, c.m * c.f);
  CHECK_CUDA(cudaDeviceSynchronize());

  te_jax::PrologueArgs fwd;
  fwd.kind = Prologue::kAct;
  fwd.h = h;
  fwd.F = c.f;
  fwd.act0 = c.act0;
  fwd.act1 = c.act1;
  te_jax::PrologueArgs bwd = fwd;
  bwd.kind = Prologue::kDAct;
  bwd.dz = dz;
  const double fwd_bytes = c.m * w * 2.0 + c.m * c.f;               // h in, z out
  const double bwd_bytes = c.m * (w + c.f) * 2.0 + 2.0 * c.m * w + c.m * c.f;  // h, dz in; dh x2, z.T out
  for (ScaleMode mode : {ScaleMode::kTensor, ScaleMode::kVec128}) {
    const bool vec = mode == ScaleMode::kVec128;
    QuantizeArgs zf;  // forward: z rowwise
    zf.M = c.m;
    zf.K = c.f;
    zf.mode = mode;
    zf.data = z;
    QuantizeArgs df;  // backward: dh rowwise + columnwise (E5M2)
    df.M = c.m;
    df.K = w;
    df.mode = mode;
    df.out = te_jax::Fp8Type::kE5M2;
    df.data = dh;
    df.data_t = dh_t;
    QuantizeArgs zt;  // backward: act(h) columnwise
    zt.M = c.m;
    zt.K = c.f;
    zt.mode = mode;
    zt.data_t = z_t;
    if (vec) {
      zf.sinv = sinv;
      zf.sinv_ld = m4;
      df.sinv = sinv;
      df.sinv_ld = m4;
      df.sinv_t = sinv_t;
      df.sinv_t_ld = (w + 3) / 4 * 4;
      zt.sinv_t = zs_t;
      zt.sinv_t_ld = (c.f + 3) / 4 * 4;
      zf.pow2 = df.pow2 = zt.pow2 = true;
    } else {
      zf.scale = df.scale = zt.scale = scalars;
      zf.amax_out = df.amax_out = scalars + 2;
    }
    char name[96];
    std::snprintf(name, sizeof(name), "%s %s fwd", c.name, vec ? "1x128" : "tensor");
    Time(name, [&] { CHECK_CUDA(te_jax::LaunchPrologueQuantize(zf, fwd, nullptr, 0)); },
         amax_bits, fwd_bytes);
    std::snprintf(name, sizeof(name), "%s %s bwd", c.name, vec ? "1x128" : "tensor");
    Time(name, [&] { CHECK_CUDA(te_jax::LaunchPrologueQuantize(df, bwd, &zt, 0)); },
         amax_bits, bwd_bytes);
  }
  for (void* p : {static_cast<void*>(h), static_cast<void*>(dz), static_cast<void*>(z),
                  static_cast<void*>(z_t), static_cast<void*>(dh), static_cast<void*>(dh_t),
                  static_cast<void*>(sinv), static_cast<void*>(sinv_t), static_cast<void*>(zs_t),
                  static_cast<void*>(scalars)})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main() {
  __nv_bfloat16* h;
  unsigned* out;
  CHECK_CUDA(cudaMalloc(&h, kM * kF * 2));
  CHECK_CUDA(cudaMalloc(&out, sizeof(unsigned)));
  Fill<<<4096, 256>>>(h, kM * kF);
  CHECK_CUDA(cudaDeviceSynchronize());
  const dim3 tiles(kF / kTile, kM / kTile);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int flat_blocks = sms * 8;

  // The shipped kernels: gelu at 16384 x 16384, and the Llama preset's
  // SwiGLU MLP (32768 tokens, width 5632), whose 1x128 backward is issue
  // 43's largest te_jax kernel (bench_ops.py --only act times the same).
  TimeShipped({"gelu 16k x 16k", kM, kF, te_jax::kActGelu, -1}, out);
  TimeShipped({"swiglu 32k x 2x5632", 32768, 5632, te_jax::kActSilu, te_jax::kActLinear}, out);

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
