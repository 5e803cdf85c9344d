"""Issue 44 items 5, 8 and 9: the Linen FP8 state helpers never drop state silently.

* ``apply_fp8_updates(variables, grads)`` with gradients taken with respect
  to the parameters only used to return the old state (scales frozen): it
  raises, naming the fix, as ``te_jax.nnx.apply_fp8_updates`` does.
* ``accumulate_gradients`` of two trees of which one holds FP8 state used to
  fail with a bare KeyError (or a pytree mismatch): a ValueError names the fix.
* ``flax.core.FrozenDict`` variables and gradients (``flax.core.freeze``, as
  Flax's FP8 guide writes them) are mappings too: the FP8 state in them is
  merged, updated, migrated and counted like the one of a dict (a FrozenDict
  is not a dict subclass, and the helpers used to sum it or skip it).
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import fp8_state, recipe
from te_jax.fp8_state import FP8_COLLECTION

HIST = 4
R = recipe.DelayedScaling(amax_history_len=HIST)


def _state(amax, scale):
  """A one-GEMM FP8 collection whose every tensor has newest amax ``amax``."""
  t = {"amax_history": jnp.array([amax] + [0.0] * (HIST - 1), jnp.float32),
       "scale": jnp.float32(scale)}
  return {"dense": {"x": t, "kernel": t, "grad": t}}


def _variables(amax=1.0, scale=448.0):
  return {"params": {"dense": {"kernel": jnp.ones((4, 4))}}, FP8_COLLECTION: _state(amax, scale)}


# ----------------------------------------------------- apply_fp8_updates --

def test_apply_fp8_updates_without_fp8_grads_raises_with_the_fix():
  variables = _variables()
  param_grads = {"params": {"dense": {"kernel": jnp.ones((4, 4))}}}
  with pytest.raises(ValueError, match=r"jax.grad\(loss_fn\)\(variables") as e:
    te_jax.apply_fp8_updates(variables, param_grads)
  assert "frozen" in str(e.value)


def test_apply_fp8_updates_replaces_the_state():
  new = _variables(amax=3.0, scale=149.0)
  out = te_jax.apply_fp8_updates(_variables(), new)
  np.testing.assert_array_equal(out[FP8_COLLECTION]["dense"]["x"]["amax_history"],
                                new[FP8_COLLECTION]["dense"]["x"]["amax_history"])
  assert out["params"] is not None


def test_apply_fp8_updates_keeps_a_state_that_no_gemm_used():
  # A state whose "gradient" came back as zeros (its output did not reach the
  # loss) keeps its history, as te_jax.nnx.apply_fp8_updates does.
  old = _variables(amax=2.0, scale=224.0)
  zeros = jax.tree.map(jnp.zeros_like, old)
  out = te_jax.apply_fp8_updates(old, zeros)
  np.testing.assert_array_equal(out[FP8_COLLECTION]["dense"]["grad"]["amax_history"],
                                old[FP8_COLLECTION]["dense"]["grad"]["amax_history"])
  assert float(out[FP8_COLLECTION]["dense"]["grad"]["scale"]) == 224.0


def test_apply_fp8_updates_refuses_the_state_of_another_model():
  other = {FP8_COLLECTION: {"other_dense": _state(1.0, 1.0)["dense"]}}
  with pytest.raises(ValueError, match="other_dense"):
    te_jax.apply_fp8_updates(_variables(), other)


def test_apply_fp8_updates_keeps_a_frozen_dict_frozen():
  out = te_jax.apply_fp8_updates(flax.core.freeze(_variables()),
                                 flax.core.freeze(_variables(amax=5.0)))
  assert isinstance(out, flax.core.FrozenDict)
  assert float(out[FP8_COLLECTION]["dense"]["x"]["amax_history"][0]) == 5.0


# -------------------------------------------------- accumulate_gradients --

@pytest.mark.parametrize("which", ["acc", "grads"])
def test_accumulate_gradients_with_one_fp8_tree_raises_with_the_fix(which):
  full = _variables()
  params_only = {"params": full["params"]}
  acc, grads = (full, params_only) if which == "acc" else (params_only, full)
  with pytest.raises(ValueError, match="whole variables") as e:
    te_jax.accumulate_gradients(acc, grads)
  assert f"{which} holds the FP8 state" in str(e.value)


def test_accumulate_gradients_merges_frozen_dicts_by_max():
  # A FrozenDict is not a dict: the FP8 collection used to be SUMMED (1 + 3).
  a, b = flax.core.freeze(_variables(1.0, 448.0)), flax.core.freeze(_variables(3.0, 149.0))
  out = te_jax.accumulate_gradients(a, b)
  assert isinstance(out, flax.core.FrozenDict)
  assert float(out[FP8_COLLECTION]["dense"]["x"]["amax_history"][0]) == 3.0
  assert float(out[FP8_COLLECTION]["dense"]["x"]["scale"]) == 149.0
  np.testing.assert_array_equal(out["params"]["dense"]["kernel"], 2 * jnp.ones((4, 4)))


def test_accumulate_gradients_refuses_different_fp8_trees():
  other = _variables()
  other[FP8_COLLECTION] = {"renamed": other[FP8_COLLECTION]["dense"]}
  with pytest.raises(ValueError, match="renamed"):
    te_jax.accumulate_gradients(_variables(), other)


# ---------------------------------------------------- other tree helpers --

def test_migrate_scale_inv_converts_inside_a_frozen_dict():
  old = flax.core.freeze({FP8_COLLECTION: {"d": {"x": {
      "amax_history": jnp.zeros(HIST), "scale_inv": jnp.float32(0.25)}}}})
  out = fp8_state.migrate_scale_inv(old)
  assert float(out[FP8_COLLECTION]["d"]["x"]["scale"]) == 4.0


def test_ignored_outliers_counts_inside_a_frozen_dict():
  hist = jnp.array([1e6, 1.0, 1.0, 0.0], jnp.float32)   # newest: an outlier
  tree = flax.core.freeze({"d": {"x": {"amax_history": hist, "scale": jnp.float32(1.0)}}})
  assert int(fp8_state.ignored_outliers(tree, R)) == 1


@pytest.mark.parametrize("scale_shape", ["(E,)", "(E, 1)"])
def test_updates_keep_the_rows_no_use_reached_in_a_per_expert_state(scale_shape):
  """A grouped GEMM's kernel state has one history and scale per expert; an
  expert that got no tokens comes back as zeros and keeps its row, the others
  take their update (the scale > 0 mask is per row, not broadcast against
  the whole history)."""
  from te_jax import fp8_state as fs   # pylint: disable=import-outside-toplevel
  e, h = 3, 3      # as many experts as history entries: a broadcast would not fail
  old_hist = jnp.arange(1.0, 1.0 + e * h).reshape(e, h)
  old_scale = jnp.array([1.0, 2.0, 3.0])
  new_hist = jnp.array([[9.0, 1.0, 2.0], [0.0, 0.0, 0.0], [7.0, 7.0, 8.0]])
  new_scale = jnp.array([4.0, 0.0, 5.0])
  if scale_shape == "(E, 1)":
    old_scale, new_scale = old_scale[:, None], new_scale[:, None]
  got = fs.keep_where_unused({"kernel": {"amax_history": new_hist, "scale": new_scale}},
                             {"kernel": {"amax_history": old_hist, "scale": old_scale}})
  np.testing.assert_array_equal(got["kernel"]["amax_history"],
                                jnp.stack([new_hist[0], old_hist[1], new_hist[2]]))
  np.testing.assert_array_equal(np.asarray(got["kernel"]["scale"]).reshape(e), [4.0, 2.0, 5.0])
