// What bounds the fused activation kernels. First the shipped kernels of
// kernels/act_quantize*.cu (included below), through their public launchers
// as the FFI calls them, per tensor and 1x128, forward (z rowwise) and
// backward (dh both ways and act(h)'s columnwise copy): gelu on a 16384 x
// 16384 bf16 h, and the Llama preset's SwiGLU MLP (32768 x 2 x 5632), whose
// 1x128 backward is issue 43's largest te_jax kernel (small enough for
// Nsight Compute: tools/gpu_kernels.sh act ncu). The 1x128 backward
// (DActQuantizeVec128Kernel, kernels/act_quantize_blockwise_bwd.cu) also
// with h as its E4M3 copy (store_act_input_in_fp8, the training
// configuration), and for gelu also at 2 blocks per SM beside the shipped 3
// (its launch bound, DActMinBlocks). Then checks of the 1x128 backward,
// byte for byte against shipped kernels that keep float32 values (exit
// status 1 on any difference): act(h)'s columnwise copy against the 1x128
// forward's columnwise z, and, for ("relu", "linear"), whose dh is exact
// float32 products, dh's two copies against the 1x128 quantize of that dh
// (the concatenation prologue with one part), on edges, wide exponents,
// pow2 off and tiny dz (the backward's exact path), and an Inf in h. Then,
// on the gelu h, an amax-only pass over gelu(h) (the first pass of current
// scaling) in variants that change one thing at a time:
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
//
// Build (flags as the te_jax module) and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -prec-div=true -ftz=false -Icustom_calls -Ibenchmarks -o /tmp/act_math \
//        benchmarks/act_math.cu
//   /tmp/act_math            (or: OUT=... bash tools/gpu_kernels.sh act)
//   /tmp/act_math --profile  (each kernel of the timed shapes launched once,
//                             no checks: for Nsight Compute)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

// The kernels themselves (one translation unit: they live in an anonymous
// namespace there).
#include "kernels/act_quantize.cu"
#include "kernels/act_quantize_blockwise.cu"
#include "kernels/act_quantize_blockwise_bwd.cu"
#include "kernels/act_quantize_tensor.cu"
#include "kernels/act_quantize.h"
#include "check_cuda.h"

namespace {

using te_jax::prologue::kSub;
constexpr int kThreads = 256, kTile = 128;
int g_failures = 0;      // byte checks that failed: main's exit status
bool g_profile = false;  // --profile: one launch per kernel, no checks (Nsight Compute)
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

// h = scale * (approximately normal) from a hash: sum of 4 uniforms, centred;
// with spread > 0 each value also times 2^-e, e from the hash in [0, spread)
// (exponents down to bf16's subnormals: the backward's checks).
__global__ void Fill(__nv_bfloat16* h, long n, float scale = 3.f, int spread = 0) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u + 12345u;
    float s = 0.f;
    for (int k = 0; k < 4; ++k) {
      x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
      s += (x & 0xFFFFFF) / 16777216.f;
    }
    float v = scale * 1.7320508f * (s - 2.f);
    if (spread > 0) v = ldexpf(v, -static_cast<int>((x >> 24) % static_cast<unsigned>(spread)));
    h[i] = __float2bfloat16(v);
  }
}

template <typename Launch>
void Time(const char* name, Launch launch, unsigned* d_out, double bytes = kM * kF * 2.0) {
  if (g_profile) {  // one launch, for Nsight Compute (tools/gpu_kernels.sh act ncu)
    launch();
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("%-36s launched once (--profile)\n", name);
    return;
  }
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
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  unsigned bits = 0;
  CHECK_CUDA(cudaMemcpy(&bits, d_out, sizeof(bits), cudaMemcpyDeviceToHost));
  float amax;
  memcpy(&amax, &bits, sizeof(amax));
  std::printf("%-36s %7.3f ms  %5.2f TB/s  amax %.9g\n", name, ms / reps,
              bytes / (ms / reps * 1e-3) * 1e-12, amax);
}

