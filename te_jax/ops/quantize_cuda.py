"""CUDA custom-call path of ``ops/quantize.py`` (FFI handlers in
``custom_calls/ffi/quantize.cc``).

Each function returns exactly the ``QuantizedTensor`` the reference of the
dispatcher in ``quantize.py`` returns, bit for bit. The blockwise kernels
write scale_inv in the native layouts of the tiling table (``tiling.py``);
this module exposes the LOGICAL layout ``(ceil(M/bm), ceil(K/bk))`` through
``TileLayout.from_native`` (a slice / transpose) that ``gemm_cuda.py`` undoes,
so that under ``jit`` XLA cancels the pair between a quantize and the GEMM
that consumes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor, nan_scale_inv_if_non_finite

__all__ = ["quantize_tensorwise", "quantize_current", "quantize_from_amax",
           "quantize_blockwise", "native_scale_shapes", "BLOCKWISE_LAYOUTS",
           "quantize_stack_tensorwise", "quantize_stack_current", "quantize_stack_from_amax",
           "quantize_stack_blockwise", "CUDA_MAX_ENTRIES"]

_F32 = jnp.float32
# The layouts te_jax_quantize_blockwise has kernels for; its block_rows
# attribute is the layout's block_shape[0].
BLOCKWISE_LAYOUTS = (tiling.TILE_1X128, tiling.BLOCK_128X128)


# The stack kernels put the entries on grid.z, which CUDA caps at 65535
# (custom_calls/kernels/quantize.h: kMaxStackEntries).
CUDA_MAX_ENTRIES = 65535


def _check_rows(m: int, name="x"):
  """ValueError unless the quantize kernels' grid takes ``m`` rows."""
  if m > tiling.CUDA_MAX_ROWS:
    raise ValueError(f"{name} has {m} rows; the CUDA quantize kernels take at most "
                     f"{tiling.CUDA_MAX_ROWS}: split the tensor or use impl='reference'.")


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def quantize_tensorwise(x, scale, dtype, columnwise: bool):
  """Per-tensor quantize with a given scale."""
  m, k = x.shape
  _check_rows(m)
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
  _check_rows(m)
  outs = (_sds((m, k), dtype), _sds((k, m) if columnwise else (0, 0), dtype),
          _sds((), _F32), _sds((), _F32))
  data, data_t, scale_inv, amax = jax.ffi.ffi_call("te_jax_quantize_current", outs)(
      x, columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, amax, columnwise)


def quantize_from_amax(x, amax, dtype, columnwise: bool):
  """Current scaling from a given amax."""
  m, k = x.shape
  _check_rows(m)
  outs = (_sds((m, k), dtype), _sds((k, m) if columnwise else (0, 0), dtype), _sds((), _F32))
  data, data_t, scale_inv = jax.ffi.ffi_call("te_jax_quantize_from_amax", outs)(
      x, jnp.asarray(amax, _F32), columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, jnp.asarray(amax, _F32), columnwise)


def native_scale_shapes(m: int, k: int, layout: tiling.TileLayout):
  """Shapes of the native scale_inv arrays of an (m, k) tensor in ``layout``.

  Returns (rowwise, columnwise): the native grid of the (m, k) tensor and of
  its columnwise copy, the quantization of x.T (k, m) in the same layout.
  """
  return layout.native_scale_shape(m, k), layout.native_scale_shape(k, m)


def blockwise_scale_outputs(m: int, k: int, layout: tiling.TileLayout, columnwise: bool):
  """The two scale results of a blockwise kernel for an (m, k) tensor:
  native rowwise and columnwise grids ((0, 0) without ``columnwise``)."""
  s_shape, st_shape = native_scale_shapes(m, k, layout)
  return (_sds(s_shape, layout.scale_dtype),
          _sds(st_shape if columnwise else (0, 0), layout.scale_dtype))


def blockwise_result(data, s, data_t, st, m: int, k: int, layout: tiling.TileLayout
                     ) -> QuantizedTensor:
  """The ``QuantizedTensor`` of a blockwise kernel's results for an (m, k)
  tensor: native scale grids turned into logical ones (``data_t`` None: no
  columnwise copy)."""
  scale_inv = layout.from_native(s, m, k)
  if data_t is None:
    return QuantizedTensor(data, scale_inv, block_shape=layout.block_shape)
  return QuantizedTensor(data, scale_inv, data_t, layout.from_native(st, k, m), None,
                         layout.block_shape)


def _kernel_layout(block_shape) -> tiling.TileLayout:
  """The :data:`BLOCKWISE_LAYOUTS` row of ``block_shape``; ValueError for a
  tile no kernel writes."""
  layout = tiling.layout_of(block_shape)
  if layout not in BLOCKWISE_LAYOUTS:
    names = " or ".join(str(l.block_shape) for l in BLOCKWISE_LAYOUTS)
    raise ValueError(f"block_shape must be {names} for the CUDA path, "
                     f"got {block_shape!r}; use impl='reference' for other tiles.")
  return layout


