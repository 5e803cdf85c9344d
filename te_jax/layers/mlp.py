"""The ``LayerNormMLP`` block: norm -> dense -> activation(s) -> dropout -> dense.

:func:`layernorm_mlp` owns which path the block takes:

* the fused core (``te_jax.fused_mlp``), when ``fuse_activation_quantize``,
  FP8 on, the GEMMs unsharded, dropout inactive and the shapes allowed
  (:func:`fused_core_blocker`; tokens a multiple of the recipe's
  ``token_block``, embed and mlp multiples of 128): the activation and the
  quantization of its output are one pass over memory, forward and backward,
  and no activation gradient is materialized in the compute dtype. It also
  takes the norm (normalized and quantized in one pass, the norm's backward
  in one kernel) where ``te_jax.layers.norm`` allows it; otherwise the norm
  runs in front of it;
* else two GEMMs around an XLA activation (:func:`activate`), with the norm
  in front. When the fused core was asked for but cannot run, the
  ``te_jax`` logger says why (INFO, once per reason: :func:`log_unfused`).

``fp8_autocast(store_act_input_in_fp8=True)`` reaches the fused core, with
its norm or behind it (``te_jax.fused_mlp.fp8_mlp`` keeps h in FP8); where
the block runs as two FP8 dense layers the option cannot apply, and a
warning says so once per reason (:func:`warn_act_input_not_in_fp8`).

Both paths use the same parameters and FP8 states (``wi_fp8_meta``,
``wo_fp8_meta``). Gated activations (two names, e.g. ("silu", "linear") =
SwiGLU) use one up-projection (embed, n_act, mlp) computed as one GEMM; the
result is ``act0(h[..., 0, :]) * act1(h[..., 1, :])``.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Optional, Sequence, Tuple

import jax

from te_jax import fused_mlp
from te_jax import norm_dense
from te_jax.fused_mlp import warn_act_input_not_in_fp8
from te_jax.layers.checks import check_add_residual
from te_jax.layers.gemm import gemm, mlp_core
from te_jax.layers.norm import fused_norm_states, module_norm
from te_jax.layers.settings import Settings
from te_jax.layers.state import GemmStates
from te_jax.ops.act_quantize import ACTIVATIONS

__all__ = ["ACTIVATIONS", "FP8_GEMMS", "layernorm_mlp", "activate", "check_activations",
           "fused_core_blocker", "fused_norm_mlp", "log_unfused", "warn_act_input_not_in_fp8"]

# The state names of the block's two GEMMs.
FP8_GEMMS = ("wi_fp8_meta", "wo_fp8_meta")


def check_activations(acts) -> tuple:
  """The activation names as a tuple; ValueError unless one or two known ones."""
  acts = (acts,) if isinstance(acts, str) else tuple(acts)
  if not acts or len(acts) > 2:
    raise ValueError(f"activations must hold one or two names, got {acts!r}.")
  for a in acts:
    if a not in ACTIVATIONS:
      raise ValueError(f"unknown activation {a!r}; known: {sorted(ACTIVATIONS)}.")
  return acts


@functools.lru_cache(maxsize=None)
def log_unfused(owner: str, reason: str, backward_chunks: int = 1):
  """Says once per reason why ``owner`` (a LayerNormMLP, Linen or NNX) took
  the unfused FP8 path; warns too where its ``backward_chunks`` (a memory
  saving the user asked for) has no effect there."""
  logging.getLogger("te_jax").info(
      "te_jax: %s runs as two FP8 dense layers (not the fused "
      "activation-quantize core, which holds less memory): %s", owner, reason)
  if backward_chunks > 1:
    logging.getLogger("te_jax").warning(
        "te_jax: %s backward_chunks=%d has no effect: the block runs as two FP8 dense "
        "layers because %s", owner, backward_chunks, reason)


def fused_core_blocker(m: int, embed: int, f: int, settings: Settings, acts,
                       dropout: bool) -> Optional[str]:
  """Why the fused MLP core cannot run on ``m`` tokens of width ``embed``
  with hidden width ``f`` (None when it can); ``dropout``: whether the
  intermediate dropout is active."""
  if dropout:
    return "intermediate dropout is active"
  if not settings.unsharded():
    return "its GEMMs are sharded (the fused core has no sharding rule)"
  return fused_mlp.why_not_supported(m, embed, f, embed, settings.recipe, acts) or None


def activate(h: jax.Array, acts: Sequence[str]) -> jax.Array:
  """The unfused MLP's activation, ``act0(h[..., 0, :]) * act1(h[..., 1, :])``
  ...: h (..., len(acts), mlp) -> (..., mlp) in h's dtype.

  Under ``jax.checkpoint``, so that the backward keeps only ``h`` and
  recomputes the activation's derivative from it inside its own fusion.
  Differentiated directly, XLA's forward writes an intermediate (gelu's
  tanh) as a second full-size output and the backward reads it back: one
  more hidden-sized buffer of memory and its traffic per step.
  """
  def fn(h):
    z = ACTIVATIONS[acts[0]].jax_fn(h[..., 0, :])
    for i in range(1, len(acts)):
      z = z * ACTIVATIONS[acts[i]].jax_fn(h[..., i, :])
    return z
  return jax.checkpoint(fn)(h)


def fused_norm_mlp(x, wi, wo, bi, bo, *, norm: norm_dense.NormParams, settings: Settings,
                   states, activations, dtype, return_norm_output: bool,
                   backward_chunks: int = 1, add_input: bool = False):
  """The whole block as one custom VJP (``te_jax.fused_mlp.fp8_mlp`` with its
  norm): the norm and the activation each computed and quantized in one
  pass, forward and backward.

  Shapes: ``x`` (..., E) -> (..., E), with ``return_norm_output`` also the
  norm output (..., E); ``wi`` (E, n_act, F), ``wo`` (F, E), ``bi`` (n_act,
  F) and ``bo`` (E,) or None, in the compute dtype. ``states``: the (wi, wo)
  delayed-scaling states (None for the other recipes). ``backward_chunks``
  and ``add_input`` (``x + block(x)``): as ``te_jax.fused_mlp.fp8_mlp``'s.
  """
  lead, e = x.shape[:-1], x.shape[-1]
  out = fused_mlp.fp8_mlp(
      x.reshape(math.prod(lead), e), wi.reshape(e, -1), wo,
      None if bi is None else bi.reshape(-1), bo, activations=activations,
      recipe=settings.recipe, wi_state=states[0], wo_state=states[1],
      impl=settings.impl, dtype=dtype, norm=norm, return_norm_output=return_norm_output,
      backward_chunks=backward_chunks, add_input=add_input, **settings.mlp_residual_plan())
  if return_norm_output:
    return out[0].reshape(*lead, e), out[1].reshape(x.shape)
  return out.reshape(*lead, e)


def layernorm_mlp(states: GemmStates, settings: Settings, x: jax.Array, *,
                  norm: norm_dense.NormParams, wi: jax.Array, wo: jax.Array,
                  bi: Optional[jax.Array], bo: Optional[jax.Array], activations: Tuple[str, ...],
                  dtype, owner: str, kernel_axes: Tuple[Sequence, Sequence],
                  fuse_activation_quantize: bool = True, fuse_norm_quantize: bool = True,
                  backward_chunks: int = 1, dropout: Optional[Callable] = None,
                  dropout_active: bool = False, return_norm_output: bool = False,
                  add_residual: bool = False):
  """``act(norm(x) @ wi + bi) @ wo + bo`` on the path the module docs describe.

  Args:
    states, settings: the module's FP8 state (GEMMs :data:`FP8_GEMMS`) and
      autocast settings.
    x: (..., E) input.
    norm: the norm's parameters and options.
    wi: (E, n_act, F) and ``wo`` (F, E) kernels in their parameter dtype;
      ``bi`` (n_act, F) and ``bo`` (E,) biases or None, in any dtype.
    activations: one or two names (:func:`check_activations`).
    dtype: the compute dtype (of the output and the norm output).
    owner: the module as the log lines name it (e.g. "nnx.LayerNormMLP").
    kernel_axes: the logical axis names of ``wi`` and ``wo``.
    fuse_activation_quantize, fuse_norm_quantize, backward_chunks: the
      module's options (False: never that fused path).
    dropout: the intermediate dropout, ``z -> dropout(z)``, or None; applied
      on the unfused path.
    dropout_active: whether ``dropout`` drops anything in this call (then
      the fused core, which has no dropout, is not taken).
    return_norm_output: also return the norm output.
    add_residual: return ``x + y`` (x in ``dtype``): on the fused core with
      its norm the add is the down projection's C input and its backward
      part of the norm's kernel (``fp8_mlp(add_input=True)``), elsewhere an
      add after the block.

  Returns:
    (..., E) in ``dtype``; with ``return_norm_output`` ``(y, norm output)``.
  """
  fused_mlp.check_backward_chunks(backward_chunks, settings.recipe)
  if add_residual:
    check_add_residual(owner, x, dtype, wo.shape[-1])
  lead, e, f = x.shape[:-1], x.shape[-1], wo.shape[0]
  m = math.prod(lead)
  bi = None if bi is None else bi.astype(dtype)
  bo = None if bo is None else bo.astype(dtype)
  fused = False
  blocker = "fuse_activation_quantize=False"
  if fuse_activation_quantize and settings.recipe is not None:
    blocker = fused_core_blocker(m, e, f, settings, activations, dropout_active)
    fused = blocker is None
    if not fused:
      log_unfused(owner, blocker, backward_chunks)
  if settings.store_act_input_in_fp8 and not fused:
    warn_act_input_not_in_fp8(owner, f"it runs as two FP8 dense layers because {blocker}")
  found = (fused_norm_states(states, settings, x, FP8_GEMMS)
           if fused and fuse_norm_quantize else None)
  if found is not None:
    if found[0] is not None:
      states.track_updates(wi)
    return fused_norm_mlp(x, wi, wo, bi, bo, norm=norm, settings=settings, states=found,
                          activations=activations, dtype=dtype,
                          return_norm_output=return_norm_output,
                          backward_chunks=backward_chunks, add_input=add_residual)
  ln_out = module_norm(owner, settings, x, norm, dtype, kernels=fuse_norm_quantize)
  if fused:   # both GEMMs in one custom VJP, the activation fused into quantization
    y = mlp_core(states, settings, ln_out.reshape(m, e), wi.reshape(e, -1), None if bi is None
                 else bi.reshape(-1), wo, bo, activations=activations, names=FP8_GEMMS,
                 backward_chunks=backward_chunks).reshape(*lead, e)
  else:
    h = gemm(states, settings, ln_out, wi, bi, name=FP8_GEMMS[0], kernel_axes=kernel_axes[0])
    z = activate(h, activations).astype(dtype)      # h: (..., n_act, mlp)
    if dropout is not None:
      z = dropout(z)
    y = gemm(states, settings, z, wo, bo, name=FP8_GEMMS[1], kernel_axes=kernel_axes[1],
             track=False)
  if add_residual:
    y = x + y
  return (y, ln_out) if return_norm_output else y
