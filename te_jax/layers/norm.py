"""Norms in the te_jax modules, and which path each one takes.

A module's norm over the last axis runs one of three ways:

* fused into the FP8 quantization of the next GEMM's input
  (``te_jax.norm_dense`` / ``te_jax.fused_mlp``), where the input and the
  active recipe allow it (:func:`fused_norm_blocker`) and the module's FP8
  state fits (:func:`fused_norm_states`); otherwise INFO once per reason
  (:func:`log_unfused_norm`);
* unquantized on te_jax's statistics and backward kernels
  (``te_jax.norm_dense.normalize``), where the hidden size is at least
  :data:`MIN_KERNEL_HIDDEN` and :func:`norm_kernel_blocker` does not object
  (:func:`module_norm`);
* in XLA (:func:`apply_norm`), else (:func:`log_xla_norm` says why, when it
  is not the size).

:func:`apply_norm` is also the numerics every other path matches.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp

from te_jax import explicit_axes as explicit_lib
from te_jax import norm_dense
from te_jax.layers.gemm import canonicalize_axes
from te_jax.layers.settings import Settings
from te_jax.layers.state import GemmStates, fused_states
from te_jax.ops import normalization as norm_op

__all__ = ["NORM_TYPES", "MIN_KERNEL_HIDDEN", "check_norm_type", "apply_norm", "module_norm",
           "norm_kernel_blocker", "fused_norm_blocker", "fused_norm_states", "check_input_norm",
           "log_unfused_norm", "log_xla_norm"]

NORM_TYPES = ("layernorm", "rmsnorm")
_NORM_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The narrowest hidden size whose unquantized norm runs on te_jax's kernels
# (module_norm); narrower ones stay in XLA, which is as fast or faster there
# (the comparison is in BENCHMARKS.md and the dated log under docs/).
MIN_KERNEL_HIDDEN = 4096


def check_norm_type(norm_type: str):
  """ValueError unless ``norm_type`` is "layernorm" or "rmsnorm"."""
  if norm_type not in NORM_TYPES:
    raise ValueError(f"layernorm_type must be one of {NORM_TYPES}, got {norm_type!r}.")


def apply_norm(x: jax.Array, scale: jax.Array, bias: Optional[jax.Array], *,
               norm_type: str, epsilon: float, zero_centered_gamma: bool,
               dtype) -> jax.Array:
  """Normalizes ``x`` (..., H) over its last axis in float32; returns ``dtype``.

  ``scale`` (H,) is gamma, or gamma - 1 with ``zero_centered_gamma``;
  ``bias`` (H,) is beta (layernorm) or None.
  """
  x32 = x.astype(jnp.float32)
  if norm_type == "layernorm":
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    xc = x32 - mean
    var = jnp.mean(jnp.square(xc), axis=-1, keepdims=True)
  else:
    xc = x32
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  y = xc * jax.lax.rsqrt(var + epsilon)
  # Under an explicit-axes mesh a scale sharded over FSDP axes is gathered
  # first (XLA does it unasked under an auto-axes one).
  scale, bias = explicit_lib.gather_explicit(scale), explicit_lib.gather_explicit(bias)
  gamma = scale.astype(jnp.float32)
  if zero_centered_gamma:
    gamma = gamma + 1.0
  y = y * gamma
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(dtype)


@functools.lru_cache(maxsize=None)
def log_unfused_norm(module_name: str, reason: str):
  """Says once per (module class, reason) why the norm was not fused."""
  logging.getLogger("te_jax").info(
      "te_jax: %s quantizes its normalized input in a separate pass (not the fused "
      "norm + quantize kernels): %s", module_name, reason)


@functools.lru_cache(maxsize=None)
def log_xla_norm(module_name: str, reason: str):
  """Says once per (module class, reason) why a norm runs in XLA."""
  logging.getLogger("te_jax").info(
      "te_jax: %s normalizes in XLA (not te_jax's norm kernels): %s", module_name, reason)


def _input_blocker(settings: Settings, x: jax.Array, no_rule: str) -> Optional[str]:
  """What both norm paths refuse: sharded GEMMs (``no_rule`` says which path
  has no sharding rule) and input dtypes the kernels do not read."""
  if not settings.unsharded():
    return f"its GEMMs are sharded ({no_rule})"
  if jnp.dtype(x.dtype) not in _NORM_INPUT_DTYPES:
    return f"the input is {x.dtype}, not float32, bfloat16 or float16"
  return None


def norm_kernel_blocker(settings: Settings, x: jax.Array) -> Optional[str]:
  """Why a module's unquantized norm of ``x`` (..., H) cannot run on te_jax's
  norm kernels (``te_jax.norm_dense.normalize``), or None when it can.

  The kernels have no sharding rule, so a mesh of more than one device in
  the context, or an autocast whose mesh resource shards the GEMMs, sends the
  norm to XLA (which partitions it). A jit over several devices with no mesh
  in the context cannot be seen here: there XLA runs the kernels on
  replicated operands.
  """
  blocker = _input_blocker(settings, x, "the norm kernels have no sharding rule")
  if blocker is not None:
    return blocker
  mesh = settings.mesh
  if mesh is not None and mesh.size > 1:
    return (f"a mesh of {mesh.size} devices is active (the norm kernels have no "
            "sharding rule)")
  m, h = math.prod(x.shape[:-1]), x.shape[-1]
  if not norm_op.norm_supported(m, h):
    return (f"{m} tokens, hidden {h}: the kernels take hidden <= {norm_dense.MAX_HIDDEN} "
            "and at least one token")
  return None


def module_norm(module_name: str, settings: Settings, x: jax.Array,
                norm: norm_dense.NormParams, dtype, kernels: bool = True) -> jax.Array:
  """``norm(x)`` (..., H) in ``dtype`` for a module whose norm is not fused
  into an FP8 quantize: ``te_jax.norm_dense.normalize`` (the statistics and
  backward kernels, ``settings.impl``) unless :func:`norm_kernel_blocker`
  objects, then :func:`apply_norm` after one INFO line saying why;
  :func:`apply_norm` silently with ``kernels=False`` (the module's
  ``fuse_norm_quantize=False``) and below :data:`MIN_KERNEL_HIDDEN`.
  The outputs agree up to the statistics' float32 summation order (bit for
  bit on the reference path); the gradients are the closed form's."""
  if kernels and x.shape[-1] >= MIN_KERNEL_HIDDEN:
    blocker = norm_kernel_blocker(settings, x)
    if blocker is None:
      return norm_dense.normalize(x, norm.gamma, norm.beta, norm_type=norm.norm_type,
                                  epsilon=norm.epsilon,
                                  zero_centered_gamma=norm.zero_centered_gamma, dtype=dtype,
                                  impl=settings.impl)
    log_xla_norm(module_name, blocker)
  return apply_norm(x, norm.gamma, norm.beta, norm_type=norm.norm_type, epsilon=norm.epsilon,
                    zero_centered_gamma=norm.zero_centered_gamma, dtype=dtype)


