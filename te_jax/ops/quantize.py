"""FP8 quantization: per-tensor (given scale, current amax, given amax) and blockwise.

Each op has a pure-JAX ``<op>_reference`` (the spec, and exactly what the
dispatcher runs off the GPU), a CUDA custom-call path (``quantize_cuda.py``)
and the public dispatcher ``<op>(..., impl="auto")``. The CUDA path agrees
with the reference bit for bit. Every op returns a
:class:`~te_jax.ops.fp8.QuantizedTensor`.

Numerics (``docs/design.md``): ``q = saturating_cast(x * scale)``, ``scale_inv =
1 / scale``; a tensor or tile whose amax is 0 gets scale 1 (for per-tensor
delayed scaling the caller owns the scale); power-of-2 scales are rounded
*down*, so ``|x| * scale`` never exceeds the FP8 max. Saturation applies to
finite values only: a tensor or tile holding an Inf or NaN gets a NaN
scale_inv (and, where the op derives the scale, NaN data), so the GEMM that
reads it is non-finite, as the unquantized product would be. Every amax is
``te_jax.ops.fp8.amax``, which propagates a NaN on every backend.

The "columnwise" copy an op can write in the same pass is the quantization of
``x.T`` with the same ``block_shape``: for per-tensor scaling and for
128x128 blocks it equals the transpose of the rowwise copy; for 1x128 tiles it
is ``x`` tiled 128x1, the operand layout the weight-gradient GEMM needs.

The ops with a fused prologue (``act_quantize``, ``dact_quantize``,
``concat_quantize``, ``norm_quantize``) take one ``mode`` of :data:`MODES`
(``tiling.QUANTIZE_MODES`` names each mode's tile layout) and share
:func:`check_mode_args`, so their options agree. :func:`quantize_by_mode`
takes the same options (and a ``block_shape`` for "blockwise") and writes
both copies of a tensor in one pass: the public
``te_jax.quantize.quantize_rowwise_columnwise``.

>>> import jax.numpy as jnp
>>> q = quantize_blockwise(jnp.ones((4, 256)), (1, 128), columnwise=True)
>>> q.data.shape, q.scale_inv.shape, q.data_t.shape, q.scale_inv_t.shape
((4, 256), (4, 2), (256, 4), (256, 1))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.ops import _native
from te_jax.ops import quantize_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import (FP8_DTYPES, QuantizedTensor, amax as amax_of,
                            dequantize_blockwise_reference, fp8_max,
                            nan_scale_inv_if_non_finite, tile)

__all__ = [
    "MODES",
    "compute_scale",
    "is_positive_amax",
    "saturating_cast",
    "round_down_power_of_2",
    "check_mode_args",
    "quantize_tensorwise_reference",
    "quantize_current_reference",
    "quantize_from_amax_reference",
    "quantize_blockwise_reference",
    "quantize_by_mode_reference",
    "quantize_by_mode",
    "dequantize_blockwise_reference",
    "quantize_tensorwise",
    "quantize_current",
    "quantize_from_amax",
    "quantize_blockwise",
]

# Modes of the fused-prologue quantize ops (tiling.QUANTIZE_MODES names the
# layout of each): a given per-tensor scale (delayed scaling), the per-tensor
# scale of this tensor's amax, "blockwise" tiles.
MODES = tuple(tiling.QUANTIZE_MODES)
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32_MAX = float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------- checks ---

def check_fp8_dtype(dtype, name="dtype"):
  if jnp.dtype(dtype) not in FP8_DTYPES:
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


def _check_scalar(value, name):
  if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
    raise TypeError(f"{name} must be a float scalar, got dtype {jnp.result_type(value)}.")
  if jnp.shape(value) != ():
    raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}.")
  return jnp.asarray(value, jnp.float32)


def check_mode_args(mode, dtype, scale, power_2_scale):
  """Validates the quantization options of a fused-prologue op.

  Returns (dtype, scale as a float32 scalar or None). ``scale`` is required
  for "tensorwise" and refused otherwise; ``power_2_scale`` is a blockwise
  option (as for ``quantize_blockwise``; the per-tensor ops have none).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  dtype = check_fp8_dtype(dtype)
  if not isinstance(power_2_scale, (bool, np.bool_)):
    raise TypeError(f"power_2_scale must be a Python bool (it is static), got "
                    f"{power_2_scale!r}.")
  if power_2_scale and mode != "blockwise":
    raise ValueError(f"power_2_scale applies to mode='blockwise' only, got mode={mode!r} "
                     "(as quantize_tensorwise / quantize_current, which have none).")
  if mode == "tensorwise":
    if scale is None:
      raise ValueError("mode='tensorwise' needs scale, a float32 scalar (delayed "
                       "scaling).")
    return dtype, _check_scalar(scale, "scale")
  if scale is not None:
    raise ValueError(f"scale must be None for mode={mode!r}: the scale comes from "
                     "the amax of the tensor ('current') or of each tile "
                     "('blockwise').")
  return dtype, None


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


