"""Issue 44 item 4 (mechanism): one FP8 state used several times in a step merges.

The delayed-scaling state's "gradient" is its new state, and autodiff SUMS
the gradients of a value used twice: a GEMM called twice in one step (shared
layer, tied weights, a block applied twice) got the sum of two new states
(its amax entry the sum of the amaxes, scales far too large).
``te_jax.fp8_state.merge_uses`` reads the state through a dtype whose
gradients merge, so the uses give one update: one history entry, the largest
amax, and the scale that history gives.

Functional level: ``te_jax.dense.dense_general`` called more than once with
one state inside ``jax.grad``, eager, under ``jax.jit``, ``jax.lax.scan``
(closed over, and stacked per layer), ``jax.checkpoint`` and ``lax.cond``.
Each expected state is ``mode.update_state(old, {role: largest amax})``, the
update of ONE use that saw the largest amax of every role.
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import dense, fp8_state, recipe

HIST = 4
R = recipe.DelayedScaling(amax_history_len=HIST)
MODE = R.scaling_mode()
K, N = 32, 32
KERNEL = jax.random.uniform(jax.random.PRNGKey(0), (K, N), jnp.float32, -0.5, 0.5)
KERNEL_AMAX = float(jnp.max(jnp.abs(KERNEL)))


def _old_state():
  """A state with history, so that a wrong roll or merge shows."""
  def amaxes(x):
    return {"x": jnp.float32(x), "kernel": jnp.float32(0.25), "grad": jnp.float32(0.5)}
  return MODE.update_state(MODE.update_state(MODE.init_state(), amaxes(1.5)), amaxes(0.75))


def _x(value):
  return jnp.full((16, K), value, jnp.float32)


def _use(x, state, weight=1.0):
  """One GEMM call reading ``state``; the loss term ``weight * sum(y)`` makes
  this call's output-gradient amax ``weight``."""
  y = dense.dense_general(x, KERNEL, recipe=R, fp8_state=fp8_state.merge_uses(state, MODE))
  return weight * jnp.sum(y)


def _expected(old, x_amax, grad_amax):
  return MODE.update_state(old, {"x": jnp.float32(x_amax), "kernel": jnp.float32(KERNEL_AMAX),
                                 "grad": jnp.float32(grad_amax)})


def _assert_states_equal(got, want):
  for role in ("x", "kernel", "grad"):
    for leaf in ("amax_history", "scale"):
      np.testing.assert_array_equal(np.asarray(got[role][leaf]), np.asarray(want[role][leaf]),
                                    err_msg=f"{role}/{leaf}")


def _twice(state):
  return _use(_x(2.0), state, 1.0) + _use(_x(3.0), state, 2.0)


@pytest.mark.parametrize("transform", ["eager", "jit"])
def test_two_uses_in_one_grad_give_one_max_update(transform):
  grad = jax.grad(_twice)
  if transform == "jit":
    grad = jax.jit(grad)
  got = grad(_old_state())
  _assert_states_equal(got, _expected(_old_state(), 3.0, 2.0))
  # One entry was pushed: the older entries moved by one, not two.
  np.testing.assert_array_equal(got["x"]["amax_history"], [3.0, 0.75, 1.5, 0.0])


def test_one_use_is_unchanged_by_merge_uses():
  def raw(state):
    return jnp.sum(dense.dense_general(_x(3.0), KERNEL, recipe=R, fp8_state=state))
  want = jax.jit(jax.grad(raw))(_old_state())
  got = jax.jit(jax.grad(lambda s: _use(_x(3.0), s)))(_old_state())
  _assert_states_equal(got, want)


def test_scan_closing_over_the_state_merges_every_iteration():
  xs = jnp.stack([_x(2.0), _x(5.0), _x(1.0)])

  def loss(state):
    def body(carry, x):
      return carry + _use(x, state), None
    return jax.lax.scan(body, jnp.float32(0), xs)[0]
  got = jax.jit(jax.grad(loss))(_old_state())
  _assert_states_equal(got, _expected(_old_state(), 5.0, 1.0))


def test_scan_over_stacked_layers_merges_within_each_layer():
  layers = 2
  stacked = jax.tree.map(lambda a: jnp.stack([a] * layers), _old_state())

  def loss(stack):
    def body(carry, state):   # each layer's state used twice, like a shared block
      return carry + _use(_x(2.0), state, 1.0) + _use(_x(3.0), state, 2.0), None
    return jax.lax.scan(body, jnp.float32(0), stack)[0]
  got = jax.jit(jax.grad(loss))(stacked)
  for layer in range(layers):
    _assert_states_equal(jax.tree.map(lambda a, i=layer: a[i], got),
                         _expected(_old_state(), 3.0, 2.0))


