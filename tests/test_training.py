"""FP8 state through real training loops: TrainState and a plain optax loop."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
from te_jax import flax as tfx
from te_jax import recipe

FP8 = te_jax.FP8_COLLECTION


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jax.nn.gelu(tfx.DenseGeneral(64, use_bias=True, name="up")(x))
    return tfx.DenseGeneral(1, name="down")(h)


def _data(n=128):
  x = jax.random.normal(jax.random.PRNGKey(0), (n, 32))
  y = jnp.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2]
  return x, y


def _loss(variables, model, x, y):
  return jnp.mean((model.apply(variables, x) - y) ** 2)


def _state_and_step(model, x, y, lr=1e-2):
  """A TrainState of ``model`` and a jitted step; call inside fp8_autocast."""
  variables = model.init(jax.random.PRNGKey(1), x)
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                        tx=optax.adam(lr))

  @jax.jit
  def step(state):
    loss, grads = jax.value_and_grad(_loss)(state.params, model, x, y)
    return state.apply_gradients(grads=grads), loss

  return state, step


def test_trainstate_apply_gradients_overwrites_fp8_state():
  r = recipe.DelayedScaling(amax_history_len=8)
  model, (x, y) = _MLP(), _data()
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    state, step = _state_and_step(model, x, y)

    losses, hist0 = [], None
    for i in range(3):
      state, loss = step(state)
      losses.append(float(loss))
      meta = state.params[FP8]["up"]["fp8_meta"]
      if i == 0:
        hist0 = np.asarray(meta["x"]["amax_history"])
  # the history shifted once per step and holds this step's input amax
  hist = np.asarray(meta["x"]["amax_history"])
  amax_x = float(jnp.max(jnp.abs(x)))
  assert hist[0] == pytest.approx(amax_x) and hist[2] == pytest.approx(amax_x)
  assert hist0[1] == 0.0 and hist[3] == 0.0
  assert float(meta["x"]["scale"]) == pytest.approx(448.0 / amax_x, rel=1e-6)
  # the gradient amax arrived through the backward pass, in E5M2 (HYBRID)
  assert float(meta["grad"]["amax_history"][0]) > 0
  g_max = float(meta["grad"]["amax_history"].max())
  assert float(meta["grad"]["scale"]) == pytest.approx(57344.0 / g_max, rel=1e-6)
  # the optimizer never saw the FP8 state
  assert FP8 not in jax.tree_util.tree_structure(state.opt_state).__repr__()
  assert losses[-1] < losses[0]


def test_plain_grad_optax_loop_matches_trainstate():
  """The documented loop (apply_fp8_updates) gives the same result as TrainState."""
  r = recipe.DelayedScaling(amax_history_len=4)
  model, (x, y) = _MLP(), _data()
  tx = optax.sgd(0.05)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    variables = model.init(jax.random.PRNGKey(1), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    opt_state = tx.init(variables["params"])
    grad_fn = jax.jit(jax.grad(_loss), static_argnums=1)
    for _ in range(2):
      state = state.apply_gradients(grads=grad_fn(state.params, model, x, y))
      grads = grad_fn(variables, model, x, y)
      updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
      variables = te_jax.apply_fp8_updates(variables, grads)
      variables["params"] = optax.apply_updates(variables["params"], updates)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("r", [None, recipe.DelayedScaling(amax_history_len=16),
                               recipe.Float8CurrentScaling(),
                               recipe.Float8BlockScaling()],
                         ids=["bf16", "delayed", "current", "blockwise"])
def test_loss_falls_for_every_recipe(r):
  model, (x, y) = _MLP(), _data()
  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    state, step = _state_and_step(model, x, y)

    losses = [float(step(state)[1])]
    for _ in range(30):
      state, loss = step(state)
    losses.append(float(loss))
  assert (FP8 in state.params) == isinstance(r, recipe.DelayedScaling)
  assert losses[-1] < 0.5 * losses[0], losses
