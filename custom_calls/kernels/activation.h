// Activation functions and their derivatives in float32, for the fused
// "activation + FP8 quantize" prologue of kernels/quantize.cu.
//
// These mirror te_jax/ops/act_quantize.py (`_act_fwd_bwd`) operation for
// operation. Every multiply/add is an explicit __f*_rn intrinsic so that nvcc
// cannot contract it into an FMA: the result then differs from the JAX
// reference only where the math library differs (tanhf, expf, erfcf vs XLA's
// own approximations, a few float32 ulps), not by how the formula was
// associated.
#pragma once

#include <cuda_runtime.h>

#include "kernels/quantize.h"  // ActId

namespace te_jax {

namespace act_detail {

__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }

// 1 / (1 + exp(-x)): exp overflows to inf for x < -88, giving exactly 0.
__device__ __forceinline__ float Sigmoid(float x) {
  return __fdiv_rn(1.f, Add(1.f, expf(-x)));
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
    case kActGelu: {
      const float x2 = Mul(x, x);
      const float u = Mul(kSqrt2OverPi, Add(x, Mul(kGeluC, Mul(x2, x))));
      const float t = tanhf(u);
      const float cdf = Mul(0.5f, Add(1.f, t));
      *f = Mul(x, cdf);
      // d/dx: cdf + x * 0.5 (1 - t^2) u'(x); (1 - t)(1 + t) keeps 1 - t^2
      // accurate where t is near +-1.
      const float du = Mul(kSqrt2OverPi, Add(1.f, Mul(kGeluC3, x2)));
      *df = Add(cdf, Mul(Mul(x, Mul(0.5f, Mul(Sub(1.f, t), Add(1.f, t)))), du));
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
      const float s = Sigmoid(x);
      *f = Mul(x, s);
      *df = Mul(s, Add(1.f, Mul(x, Sub(1.f, s))));
      return;
    }
    case kActSigmoid: {
      const float s = Sigmoid(x);
      *f = s;
      *df = Mul(s, Sub(1.f, s));
      return;
    }
    case kActTanh: {
      const float t = tanhf(x);
      *f = t;
      *df = Mul(Sub(1.f, t), Add(1.f, t));
      return;
    }
    case kActQuickGelu: {
      const float a = Mul(kQuick, x);
      const float s = Sigmoid(a);
      *f = Mul(x, s);
      *df = Mul(s, Add(1.f, Mul(a, Sub(1.f, s))));
      return;
    }
    default:  // kActLinear (ids are validated on the host)
      *f = x;
      *df = 1.f;
      return;
  }
}

}  // namespace te_jax
