// The nanobind module te_jax._te_jax_ffi: hands the FFI handlers to Python,
// where te_jax/ops/_native.py registers each with
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace te_jax {
extern "C" {
// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in ffi/*.cc.
XLA_FFI_Error* TeJaxQuantizeTensorwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeCurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeFromAmax(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeBlockwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeStackTensorwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeStackCurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeStackFromAmax(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxQuantizeStackBlockwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxActQuantizeTensorwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxActQuantizeCurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxActQuantizeBlockwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxConcatQuantizeTensorwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxConcatQuantizeCurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxConcatQuantizeBlockwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxNormQuantizeTensorwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxNormQuantizeCurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxNormQuantizeBlockwise(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxNormBackward(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxNormStats(XLA_FFI_CallFrame*);
XLA_FFI_Error* TeJaxGemm(XLA_FFI_CallFrame*);
#ifdef TE_JAX_HAVE_SM90  // ffi/grouped_gemm.cc: built with the CUTLASS headers only
XLA_FFI_Error* TeJaxGroupedGemm(XLA_FFI_CallFrame*);
#endif
}
}  // namespace te_jax

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "handler must be an XLA FFI function");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_te_jax_ffi, m) {
  m.doc() =
      "te_jax CUDA custom calls (XLA FFI handlers for FP8 quantize, activation + quantize, "
      "concatenation + quantize, normalization + quantize and its backward, GEMM)";
  m.def("registrations", []() {
    nb::dict d;
    d["te_jax_quantize_tensorwise"] = Capsule(te_jax::TeJaxQuantizeTensorwise);
    d["te_jax_quantize_current"] = Capsule(te_jax::TeJaxQuantizeCurrent);
    d["te_jax_quantize_from_amax"] = Capsule(te_jax::TeJaxQuantizeFromAmax);
    d["te_jax_quantize_blockwise"] = Capsule(te_jax::TeJaxQuantizeBlockwise);
    d["te_jax_quantize_stack_tensorwise"] = Capsule(te_jax::TeJaxQuantizeStackTensorwise);
    d["te_jax_quantize_stack_current"] = Capsule(te_jax::TeJaxQuantizeStackCurrent);
    d["te_jax_quantize_stack_from_amax"] = Capsule(te_jax::TeJaxQuantizeStackFromAmax);
    d["te_jax_quantize_stack_blockwise"] = Capsule(te_jax::TeJaxQuantizeStackBlockwise);
    d["te_jax_act_quantize_tensorwise"] = Capsule(te_jax::TeJaxActQuantizeTensorwise);
    d["te_jax_act_quantize_current"] = Capsule(te_jax::TeJaxActQuantizeCurrent);
    d["te_jax_act_quantize_blockwise"] = Capsule(te_jax::TeJaxActQuantizeBlockwise);
    d["te_jax_concat_quantize_tensorwise"] = Capsule(te_jax::TeJaxConcatQuantizeTensorwise);
    d["te_jax_concat_quantize_current"] = Capsule(te_jax::TeJaxConcatQuantizeCurrent);
    d["te_jax_concat_quantize_blockwise"] = Capsule(te_jax::TeJaxConcatQuantizeBlockwise);
    d["te_jax_norm_quantize_tensorwise"] = Capsule(te_jax::TeJaxNormQuantizeTensorwise);
    d["te_jax_norm_quantize_current"] = Capsule(te_jax::TeJaxNormQuantizeCurrent);
    d["te_jax_norm_quantize_blockwise"] = Capsule(te_jax::TeJaxNormQuantizeBlockwise);
    d["te_jax_norm_backward"] = Capsule(te_jax::TeJaxNormBackward);
    d["te_jax_norm_stats"] = Capsule(te_jax::TeJaxNormStats);
    d["te_jax_gemm"] = Capsule(te_jax::TeJaxGemm);
#ifdef TE_JAX_HAVE_SM90
    d["te_jax_grouped_gemm"] = Capsule(te_jax::TeJaxGroupedGemm);
#endif
    return d;
  });
}
