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
// The stack targets (te_jax/ops/quantize_stack.py) quantize each entry of x
// (E, M, K) exactly as the 2-D target of the same mode quantizes that entry
// alone, in one launch over all entries (kernels/quantize.h: StackArgs):
//   te_jax_quantize_stack_tensorwise: scale (E,) -> data, data_t, amax (E,)
//   te_jax_quantize_stack_current:    -> data, data_t, scale_inv (E,), amax (E,)
//   te_jax_quantize_stack_from_amax:  amax (E,) -> data, data_t, scale_inv (E,)
//   te_jax_quantize_stack_blockwise:  -> data, sinv (E, native), data_t,
//                                     sinv_t (E, native)
// with data (E, M, K), data_t (E, K, M) or a (0, 0, 0) placeholder. Their
// handlers check every operand's shape (an InvalidArgument names it), and E,
// M or K of 0 launches nothing.
//
// Every handler here is declared command-buffer compatible (XLA may record it
// in a CUDA graph by stream capture and replay it): it allocates nothing,
// never queries or syncs the stream, and only sets kernel attributes and
// launches kernels and memsets on XLA's stream into the buffers XLA passes.
#include <initializer_list>
#include <string>
#include <utility>

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

// ---- stacks (E, M, K) ----

// Whether buffer ``b`` has exactly the dimensions ``want``.
bool DimsAre(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

ffi::Error StackInvalid(const char* who, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("te_jax ") + who + ": " + what);
}

// Fills the fields every stack mode shares from x (E, M, K), data (E, M, K)
// and, when columnwise, data_t (E, K, M); checks their shapes and types.
ffi::Error StackCommon(const ffi::AnyBuffer& x, const ffi::AnyBuffer& data,
                       const ffi::AnyBuffer& data_t, int64_t columnwise, QuantizeArgs* a,
                       StackArgs* s, const char* who) {
  auto dims = x.dimensions();
  if (dims.size() != 3) return StackInvalid(who, "x must be 3-D (E, M, K)");
  s->E = dims[0];
  a->x = x.untyped_data();
  a->M = dims[1];
  a->K = dims[2];
  if (s->E > kMaxStackEntries)
    return StackInvalid(who, "x has " + std::to_string(s->E) + " entries; at most " +
                                 std::to_string(kMaxStackEntries) + " (the grid's z dimension)");
  if ((a->M + 127) / 128 > 65535)
    return StackInvalid(who, "x has " + std::to_string(a->M) + " rows per entry; at most 65535 x 128");
  if (columnwise != 0 && columnwise != 1) return StackInvalid(who, "columnwise must be 0 or 1");
  if (auto e = GetInType(x, &a->in, "x"); e.failure()) return e;
  if (auto e = GetOutType(data.element_type(), &a->out); e.failure()) return e;
  if (!DimsAre(data, {s->E, a->M, a->K})) return StackInvalid(who, "data must be (E, M, K), x's shape");
  a->data = static_cast<uint8_t*>(data.untyped_data());
  if (columnwise) {
    if (data_t.element_type() != data.element_type())
      return StackInvalid(who, "data_t must have data's FP8 type");
    if (!DimsAre(data_t, {s->E, a->K, a->M})) return StackInvalid(who, "data_t must be (E, K, M)");
    a->data_t = static_cast<uint8_t*>(data_t.untyped_data());
  }
  return ffi::Error::Success();
}

// Checks that a per-entry float32 buffer is (E,).
ffi::Error PerEntry(const ffi::Buffer<ffi::F32>& b, int64_t E, const char* name, const char* who) {
  auto d = b.dimensions();
  if (d.size() != 1 || d[0] != E) return StackInvalid(who, std::string(name) + " must be (E,), one per entry");
  return ffi::Error::Success();
}

ffi::Error StackTensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                               ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                               ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t columnwise) {
  constexpr const char* kWho = "quantize_stack_tensorwise";
  QuantizeArgs a;
  StackArgs s;
  if (auto e = StackCommon(x, *data, *data_t, columnwise, &a, &s, kWho); e.failure()) return e;
  if (auto e = PerEntry(scale, s.E, "scale", kWho); e.failure()) return e;
  if (auto e = PerEntry(*amax, s.E, "amax", kWho); e.failure()) return e;
  a.mode = ScaleMode::kTensor;
  a.scale = scale.typed_data();
  a.amax_out = amax->typed_data();
  return CudaError(LaunchQuantizeStack(a, s, stream), kWho);
}

// The cast of current scaling over a stack: each entry's scale derived on
// the device from its amax (amax[e]), as CastFromAmax does for one tensor.
ffi::Error StackCastFromAmax(QuantizeArgs a, const StackArgs& s, const float* amax,
                             float* scale_inv, cudaStream_t stream, const char* what) {
  a.mode = ScaleMode::kTensor;
  a.amax_in = amax;
  a.scale_inv = scale_inv;
  return CudaError(LaunchQuantizeStack(a, s, stream), what);
}

