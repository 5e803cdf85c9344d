// XLA FFI handlers of te_jax/ops/normalization.py (Python side:
// normalization_cuda.py): LayerNorm / RMSNorm fused with the FP8 quantize of
// its output v, which is never written in 16 or 32 bits, and the backward.
//
//   te_jax_norm_quantize_tensorwise: given scale -> data, data_t, scale_inv,
//                                    amax, mean, rstd
//   te_jax_norm_quantize_current:    scale from max|v| (computed in the
//                                    statistics pass) -> the same
//   te_jax_norm_quantize_blockwise:  1x128 + 128x1 tiles -> data, sinv, data_t,
//                                    sinv_t (cuBLASLt layouts), mean, rstd
//   te_jax_norm_backward:            dy, dy_add, dx_add, x, gamma, mean, rstd
//                                    -> dx, dgamma, dbeta, partial (scratch,
//                                    discarded); dy_add (M, H) of dy's dtype
//                                    or (0, 0): the cotangent is dy + dy_add;
//                                    dx_add likewise: dx comes back plus it
//   te_jax_norm_stats:               x -> mean, rstd (the statistics pass
//                                    alone: the forward of the norm without
//                                    FP8, whose output XLA writes from them)
//
// Forward operands: x (M, H) f32/bf16/f16; gamma (H,) f32; beta (H,) f32 or
// a (0,) placeholder (no beta); mean_in, rstd_in: the row statistics when
// the caller has them (a forward's, for the backward to quantize norm(x)
// again), else (0,) placeholders. Attributes: rmsnorm (0: layernorm, 1:
// rmsnorm, whose mean is always a (0,) placeholder), zero_centered_gamma
// (0/1: the scale is 1 + gamma), epsilon (float32), and power_2_scale (0/1)
// for current and blockwise. The FP8 format is read off the element type of
// `data` (or `data_t`).
//
// Optional results: a copy that is not wanted comes as a (0, 0) placeholder
// (its scales too), the other one is written (at least one). With given
// statistics the statistics pass is skipped and the mean / rstd results are
// (0,) placeholders. amax: max|v|, or a (0,) placeholder where the caller
// has it (tensorwise: not computed; current: amax_in () given instead, the
// scale derived from it on the device; given statistics need it, as the
// norm's amax comes from its statistics pass).
//
// Every handler here is declared command-buffer compatible (XLA may record
// it in a CUDA graph by stream capture and replay it): it allocates nothing
// (the backward's partial sums are a result the Python wrapper asks for and
// discards), never queries or syncs the stream, and only sets kernel
// attributes and launches kernels and memsets on XLA's stream into the
// buffers XLA passes.
#include <cmath>

#include "ffi/prologue_common.h"
#include "kernels/act_quantize.h"
#include "kernels/normalization.h"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

ffi::Error Bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("te_jax normalization: " + msg);
}

template <typename B>
bool IsVector(const B& b, int64_t n) {
  auto d = b.dimensions();
  return d.size() == 1 && d[0] == n;
}

ffi::Error CheckFlag(int64_t v, const char* name) {
  if (v != 0 && v != 1) return Bad(std::string(name) + " must be 0 or 1");
  return ffi::Error::Success();
}

