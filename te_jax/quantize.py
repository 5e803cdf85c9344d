"""Public FP8 quantization API (DESIGN.md).

On a GPU with the CUDA custom calls built these run our kernels; elsewhere the
pure-JAX references in ``te_jax.ops.quantize``, which are the spec.

>>> import jax, jax.numpy as jnp
>>> from te_jax import quantize as q
>>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 300))
>>> data, scale_inv = q.quantize_blockwise(x, (1, 128))
>>> scale_inv.shape
(256, 3)
>>> x_hat = q.dequantize_blockwise(data, scale_inv, (1, 128))
>>> bool(jnp.max(jnp.abs(x_hat - x)) < 0.07 * jnp.max(jnp.abs(x)))
True
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from te_jax.ops import quantize as _op

__all__ = ["quantize_tensorwise", "quantize_blockwise", "dequantize_blockwise",
           "compute_scale"]

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