// The shipped activation-quantize kernels through their public launchers
// (kernels/act_quantize.h, as the FFI calls them), on an (m, n_act * f) bf16
// h and (m, f) dz: the forward (z = act(h) rowwise, the fused MLP's memory
// plan) and the backward (dh both ways plus act(h)'s columnwise copy for the
// wgrad of wo), per tensor (a given scale: delayed scaling) and 1x128
// (blockwise, power-of-2 scales as Float8BlockScaling's default). TB/s counts
// the bytes each pass must move once.
struct ActCase {
  const char* name;
  long m, f;
  int act0, act1;  // act1 < 0: not gated
  long width() const { return (act1 >= 0 ? 2 : 1) * f; }
  // ("relu", "linear"): dh and act(h) are exact products (ReluLinearDh).
  bool exact() const { return act0 == te_jax::kActRelu && act1 == te_jax::kActLinear; }
};

// The outputs of one pass: z rowwise (forward), dh both ways and act(h)'s
// columnwise copy (backward), the 1x128 scales in their native layouts.
struct Outputs {
  uint8_t *z = nullptr, *dh = nullptr, *dh_t = nullptr, *z_t = nullptr;
  float *sinv = nullptr, *sinv_t = nullptr, *zs_t = nullptr;
  size_t n_dh = 0, n_z = 0, n_sinv = 0, n_sinv_t = 0, n_zs_t = 0;
  long m4 = 0, w4 = 0, f4 = 0;  // scale row pitches

  explicit Outputs(const ActCase& c) {
    const long w = c.width(), mt = (c.m + 127) / 128;
    m4 = (c.m + 3) / 4 * 4;
    w4 = (w + 3) / 4 * 4;
    f4 = (c.f + 3) / 4 * 4;
    n_dh = c.m * w;
    n_z = c.m * c.f;
    n_sinv = (w + 127) / 128 * m4;
    n_sinv_t = mt * w4;
    n_zs_t = mt * f4;
    CHECK_CUDA(cudaMalloc(&z, n_z));
    CHECK_CUDA(cudaMalloc(&z_t, n_z));
    CHECK_CUDA(cudaMalloc(&dh, n_dh));
    CHECK_CUDA(cudaMalloc(&dh_t, n_dh));
    CHECK_CUDA(cudaMalloc(&sinv, n_sinv * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&sinv_t, n_sinv_t * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&zs_t, n_zs_t * sizeof(float)));
  }
  ~Outputs() {
    for (void* p : {static_cast<void*>(z), static_cast<void*>(z_t), static_cast<void*>(dh),
                    static_cast<void*>(dh_t), static_cast<void*>(sinv),
                    static_cast<void*>(sinv_t), static_cast<void*>(zs_t)})
      CHECK_CUDA(cudaFree(p));
  }
  // The same byte in every backward output, so that a byte one kernel
  // writes and the other leaves alone shows as a difference.
  void Poison() const {
    CHECK_CUDA(cudaMemset(dh, 0xA5, n_dh));
    CHECK_CUDA(cudaMemset(dh_t, 0xA5, n_dh));
    CHECK_CUDA(cudaMemset(z_t, 0xA5, n_z));
    CHECK_CUDA(cudaMemset(sinv, 0xA5, n_sinv * sizeof(float)));
    CHECK_CUDA(cudaMemset(sinv_t, 0xA5, n_sinv_t * sizeof(float)));
    CHECK_CUDA(cudaMemset(zs_t, 0xA5, n_zs_t * sizeof(float)));
  }
};

// The backward's QuantizeArgs: dh (rowwise + columnwise, E5M2) into df,
// act(h)'s columnwise copy (E4M3) into zt. scalars: the per-tensor scales.
void BwdArgs(const ActCase& c, te_jax::ScaleMode mode, bool pow2, const Outputs& o,
             float* scalars, te_jax::QuantizeArgs* df, te_jax::QuantizeArgs* zt) {
  *df = te_jax::QuantizeArgs();
  df->M = c.m;
  df->K = c.width();
  df->mode = mode;
  df->out = te_jax::Fp8Type::kE5M2;
  df->data = o.dh;
  df->data_t = o.dh_t;
  *zt = te_jax::QuantizeArgs();
  zt->M = c.m;
  zt->K = c.f;
  zt->mode = mode;
  zt->data_t = o.z_t;
  if (mode == te_jax::ScaleMode::kVec128) {
    df->sinv = o.sinv;
    df->sinv_ld = o.m4;
    df->sinv_t = o.sinv_t;
    df->sinv_t_ld = o.w4;
    zt->sinv_t = o.zs_t;
    zt->sinv_t_ld = o.f4;
    df->pow2 = zt->pow2 = pow2;
  } else {
    df->scale = zt->scale = scalars;
    df->amax_out = scalars + 2;
  }
}