def fused_norm_blocker(settings: Settings, x: jax.Array) -> Optional[str]:
  """Why the input ``x`` (..., embed) of an FP8 module cannot take the fused
  norm path (``te_jax.norm_dense``), or None when it can. FP8 must be on."""
  blocker = _input_blocker(settings, x, "the fused norm has no sharding rule")
  if blocker is not None:
    return blocker
  m, k = math.prod(x.shape[:-1]), x.shape[-1]
  if not norm_dense.supported(m, k, settings.recipe):
    return (f"{m} tokens, embed {k}: it needs tokens % {settings.mode.token_block} == 0, "
            f"embed % 128 == 0 and embed <= {norm_dense.MAX_HIDDEN} (a norm cannot be "
            "padded)")
  return None


def fused_norm_states(states: GemmStates, settings: Settings, x: jax.Array, names):
  """The FP8 states (a tuple, one per GEMM in ``names``) with which a module
  takes its fused norm + quantize path for input ``x``, or None when it
  normalizes separately instead: silently with FP8 off, else after
  :func:`log_unfused_norm` says why."""
  if settings.recipe is None:
    return None
  blocker = fused_norm_blocker(settings, x)
  if blocker is None:
    found, blocker = fused_states(states, names, settings.mode)
    if blocker is None:
      return found
  log_unfused_norm(states.module_name, blocker)
  return None


def check_input_norm(input_norm, axis, ndim: int):
  """Checks the ``input_norm`` argument of a projection contracting ``axis``
  of an ndim-D input: a ``te_jax.norm_dense.NormParams``, and a projection
  over the last axis alone (the axis the norm normalizes)."""
  if not isinstance(input_norm, norm_dense.NormParams):
    raise TypeError(f"input_norm must be a te_jax.norm_dense.NormParams, got "
                    f"{type(input_norm).__name__}.")
  if canonicalize_axes(axis, ndim) != (ndim - 1,):
    raise ValueError(f"input_norm normalizes the last axis of the input, so the "
                     f"projection must contract it alone: axis=-1, got {axis!r}.")
