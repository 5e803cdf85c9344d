"""When a Flax module's norm can be fused into the FP8 quantization of its GEMM input.

The checks shared by every module with a fused norm + quantize path
(``te_jax.flax.dense``, ``te_jax.flax.mlp`` and their NNX twins): whether the
input and the active recipe allow it (:func:`fused_norm_blocker`), the FP8
state the fused core uses (:func:`fused_states`), the INFO line that says
why a module quantizes its normalized input in a separate pass instead
(:func:`log_unfused_norm`), and the fused norm + projection call of the
Linen and NNX dense modules (:func:`norm_project`). Then the norm those
modules apply when it is not fused (:func:`module_norm`): te_jax's norm
kernels unquantized (``te_jax.norm_dense.normalize``) where the hidden size
is at least :data:`MIN_KERNEL_HIDDEN` and the input is not sharded, else
XLA's (:func:`log_xla_norm` says why, when it is not the size).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import fp8_state as state_lib
from te_jax import norm_dense
from te_jax import sharding as sharding_lib
from te_jax.flax import fp8_module
from te_jax.flax.norm import apply_norm
from te_jax.ops import normalization as norm_op

__all__ = ["MIN_KERNEL_HIDDEN", "check_input_norm", "fused_norm_blocker", "fused_states",
           "fused_norm_states", "log_unfused_norm", "log_xla_norm", "norm_project",
           "norm_kernel_blocker", "module_norm"]

_NORM_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The narrowest hidden size whose unquantized norm runs on te_jax's kernels
# (module_norm); narrower ones stay in XLA. Measured on the H200
# (2026-12-03, bf16): at 4096 (LayerNorm, 16384 tokens) the kernels made the
# FP8-off MLP step 0.4% and the layer step 1.2% faster than XLA's norm; at
# 2048 (the Llama preset: RMSNorm, 24 layers, 32768 tokens) 1.2% slower. The
# backward kernel's block is hidden / 8 threads, and at 2048 it moved 1.95
# TB/s against 2.6 at 4096; with its grid sized to fill the SMs (2026-12-04)
# it moves 2.79 TB/s there, yet the Llama bf16 step still ran 0.7% slower than
# with XLA's norm (464.1 vs 461.1 ms), so the threshold stays.
MIN_KERNEL_HIDDEN = 4096


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


def _input_blocker(settings: fp8_module.GemmSettings, x: jax.Array, no_rule: str
                   ) -> Optional[str]:
  """What both norm paths refuse: sharded GEMMs (``no_rule`` says which path
  has no sharding rule) and input dtypes the kernels do not read."""
  if not settings.unsharded():
    return f"its GEMMs are sharded ({no_rule})"
  if jnp.dtype(x.dtype) not in _NORM_INPUT_DTYPES:
    return f"the input is {x.dtype}, not float32, bfloat16 or float16"
  return None


def norm_kernel_blocker(settings: fp8_module.GemmSettings, x: jax.Array) -> Optional[str]:
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
  mesh = sharding_lib.get_mesh()
  if mesh is not None and mesh.size > 1:
    return (f"a mesh of {mesh.size} devices is active (the norm kernels have no "
            "sharding rule)")
  m, h = math.prod(x.shape[:-1]), x.shape[-1]
  if not norm_op.norm_supported(m, h):
    return (f"{m} tokens, hidden {h}: the kernels take hidden <= {norm_dense.MAX_HIDDEN} "
            "and at least one token")
  return None


def module_norm(module_name: str, settings: fp8_module.GemmSettings, x: jax.Array,
                norm: norm_dense.NormParams, dtype, kernels: bool = True) -> jax.Array:
  """``norm(x)`` (..., H) in ``dtype`` for a module whose norm is not fused
  into an FP8 quantize: ``te_jax.norm_dense.normalize`` (the statistics and
  backward kernels, ``settings.impl``) unless :func:`norm_kernel_blocker`
  objects, then XLA's ``apply_norm`` after one INFO line saying why; XLA's
  silently with ``kernels=False`` (the module's ``fuse_norm_quantize=False``)
  and below :data:`MIN_KERNEL_HIDDEN`, where XLA's norm measured faster.
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


def fused_norm_blocker(settings: fp8_module.GemmSettings, x: jax.Array) -> Optional[str]:
  """Why the input ``x`` (..., embed) of an FP8 module cannot take the fused
  norm path (``te_jax.norm_dense``), or None when it can. FP8 must be on."""
  recipe = settings.recipe
  blocker = _input_blocker(settings, x, "the fused norm has no sharding rule")
  if blocker is not None:
    return blocker
  m, k = math.prod(x.shape[:-1]), x.shape[-1]
  if not norm_dense.supported(m, k, recipe):
    return (f"{m} tokens, embed {k}: it needs tokens % "
            f"{recipe.scaling_mode().token_block} == 0, embed % 128 == 0 and embed <= "
            f"{norm_dense.MAX_HIDDEN} (a norm cannot be padded)")
  return None


def fused_states(module: nn.Module, settings: fp8_module.GemmSettings, names):
  """(states, None) for a fused core that calls the functional layer with the
  FP8 states of the GEMMs ``names`` (the variables two ``fp8_module.fp8_gemm``
  calls of those names use), or (None, reason) when the module should take
  the unfused path instead, whose ``fp8_gemm`` then handles them: the
  variables hold another recipe's state (kept as they are there), or are
  missing or of another shape (``fp8_gemm`` raises its error there).
  Declares nothing unless it returns states.
  """
  mode = settings.recipe.scaling_mode()
  coll = state_lib.FP8_COLLECTION
  have = [module.has_variable(coll, n) for n in names]
  if not mode.uses_state:
    if any(have):
      return None, "it holds FP8 state that the active recipe does not use"
    return (None,) * len(names), None
  if not all(have) and not module.is_mutable_collection(coll):
    return None, "its FP8 state variables are missing"
  want = jax.tree.map(lambda a: a.shape, jax.eval_shape(mode.init_state))
  for n, h in zip(names, have):
    if h and jax.tree.map(lambda a: a.shape, module.get_variable(coll, n)) != want:
      return None, f"its FP8 state '{n}' does not fit the active recipe"
  # Through declare_fp8_state: the same scan checks as the unfused path.
  return tuple(fp8_module.declare_fp8_state(module, n, mode) for n in names), None


def fused_norm_states(module, settings: fp8_module.GemmSettings, x: jax.Array, names,
                      find_states=fused_states):
  """The FP8 states (a tuple, one per GEMM in ``names``) with which ``module``
  takes its fused norm + quantize path for input ``x``, or None when it
  normalizes in XLA instead: silently with FP8 off, else after
  :func:`log_unfused_norm` says why. ``find_states``: :func:`fused_states`
  (Linen) or ``te_jax.nnx.state.fused_states`` (NNX), same contract."""
  if settings.recipe is None:
    return None
  blocker = fused_norm_blocker(settings, x)
  if blocker is None:
    states, blocker = find_states(module, settings, names)
    if blocker is None:
      return states
  log_unfused_norm(type(module).__name__, blocker)
  return None


def check_input_norm(input_norm, axis, ndim: int):
  """Checks the ``input_norm`` argument of a projection contracting ``axis``
  of an ndim-D input: a ``te_jax.norm_dense.NormParams``, and a projection
  over the last axis alone (the axis the norm normalizes)."""
  if not isinstance(input_norm, norm_dense.NormParams):
    raise TypeError(f"input_norm must be a te_jax.norm_dense.NormParams, got "
                    f"{type(input_norm).__name__}.")
  if fp8_module.canonicalize_axes(axis, ndim) != (ndim - 1,):
    raise ValueError(f"input_norm normalizes the last axis of the input, so the "
                     f"projection must contract it alone: axis=-1, got {axis!r}.")


def norm_project(x, norm: norm_dense.NormParams, kernel, bias, settings, compute, state, *,
                 features, return_norm_output: bool, num_splits: int = 1):
  """``te_jax.norm_dense.fp8_norm_dense`` on the 2-D views of a module's input
  x (..., embed), kernel (embed, *features) in its parameter dtype and bias
  (*features,) or None, in the module's shapes: (..., *features), a tuple of
  ``features[0]`` arrays (..., *features[1:]) when ``num_splits`` > 1, and
  with ``return_norm_output`` also the normalized x in ``compute``."""
  embed, lead = x.shape[-1], x.shape[:-1]
  out = norm_dense.fp8_norm_dense(
      x.reshape(-1, embed), norm.gamma, norm.beta,
      fp8_module.gemm_kernel(settings, kernel, compute).reshape(embed, -1),
      None if bias is None else bias.astype(compute).reshape(-1),
      norm_type=norm.norm_type, epsilon=norm.epsilon,
      zero_centered_gamma=norm.zero_centered_gamma, recipe=settings.recipe,
      fp8_state=state, impl=settings.impl, return_norm_output=return_norm_output,
      dtype=compute, num_splits=num_splits)
  y, ln_out = out if return_norm_output else (out, None)
  if num_splits > 1:
    y = tuple(p.reshape(lead + tuple(features[1:])) for p in y)
  else:
    y = y.reshape(lead + tuple(features))
  return (y, ln_out.reshape(x.shape)) if return_norm_output else y
