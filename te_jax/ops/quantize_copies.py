"""Which FP8 copies a fused-prologue quantize op writes, and with a known amax.

The ops that compute the tensor they quantize (``act_quantize``,
``dact_quantize``, ``norm_quantize``) write both copies by default: the
rowwise one for the GEMM contracting over the tensor's columns and the
columnwise one for the wgrad GEMM. A layer that does not keep the
columnwise copy between its passes asks for the rowwise one alone in the
forward and for the columnwise one alone in the backward, where it
quantizes the tensor again as the forward did: with the forward's scale
(a given ``scale``), or, under current scaling, from the forward's ``amax``
(given here rather than computed again). This module holds the checks of
those options and the reference quantization that honours them, the spec of
every such op's outputs.

>>> import jax.numpy as jnp
>>> q = quantize_selected_reference(jnp.ones((4, 8)), "current", jnp.float8_e4m3fn,
...                                 columnwise=False)
>>> q.data.shape, q.data_t is None, float(q.amax)
((4, 8), True, 1.0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import quantize as quantize_op
from te_jax.ops.fp8 import QuantizedTensor, amax as amax_of, nan_scale_inv_if_non_finite

__all__ = ["check_outputs", "check_given_amax", "quantize_selected_reference"]

_F32 = jnp.float32


def check_outputs(rowwise, columnwise) -> None:
  """Raises unless ``rowwise`` and ``columnwise`` are Python bools, not both
  False (the output selection of the fused-prologue ops; static)."""
  for name, v in (("rowwise", rowwise), ("columnwise", columnwise)):
    if not isinstance(v, (bool, np.bool_)):
      raise TypeError(f"{name} must be a Python bool (it is static), got {v!r}.")
  if not (rowwise or columnwise):
    raise ValueError("rowwise and columnwise are both False: ask for at least one copy.")


def check_given_amax(mode: str, amax, name: str = "amax"):
  """``amax`` (max|v| known beforehand) as a float32 scalar, or None.

  Per-tensor modes take it ("current" derives its scale from it,
  "tensorwise" gives a NaN scale_inv where it is not finite); "blockwise"
  has no tensor amax and refuses one.
  """
  if amax is None:
    return None
  if mode == "blockwise":
    raise ValueError(f"{name} must be None for mode='blockwise' (each tile's scale "
                     "comes from its own values).")
  if not jnp.issubdtype(jnp.result_type(amax), jnp.floating) or jnp.shape(amax) != ():
    raise TypeError(f"{name} must be a float32 scalar, got dtype {jnp.result_type(amax)} "
                    f"shape {jnp.shape(amax)}.")
  return jnp.asarray(amax, _F32)


# jit: as quantize_by_mode_reference (one compilation when tests call it eagerly).
@functools.partial(jax.jit, static_argnames=("mode", "dtype", "power_2_scale", "rowwise",
                                             "columnwise"))
def quantize_selected_reference(v: jax.Array, mode: str, dtype, scale=None,
                                power_2_scale: bool = False, *, amax=None,
                                rowwise: bool = True, columnwise: bool = True
                                ) -> QuantizedTensor:
  """``quantize_by_mode_reference(v, ...)`` with a choice of copies and a
  known amax: the spec of the fused-prologue ops' outputs.

  Args:
    v: (M, K) float32, the value the op computes.
    mode, dtype, scale, power_2_scale: as ``quantize_by_mode_reference``
      (the mode's tiles for "blockwise").
    amax: None, or max|v| known beforehand (per-tensor modes): "current"
      takes its scale from it (``quantize_from_amax_reference``),
      "tensorwise" returns it and NaN scale inverses where it is not finite.
    rowwise, columnwise: which copies to return; the other's fields are None,
      except a per-tensor scale_inv, the one scale of both copies.

  Returns:
    A ``QuantizedTensor`` whose present fields equal those of
    ``quantize_by_mode_reference(v, ...)`` when amax is None or max|v|.
  """
  if mode == "tensorwise" and amax is not None:
    data = quantize_op.saturating_cast(v.astype(_F32) * scale, dtype)
    q = nan_scale_inv_if_non_finite(QuantizedTensor(data, 1.0 / scale, data.T, 1.0 / scale, amax))
  elif mode == "current":
    q = quantize_op.quantize_from_amax_reference(v, amax_of(v) if amax is None else amax, dtype,
                                                 columnwise=True)
  else:
    q = quantize_op.quantize_by_mode_reference(v, mode, dtype, scale, power_2_scale)
  if not columnwise:
    q = q.replace(data_t=None, scale_inv_t=None)
  if not rowwise:
    q = q.replace(data=None, scale_inv=None if q.block_shape else q.scale_inv)
  return q