// Bytes where a and b (n bytes each, on the device) differ: out[0] the
// count, out[1] the first index (both preset by the caller).
__global__ void CountDiff(const uint8_t* a, const uint8_t* b, size_t n,
                          unsigned long long* out) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) {
      atomicAdd(out, 1ull);
      atomicMin(out + 1, static_cast<unsigned long long>(i));
    }
}

bool SameBytes(const char* what, const void* got, const void* want, size_t n) {
  unsigned long long* d;
  CHECK_CUDA(cudaMalloc(&d, 2 * sizeof(unsigned long long)));
  const unsigned long long init[2] = {0ull, ~0ull};
  CHECK_CUDA(cudaMemcpy(d, init, sizeof(init), cudaMemcpyHostToDevice));
  CountDiff<<<2048, 256>>>(static_cast<const uint8_t*>(got), static_cast<const uint8_t*>(want),
                           n, d);
  unsigned long long r[2];
  CHECK_CUDA(cudaMemcpy(r, d, sizeof(r), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(d));
  if (r[0] != 0) {
    uint8_t x = 0, y = 0;
    CHECK_CUDA(cudaMemcpy(&x, static_cast<const uint8_t*>(got) + r[1], 1, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&y, static_cast<const uint8_t*>(want) + r[1], 1, cudaMemcpyDeviceToHost));
    std::printf("    %-7s %llu of %zu bytes differ, first at byte %llu: backward 0x%02x reference 0x%02x\n",
                what, r[0], n, r[1], x, y);
  }
  return r[0] == 0;
}

te_jax::PrologueArgs ActArgs(const ActCase& c, te_jax::Prologue kind, const void* h,
                             const void* dz) {
  te_jax::PrologueArgs q;
  q.kind = kind;
  q.h = h;
  q.dz = dz;
  q.F = c.f;
  q.act0 = c.act0;
  q.act1 = c.act1;
  return q;
}

// An E4M3 h (m, w) with its 1x128 tile scales (Fp8HInput, rows of
// scale_ld): bytes from a hash (no NaN), scales 2^0 .. 2^-7.
__global__ void FillFp8(uint8_t* h, float* scale, long m, long w, long scale_ld) {
  const long stride = static_cast<long>(gridDim.x) * blockDim.x;
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * w; i += stride) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u + 777u;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    const unsigned b = x & 0xFFu;
    h[i] = static_cast<uint8_t>((b & 0x7Fu) == 0x7Fu ? b ^ 1u : b);  // 0x7F, 0xFF: NaN
  }
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * scale_ld;
       i += stride)
    scale[i] = ldexpf(1.f, -static_cast<int>((static_cast<unsigned>(i) * 2654435761u >> 7) % 8u));
}

