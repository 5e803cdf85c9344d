// XLA FFI handlers of te_jax/ops/concat_quantize.py (Python side:
// concat_quantize_cuda.py): the FP8 quantization of v = [p0 | p1 | ...], the
// concatenation of 1 to 4 (M, F_i) parts along their last dim, read from the
// parts themselves, so v is never written. The dense layer with split outputs
// (te_jax.dense.fp8_dense_split: a fused Q/K/V projection) quantizes the
// gradients of its outputs this way.
//
//   te_jax_concat_quantize_tensorwise: given scale -> data, data_t, scale_inv, amax
//   te_jax_concat_quantize_current:    scale from max|v| (a first pass over the
//                                      parts) -> data, data_t, scale_inv, amax
//   te_jax_concat_quantize_blockwise:  1x128 + 128x1 tiles -> data, sinv,
//                                      data_t, sinv_t (scales in cuBLASLt layouts)
//
// The parts are the remaining operands (after the scale, for tensorwise);
// they share M and the element type, and every width F_i % 8 == 0 (a
// thread's 8 columns lie in one part); v is (M, K), K = sum F_i (the widths
// may differ: a grouped-query attention's Q/K/V gradient has a wide Q and
// narrower K and V). The columnwise copy (the quantization of v.T) is always
// written. Same kernels (kernels/act_quantize.cu, Prologue::kConcat) and
// therefore the same tiles, scales and bytes as quantizing v itself.
//
// Every handler here is declared command-buffer compatible (XLA may record it
// in a CUDA graph by stream capture and replay it): it allocates nothing,
// never queries or syncs the stream, and only sets kernel attributes and
// launches kernels and memsets on XLA's stream into the buffers XLA passes.
#include "ffi/quantize_common.h"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

ffi::Error Bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("te_jax concat_quantize: " + msg);
}

// Checks the parts and outputs; fills everything but the scale fields.
ffi::Error Setup(const ffi::RemainingArgs& parts, const ffi::AnyBuffer& data,
                 const ffi::AnyBuffer& data_t, QuantizeArgs* a, PrologueArgs* q) {
  const int64_t n = static_cast<int64_t>(parts.size());
  if (n < 1 || n > kMaxConcatParts) return Bad("takes 1 to 4 parts");
  int64_t M = 0, K = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::string name = "parts[" + std::to_string(i) + "]";
    auto part = parts.get<ffi::AnyBuffer>(i);
    if (part.has_error()) return std::move(part).error();
    auto d = part->dimensions();
    if (d.size() != 2)
      return Bad(name + " must be 2-D (M, F_i), got " + std::to_string(d.size()) + " dims");
    InType in;
    if (auto e = GetInType(*part, &in, name.c_str()); e.failure()) return e;
    if (i == 0) {
      M = d[0];
      a->in = in;
    } else if (d[0] != M) {
      return Bad(name + " has " + std::to_string(d[0]) +
                 " rows; every part needs parts[0]'s M = " + std::to_string(M));
    } else if (in != a->in) {
      return Bad(name + "'s dtype differs from parts[0]'s; every part needs one dtype");
    }
    if (d[1] <= 0 || d[1] % 8 != 0)
      return Bad(name + "'s width F_i = " + std::to_string(d[1]) +
                 " must be a positive multiple of 8 (a thread's 8 columns lie in one part)");
    K += d[1];
    q->parts[i] = part->untyped_data();
    q->part_end[i] = K;
  }
  q->kind = Prologue::kConcat;
  q->n_parts = static_cast<int>(n);
  a->M = M;
  a->K = K;
  if (auto e = GetOutType(data.element_type(), &a->out); e.failure()) return e;
  auto dd = data.dimensions();
  auto td = data_t.dimensions();
  if (dd.size() != 2 || dd[0] != a->M || dd[1] != a->K)
    return Bad("data must be (M, K), K = the sum of the parts' widths");
  if (td.size() != 2 || td[0] != a->K || td[1] != a->M ||
      data_t.element_type() != data.element_type())
    return Bad("data_t must be (K, M), K = the sum of the parts' widths, of data's dtype");
  a->data = static_cast<uint8_t*>(data.untyped_data());
  a->data_t = static_cast<uint8_t*>(data_t.untyped_data());
  return ffi::Error::Success();
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> scale,
                          ffi::RemainingArgs parts, ffi::Result<ffi::AnyBuffer> data,
                          ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(parts, *data, *data_t, &a, &q); e.failure()) return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.amax_out = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchQuantize(a, stream, q), "concat_quantize_tensorwise");
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::RemainingArgs parts,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(parts, *data, *data_t, &a, &q); e.failure()) return e;
  // Pass 1: max|v| over the parts; pass 2 derives the scale from it on the
  // device and casts.
  if (auto e = CudaError(LaunchPrologueAmax(a, q, amax->typed_data(), stream),
                         "concat_quantize_current (amax)");
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchQuantize(a, stream, q), "concat_quantize_current (cast)");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::RemainingArgs parts,
                         ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(parts, *data, *data_t, &a, &q); e.failure()) return e;
  a.mode = ScaleMode::kVec128;
  a.pow2 = power_2_scale != 0;
  if (auto e = SetVec128Scales(*sinv, *sinv_t, &a, "te_jax concat_quantize"); e.failure())
    return e;
  return CudaError(LaunchQuantize(a, stream, q), "concat_quantize_blockwise");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxConcatQuantizeTensorwise, TensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scale ()
                                  .RemainingArgs()                   // parts, part i (M, F_i)
                                  .Ret<ffi::AnyBuffer>()             // data (M, K = sum F_i) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>(),     // amax () = max|v|
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxConcatQuantizeCurrent, CurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()                   // parts, part i (M, F_i)
                                  .Ret<ffi::AnyBuffer>()             // data (M, K = sum F_i) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>(),     // amax () = max|v|
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxConcatQuantizeBlockwise, BlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()                   // parts, part i (M, F_i)
                                  .Ret<ffi::AnyBuffer>()             // data (M, K = sum F_i) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv, native layout
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv_t, native layout
                                  .Attr<int64_t>("power_2_scale"),   // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
