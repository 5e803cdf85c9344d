// XLA FFI handlers of te_jax/ops/quantize.py (Python side: quantize_cuda.py).
//
//   te_jax_quantize_tensorwise: given scale -> data, data_t, amax
//   te_jax_quantize_current:    scale from this tensor's amax -> data, data_t,
//                               scale_inv, amax
//   te_jax_quantize_blockwise:  1x128 (+128x1) or 128x128 -> data, sinv,
//                               data_t, sinv_t (scales in cuBLASLt layouts)
//
// The FP8 format is read off the element type of `data`; the columnwise copy
// is written only when `columnwise` != 0 (Python then passes a real (K, M)
// result, else a 0-element placeholder).
//
// Every handler here is declared command-buffer compatible (XLA may record it
// in a CUDA graph by stream capture and replay it): it allocates nothing,
// never queries or syncs the stream, and only sets kernel attributes and
// launches kernels and memsets on XLA's stream into the buffers XLA passes.
#include "ffi/quantize_common.h"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

// Fills the fields shared by every mode; checks that x is 2-D.
ffi::Error Common(const ffi::AnyBuffer& x, const ffi::AnyBuffer& data, const ffi::AnyBuffer& data_t,
                  int64_t columnwise, QuantizeArgs* a) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("te_jax quantize: x must be 2-D");
  a->x = x.untyped_data();
  a->M = dims[0];
  a->K = dims[1];
  if (auto e = GetInType(x, &a->in, "x"); e.failure()) return e;
  if (auto e = GetOutType(data.element_type(), &a->out); e.failure()) return e;
  a->data = static_cast<uint8_t*>(data.untyped_data());
  if (columnwise) {
    if (data_t.element_count() != static_cast<size_t>(a->M * a->K))
      return ffi::Error::InvalidArgument("te_jax quantize: data_t must have K*M elements");
    a->data_t = static_cast<uint8_t*>(data_t.untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t columnwise) {
  QuantizeArgs a;
  if (auto e = Common(x, *data, *data_t, columnwise, &a); e.failure()) return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.amax_out = amax->typed_data();
  return CudaError(LaunchQuantize(a, stream), "quantize_tensorwise");
}

// The cast of current scaling: the kernel derives scale = fp8_max / amax on
// the device (no host round trip, no XLA op between the passes) and writes
// 1 / scale to scale_inv.
ffi::Error CastFromAmax(QuantizeArgs a, const float* amax, float* scale_inv,
                        cudaStream_t stream, const char* what) {
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax;
  a.scale_inv = scale_inv;
  return CudaError(LaunchQuantize(a, stream), what);
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                       ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t columnwise) {
  QuantizeArgs a;
  if (auto e = Common(x, *data, *data_t, columnwise, &a); e.failure()) return e;
  // Pass 1 reduces amax, pass 2 casts with the scale derived from it.
  if (auto e = CudaError(LaunchAmax(a.x, a.M * a.K, a.in, amax->typed_data(), stream),
                         "quantize_current (amax)");
      e.failure())
    return e;
  return CastFromAmax(a, amax->typed_data(), scale_inv->typed_data(), stream,
                      "quantize_current (cast)");
}

// Current scaling with an amax computed elsewhere (te_jax.distributed
// max-reduces it over the mesh first): the same CastFromAmax as CurrentImpl,
// so sharded and unsharded GEMMs quantize with bit-identical scales.
ffi::Error FromAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                        ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, int64_t columnwise) {
  if (amax.element_count() != 1)
    return ffi::Error::InvalidArgument("te_jax quantize_from_amax: amax must be a scalar");
  QuantizeArgs a;
  if (auto e = Common(x, *data, *data_t, columnwise, &a); e.failure()) return e;
  return CastFromAmax(a, amax.typed_data(), scale_inv->typed_data(), stream,
                      "quantize_from_amax");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t, int64_t block_rows,
                         int64_t power_2_scale, int64_t columnwise) {
  QuantizeArgs a;
  if (auto e = Common(x, *data, *data_t, columnwise, &a); e.failure()) return e;
  if (block_rows != 1 && block_rows != 128)
    return ffi::Error::InvalidArgument("te_jax quantize_blockwise: block_rows must be 1 or 128");
  a.mode = block_rows == 1 ? ScaleMode::kVec128 : ScaleMode::kBlock128;
  a.pow2 = power_2_scale != 0;
  // The leading dimension of each native scale array is its last dim.
  auto sd = sinv->dimensions();
  if (sd.size() != 2) return ffi::Error::InvalidArgument("te_jax quantize_blockwise: sinv must be 2-D");
  a.sinv = sinv->typed_data();
  a.sinv_ld = sd[1];
  if (columnwise) {
    auto td = sinv_t->dimensions();
    if (td.size() != 2) return ffi::Error::InvalidArgument("te_jax quantize_blockwise: sinv_t must be 2-D");
    a.sinv_t = sinv_t->typed_data();
    a.sinv_t_ld = td[1];
  }
  return CudaError(LaunchQuantize(a, stream), "quantize_blockwise");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeTensorwise, TensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scale ()
                                  .Ret<ffi::AnyBuffer>()             // data (M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax ()
                                  .Attr<int64_t>("columnwise"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeCurrent, CurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (M, K)
                                  .Ret<ffi::AnyBuffer>()             // data (M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax ()
                                  .Attr<int64_t>("columnwise"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeFromAmax, FromAmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // amax ()
                                  .Ret<ffi::AnyBuffer>()             // data (M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Attr<int64_t>("columnwise"),      // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeBlockwise, BlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (M, K)
                                  .Ret<ffi::AnyBuffer>()             // data (M, K) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv, native layout
                                  .Ret<ffi::AnyBuffer>()             // data_t (K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv_t, native layout or empty
                                  .Attr<int64_t>("block_rows")       // 1 (1x128) or 128 (128x128)
                                  .Attr<int64_t>("power_2_scale")    // 0/1
                                  .Attr<int64_t>("columnwise"),      // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
