// Helpers shared by the quantize FFI handlers (quantize.cc, act_quantize.cc,
// concat_quantize.cc).
#pragma once

#include "ffi/common.h"
#include "kernels/quantize.h"

namespace te_jax {

// Whether buffer ``b`` is 2-D with dimensions (d0, d1).
inline bool HasDims(const xla::ffi::AnyBuffer& b, int64_t d0, int64_t d1) {
  auto d = b.dimensions();
  return d.size() == 2 && d[0] == d0 && d[1] == d1;
}

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

// Points `a` at the scale outputs of a 1x128 (+ 128x1 for the columnwise
// copy) quantization of an (a->M, a->K) tensor after checking their native
// layouts (quantize_cuda.native_scale_shapes): sinv (ceil(K/128),
// roundup(M, 4)) and sinv_t (ceil(M/128), roundup(K, 4)); the leading
// dimension of each is its last dim.
inline xla::ffi::Error SetVec128Scales(xla::ffi::Buffer<xla::ffi::F32>& sinv,
                                       xla::ffi::Buffer<xla::ffi::F32>& sinv_t, QuantizeArgs* a,
                                       const char* who) {
  namespace ffi = xla::ffi;
  const int64_t M = a->M, K = a->K;
  auto sd = sinv.dimensions();
  auto td = sinv_t.dimensions();
  if (sd.size() != 2 || sd[0] != (K + 127) / 128 || sd[1] != (M + 3) / 4 * 4)
    return ffi::Error::InvalidArgument(std::string(who) +
                                       ": sinv must be (ceil(W/128), roundup(M, 4))");
  if (td.size() != 2 || td[0] != (M + 127) / 128 || td[1] != (K + 3) / 4 * 4)
    return ffi::Error::InvalidArgument(std::string(who) +
                                       ": sinv_t must be (ceil(M/128), roundup(W, 4))");
  a->sinv = sinv.typed_data();
  a->sinv_ld = sd[1];
  a->sinv_t = sinv_t.typed_data();
  a->sinv_t_ld = td[1];
  return ffi::Error::Success();
}

}  // namespace te_jax