def is_positive_amax(amax: jax.Array) -> jax.Array:
  """``amax > 0`` and finite, decided on the bits so that a subnormal amax
  counts as positive even where XLA flushes subnormals to zero."""
  bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
  return jnp.isfinite(amax) & ((bits & jnp.uint32(0x7FFFFFFF)) != 0) & (bits >> 31 == 0)


def compute_scale(amax: jax.Array, dtype, margin: int = 0,
                  power_2_scale: bool = False) -> jax.Array:
  """``fp8_max / amax / 2**margin``; 1 where amax is 0, NaN where it is not finite.

  The result is clipped to the float32 max, so a tiny amax never yields an
  infinite scale. A NaN scale (the tensor or tile holds an Inf or NaN) makes
  every FP8 value and the scale_inv NaN, so a GEMM reading them is
  non-finite, as the unquantized product would be: saturation never hides a
  non-finite input.

  >>> float(compute_scale(jnp.float32(2.0), jnp.float8_e4m3fn))
  224.0
  """
  amax = amax.astype(jnp.float32)
  valid = is_positive_amax(amax)
  # A subnormal amax: fp8_max / amax overflows, so the scale is the float32
  # max (the kernels, built with -ftz=false, get there by the division; XLA
  # may flush the subnormal to 0 first, hence the explicit select).
  subnormal = valid & (jnp.abs(amax) < jnp.float32(np.finfo(np.float32).tiny))
  safe = jnp.where(valid & ~subnormal, amax, 1.0)
  scale = jnp.float32(fp8_max(dtype)) / safe
  if margin:
    scale = scale / jnp.float32(2.0 ** margin)
  scale = jnp.minimum(scale, jnp.float32(_F32_MAX))
  scale = jnp.where(subnormal, jnp.float32(_F32_MAX), scale)
  if power_2_scale:
    scale = round_down_power_of_2(scale)
  return jnp.where(valid, scale, jnp.where(jnp.isfinite(amax), jnp.float32(1.0),
                                           jnp.float32(jnp.nan)))


def _per_tensor(data, scale_inv, amax, columnwise) -> QuantizedTensor:
  if not columnwise:
    return QuantizedTensor(data, scale_inv, amax=amax)
  return QuantizedTensor(data, scale_inv, data.T, scale_inv, amax)


def quantize_tensorwise_reference(x: jax.Array, scale: jax.Array, dtype, *,
                                  columnwise: bool = False) -> QuantizedTensor:
  """``saturating_cast(x * scale)`` with amax ``max|x|`` and scale_inv ``1/scale``.

  The scale is given, so an Inf in ``x`` would saturate to +-fp8_max: where
  the amax is not finite the scale_inv is NaN instead
  (``nan_scale_inv_if_non_finite``), which makes the GEMM output non-finite.
  """
  xf = x.astype(jnp.float32)
  scale = jnp.asarray(scale, jnp.float32)
  data = saturating_cast(xf * scale, dtype)
  return nan_scale_inv_if_non_finite(
      _per_tensor(data, 1.0 / scale, amax_of(xf), columnwise))


def quantize_from_amax_reference(x: jax.Array, amax: jax.Array, dtype, *,
                                 columnwise: bool = False) -> QuantizedTensor:
  """Current scaling with a given amax: scale ``compute_scale(amax, dtype)``."""
  amax = jnp.asarray(amax, jnp.float32)
  scale = compute_scale(amax, dtype)
  data = saturating_cast(x.astype(jnp.float32) * scale, dtype)
  return _per_tensor(data, 1.0 / scale, amax, columnwise)


def quantize_current_reference(x: jax.Array, dtype, *,
                               columnwise: bool = False) -> QuantizedTensor:
  """Current scaling: the scale of this tensor's own amax ``max|x|``."""
  return quantize_from_amax_reference(x, amax_of(x), dtype, columnwise=columnwise)


