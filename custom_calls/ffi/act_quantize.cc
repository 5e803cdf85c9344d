// XLA FFI handlers of te_jax/ops/act_quantize.py (Python side:
// act_quantize_cuda.py): an activation, or its gradient, fused into the FP8
// quantize of its result v, which is never written in 16 or 32 bits.
//
//   te_jax_act_quantize_tensorwise: given scale -> data, data_t, scale_inv, amax
//   te_jax_act_quantize_current:    scale from max|v| (a first pass over the
//                                   inputs) -> data, data_t, scale_inv, amax
//   te_jax_act_quantize_blockwise:  1x128 + 128x1 tiles -> data, sinv, data_t,
//                                   sinv_t (scales in cuBLASLt layouts)
//
// Operands: h (M, n_act*F) and dz (M, F) when backward == 1, else a
// 0-element placeholder (one handler per mode keeps the target table short).
//   backward == 0: v = act0(h0) [* act1(h1)], (M, F)
//   backward == 1: v = dz * act0'(h0) or, gated, the (M, 2F)
//                  [dz * act0'(h0) * act1(h1), dz * act0(h0) * act1'(h1)]
// with h0 = h[:, :F], h1 = h[:, F:]. act0/act1 are ActId values
// (kernels/quantize.h), act1 = -1 when not gated. The columnwise copy (the
// quantization of v.T) is always written. The FP8 format is read off the
// element type of `data`.
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
  return ffi::Error::InvalidArgument("te_jax act_quantize: " + msg);
}

// Checks the operands and attributes; fills everything but the scale fields.
ffi::Error Setup(const ffi::AnyBuffer& h, const ffi::AnyBuffer& dz, const ffi::AnyBuffer& data,
                 const ffi::AnyBuffer& data_t, int64_t backward, int64_t act0, int64_t act1,
                 QuantizeArgs* a, PrologueArgs* q) {
  auto hd = h.dimensions();
  if (hd.size() != 2) return Bad("h must be 2-D");
  if (act0 < 0 || act0 >= kNumAct) return Bad("act0 must be an activation id in [0, 8)");
  if (act1 < -1 || act1 >= kNumAct) return Bad("act1 must be -1 or an activation id in [0, 8)");
  const int64_t n_act = act1 >= 0 ? 2 : 1;
  const int64_t M = hd[0];
  if (hd[1] % n_act != 0) return Bad("h.shape[1] must be n_act * F");
  const int64_t F = hd[1] / n_act;
  // A thread's 8 output columns must not straddle h0 and h1 (prologue.h).
  if (n_act == 2 && F % 8 != 0) return Bad("gated activations need F % 8 == 0");
  if (auto e = GetInType(h, &a->in, "h"); e.failure()) return e;
  q->kind = backward ? Prologue::kDAct : Prologue::kAct;
  q->h = h.untyped_data();
  q->F = F;
  q->act0 = static_cast<int>(act0);
  q->act1 = static_cast<int>(act1);
  if (backward) {
    if (!HasDims(dz, M, F)) return Bad("dz must be (M, F) with h (M, n_act * F)");
    if (dz.element_type() != h.element_type()) return Bad("dz and h must have one dtype");
    q->dz = dz.untyped_data();
  }
  a->M = M;
  a->K = backward ? n_act * F : F;
  if (auto e = GetOutType(data.element_type(), &a->out); e.failure()) return e;
  if (!HasDims(data, a->M, a->K)) return Bad("data must be (M, W)");
  if (!HasDims(data_t, a->K, a->M) || data_t.element_type() != data.element_type())
    return Bad("data_t must be (W, M) of data's dtype");
  a->data = static_cast<uint8_t*>(data.untyped_data());
  a->data_t = static_cast<uint8_t*>(data_t.untyped_data());
  return ffi::Error::Success();
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                          ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> data,
                          ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t backward, int64_t act0,
                          int64_t act1) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(h, dz, *data, *data_t, backward, act0, act1, &a, &q); e.failure()) return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.amax_out = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchQuantize(a, stream, q), "act_quantize_tensorwise");
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                       ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t backward, int64_t act0,
                       int64_t act1, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(h, dz, *data, *data_t, backward, act0, act1, &a, &q); e.failure()) return e;
  // Pass 1: max|v| with the same prologue; pass 2 derives the scale from it
  // on the device and casts (no host round trip, no XLA op in between).
  if (auto e = CudaError(LaunchPrologueAmax(a, q, amax->typed_data(), stream),
                         "act_quantize_current (amax)");
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  a.pow2 = power_2_scale != 0;
  return CudaError(LaunchQuantize(a, stream, q), "act_quantize_current (cast)");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                         ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t, int64_t backward,
                         int64_t act0, int64_t act1, int64_t power_2_scale) {
  QuantizeArgs a;
  PrologueArgs q;
  if (auto e = Setup(h, dz, *data, *data_t, backward, act0, act1, &a, &q); e.failure()) return e;
  a.mode = ScaleMode::kVec128;
  a.pow2 = power_2_scale != 0;
  if (auto e = SetVec128Scales(*sinv, *sinv_t, &a, "te_jax act_quantize"); e.failure()) return e;
  return CudaError(LaunchQuantize(a, stream, q), "act_quantize_blockwise");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeTensorwise, TensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F)
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scale ()
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax () = max|v|
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1"),            // ActId or -1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeCurrent, CurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F)
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax () = max|v|
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1")             // ActId or -1
                                  .Attr<int64_t>("power_2_scale"),   // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeBlockwise, BlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F)
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv, native layout
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv_t, native layout
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1")             // ActId or -1
                                  .Attr<int64_t>("power_2_scale"),   // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
