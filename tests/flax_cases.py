"""Recipes and the error measure shared by the te_jax.flax module tests."""

import numpy as np

from te_jax import recipe

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
