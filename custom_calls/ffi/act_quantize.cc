// XLA FFI handlers of te_jax/ops/act_quantize.py (Python side:
// act_quantize_cuda.py): an activation, or its gradient, fused into the FP8
// quantize of its result v, which is never written in 16 or 32 bits.
//
//   te_jax_act_quantize_tensorwise: given scale -> data, data_t, scale_inv,
//                                   amax, act_t, act_scale_inv, h_fp8, h_sinv
//   te_jax_act_quantize_current:    scale from max|v| (a first pass over the
//                                   inputs) -> the same
//   te_jax_act_quantize_blockwise:  1x128 + 128x1 tiles -> data, sinv, data_t,
//                                   sinv_t, act_t, act_sinv_t (scales in
//                                   cuBLASLt layouts), h_fp8, h_sinv
//
// Operands: h (M, n_act*F) and dz (M, F) when backward == 1, else a
// 0-element placeholder (one handler per mode keeps the target table short).
//   backward == 0: v = act0(h0) [* act1(h1)], (M, F)
//   backward == 1: v = dz * act0'(h0) or, gated, the (M, 2F)
//                  [dz * act0'(h0) * act1(h1), dz * act0(h0) * act1'(h1)]
// with h0 = h[:, :F], h1 = h[:, F:]. act0/act1 are ActId values
// (kernels/quantize.h), act1 = -1 when not gated.
//
// h_scale: a (0, 0) placeholder, or, with backward == 1 and h float8_e4m3fn
// (store_act_input_in_fp8's copy of h), h's float32 1x128 tile scales
// (M, ceil(n_act*F / 128)): the kernels read h as float(h) * scale rounded
// to dz's dtype (kernels/act_quantize.h Fp8HInput), never a 16-bit copy.
//
// Optional results: a copy that is not wanted comes as a (0, 0) placeholder
// (its scales too), the other one is written (data (M, W) rowwise, data_t
// (W, M) columnwise, at least one). With backward == 1, act_t (F, M) asks
// for the columnwise copy of z = act(h) as well, quantized as the forward
// quantized it: with the scale act_scale (tensorwise), the scale of the
// amax act_amax (current: the forward's max|z|), or its own 128x1 tiles
// (blockwise, act_power_2_scale); act_scale_inv () gets 1 / its scale. The
// FP8 format of v is read off data (or data_t), that of z off act_t.
// Without it act_t, act_scale_inv / act_sinv_t and act_scale / act_amax are
// 0-element placeholders.
//
// With backward == 0, h_fp8 (M, n_act*F) float8_e4m3fn and h_sinv (M,
// n_act*F / 128) float32 ask for h's own E4M3 copy as well (store_act_input_
// in_fp8's copy, which the backward then reads through h_scale): 1x128
// tiles, power-of-two scales, h_sinv = 1 / scale in the logical row-major
// layout, bit for bit quantize_blockwise(h, (1, 128), float8_e4m3fn,
// power_2_scale=True).rowwise() (kernels/act_quantize.h Fp8HOutput), from
// the h values the pass loads for z; it needs F % 128 == 0 and the rowwise
// copy (data). Under current scaling the cast pass writes it, not the amax
// pass. Without it both are (0, 0) placeholders (h_fp8 of any dtype: the
// Python side sends uint8, which no FP8 result of the call shares).
//
// Every handler here is declared command-buffer compatible (XLA may record it
// in a CUDA graph by stream capture and replay it): it allocates nothing,
// never queries or syncs the stream, and only sets kernel attributes and
// launches kernels and memsets on XLA's stream into the buffers XLA passes.
#include "ffi/prologue_common.h"
#include "kernels/act_quantize.h"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

ffi::Error Bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("te_jax act_quantize: " + msg);
}

// h_scale with an E4M3 h (see the top): sets *hs and *fp8_h.
ffi::Error SetupFp8H(const ffi::AnyBuffer& h, const ffi::Buffer<ffi::F32>& h_scale,
                     int64_t backward, Fp8HInput* hs, bool* fp8_h) {
  auto sd = h_scale.dimensions();
  if (sd.size() != 2) return Bad("h_scale must be 2-D");
  *fp8_h = h.element_type() == ffi::F8E4M3FN;
  if (!*fp8_h) {
    if (sd[0] != 0 || sd[1] != 0) return Bad("h_scale must be (0, 0) unless h is float8_e4m3fn");
    return ffi::Error::Success();
  }
  if (!backward) return Bad("an FP8 h (float8_e4m3fn) is an input of the backward only");
  auto hd = h.dimensions();
  if (hd.size() != 2 || sd[0] != hd[0] || sd[1] != (hd[1] + 127) / 128)
    return Bad("h_scale must be (M, ceil(h.shape[1] / 128)) with a float8_e4m3fn h");
  hs->scale = h_scale.typed_data();
  hs->scale_ld = sd[1];
  return ffi::Error::Success();
}

