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
//   te_jax_norm_backward:            dy, x, gamma, mean, rstd -> dx, dgamma,
//                                    dbeta, partial (scratch, discarded)
//   te_jax_norm_stats:               x -> mean, rstd (the statistics pass
//                                    alone: the forward of the norm without
//                                    FP8, whose output XLA writes from them)
//
// Forward operands: x (M, H) f32/bf16/f16; gamma (H,) f32; beta (H,) f32 or
// a (0,) placeholder (no beta). Attributes: rmsnorm (0: layernorm, 1:
// rmsnorm, whose mean result is a (0,) placeholder), zero_centered_gamma
// (0/1: the scale is 1 + gamma), epsilon (float32), and power_2_scale (0/1)
// for current and blockwise. The columnwise copy is always written; the FP8
// format is read off the element type of `data`.
//
// Every handler here is declared command-buffer compatible (XLA may record
// it in a CUDA graph by stream capture and replay it): it allocates nothing
// (the backward's partial sums are a result the Python wrapper asks for and
// discards), never queries or syncs the stream, and only sets kernel
// attributes and launches kernels and memsets on XLA's stream into the
// buffers XLA passes.
#include <cmath>

#include "ffi/quantize_common.h"
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
// prologue and the statistics pass.
ffi::Error Setup(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& gamma,
                 const ffi::Buffer<ffi::F32>& beta, const ffi::AnyBuffer& data,
                 const ffi::AnyBuffer& data_t, ffi::Buffer<ffi::F32>& mean,
                 ffi::Buffer<ffi::F32>& rstd, int64_t rmsnorm, int64_t zero_centered,
                 float epsilon, QuantizeArgs* a, PrologueArgs* q, NormStatsArgs* s) {
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
  if (!IsVector(mean, rmsnorm ? 0 : M)) return Bad("mean must be (M,) for layernorm, (0,) for rmsnorm");
  if (!IsVector(rstd, M)) return Bad("rstd must be (M,)");
  a->M = M;
  a->K = H;
  if (auto e = GetOutType(data.element_type(), &a->out); e.failure()) return e;
  if (!HasDims(data, M, H)) return Bad("data must be (M, H)");
  if (!HasDims(data_t, H, M) || data_t.element_type() != data.element_type())
    return Bad("data_t must be (H, M) of data's dtype");
  a->data = static_cast<uint8_t*>(data.untyped_data());
  a->data_t = static_cast<uint8_t*>(data_t.untyped_data());

  float* mean_ptr = rmsnorm ? nullptr : mean.typed_data();
  const float* beta_ptr = has_beta ? beta.typed_data() : nullptr;
  q->kind = Prologue::kNorm;
  q->h = x.untyped_data();
  q->F = H;
  q->mean = mean_ptr;
  q->rstd = rstd.typed_data();
  q->gamma = gamma.typed_data();
  q->beta = beta_ptr;
  q->zero_centered = static_cast<int>(zero_centered);

  s->x = x.untyped_data();
  s->M = M;
  s->H = H;
  s->in = a->in;
  s->epsilon = epsilon;
  s->mean = mean_ptr;
  s->rstd = rstd.typed_data();
  s->gamma = gamma.typed_data();
  s->beta = beta_ptr;
  s->zero_centered = static_cast<int>(zero_centered);
  return ffi::Error::Success();
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                          ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax,
                          ffi::Result<ffi::Buffer<ffi::F32>> mean,
                          ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                          int64_t zero_centered, float epsilon) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  if (auto e = Setup(x, gamma, beta, *data, *data_t, *mean, *rstd, rmsnorm, zero_centered,
                     epsilon, &a, &q, &s);
      e.failure())
    return e;
  if (scale.element_count() != 1) return Bad("scale must be a float32 scalar");
  if (auto e = CudaError(LaunchNormStats(s, stream), "norm_quantize_tensorwise (statistics)");
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.amax_out = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchQuantize(a, stream, q), "norm_quantize_tensorwise (cast)");
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                       ffi::Buffer<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> data,
                       ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax,
                       ffi::Result<ffi::Buffer<ffi::F32>> mean,
                       ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                       int64_t zero_centered, float epsilon, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  if (auto e = Setup(x, gamma, beta, *data, *data_t, *mean, *rstd, rmsnorm, zero_centered,
                     epsilon, &a, &q, &s);
      e.failure())
    return e;
  if (auto e = CheckFlag(power_2_scale, "power_2_scale"); e.failure()) return e;
  // Pass 1: statistics and max|v| (a third pass over each row, from L1/L2);
  // pass 2 derives the scale from it on the device and casts.
  s.amax_out = amax->typed_data();
  if (auto e = CudaError(LaunchNormStats(s, stream), "norm_quantize_current (statistics)");
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  a.pow2 = power_2_scale != 0;
  return CudaError(LaunchQuantize(a, stream, q), "norm_quantize_current (cast)");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma,
                         ffi::Buffer<ffi::F32> beta, ffi::Result<ffi::AnyBuffer> data,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> mean,
                         ffi::Result<ffi::Buffer<ffi::F32>> rstd, int64_t rmsnorm,
                         int64_t zero_centered, float epsilon, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  NormStatsArgs s;
  if (auto e = Setup(x, gamma, beta, *data, *data_t, *mean, *rstd, rmsnorm, zero_centered,
                     epsilon, &a, &q, &s);
      e.failure())
    return e;
  if (auto e = CheckFlag(power_2_scale, "power_2_scale"); e.failure()) return e;
  a.mode = ScaleMode::kVec128;
  a.pow2 = power_2_scale != 0;
  if (auto e = SetVec128Scales(*sinv, *sinv_t, &a, "te_jax normalization"); e.failure()) return e;
  if (auto e = CudaError(LaunchNormStats(s, stream), "norm_quantize_blockwise (statistics)");
      e.failure())
    return e;
  return CudaError(LaunchQuantize(a, stream, q), "norm_quantize_blockwise (cast)");
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

ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
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
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) fp8
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()       // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()       // amax () = max|v|
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,)
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
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) fp8
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()       // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()       // amax () = max|v|
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,)
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
                                  .Ret<ffi::AnyBuffer>()              // data (M, H) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()       // sinv, native layout
                                  .Ret<ffi::AnyBuffer>()              // data_t (H, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()       // sinv_t, native layout
                                  .Ret<ffi::Buffer<ffi::F32>>()       // mean (M,) or (0,)
                                  .Ret<ffi::Buffer<ffi::F32>>()       // rstd (M,)
                                  .Attr<int64_t>("rmsnorm")           // 0/1
                                  .Attr<int64_t>("zero_centered_gamma")  // 0/1
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("power_2_scale"),    // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxNormBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // dy (M, H)
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
