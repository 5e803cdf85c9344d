"""CUDA custom-call path of ``ops/act_quantize.py`` (FFI handlers in
``custom_calls/ffi/act_quantize.cc``, kernels in ``custom_calls/kernels/``).

One call reads h (and dz) and writes both FP8 copies of v = act(h) or
dact(dz, h) plus the scales: v itself never reaches memory. The blockwise
scales come back in the LOGICAL layout of ``quantize_blockwise`` through the
same slice/transpose as ``quantize_cuda.py``, which ``gemm_cuda.py`` undoes
(XLA cancels the pair under ``jit``).

Argument checks live in ``act_quantize.py``; this module assumes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops.quantize_cuda import native_scale_shapes

__all__ = ["act_quantize", "ACT_IDS"]

_F32 = jnp.float32

# Activation ids of custom_calls/kernels/quantize.h (enum ActId).
ACT_IDS = {"linear": 0, "gelu": 1, "gelu_exact": 2, "relu": 3, "silu": 4, "swish": 4,
           "sigmoid": 5, "tanh": 6, "quick_gelu": 7}


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def act_quantize(h, dz, activations, mode: str, dtype, scale, power_2_scale: bool):
  """``(data, scale_inv, data_t, scale_inv_t, amax)`` of act(h) (``dz`` None)
  or of dact(dz, h); see ``act_quantize.act_quantize`` for the shapes."""
  backward = dz is not None
  n_act = len(activations)
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
  attrs = dict(backward=np.int64(backward), act0=np.int64(ACT_IDS[activations[0]]),
               act1=np.int64(ACT_IDS[activations[1]] if n_act == 2 else -1))
  fp8 = (_sds((m, w), dtype), _sds((w, m), dtype))
  if mode == "tensorwise":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_act_quantize_tensorwise", fp8 + (_sds((), _F32), _sds((), _F32)))(
            h, dz_arg, jnp.asarray(scale, _F32), **attrs)
    return data, scale_inv, data_t, scale_inv, amax
  if mode == "current":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_act_quantize_current", fp8 + (_sds((), _F32), _sds((), _F32)))(
            h, dz_arg, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
    return data, scale_inv, data_t, scale_inv, amax
  # blockwise: 1x128 rowwise, 128x1 for the columnwise copy (= 1x128 of v.T).
  s_shape, st_shape = native_scale_shapes(m, w, (1, 128))
  data, s, data_t, st = jax.ffi.ffi_call(
      "te_jax_act_quantize_blockwise",
      (fp8[0], _sds(s_shape, _F32), fp8[1], _sds(st_shape, _F32)))(
          h, dz_arg, power_2_scale=np.int64(bool(power_2_scale)), **attrs)
  return data, s[:, :m].T, data_t, st[:, :w].T, None
