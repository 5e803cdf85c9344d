"""kernel_init wrapped in nn.with_logical_partitioning (Flax's idiom).

DenseGeneral / LayerNormDenseGeneral: the wrapper's names replace the default
kernel_axes (and give the default bias_axes); an explicit kernel_axes must
equal them. LayerNormMLP: one initializer serves two kernels, so the names
are checked against kernel_axes_1 / kernel_axes_2 and not taken. The values
are those of the unwrapped initializer either way.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe
from te_jax import flax as tfx

INIT = nn.initializers.lecun_normal()


def init_vars(m, x):
  return jax.jit(m.init)(jax.random.key(0), x)


def specs(v):
  return jax.tree.map(tuple, nn.get_partition_spec(v)["params"],
                      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def test_dense_general_takes_the_wrapped_names():
  x = jnp.ones((2, 8, 32))
  plain = init_vars(tfx.DenseGeneral(64, use_bias=True, kernel_init=INIT), x)
  for names in (("embed", "mlp"), ("my_embed", None)):
    m = tfx.DenseGeneral(64, use_bias=True,
                         kernel_init=nn.with_logical_partitioning(INIT, names))
    v = init_vars(m, x)
    assert specs(v) == {"kernel": names, "bias": names[1:]}
    np.testing.assert_array_equal(nn.unbox(v)["params"]["kernel"],
                                  nn.unbox(plain)["params"]["kernel"])
  with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
    y = jax.jit(m.apply)(v, x)
    y_plain = jax.jit(tfx.DenseGeneral(64, use_bias=True, kernel_init=INIT).apply)(plain, x)
  np.testing.assert_array_equal(y, y_plain)


def test_dense_general_multi_dim_kernel_and_mesh_rules_kept():
  x = jnp.ones((2, 8, 32))
  rules = (("heads", None),)
  init = nn.with_logical_partitioning(INIT, ("embed", "heads", "kv"), rules=rules)
  v = init_vars(tfx.DenseGeneral((4, 16), kernel_init=init), x)
  k = v["params"]["kernel"]
  assert isinstance(k, nn.LogicallyPartitioned) and k.rules == rules
  assert k.names == ("embed", "heads", "kv") and k.value.shape == (32, 4, 16)
  # the initializer sees the 2-D (in, out) view, as without the wrapper
  plain = init_vars(tfx.DenseGeneral((4, 16), kernel_init=INIT), x)
  np.testing.assert_array_equal(k.value, nn.unbox(plain)["params"]["kernel"])


def test_explicit_kernel_axes_must_agree():
  x = jnp.ones((2, 32))
  init = nn.with_logical_partitioning(INIT, ("embed", "mlp"))
  v = init_vars(tfx.DenseGeneral(64, kernel_init=init, kernel_axes=("embed", "mlp")), x)
  assert specs(v)["kernel"] == ("embed", "mlp")
  with pytest.raises(ValueError, match=r"kernel_axes=\('embed', 'heads'\).*drop kernel_axes"):
    tfx.DenseGeneral(64, kernel_init=init, kernel_axes=("embed", "heads")).init(
        jax.random.key(0), x)


def test_wrong_name_count_and_mesh_partitioning_raise():
  x = jnp.ones((2, 32))
  with pytest.raises(ValueError, match="one name per dim"):
    tfx.DenseGeneral((4, 16), kernel_init=nn.with_logical_partitioning(
        INIT, ("embed", "mlp"))).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="with_logical_partitioning"):
    tfx.DenseGeneral(16, kernel_init=nn.with_partitioning(INIT, ("data", None))).init(
        jax.random.key(0), x)


def test_wrapped_bias_init():
  x = jnp.ones((2, 32))
  m = tfx.DenseGeneral(16, use_bias=True, bias_init=nn.with_logical_partitioning(
      nn.initializers.ones, ("out",)))
  v = init_vars(m, x)
  assert specs(v)["bias"] == ("out",)
  np.testing.assert_array_equal(nn.unbox(v)["params"]["bias"], np.ones(16))
  with pytest.raises(ValueError, match="bias_axes="):
    tfx.DenseGeneral(16, use_bias=True, bias_axes=("mlp",), bias_init=m.bias_init).init(
        jax.random.key(0), x)


def test_layernorm_dense_general():
  x = jax.random.normal(jax.random.key(2), (2, 16, 128))
  init = nn.with_logical_partitioning(INIT, ("embed", "joined_kv"))
  m = tfx.LayerNormDenseGeneral(256, kernel_init=init)
  v = init_vars(m, x)
  assert specs(v)["kernel"] == ("embed", "joined_kv")
  plain = init_vars(tfx.LayerNormDenseGeneral(256, kernel_init=INIT), x)
  np.testing.assert_array_equal(nn.unbox(v)["params"]["kernel"],
                                nn.unbox(plain)["params"]["kernel"])
  with te_jax.fp8_autocast(True, recipe.Float8BlockScaling()):   # the fused norm path
    assert jax.jit(m.apply)(v, x).shape == (2, 16, 256)
  with pytest.raises(ValueError, match="kernel_axes="):
    tfx.LayerNormDenseGeneral(256, kernel_init=init, kernel_axes=("embed", "mlp")).init(
        jax.random.key(0), x)


@pytest.mark.parametrize("names", [("embed", "mlp"), ("mlp", "embed"),
                                   ("embed", "act", "mlp")])
def test_layernorm_mlp_accepts_its_kernels_names(names):
  x = jax.random.normal(jax.random.key(2), (2, 16, 128))
  kw = dict(intermediate_dim=256, activations=("silu", "linear"))
  m = tfx.LayerNormMLP(**kw, kernel_init=nn.with_logical_partitioning(INIT, names))
  v = init_vars(m, x)
  s = specs(v)
  assert s["wi_kernel"] == ("embed", "act", "mlp") and s["wo_kernel"] == ("mlp", "embed")
  plain = init_vars(tfx.LayerNormMLP(**kw, kernel_init=INIT), x)
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(v), nn.unbox(plain))
  with te_jax.fp8_autocast(True, recipe.DelayedScaling()):
    v8 = init_vars(m, x)
    assert jax.jit(m.apply)(v8, x).shape == x.shape


def test_layernorm_mlp_other_names_raise():
  x = jnp.ones((2, 16, 128))
  m = tfx.LayerNormMLP(256, kernel_init=nn.with_logical_partitioning(INIT, ("a", "b")))
  with pytest.raises(ValueError, match="kernel_axes_1.*unwrapped"):
    m.init(jax.random.key(0), x)
  # names that fit custom kernel_axes_1/kernel_axes_2 are fine
  m = tfx.LayerNormMLP(256, kernel_axes_1=("a", "act", "b"), kernel_axes_2=("b", "a"),
                       kernel_init=nn.with_logical_partitioning(INIT, ("a", "b")))
  assert specs(init_vars(m, x))["wo_kernel"] == ("b", "a")
