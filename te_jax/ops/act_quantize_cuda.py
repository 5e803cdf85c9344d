"""CUDA custom-call path of ``ops/act_quantize.py`` (FFI handlers in
``custom_calls/ffi/act_quantize.cc``, kernels in ``custom_calls/kernels/``).

One call reads h (and dz) and writes both FP8 copies of v = act(h) or
dact(dz, h) plus the scales: v itself never reaches memory. The blockwise
scales come back in the LOGICAL layout of ``quantize_blockwise`` through the
layout's ``from_native`` (``tiling.py``), which ``gemm_cuda.py`` undoes (XLA
cancels the pair under ``jit``).

Argument checks live in ``act_quantize.py``; this module assumes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import quantize_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor, nan_scale_inv_if_non_finite

__all__ = ["act_quantize"]

_F32 = jnp.float32


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def act_quantize(h, dz, kernel_ids, mode: str, dtype, scale, power_2_scale: bool):
  """The ``QuantizedTensor`` of act(h) (``dz`` None) or of dact(dz, h).

  ``kernel_ids``: one or two ``ActId``s (``Activation.kernel_id``); see
  ``act_quantize.act_quantize`` for the shapes.
  """
  backward = dz is not None
  n_act = len(kernel_ids)
  m = h.shape[0]
  f = h.shape[1] // n_act
  w = n_act * f if backward else f
  if backward and dz.dtype != h.dtype:
    # The kernels read both inputs with one element type. Widening to the
    # common type is exact, so the float32 values (and the result) are those
    # of the reference; it costs one XLA convert pass.
    common = jnp.promote_types(dz.dtype, h.dtype)
    h, dz = h.astype(common), dz.astype(common)
  # The forward has no dz: a 0-element placeholder keeps one handler per mode.
  dz_arg = dz if backward else jnp.zeros((0, 0), h.dtype)
  attrs = dict(backward=np.int64(backward), act0=np.int64(kernel_ids[0]),
               act1=np.int64(kernel_ids[1] if n_act == 2 else -1))
  fp8 = (_sds((m, w), dtype), _sds((w, m), dtype))
  if mode == "tensorwise":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_act_quantize_tensorwise", fp8 + (_sds((), _F32), _sds((), _F32)))(
            h, dz_arg, jnp.asarray(scale, _F32), **attrs)
    return nan_scale_inv_if_non_finite(
        QuantizedTensor(data, scale_inv, data_t, scale_inv, amax))
  if mode == "current":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_act_quantize_current", fp8 + (_sds((), _F32), _sds((), _F32)))(
            h, dz_arg, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
    return QuantizedTensor(data, scale_inv, data_t, scale_inv, amax)
  # blockwise: the mode's tiles rowwise, and the same tiles of v.T for the
  # columnwise copy.
  layout = tiling.mode_layout(mode)
  s_out, st_out = quantize_cuda.blockwise_scale_outputs(m, w, layout, True)
  data, s, data_t, st = jax.ffi.ffi_call(
      "te_jax_act_quantize_blockwise", (fp8[0], s_out, fp8[1], st_out))(
          h, dz_arg, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
  return quantize_cuda.blockwise_result(data, s, data_t, st, m, w, layout)
