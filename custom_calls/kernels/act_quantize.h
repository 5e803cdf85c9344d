// The prologue quantize kernels (kernels/act_quantize.cu) with a choice of
// outputs: the FFI handlers of the fused activation and normalization
// (ffi/act_quantize.cc, ffi/normalization.cc) call them directly. Plain CUDA
// host declarations, no XLA headers.
#pragma once

#include <cuda_runtime.h>

#include "kernels/quantize.h"

namespace te_jax {

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
// Returns cudaErrorInvalidValue for anything else.
cudaError_t LaunchPrologueQuantize(const QuantizeArgs& a, const PrologueArgs& q,
                                   const QuantizeArgs* act, cudaStream_t stream);

}  // namespace te_jax
