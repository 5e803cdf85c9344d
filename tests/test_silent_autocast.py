"""Issue 44 item 3: the active ``fp8_autocast`` is part of what decides a retrace.

A ``jax.jit`` function traced under one autocast and called under another
used to run the first one (traced FP8-off, called under current scaling:
the output bit-identical to FP8 off). The autocast now enters JAX's jit
cache key: a different recipe, FP8 on/off or mesh resource traces again; an
equal recipe reuses the compiled function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe, sharding
from te_jax import flax as tfx

X = jax.random.normal(jax.random.PRNGKey(0), (16, 64), jnp.float32)
MODEL = tfx.DenseGeneral(32)
VARIABLES = MODEL.init(jax.random.PRNGKey(1), X)      # FP8 off: no FP8 state


def _counting_apply():
  traces = []

  @jax.jit
  def apply(v, x):
    traces.append(1)
    return MODEL.apply(v, x)
  return apply, traces


def _under(r, fn, *args, enabled=True):
  with te_jax.fp8_autocast(enabled, r):
    return fn(*args)


def test_traced_fp8_off_then_called_under_current_scaling_runs_current_scaling():
  apply, _ = _counting_apply()
  off = apply(VARIABLES, X)                                  # traced with FP8 off
  # A fresh jit traced under current scaling (eager differs in the last bits).
  want = _under(recipe.Float8CurrentScaling(), jax.jit(MODEL.apply), VARIABLES, X)
  got = _under(recipe.Float8CurrentScaling(), apply, VARIABLES, X)
  assert not np.array_equal(np.asarray(off), np.asarray(want))   # FP8 changes it
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_traced_under_current_scaling_then_called_outside_runs_fp8_off():
  apply, _ = _counting_apply()
  _under(recipe.Float8CurrentScaling(), apply, VARIABLES, X)
  np.testing.assert_array_equal(np.asarray(apply(VARIABLES, X)),
                                np.asarray(jax.jit(MODEL.apply)(VARIABLES, X)))


def test_an_equal_recipe_does_not_retrace():
  apply, traces = _counting_apply()
  _under(recipe.Float8CurrentScaling(), apply, VARIABLES, X)
  _under(recipe.Float8CurrentScaling(), apply, VARIABLES, X)   # equal, new object
  assert len(traces) == 1
  _under(recipe.Float8BlockScaling(), apply, VARIABLES, X)
  assert len(traces) == 2
  _under(recipe.Float8CurrentScaling(fast_accum_fprop=False), apply, VARIABLES, X)
  assert len(traces) == 3


@pytest.mark.parametrize("enter", [
    lambda: te_jax.fp8_autocast(False, recipe.Float8CurrentScaling()),
    lambda: te_jax.fp8_autocast(False),
])
def test_fp8_off_autocast_shares_the_trace_of_no_autocast(enter):
  # Under enabled=False the recipe is not read: no retrace for it.
  apply, traces = _counting_apply()
  apply(VARIABLES, X)
  with enter():
    apply(VARIABLES, X)
  assert len(traces) == 1


def test_another_mesh_resource_retraces():
  apply, traces = _counting_apply()
  r = recipe.Float8CurrentScaling()
  _under(r, apply, VARIABLES, X)
  with te_jax.fp8_autocast(True, r, mesh_resource=sharding.MeshResource(dp_resource="data")):
    apply(VARIABLES, X)
  assert len(traces) == 2
