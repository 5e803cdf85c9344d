"""FP8 GEMM in the "TN" layout: ``out = a @ b.T`` with both operands K-major.

``a`` is (M, K) and ``b`` is (N, K), each a ``ScaledTensor``: cuBLASLt on
Hopper wants FP8 operands contiguous along the contraction dimension, so the
FP8 layers always hand over the copy (rowwise or columnwise) that is.

Scaling pairs: ``tiling.GEMM_PAIRS``, the pairs cuBLASLt accepts:

* per-tensor x per-tensor (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3);
* blockwise: a 1x128 / b 128x128 (fprop, dgrad), a 1x128 / b 1x128 (wgrad),
  a 128x128 / b 1x128.

The reference dequantizes both operands to float32 and multiplies at
``Precision.HIGHEST``: the spec every CUDA GEMM is measured against.

A ``residual`` (M, N) of ``out_dtype`` is added in float32 before the one
rounding to ``out_dtype`` (cuBLASLt's C input with beta = 1): the
``x + proj(h)`` of a transformer block, which otherwise costs a pass of its
own over the output (XLA cannot fuse an add into a custom call).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops import _native
from te_jax.ops import gemm_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import FP8_DTYPES, ScaledTensor

__all__ = ["gemm_reference", "gemm"]

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))


def gemm_reference(a: ScaledTensor, b: ScaledTensor, out_dtype=jnp.bfloat16,
                   bias: Optional[jax.Array] = None,
                   residual: Optional[jax.Array] = None) -> jax.Array:
  """``dequant(a) @ dequant(b).T (+ bias) (+ residual)`` in float32, cast to
  ``out_dtype``."""
  af, bf = a.dequantize(jnp.float32), b.dequantize(jnp.float32)
  out = lax.dot_general(af, bf, (((1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  if residual is not None:
    out = out + residual.astype(jnp.float32)
  return out.astype(out_dtype)


def _check(a, b, out_dtype, bias, residual=None):
  for name, t in (("a", a), ("b", b)):
    if not isinstance(t, ScaledTensor):
      raise TypeError(f"{name} must be a te_jax ScaledTensor, got {type(t).__name__}.")
    if t.data.ndim != 2:
      raise ValueError(f"{name}.data must be 2-D, got shape {t.data.shape}.")
    if jnp.dtype(t.dtype) not in FP8_DTYPES:
      raise TypeError(f"{name}.data must be float8_e4m3fn or float8_e5m2, got {t.dtype}.")
  if a.shape[1] != b.shape[1]:
    raise ValueError(
        f"a and b must share the contraction dim (TN layout: a (M, K), b (N, K)), "
        f"got a {a.shape} and b {b.shape}.")
  if (a.block_shape is None) != (b.block_shape is None):
    raise ValueError("a and b must both be per-tensor or both be blockwise scaled, "
                     f"got block shapes {a.block_shape} and {b.block_shape}.")
  if a.block_shape is None:
    if a.dtype == jnp.float8_e5m2 and b.dtype == jnp.float8_e5m2:
      raise TypeError("E5M2 x E5M2 is not a supported FP8 GEMM; quantize one "
                      "operand as E4M3.")
  elif (tiling.layout_of(a.block_shape), tiling.layout_of(b.block_shape)) not in \
      tiling.GEMM_PAIRS:
    supported = tuple((la.block_shape, lb.block_shape) for la, lb in tiling.GEMM_PAIRS
                      if not la.per_tensor)
    raise ValueError(f"unsupported block-shape pair {a.block_shape} x "
                     f"{b.block_shape}; supported: {supported}.")
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}.")
  if bias is not None and bias.shape != (b.shape[0],):
    raise ValueError(f"bias must have shape ({b.shape[0]},), got {bias.shape}.")
  if residual is not None:
    want = (a.shape[0], b.shape[0])
    if residual.shape != want:
      raise ValueError(f"residual must have the output's shape {want}, got {residual.shape}.")
    if jnp.dtype(residual.dtype) != jnp.dtype(out_dtype):
      raise TypeError(f"residual must have out_dtype ({jnp.dtype(out_dtype).name}), got "
                      f"{residual.dtype}: cast it, or ask for that out_dtype.")


def gemm(a: ScaledTensor, b: ScaledTensor, *, out_dtype=jnp.bfloat16,
         bias: Optional[jax.Array] = None, fast_accum: bool = False,
         residual: Optional[jax.Array] = None, impl: str = "auto") -> jax.Array:
  """FP8 GEMM ``a @ b.T``.

  Args:
    a: (M, K) ScaledTensor.
    b: (N, K) ScaledTensor.
    out_dtype: bfloat16, float16 or float32.
    bias: optional (N,) vector added in float32 before the cast.
    fast_accum: per-tensor only: let the tensor cores accumulate at reduced
      precision (ignored by the reference, which is always exact fp32).
    residual: optional (M, N) array of ``out_dtype`` added in float32
      before the cast.
    impl: "auto", "cuda" or "reference".

  Returns:
    (M, N) array of ``out_dtype``.
  """
  _check(a, b, out_dtype, bias, residual)
  def cuda():
    return gemm_cuda.gemm(a, b, jnp.dtype(out_dtype), bias, fast_accum, residual)
  return _native.dispatch(impl, cuda, lambda: gemm_reference(a, b, out_dtype, bias, residual))
