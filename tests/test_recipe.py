"""Recipes validate their fields; fp8_autocast sets and restores the context."""

import jax.numpy as jnp
import pytest

import te_jax
from te_jax import recipe


def test_defaults_match_design():
  d = recipe.DelayedScaling()
  assert (d.fp8_format, d.margin, d.amax_history_len, d.amax_compute_algo) == (
      recipe.Format.HYBRID, 0, 1024, "max")
  assert d.fwd_dtype == jnp.float8_e4m3fn and d.bwd_dtype == jnp.float8_e5m2
  b = recipe.Float8BlockScaling()
  assert b.fp8_format == recipe.Format.E4M3 and b.power_2_scale is True
  assert b.bwd_dtype == jnp.float8_e4m3fn and b.token_block == 128
  assert recipe.Float8CurrentScaling().fp8_format == recipe.Format.HYBRID
  assert recipe.Float8CurrentScaling().token_block == 16


@pytest.mark.parametrize("kwargs, field", [
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"margin": -1}, "margin"),
    ({"amax_history_len": 0}, "amax_history_len"),
])
def test_bad_fields_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    recipe.DelayedScaling(**kwargs)


def test_bad_types():
  with pytest.raises(TypeError, match="fp8_format"):
    recipe.Float8BlockScaling(fp8_format="E4M3")
  with pytest.raises(TypeError, match="power_2_scale"):
    recipe.Float8BlockScaling(power_2_scale=1)
  with pytest.raises(TypeError, match="fast_accum_wgrad"):
    recipe.DelayedScaling(fast_accum_wgrad="yes")


def test_recipes_are_frozen_and_hashable():
  r = recipe.DelayedScaling(amax_history_len=16)
  with pytest.raises(Exception):
    r.margin = 2
  assert hash(r) == hash(recipe.DelayedScaling(amax_history_len=16))


def test_fp8_autocast_nests_and_restores():
  assert not te_jax.get_fp8_context().enabled
  blk = recipe.Float8BlockScaling()
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=blk) as ctx:
    assert ctx.recipe is blk and te_jax.get_fp8_context().enabled
    with te_jax.fp8_autocast(enabled=False):
      assert not te_jax.get_fp8_context().enabled
    assert te_jax.get_fp8_context().recipe is blk
  assert not te_jax.get_fp8_context().enabled
  with te_jax.fp8_autocast() as ctx:
    assert isinstance(ctx.recipe, recipe.DelayedScaling)
  with pytest.raises(TypeError, match="fp8_recipe"):
    with te_jax.fp8_autocast(fp8_recipe="delayed"):
      pass


# ------------------------------------------------- the scaling protocol ---

def test_each_recipe_names_its_scaling_mode():
  """recipe.scaling_mode() (te_jax.scaling) carries what the layers ask of a
  recipe: formats per role, token alignment, accumulation per GEMM, state."""
  from te_jax import fp8_state, scaling  # pylint: disable=import-outside-toplevel
  d = recipe.DelayedScaling(amax_history_len=8, fast_accum_dgrad=True)
  c = recipe.Float8CurrentScaling(fast_accum_fprop=False, fast_accum_wgrad=True)
  b = recipe.Float8BlockScaling()
  modes = {type(r): r.scaling_mode() for r in (d, c, b)}
  assert isinstance(modes[recipe.DelayedScaling], scaling.DelayedScalingMode)
  assert isinstance(modes[recipe.Float8CurrentScaling], scaling.CurrentScalingMode)
  assert isinstance(modes[recipe.Float8BlockScaling], scaling.BlockScalingMode)
  for r in (d, c, b):
    m = r.scaling_mode()
    assert m.recipe is r and m.token_block == r.token_block
    assert m.dtype("x") == m.dtype("kernel") == r.fwd_dtype and m.dtype("grad") == r.bwd_dtype
    with pytest.raises(ValueError, match="role must be one of"):
      m.dtype("bias")
  assert (d.token_block, c.token_block, b.token_block) == (16, 16, 128)
  # accumulation: the per-tensor recipes' fields; blockwise always fp32
  dm, cm, bm = modes[recipe.DelayedScaling], modes[recipe.Float8CurrentScaling], modes[
      recipe.Float8BlockScaling]
  assert [dm.fast_accum(g) for g in scaling.GEMMS] == [True, True, False]
  assert [cm.fast_accum(g) for g in scaling.GEMMS] == [False, False, True]
  assert [bm.fast_accum(g) for g in scaling.GEMMS] == [False, False, False]
  with pytest.raises(ValueError, match="gemm must be one of"):
    dm.fast_accum("backward")
  # state: delayed scaling only
  assert dm.uses_state and not cm.uses_state and not bm.uses_state
  st = dm.init_state()
  assert st["x"]["amax_history"].shape == (8,)
  assert cm.init_state() is None and bm.init_state() is None
  dm.check_state(st)
  with pytest.raises(ValueError, match="DelayedScaling needs fp8_state"):
    dm.check_state(None)
  for m, name in ((cm, "Float8CurrentScaling"), (bm, "Float8BlockScaling")):
    m.check_state(None)
    with pytest.raises(ValueError, match=f"fp8_state must be None for {name}"):
      m.check_state(fp8_state.init_dense_state(2))
    assert m.update_state(None, {"x": jnp.float32(3.0)}) is None
  new = dm.update_state(st, {"x": jnp.float32(3.0)})
  assert float(new["x"]["amax_history"][0]) == 3.0
  assert new["kernel"] is st["kernel"] and new["grad"] is st["grad"]
  assert b.scaling_mode().block_shape("kernel") == (128, 128)
  assert b.scaling_mode().block_shape("x") == b.scaling_mode().block_shape("grad") == (1, 128)