void TimeShipped(const ActCase& c, unsigned* amax_bits) {
  using te_jax::Prologue;
  using te_jax::QuantizeArgs;
  using te_jax::ScaleMode;
  const long w = c.width();
  __nv_bfloat16 *h, *dz;
  float* scalars;
  CHECK_CUDA(cudaMalloc(&h, c.m * w * 2));
  CHECK_CUDA(cudaMalloc(&dz, c.m * c.f * 2));
  CHECK_CUDA(cudaMalloc(&scalars, 4 * sizeof(float)));  // scale 1 (x2), amax out (x2)
  const float one[2] = {1.f, 1.f};
  CHECK_CUDA(cudaMemcpy(scalars, one, sizeof(one), cudaMemcpyHostToDevice));
  Fill<<<4096, 256>>>(h, c.m * w);
  Fill<<<4096, 256>>>(dz, c.m * c.f);
  CHECK_CUDA(cudaDeviceSynchronize());
  const Outputs out(c);

  const te_jax::PrologueArgs fwd = ActArgs(c, Prologue::kAct, h, nullptr);
  const te_jax::PrologueArgs bwd = ActArgs(c, Prologue::kDAct, h, dz);
  const double fwd_bytes = c.m * w * 2.0 + c.m * c.f;               // h in, z out
  const double out_bytes = 2.0 * c.m * w + c.m * c.f;               // dh x2, z.T out
  const double bwd_bytes = c.m * (w + c.f) * 2.0 + out_bytes;       // h, dz in
  // The Llama step's forward with keep_fp8_copies and
  // store_act_input_in_fp8: z both ways and h's E4M3 copy from one launch
  // (Fp8HOutput; needs F % 128 == 0).
  const long sld = (w + 127) / 128;
  const bool h_copy = c.f % 128 == 0;
  uint8_t* h8_out = nullptr;
  float* h8_out_scale = nullptr;
  if (h_copy) {
    CHECK_CUDA(cudaMalloc(&h8_out, c.m * w));
    CHECK_CUDA(cudaMalloc(&h8_out_scale, c.m * sld * sizeof(float)));
  }
  te_jax::Fp8HOutput ho;
  ho.data = h8_out;
  ho.scale_inv = h8_out_scale;
  ho.scale_ld = sld;
  const double fwd_all_bytes = c.m * w * 2.0 + 2.0 * c.m * c.f + c.m * w + c.m * sld * 4.0;
  char name[96];
  for (ScaleMode mode : {ScaleMode::kTensor, ScaleMode::kVec128}) {
    const bool vec = mode == ScaleMode::kVec128;
    QuantizeArgs df, zt;
    BwdArgs(c, mode, true, out, scalars, &df, &zt);
    QuantizeArgs zf;  // forward: z rowwise
    zf.M = c.m;
    zf.K = c.f;
    zf.mode = mode;
    zf.data = out.z;
    if (vec) {
      zf.sinv = out.sinv;
      zf.sinv_ld = out.m4;
      zf.pow2 = true;
    } else {
      zf.scale = scalars;
      zf.amax_out = scalars + 2;
    }
    std::snprintf(name, sizeof(name), "%s %s fwd", c.name, vec ? "1x128" : "tensor");
    Time(name, [&] { CHECK_CUDA(te_jax::LaunchPrologueQuantize(zf, fwd, nullptr, 0)); },
         amax_bits, fwd_bytes);
    if (h_copy) {
      QuantizeArgs zs = zf;  // + z's columnwise copy
      zs.data_t = out.z_t;
      if (vec) {
        zs.sinv_t = out.zs_t;
        zs.sinv_t_ld = out.f4;
      }
      std::snprintf(name, sizeof(name), "%s %s fwd z, z.T, h e4m3", c.name,
                    vec ? "1x128" : "tensor");
      Time(name, [&] {
        CHECK_CUDA(te_jax::LaunchPrologueQuantize(zs, fwd, nullptr, 0, nullptr, &ho));
      }, amax_bits, fwd_all_bytes);
      if (vec) {  // the same 1x128 kernel at 2 and 3 blocks per SM
        using te_jax::prologue::ActLoop;
        constexpr int kAll = te_jax::kOutBoth | te_jax::kOutH;
        const bool gelu = c.act1 < 0;
        auto at = [&](auto blocks) {
          constexpr int kBlocks = decltype(blocks)::value;
          std::snprintf(name, sizeof(name), "%s 1x128 fwd z, z.T, h e4m3 %d blocks/SM", c.name,
                        kBlocks);
          Time(name, [&] {
            CHECK_CUDA(gelu ? (te_jax::LaunchActKernel<__nv_bfloat16, Prologue::kAct,
                                                       ActLoop::kGelu, kAll, kBlocks>(zs, fwd, ho, 0))
                            : (te_jax::LaunchActKernel<__nv_bfloat16, Prologue::kAct,
                                                       ActLoop::kSwiGlu, kAll, kBlocks>(zs, fwd, ho, 0)));
          }, amax_bits, fwd_all_bytes);
        };
        at(std::integral_constant<int, 2>{});
        at(std::integral_constant<int, 3>{});
      }
    }
    std::snprintf(name, sizeof(name), "%s %s bwd", c.name, vec ? "1x128" : "tensor");
    Time(name, [&] { CHECK_CUDA(te_jax::LaunchPrologueQuantize(df, bwd, &zt, 0)); },
         amax_bits, bwd_bytes);
  }
  // The 1x128 backward with h as its E4M3 copy (h bytes and their tile
  // scales read instead of a bf16 h), and for gelu both backwards at 2
  // blocks per SM (DActMinBlocks gives gelu 3).
  uint8_t* h8;
  float* h8_scale;
  CHECK_CUDA(cudaMalloc(&h8, c.m * w));
  CHECK_CUDA(cudaMalloc(&h8_scale, c.m * sld * sizeof(float)));
  FillFp8<<<4096, 256>>>(h8, h8_scale, c.m, w, sld);
  CHECK_CUDA(cudaDeviceSynchronize());
  te_jax::Fp8HInput hs;
  hs.scale = h8_scale;
  hs.scale_ld = sld;
  const te_jax::PrologueArgs bwd8 = ActArgs(c, Prologue::kDAct, h8, dz);
  const double bwd8_bytes = c.m * w * 1.0 + c.m * sld * 4.0 + c.m * c.f * 2.0 + out_bytes;
  QuantizeArgs df, zt;
  BwdArgs(c, ScaleMode::kVec128, true, out, nullptr, &df, &zt);
  std::snprintf(name, sizeof(name), "%s 1x128 bwd e4m3 h", c.name);
  Time(name, [&] { CHECK_CUDA(te_jax::LaunchPrologueQuantize(df, bwd8, &zt, 0, &hs)); },
       amax_bits, bwd8_bytes);
  if (c.act1 < 0) {  // gelu
    using te_jax::prologue::ActLoop;
    std::snprintf(name, sizeof(name), "%s 1x128 bwd 2 blocks/SM", c.name);
    Time(name, [&] {
      CHECK_CUDA((te_jax::LaunchDActKernel<__nv_bfloat16, ActLoop::kGelu, false, true, false, 2>(
          df, bwd, zt, te_jax::Fp8HInput(), 0)));
    }, amax_bits, bwd_bytes);
    std::snprintf(name, sizeof(name), "%s 1x128 bwd e4m3 h 2 blocks/SM", c.name);
    Time(name, [&] {
      CHECK_CUDA((te_jax::LaunchDActKernel<__nv_bfloat16, ActLoop::kGelu, true, true, false, 2>(
          df, bwd8, zt, hs, 0)));
    }, amax_bits, bwd8_bytes);
  }
  for (void* p : {static_cast<void*>(h), static_cast<void*>(dz), static_cast<void*>(scalars),
                  static_cast<void*>(h8), static_cast<void*>(h8_scale),
                  static_cast<void*>(h8_out), static_cast<void*>(h8_out_scale)})
    CHECK_CUDA(cudaFree(p));
}

