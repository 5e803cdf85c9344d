"""``ScaledTensor``: FP8 data together with the scales that dequantize it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

__all__ = ["ScaledTensor"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale_inv"],
    meta_fields=["block_shape"])
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
  """An FP8 matrix ``data`` with ``data * scale_inv ~= x``.

  Attributes:
    data: float8 array of shape (rows, cols).
    scale_inv: float32; shape () for per-tensor scaling, or
      (ceil(rows / bm), ceil(cols / bk)) with one entry per tile for blockwise
      scaling.
    block_shape: None for per-tensor scaling, else the tile shape (bm, bk).
  """

  data: jax.Array
  scale_inv: jax.Array
  block_shape: Optional[Tuple[int, int]] = None

  @property
  def shape(self):
    return self.data.shape

  @property
  def dtype(self):
    return self.data.dtype

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Returns ``data * scale_inv`` (broadcast over tiles) in ``dtype``."""
    from te_jax.ops.quantize import dequantize_blockwise_reference  # no cycle at import
    if self.block_shape is None:
      return (self.data.astype(jnp.float32) * self.scale_inv).astype(dtype)
    return dequantize_blockwise_reference(self.data, self.scale_inv,
                                          self.block_shape, dtype)