def quantize_blockwise(x, block_shape, dtype, power_2_scale: bool, columnwise: bool):
  """Blockwise quantize (amax None: every tile has its own).

  Only the :data:`BLOCKWISE_LAYOUTS` have kernels: (1, 128) (with 128x1
  tiles for the columnwise copy) and (128, 128).
  """
  layout = _kernel_layout(block_shape)
  m, k = x.shape
  _check_rows(m)
  s_out, st_out = blockwise_scale_outputs(m, k, layout, columnwise)
  outs = (_sds((m, k), dtype), s_out, _sds((k, m) if columnwise else (0, 0), dtype), st_out)
  data, s, data_t, st = jax.ffi.ffi_call("te_jax_quantize_blockwise", outs)(
      x, block_rows=np.int64(layout.block_shape[0]),
      power_2_scale=np.int64(bool(power_2_scale)), columnwise=np.int64(bool(columnwise)))
  return blockwise_result(data, s, data_t if columnwise else None, st, m, k, layout)


# ------------------------------------------------------------------ stacks --
# x (E, M, K): every entry quantized as the 2-D function above quantizes it
# alone, in one launch (te_jax_quantize_stack_*); each field of the result
# has a leading E axis.

def _stack_shape(x):
  e, m, k = x.shape
  _check_rows(m)
  if e > CUDA_MAX_ENTRIES:
    raise ValueError(f"x has {e} entries; the CUDA stack quantize takes at most "
                     f"{CUDA_MAX_ENTRIES}: split the stack or use impl='reference'.")
  return e, m, k


def _stack_data(e, m, k, dtype, columnwise):
  """The data (E, M, K) and data_t (E, K, M) results ((0, 0, 0) without
  ``columnwise``)."""
  return _sds((e, m, k), dtype), _sds((e, k, m) if columnwise else (0, 0, 0), dtype)


def quantize_stack_tensorwise(x, scale, dtype, columnwise: bool):
  """Per-tensor quantize of each entry with its given scale (E,)."""
  e, m, k = _stack_shape(x)
  scale = jnp.asarray(scale, _F32)
  data, data_t, amax = jax.ffi.ffi_call(
      "te_jax_quantize_stack_tensorwise", (*_stack_data(e, m, k, dtype, columnwise),
                                           _sds((e,), _F32)))(
      x, scale, columnwise=np.int64(bool(columnwise)))
  return nan_scale_inv_if_non_finite(_per_tensor(data, 1.0 / scale, data_t, amax, columnwise))


def quantize_stack_current(x, dtype, columnwise: bool):
  """Current scaling of each entry: one amax launch over the stack, one cast."""
  e, m, k = _stack_shape(x)
  data, data_t, scale_inv, amax = jax.ffi.ffi_call(
      "te_jax_quantize_stack_current", (*_stack_data(e, m, k, dtype, columnwise),
                                        _sds((e,), _F32), _sds((e,), _F32)))(
      x, columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, amax, columnwise)


def quantize_stack_from_amax(x, amax, dtype, columnwise: bool):
  """Current scaling of each entry from its given amax (E,)."""
  e, m, k = _stack_shape(x)
  amax = jnp.asarray(amax, _F32)
  data, data_t, scale_inv = jax.ffi.ffi_call(
      "te_jax_quantize_stack_from_amax", (*_stack_data(e, m, k, dtype, columnwise),
                                          _sds((e,), _F32)))(
      x, amax, columnwise=np.int64(bool(columnwise)))
  return _per_tensor(data, scale_inv, data_t, amax, columnwise)


def quantize_stack_blockwise(x, block_shape, dtype, power_2_scale: bool, columnwise: bool):
  """Blockwise quantize of each entry; scale grids (E, ...) in the logical
  layout of each entry (``TileLayout.from_native`` per entry)."""
  layout = _kernel_layout(block_shape)
  e, m, k = _stack_shape(x)
  s_shape, st_shape = native_scale_shapes(m, k, layout)
  data_out, data_t_out = _stack_data(e, m, k, dtype, columnwise)
  outs = (data_out, _sds((e, *s_shape), layout.scale_dtype), data_t_out,
          _sds((e, *st_shape) if columnwise else (0, 0, 0), layout.scale_dtype))
  data, s, data_t, st = jax.ffi.ffi_call("te_jax_quantize_stack_blockwise", outs)(
      x, block_rows=np.int64(layout.block_shape[0]),
      power_2_scale=np.int64(bool(power_2_scale)), columnwise=np.int64(bool(columnwise)))
  # Each entry's results as the 2-D op assembles them (blockwise_result).
  if not columnwise:
    data_t = st = None
  return jax.vmap(lambda d, si, dt, sti: blockwise_result(d, si, dt, sti, m, k, layout))(
      data, s, data_t, st)