// Checks the operands and attributes; fills everything but the scale fields.
// An E4M3 h (with h_scale: *hs, *fp8_h) takes dz's element type as a->in.
ffi::Error Setup(const ffi::AnyBuffer& h, const ffi::AnyBuffer& dz,
                 const ffi::Buffer<ffi::F32>& h_scale, const ffi::AnyBuffer& data,
                 const ffi::AnyBuffer& data_t, int64_t backward, int64_t act0, int64_t act1,
                 QuantizeArgs* a, PrologueArgs* q, Fp8HInput* hs, bool* fp8_h) {
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
  if (auto e = SetupFp8H(h, h_scale, backward, hs, fp8_h); e.failure()) return e;
  if (auto e = GetInType(*fp8_h ? dz : h, &a->in, *fp8_h ? "dz" : "h"); e.failure()) return e;
  q->kind = backward ? Prologue::kDAct : Prologue::kAct;
  q->h = h.untyped_data();
  q->F = F;
  q->act0 = static_cast<int>(act0);
  q->act1 = static_cast<int>(act1);
  if (backward) {
    if (!HasDims(dz, M, F)) return Bad("dz must be (M, F) with h (M, n_act * F)");
    if (!*fp8_h && dz.element_type() != h.element_type())
      return Bad("dz and h must have one dtype (or h float8_e4m3fn with h_scale)");
    q->dz = dz.untyped_data();
  }
  a->M = M;
  a->K = backward ? n_act * F : F;
  bool out_set = false;
  if (auto e = OptionalFp8(data, a->M, a->K, &a->data, &a->out, &out_set,
                           "te_jax act_quantize: data");
      e.failure())
    return e;
  if (auto e = OptionalFp8(data_t, a->K, a->M, &a->data_t, &a->out, &out_set,
                           "te_jax act_quantize: data_t");
      e.failure())
    return e;
  if (!out_set) return Bad("data and data_t are both (0, 0): no copy asked for");
  return ffi::Error::Success();
}

// act_t: (F, M) FP8 for act(h)'s columnwise copy (backward only), or (0, 0).
// Fills `z` but its scale fields; returns in *wanted whether it is asked for.
ffi::Error SetupAct(const ffi::AnyBuffer& act_t, const QuantizeArgs& a, const PrologueArgs& q,
                    QuantizeArgs* z, bool* wanted) {
  bool out_set = false;
  if (auto e = OptionalFp8(act_t, q.F, a.M, &z->data_t, &z->out, &out_set,
                           "te_jax act_quantize: act_t");
      e.failure())
    return e;
  *wanted = out_set;
  if (out_set && q.kind != Prologue::kDAct) return Bad("act_t is a result of the backward only");
  z->M = a.M;
  z->K = q.F;
  z->in = a.in;
  z->mode = a.mode;
  return ffi::Error::Success();
}

