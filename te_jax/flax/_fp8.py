"""Helpers shared by the Linen modules: the active recipe and FP8 GEMM state.

Every GEMM of a te_jax Linen module goes through :func:`fp8_gemm`, which

* reads the active recipe from :func:`te_jax.get_fp8_context` *at trace time*
  (``recipe = ctx.recipe if ctx.enabled else None``);
* under ``DelayedScaling`` declares the GEMM's amax histories and scales as
  one variable ``<name>`` in the collection ``FP8_COLLECTION``
  (``"_overwrite_with_gradient"``), created with
  ``fp8_state.init_dense_state(recipe.amax_history_len)``; no FP8 state exists
  with FP8 off or with the other recipes;
* calls :func:`te_jax.dense.dense` on the 2-D view of the operands.

When the variables hold delayed-scaling state but the active recipe does not
use it (FP8 switched off for a step, or another recipe), the state's
"gradient" is the state itself, so ``TrainState.apply_gradients`` leaves it
untouched.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import flax.linen as nn

from te_jax import dense as dense_lib
from te_jax import fp8_state as state_lib
from te_jax import fused_mlp
from te_jax import recipe as recipe_lib
from te_jax import sharding as sharding_lib
from te_jax.autocast import get_fp8_context

__all__ = ["active_recipe", "fp8_gemm", "fp8_mlp_core", "unsharded",
           "canonicalize_axes", "FP8_META"]

FP8_META = "fp8_meta"


def active_recipe() -> Optional[recipe_lib.Recipe]:
  """The recipe of the innermost enabled ``fp8_autocast``, else None."""
  ctx = get_fp8_context()
  return ctx.recipe if ctx.enabled else None


def canonicalize_axes(axes, ndim: int) -> Tuple[int, ...]:
  """Normalizes an int or tuple of (possibly negative) axes of an ndim array."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  out = tuple(a % ndim if -ndim <= a < ndim else None for a in axes)
  if None in out:
    raise ValueError(f"axis {axes} out of range for an input of rank {ndim}.")
  if len(set(out)) != len(out):
    raise ValueError(f"axis {axes} repeats an axis.")
  return out


def _fp8_state(module: nn.Module, name: str, recipe):
  """Declares (or reads) the delayed-scaling state of one GEMM."""
  hist = recipe.amax_history_len
  if not module.has_variable(state_lib.FP8_COLLECTION, name) and (
      not module.is_mutable_collection(state_lib.FP8_COLLECTION)):
    raise ValueError(
        f"{module.__class__.__name__} {module.path if hasattr(module, 'path') else ''}"
        f": DelayedScaling needs the FP8 state variable '{name}' in collection "
        f"'{state_lib.FP8_COLLECTION}', but the variables passed to apply() have "
        "none. Initialize the model inside fp8_autocast(enabled=True, "
        "fp8_recipe=DelayedScaling(...)) with the same recipe, or pass "
        f"mutable=['{state_lib.FP8_COLLECTION}'].")
  var = module.variable(state_lib.FP8_COLLECTION, name,
                        state_lib.init_dense_state, hist)
  state = var.value
  got = state["x"]["amax_history"].shape[-1]
  if got != hist:
    raise ValueError(
        f"FP8 state '{name}' has an amax history of length {got} but the active "
        f"DelayedScaling recipe has amax_history_len={hist}; initialize the model "
        "with the recipe used for training.")
  return state


@jax.custom_vjp
def _keep_state(y, state):
  """Identity on ``y`` whose backward returns ``state`` as the state's gradient.

  Used when a module holds delayed-scaling state but the active recipe does
  not use it (FP8 off, or another recipe): the "gradient" that
  ``TrainState.apply_gradients`` writes back is then the state itself, so the
  state is left untouched instead of being overwritten by zeros.
  """
  del state
  return y


def _keep_state_fwd(y, state):
  return y, state


def _keep_state_bwd(state, g):
  return g, state


_keep_state.defvjp(_keep_state_fwd, _keep_state_bwd)


