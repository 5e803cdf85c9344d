"""FP8 quantization of a stack of matrices (E, M, K), each entry on its own.

The expert weights of a mixture of experts (``te_jax.grouped_dense``) are one
(E, K, N) array whose entries each have their own scale (per tensor) or
128x128 blocks. Quantized entry by entry, that is E small kernel launches
inside an XLA loop with a dynamic slice and update per entry; the ops here
quantize every entry in one launch over the whole stack
(``te_jax_quantize_stack_*`` in ``custom_calls/ffi/quantize.cc``; the kernel
puts the entries on grid.z).

Each op quantizes entry ``e`` exactly as the 2-D op of ``ops/quantize.py``
with the same mode quantizes ``x[e]`` alone, bit for bit: its reference (the
spec, and what ``impl="reference"`` runs) is that 2-D reference applied per
entry with ``jax.vmap``, and the CUDA path runs the 2-D kernel's code per
entry. Every op returns a :class:`~te_jax.ops.fp8.QuantizedTensor` whose
fields all carry a leading E axis: data (E, M, K); scale_inv (E,) per tensor
or (E, ceil(M/bm), ceil(K/bk)) per tile (each entry's logical grid); data_t
(E, K, M) and scale_inv_t with ``columnwise``; amax (E,) per tensor, None
blockwise.

E may be 0 (empty results, no kernel work); M and K may not (as for the 2-D
ops). These ops live beside ``ops/quantize.py`` rather than in it to keep
modules under ~500 lines.

>>> import jax.numpy as jnp
>>> q = quantize_stack_blockwise(jnp.ones((3, 200, 300)), (128, 128), columnwise=True)
>>> q.data.shape, q.scale_inv.shape, q.data_t.shape, q.scale_inv_t.shape
((3, 200, 300), (3, 2, 3), (3, 300, 200), (3, 3, 2))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import _native
from te_jax.ops import quantize as q2d
from te_jax.ops import quantize_cuda
from te_jax.ops.fp8 import QuantizedTensor

__all__ = [
    "check_stack",
    "quantize_stack_tensorwise_reference",
    "quantize_stack_current_reference",
    "quantize_stack_from_amax_reference",
    "quantize_stack_blockwise_reference",
    "quantize_stack_tensorwise",
    "quantize_stack_current",
    "quantize_stack_from_amax",
    "quantize_stack_blockwise",
]

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------- checks ---

def check_stack(x, name: str = "x") -> int:
  """Checks that ``x`` is a (E, M, K) float32/bfloat16/float16 stack with
  M, K >= 1 (E may be 0); returns E."""
  if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in _INPUT_DTYPES:
    raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got "
                    f"{getattr(x, 'dtype', type(x))}.")
  if x.ndim != 3:
    raise ValueError(f"{name} must be 3-D (E, M, K), a stack of E matrices, got shape "
                     f"{x.shape}; quantize one matrix with te_jax.ops.quantize instead.")
  if 0 in x.shape[1:]:
    raise ValueError(f"{name} must have non-empty matrices (M, K >= 1), got shape {x.shape}.")
  return x.shape[0]


def _check_per_entry(value, e: int, name: str) -> jax.Array:
  """``value`` as float32 of shape (E,), one per entry."""
  if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype {jnp.result_type(value)}.")
  if jnp.shape(value) != (e,):
    raise ValueError(f"{name} must have shape (E,) = ({e},), one per entry of x, got shape "
                     f"{jnp.shape(value)}; for one value shared by all entries pass "
                     f"jnp.full(({e},), {name}).")
  return jnp.asarray(value, jnp.float32)


def _check_flag(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool (it is static), got {value!r}.")
  return bool(value)


# ------------------------------------------------------------- references ---
# The 2-D references applied per entry: the spec of the stack ops.

def quantize_stack_tensorwise_reference(x: jax.Array, scale: jax.Array, dtype, *,
                                        columnwise: bool = False) -> QuantizedTensor:
  """``quantize_tensorwise_reference(x[e], scale[e])`` for every entry e."""
  return jax.vmap(lambda xe, se: q2d.quantize_tensorwise_reference(
      xe, se, dtype, columnwise=columnwise))(x, scale)


def quantize_stack_current_reference(x: jax.Array, dtype, *,
                                     columnwise: bool = False) -> QuantizedTensor:
  """``quantize_current_reference(x[e])`` for every entry e."""
  return jax.vmap(lambda xe: q2d.quantize_current_reference(
      xe, dtype, columnwise=columnwise))(x)


def quantize_stack_from_amax_reference(x: jax.Array, amax: jax.Array, dtype, *,
                                       columnwise: bool = False) -> QuantizedTensor:
  """``quantize_from_amax_reference(x[e], amax[e])`` for every entry e."""
  return jax.vmap(lambda xe, ae: q2d.quantize_from_amax_reference(
      xe, ae, dtype, columnwise=columnwise))(x, amax)


def quantize_stack_blockwise_reference(x: jax.Array, block_shape=(1, 128),
                                       dtype=jnp.float8_e4m3fn, power_2_scale: bool = False,
                                       *, columnwise: bool = False) -> QuantizedTensor:
  """``quantize_blockwise_reference(x[e], ...)`` for every entry e."""
  block_shape = tuple(block_shape)
  return jax.vmap(lambda xe: q2d.quantize_blockwise_reference(
      xe, block_shape, dtype, power_2_scale, columnwise=columnwise))(x)


# ------------------------------------------------------------ dispatchers ---

def quantize_stack_tensorwise(x: jax.Array, scale: jax.Array, dtype=jnp.float8_e4m3fn, *,
                              columnwise: bool = False, impl: str = "auto"
                              ) -> QuantizedTensor:
  """Per-tensor quantize of each entry with its given scale (delayed scaling).

  Args:
    x: (E, M, K) float32/bfloat16/float16.
    scale: (E,) float32, entry e's scale.
    dtype: FP8 dtype.
    columnwise: also return each entry's transposed copy, data_t (E, K, M).
    impl: "auto", "cuda" or "reference".

  Returns:
    data (E, M, K), scale_inv (E,) = 1/scale (NaN where the entry's amax is
    not finite), data_t (E, K, M) and scale_inv_t with ``columnwise``, amax
    (E,) = max|x[e]|.
  """
  e = check_stack(x)
  dtype = q2d.check_fp8_dtype(dtype)
  scale = _check_per_entry(scale, e, "scale")
  columnwise = _check_flag(columnwise, "columnwise")
  return _native.dispatch(
      impl, lambda: quantize_cuda.quantize_stack_tensorwise(x, scale, dtype, columnwise),
      lambda: quantize_stack_tensorwise_reference(x, scale, dtype, columnwise=columnwise))


def quantize_stack_current(x: jax.Array, dtype=jnp.float8_e4m3fn, *,
                           columnwise: bool = False, impl: str = "auto") -> QuantizedTensor:
  """Per-tensor quantize of each entry with the scale of its own amax.

  Args:
    x: (E, M, K) float32/bfloat16/float16.
    dtype: FP8 dtype.
    columnwise: also return data_t (E, K, M).
    impl: "auto", "cuda" or "reference".

  Returns:
    data (E, M, K), scale_inv (E,), data_t and scale_inv_t with
    ``columnwise``, amax (E,) = max|x[e]|.
  """
  check_stack(x)
  dtype = q2d.check_fp8_dtype(dtype)
  columnwise = _check_flag(columnwise, "columnwise")
  return _native.dispatch(
      impl, lambda: quantize_cuda.quantize_stack_current(x, dtype, columnwise),
      lambda: quantize_stack_current_reference(x, dtype, columnwise=columnwise))


def quantize_stack_from_amax(x: jax.Array, amax: jax.Array, dtype=jnp.float8_e4m3fn, *,
                             columnwise: bool = False, impl: str = "auto"
                             ) -> QuantizedTensor:
  """Current scaling of each entry from a given amax (E,), e.g. max-reduced
  over the mesh axes an expert weight is sharded on; with ``amax[e] =
  max|x[e]|`` it equals :func:`quantize_stack_current` bit for bit.

  Args:
    x: (E, M, K) float32/bfloat16/float16.
    amax: (E,) float32.
    dtype: FP8 dtype.
    columnwise: also return data_t (E, K, M).
    impl: "auto", "cuda" or "reference".

  Returns:
    data (E, M, K), scale_inv (E,), data_t and scale_inv_t with
    ``columnwise``, and ``amax`` as given.
  """
  e = check_stack(x)
  dtype = q2d.check_fp8_dtype(dtype)
  amax = _check_per_entry(amax, e, "amax")
  columnwise = _check_flag(columnwise, "columnwise")
  return _native.dispatch(
      impl, lambda: quantize_cuda.quantize_stack_from_amax(x, amax, dtype, columnwise),
      lambda: quantize_stack_from_amax_reference(x, amax, dtype, columnwise=columnwise))


def quantize_stack_blockwise(x: jax.Array, block_shape=(1, 128), dtype=jnp.float8_e4m3fn,
                             power_2_scale: bool = False, *, columnwise: bool = False,
                             impl: str = "auto") -> QuantizedTensor:
  """Blockwise quantize of each entry, as ``quantize_blockwise`` of one.

  Args:
    x: (E, M, K) float32/bfloat16/float16.
    block_shape: (bm, bk); the CUDA path takes (1, 128) (with 128x1 tiles
      for the columnwise copy) and (128, 128), the reference any tile.
    dtype: FP8 dtype.
    power_2_scale: round the scales down to powers of two.
    columnwise: also quantize each ``x[e].T`` with the same tiles.
    impl: "auto", "cuda" or "reference".

  Returns:
    data (E, M, K), scale_inv (E, ceil(M/bm), ceil(K/bk)), with
    ``columnwise`` data_t (E, K, M) and scale_inv_t (E, ceil(K/bm),
    ceil(M/bk)); amax None.
  """
  check_stack(x)
  block_shape = q2d.check_block_shape(block_shape)
  dtype = q2d.check_fp8_dtype(dtype)
  power_2_scale = _check_flag(power_2_scale, "power_2_scale")
  columnwise = _check_flag(columnwise, "columnwise")
  return _native.dispatch(
      impl, lambda: quantize_cuda.quantize_stack_blockwise(x, block_shape, dtype, power_2_scale,
                                                           columnwise),
      lambda: quantize_stack_blockwise_reference(x, block_shape, dtype, power_2_scale,
                                                 columnwise=columnwise))
