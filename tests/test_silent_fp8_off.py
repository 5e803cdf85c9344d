"""Issue 44 items 1 and 2: a model with delayed-scaling state run without it says so.

A model initialised (Linen) or constructed (NNX) inside
``fp8_autocast(DelayedScaling)`` and then applied -- or its jitted training
step traced -- outside any autocast ran with FP8 off, silently (outputs off
by up to 0.2, the FP8 state never advancing; NNX's FP8StateWarning did not
fire either). Under another recipe the state was ignored, silently too. Now
each warns once per module class (``te_jax.fp8_state.FP8StateWarning``),
naming the fix; an explicit ``fp8_autocast(enabled=False)`` -- the way to
evaluate without FP8 on purpose -- stays quiet.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import te_jax
from te_jax import flax as tfx
from te_jax import nnx as tnx
from te_jax import recipe
from te_jax.fp8_state import FP8StateWarning
from te_jax.layers import state as layer_state

R = recipe.DelayedScaling(amax_history_len=4)
X = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32))


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  """Each test sees the once-per-class warnings afresh."""
  monkeypatch.setattr(layer_state, "_WARNED_UNUSED", set())


def _warned(fn, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn(*args)
  return [str(w.message) for w in caught if issubclass(w.category, FP8StateWarning)]


def _linen():
  model = tfx.TransformerLayer(32, 64, 2)
  with te_jax.fp8_autocast(True, R):
    return model, model.init(jax.random.PRNGKey(1), X)


def test_linen_applied_outside_the_autocast_warns_once_per_class():
  model, variables = _linen()
  got = _warned(lambda: [model.apply(variables, X) for _ in range(2)])
  # One line for the DenseGeneral projections, one for the LayerNormMLP.
  assert len(got) == 2, got
  assert all("outside fp8_autocast" in m and "fp8_autocast(enabled=False)" in m
             and "DelayedScaling" in m for m in got)
  assert _warned(model.apply, variables, X) == []


def test_linen_explicit_fp8_off_is_quiet():
  model, variables = _linen()

  def run():
    with te_jax.fp8_autocast(enabled=False):
      model.apply(variables, X)
  assert _warned(run) == []


def test_linen_under_another_recipe_names_the_collection_to_drop():
  model, variables = _linen()

  def run():
    with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
      model.apply(variables, X)
  got = _warned(run)
  assert got and all("Float8CurrentScaling" in m and "_overwrite_with_gradient" in m
                     for m in got)


def test_linen_jitted_step_traced_outside_the_autocast_warns():
  model, variables = _linen()
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                        tx=optax.sgd(0.1))

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean(model.apply(p, X) ** 2))(state.params)
    return state.apply_gradients(grads=grads)
  got = _warned(step, state)              # traced, and run, with FP8 off
  assert got and "outside fp8_autocast" in got[0]


def test_linen_fp8_dot_general_applied_outside_warns():
  layer = nn.Dense(16, dot_general_cls=tfx.Fp8DotGeneral)
  with te_jax.fp8_autocast(True, R):
    variables = layer.init(jax.random.PRNGKey(1), X)
  got = _warned(layer.apply, variables, X)
  assert len(got) == 1 and "Fp8DotGeneral" in got[0]


def test_a_model_without_fp8_state_is_quiet_outside():
  model = tfx.TransformerLayer(32, 64, 2)
  variables = model.init(jax.random.PRNGKey(1), X)      # FP8 off: no state
  assert _warned(model.apply, variables, X) == []


# ------------------------------------------------------------- NNX ------

def _nnx_loop(model, ctx):
  """The training loop of docs/nnx.md, run for one step under ``ctx``."""
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2),
                                     argnums=nnx.DiffState(0, tnx.WRT))(model)
    optimizer.update(model, grads)
    tnx.apply_fp8_updates(model, grads)
    return loss

  def run():
    if ctx is None:
      train_step(model, optimizer, X)
    else:
      with ctx:
        train_step(model, optimizer, X)
  return _warned(run)


def _nnx_model():
  with te_jax.fp8_autocast(True, R):
    return tnx.TransformerLayer(32, 64, 2, rngs=nnx.Rngs(0))


def test_nnx_loop_outside_the_autocast_warns():
  got = _nnx_loop(_nnx_model(), None)
  assert len(got) == 2 and all("outside fp8_autocast" in m for m in got), got


def test_nnx_loop_with_explicit_fp8_off_is_quiet():
  assert _nnx_loop(_nnx_model(), te_jax.fp8_autocast(enabled=False)) == []


def test_nnx_under_another_recipe_warns_and_init_fp8_state_drops_the_state():
  current = recipe.Float8CurrentScaling()
  model = _nnx_model()
  got = _nnx_loop(model, te_jax.fp8_autocast(True, current))
  assert got and all("Float8CurrentScaling" in m and "init_fp8_state" in m for m in got)
  tnx.init_fp8_state(model, current)
  assert not any(isinstance(v, (tnx.FP8State, tnx.FP8Counters))
                 for _, v in nnx.iter_graph(model))
  layer_state._WARNED_UNUSED.clear()
  assert _nnx_loop(model, te_jax.fp8_autocast(True, current)) == []