def fp8_gemm(module: nn.Module, x: jax.Array, kernel: jax.Array,
             bias: Optional[jax.Array] = None, *, recipe=None,
             name: str = FP8_META, contract_ndim: int = 1,
             kernel_axes: Optional[Sequence[Optional[str]]] = None,
             split_output: bool = False):
  """``x @ kernel (+ bias)`` over the last ``contract_ndim`` dims of ``x``.

  Calls :func:`te_jax.dense.dense_general`, which keeps the leading dims of
  ``x`` (a (batch, seq) layout sharded for sequence parallelism reaches the
  GEMM as it is) and, with ``kernel_axes`` and an active mesh resource, runs
  the FP8 GEMMs sharded.

  Args:
    module: the Linen module that owns the GEMM (and its FP8 state).
    x: (*lead, *in_dims) input in the compute dtype, contracting dims last.
    kernel: (*in_dims, *out_dims) kernel in the compute dtype.
    bias: optional (*out_dims) bias.
    recipe: a te_jax recipe, or None for a plain dot in ``x.dtype``.
    name: name of the FP8 state variable (one per GEMM of the module).
    contract_ndim: number of contracting dims (``len(in_dims)``).
    kernel_axes: logical axis names of the kernel, one per dim.
    split_output: return the output unstacked along its first out dim, a
      tuple of ``out_dims[0]`` arrays (*lead, *out_dims[1:]). In FP8 and
      unsharded, through ``te_jax.dense.fp8_dense_split`` (the gradients of
      the parts are quantized without being concatenated).

  Returns:
    (*lead, *out_dims) array in ``x.dtype``, or the tuple (``split_output``).
  """
  kernel_axes = None if kernel_axes is None else tuple(kernel_axes)
  state = None
  if isinstance(recipe, recipe_lib.DelayedScaling):
    state = _fp8_state(module, name, recipe)
  if split_output and recipe is not None and unsharded():
    y = _split_gemm(x, kernel, bias, recipe, state, contract_ndim)
  else:
    y = dense_lib.dense_general(x, kernel, bias, contract_ndim=contract_ndim,
                                recipe=recipe, fp8_state=state, kernel_axes=kernel_axes)
    if split_output:
      lead = (slice(None),) * (x.ndim - contract_ndim)
      y = tuple(y[lead + (i,)] for i in range(kernel.shape[contract_ndim]))
  if state is None and module.has_variable(state_lib.FP8_COLLECTION, name):
    # State from a DelayedScaling init, unused now: keep it as it is.
    y = _keep_state(y, module.get_variable(state_lib.FP8_COLLECTION, name))
  return y


def _split_gemm(x, kernel, bias, recipe, state, contract_ndim):
  """``fp8_gemm(..., split_output=True)`` through ``fp8_dense_split``."""
  lead = x.shape[:x.ndim - contract_ndim]
  in_dims, out_dims = kernel.shape[:contract_ndim], kernel.shape[contract_ndim:]
  k = math.prod(in_dims)
  parts = dense_lib.fp8_dense_split(
      x.reshape(lead + (k,)), kernel.reshape(k, -1),
      None if bias is None else bias.reshape(-1), num_splits=out_dims[0],
      recipe=recipe, fp8_state=state)
  return tuple(p.reshape(lead + tuple(out_dims[1:])) for p in parts)


def unsharded() -> bool:
  """True when no mesh axis named by the active mesh resource has size > 1.

  The fused FP8 MLP core has no sharding rule of its own, so it is only used
  when the GEMMs would not be sharded anyway.
  """
  mr = get_fp8_context().mesh_resource
  if mr is None:
    return True
  mesh = sharding_lib.get_mesh()
  if mesh is None:
    return True
  axes = [a for role in (mr.dp_resource, mr.fsdp_resource, mr.tp_resource)
          for a in ((role,) if isinstance(role, str) else (role or ()))]
  return sharding_lib.mesh_axis_size(mesh, tuple(a for a in axes
                                                 if a in mesh.axis_names)) == 1


def fp8_mlp_core(module: nn.Module, x2d, wi2d, bi, wo, bo, *, recipe, activations,
                 names=("wi_fp8_meta", "wo_fp8_meta")):
  """``te_jax.fused_mlp.fp8_mlp`` with the module's delayed-scaling state.

  Uses (and updates) the same state variables as two :func:`fp8_gemm` calls
  named ``names`` would, so a model can switch between the fused and the
  unfused path without touching its variables.
  """
  if isinstance(recipe, recipe_lib.DelayedScaling):
    si, so = (_fp8_state(module, n, recipe) for n in names)
    return fused_mlp.fp8_mlp(x2d, wi2d, wo, bi, bo, activations=activations,
                             recipe=recipe, wi_state=si, wo_state=so)
  y = fused_mlp.fp8_mlp(x2d, wi2d, wo, bi, bo, activations=activations, recipe=recipe)
  for n in names:
    if module.has_variable(state_lib.FP8_COLLECTION, n):
      y = _keep_state(y, module.get_variable(state_lib.FP8_COLLECTION, n))
  return y
