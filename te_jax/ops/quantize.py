"""FP8 quantization: per-tensor (given scale or current amax) and blockwise.

Each op has a pure-JAX ``*_reference`` (the spec), a CUDA custom-call path
(``_*_cuda``, in ``quantize_cuda.py``), and a public dispatcher taking
``impl``. The CUDA path must agree bit for bit with the reference.

Numerics (DESIGN.md): ``q = saturating_cast(x * scale)``, ``scale_inv =
1 / scale``; a tensor or tile whose amax is 0 or non-finite gets scale 1
(per-tile; for per-tensor delayed scaling the previous scale is kept by the
caller); power-of-2 scales are rounded *down*, so ``|x| * scale`` never
exceeds the FP8 max.

The "columnwise" copy an op can write in the same pass is the quantization of
``x.T`` with the same ``block_shape``: for per-tensor scaling and for
128x128 blocks it equals the transpose of the rowwise copy; for 1x128 tiles it
is ``x`` tiled 128x1, the operand layout the weight-gradient GEMM needs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops import _native
from te_jax.recipe import fp8_max

__all__ = [
    "compute_scale",
    "saturating_cast",
    "quantize_tensorwise_reference",
    "quantize_current_reference",
    "quantize_from_amax_reference",
    "quantize_blockwise_reference",
    "dequantize_blockwise_reference",
    "quantize_tensorwise",
    "quantize_current",
    "quantize_from_amax",
    "quantize_blockwise",
]

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32_MAX = float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------- checks ---

def check_fp8_dtype(dtype, name="dtype"):
  if jnp.dtype(dtype) not in _FP8_DTYPES:
    raise TypeError(
        f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype}.")
  return jnp.dtype(dtype)


def check_input(x, name="x", ndim=None):
  if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in _INPUT_DTYPES:
    raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got "
                    f"{getattr(x, 'dtype', type(x))}.")
  if ndim is not None and x.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}.")
  if x.size == 0:
    raise ValueError(f"{name} must not be empty, got shape {x.shape}.")


def check_block_shape(block_shape):
  if (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2 or
      not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
              for b in block_shape)):
    raise ValueError(
        f"block_shape must be a pair of positive ints such as (1, 128) or "
        f"(128, 128), got {block_shape!r}.")
  return tuple(block_shape)


# ------------------------------------------------------------- references ---

def saturating_cast(x_f32: jax.Array, dtype) -> jax.Array:
  """Casts to FP8 with values beyond the max clipped to +-max (NaN stays NaN).

  The optimization barrier keeps XLA:GPU from folding a later
  ``convert(convert(x, f8), f32)`` back into ``x`` (it may, under its default
  excess-precision setting), which would silently skip the FP8 rounding.
  """
  m = fp8_max(dtype)
  return lax.optimization_barrier(jnp.clip(x_f32, -m, m).astype(dtype))


def round_down_power_of_2(scale: jax.Array) -> jax.Array:
  """Largest power of two <= ``scale`` for positive normal float32 ``scale``.

  Clearing the mantissa bits is exact, unlike ``exp2(floor(log2(s)))``,
  so the CUDA kernels can reproduce it bit for bit.
  """
  bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
  return lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)


def compute_scale(amax: jax.Array, dtype, margin: int = 0,
                  power_2_scale: bool = False) -> jax.Array:
  """``fp8_max / amax / 2**margin``; 1 where amax is 0 or not finite.

  The result is clipped to the float32 max, so a tiny amax never yields an
  infinite scale.
  """
  amax = amax.astype(jnp.float32)
  valid = jnp.isfinite(amax) & (amax > 0)
  safe = jnp.where(valid, amax, 1.0)
  scale = jnp.float32(fp8_max(dtype)) / safe
  if margin:
    scale = scale / jnp.float32(2.0 ** margin)
  scale = jnp.minimum(scale, jnp.float32(_F32_MAX))
  if power_2_scale:
    scale = round_down_power_of_2(scale)
  return jnp.where(valid, scale, jnp.float32(1.0))


def quantize_tensorwise_reference(x: jax.Array, scale: jax.Array, dtype
                                  ) -> Tuple[jax.Array, jax.Array]:
  """``(saturating_cast(x * scale), max|x|)``; x of any shape, scale a scalar."""
  xf = x.astype(jnp.float32)
  data = saturating_cast(xf * jnp.asarray(scale, jnp.float32), dtype)
  amax = jnp.max(jnp.abs(xf))
  return data, amax


def quantize_current_reference(x: jax.Array, dtype
                               ) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Current scaling: returns ``(data, scale_inv, amax)`` with scale from max|x|."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  data, scale_inv = quantize_from_amax_reference(x, amax, dtype)
  return data, scale_inv, amax


def quantize_from_amax_reference(x: jax.Array, amax: jax.Array, dtype
                                 ) -> Tuple[jax.Array, jax.Array]:
  """Current scaling with a given amax: ``(data, scale_inv)``."""
  scale = compute_scale(jnp.asarray(amax, jnp.float32), dtype)
  data, _ = quantize_tensorwise_reference(x, scale, dtype)
  return data, 1.0 / scale


def _tile(x: jax.Array, block_shape):
  """Pads (M, K) with zeros to whole tiles; returns (tiles, M, K).

  ``tiles`` has shape (M/bm, bm, K/bk, bk) after padding.
  """
  (m, k), (bm, bk) = x.shape, block_shape
  mt, kt = -(-m // bm), -(-k // bk)
  xp = jnp.pad(x, ((0, mt * bm - m), (0, kt * bk - k)))
  return xp.reshape(mt, bm, kt, bk), m, k


def quantize_blockwise_reference(x: jax.Array, block_shape=(1, 128),
                                 dtype=jnp.float8_e4m3fn,
                                 power_2_scale: bool = False
                                 ) -> Tuple[jax.Array, jax.Array]:
  """Quantizes each (bm, bk) tile of 2-D ``x`` with its own scale.

  Args:
    x: (M, K) float array; edge tiles may be partial (padding never enters
      an amax).
    block_shape: (bm, bk).
    dtype: FP8 dtype of the result.
    power_2_scale: round scales down to powers of two.

  Returns:
    data: (M, K) FP8. scale_inv: (ceil(M/bm), ceil(K/bk)) float32.
  """
  tiles, m, k = _tile(x.astype(jnp.float32), block_shape)
  amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
  scale = compute_scale(amax, dtype, power_2_scale=power_2_scale)
  data = saturating_cast(tiles * scale[:, None, :, None], dtype)
  data = data.reshape(tiles.shape[0] * tiles.shape[1], -1)[:m, :k]
  return data, 1.0 / scale


def dequantize_blockwise_reference(data: jax.Array, scale_inv: jax.Array,
                                   block_shape=(1, 128),
                                   dtype=jnp.float32) -> jax.Array:
  """Inverse of ``quantize_blockwise_reference``: (M, K) in ``dtype``."""
  tiles, m, k = _tile(data.astype(jnp.float32), block_shape)
  x = tiles * scale_inv.astype(jnp.float32)[:, None, :, None]
  return x.reshape(tiles.shape[0] * tiles.shape[1], -1)[:m, :k].astype(dtype)


# ------------------------------------------------------------ dispatchers ---

def _as_2d(x):
  """The (rows, last dim) view the per-tensor kernels take; any rank works."""
  return x if x.ndim == 2 else x.reshape(-1, x.shape[-1] if x.ndim else 1)


def quantize_tensorwise(x: jax.Array, scale: jax.Array, dtype=jnp.float8_e4m3fn,
                        *, columnwise: bool = False, impl: str = "auto"
                        ) -> Tuple[jax.Array, Optional[jax.Array], jax.Array]:
  """Per-tensor quantize with a given scale (delayed scaling).

  Args:
    x: float array; 2-D (M, K) when ``columnwise``.
    scale: float32 scalar.
    dtype: FP8 dtype.
    columnwise: also return the (K, M) transposed FP8 copy.
    impl: "auto", "cuda" or "reference".

  Returns:
    (data (x.shape), data_t ((K, M)) or None, amax float32 scalar).
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)
  if jnp.shape(scale) != ():
    raise ValueError(f"scale must be a scalar, got shape {jnp.shape(scale)}.")
  def cuda():
    from te_jax.ops import quantize_cuda  # pylint: disable=import-outside-toplevel
    data, data_t, amax = quantize_cuda.quantize_tensorwise(_as_2d(x), scale, dtype,
                                                            columnwise)
    return data.reshape(x.shape), data_t, amax

  def reference():
    data, amax = quantize_tensorwise_reference(x, scale, dtype)
    return data, (data.T if columnwise else None), amax
  return _native.dispatch(impl, cuda, reference)


