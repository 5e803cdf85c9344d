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
