"""Issue 44 items 4 and 8 at the Linen module level.

The mechanism is ``te_jax.fp8_state.merge_uses`` (tests/test_silent_merge.py);
the module layer reads every GEMM state through it (``LinenStates.state``).
Without that wiring the shared layer's newest amax entry is the sum of its
two uses' amaxes, and the frozen-variables step fails in the backward pass.
"""

import flax
import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import optax

import te_jax
from te_jax import flax as tfx
from te_jax import recipe
from te_jax.fp8_state import FP8_COLLECTION

HIST = 4
R = recipe.DelayedScaling(amax_history_len=HIST)


class Shared(nn.Module):
  """One DenseGeneral applied to two inputs: one state, two uses per step."""

  @nn.compact
  def __call__(self, a, b):
    layer = tfx.DenseGeneral(16, use_bias=False, name="shared")
    return jnp.sum(layer(a)) + 2.0 * jnp.sum(layer(b))


def _init(model, *xs):
  with te_jax.fp8_autocast(True, R):
    return model.init(jax.random.PRNGKey(0), *xs)


def test_shared_layer_gets_one_max_entry_per_step():
  a, b = jnp.full((8, 16), 2.0), jnp.full((8, 16), 3.0)
  model = Shared()
  variables = _init(model, a, b)
  with te_jax.fp8_autocast(True, R):
    grads = jax.jit(jax.grad(lambda v: model.apply(v, a, b)))(variables)
  x_hist = grads[FP8_COLLECTION]["shared"]["fp8_meta"]["x"]["amax_history"]
  # Summed (without merge_uses) the newest entry would be 2 + 3 = 5.
  np.testing.assert_array_equal(np.asarray(x_hist), [3.0, 0.0, 0.0, 0.0])


def test_train_step_with_frozen_variables():
  model = tfx.DenseGeneral(16)
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  variables = flax.core.freeze(_init(model, x))
  tx = optax.sgd(1e-2)
  opt_state = tx.init(variables["params"])

  @jax.jit
  def step(variables, opt_state):
    grads = jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(variables)
    updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
    variables = te_jax.apply_fp8_updates(variables, grads)
    return variables.copy({"params": optax.apply_updates(variables["params"], updates)}), \
        opt_state

  with te_jax.fp8_autocast(True, R):
    new, _ = step(variables, opt_state)
  assert isinstance(new, flax.core.FrozenDict)
  newest = [float(np.asarray(leaf)[0]) for leaf in jax.tree.leaves(new[FP8_COLLECTION])
            if np.ndim(leaf) == 1]
  assert all(v > 0 for v in newest), newest     # x, kernel and grad amaxes recorded
