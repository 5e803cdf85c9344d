// Activation functions and their derivatives in float32, for the fused
// "activation + FP8 quantize" prologue of kernels/act_quantize.cu.
//
// These mirror te_jax/ops/act_quantize.py (`_act_fwd_bwd`) operation for
// operation. Every multiply/add is an explicit __f*_rn intrinsic so that nvcc
// cannot contract it into an FMA: the result then differs from the JAX
// reference only where the math library differs (expf, expm1f, erfcf vs
// XLA's own approximations, a few float32 ulps), not by how the formula was
// associated. No tanhf and no 1 - sigmoid by subtraction: near +-1 those turn
// ulp differences between implementations into large relative errors.
#pragma once

#include <cuda_runtime.h>

#include "kernels/quantize.h"  // ActId

namespace te_jax {

namespace act_detail {

__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }

// 1 / d, correctly rounded, for d in [1, 2] (d = 1 + e with e = exp(-|x|),
// or NaN): the hardware estimate and one Newton step. Bit-identical to
// __frcp_rn on every float in [1, 2] (checked exhaustively by
// benchmarks/act_math.cu), without __frcp_rn's special-case path for
// subnormal/huge d, a call that kept the loops from being scheduled
// (the timings are in docs/benchmarks-log-2026-11.md).
__device__ __forceinline__ float RcpOnePlus(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, fmaf(-d, r, 1.f), r);
}

// exp(-|x|) in six instructions where expf takes eight (its split into an
// integer and a fraction of a power of 2): t = -|x| log2(e) rounded, 2^t by
// the hardware ex2 (MUFU.EX2), and the part of -|x| that the rounding of t
// dropped, r = -|x| - t ln2 (two FMAs, ln 2 in a high and a low part),
// added back as 2^t (1 + r). Within 3 ulps of double exp on [-87, 0]
// (benchmarks/act_math.cu checks it). |x| is capped at 128 first (NaN kept), so that
// x = +-inf gives 0 and not inf - inf. Where exp(-|x|) is below 2^-126
// (|x| > 87.3) the result is 0, where expf returns a subnormal: ex2 without
// flush-to-zero costs three more instructions, and such values become FP8
// zeros unless their whole 1x128 tile or tensor is below ~1e-30.
__device__ __forceinline__ float ExpNegAbs(float x) {
  constexpr float kLog2e = 1.44269502f;
  constexpr float kLn2Hi = 0.693145752f;  // 0x3f317200: ln 2 = kLn2Hi + kLn2Lo
  constexpr float kLn2Lo = 1.42860677e-06f;
  float m;
  asm("min.NaN.f32 %0, %1, 0f43000000;" : "=f"(m) : "f"(fabsf(x)));  // min(|x|, 128)
  const float a = -m;
  const float t = Mul(a, kLog2e);
  const float r = fmaf(-t, kLn2Lo, fmaf(-t, kLn2Hi, a));
  float p;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(p) : "f"(t));
  return fmaf(p, r, p);
}

// (sigmoid(x), 1 - sigmoid(x)) from e = exp(-|x|): 1/(1+e) and e/(1+e).
// Never 1 - s by subtraction: near s = 1 that loses all relative accuracy,
// and the derivatives multiply by the complement (see act_quantize.py).
__device__ __forceinline__ void SigmoidPair(float x, float* s, float* s_c) {
  const float e = ExpNegAbs(x);
  const float r = RcpOnePlus(Add(1.f, e));  // == 1 / (1 + e), IEEE
  const float er = Mul(e, r);
  const bool pos = x >= 0.f;  // false for NaN, as jnp.where(x >= 0, ...)
  *s = pos ? r : er;
  *s_c = pos ? er : r;
}

}  // namespace act_detail

// f = act(x) and df = act'(x). Callers use one or both; the unused one is
// removed after inlining. Constants are the float32 roundings of the values
// written in act_quantize.py.
__device__ __forceinline__ void Activate(int id, float x, float* f, float* df) {
  using namespace act_detail;
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kGeluC = 0.044715f;
  constexpr float kGeluC3 = 0.134145f;          // 3 * 0.044715
  constexpr float kSqrtHalf = 0.7071067811865476f;
  constexpr float kInvSqrt2Pi = 0.3989422804014327f;
  constexpr float kQuick = 1.702f;
  switch (id) {
    case kActGelu: {  // 0.5 (1 + tanh u) = sigmoid(2u)
      const float x2 = Mul(x, x);
      // 2u in one rounding: round(2c * t) == 2 * round(c * t) for every t
      // (scaling by 2 is exact; where c * t would be subnormal, 2u is far
      // too small to move exp(-|2u|) from 1, and both overflow together).
      const float two_u = Mul(2.f * kSqrt2OverPi, Add(x, Mul(kGeluC, Mul(x2, x))));
      float cdf, cdf_c;
      SigmoidPair(two_u, &cdf, &cdf_c);
      *f = Mul(x, cdf);
      // d/dx: cdf + x * 0.5 (1 - tanh(u)^2) u'(x), with
      // 0.5 (1 - tanh(u)^2) = 2 sigmoid(2u) (1 - sigmoid(2u)).
      const float du = Mul(kSqrt2OverPi, Add(1.f, Mul(kGeluC3, x2)));
      *df = Add(cdf, Mul(Mul(x, Mul(2.f, Mul(cdf, cdf_c))), du));
      return;
    }
    case kActGeluExact: {
      const float cdf = Mul(0.5f, erfcf(Mul(-x, kSqrtHalf)));
      *f = Mul(x, cdf);
      const float pdf = Mul(expf(Mul(Mul(x, x), -0.5f)), kInvSqrt2Pi);
      *df = Add(cdf, Mul(x, pdf));
      return;
    }
    case kActRelu:
      *f = x < 0.f ? 0.f : x;  // NaN stays NaN (as jnp.where(x < 0, 0, x))
      *df = x > 0.f ? 1.f : 0.f;
      return;
    case kActSilu: {
      float s, s_c;
      SigmoidPair(x, &s, &s_c);
      *f = Mul(x, s);
      *df = Mul(s, Add(1.f, Mul(x, s_c)));
      return;
    }
    case kActSigmoid: {
      float s, s_c;
      SigmoidPair(x, &s, &s_c);
      *f = s;
      *df = Mul(s, s_c);
      return;
    }
    case kActTanh: {  // (1 - e) / (1 + e), e = exp(-2|x|), 1 - e by expm1
      const float a = Mul(2.f, fabsf(x));
      const float e = expf(-a);
      const float r = RcpOnePlus(Add(1.f, e));  // == 1 / (1 + e), IEEE
      const float t = Mul(-expm1f(-a), r);
      *f = x < 0.f ? -t : t;
      *df = Mul(4.f, Mul(e, Mul(r, r)));
      return;
    }
    case kActQuickGelu: {
      const float a = Mul(kQuick, x);
      float s, s_c;
      SigmoidPair(a, &s, &s_c);
      *f = Mul(x, s);
      *df = Mul(s, Add(1.f, Mul(a, s_c)));
      return;
    }
    default:  // kActLinear (ids are validated on the host)
      *f = x;
      *df = 1.f;
      return;
  }
}

}  // namespace te_jax