// h_fp8 and h_sinv (see the top): h's E4M3 copy of the forward, or (0, 0)
// placeholders. Sets *ho (its pointers null when not asked for).
ffi::Error SetupHCopy(const ffi::AnyBuffer& h_fp8, ffi::Buffer<ffi::F32>& h_sinv,
                      const QuantizeArgs& a, const PrologueArgs& q, Fp8HOutput* ho) {
  const int64_t width = (q.act1 >= 0 ? 2 : 1) * q.F;
  const bool wanted = !HasDims(h_fp8, 0, 0);
  if (wanted) {
    if (q.kind != Prologue::kAct) return Bad("h_fp8 (h's E4M3 copy) is a result of the forward only");
    if (q.F % 128 != 0) return Bad("h_fp8 (h's E4M3 copy) needs F % 128 == 0");
    if (!HasDims(h_fp8, a.M, width) || h_fp8.element_type() != ffi::F8E4M3FN)
      return Bad("h_fp8 must be (M, n_act * F) float8_e4m3fn, or (0, 0)");
    if (a.data == nullptr) return Bad("h_fp8 needs the rowwise copy (data) as well");
  }
  if (!OptionalScaleGrid(h_sinv, wanted, a.M, width / 128, &ho->scale_inv, &ho->scale_ld))
    return Bad("h_sinv must be (M, n_act * F / 128) with h_fp8, else (0, 0)");
  ho->data = wanted ? static_cast<uint8_t*>(h_fp8.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// The per-tensor act(h) copy: its scalar operand (act_scale or act_amax) and
// act_scale_inv, both () with act_t, both (0,) without.
ffi::Error SetupActScalars(bool wanted, ffi::Buffer<ffi::F32>& operand,
                           ffi::Buffer<ffi::F32>& scale_inv, const float** operand_ptr,
                           QuantizeArgs* z, const char* operand_name) {
  bool bad = false;
  *operand_ptr = OptionalF32(operand, 1, &bad);
  z->scale_inv = OptionalF32(scale_inv, 1, &bad);
  if (bad || (*operand_ptr != nullptr) != wanted || (z->scale_inv != nullptr) != wanted)
    return Bad(std::string(operand_name) + " and act_scale_inv must be () with act_t, (0,) without");
  return ffi::Error::Success();
}

ffi::Error TensorwiseImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                          ffi::Buffer<ffi::F32> h_scale, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::F32> act_scale,
                          ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> data_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                          ffi::Result<ffi::Buffer<ffi::F32>> amax,
                          ffi::Result<ffi::AnyBuffer> act_t,
                          ffi::Result<ffi::Buffer<ffi::F32>> act_scale_inv,
                          ffi::Result<ffi::AnyBuffer> h_fp8,
                          ffi::Result<ffi::Buffer<ffi::F32>> h_sinv, int64_t backward,
                          int64_t act0, int64_t act1) {
  QuantizeArgs a, z;
  PrologueArgs q;
  Fp8HInput hs;
  Fp8HOutput ho;
  bool with_act = false, fp8_h = false;
  if (auto e = Setup(h, dz, h_scale, *data, *data_t, backward, act0, act1, &a, &q, &hs, &fp8_h);
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  if (auto e = SetupAct(*act_t, a, q, &z, &with_act); e.failure()) return e;
  if (auto e = SetupActScalars(with_act, act_scale, *act_scale_inv, &z.scale, &z, "act_scale");
      e.failure())
    return e;
  if (scale.element_count() != 1) return Bad("scale must be a float32 scalar");
  a.scale = scale.typed_data();
  bool bad = false;
  a.amax_out = OptionalF32(*amax, 1, &bad);  // (0,): the caller has the amax already
  if (bad) return Bad("amax must be () or (0,)");
  a.scale_inv = scale_inv->typed_data();
  if (auto e = SetupHCopy(*h_fp8, *h_sinv, a, q, &ho); e.failure()) return e;
  return CudaError(LaunchPrologueQuantize(a, q, with_act ? &z : nullptr, stream,
                                          fp8_h ? &hs : nullptr, ho.data ? &ho : nullptr),
                   "act_quantize_tensorwise");
}

ffi::Error CurrentImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                       ffi::Buffer<ffi::F32> h_scale, ffi::Buffer<ffi::F32> act_amax,
                       ffi::Result<ffi::AnyBuffer> data,
                       ffi::Result<ffi::AnyBuffer> data_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                       ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer> act_t,
                       ffi::Result<ffi::Buffer<ffi::F32>> act_scale_inv,
                       ffi::Result<ffi::AnyBuffer> h_fp8,
                       ffi::Result<ffi::Buffer<ffi::F32>> h_sinv, int64_t backward,
                       int64_t act0, int64_t act1, int64_t power_2_scale) {
  QuantizeArgs a, z;
  PrologueArgs q;
  Fp8HInput hs;
  Fp8HOutput ho;
  bool with_act = false, fp8_h = false;
  if (auto e = Setup(h, dz, h_scale, *data, *data_t, backward, act0, act1, &a, &q, &hs, &fp8_h);
      e.failure())
    return e;
  a.mode = ScaleMode::kTensor;
  if (auto e = SetupAct(*act_t, a, q, &z, &with_act); e.failure()) return e;
  if (auto e = SetupActScalars(with_act, act_amax, *act_scale_inv, &z.amax_in, &z, "act_amax");
      e.failure())
    return e;
  z.pow2 = a.pow2 = power_2_scale != 0;
  if (amax->element_count() != 1) return Bad("amax must be a float32 scalar");
  if (auto e = SetupHCopy(*h_fp8, *h_sinv, a, q, &ho); e.failure()) return e;
  // Pass 1: max|v| with the same prologue; pass 2 derives the scale from it
  // on the device and casts (no host round trip, no XLA op in between), and
  // writes h's copy when asked (pass 1 only reads).
  cudaError_t amax_err = fp8_h ? LaunchPrologueAmax(a, q, hs, amax->typed_data(), stream)
                               : LaunchPrologueAmax(a, q, amax->typed_data(), stream);
  if (auto e = CudaError(amax_err, "act_quantize_current (amax)");
      e.failure())
    return e;
  a.amax_in = amax->typed_data();
  a.scale_inv = scale_inv->typed_data();
  return CudaError(LaunchPrologueQuantize(a, q, with_act ? &z : nullptr, stream,
                                          fp8_h ? &hs : nullptr, ho.data ? &ho : nullptr),
                   "act_quantize_current (cast)");
}

ffi::Error BlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer h, ffi::AnyBuffer dz,
                         ffi::Buffer<ffi::F32> h_scale, ffi::Result<ffi::AnyBuffer> data,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv,
                         ffi::Result<ffi::AnyBuffer> data_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> sinv_t,
                         ffi::Result<ffi::AnyBuffer> act_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> act_sinv_t,
                         ffi::Result<ffi::AnyBuffer> h_fp8,
                         ffi::Result<ffi::Buffer<ffi::F32>> h_sinv, int64_t backward,
                         int64_t act0, int64_t act1, int64_t power_2_scale,
                         int64_t act_power_2_scale) {
  QuantizeArgs a, z;
  PrologueArgs q;
  Fp8HInput hs;
  Fp8HOutput ho;
  bool with_act = false, fp8_h = false;
  if (auto e = Setup(h, dz, h_scale, *data, *data_t, backward, act0, act1, &a, &q, &hs, &fp8_h);
      e.failure())
    return e;
  a.mode = ScaleMode::kVec128;
  a.pow2 = power_2_scale != 0;
  if (auto e = SetOptionalVec128Scales(*sinv, *sinv_t, &a, "te_jax act_quantize"); e.failure())
    return e;
  if (auto e = SetupAct(*act_t, a, q, &z, &with_act); e.failure()) return e;
  // act(h)'s columnwise copy: the 128x1 scales of an (M, F) tensor.
  if (!OptionalScaleGrid(*act_sinv_t, with_act, (z.M + 127) / 128, (z.K + 3) / 4 * 4,
                         &z.sinv_t, &z.sinv_t_ld))
    return Bad("act_sinv_t must be (ceil(M/128), roundup(F, 4)) with act_t, else (0, 0)");
  z.pow2 = act_power_2_scale != 0;
  if (auto e = SetupHCopy(*h_fp8, *h_sinv, a, q, &ho); e.failure()) return e;
  return CudaError(LaunchPrologueQuantize(a, q, with_act ? &z : nullptr, stream,
                                          fp8_h ? &hs : nullptr, ho.data ? &ho : nullptr),
                   "act_quantize_blockwise");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeTensorwise, TensorwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F), E4M3 too
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // h_scale or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // scale ()
                                  .Arg<ffi::Buffer<ffi::F32>>()      // act_scale () or (0,)
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax () = max|v|, or (0,)
                                  .Ret<ffi::AnyBuffer>()             // act_t (F, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // act_scale_inv () or (0,)
                                  .Ret<ffi::AnyBuffer>()             // h_fp8 (M, nF) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // h_sinv (M, nF/128) or (0, 0)
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1"),            // ActId or -1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeCurrent, CurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F), E4M3 too
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // h_scale or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // act_amax () or (0,)
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // scale_inv ()
                                  .Ret<ffi::Buffer<ffi::F32>>()      // amax () = max|v|
                                  .Ret<ffi::AnyBuffer>()             // act_t (F, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // act_scale_inv () or (0,)
                                  .Ret<ffi::AnyBuffer>()             // h_fp8 (M, nF) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // h_sinv (M, nF/128) or (0, 0)
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1")             // ActId or -1
                                  .Attr<int64_t>("power_2_scale"),   // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxActQuantizeBlockwise, BlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()             // h (M, n_act*F), E4M3 too
                                  .Arg<ffi::AnyBuffer>()             // dz (M, F) or (0, 0)
                                  .Arg<ffi::Buffer<ffi::F32>>()      // h_scale or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data (M, W) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv, native, or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // data_t (W, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // sinv_t, native, or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // act_t (F, M) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // act_sinv_t, native, or (0, 0)
                                  .Ret<ffi::AnyBuffer>()             // h_fp8 (M, nF) or (0, 0)
                                  .Ret<ffi::Buffer<ffi::F32>>()      // h_sinv (M, nF/128) or (0, 0)
                                  .Attr<int64_t>("backward")         // 0: act, 1: dact
                                  .Attr<int64_t>("act0")             // ActId
                                  .Attr<int64_t>("act1")             // ActId or -1
                                  .Attr<int64_t>("power_2_scale")    // 0/1
                                  .Attr<int64_t>("act_power_2_scale"),  // 0/1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