// Checks the operands and attributes shared by the three forward targets;
// fills the quantize arguments (all but the scale fields), the kNorm
// prologue and the statistics pass; *stats_given: skip that pass.
ffi::Error Setup(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& gamma,
                 const ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& mean_in,
                 ffi::Buffer<ffi::F32>& rstd_in, const ffi::AnyBuffer& data,
                 const ffi::AnyBuffer& data_t, ffi::Buffer<ffi::F32>& mean,
                 ffi::Buffer<ffi::F32>& rstd, int64_t rmsnorm, int64_t zero_centered,
                 float epsilon, QuantizeArgs* a, PrologueArgs* q, NormStatsArgs* s,
                 bool* stats_given) {
  if (auto e = CheckFlag(rmsnorm, "rmsnorm"); e.failure()) return e;
  if (auto e = CheckFlag(zero_centered, "zero_centered_gamma"); e.failure()) return e;
  if (!std::isfinite(epsilon) || epsilon < 0.f) return Bad("epsilon must be finite and >= 0");
  auto xd = x.dimensions();
  if (xd.size() != 2) return Bad("x must be 2-D");
  const int64_t M = xd[0], H = xd[1];
  if (auto e = GetInType(x, &a->in, "x"); e.failure()) return e;
  if (!IsVector(gamma, H)) return Bad("gamma must be float32 (H,)");
  const bool has_beta = beta.element_count() != 0;
  if (has_beta && !IsVector(beta, H)) return Bad("beta must be float32 (H,) or (0,)");
  if (rmsnorm && has_beta) return Bad("rmsnorm takes no beta");
  const bool given = rstd_in.element_count() != 0;
  const int64_t mean_len = rmsnorm ? 0 : M;
  if (given) {
    if (!IsVector(rstd_in, M)) return Bad("rstd_in must be (M,) or (0,)");
    if (!IsVector(mean_in, mean_len)) return Bad("mean_in must be (M,) for layernorm, (0,) for rmsnorm");
    if (!IsVector(mean, 0) || !IsVector(rstd, 0))
      return Bad("mean and rstd must be (0,) with given statistics");
  } else {
    if (!IsVector(mean_in, 0)) return Bad("mean_in must be (0,) without rstd_in");
    if (!IsVector(mean, mean_len)) return Bad("mean must be (M,) for layernorm, (0,) for rmsnorm");
    if (!IsVector(rstd, M)) return Bad("rstd must be (M,)");
  }
  *stats_given = given;
  a->M = M;
  a->K = H;
  bool out_set = false;
  if (auto e = OptionalFp8(data, M, H, &a->data, &a->out, &out_set, "te_jax normalization: data");
      e.failure())
    return e;
  if (auto e = OptionalFp8(data_t, H, M, &a->data_t, &a->out, &out_set,
                           "te_jax normalization: data_t");
      e.failure())
    return e;
  if (!out_set) return Bad("data and data_t are both (0, 0): no copy asked for");

  float* mean_ptr = rmsnorm ? nullptr : (given ? mean_in : mean).typed_data();
  float* rstd_ptr = (given ? rstd_in : rstd).typed_data();
  const float* beta_ptr = has_beta ? beta.typed_data() : nullptr;
  q->kind = Prologue::kNorm;
  q->h = x.untyped_data();
  q->F = H;
  q->mean = mean_ptr;
  q->rstd = rstd_ptr;
  q->gamma = gamma.typed_data();
  q->beta = beta_ptr;
  q->zero_centered = static_cast<int>(zero_centered);

  s->x = x.untyped_data();
  s->M = M;
  s->H = H;
  s->in = a->in;
  s->epsilon = epsilon;
  s->mean = mean_ptr;
  s->rstd = rstd_ptr;
  s->gamma = gamma.typed_data();
  s->beta = beta_ptr;
  s->zero_centered = static_cast<int>(zero_centered);
  return ffi::Error::Success();
}

