"""FP8 quantize of a concatenation, read from its parts.

``concat_quantize(parts, ...)`` is ``quantize_*(concatenate(parts, axis=1),
columnwise=True)`` (``ops/quantize.py``), bit for bit, but on the CUDA path
the concatenation is never written: one kernel reads the (M, F_i) parts and
writes both FP8 copies of the (M, sum F_i) result (``custom_calls/ffi/
concat_quantize.cc``). A fused projection whose outputs are used separately
(Q, K and V of attention) gets its output gradient as separate parts; this
op quantizes them for the backward GEMMs without XLA first concatenating them
(``te_jax.dense.fp8_dense_split``). The parts share M and the dtype; their
widths may differ (grouped-query attention: Q is heads * head_dim wide, K and
V groups * head_dim each).

>>> import jax.numpy as jnp
>>> from te_jax.ops import concat_quantize as cq
>>> parts = [jnp.ones((256, w), jnp.bfloat16) * i for i, w in ((1, 256), (2, 64), (3, 64))]
>>> q = cq.concat_quantize(parts, mode="current", dtype=jnp.float8_e5m2)
>>> q.data.shape, q.data_t.shape, float(q.amax)
((256, 384), (384, 256), 3.0)
>>> cq.concat_quantize_supported(256, [256, 64, 64])
True
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import _native
from te_jax.ops import concat_quantize_cuda
from te_jax.ops import quantize as quantize_op
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor

__all__ = ["MODES", "concat_quantize", "concat_quantize_reference",
           "concat_quantize_supported"]

MODES = quantize_op.MODES
MAX_PARTS = 4  # custom_calls/kernels/quantize.h: kMaxConcatParts



def _check(parts, mode, dtype, scale, power_2_scale):
  if not isinstance(parts, (list, tuple)) or not parts:
    raise TypeError(f"parts must be a non-empty list or tuple of arrays, got {parts!r}.")
  for i, p in enumerate(parts):
    quantize_op.check_input(p, f"parts[{i}]", 2)
    if p.shape[0] != parts[0].shape[0]:
      raise ValueError(f"every part needs the rows M of parts[0] (M = {parts[0].shape[0]}; "
                       f"the widths may differ); parts[{i}] has shape {p.shape}.")
    if p.dtype != parts[0].dtype:
      raise ValueError(f"every part needs the dtype of parts[0] ({parts[0].dtype}); "
                       f"parts[{i}] is {p.dtype}. Cast the parts to one dtype first.")
  return quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)


def concat_quantize_reference(parts: Sequence[jax.Array], *, mode: str, dtype,
                              scale=None, power_2_scale: bool = False) -> QuantizedTensor:
  """Pure-JAX ``concat_quantize``: the ``ops/quantize.py`` references applied
  to ``jnp.concatenate(parts, axis=1)``."""
  dtype, scale = _check(parts, mode, dtype, scale, power_2_scale)
  return quantize_op.quantize_by_mode_reference(
      jnp.concatenate(parts, axis=1), mode, dtype, scale, power_2_scale)


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def concat_quantize_supported(m: int, widths: Sequence[int]) -> bool:
  """Whether the CUDA path takes parts of shapes (m, widths[0]), (m, widths[1]), ...

  ``widths`` holds one int per part, the parts' last dims, which may differ:
  1 to ``MAX_PARTS`` (4) parts, every width a positive multiple of 8 (a
  thread's 8 columns must lie in one part), and m from 1 to
  ``tiling.CUDA_MAX_ROWS`` (65535*128). Shapes only: ``impl="auto"`` falls
  back to the reference by itself where there is no GPU or native module.
  """
  if isinstance(widths, (str, bytes)):
    return False
  try:
    widths = tuple(widths)
  except TypeError:
    return False
  return (_is_int(m) and 1 <= m <= tiling.CUDA_MAX_ROWS and 1 <= len(widths) <= MAX_PARTS
          and all(_is_int(w) and w >= 8 and w % 8 == 0 for w in widths))


def concat_quantize(parts: Sequence[jax.Array], *, mode: str, dtype, scale=None,
                    power_2_scale: bool = False, impl: str = "auto") -> QuantizedTensor:
  """FP8 quantization of ``concatenate(parts, axis=1)``, both layouts, in one pass.

  Args:
    parts: list/tuple of (M, F_i) float32/bfloat16/float16 arrays sharing M
      and the dtype; the widths F_i may differ (the CUDA path takes 1 to 4
      parts, every F_i % 8 == 0).
    mode: "tensorwise" (given ``scale``, delayed scaling), "current" (scale
      from the amax of the concatenation) or "blockwise" (1x128 tiles, plus
      128x1 tiles for the columnwise copy).
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: float32 scalar for "tensorwise"; None otherwise.
    power_2_scale: round the scales down to powers of two ("blockwise" only).
    impl: "auto", "cuda" or "reference" (see ``ops/_native.py``).

  Returns:
    A ``QuantizedTensor``: data (M, K) FP8, K = sum F_i, and data_t (K, M)
    the quantization of the transposed concatenation.
    Per-tensor modes: scale_inv = scale_inv_t = 1/scale (float32 scalar),
    amax = max|v| (float32 scalar). "blockwise": scale_inv (M, ceil(K/128)),
    scale_inv_t (K, ceil(M/128)) (``quantize_blockwise``'s logical
    layout), amax None.

  Raises:
    TypeError/ValueError for bad arguments; ValueError when the CUDA path is
    chosen and ``concat_quantize_supported(M, [F_0, F_1, ...])`` is False.
  """
  dtype, scale = _check(parts, mode, dtype, scale, power_2_scale)
  parts = tuple(parts)
  def cuda():
    m = parts[0].shape[0]
    widths = [p.shape[1] for p in parts]
    if not concat_quantize_supported(m, widths):
      raise ValueError(
          f"the CUDA concat_quantize kernel does not take {len(parts)} parts of M = {m} "
          f"rows and widths {widths}: it needs 1 to {MAX_PARTS} parts, every width "
          f"F_i % 8 == 0 and M <= {tiling.CUDA_MAX_ROWS}. Check "
          "concat_quantize_supported(M, widths) first, or pass impl='reference'.")
    return concat_quantize_cuda.concat_quantize(parts, mode, dtype, scale, power_2_scale)
  return _native.dispatch(impl, cuda, lambda: concat_quantize_reference(
      parts, mode=mode, dtype=dtype, scale=scale, power_2_scale=power_2_scale))