def quantize_current(x: jax.Array, dtype=jnp.float8_e4m3fn, *,
                     columnwise: bool = False, impl: str = "auto"
                     ) -> Tuple[jax.Array, Optional[jax.Array], jax.Array, jax.Array]:
  """Per-tensor quantize with the scale from this tensor's own amax.

  Returns:
    (data, data_t or None, scale_inv float32 scalar, amax float32 scalar).
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)
  def cuda():
    from te_jax.ops import quantize_cuda  # pylint: disable=import-outside-toplevel
    data, data_t, scale_inv, amax = quantize_cuda.quantize_current(_as_2d(x), dtype,
                                                                   columnwise)
    return data.reshape(x.shape), data_t, scale_inv, amax

  def reference():
    data, scale_inv, amax = quantize_current_reference(x, dtype)
    return data, (data.T if columnwise else None), scale_inv, amax
  return _native.dispatch(impl, cuda, reference)


def quantize_from_amax(x: jax.Array, amax: jax.Array, dtype=jnp.float8_e4m3fn, *,
                       columnwise: bool = False, impl: str = "auto"
                       ) -> Tuple[jax.Array, Optional[jax.Array], jax.Array]:
  """Current scaling with a given amax (e.g. one max-reduced over a mesh).

  The scale is ``compute_scale(amax, dtype)``, derived where
  :func:`quantize_current` derives it (in the CUDA kernel on the CUDA path),
  so ``quantize_from_amax(x, max|x|)`` equals ``quantize_current(x)`` bit for
  bit on either path.

  Args:
    x: float array; 2-D (M, K) when ``columnwise``.
    amax: float32 scalar.
    dtype: FP8 dtype.
    columnwise: also return the (K, M) transposed FP8 copy.
    impl: "auto", "cuda" or "reference".

  Returns:
    (data, data_t or None, scale_inv float32 scalar).
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)
  if jnp.shape(amax) != ():
    raise ValueError(f"amax must be a scalar, got shape {jnp.shape(amax)}.")
  def cuda():
    from te_jax.ops import quantize_cuda  # pylint: disable=import-outside-toplevel
    data, data_t, scale_inv = quantize_cuda.quantize_from_amax(_as_2d(x), amax, dtype,
                                                               columnwise)
    return data.reshape(x.shape), data_t, scale_inv

  def reference():
    data, scale_inv = quantize_from_amax_reference(x, amax, dtype)
    return data, (data.T if columnwise else None), scale_inv
  return _native.dispatch(impl, cuda, reference)


