"""Benchmark helpers that decide what a timing measures."""

import os
import sys

import jax
import jax.numpy as jnp

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx
from te_jax import recipe as recipe_lib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from _fp8_carry import carry_fp8_state  # noqa: E402  pylint: disable=wrong-import-position
import bench_layer  # noqa: E402  pylint: disable=wrong-import-position


def _scale_invs(variables):
  return [float(s) for p, s in jax.tree_util.tree_leaves_with_path(
      variables[fp8_state.FP8_COLLECTION]) if "scale_inv" in jax.tree_util.keystr(p)]


def test_carry_advances_delayed_state_and_leaves_params():
  rec = recipe_lib.DelayedScaling(amax_history_len=4)
  model = tfx.LayerNormMLP(intermediate_dim=64, activations=("gelu",))
  x = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.float32)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=rec):
    variables = model.init(jax.random.key(1), x)

  def loss(v):
    with te_jax.fp8_autocast(enabled=True, fp8_recipe=rec):
      return jnp.mean(jnp.square(model.apply(v, x)))

  assert all(s == 1.0 for s in _scale_invs(variables))       # fresh state: scale 1
  grads = jax.grad(loss)(variables)
  carried = carry_fp8_state(variables, grads)
  assert carried["params"] is variables["params"]
  # The x/kernel/grad scales now come from the amaxes of the step just run.
  assert all(0.0 < s < 1.0 for s in _scale_invs(carried))
  assert carried[fp8_state.FP8_COLLECTION] is grads[fp8_state.FP8_COLLECTION]


def test_carry_without_fp8_collection_is_identity():
  variables = {"params": {"w": jnp.ones(3)}}
  assert carry_fp8_state(variables, {"params": {"w": jnp.zeros(3)}}) is variables


def test_step_shares_split_each_layer_step():
  ms = {"layer/te_off": 30.0, "mlp/te_off": 18.0, "attn/module_off": 10.0, "attn/core": 2.5,
        "layer/te_block": 20.0, "mlp/te_block": 12.0, "attn/te_block": 6.5,
        "layer/te_delayed": 19.0, "mlp/te_delayed": 11.0}       # no attn/te_delayed row
  by = {name: {"ms": v} for name, v in ms.items()}
  rows = [line for line in bench_layer.step_shares(by) if line.startswith("| off")
          or line.startswith("| block") or line.startswith("| delayed")]
  assert rows == [
      "| off | 30.000 | 18.00 (60%) | 2.50 (8%) | 7.50 (25%) | 2.00 (7%) |",
      "| block | 20.000 | 12.00 (60%) | 2.50 (12%) | 4.00 (20%) | 1.50 (8%) |"]
  del by["attn/core"]
  assert bench_layer.step_shares(by) == []
