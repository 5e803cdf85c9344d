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
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import dense as dense_lib
from te_jax import fp8_state as state_lib
from te_jax import recipe as recipe_lib
from te_jax.autocast import get_fp8_context

__all__ = ["active_recipe", "fp8_gemm", "canonicalize_axes", "FP8_META"]

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


def fp8_gemm(module: nn.Module, x2d: jax.Array, kernel2d: jax.Array,
             bias: Optional[jax.Array] = None, *, recipe=None,
             name: str = FP8_META) -> jax.Array:
  """``x2d @ kernel2d (+ bias)`` with the recipe given (None = no FP8).

  Args:
    module: the Linen module that owns the GEMM (and its FP8 state).
    x2d: (M, K) input in the compute dtype.
    kernel2d: (K, N) kernel in the compute dtype.
    bias: optional (N,) bias.
    recipe: a te_jax recipe, or None for a plain dot in ``x2d.dtype``.
    name: name of the FP8 state variable (one per GEMM of the module).

  Returns:
    (M, N) array in ``x2d.dtype``.
  """
  state = None
  if isinstance(recipe, recipe_lib.DelayedScaling):
    state = _fp8_state(module, name, recipe)
  return dense_lib.dense(x2d, kernel2d, bias, recipe=recipe, fp8_state=state)