def test_checkpoint_body_with_two_uses():
  got = jax.jit(jax.grad(jax.checkpoint(_twice)))(_old_state())
  _assert_states_equal(got, _expected(_old_state(), 3.0, 2.0))


def test_checkpoint_closing_over_the_state_merges_across_calls():
  def loss(state):
    block = jax.checkpoint(lambda x, w: _use(x, state, w), static_argnums=(1,))
    return block(_x(2.0), 1.0) + block(_x(3.0), 2.0) + _use(_x(1.0), state)
  got = jax.jit(jax.grad(loss))(_old_state())
  _assert_states_equal(got, _expected(_old_state(), 3.0, 2.0))


def test_shared_state_passed_into_checkpoint_calls_merges_across_calls():
  # A state passed as an argument is a new value inside each jax.checkpoint
  # (as nn.remat passes the variables): shared_state carries the merging
  # dtype across the boundary.
  def loss(state):
    shared = fp8_state.shared_state(state, MODE)
    block = jax.checkpoint(lambda x, s, w: _use(x, s, w), static_argnums=(2,))
    return block(_x(2.0), shared, 1.0) + block(_x(3.0), shared, 2.0)
  got = jax.jit(jax.grad(loss))(_old_state())
  _assert_states_equal(got, _expected(_old_state(), 3.0, 2.0))


def test_a_state_no_use_reached_comes_back_unchanged():
  # The branch not taken contributes the merge identity: the state is kept,
  # not zeroed (and never -inf).
  def loss(state):
    return jax.lax.cond(False, lambda: _use(_x(2.0), state), lambda: jnp.float32(0))
  got = jax.jit(jax.grad(loss))(_old_state())
  _assert_states_equal(got, _old_state())


def test_a_frozen_dict_state_is_differentiated():
  # Item 8: a FrozenDict state (flax.core.freeze'd variables) used to fail in
  # the backward pass with a pytree-structure error; merge_uses reads it as dicts.
  frozen = flax.core.freeze(_old_state())
  got = jax.jit(jax.grad(_twice))(frozen)
  assert isinstance(got, flax.core.FrozenDict)
  _assert_states_equal(got, _expected(_old_state(), 3.0, 2.0))


def test_merge_uses_passes_stateless_recipes_and_refuses_other_layouts():
  cur = recipe.Float8CurrentScaling().scaling_mode()
  assert fp8_state.merge_uses(None, cur) is None
  bad = dict(_old_state(), x={"amax_history": jnp.zeros((2, HIST)), "scale": jnp.ones((3,))})
  with pytest.raises(ValueError, match="one FP8 GEMM"):     # a scale per history row, or none
    fp8_state.merge_uses(bad, MODE)
  with pytest.raises(ValueError, match="one FP8 GEMM"):
    fp8_state.merge_uses({"x": {"amax_history": jnp.zeros((HIST,))}}, MODE)


@pytest.mark.parametrize("scale_shape", ["(E,)", "(E, 1)"])
def test_several_uses_of_a_per_row_state_update_each_row_on_its_own(scale_shape):
  """A grouped GEMM's kernel state holds one history per expert (history
  (E, H), scale (E,) or (E, 1)): merge_uses takes it, and several uses
  update each row with that row's largest amax (the end-to-end merge through
  the MoE modules is tests/test_flax_moe.py's)."""
  from te_jax import fp8_merge   # pylint: disable=import-outside-toplevel
  old = _old_state()["x"]
  rows = jax.tree.map(lambda a: jnp.stack([a, a * 2.0]), old)
  if scale_shape == "(E, 1)":
    rows = dict(rows, scale=rows["scale"][:, None])
  assert fp8_state.merge_uses({"x": rows}, MODE)["x"]["scale"].shape == rows["scale"].shape
  amax = jnp.array([3.0, 4.0])
  got = fp8_merge._update_rows(MODE, "x", rows, amax)
  for e in range(2):
    want = MODE.update_state({"x": {"amax_history": rows["amax_history"][e],
                                    "scale": rows["scale"].reshape(2)[e]}}, {"x": amax[e]})["x"]
    np.testing.assert_array_equal(np.asarray(got["amax_history"][e]),
                                  np.asarray(want["amax_history"]))
    np.testing.assert_array_equal(np.asarray(got["scale"]).reshape(2)[e],
                                  np.asarray(want["scale"]))
  assert got["scale"].shape == rows["scale"].shape