def _blockwise(x, block_shape, dtype, power_2_scale):
  """(data, scale_inv) of 2-D ``x`` quantized per (bm, bk) tile."""
  tiles, m, k = tile(x.astype(jnp.float32), block_shape)
  scale = compute_scale(amax_of(tiles, axis=(1, 3)), dtype, power_2_scale=power_2_scale)
  data = saturating_cast(tiles * scale[:, None, :, None], dtype)
  data = data.reshape(tiles.shape[0] * tiles.shape[1], -1)[:m, :k]
  return data, 1.0 / scale


def quantize_blockwise_reference(x: jax.Array, block_shape=(1, 128),
                                 dtype=jnp.float8_e4m3fn, power_2_scale: bool = False,
                                 *, columnwise: bool = False) -> QuantizedTensor:
  """Quantizes each (bm, bk) tile of 2-D ``x`` with its own scale.

  Args:
    x: (M, K) float array; edge tiles may be partial (padding never enters
      an amax).
    block_shape: (bm, bk).
    dtype: FP8 dtype of the result.
    power_2_scale: round scales down to powers of two.
    columnwise: also quantize ``x.T`` with the same tiles.

  Returns:
    A QuantizedTensor: data (M, K), scale_inv (ceil(M/bm), ceil(K/bk)),
    data_t (K, M) and scale_inv_t (ceil(K/bm), ceil(M/bk)) with
    ``columnwise``; amax None.
  """
  block_shape = tuple(block_shape)
  data, scale_inv = _blockwise(x, block_shape, dtype, power_2_scale)
  if not columnwise:
    return QuantizedTensor(data, scale_inv, block_shape=block_shape)
  if block_shape[0] == block_shape[1]:  # square blocks: the transpose is exact
    data_t, scale_inv_t = data.T, scale_inv.T
  else:
    data_t, scale_inv_t = _blockwise(x.T, block_shape, dtype, power_2_scale)
  return QuantizedTensor(data, scale_inv, data_t, scale_inv_t, None, block_shape)


# jit: the fused-prologue references call this eagerly in tests; one
# compilation instead of one per op (inlined under an outer jit).
@functools.partial(jax.jit, static_argnames=("mode", "dtype", "power_2_scale",
                                             "block_shape"))
def quantize_by_mode_reference(v: jax.Array, mode: str, dtype, scale=None,
                               power_2_scale: bool = False, block_shape=None
                               ) -> QuantizedTensor:
  """The reference quantization of 2-D ``v`` in a :data:`MODES` mode, both copies.

  "tensorwise": :func:`quantize_tensorwise_reference` with ``scale``;
  "current": :func:`quantize_current_reference`; "blockwise":
  :func:`quantize_blockwise_reference` with ``block_shape`` tiles, by default
  the mode's (``tiling.QUANTIZE_MODES``: 1x128). The spec of the
  fused-prologue ops, applied to the float32 value they compute, and of
  :func:`quantize_by_mode`.
  """
  if mode == "tensorwise":
    return quantize_tensorwise_reference(v, scale, dtype, columnwise=True)
  if mode == "current":
    return quantize_current_reference(v, dtype, columnwise=True)
  if block_shape is None:
    block_shape = tiling.mode_layout(mode).block_shape
  return quantize_blockwise_reference(v, block_shape, dtype, power_2_scale, columnwise=True)


# ------------------------------------------------------------ dispatchers ---

def _as_2d(x):
  """The (rows, last dim) view the per-tensor kernels take; any rank works."""
  return x if x.ndim == 2 else x.reshape(-1, x.shape[-1] if x.ndim else 1)


def _dispatch_per_tensor(x, columnwise, impl, cuda_op, reference_op, *args):
  """``cuda_op(2-D view of x, *args, columnwise)`` or ``reference_op(x, *args,
  columnwise=)``: the per-tensor kernels take the (rows, last dim) view, the
  data comes back in ``x``'s shape."""
  def cuda():
    q = cuda_op(_as_2d(x), *args, columnwise)
    return q.replace(data=q.data.reshape(x.shape))
  return _native.dispatch(impl, cuda, lambda: reference_op(x, *args, columnwise=columnwise))