// dh of ("relu", "linear") on an (m, 2f) h, as the backward's row loop
// computes it (prologue.h ActRows: (dz * relu'(h0)) * h1 | (dz * relu(h0))
// * 1, each product rounded once): products of bf16 values, so every
// correct kernel gets these float32 values, with up to 16 significant bits
// (the parked values' rounding to odd is exercised).
__global__ void ReluLinearDh(const __nv_bfloat16* h, const __nv_bfloat16* dz, float* dh, long m,
                             long f) {
  for (long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * 2 * f;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = i / (2 * f), c = i % (2 * f), sc = c < f ? c : c - f;
    const float h0 = __bfloat162float(h[r * 2 * f + sc]);
    const float h1 = __bfloat162float(h[r * 2 * f + f + sc]);
    const float d = __bfloat162float(dz[r * f + sc]);
    const float f0 = h0 < 0.f ? 0.f : h0, d0 = h0 > 0.f ? 1.f : 0.f;
    dh[i] = c < f ? __fmul_rn(__fmul_rn(d, d0), h1) : __fmul_rn(__fmul_rn(d, f0), 1.f);
  }
}

// Checks only (not timed): the shipped 1x128 backward on the shapes and
// inputs of `c` against shipped kernels that keep float32 values until the
// column scales are known: act(h)'s columnwise copy (E4M3) against the 1x128
// forward's columnwise z of the same h, and, for ("relu", "linear"), dh's
// rowwise and columnwise copies (E5M2) against the 1x128 quantize of
// ReluLinearDh (the concatenation prologue with one float32 part). Every
// byte, scales included (whole buffers). h and dz spread over exponents 2^0
// .. 2^-(spread-1) (parked values that are float32 subnormals or land on FP8
// subnormals); pow2 off and a tiny dz (column scales above 2^100) take the
// backward's exact path, and so does an Inf in h (`inf`: NaN scales).
void CheckBwd(const char* label, const ActCase& c, bool pow2, float dz_scale, int spread = 0,
              bool inf = false) {
  using te_jax::Prologue;
  const long w = c.width();
  __nv_bfloat16 *h, *dz;
  CHECK_CUDA(cudaMalloc(&h, c.m * w * 2));
  CHECK_CUDA(cudaMalloc(&dz, c.m * c.f * 2));
  Fill<<<1024, 256>>>(h, c.m * w, 3.f, spread);
  Fill<<<1024, 256>>>(dz, c.m * c.f, 3.f * dz_scale, spread);
  if (inf) {  // h0 at (m / 2, 3)
    const __nv_bfloat16 v = __float2bfloat16(INFINITY);
    CHECK_CUDA(cudaMemcpy(h + (c.m / 2) * w + 3, &v, sizeof(v), cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const Outputs got(c), want(c);
  got.Poison();
  want.Poison();
  te_jax::QuantizeArgs df, zt;
  BwdArgs(c, te_jax::ScaleMode::kVec128, pow2, got, nullptr, &df, &zt);
  CHECK_CUDA(te_jax::LaunchPrologueQuantize(df, ActArgs(c, Prologue::kDAct, h, dz), &zt, 0));
  te_jax::QuantizeArgs zf;  // the forward's columnwise z
  zf.M = c.m;
  zf.K = c.f;
  zf.mode = te_jax::ScaleMode::kVec128;
  zf.out = zt.out;
  zf.pow2 = pow2;
  zf.data_t = want.z_t;
  zf.sinv_t = want.zs_t;
  zf.sinv_t_ld = want.f4;
  CHECK_CUDA(te_jax::LaunchPrologueQuantize(zf, ActArgs(c, Prologue::kAct, h, nullptr), nullptr, 0));
  float* dh32 = nullptr;
  if (c.exact()) {
    CHECK_CUDA(cudaMalloc(&dh32, c.m * w * sizeof(float)));
    ReluLinearDh<<<1024, 256>>>(h, dz, dh32, c.m, c.f);
    te_jax::QuantizeArgs qa, unused;
    BwdArgs(c, te_jax::ScaleMode::kVec128, pow2, want, nullptr, &qa, &unused);
    qa.in = te_jax::InType::kF32;
    te_jax::PrologueArgs cat;
    cat.kind = Prologue::kConcat;
    cat.parts[0] = dh32;
    cat.n_parts = 1;
    cat.part_end[0] = w;
    CHECK_CUDA(te_jax::LaunchPrologueQuantize(qa, cat, nullptr, 0));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  bool ok = SameBytes("z.T", got.z_t, want.z_t, got.n_z);
  ok = SameBytes("zs_t", got.zs_t, want.zs_t, got.n_zs_t * sizeof(float)) && ok;
  if (c.exact()) {
    ok = SameBytes("dh", got.dh, want.dh, got.n_dh) && ok;
    ok = SameBytes("dh.T", got.dh_t, want.dh_t, got.n_dh) && ok;
    ok = SameBytes("sinv", got.sinv, want.sinv, got.n_sinv * sizeof(float)) && ok;
    ok = SameBytes("sinv_t", got.sinv_t, want.sinv_t, got.n_sinv_t * sizeof(float)) && ok;
    CHECK_CUDA(cudaFree(dh32));
  }
  std::printf("%-48s 1x128 bwd %s bytes: %s\n", label, c.exact() ? "dh, z.T" : "z.T",
              ok ? "PASS" : "FAIL");
  if (!ok) ++g_failures;
  CHECK_CUDA(cudaFree(h));
  CHECK_CUDA(cudaFree(dz));
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--profile") == 0) {
      g_profile = true;
    } else {
      std::fprintf(stderr, "usage: %s [--profile]\n", argv[0]);
      return 2;
    }
  }
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
  if (g_profile) return 0;  // --profile: those launches only
  // The 1x128 backward's bytes: gelu (one block per tile of dh), SwiGLU
  // paired (F % 128 == 0) and not (F = 136: tiles of dh straddle h0 and
  // h1), and ("relu", "linear") both ways, whose dh is checked as well.
  const int gelu = te_jax::kActGelu, silu = te_jax::kActSilu, relu = te_jax::kActRelu,
            lin = te_jax::kActLinear;
  const ActCase gelu_edges{"", 1000, 1000, gelu, -1}, gelu_1k{"", 1024, 1024, gelu, -1};
  const ActCase swiglu_edges{"", 1000, 384, silu, lin}, swiglu_136{"", 1000, 136, silu, lin};
  const ActCase swiglu_1k{"", 1024, 512, silu, lin};
  const ActCase relu_lin_edges{"", 1000, 384, relu, lin}, relu_lin_136{"", 1000, 136, relu, lin};
  const ActCase relu_lin_1k{"", 1024, 512, relu, lin};
  CheckBwd("gelu 1000 x 1000 (edges)", gelu_edges, true, 1.f);
  CheckBwd("swiglu 1000 x 2x384 (paired, edge rows)", swiglu_edges, true, 1.f);
  CheckBwd("swiglu 1000 x 2x136 (unpaired, straddling tiles)", swiglu_136, true, 1.f);
  CheckBwd("relu-linear 1000 x 2x384 (paired, edge rows)", relu_lin_edges, true, 1.f);
  CheckBwd("relu-linear 1000 x 2x136 (unpaired)", relu_lin_136, true, 1.f);
  CheckBwd("gelu 1024 x 1024 wide exponents", gelu_1k, true, 1.f, 140);
  CheckBwd("swiglu 1024 x 2x512 wide exponents", swiglu_1k, true, 1.f, 140);
  CheckBwd("relu-linear 1024 x 2x512 wide exponents", relu_lin_1k, true, 1.f, 140);
  CheckBwd("relu-linear 1000 x 2x136 wide exponents", relu_lin_136, true, 1.f, 140);
  CheckBwd("gelu 1024 x 1024 pow2 off (exact path)", gelu_1k, false, 1.f);
  CheckBwd("swiglu 1024 x 2x512 pow2 off (exact path)", swiglu_1k, false, 1.f);
  CheckBwd("relu-linear 1024 x 2x512 pow2 off (exact path)", relu_lin_1k, false, 1.f);
  CheckBwd("gelu 1024 x 1024 dz*2^-128 (exact path)", gelu_1k, true, 0x1p-128f);
  CheckBwd("swiglu 1024 x 2x512 dz*2^-128 (exact path)", swiglu_1k, true, 0x1p-128f);
  CheckBwd("relu-linear 1024 x 2x512 dz*2^-128 (exact path)", relu_lin_1k, true, 0x1p-128f);
  CheckBwd("swiglu 1024 x 2x512 an Inf in h (exact path)", swiglu_1k, true, 1.f, 0, true);
  CheckBwd("relu-linear 1000 x 2x136 an Inf in h (exact path)", relu_lin_136, true, 1.f, 0, true);

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
  if (g_failures > 0) {
    std::printf("BWD CHECKS FAIL: %d check(s) of the 1x128 backward's bytes differ\n",
                g_failures);
    return 1;
  }
  std::printf("BWD CHECKS PASS: every check of the 1x128 backward's bytes bit-identical\n");
  return 0;
}
