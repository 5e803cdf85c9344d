"""CUDA custom-call path of ``ops/quantize.py`` (FFI handlers in
``custom_calls/ffi/quantize.cc``).

Each function returns exactly the ``QuantizedTensor`` the reference of the
dispatcher in ``quantize.py`` returns, bit for bit. The blockwise kernels write scale_inv
in the layouts cuBLASLt reads (see ``custom_calls/README.md``); this module
exposes the LOGICAL layout ``(ceil(M/bm), ceil(K/bk))`` through a slice /
transpose that ``gemm_cuda.py`` undoes, so that under ``jit`` XLA cancels the
pair between a quantize and the GEMM that consumes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops.fp8 import QuantizedTensor, nan_scale_inv_if_non_finite

__all__ = ["quantize_tensorwise", "quantize_current", "quantize_from_amax",
           "quantize_blockwise", "native_scale_shapes"]

_F32 = jnp.float32
_BLOCK_SHAPES = ((1, 128), (128, 128))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _round_up(a: int, b: int) -> int:
  return _cdiv(a, b) * b


def _check_grid(m: int, name="x"):
  # The kernels put 128-row tiles on grid.y, which CUDA caps at 65535.
  if _cdiv(m, 128) > 65535:
    raise ValueError(f"{name} has {m} rows; the CUDA quantize kernels take at most "
                     f"{65535 * 128}: split the tensor or use impl='reference'.")


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def quantize_tensorwise(x, scale, dtype, columnwise: bool):
  """Per-tensor quantize with a given scale."""
  m, k = x.shape
  _check_grid(m)
  outs = (_sds((m, k), dtype), _sds((k, m) if columnwise else (0, 0), dtype), _sds((), _F32))
  data, data_t, amax = jax.ffi.ffi_call("te_jax_quantize_tensorwise", outs)(
      x, jnp.asarray(scale, _F32), columnwise=np.int64(bool(columnwise)))
  return nan_scale_inv_if_non_finite(
      _per_tensor(data, 1.0 / jnp.asarray(scale, _F32), data_t, amax, columnwise))


def _per_tensor(data, scale_inv, data_t, amax, columnwise):
  if not columnwise:
    return QuantizedTensor(data, scale_inv, amax=amax)
  return QuantizedTensor(data, scale_inv, data_t, scale_inv, amax)


def quantize_current(x, dtype, columnwise: bool):
  """Current scaling (two reads of x: the amax, then the cast)."""
  m, k = x.shape
  _check_grid(m)
  outs = (_sds((m, k), dtype), _sds((k, m) if columnwise else (0, 0), dtype),
          _sds((), _F32), _sds((), _F32))
  data, data_t, scale_inv, amax = jax.ffi.ffi_call("te_jax_quantize_current", outs)(
      x, columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, amax, columnwise)


def quantize_from_amax(x, amax, dtype, columnwise: bool):
  """Current scaling from a given amax."""
  m, k = x.shape
  _check_grid(m)
  outs = (_sds((m, k), dtype), _sds((k, m) if columnwise else (0, 0), dtype), _sds((), _F32))
  data, data_t, scale_inv = jax.ffi.ffi_call("te_jax_quantize_from_amax", outs)(
      x, jnp.asarray(amax, _F32), columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, jnp.asarray(amax, _F32), columnwise)


def native_scale_shapes(m: int, k: int, block_shape):
  """Shapes of the cuBLASLt-layout scale_inv arrays of an (m, k) tensor.

  Returns (rowwise, columnwise):
    (1, 128): VEC128, rows contiguous: (ceil(k/128), roundup(m, 4)) and, for
      the copy of x.T, (ceil(m/128), roundup(k, 4)).
    (128, 128): BLK128x128, K-blocks contiguous with the leading dimension
      padded to 4: (ceil(m/128), roundup(ceil(k/128), 4)) and
      (ceil(k/128), roundup(ceil(m/128), 4)).
  """
  if tuple(block_shape) == (1, 128):
    return (_cdiv(k, 128), _round_up(m, 4)), (_cdiv(m, 128), _round_up(k, 4))
  mb, kb = _cdiv(m, 128), _cdiv(k, 128)
  return (mb, _round_up(kb, 4)), (kb, _round_up(mb, 4))


def quantize_blockwise(x, block_shape, dtype, power_2_scale: bool, columnwise: bool):
  """Blockwise quantize (amax None: every tile has its own).

  Only (1, 128) (with 128x1 tiles for the columnwise copy) and (128, 128)
  have kernels.
  """
  block_shape = tuple(block_shape)
  if block_shape not in _BLOCK_SHAPES:
    raise ValueError(f"block_shape must be (1, 128) or (128, 128) for the CUDA path, "
                     f"got {block_shape!r}; use impl='reference' for other tiles.")
  m, k = x.shape
  _check_grid(m)
  s_shape, st_shape = native_scale_shapes(m, k, block_shape)
  outs = (_sds((m, k), dtype), _sds(s_shape, _F32),
          _sds((k, m) if columnwise else (0, 0), dtype),
          _sds(st_shape if columnwise else (0, 0), _F32))
  data, s, data_t, st = jax.ffi.ffi_call("te_jax_quantize_blockwise", outs)(
      x, block_rows=np.int64(block_shape[0]), power_2_scale=np.int64(bool(power_2_scale)),
      columnwise=np.int64(bool(columnwise)))
  if block_shape == (1, 128):
    scale_inv = s[:, :m].T                      # (m, ceil(k/128))
    scale_inv_t = st[:, :k].T if columnwise else None  # (k, ceil(m/128))
  else:
    scale_inv = s[:, :_cdiv(k, 128)]            # (ceil(m/128), ceil(k/128))
    scale_inv_t = st[:, :_cdiv(m, 128)] if columnwise else None
  if not columnwise:
    return QuantizedTensor(data, scale_inv, block_shape=block_shape)
  return QuantizedTensor(data, scale_inv, data_t, scale_inv_t, None, block_shape)