def quantize_tensorwise(x: jax.Array, scale: jax.Array, dtype=jnp.float8_e4m3fn,
                        *, columnwise: bool = False, impl: str = "auto"
                        ) -> QuantizedTensor:
  """Per-tensor quantize with a given scale (delayed scaling).

  Args:
    x: float array; 2-D (M, K) when ``columnwise``.
    scale: float32 scalar.
    dtype: FP8 dtype.
    columnwise: also return the (K, M) transposed FP8 copy.
    impl: "auto", "cuda" or "reference".

  Returns:
    data (x.shape), scale_inv = 1/scale, data_t (K, M) with ``columnwise``,
    amax = max|x| (float32 scalars).
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)
  scale = _check_scalar(scale, "scale")

  return _dispatch_per_tensor(x, columnwise, impl, quantize_cuda.quantize_tensorwise,
                              quantize_tensorwise_reference, scale, dtype)


def quantize_current(x: jax.Array, dtype=jnp.float8_e4m3fn, *,
                     columnwise: bool = False, impl: str = "auto") -> QuantizedTensor:
  """Per-tensor quantize with the scale from this tensor's own amax.

  Returns:
    data, scale_inv, data_t with ``columnwise``, amax = max|x|.
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)

  return _dispatch_per_tensor(x, columnwise, impl, quantize_cuda.quantize_current,
                              quantize_current_reference, dtype)


def quantize_from_amax(x: jax.Array, amax: jax.Array, dtype=jnp.float8_e4m3fn, *,
                       columnwise: bool = False, impl: str = "auto") -> QuantizedTensor:
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
    data, scale_inv, data_t with ``columnwise``, and ``amax`` as given.
  """
  check_input(x, "x", 2 if columnwise else None)
  dtype = check_fp8_dtype(dtype)
  amax = _check_scalar(amax, "amax")

  return _dispatch_per_tensor(x, columnwise, impl, quantize_cuda.quantize_from_amax,
                              quantize_from_amax_reference, amax, dtype)


def quantize_blockwise(x: jax.Array, block_shape=(1, 128), dtype=jnp.float8_e4m3fn,
                       power_2_scale: bool = False, *, columnwise: bool = False,
                       impl: str = "auto") -> QuantizedTensor:
  """Blockwise quantize of 2-D ``x`` (M, K), optionally with its columnwise copy.

  Returns:
    As :func:`quantize_blockwise_reference`.
  """
  check_input(x, "x", 2)
  block_shape = check_block_shape(block_shape)
  dtype = check_fp8_dtype(dtype)

  def cuda():
    return quantize_cuda.quantize_blockwise(x, block_shape, dtype, power_2_scale,
                                            columnwise)
  return _native.dispatch(impl, cuda, lambda: quantize_blockwise_reference(
      x, block_shape, dtype, power_2_scale, columnwise=columnwise))



def quantize_by_mode(x: jax.Array, mode: str, dtype=jnp.float8_e4m3fn, *, scale=None,
                     block_shape=None, power_2_scale: bool = False,
                     impl: str = "auto") -> QuantizedTensor:
  """Rowwise and columnwise FP8 copies of 2-D ``x`` in one pass, in any recipe's layout.

  The CUDA path is one kernel that reads ``x`` once and writes both copies;
  the reference is :func:`quantize_by_mode_reference`.

  Args:
    x: (M, K) float32/bfloat16/float16.
    mode: "tensorwise" (the given ``scale``: delayed scaling), "current" (the
      scale of ``max|x|``) or "blockwise" (one scale per tile).
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: float32 scalar, for "tensorwise" only.
    block_shape: "blockwise" only: (1, 128) (default; the columnwise copy is
      then ``x`` tiled 128x1) or (128, 128); the reference takes any tile.
    power_2_scale: "blockwise" only: round the scales down to powers of two.
    impl: "auto", "cuda" or "reference".

  Returns:
    A ``QuantizedTensor``: data (M, K) and data_t (K, M), the quantization of
    ``x.T`` in the same layout. Per tensor: scale_inv = scale_inv_t float32
    scalars and amax = max|x|. Blockwise: scale_inv (ceil(M/bm), ceil(K/bk)),
    scale_inv_t (ceil(K/bm), ceil(M/bk)), amax None.
  """
  check_input(x, "x", 2)
  dtype, scale = check_mode_args(mode, dtype, scale, power_2_scale)
  if mode != "blockwise":
    if block_shape is not None:
      raise ValueError(f"block_shape applies to mode='blockwise' only, got mode={mode!r} "
                       f"and block_shape={block_shape!r}.")
  else:
    block_shape = check_block_shape(block_shape if block_shape is not None
                                    else tiling.mode_layout(mode).block_shape)

  def cuda():
    if mode == "tensorwise":
      return quantize_cuda.quantize_tensorwise(x, scale, dtype, True)
    if mode == "current":
      return quantize_cuda.quantize_current(x, dtype, True)
    return quantize_cuda.quantize_blockwise(x, block_shape, dtype, power_2_scale, True)
  return _native.dispatch(impl, cuda, lambda: quantize_by_mode_reference(
      x, mode, dtype, scale, power_2_scale, block_shape))
