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

from te_jax.ops import act_quantize_cuda
from te_jax.ops import tiling

__all__ = ["norm_stats", "norm_quantize", "norm_backward", "MAX_HIDDEN", "backward_blocks"]

_F32 = jnp.float32
MAX_HIDDEN = 8192   # custom_calls/kernels/normalization.h: kNormBwdMaxHidden
# CUDA blocks of the backward kernel: each takes every `blocks`-th row and
# writes one row of partial dgamma/dbeta sums. The kernel runs H / 8 threads
# per block within a 64-register budget (launch bounds of 1024 threads), so an
# SM holds 1024 / threads blocks: the grid fills an H100's or H200's 132 SMs with that
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
                  dtype, scale, power_2_scale: bool, *, rowwise: bool = True,
                  columnwise: bool = True, stats=None, amax=None):
  """(QuantizedTensor of norm(x), mean or None, rstd); see ``normalization.norm_quantize``.

  ``stats``: the (mean or None, rstd) to normalize with instead of a
  statistics pass (``normalization.norm_quantize_with_stats``), returned as
  given. ``amax``: max|norm(x)| known beforehand ("current": the scale's,
  required with ``stats``; "tensorwise": returned instead of computed).
  """
  m, h = x.shape
  given = stats is not None
  none = jnp.zeros((0,), _F32)
  mean_in, rstd_in = ((none, none) if not given else
                      (none if stats[0] is None else stats[0], stats[1]))
  stats_out = (_sds((0,) if rms or given else (m,), _F32), _sds((0,) if given else (m,), _F32))
  attrs = dict(rmsnorm=np.int64(rms), zero_centered_gamma=np.int64(zero_centered),
               epsilon=np.float32(epsilon))
  operands = (x, _f32(gamma), _f32(beta))
  fp8 = act_quantize_cuda.fp8_outputs(m, h, dtype, rowwise, columnwise)
  # amax: a result unless the caller has it.
  amax_out = _sds((0,) if amax is not None else (), _F32)

  def stats_result(mean, rstd):
    if given:
      return stats
    return (None if rms else mean), rstd

  if mode == "blockwise":
    grids = act_quantize_cuda.scale_grid_outputs(m, h, tiling.mode_layout(mode), rowwise,
                                                 columnwise)
    data, s, data_t, st, mean, rstd = jax.ffi.ffi_call(
        "te_jax_norm_quantize_blockwise", (fp8[0], grids[0], fp8[1], grids[1]) + stats_out)(
            *operands, mean_in, rstd_in, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
    amax_result = None
  else:
    outs = fp8 + (_sds((), _F32), amax_out) + stats_out
    if mode == "tensorwise":
      data, data_t, s, amax_result, mean, rstd = jax.ffi.ffi_call(
          "te_jax_norm_quantize_tensorwise", outs)(
              *operands, jnp.asarray(scale, _F32), mean_in, rstd_in, **attrs)
    else:   # current
      amax_in = none if amax is None else jnp.asarray(amax, _F32)
      data, data_t, s, amax_result, mean, rstd = jax.ffi.ffi_call(
          "te_jax_norm_quantize_current", outs)(
              *operands, amax_in, mean_in, rstd_in,
              power_2_scale=np.int64(bool(power_2_scale)), **attrs)
    if amax is not None:
      amax_result = amax
    st = s
  q = act_quantize_cuda.selected_result(mode, m, h, data, s, data_t, st, amax_result, rowwise,
                                        columnwise)
  return (q,) + stats_result(mean, rstd)


def norm_backward(dy, x, gamma, mean, rstd, zero_centered: bool, blocks: int | None = None,
                  dy_add=None, dx_add=None):
  """(dx in x.dtype, dgamma and dbeta in gamma.dtype, dbeta None for rmsnorm).

  ``blocks`` overrides :func:`backward_blocks` (benchmarks compare grids with it).
  ``dy_add`` (dy's shape and dtype, or None): the cotangent is ``dy + dy_add``,
  which the kernel sums as it reads them. ``dx_add`` (x's shape and dtype, or
  None): added to dx as the kernel stores it.
  """
  rms = mean is None
  m, h = x.shape
  # The kernel reads both with one element type. Widening to the common type
  # is exact, and dx (computed in float32) is rounded once, to x.dtype: the
  # reference's values. Costs an XLA convert pass only for mixed dtypes.
  common = jnp.promote_types(dy.dtype, x.dtype)
  if dy_add is not None and common != dy.dtype:
    # The kernel rounds the sum to the common type; the reference rounds it
    # to dy's. Mixed dtypes are not the fused path's case: XLA adds.
    dy, dy_add = dy + dy_add, None
  late_add = None
  if dx_add is not None and common != x.dtype:   # dx is rounded to x.dtype after the kernel
    dx_add, late_add = None, dx_add
  if blocks is None:
    blocks = backward_blocks(m, h)
  elif isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= 65535:
    raise ValueError(f"blocks must be an int in [1, 65535] (the kernel's grid), got {blocks!r}.")
  outs = (_sds((m, h), common), _sds((h,), _F32), _sds((0,) if rms else (h,), _F32),
          _sds((1 if rms else 2, blocks, h), _F32))
  none = jnp.zeros((0, 0), common)
  dx, dgamma, dbeta, _ = jax.ffi.ffi_call("te_jax_norm_backward", outs)(
      dy.astype(common), none if dy_add is None else dy_add,
      none if dx_add is None else dx_add, x.astype(common), _f32(gamma), _f32(mean), rstd,
      rmsnorm=np.int64(rms), zero_centered_gamma=np.int64(zero_centered))
  dx = dx.astype(x.dtype)
  if late_add is not None:
    dx = dx + late_add
  return (dx, dgamma.astype(gamma.dtype),
          None if rms else dbeta.astype(gamma.dtype))
