"""CUDA custom-call path of ``ops/normalization.py`` (FFI handlers in
``custom_calls/ffi/normalization.cc``, kernels in
``custom_calls/kernels/normalization.cu`` and, for the FP8 output, the
``Prologue::kNorm`` tile kernels of ``act_quantize.cu``).

``norm_quantize`` returns exactly the pytree of the reference: the
``QuantizedTensor`` (blockwise scales in the LOGICAL layout through the
layout's ``from_native`` (``tiling.py``), which ``gemm_cuda.py`` undoes), the
mean (None for rmsnorm) and rstd. gamma and beta reach the kernels as
float32 (an exact conversion). Argument checks live in ``normalization.py``;
this module assumes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import quantize_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor, nan_scale_inv_if_non_finite

__all__ = ["norm_stats", "norm_quantize", "norm_backward", "MAX_HIDDEN", "backward_blocks"]

_F32 = jnp.float32
MAX_HIDDEN = 8192   # custom_calls/kernels/normalization.h: kNormBwdMaxHidden
# CUDA blocks of the backward kernel: each takes every `blocks`-th row and
# writes one row of partial dgamma/dbeta sums. The kernel runs H / 8 threads
# per block within a 64-register budget (launch bounds of 1024 threads), so an
# SM holds 1024 / threads blocks: the grid fills the H200's 132 SMs with that
# many (264 at H = 4096, 528 at H = 2048, where a fixed 264 left half of each
# SM's threads idle). Constants rather than the device's SM count so that
# results (the partial sums' order) do not depend on the GPU model.
_BWD_SMS = 132
_BWD_THREADS_PER_SM = 1024
_BWD_MAX_BLOCKS_PER_SM = 8


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _f32(a):
  """float32 copy of an optional (H,) parameter; a (0,) placeholder for None."""
  return jnp.zeros((0,), _F32) if a is None else a.astype(_F32)


def backward_blocks(m: int, h: int) -> int:
  """Number of CUDA blocks (rows of partial sums) of the backward for (m, h) rows."""
  threads = (-(-h // 8) + 31) // 32 * 32   # as LaunchNormBackward launches it (normalization.cu)
  per_sm = max(1, min(_BWD_MAX_BLOCKS_PER_SM, _BWD_THREADS_PER_SM // threads))
  return max(1, min(int(m), _BWD_SMS * per_sm))


def norm_stats(x, rms: bool, epsilon: float):
  """(mean or None, rstd), float32 (M,) each; see ``normalization.norm_stats``."""
  m = x.shape[0]
  mean, rstd = jax.ffi.ffi_call(
      "te_jax_norm_stats", (_sds((0,) if rms else (m,), _F32), _sds((m,), _F32)))(
          x, rmsnorm=np.int64(rms), epsilon=np.float32(epsilon))
  return (None if rms else mean), rstd


def norm_quantize(x, gamma, beta, rms: bool, epsilon: float, zero_centered: bool, mode: str,
                  dtype, scale, power_2_scale: bool):
  """(QuantizedTensor of norm(x), mean or None, rstd); see ``normalization.norm_quantize``."""
  m, h = x.shape
  stats = (_sds((0,) if rms else (m,), _F32), _sds((m,), _F32))
  attrs = dict(rmsnorm=np.int64(rms), zero_centered_gamma=np.int64(zero_centered),
               epsilon=np.float32(epsilon))
  operands = (x, _f32(gamma), _f32(beta))
  fp8 = (_sds((m, h), dtype), _sds((h, m), dtype))
  scalars = (_sds((), _F32), _sds((), _F32))

  def stats_out(mean, rstd):
    return (None if rms else mean), rstd

  if mode == "tensorwise":
    data, data_t, scale_inv, amax, mean, rstd = jax.ffi.ffi_call(
        "te_jax_norm_quantize_tensorwise", fp8 + scalars + stats)(
            *operands, jnp.asarray(scale, _F32), **attrs)
    q = nan_scale_inv_if_non_finite(QuantizedTensor(data, scale_inv, data_t, scale_inv, amax))
    return (q,) + stats_out(mean, rstd)
  if mode == "current":
    data, data_t, scale_inv, amax, mean, rstd = jax.ffi.ffi_call(
        "te_jax_norm_quantize_current", fp8 + scalars + stats)(
            *operands, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
    return (QuantizedTensor(data, scale_inv, data_t, scale_inv, amax),) + stats_out(mean, rstd)
  # blockwise: the mode's tiles rowwise, and the same tiles of y.T for the
  # columnwise copy.
  layout = tiling.mode_layout(mode)
  s_out, st_out = quantize_cuda.blockwise_scale_outputs(m, h, layout, True)
  data, s, data_t, st, mean, rstd = jax.ffi.ffi_call(
      "te_jax_norm_quantize_blockwise", (fp8[0], s_out, fp8[1], st_out) + stats)(
          *operands, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
  q = quantize_cuda.blockwise_result(data, s, data_t, st, m, h, layout)
  return (q,) + stats_out(mean, rstd)


def norm_backward(dy, x, gamma, mean, rstd, zero_centered: bool, blocks: int | None = None):
  """(dx in x.dtype, dgamma and dbeta in gamma.dtype, dbeta None for rmsnorm).

  ``blocks`` overrides :func:`backward_blocks` (benchmarks compare grids with it).
  """
  rms = mean is None
  m, h = x.shape
  # The kernel reads both with one element type. Widening to the common type
  # is exact, and dx (computed in float32) is rounded once, to x.dtype: the
  # reference's values. Costs an XLA convert pass only for mixed dtypes.
  common = jnp.promote_types(dy.dtype, x.dtype)
  if blocks is None:
    blocks = backward_blocks(m, h)
  elif isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= 65535:
    raise ValueError(f"blocks must be an int in [1, 65535] (the kernel's grid), got {blocks!r}.")
  outs = (_sds((m, h), common), _sds((h,), _F32), _sds((0,) if rms else (h,), _F32),
          _sds((1 if rms else 2, blocks, h), _F32))
  dx, dgamma, dbeta, _ = jax.ffi.ffi_call("te_jax_norm_backward", outs)(
      dy.astype(common), x.astype(common), _f32(gamma), _f32(mean), rstd,
      rmsnorm=np.int64(rms), zero_centered_gamma=np.int64(zero_centered))
  return (dx.astype(x.dtype), dgamma.astype(gamma.dtype),
          None if rms else dbeta.astype(gamma.dtype))