ffi::Error StackCurrentImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                            ffi::Result<ffi::AnyBuffer> data_t,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                            ffi::Result<ffi::Buffer<ffi::F32>> amax, int64_t columnwise) {
  constexpr const char* kWho = "quantize_stack_current";
  QuantizeArgs a;
  StackArgs s;
  if (auto e = StackCommon(x, *data, *data_t, columnwise, &a, &s, kWho); e.failure()) return e;
  if (auto e = PerEntry(*scale_inv, s.E, "scale_inv", kWho); e.failure()) return e;
  if (auto e = PerEntry(*amax, s.E, "amax", kWho); e.failure()) return e;
  // Pass 1: every entry's amax in one launch; pass 2: the cast.
  if (auto e = CudaError(LaunchAmaxStack(a.x, a.M * a.K, s.E, a.in, amax->typed_data(), stream),
                         "quantize_stack_current (amax)");
      e.failure())
    return e;
  return StackCastFromAmax(a, s, amax->typed_data(), scale_inv->typed_data(), stream,
                           "quantize_stack_current (cast)");
}

ffi::Error StackFromAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                             ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, int64_t columnwise) {
  constexpr const char* kWho = "quantize_stack_from_amax";
  QuantizeArgs a;
  StackArgs s;
  if (auto e = StackCommon(x, *data, *data_t, columnwise, &a, &s, kWho); e.failure()) return e;
  if (auto e = PerEntry(amax, s.E, "amax", kWho); e.failure()) return e;
  if (auto e = PerEntry(*scale_inv, s.E, "scale_inv", kWho); e.failure()) return e;
  return StackCastFromAmax(a, s, amax.typed_data(), scale_inv->typed_data(), stream, kWho);
}

// The native scale grid of one (rows, cols) entry (quantize_cuda.native_scale_shapes):
// 1x128: (ceil(cols/128), roundup(rows, 4)); 128x128: (ceil(rows/128),
// roundup(ceil(cols/128), 4)).
std::pair<int64_t, int64_t> NativeGrid(int64_t rows, int64_t cols, bool vec128) {
  auto up4 = [](int64_t v) { return (v + 3) / 4 * 4; };
  if (vec128) return {(cols + 127) / 128, up4(rows)};
  return {(rows + 127) / 128, up4((cols + 127) / 128)};
}

ffi::Error StackBlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                              ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                              ffi::Result<ffi::AnyBuffer> data_t,
                              ffi::Result<ffi::Buffer<ffi::F32>> sinv_t, int64_t block_rows,
                              int64_t power_2_scale, int64_t columnwise) {
  constexpr const char* kWho = "quantize_stack_blockwise";
  QuantizeArgs a;
  StackArgs s;
  if (auto e = StackCommon(x, *data, *data_t, columnwise, &a, &s, kWho); e.failure()) return e;
  if (block_rows != 1 && block_rows != 128) return StackInvalid(kWho, "block_rows must be 1 or 128");
  if (power_2_scale != 0 && power_2_scale != 1) return StackInvalid(kWho, "power_2_scale must be 0 or 1");
  const bool vec128 = block_rows == 1;
  a.mode = vec128 ? ScaleMode::kVec128 : ScaleMode::kBlock128;
  a.pow2 = power_2_scale != 0;
  // Each entry's grid is the one the 2-D target writes (its leading
  // dimension is the last dim); entries follow each other.
  const auto g = NativeGrid(a.M, a.K, vec128);
  auto sd = sinv->dimensions();
  if (sd.size() != 3 || sd[0] != s.E || sd[1] != g.first || sd[2] != g.second)
    return StackInvalid(kWho, vec128 ? "sinv must be (E, ceil(K/128), roundup(M, 4))"
                                     : "sinv must be (E, ceil(M/128), roundup(ceil(K/128), 4))");
  a.sinv = sinv->typed_data();
  a.sinv_ld = g.second;
  s.sinv_stride = g.first * g.second;
  if (columnwise) {
    const auto gt = NativeGrid(a.K, a.M, vec128);
    auto td = sinv_t->dimensions();
    if (td.size() != 3 || td[0] != s.E || td[1] != gt.first || td[2] != gt.second)
      return StackInvalid(kWho, vec128 ? "sinv_t must be (E, ceil(M/128), roundup(K, 4))"
                                       : "sinv_t must be (E, ceil(K/128), roundup(ceil(M/128), 4))");
    a.sinv_t = sinv_t->typed_data();
    a.sinv_t_ld = gt.second;
    s.sinv_t_stride = gt.first * gt.second;
  }
  return CudaError(LaunchQuantizeStack(a, s, stream), kWho);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeStackTensorwise, StackTensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (E, M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scale (E,)
                                  .Ret<ffi::AnyBuffer>()             // data (E, M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (E, K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax (E,)
                                  .Attr<int64_t>("columnwise"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeStackCurrent, StackCurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (E, M, K)
                                  .Ret<ffi::AnyBuffer>()             // data (E, M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (E, K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv (E,)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax (E,)
                                  .Attr<int64_t>("columnwise"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeStackFromAmax, StackFromAmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (E, M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // amax (E,)
                                  .Ret<ffi::AnyBuffer>()             // data (E, M, K) fp8
                                  .Ret<ffi::AnyBuffer>()             // data_t (E, K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv (E,)
                                  .Attr<int64_t>("columnwise"),      // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxQuantizeStackBlockwise, StackBlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // x (E, M, K)
                                  .Ret<ffi::AnyBuffer>()             // data (E, M, K) fp8
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv (E, native grid)
                                  .Ret<ffi::AnyBuffer>()             // data_t (E, K, M) fp8 or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv_t (E, native grid) or empty
                                  .Attr<int64_t>("block_rows")       // 1 (1x128) or 128 (128x128)
                                  .Attr<int64_t>("power_2_scale")    // 0/1
                                  .Attr<int64_t>("columnwise"),      // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