def quantize_blockwise(x: jax.Array, block_shape=(1, 128), dtype=jnp.float8_e4m3fn,
                       power_2_scale: bool = False, *, columnwise: bool = False,
                       impl: str = "auto"):
  """Blockwise quantize of 2-D ``x`` (M, K), optionally with its columnwise copy.

  Returns:
    (data (M, K), scale_inv (ceil(M/bm), ceil(K/bk)), data_t (K, M) or None,
    scale_inv_t (ceil(K/bm), ceil(M/bk)) or None); the ``_t`` pair is the
    quantization of ``x.T`` with the same ``block_shape``.
  """
  check_input(x, "x", 2)
  block_shape = check_block_shape(block_shape)
  dtype = check_fp8_dtype(dtype)
  def cuda():
    from te_jax.ops import quantize_cuda  # pylint: disable=import-outside-toplevel
    return quantize_cuda.quantize_blockwise(x, block_shape, dtype, power_2_scale,
                                            columnwise)

  def reference():
    data, scale_inv = quantize_blockwise_reference(x, block_shape, dtype, power_2_scale)
    if not columnwise:
      return data, scale_inv, None, None
    if block_shape[0] == block_shape[1]:  # square blocks: the transpose is exact
      return data, scale_inv, data.T, scale_inv.T
    data_t, scale_inv_t = quantize_blockwise_reference(x.T, block_shape, dtype,
                                                       power_2_scale)
    return data, scale_inv, data_t, scale_inv_t
  return _native.dispatch(impl, cuda, reference)
