"""Recipes and the error measure shared by the te_jax.flax module tests."""

import jax.numpy as jnp

from te_jax import recipe

# Factories, so every test builds its own recipe instance.
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}


def rel(a, b):
  """Relative Frobenius error ||a - b|| / ||b||, computed in float32."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))