// The statistics pass unless the statistics were given.
ffi::Error Stats(const NormStatsArgs& s, bool given, cudaStream_t stream, const char* what) {
  if (given) return ffi::Error::Success();
  return CudaError(LaunchNormStats(s, stream), what);
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                          ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::F32> mean_in, ffi::Buffer<ffi::F32> rstd_in,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax,
                          ffi::Result<ffi::Buffer<ffi::F32>> mean,
                          ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                          int64_t zero_centered, float epsilon) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  bool given = false;
  if (auto e = Setup(x, gamma, beta, mean_in, rstd_in, *data, *data_t, *mean, *rstd, rmsnorm,
                     zero_centered, epsilon, &a, &q, &s, &given);
      e.failure())
    return e;
  if (scale.element_count() != 1) return Bad("scale must be a float32 scalar");
  bool bad = false;
  a.amax_out = OptionalF32(*amax, 1, &bad);  // (0,): the caller has the amax already
  if (bad) return Bad("amax must be () or (0,)");
  if (auto e = Stats(s, given, stream, "norm_quantize_tensorwise (statistics)"); e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchPrologueQuantize(a, q, nullptr, stream), "norm_quantize_tensorwise (cast)");
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                       ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> amax_in,
                       ffi::Buffer<ffi::F32> mean_in, ffi::Buffer<ffi::F32> rstd_in,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax,
                       ffi::Result<ffi::Buffer<ffi::F32>> mean,
                       ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                       int64_t zero_centered, float epsilon, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  bool given = false;
  if (auto e = Setup(x, gamma, beta, mean_in, rstd_in, *data, *data_t, *mean, *rstd, rmsnorm,
                     zero_centered, epsilon, &a, &q, &s, &given);
      e.failure())
    return e;
  if (auto e = CheckFlag(power_2_scale, "power_2_scale"); e.failure()) return e;
  bool bad = false;
  const float* amax_given = OptionalF32(amax_in, 1, &bad);
  float* amax_out = OptionalF32(*amax, 1, &bad);
  if (bad || (amax_given == nullptr) == (amax_out == nullptr))
    return Bad("exactly one of amax_in and amax must be () (the other (0,))");
  if (given && amax_given == nullptr)
    return Bad("given statistics need amax_in: the amax comes from the statistics pass");
  // Pass 1: statistics and max|v| (a third pass over each row, from L1/L2);
  // pass 2 derives the scale from it on the device and casts.
  s.amax_out = amax_out;
  if (auto e = Stats(s, given, stream, "norm_quantize_current (statistics)"); e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax_given != nullptr ? amax_given : amax_out;
  a.scale_inv = scale_inv->typed_data();
  a.pow2 = power_2_scale != 0;
  return CudaError(LaunchPrologueQuantize(a, q, nullptr, stream), "norm_quantize_current (cast)");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                         ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> mean_in,
                         ffi::Buffer<ffi::F32> rstd_in, ffi::Result<ffi::AnyBuffer> data,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> mean,
                         ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                         int64_t zero_centered, float epsilon, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  bool given = false;
  if (auto e = Setup(x, gamma, beta, mean_in, rstd_in, *data, *data_t, *mean, *rstd, rmsnorm,
                     zero_centered, epsilon, &a, &q, &s, &given);
      e.failure())
    return e;
  if (auto e = CheckFlag(power_2_scale, "power_2_scale"); e.failure()) return e;
  a.mode = ScaleMode::kVec128;
  a.pow2 = power_2_scale != 0;
  if (auto e = SetOptionalVec128Scales(*sinv, *sinv_t, &a, "te_jax normalization"); e.failure())
    return e;
  if (auto e = Stats(s, given, stream, "norm_quantize_blockwise (statistics)"); e.failure())
    return e;
  return CudaError(LaunchPrologueQuantize(a, q, nullptr, stream), "norm_quantize_blockwise (cast)");
}

