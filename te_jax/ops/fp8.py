"""FP8 formats and the two values every op passes around.

* :class:`ScaledTensor`: one FP8 matrix with the scales that dequantize it,
  the operand type of ``gemm``.
* :class:`QuantizedTensor`: what every quantize-family op returns (the
  rowwise copy, the columnwise copy a backward GEMM reads, their scales and
  the amax), so that callers never depend on a tuple order.

This module is the bottom of te_jax: it imports nothing from the package.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["FP8_DTYPES", "fp8_max", "amax", "pmax_amax", "FP8Payload", "fp8_payload", "ScaledTensor",
           "QuantizedTensor", "dequantize_blockwise_reference", "nan_scale_inv_if_non_finite"]

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_FP8_MAX = {FP8_DTYPES[0]: 448.0, FP8_DTYPES[1]: 57344.0}


def fp8_max(dtype) -> float:
  """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).

  >>> fp8_max(jnp.float8_e5m2)
  57344.0
  """
  dtype = jnp.dtype(dtype)
  if dtype not in _FP8_MAX:
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}.")
  return _FP8_MAX[dtype]


# |v| as bits: clearing the sign bit of a float32 is its absolute value, and
# for non-negative floats the unsigned integer order of the bits is the float
# order with every NaN above +Inf. A max over these bits is therefore a
# NaN-propagating max|v| on every backend, which a float reduce-max is not:
# XLA:CPU's vectorized reduce-max drops a NaN (and can return -inf) for some
# shapes. The CUDA kernels reduce the same bits (custom_calls/kernels/tile.cuh,
# AbsBits).
_ABS_MASK = 0x7FFFFFFF


def _abs_bits(v: jax.Array) -> jax.Array:
  bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
  return bits & jnp.uint32(_ABS_MASK)


def amax(x: jax.Array, axis=None) -> jax.Array:
  """``max|x|`` over ``axis`` (all axes by default) as float32, NaN wherever
  the reduced elements hold a NaN, on every backend.

  Exact: no flush of subnormals, the same value as the kernels' amax. Every
  amax te_jax's references and scaling modes take goes through this.

  >>> float(amax(jnp.array([1.0, -3.0, 2.0])))
  3.0
  >>> amax(jnp.ones((128, 128)).at[127, 127].set(jnp.nan)).tolist()
  nan
  """
  return lax.bitcast_convert_type(jnp.max(_abs_bits(x), axis=axis), jnp.float32)


def pmax_amax(value: jax.Array, axis_name) -> jax.Array:
  """``lax.pmax`` of amaxes (values >= 0 or NaN) over mesh axes ``axis_name``,
  NaN-propagating like :func:`amax` (a plain ``pmax`` may drop a NaN on CPU)."""
  bits = _abs_bits(value)
  # pmax needs its operand varying over every axis it reduces (JAX >= 0.11
  # checks it under shard_map), and an amax of a tensor sharded over only some
  # of them is invariant over the rest. Adding a zero built from axis_index
  # makes it varying over all of them, on every JAX version, with or without
  # check_vma; XLA folds the addition away.
  bits = bits + jnp.zeros_like(bits) * lax.axis_index(axis_name).astype(bits.dtype)
  return lax.bitcast_convert_type(lax.pmax(bits, axis_name), jnp.float32)


def tile(x: jax.Array, block_shape) -> Tuple[jax.Array, int, int]:
  """Zero-pads 2-D ``x`` (M, K) to whole tiles; returns (tiles, M, K).

  ``tiles`` has shape (ceil(M/bm), bm, ceil(K/bk), bk).
  """
  (m, k), (bm, bk) = x.shape, block_shape
  mt, kt = -(-m // bm), -(-k // bk)
  xp = jnp.pad(x, ((0, mt * bm - m), (0, kt * bk - k)))
  return xp.reshape(mt, bm, kt, bk), m, k


def dequantize_blockwise_reference(data: jax.Array, scale_inv: jax.Array,
                                   block_shape=(1, 128),
                                   dtype=jnp.float32) -> jax.Array:
  """``data * scale_inv`` broadcast over (bm, bk) tiles: (M, K) in ``dtype``.

  Args:
    data: (M, K) FP8.
    scale_inv: (ceil(M/bm), ceil(K/bk)) float32.
    block_shape: (bm, bk).
    dtype: output dtype.
  """
  tiles, m, k = tile(data.astype(jnp.float32), block_shape)
  x = tiles * scale_inv.astype(jnp.float32)[:, None, :, None]
  return x.reshape(tiles.shape[0] * tiles.shape[1], -1)[:m, :k].astype(dtype)


class FP8Payload:
  """What every FP8 operand type shares: the shape and dtype of its FP8
  ``data``, and the rule that only per-tensor scales and square tiles
  survive a transpose (:meth:`check_transposable`)."""

  @property
  def shape(self):
    return self.data.shape

  @property
  def dtype(self):
    return self.data.dtype

  def check_transposable(self, fix: str) -> None:
    """Raises a ValueError (ending with ``fix``) unless the scales are
    per-tensor or square tiles, the only ones a transpose keeps a tiling of."""
    if self.block_shape is not None and self.block_shape[0] != self.block_shape[1]:
      raise ValueError(f"the transpose of {self.block_shape} tiles is not a tiling of "
                       f"the same shape; {fix}")


def fp8_payload(cls):
  """Makes an :class:`FP8Payload` subclass a frozen dataclass and a pytree
  whose leaves are ``data`` and ``scale_inv``; ``block_shape`` is static."""
  return jax.tree_util.register_dataclass(
      dataclasses.dataclass(frozen=True)(cls),
      data_fields=["data", "scale_inv"], meta_fields=["block_shape"])


@fp8_payload
class ScaledTensor(FP8Payload):
  """An FP8 matrix ``data`` with ``data * scale_inv ~= x``.

  Attributes:
    data: float8 array of shape (rows, cols).
    scale_inv: float32; shape () for per-tensor scaling, or
      (ceil(rows / bm), ceil(cols / bk)) with one entry per tile for blockwise
      scaling.
    block_shape: None for per-tensor scaling, else the tile shape (bm, bk).

  >>> t = ScaledTensor(jnp.full((2, 2), 3.0, jnp.float8_e4m3fn), jnp.float32(0.5))
  >>> t.dequantize().tolist()
  [[1.5, 1.5], [1.5, 1.5]]
  """

  data: jax.Array
  scale_inv: jax.Array
  block_shape: Optional[Tuple[int, int]] = None

  @property
  def T(self) -> "ScaledTensor":  # pylint: disable=invalid-name
    """The transpose; exact for per-tensor scales and square blocks only."""
    self.check_transposable("quantize x.T instead (columnwise=True).")
    s = self.scale_inv if self.block_shape is None else self.scale_inv.T
    return ScaledTensor(self.data.T, s, self.block_shape)

  def rows(self, start: int, stop: int) -> "ScaledTensor":
    """Rows [start, stop) of this (rows, cols) matrix with their slice of the
    scales. Both ends must fall on scale-tile boundaries (anywhere for
    per-tensor scales, multiples of ``block_shape[0]`` for blockwise ones;
    ``stop`` may also be the last row), so that the rows dequantize exactly as
    they did in the whole."""
    total = self.shape[0]
    bm = 1 if self.block_shape is None else self.block_shape[0]
    if not (0 <= start < stop <= total) or start % bm or (stop % bm and stop != total):
      raise ValueError(f"rows [{start}, {stop}) of {total} do not start and end on "
                       f"{bm}-row scale tiles (block_shape {self.block_shape}).")
    if self.block_shape is None:
      return ScaledTensor(self.data[start:stop], self.scale_inv, None)
    return ScaledTensor(self.data[start:stop], self.scale_inv[start // bm:-(-stop // bm)],
                        self.block_shape)

  def row_blocks(self, n: int) -> Tuple["ScaledTensor", ...]:
    """The ``n`` equal row blocks of this (rows, cols) matrix, each with its
    own slice of the scales: (rows / n, cols) each.

    ``rows / n`` must be a whole number of scale tiles (any size for
    per-tensor scales, a multiple of ``block_shape[0]`` for blockwise ones),
    so that every block's values dequantize exactly as they did in the whole.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"n must be an int >= 1, got {n!r}.")
    rows = self.shape[0]
    bm = 1 if self.block_shape is None else self.block_shape[0]
    if rows % n or (rows // n) % bm:
      raise ValueError(f"cannot split {rows} rows into {n} equal blocks of whole "
                       f"{bm}-row scale tiles (block_shape {self.block_shape}).")
    size = rows // n
    return tuple(self.rows(i * size, (i + 1) * size) for i in range(n))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Returns ``data * scale_inv`` (broadcast over tiles) in ``dtype``."""
    if self.block_shape is None:
      return (self.data.astype(jnp.float32) * self.scale_inv).astype(dtype)
    return dequantize_blockwise_reference(self.data, self.scale_inv,
                                          self.block_shape, dtype)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale_inv", "data_t", "scale_inv_t", "amax"],
    meta_fields=["block_shape"])
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """The result of every quantize-family op (``ops/quantize.py``,
  ``ops/act_quantize.py``, ``ops/concat_quantize.py``).

  For a quantized (M, K) value ``v``:

  Attributes:
    data: (M, K) FP8, ``v`` quantized rowwise.
    scale_inv: float32 scale inverse of ``data``: () per tensor, or
      (ceil(M/bm), ceil(K/bk)) per tile.
    data_t: (K, M) FP8, the quantization of ``v.T`` with the same
      ``block_shape`` (the operand the weight-gradient GEMM reads), or None
      when the op was not asked for it.
    scale_inv_t: its scale inverse, () or (ceil(K/bm), ceil(M/bk)); None
      with ``data_t``.
    amax: ``max|v|`` as a float32 scalar, or None where the op does not
      compute one (blockwise: each tile has its own).
    block_shape: None for per-tensor scaling, else (bm, bk).
  """

  data: jax.Array
  scale_inv: jax.Array
  data_t: Optional[jax.Array] = None
  scale_inv_t: Optional[jax.Array] = None
  amax: Optional[jax.Array] = None
  block_shape: Optional[Tuple[int, int]] = None

  def rowwise(self) -> ScaledTensor:
    """``data`` as a GEMM operand contiguous along K (M, K)."""
    if self.data is None:
      raise ValueError("this QuantizedTensor has no rowwise copy; quantize with "
                       "rowwise=True.")
    return ScaledTensor(self.data, self.scale_inv, self.block_shape)

  def columnwise(self) -> ScaledTensor:
    """``data_t`` as a GEMM operand contiguous along M (K, M)."""
    if self.data_t is None:
      raise ValueError("this QuantizedTensor has no columnwise copy; quantize with "
                       "columnwise=True.")
    return ScaledTensor(self.data_t, self.scale_inv_t, self.block_shape)

  def replace(self, **changes) -> "QuantizedTensor":
    return dataclasses.replace(self, **changes)


def nan_scale_inv_if_non_finite(q: QuantizedTensor) -> QuantizedTensor:
  """``q`` with NaN scale inverses when its (per-tensor) amax is not finite.

  For ops quantizing with a given scale (delayed scaling): the saturating
  cast turns +-Inf into +-fp8_max, and a NaN scale_inv is what still makes a
  GEMM that reads the tensor non-finite. Unchanged when ``q.amax`` is None.
  """
  if q.amax is None:
    return q
  bad = ~jnp.isfinite(q.amax)
  nan = jnp.float32(jnp.nan)
  return q.replace(
      scale_inv=jnp.where(bad, nan, q.scale_inv),
      scale_inv_t=None if q.scale_inv_t is None else jnp.where(bad, nan, q.scale_inv_t))
