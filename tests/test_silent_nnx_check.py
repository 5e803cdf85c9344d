"""Issue 44 items 6 and 7: the NNX "forgot apply_fp8_updates" check.

* Item 6: the check saw a training step through ``kernel[0, 0]`` alone; a
  weight that gets no gradient (its input feature always 0) hid every step,
  and the frozen scales went unreported. It now reads a weighted sum of up to
  ``PROBE_ENTRIES`` entries spread over the kernel
  (``te_jax.layers.state.kernel_probe``).
* Item 7: a step jitted with ``donate_argnums`` (as Flax's NNX MiniGPT
  tutorial writes it) crashed at step 2 with "Array has been deleted": the
  check held the previous step's count, which the next call donated. A
  deleted count is dropped, and the module's counts are then read from a
  private copy.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import nnx as tnx
from te_jax import recipe
from te_jax.layers.state import kernel_probe

R = recipe.DelayedScaling(amax_history_len=4)


def _linear():
  with te_jax.fp8_autocast(True, R):
    return tnx.Linear(32, 16, rngs=nnx.Rngs(0))


def _step(apply, donate=False):
  def train_step(model, optimizer, x):
    def loss_fn(m):
      return jnp.mean((m(x) - 1.0) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=tnx.diff_state(0))(model)
    optimizer.update(model, grads)
    if apply:
      tnx.apply_fp8_updates(model, grads)
    return loss
  return nnx.jit(train_step, donate_argnums=(0, 1) if donate else ())


def _mlp():
  # Big enough a step that its count is rarely finished when it is written
  # back (what made the held count outlive the next, donating call).
  with te_jax.fp8_autocast(True, R):
    return tnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))


def _train(model, step, xs, *, block=True, tx=optax.sgd(0.1)):
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with te_jax.fp8_autocast(True, R):
      for x in xs:
        step(model, optimizer, x)
        if block:   # counts are read once finished: let each one finish
          jax.block_until_ready(nnx.state(model))
          jax.effects_barrier()
  return [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]


def _inputs(n, dead_feature=False):
  xs = [jax.random.normal(jax.random.PRNGKey(i), (4, 8, 32)) for i in range(n)]
  return [x.at[..., 0].set(0.0) if dead_feature else x for x in xs]


# ----------------------------------------------------------- item 6 ----

def test_forgotten_update_is_seen_when_the_first_weight_gets_no_gradient():
  model = _linear()
  k00 = float(model.kernel[...][0, 0])
  warned = _train(model, _step(apply=False), _inputs(3, dead_feature=True))
  assert float(model.kernel[...][0, 0]) == k00       # the weight the old probe read
  assert len(warned) == 1 and "apply_fp8_updates" in str(warned[0].message)


def test_applied_updates_with_a_dead_feature_do_not_warn():
  model = _linear()
  assert _train(model, _step(apply=True), _inputs(3, dead_feature=True)) == []
  assert np.count_nonzero(model.fp8_meta.get_value()["x"]["amax_history"]) == 3


def test_probe_sees_a_change_of_any_row_and_any_column():
  kernel = jax.random.normal(jax.random.PRNGKey(0), (256, 96))
  base = float(kernel_probe(kernel))
  # One row (all columns) or one column (all rows) updated: seen.
  for row in (0, 100, 255):
    assert float(kernel_probe(kernel.at[row].add(1e-3))) != base
  for col in (0, 50, 95):
    assert float(kernel_probe(kernel.at[:, col].add(1e-3))) != base
  assert float(kernel_probe(kernel)) == base
  # Large: 1024 entries read, every 4th row; a band of 8 rows is seen anywhere.
  big = jnp.zeros((4096, 4096), jnp.bfloat16)
  for start in (0, 2000, 4088):
    assert float(kernel_probe(big.at[start:start + 8].set(1.0))) != 0.0


# ----------------------------------------------------------- item 7 ----

@pytest.mark.parametrize("block", [True, False], ids=["blocking", "running_ahead"])
def test_donated_step_applying_updates_runs_and_advances(block):
  model = _mlp()
  warned = _train(model, _step(apply=True, donate=True), _inputs(5), block=block,
                  tx=optax.adamw(1e-3))
  assert warned == []
  assert np.count_nonzero(model.wi_fp8_meta.get_value()["x"]["amax_history"]) == 4


def test_donated_step_without_updates_warns_instead_of_crashing():
  model = _mlp()
  warned = _train(model, _step(apply=False, donate=True), _inputs(4), tx=optax.adamw(1e-3))
  assert len(warned) == 1 and "apply_fp8_updates" in str(warned[0].message)
