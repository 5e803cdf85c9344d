// Helpers of the FFI handlers whose outputs are optional (act_quantize.cc,
// normalization.cc): an output that is not wanted comes as a 0-element
// placeholder (XLA allocates every result of a custom call), and its
// pointer in QuantizeArgs stays null (kernels/act_quantize.h).
#pragma once

#include <string>

#include "ffi/quantize_common.h"

namespace te_jax {

// An optional 2-D FP8 result: (d0, d1), or (0, 0) when not wanted (*ptr
// null). Sets a->out from its dtype, which every FP8 result of one handler
// shares (`out_set`: whether an earlier one set it).
inline xla::ffi::Error OptionalFp8(const xla::ffi::AnyBuffer& b, int64_t d0, int64_t d1,
                                   uint8_t** ptr, Fp8Type* out, bool* out_set,
                                   const std::string& what) {
  namespace ffi = xla::ffi;
  *ptr = nullptr;
  if (HasDims(b, 0, 0)) return ffi::Error::Success();
  if (!HasDims(b, d0, d1))
    return ffi::Error::InvalidArgument(what + " must be (" + std::to_string(d0) + ", " +
                                       std::to_string(d1) + ") or (0, 0)");
  Fp8Type t;
  if (auto e = GetOutType(b.element_type(), &t); e.failure()) return e;
  if (*out_set && t != *out)
    return ffi::Error::InvalidArgument(what + " must have the dtype of the other FP8 results");
  *out = t;
  *out_set = true;
  *ptr = static_cast<uint8_t*>(b.untyped_data());
  return ffi::Error::Success();
}

// An optional float32 buffer of n elements: the pointer, or null for a
// 0-element placeholder; `*bad` set for any other size.
template <typename B>
float* OptionalF32(B& b, int64_t n, bool* bad) {
  const int64_t count = static_cast<int64_t>(b.element_count());
  if (count == 0) return nullptr;
  if (count != n) *bad = true;
  return b.typed_data();
}

// One native scale grid of a 1x128 (+ 128x1) quantization whose copy is
// optional: (d0, d1) when `present`, else (0, 0). Sets *ptr (null when
// absent) and *ld (its last dim); false for any other shape.
inline bool OptionalScaleGrid(xla::ffi::Buffer<xla::ffi::F32>& b, bool present, int64_t d0,
                              int64_t d1, float** ptr, int64_t* ld) {
  auto d = b.dimensions();
  if (d.size() != 2 || d[0] != (present ? d0 : 0) || d[1] != (present ? d1 : 0)) return false;
  *ptr = present ? b.typed_data() : nullptr;
  *ld = d[1];
  return true;
}

// The scale results of a 1x128 (+ 128x1) quantization of an (a->M, a->K)
// tensor whose copies are optional: sinv (ceil(K/128), roundup(M, 4)) with
// the rowwise copy (a->data set), sinv_t (ceil(M/128), roundup(K, 4)) with
// the columnwise one (a->data_t set), each (0, 0) otherwise.
inline xla::ffi::Error SetOptionalVec128Scales(xla::ffi::Buffer<xla::ffi::F32>& sinv,
                                               xla::ffi::Buffer<xla::ffi::F32>& sinv_t,
                                               QuantizeArgs* a, const std::string& who) {
  namespace ffi = xla::ffi;
  const int64_t M = a->M, K = a->K;
  if (!OptionalScaleGrid(sinv, a->data != nullptr, (K + 127) / 128, (M + 3) / 4 * 4, &a->sinv,
                         &a->sinv_ld))
    return ffi::Error::InvalidArgument(
        who + ": sinv must be (ceil(W/128), roundup(M, 4)) with the rowwise copy, else (0, 0)");
  if (!OptionalScaleGrid(sinv_t, a->data_t != nullptr, (M + 127) / 128, (K + 3) / 4 * 4,
                         &a->sinv_t, &a->sinv_t_ld))
    return ffi::Error::InvalidArgument(
        who + ": sinv_t must be (ceil(M/128), roundup(W, 4)) with the columnwise copy, else (0, 0)");
  return ffi::Error::Success();
}

}  // namespace te_jax
