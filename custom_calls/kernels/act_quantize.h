// The prologue quantize kernels (kernels/act_quantize.cu) with a choice of
// outputs: the FFI handlers of the fused activation and normalization
// (ffi/act_quantize.cc, ffi/normalization.cc) call them directly. Plain CUDA
// host declarations, no XLA headers.
#pragma once

#include <cuda_runtime.h>

#include "kernels/quantize.h"

namespace te_jax {

// h given as E4M3 bytes (kDAct only; store_act_input_in_fp8's copy, see
// te_jax/ops/act_quantize.py): PrologueArgs::h points at the (M, n_act*F)
// bytes and h's value at (r, c) is float(h[r, c]) * scale[r * scale_ld +
// c / 128], rounded to the element type of dz (QuantizeArgs::in): the values
// of h dequantized to dz's dtype, which the reference reads.
struct Fp8HInput {
  const float* scale = nullptr;  // (M, ceil(n_act*F / 128)) float32, row-major
  int64_t scale_ld = 0;          // >= ceil(n_act*F / 128)
};

// h's own E4M3 copy, written by the forward's kAct kernels beside z =
// act(h) (store_act_input_in_fp8: the copy of h the backward reads as
// Fp8HInput) from the h values they load for z, instead of a quantize pass
// of its own over h. Bit for bit quantize_blockwise(h, (1, 128),
// float8_e4m3fn, power_2_scale=True).rowwise() of te_jax/ops/quantize.py:
// per 1x128 tile scale = ComputeScale(max|h|, 448, pow2), bytes
// cast(h * scale), scale_inv = 1 / scale (NaN for a tile holding an Inf or
// NaN). Needs q.F % 128 == 0 (a tile of h never straddles h0 and h1, and
// the 16 lanes sharing a row of a 128x128 block hold one whole tile).
struct Fp8HOutput {
  uint8_t* data = nullptr;    // (M, n_act*F) E4M3, row-major
  float* scale_inv = nullptr;  // (M, n_act*F / 128) float32, row-major: the logical layout
  int64_t scale_ld = 0;        // >= n_act*F / 128
};

// Quantizes v, the (a.M, a.K) output of the prologue `q` (q.kind != kNone),
// as LaunchQuantize(a, stream, q) does, writing only the copies asked for:
// the rowwise one when a.data is set (with a.sinv for ScaleMode::kVec128),
// the columnwise one when a.data_t is set (with a.sinv_t); at least one of
// the two. a.mode is kTensor (a.scale or a.amax_in set, exactly one) or
// kVec128. Zeroes a.amax_out first when set (kTensor).
//
// `act`, when not null, needs q.kind == Prologue::kDAct: the kernel also
// writes the columnwise copy of z = act(h) (the (M, q.F) output of the
// forward's kAct prologue on the same h), whose values the backward's pass
// computes anyway, instead of a separate pass over h:
//   act->M == a.M, act->K == q.F, act->mode == a.mode, act->out its format,
//   act->data_t (F, M) set and act->data null (no rowwise copy);
//   kTensor: act->scale (given) or act->amax_in (scale derived from it on the
//     device, as current scaling's forward derived it), exactly one, and
//     act->scale_inv (optional) receives 1 / scale;
//   kVec128: act->sinv_t (native layout (ceil(M/128), roundup(F, 4))),
//     act->sinv_t_ld, act->pow2; its 128x1 tile scales come from the same
//     values as the forward's.
// The bytes equal those the forward's kAct kernel writes for the same scale.
// `h_fp8`, when not null, needs q.kind == Prologue::kDAct: q.h is E4M3
// (Fp8HInput) and a.in is dz's element type.
// `h_out`, when not null, needs q.kind == Prologue::kAct and q.F % 128 == 0:
// the kernel also writes h's E4M3 copy (Fp8HOutput), whatever a.mode and
// the copies of z asked for (under current scaling: in this, the cast
// pass, not in LaunchPrologueAmax's).
// Returns cudaErrorInvalidValue for anything else.
cudaError_t LaunchPrologueQuantize(const QuantizeArgs& a, const PrologueArgs& q,
                                   const QuantizeArgs* act, cudaStream_t stream,
                                   const Fp8HInput* h_fp8 = nullptr,
                                   const Fp8HOutput* h_out = nullptr);

// LaunchPrologueAmax (kernels/quantize.h) of a kDAct prologue whose h is E4M3
// (Fp8HInput): the first pass of current scaling with the values that
// LaunchPrologueQuantize(a, q, act, stream, &h_fp8) quantizes.
cudaError_t LaunchPrologueAmax(const QuantizeArgs& a, const PrologueArgs& q,
                               const Fp8HInput& h_fp8, float* amax_out, cudaStream_t stream);

}  // namespace te_jax
