"""The ops tiling table: every way an FP8 matrix carries its scales, in one place.

A *tile layout* says how an FP8 matrix of shape (rows, K) is scaled: one
scale for the whole tensor, or one per (bm, bk) tile. Every quantize op, the
GEMM and their CUDA wrappers read the layout's facts from its row here
instead of spelling block shapes, mode ids or scale shapes themselves:

=================  ============  ===========  ===============================  =========
row                block_shape   scale dtype  native scale layout (cuBLASLt)   GEMM mode
=================  ============  ===========  ===============================  =========
``PER_TENSOR``     None          float32      one scalar (SCALAR_32F)          0
``TILE_1X128``     (1, 128)      float32      (ceil(K/128), rows), rows        1
                                              contiguous (VEC128_32F)
``BLOCK_128X128``  (128, 128)    float32      (ceil(rows/128), ceil(K/128)),   2
                                              K-blocks contiguous, leading
                                              dim a multiple of 4
                                              (BLK128x128_32F)
=================  ============  ===========  ===============================  =========

Two scale layouts exist for every tiled layout:

* the *logical* one, ``(ceil(rows/bm), ceil(K/bk))``, which every op returns
  (``ScaledTensor.scale_inv``, ``QuantizedTensor.scale_inv``) and the
  references compute;
* the *native* one, which the kernels write and cuBLASLt reads: the logical
  grid, transposed when ``TileLayout.scales_transposed``, its contiguous
  dimension padded to a multiple of ``TileLayout.scale_ld_multiple``.
  ``TileLayout.from_native`` / ``to_native`` convert; under ``jit`` XLA
  cancels the pair between a quantize and the GEMM that reads its result.

The columnwise copy of a tensor (the operand of the weight-gradient GEMM)
is the quantization of ``x.T`` in the same layout, so its scales are those
of a (K, rows) matrix: for ``TILE_1X128`` that is ``x`` tiled 128x1.

:data:`QUANTIZE_MODES` names the layout of each ``mode`` of the
fused-prologue quantize ops (``act_quantize``, ``dact_quantize``,
``concat_quantize``, ``norm_quantize``): "blockwise" is ``TILE_1X128``.
:data:`GEMM_PAIRS` lists the (a, b) layout pairs the GEMM takes.

The GEMM mode ids are the ``a_mode`` / ``b_mode`` attributes of the
``te_jax_gemm`` custom call (``custom_calls/ffi/gemm.cc``) and equal the
kernels' ``ScaleMode`` enum (``custom_calls/kernels/quantize.h``);
``tests/test_tiling.py`` reads both C++ files and checks they agree with
this table. ``docs/recipes.md`` ("How to add a tile layout") lists what a
new layout touches.

This module imports nothing from te_jax.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

__all__ = ["TileLayout", "PER_TENSOR", "TILE_1X128", "BLOCK_128X128", "LAYOUTS",
           "QUANTIZE_MODES", "GEMM_PAIRS", "KERNEL_TILE", "CUDA_MAX_ROWS", "layout_of",
           "mode_layout", "cdiv"]

# The quantize kernels run one CUDA block per KERNEL_TILE x KERNEL_TILE tile
# of x (custom_calls/kernels/tile.cuh: kTile), with the row tiles on grid.y,
# which CUDA caps at 65535: the most rows a quantize kernel takes.
KERNEL_TILE = 128
CUDA_MAX_ROWS = 65535 * KERNEL_TILE


def cdiv(a: int, b: int) -> int:
  """``ceil(a / b)`` for positive ints."""
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TileLayout:
  """One row of the tiling table (see the module doc).

  Attributes:
    name: short name used in messages ("tensor", "1x128", "128x128").
    block_shape: (bm, bk) of one scale tile, or None for one scale per tensor.
    scale_dtype: dtype of the scale inverses.
    gemm_mode: the ``a_mode`` / ``b_mode`` attribute of ``te_jax_gemm`` for an
      operand in this layout (the kernels' ``ScaleMode``).
    cublas_scale_mode: cuBLASLt's name of the native layout
      (``CUBLASLT_MATMUL_MATRIX_SCALE_<name>``).
    scales_transposed: the native grid is the logical one transposed
      ((ceil(K/bk), ceil(rows/bm)): rows contiguous).
    scale_ld_multiple: the native grid's contiguous dimension is padded to a
      multiple of this (cuBLASLt's leading-dimension rule).
  """

  name: str
  block_shape: Optional[Tuple[int, int]]
  scale_dtype: jnp.dtype
  gemm_mode: int
  cublas_scale_mode: str
  scales_transposed: bool = False
  scale_ld_multiple: int = 1

  @property
  def per_tensor(self) -> bool:
    return self.block_shape is None

  def scale_shape(self, rows: int, k: int) -> Tuple[int, ...]:
    """Logical scale_inv shape of a (rows, k) matrix: () or
    (ceil(rows/bm), ceil(k/bk))."""
    if self.per_tensor:
      return ()
    return (cdiv(rows, self.block_shape[0]), cdiv(k, self.block_shape[1]))

  def native_scale_shape(self, rows: int, k: int) -> Tuple[int, ...]:
    """Shape of the scale_inv array the kernels write for a (rows, k) matrix."""
    logical = self.scale_shape(rows, k)
    if not logical:
      return ()
    outer, inner = logical[::-1] if self.scales_transposed else logical
    m = self.scale_ld_multiple
    return (outer, cdiv(inner, m) * m)

  def from_native(self, s: jax.Array, rows: int, k: int) -> jax.Array:
    """The logical scale grid of a (rows, k) matrix from the native array ``s``."""
    logical = self.scale_shape(rows, k)
    if not logical:
      return s
    if self.scales_transposed:
      return s[:, :logical[0]].T
    return s[:, :logical[1]]

  def to_native(self, s: jax.Array) -> jax.Array:
    """The native array of the logical scale grid ``s`` (the inverse of
    :meth:`from_native`, padding with zeros)."""
    if self.per_tensor:
      return s
    if self.scales_transposed:
      s = s.T
    pad = -s.shape[1] % self.scale_ld_multiple
    return jnp.pad(s, ((0, 0), (0, pad))) if pad else s


PER_TENSOR = TileLayout("tensor", None, jnp.dtype(jnp.float32), gemm_mode=0,
                        cublas_scale_mode="SCALAR_32F")
TILE_1X128 = TileLayout("1x128", (1, 128), jnp.dtype(jnp.float32), gemm_mode=1,
                        cublas_scale_mode="VEC128_32F", scales_transposed=True,
                        scale_ld_multiple=4)
BLOCK_128X128 = TileLayout("128x128", (128, 128), jnp.dtype(jnp.float32), gemm_mode=2,
                           cublas_scale_mode="BLK128x128_32F", scale_ld_multiple=4)

LAYOUTS: Tuple[TileLayout, ...] = (PER_TENSOR, TILE_1X128, BLOCK_128X128)

# The ``mode`` argument of the fused-prologue quantize ops: a given per-tensor
# scale (delayed scaling), the per-tensor scale of this tensor's own amax,
# and 1x128 tiles (with 128x1 tiles for the columnwise copy).
QUANTIZE_MODES: Dict[str, TileLayout] = {
    "tensorwise": PER_TENSOR,
    "current": PER_TENSOR,
    "blockwise": TILE_1X128,
}

# (a, b) layouts of ``gemm(a, b)`` = a @ b.T that cuBLASLt takes on Hopper:
# fprop and dgrad (1x128 activations x 128x128 weights), wgrad (1x128 x 1x128,
# both tiled along the token contraction), and 128x128 x 1x128.
GEMM_PAIRS: Tuple[Tuple[TileLayout, TileLayout], ...] = (
    (PER_TENSOR, PER_TENSOR),
    (TILE_1X128, BLOCK_128X128),
    (TILE_1X128, TILE_1X128),
    (BLOCK_128X128, TILE_1X128),
)


def layout_of(block_shape) -> Optional[TileLayout]:
  """The table row whose block_shape is ``block_shape`` (None: per tensor),
  or None where no row has it (the references still take any tile)."""
  bs = None if block_shape is None else tuple(block_shape)
  for layout in LAYOUTS:
    if layout.block_shape == bs:
      return layout
  return None


def mode_layout(mode: str) -> TileLayout:
  """The layout a fused-prologue quantize ``mode`` writes; ValueError for an
  unknown mode."""
  if mode not in QUANTIZE_MODES:
    raise ValueError(f"mode must be one of {tuple(QUANTIZE_MODES)}, got {mode!r}.")
  return QUANTIZE_MODES[mode]
