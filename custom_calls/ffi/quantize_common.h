// Element-type helpers shared by the quantize FFI handlers (quantize.cc,
// act_quantize.cc).
#pragma once

#include "ffi/common.h"
#include "kernels/quantize.h"

namespace te_jax {

inline xla::ffi::Error GetInType(const xla::ffi::AnyBuffer& x, InType* out, const char* what) {
  namespace ffi = xla::ffi;
  switch (x.element_type()) {
    case ffi::F32: *out = InType::kF32; return ffi::Error::Success();
    case ffi::BF16: *out = InType::kBF16; return ffi::Error::Success();
    case ffi::F16: *out = InType::kF16; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(std::string("te_jax quantize: ") + what +
                                         " must be float32, bfloat16 or float16");
  }
}

inline xla::ffi::Error GetOutType(xla::ffi::DataType t, Fp8Type* out) {
  namespace ffi = xla::ffi;
  if (t == ffi::F8E4M3FN) { *out = Fp8Type::kE4M3; return ffi::Error::Success(); }
  if (t == ffi::F8E5M2) { *out = Fp8Type::kE5M2; return ffi::Error::Success(); }
  return ffi::Error::InvalidArgument("te_jax quantize: data must be float8_e4m3fn or float8_e5m2");
}

}  // namespace te_jax