def _tree_equal(a, b):
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                            equal_nan=True)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_scaling_mode_quantize_is_the_ops(name):
  """ScalingMode.quantize gives both copies of a tensor exactly as the ops
  do for that recipe (the layers call nothing else)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from te_jax import fp8_state  # pylint: disable=import-outside-toplevel
  from te_jax.ops import quantize as qop  # pylint: disable=import-outside-toplevel
  from te_jax.ops.fp8 import QuantizedTensor  # pylint: disable=import-outside-toplevel
  r = {"delayed": recipe.DelayedScaling(amax_history_len=2),
       "current": recipe.Float8CurrentScaling(),
       "block": recipe.Float8BlockScaling()}[name]
  m = r.scaling_mode()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 384)) * 3, jnp.float32)
  st = None
  if name == "delayed":
    st = fp8_state.init_dense_state(2)
    st = m.update_state(st, {"x": jnp.float32(7.0), "kernel": jnp.float32(2.0),
                             "grad": jnp.float32(0.5)})
  for role in ("x", "kernel", "grad"):
    got = m.quantize(x, role, st, impl="reference")
    dtype = m.dtype(role)
    if name == "delayed":
      want = qop.quantize_tensorwise(x, fp8_state.scale_from_state(st[role]), dtype,
                                     columnwise=True, impl="reference")
    elif name == "current":
      want = qop.quantize_current(x, dtype, columnwise=True, impl="reference")
    else:
      want = qop.quantize_blockwise(x, m.block_shape(role), dtype, r.power_2_scale,
                                    columnwise=True, impl="reference")
    assert isinstance(got, QuantizedTensor) and got.block_shape == want.block_shape
    assert _tree_equal(got, want), (name, role)
    assert got.data_t is not None
    rowwise_only = m.quantize(x, role, st, impl="reference", columnwise=False)
    assert rowwise_only.data_t is None
    np.testing.assert_array_equal(np.asarray(rowwise_only.data, np.float32),
                                  np.asarray(got.data, np.float32))


def test_recipe_without_scaling_mode_is_refused():
  """A Recipe subclass must define scaling_mode(); the dense says which."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from te_jax import dense  # pylint: disable=import-outside-toplevel

  @dataclasses.dataclass(frozen=True)
  class NoMode(recipe.Recipe):
    fp8_format: recipe.Format = recipe.Format.E4M3

  with pytest.raises(NotImplementedError, match="NoMode does not define scaling_mode"):
    dense.fp8_dense(jnp.ones((16, 16)), jnp.ones((16, 16)), recipe=NoMode())


def test_distributed_is_the_sharded_dense_module():
  """te_jax.distributed (the former name) resolves to te_jax.sharded_dense."""
  from te_jax import distributed, sharded_dense  # pylint: disable=import-outside-toplevel
  assert distributed.sharded_fp8_dense is sharded_dense.sharded_fp8_dense
  assert distributed.make_plan is sharded_dense.make_plan
  assert te_jax.sharded_dense is sharded_dense
