"""LayerNorm / RMSNorm fused with the FP8 quantize of their output, and their backward.

``norm_quantize`` normalizes 2-D ``x`` (M, H) over its last dim and quantizes
the float32 result ``y`` in one of the :data:`MODES` of the fused-prologue
ops (``act_quantize`` has the same options), both copies, plus the row
statistics the backward needs. On the CUDA path ``y`` is never written in
16 or 32 bits: a statistics kernel, then the 128x128-tile quantize kernel
computing ``y`` in its prologue (``custom_calls/kernels/normalization.cu``).
``rowwise=False`` / ``columnwise=False`` leave a copy out (a layer's forward
writes only the rowwise copy its fprop GEMM reads), and
``norm_quantize_with_stats`` quantizes ``norm(x)`` again from given row
statistics (and, for current scaling, a given amax), without the
statistics pass: the columnwise copy for a backward's wgrad GEMM, the same
bytes the forward would have kept. ``norm_backward`` computes dx, dgamma and
dbeta from dy in one kernel and a small reduction of per-block partial sums. ``norm_stats`` is the statistics
pass alone: with ``norm_apply_reference`` (one XLA elementwise pass) it is
the forward of a norm whose output is not quantized.

The numerics are those of ``te_jax.layers.norm.apply_norm`` (float32 from the
input's dtype, in its order of operations)::

  layernorm: mean = mean(x), var = mean((x - mean)^2), y = (x - mean) * rstd
  rmsnorm:   var = mean(x^2), y = x * rstd                (no mean, no beta)
  rstd = rsqrt(var + epsilon); y = y * gamma' (+ beta); gamma' = gamma, or
  1 + gamma with ``zero_centered_gamma``

so a fused layer equals the unfused one up to the FP8 rounding of a ``y``
that no longer goes through the compute dtype first. For rmsnorm the mean
is not computed: it is ``None`` wherever a mean is returned or taken.

CUDA vs reference: given the same statistics, ``y`` (hence amax, scales and
FP8 bytes) is bit-identical (``norm_apply_reference`` is the formula the
kernels follow operation for operation). The statistics themselves are
float32 sums in another order, and ``rstd`` is ``1 / sqrt`` where XLA:CPU's
``rsqrt`` is approximate: they agree to a few float32 ulps (``STATS_RTOL``),
which can move an FP8 value by one step where ``y`` sits at a rounding tie.
``norm_backward`` on CUDA differs from its reference only through the two
per-row sums of the closed form (``BACKWARD_RTOL``).

>>> import jax.numpy as jnp
>>> x = jnp.arange(512.0).reshape(2, 256)
>>> q, mean, rstd = norm_quantize(x, jnp.ones(256), jnp.zeros(256), norm_type="layernorm",
...                               epsilon=1e-6, zero_centered_gamma=False,
...                               mode="current", dtype=jnp.float8_e4m3fn)
>>> q.data.shape, q.data_t.shape, mean.tolist()
((2, 256), (256, 2), [127.5, 383.5])
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.ops import _native
from te_jax.ops import normalization_cuda
from te_jax.ops import quantize as quantize_op
from te_jax.ops import quantize_copies as copies
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor

__all__ = [
    "NORM_TYPES",
    "MODES",
    "STATS_RTOL",
    "BACKWARD_RTOL",
    "MAX_CUDA_HIDDEN",
    "norm_stats_reference",
    "norm_apply_reference",
    "norm_forward_reference",
    "norm_backward_reference",
    "norm_quantize_reference",
    "norm_quantize_with_stats_reference",
    "norm_stats",
    "norm_quantize",
    "norm_quantize_with_stats",
    "norm_backward",
    "norm_supported",
    "check_norm_params",
]

NORM_TYPES = ("layernorm", "rmsnorm")
MODES = quantize_op.MODES
# CUDA statistics vs the reference's (relative; for the mean, relative to the
# row's root mean square): float32 sums of up to 8192 terms in two orders, and
# IEEE 1 / sqrt vs XLA:CPU's approximate rsqrt (up to 3 ulps).
STATS_RTOL = 2e-6
# CUDA dx vs the reference's, relative to max |dx| of the row: the two row
# sums of the closed form are added in another order.
BACKWARD_RTOL = 1e-5
MAX_CUDA_HIDDEN = normalization_cuda.MAX_HIDDEN
_F32 = jnp.float32


# ----------------------------------------------------------------- checks ---

def _check_options(norm_type, epsilon, zero_centered_gamma):
  if norm_type not in NORM_TYPES:
    raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {norm_type!r}.")
  if (isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating))
      or not np.isfinite(epsilon) or epsilon < 0):
    raise TypeError(f"epsilon must be a finite Python float >= 0 (it is static), got "
                    f"{epsilon!r}.")
  if not isinstance(zero_centered_gamma, (bool, np.bool_)):
    raise TypeError(f"zero_centered_gamma must be a Python bool, got "
                    f"{zero_centered_gamma!r}.")


def check_norm_params(x, gamma, beta, norm_type):
  """Checks x (M, H) float32/bfloat16/float16, gamma (H,) and beta (H,) or
  None (rmsnorm: None); ValueError/TypeError naming the bad one."""
  quantize_op.check_input(x, "x", 2)
  h = x.shape[1]
  quantize_op.check_input(gamma, "gamma", 1)
  if gamma.shape != (h,):
    raise ValueError(f"gamma must have shape ({h},) for x {x.shape}, got {gamma.shape}.")
  if beta is not None:
    if norm_type == "rmsnorm":
      raise ValueError("beta must be None for norm_type='rmsnorm'.")
    quantize_op.check_input(beta, "beta", 1)
    if beta.shape != (h,):
      raise ValueError(f"beta must have shape ({h},) for x {x.shape}, got {beta.shape}.")


def _check_stats(x, mean, rstd, norm_type):
  m = x.shape[0]
  if norm_type == "rmsnorm":
    if mean is not None:
      raise ValueError("mean must be None for norm_type='rmsnorm' (it has no mean).")
  elif mean is None or mean.shape != (m,) or mean.dtype != _F32:
    raise ValueError(f"mean must be float32 ({m},) for layernorm, got "
                     f"{None if mean is None else (mean.shape, mean.dtype)}.")
  if rstd is None or rstd.shape != (m,) or rstd.dtype != _F32:
    raise ValueError(f"rstd must be float32 ({m},), got "
                     f"{None if rstd is None else (rstd.shape, rstd.dtype)}.")


# ------------------------------------------------------------- references ---

def norm_stats_reference(x: jax.Array, *, norm_type: str, epsilon: float
                         ) -> Tuple[Optional[jax.Array], jax.Array]:
  """(mean or None, rstd), float32 (M,) each, as ``apply_norm`` computes them."""
  x32 = x.astype(_F32)
  if norm_type == "layernorm":
    mean = jnp.mean(x32, axis=-1)
    var = jnp.mean(jnp.square(x32 - mean[:, None]), axis=-1)
  else:
    mean = None
    var = jnp.mean(jnp.square(x32), axis=-1)
  return mean, lax.rsqrt(var + float(epsilon))  # a weak-typed float32 constant


def _gamma_eff(gamma, zero_centered_gamma):
  g = gamma.astype(_F32)
  return g + 1.0 if zero_centered_gamma else g


def norm_apply_reference(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                         mean: Optional[jax.Array], rstd: jax.Array, *,
                         zero_centered_gamma: bool) -> jax.Array:
  """float32 ``((x - mean) * rstd) * gamma' + beta`` from given statistics
  (``mean`` None: ``(x * rstd) * gamma'``; no ``+ beta`` without beta).

  The formula the CUDA kernels follow operation for operation, so with the
  kernels' statistics this reproduces their values bit for bit: XLA contracts
  ``y * gamma' + beta`` into one fused multiply-add (as it does in
  ``apply_norm``), and the kernels compute that step with ``fmaf``.
  """
  x32 = x.astype(_F32)
  xc = x32 if mean is None else x32 - mean[:, None]
  y = (xc * rstd[:, None]) * _gamma_eff(gamma, zero_centered_gamma)
  if beta is not None:
    y = y + beta.astype(_F32)
  return y


def norm_forward_reference(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array], *,
                           norm_type: str, epsilon: float, zero_centered_gamma: bool
                           ) -> Tuple[jax.Array, Optional[jax.Array], jax.Array]:
  """(y float32 (M, H), mean float32 (M,) or None for rmsnorm, rstd float32 (M,)).

  ``y`` equals ``te_jax.layers.norm.apply_norm(x, gamma, beta, ...,
  dtype=jnp.float32)`` bit for bit (same operations in the same order).
  """
  _check_options(norm_type, epsilon, zero_centered_gamma)
  check_norm_params(x, gamma, beta, norm_type)
  mean, rstd = norm_stats_reference(x, norm_type=norm_type, epsilon=epsilon)
  return (norm_apply_reference(x, gamma, beta, mean, rstd,
                               zero_centered_gamma=zero_centered_gamma), mean, rstd)


def norm_backward_reference(dy: jax.Array, x: jax.Array, gamma: jax.Array,
                            mean: Optional[jax.Array], rstd: jax.Array, *, norm_type: str,
                            zero_centered_gamma: bool
                            ) -> Tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """The closed-form gradient of ``norm_forward_reference``'s y, in float32.

  With ``xhat = (x - mean) * rstd`` (rmsnorm: ``x * rstd``), ``g = dy * gamma'``,
  ``c1 = mean(g)`` and ``c2 = mean(g * xhat)`` over each row::

    dx = ((g - c1) - xhat * c2) * rstd      (rmsnorm: (g - xhat * c2) * rstd)
    dgamma = sum over rows of dy * xhat,    dbeta = sum over rows of dy

  Returns:
    (dx in x.dtype, dgamma in gamma.dtype, dbeta in gamma.dtype or None for
    rmsnorm). dbeta is returned for every layernorm; a caller without beta
    drops it.
  """
  _check_backward_args(dy, x, gamma, mean, rstd, norm_type, zero_centered_gamma)
  x32, dy32 = x.astype(_F32), dy.astype(_F32)
  xc = x32 if mean is None else x32 - mean[:, None]
  xhat = xc * rstd[:, None]
  g = dy32 * _gamma_eff(gamma, zero_centered_gamma)
  c2 = jnp.mean(g * xhat, axis=-1, keepdims=True)
  if norm_type == "layernorm":
    c1 = jnp.mean(g, axis=-1, keepdims=True)
    dx = ((g - c1) - xhat * c2) * rstd[:, None]
  else:
    dx = (g - xhat * c2) * rstd[:, None]
  dgamma = jnp.sum(dy32 * xhat, axis=0).astype(gamma.dtype)
  dbeta = None if norm_type == "rmsnorm" else jnp.sum(dy32, axis=0).astype(gamma.dtype)
  return dx.astype(x.dtype), dgamma, dbeta


def _check_backward_args(dy, x, gamma, mean, rstd, norm_type, zero_centered_gamma,
                         dy_add=None, dx_add=None):
  _check_options(norm_type, 0.0, zero_centered_gamma)
  check_norm_params(x, gamma, None, norm_type)
  quantize_op.check_input(dy, "dy", 2)
  if dy.shape != x.shape:
    raise ValueError(f"dy must have x's shape {x.shape}, got {dy.shape}.")
  if dy_add is not None and (dy_add.shape != dy.shape or dy_add.dtype != dy.dtype):
    raise ValueError(f"dy_add must have dy's shape {dy.shape} and dtype {dy.dtype}, got "
                     f"{dy_add.shape} {dy_add.dtype}: cast it, or add it to dy first.")
  if dx_add is not None and (dx_add.shape != x.shape or dx_add.dtype != x.dtype):
    raise ValueError(f"dx_add must have x's shape {x.shape} and dtype {x.dtype}, got "
                     f"{dx_add.shape} {dx_add.dtype}: cast it, or add it to dx afterwards.")
  _check_stats(x, mean, rstd, norm_type)


def norm_quantize_reference(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array], *,
                            norm_type: str, epsilon: float, zero_centered_gamma: bool,
                            mode: str, dtype, scale=None, power_2_scale: bool = False,
                            rowwise: bool = True, columnwise: bool = True
                            ) -> Tuple[QuantizedTensor, Optional[jax.Array], jax.Array]:
  """Pure-JAX ``norm_quantize``: ``quantize_selected_reference`` of
  ``norm_forward_reference(...)[0]``, with the statistics."""
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  copies.check_outputs(rowwise, columnwise)
  y, mean, rstd = norm_forward_reference(x, gamma, beta, norm_type=norm_type,
                                         epsilon=epsilon,
                                         zero_centered_gamma=zero_centered_gamma)
  return (copies.quantize_selected_reference(y, mode, dtype, scale, power_2_scale,
                                             rowwise=rowwise, columnwise=columnwise),
          mean, rstd)


def _check_with_stats_args(x, gamma, beta, mean, rstd, norm_type, zero_centered_gamma,
                           mode, dtype, scale, amax, power_2_scale, rowwise, columnwise):
  _check_options(norm_type, 0.0, zero_centered_gamma)
  check_norm_params(x, gamma, beta, norm_type)
  _check_stats(x, mean, rstd, norm_type)
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  copies.check_outputs(rowwise, columnwise)
  amax = copies.check_given_amax(mode, amax)
  if mode == "current" and amax is None:
    raise ValueError("mode='current' with given statistics needs amax (the forward's "
                     "max|norm(x)|): the norm's amax comes from its statistics pass.")
  return dtype, scale, amax


def norm_quantize_with_stats_reference(x: jax.Array, gamma: jax.Array,
                                       beta: Optional[jax.Array], mean: Optional[jax.Array],
                                       rstd: jax.Array, *, norm_type: str,
                                       zero_centered_gamma: bool, mode: str, dtype,
                                       scale=None, amax=None, power_2_scale: bool = False,
                                       rowwise: bool = True, columnwise: bool = True
                                       ) -> QuantizedTensor:
  """Pure-JAX ``norm_quantize_with_stats``: ``quantize_selected_reference`` of
  ``norm_apply_reference`` with the given statistics."""
  dtype, scale, amax = _check_with_stats_args(
      x, gamma, beta, mean, rstd, norm_type, zero_centered_gamma, mode, dtype, scale, amax,
      power_2_scale, rowwise, columnwise)
  y = norm_apply_reference(x, gamma, beta, mean, rstd, zero_centered_gamma=zero_centered_gamma)
  return copies.quantize_selected_reference(y, mode, dtype, scale, power_2_scale, amax=amax,
                                            rowwise=rowwise, columnwise=columnwise)


# ------------------------------------------------------------ dispatchers ---

def norm_supported(m: int, h: int) -> bool:
  """Whether the CUDA kernels take x (m, h), forward and backward.

  Any m up to ``tiling.CUDA_MAX_ROWS`` (65535*128) and 1 <= h <=
  ``MAX_CUDA_HIDDEN`` (the backward kernel holds a row in one block of up to
  1024 threads x 8 columns). This
  checks shapes only (``impl="auto"`` falls back to the reference where no
  GPU or native module is present by itself).
  """
  ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (m, h))
  return ints and 1 <= m <= tiling.CUDA_MAX_ROWS and 1 <= h <= MAX_CUDA_HIDDEN


def _check_cuda_shape(m, h):
  if not norm_supported(m, h):
    raise ValueError(
        f"the CUDA normalization kernels do not take M={m}, H={h}: they need M <= "
        f"{tiling.CUDA_MAX_ROWS} and H <= {MAX_CUDA_HIDDEN}. Check norm_supported(m, h) first, "
        "or pass impl='reference'.")


def norm_stats(x: jax.Array, *, norm_type: str, epsilon: float, impl: str = "auto"
               ) -> Tuple[Optional[jax.Array], jax.Array]:
  """The row statistics of ``norm(x)``, for a norm whose output is not quantized.

  Args:
    x: (M, H) float32/bfloat16/float16.
    norm_type: "layernorm" or "rmsnorm".
    epsilon: Python float >= 0, added to the variance (mean square).
    impl: "auto", "cuda" or "reference" (see ``ops/_native.py``).

  Returns:
    (mean float32 (M,) or None for rmsnorm, rstd float32 (M,)), as
    :func:`norm_stats_reference`; the CUDA values agree with it to
    ``STATS_RTOL`` (another summation order). ``norm_apply_reference`` turns
    them into the output, as ``norm_quantize``'s kernels do.

  Raises:
    ValueError/TypeError for bad arguments; ValueError when the CUDA path is
    chosen and ``norm_supported(M, H)`` is False.
  """
  _check_options(norm_type, epsilon, False)
  quantize_op.check_input(x, "x", 2)

  def cuda():
    _check_cuda_shape(*x.shape)
    return normalization_cuda.norm_stats(x, norm_type == "rmsnorm", float(epsilon))
  return _native.dispatch(impl, cuda, lambda: norm_stats_reference(
      x, norm_type=norm_type, epsilon=epsilon))


def norm_quantize(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array], *,
                  norm_type: str, epsilon: float, zero_centered_gamma: bool, mode: str,
                  dtype, scale=None, power_2_scale: bool = False, impl: str = "auto",
                  rowwise: bool = True, columnwise: bool = True
                  ) -> Tuple[QuantizedTensor, Optional[jax.Array], jax.Array]:
  """FP8 quantization of ``y = norm(x)`` in one pass over memory, with the statistics.

  Args:
    x: (M, H) float32/bfloat16/float16.
    gamma: (H,) scale (any of those dtypes); ``1 + gamma`` is applied with
      ``zero_centered_gamma``.
    beta: (H,) shift, or None (always None for rmsnorm).
    norm_type: "layernorm" or "rmsnorm".
    epsilon: Python float >= 0, added to the variance (mean square).
    zero_centered_gamma: Python bool.
    mode, dtype, scale, power_2_scale: as ``act_quantize`` ("tensorwise" with
      a given float32 ``scale``, "current", or "blockwise" 1x128 + 128x1
      tiles with optional ``power_2_scale``).
    impl: "auto", "cuda" or "reference" (see ``ops/_native.py``).
    rowwise, columnwise: which FP8 copies to write (at least one).

  Returns:
    (q, mean, rstd): q a ``QuantizedTensor`` of y as ``act_quantize``
    returns (data (M, H), data_t (H, M), scales; amax = max|y| per tensor,
    None blockwise; a copy not asked for None), mean float32 (M,) (None for
    rmsnorm), rstd float32 (M,).

  Raises:
    ValueError/TypeError for bad arguments; ValueError when the CUDA path is
    chosen and ``norm_supported(M, H)`` is False.
  """
  _check_options(norm_type, epsilon, zero_centered_gamma)
  check_norm_params(x, gamma, beta, norm_type)
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  copies.check_outputs(rowwise, columnwise)

  def cuda():
    _check_cuda_shape(*x.shape)
    return normalization_cuda.norm_quantize(
        x, gamma, beta, norm_type == "rmsnorm", float(epsilon), bool(zero_centered_gamma),
        mode, dtype, scale, power_2_scale, rowwise=rowwise, columnwise=columnwise)
  return _native.dispatch(impl, cuda, lambda: norm_quantize_reference(
      x, gamma, beta, norm_type=norm_type, epsilon=epsilon,
      zero_centered_gamma=zero_centered_gamma, mode=mode, dtype=dtype, scale=scale,
      power_2_scale=power_2_scale, rowwise=rowwise, columnwise=columnwise))


def norm_quantize_with_stats(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                             mean: Optional[jax.Array], rstd: jax.Array, *, norm_type: str,
                             zero_centered_gamma: bool, mode: str, dtype, scale=None,
                             amax=None, power_2_scale: bool = False, rowwise: bool = True,
                             columnwise: bool = True, impl: str = "auto") -> QuantizedTensor:
  """FP8 quantization of ``y = norm(x)`` from given row statistics: no statistics pass.

  For a backward that quantizes ``norm(x)`` again as its forward did (x and
  the statistics are kept for the norm's backward anyway): with the
  forward's ``mean`` and ``rstd`` (and its scale, or under current scaling
  its amax) the bytes are those the forward's ``norm_quantize`` wrote.

  Args:
    x, gamma, beta, norm_type, zero_centered_gamma: as ``norm_quantize``.
    mean, rstd: float32 (M,) statistics (mean None for rmsnorm), as
      ``norm_quantize`` returned them.
    mode, dtype, scale, power_2_scale: as ``norm_quantize``.
    amax: max|y| known beforehand (float32 scalar): required for "current"
      (its scale comes from it; the amax pass is the statistics pass),
      optional for "tensorwise" (returned, not computed; NaN scale_inv where
      it is not finite), None for "blockwise".
    rowwise, columnwise: which FP8 copies to write (at least one).
    impl: "auto", "cuda" or "reference".

  Returns:
    A ``QuantizedTensor`` as ``norm_quantize``'s (amax: the given one, or
    max|y| for "tensorwise" without one).

  Raises:
    ValueError/TypeError for bad arguments; ValueError when the CUDA path is
    chosen and ``norm_supported(M, H)`` is False.
  """
  dtype, scale, amax = _check_with_stats_args(
      x, gamma, beta, mean, rstd, norm_type, zero_centered_gamma, mode, dtype, scale, amax,
      power_2_scale, rowwise, columnwise)

  def cuda():
    _check_cuda_shape(*x.shape)
    return normalization_cuda.norm_quantize(
        x, gamma, beta, norm_type == "rmsnorm", 0.0, bool(zero_centered_gamma), mode, dtype,
        scale, power_2_scale, rowwise=rowwise, columnwise=columnwise, stats=(mean, rstd),
        amax=amax)[0]
  return _native.dispatch(impl, cuda, lambda: norm_quantize_with_stats_reference(
      x, gamma, beta, mean, rstd, norm_type=norm_type, zero_centered_gamma=zero_centered_gamma,
      mode=mode, dtype=dtype, scale=scale, amax=amax, power_2_scale=power_2_scale,
      rowwise=rowwise, columnwise=columnwise))


def norm_backward(dy: jax.Array, x: jax.Array, gamma: jax.Array, mean: Optional[jax.Array],
                  rstd: jax.Array, *, norm_type: str, zero_centered_gamma: bool,
                  dy_add: Optional[jax.Array] = None, dx_add: Optional[jax.Array] = None,
                  impl: str = "auto") -> Tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """Gradients of ``y = norm(x)`` from ``dy = dL/dy`` and the forward's statistics.

  Args:
    dy: (M, H) float32/bfloat16/float16 (any of those, not necessarily x's).
    x: (M, H) the forward's input.
    gamma: (H,) the forward's gamma (as stored: zero-centered or not).
    mean, rstd: the statistics ``norm_quantize`` returned (mean None for
      rmsnorm).
    norm_type, zero_centered_gamma: as in the forward.
    dy_add: None, or (M, H) of dy's dtype: the gradient is that of
      ``dy + dy_add`` (summed in dy's dtype), for a normalized output used
      twice; the CUDA kernel sums them as it reads them, where the sum
      would be a pass of its own.
    dx_add: None, or (M, H) of x's dtype added to dx (dx rounded to x's
      dtype first, then the sum: an add of the two arrays), for x that also
      feeds a residual connection around the norm; the CUDA kernel adds it
      as it writes dx.
    impl: "auto", "cuda" or "reference".

  Returns:
    (dx in x.dtype, dgamma in gamma.dtype, dbeta in gamma.dtype or None for
    rmsnorm), as :func:`norm_backward_reference` of ``dy + dy_add`` (its dx
    plus ``dx_add``).
  """
  _check_backward_args(dy, x, gamma, mean, rstd, norm_type, zero_centered_gamma, dy_add,
                       dx_add)

  def cuda():
    _check_cuda_shape(*x.shape)
    return normalization_cuda.norm_backward(dy, x, gamma, mean, rstd,
                                            bool(zero_centered_gamma), dy_add=dy_add,
                                            dx_add=dx_add)

  def reference():
    dx, dgamma, dbeta = norm_backward_reference(
        dy if dy_add is None else dy + dy_add, x, gamma, mean, rstd, norm_type=norm_type,
        zero_centered_gamma=zero_centered_gamma)
    return (dx if dx_add is None else dx + dx_add), dgamma, dbeta
  return _native.dispatch(impl, cuda, reference)
