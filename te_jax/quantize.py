"""Public FP8 quantization API (``docs/design.md``, "Public API").

On a GPU with the CUDA custom calls built these run our kernels; elsewhere the
pure-JAX references in ``te_jax.ops.quantize``, which are the spec.

:func:`quantize_rowwise_columnwise` is the quantization the FP8 layers use:
both copies a GEMM's forward and backward read (``x`` and ``x.T``, each
contiguous along its contraction dim) from one read of ``x``, in any
recipe's layout, as one :class:`QuantizedTensor`.

>>> import jax, jax.numpy as jnp
>>> from te_jax import quantize as q
>>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 300))
>>> data, scale_inv = q.quantize_blockwise(x, (1, 128))
>>> scale_inv.shape
(256, 3)
>>> x_hat = q.dequantize_blockwise(data, scale_inv, (1, 128))
>>> bool(jnp.max(jnp.abs(x_hat - x)) < 0.07 * jnp.max(jnp.abs(x)))
True
>>> qt = q.quantize_rowwise_columnwise(x, "blockwise", block_shape=(1, 128))
>>> qt.data.shape, qt.scale_inv.shape, qt.data_t.shape, qt.scale_inv_t.shape
((256, 300), (256, 3), (300, 256), (300, 2))
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from te_jax.ops import quantize as _op
from te_jax.ops.fp8 import QuantizedTensor

__all__ = ["quantize_tensorwise", "quantize_blockwise", "dequantize_blockwise",
           "quantize_rowwise_columnwise", "QuantizedTensor", "compute_scale"]

compute_scale = _op.compute_scale


def quantize_tensorwise(x: jax.Array, scale, dtype=jnp.float8_e4m3fn, *,
                        impl: str = "auto") -> Tuple[jax.Array, jax.Array]:
  """Casts ``x * scale`` to FP8, saturating at the format's max.

  Args:
    x: float32/bfloat16/float16 array of any shape.
    scale: float32 scalar (``fp8_max / amax`` for an exact fit).
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    impl: "auto", "cuda" or "reference".

  Returns:
    (data of ``x.shape`` and ``dtype``, amax = max|x| as a float32 scalar).
  """
  q = _op.quantize_tensorwise(x, jnp.asarray(scale, jnp.float32), dtype, impl=impl)
  return q.data, q.amax


def quantize_blockwise(x: jax.Array, block_shape=(1, 128), dtype=jnp.float8_e4m3fn,
                       power_2_scale: bool = False, *, impl: str = "auto"
                       ) -> Tuple[jax.Array, jax.Array]:
  """Quantizes each (bm, bk) tile of 2-D ``x`` with its own scale.

  Args:
    x: (M, K) float array, any M and K (edge tiles may be partial).
    block_shape: (bm, bk), e.g. (1, 128) for activations, (128, 128) for weights.
    dtype: FP8 dtype.
    power_2_scale: round every scale down to a power of two.
    impl: "auto", "cuda" or "reference".

  Returns:
    (data (M, K), scale_inv float32 (ceil(M/bm), ceil(K/bk))) with
    ``data * scale_inv`` (broadcast per tile) ~= x.
  """
  q = _op.quantize_blockwise(x, block_shape, dtype, power_2_scale, impl=impl)
  return q.data, q.scale_inv


def dequantize_blockwise(data: jax.Array, scale_inv: jax.Array, block_shape=(1, 128),
                         dtype=jnp.float32) -> jax.Array:
  """``data * scale_inv`` broadcast over (bm, bk) tiles, as ``dtype``.

  Args:
    data: (M, K) FP8 array.
    scale_inv: (ceil(M/bm), ceil(K/bk)) float32.
    block_shape: the (bm, bk) used to quantize.
    dtype: output dtype.
  """
  block_shape = _op.check_block_shape(block_shape)
  _op.check_fp8_dtype(data.dtype, "data")
  if data.ndim != 2:
    raise ValueError(f"data must be 2-D, got shape {data.shape}.")
  want = tuple(-(-d // b) for d, b in zip(data.shape, block_shape))
  if scale_inv.shape != want:
    raise ValueError(f"scale_inv must have shape {want} for data {data.shape} and "
                     f"block_shape {block_shape}, got {scale_inv.shape}.")
  return _op.dequantize_blockwise_reference(data, scale_inv, block_shape, dtype)


def quantize_rowwise_columnwise(x: jax.Array, mode: str, dtype=jnp.float8_e4m3fn, *,
                                scale=None, block_shape=None, power_2_scale: bool = False,
                                impl: str = "auto") -> QuantizedTensor:
  """FP8 copies of 2-D ``x`` and of ``x.T`` from one pass over ``x``.

  Equal, bit for bit, to quantizing ``x`` and ``x.T`` separately in the same
  layout (``quantize_tensorwise`` / ``quantize_blockwise`` twice), but the
  CUDA path is one kernel that reads ``x`` once and writes both copies. The
  layouts of the recipes:

  ==========================  =====================================================
  recipe                      call
  ==========================  =====================================================
  DelayedScaling              ``mode="tensorwise", scale=s`` (the state's scale)
  Float8CurrentScaling        ``mode="current"`` (scale ``fp8_max / max|x|``)
  Float8BlockScaling x, grad  ``mode="blockwise"`` (1x128 tiles; x.T tiled 1x128,
                              i.e. x tiled 128x1), ``power_2_scale=True``
  Float8BlockScaling kernel   ``mode="blockwise", block_shape=(128, 128)``
  ==========================  =====================================================

  Args:
    x: (M, K) float32/bfloat16/float16.
    mode: "tensorwise", "current" or "blockwise".
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: float32 scalar, required for "tensorwise" and refused otherwise.
    block_shape: "blockwise" only: (1, 128) (default) or (128, 128) (the CUDA
      path's tiles; the reference takes any (bm, bk)).
    power_2_scale: "blockwise" only: round every scale down to a power of two.
    impl: "auto", "cuda" or "reference" (``TE_JAX_IMPL``; see
      ``te_jax.ops._native``).

  Returns:
    A :class:`QuantizedTensor` ``qt``:

    * ``qt.data`` (M, K) and ``qt.data_t`` (K, M), FP8 of ``dtype``;
    * per tensor: ``qt.scale_inv`` = ``qt.scale_inv_t`` = ``1 / scale``, float32
      scalars, and ``qt.amax`` = ``max|x|`` (NaN if ``x`` holds one);
    * blockwise (bm, bk): ``qt.scale_inv`` (ceil(M/bm), ceil(K/bk)) and
      ``qt.scale_inv_t`` (ceil(K/bm), ceil(M/bk)), float32, one per tile of
      ``x`` and of ``x.T``; ``qt.amax`` None;

    so that ``qt.rowwise()`` (M, K) and ``qt.columnwise()`` (K, M) are
    ``ScaledTensor`` GEMM operands, and ``qt.data * qt.scale_inv`` (broadcast
    per tile) ~= x.

  Raises:
    ValueError / TypeError naming the argument: x not a 2-D float array, an
    unknown mode, ``scale`` missing or given where it does not apply,
    ``block_shape`` or ``power_2_scale`` outside "blockwise", a block shape
    the CUDA path has no kernel for (with ``impl="cuda"``).
  """
  return _op.quantize_by_mode(x, mode, dtype, scale=scale, block_shape=block_shape,
                              power_2_scale=power_2_scale, impl=impl)
