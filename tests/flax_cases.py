"""Recipes, inputs and the error measure shared by the te_jax.flax module tests."""

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import fp8_state, recipe

# Factories, so every test builds its own recipe instance.
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}


def rel(a, b):
  """Relative Frobenius error ||a - b|| / ||b||, in float64 on the host.

  On the host so a and b may live on different devices (a CUDA result
  against a CPU reference).
  """
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def rand(seed, shape, scale=1.0, shift=0.0, dtype=jnp.float32):
  """Normal(shift, scale) values of ``shape`` from numpy seed ``seed``, in ``dtype``."""
  x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
  return jnp.asarray(x, dtype)


def norm_params(norm_type, zero_centered, h, seed=1, dtype=jnp.float32):
  """A norm's (gamma, beta) of width h, near 1 (near 0 when zero-centered)
  and near 0; beta None for rmsnorm."""
  gamma = rand(seed, (h,), 0.2, 0.0 if zero_centered else 1.0, dtype)
  beta = rand(seed + 1, (h,), 0.1, 0.0, dtype) if norm_type == "layernorm" else None
  return gamma, beta


def vjp_run(fn, args, cot):
  """Jitted ``(fn(*args), vjp(cot))``: the output and the cotangent of every
  argument. ``cot`` is a constant of the program (placed where it lives)."""
  def f(*a):
    y, vjp = jax.vjp(fn, *a)
    return y, vjp(cot)
  return jax.jit(f)(*args)


def mlp_states(r):
  """(wi_state, wo_state) for ``fused_mlp.fp8_mlp`` under recipe ``r``: under
  DelayedScaling two states with non-trivial, different scales; else
  (None, None)."""
  if not isinstance(r, recipe.DelayedScaling):
    return None, None
  st = fp8_state.init_dense_state(r.amax_history_len)
  st = jax.tree.map(lambda a: a + (0.5 if a.ndim == 0 else 3.0), st)   # non-trivial scales
  return st, jax.tree.map(lambda a: a * 0.5, st)