ffi::Error StatsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                     ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm, float epsilon) {
  if (auto e = CheckFlag(rmsnorm, "rmsnorm"); e.failure()) return e;
  if (!std::isfinite(epsilon) || epsilon < 0.f) return Bad("epsilon must be finite and >= 0");
  auto xd = x.dimensions();
  if (xd.size() != 2) return Bad("x must be 2-D");
  const int64_t M = xd[0], H = xd[1];
  NormStatsArgs s;
  if (auto e = GetInType(x, &s.in, "x"); e.failure()) return e;
  if (!IsVector(*mean, rmsnorm ? 0 : M)) return Bad("mean must be (M,) for layernorm, (0,) for rmsnorm");
  if (!IsVector(*rstd, M)) return Bad("rstd must be (M,)");
  s.x = x.untyped_data();
  s.M = M;
  s.H = H;
  s.epsilon = epsilon;
  s.mean = rmsnorm ? nullptr : mean->typed_data();
  s.rstd = rstd->typed_data();
  return CudaError(LaunchNormStats(s, stream), "norm_stats");
}

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dy_add,
                        ffi::AnyBuffer dx_add, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> mean,
                        ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::Buffer<ffi::F32>> dgamma,
                        ffi::Result<ffi::Buffer<ffi::F32>> dbeta,
                        ffi::Result<ffi::Buffer<ffi::F32>> partial, int64_t rmsnorm,
                        int64_t zero_centered) {
  if (auto e = CheckFlag(rmsnorm, "rmsnorm"); e.failure()) return e;
  if (auto e = CheckFlag(zero_centered, "zero_centered_gamma"); e.failure()) return e;
  auto xd = x.dimensions();
  if (xd.size() != 2) return Bad("x must be 2-D");
  const int64_t M = xd[0], H = xd[1];
  NormBwdArgs a;
  if (auto e = GetInType(x, &a.in, "x"); e.failure()) return e;
  if (!HasDims(dy, M, H) || dy.element_type() != x.element_type())
    return Bad("dy must be (M, H) of x's dtype");
  const bool has_add = !HasDims(dy_add, 0, 0);
  if (has_add && (!HasDims(dy_add, M, H) || dy_add.element_type() != x.element_type()))
    return Bad("dy_add must be (M, H) of x's dtype, or (0, 0)");
  const bool has_dx_add = !HasDims(dx_add, 0, 0);
  if (has_dx_add && (!HasDims(dx_add, M, H) || dx_add.element_type() != x.element_type()))
    return Bad("dx_add must be (M, H) of x's dtype, or (0, 0)");
  if (!HasDims(*dx, M, H) || dx->element_type() != x.element_type())
    return Bad("dx must be (M, H) of x's dtype");
  if (H > kNormBwdMaxHidden) return Bad("the backward kernel takes H <= 8192");
  if (!IsVector(gamma, H)) return Bad("gamma must be float32 (H,)");
  if (!IsVector(mean, rmsnorm ? 0 : M)) return Bad("mean must be (M,) for layernorm, (0,) for rmsnorm");
  if (!IsVector(rstd, M)) return Bad("rstd must be (M,)");
  if (!IsVector(*dgamma, H)) return Bad("dgamma must be float32 (H,)");
  if (!IsVector(*dbeta, rmsnorm ? 0 : H)) return Bad("dbeta must be (H,) for layernorm, (0,) for rmsnorm");
  auto pd = partial->dimensions();
  if (pd.size() != 3 || pd[0] != (rmsnorm ? 1 : 2) || pd[1] < 1 || pd[1] > 65535 || pd[2] != H)
    return Bad("partial must be (P, blocks, H) with P = 1 (rmsnorm) or 2, 1 <= blocks <= 65535");
  a.dy = dy.untyped_data();
  a.dy_add = has_add ? dy_add.untyped_data() : nullptr;
  a.dx_add = has_dx_add ? dx_add.untyped_data() : nullptr;
  a.x = x.untyped_data();
  a.M = M;
  a.H = H;
  a.gamma = gamma.typed_data();
  a.mean = rmsnorm ? nullptr : mean.typed_data();
  a.rstd = rstd.typed_data();
  a.zero_centered = static_cast<int>(zero_centered);
  a.dx = dx->untyped_data();
  a.dgamma = dgamma->typed_data();
  a.dbeta = rmsnorm ? nullptr : dbeta->typed_data();
  a.partial = partial->typed_data();
  a.blocks = pd[1];
  return CudaError(LaunchNormBackward(a, stream), "norm_backward");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormQuantizeTensorwise, TensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // x (M, H)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // gamma (H,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // beta (H,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // scale ()
                                  .Arg<ffi::Buffer<ffi::F32>>()       // mean_in (M,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // rstd_in (M,) or (0,)
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()       // amax () = max|v|, or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,) or (0,)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<int64_t>("zero_centered_gamma")  // 0/1
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormQuantizeCurrent, CurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // x (M, H)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // gamma (H,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // beta (H,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // amax_in () or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // mean_in (M,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // rstd_in (M,) or (0,)
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()       // amax () = max|v|, or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,) or (0,)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<int64_t>("zero_centered_gamma")  // 0/1
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("power_2_scale"),    // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormQuantizeBlockwise, BlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // x (M, H)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // gamma (H,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // beta (H,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // mean_in (M,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // rstd_in (M,) or (0,)
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // sinv, native, or (0, 0)
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // sinv_t, native, or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,) or (0,)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<int64_t>("zero_centered_gamma")  // 0/1
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("power_2_scale"),    // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // dy (M, H)
                                  .Arg<ffi::AnyBuffer>()              // dy_add (M, H) or (0, 0)
                                  .Arg<ffi::AnyBuffer>()              // dx_add (M, H) or (0, 0)
                                  .Arg<ffi::AnyBuffer>()              // x (M, H), dy's dtype
                                  .Arg<ffi::Buffer<ffi::F32>>()       // gamma (H,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Arg<ffi::Buffer<ffi::F32>>()       // rstd (M,)
                                  .Ret<ffi::AnyBuffer>()              // dx (M, H), x's dtype
                                  .Ret<ffi::Buffer<ffi::F32>>()       // dgamma (H,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // dbeta (H,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // partial (P, blocks, H)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<int64_t>("zero_centered_gamma"),  // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormStats, StatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // x (M, H)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
