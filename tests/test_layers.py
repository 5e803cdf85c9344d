"""te_jax.layers, the framework-neutral core of the modules.

* The core runs with any implementation of its state protocol: a plain dict
  (no framework at all) gives the Linen module's numbers bit for bit, on the
  fused and the unfused path, and its FP8 state updates.
* The logical axis rules a module's GEMMs use are the ones its framework
  layer read (``Settings.axis_rules``, put in effect around the functional
  call by ``te_jax.sharding.use_axis_rules``): under NNX those of
  ``nnx.logical_axis_rules``, under Linen those of ``nn.logical_axis_rules``.
  The end-to-end NNX check needs 8 (fake) devices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import fp8_state, norm_dense, sharded_dense, sharding
from te_jax import flax as tfx
from te_jax import nnx as tnx
from te_jax.flax import fp8_module
from te_jax.layers import gemm as gemm_lib
from te_jax.layers import mlp as mlp_lib
from te_jax.layers.settings import read_settings
from te_jax.layers.state import GemmStates

from flax_cases import RECIPES, rand

E, F = 128, 256
COLL = fp8_state.FP8_COLLECTION


class DictStates(GemmStates):
  """The core's state protocol over a plain dict {name: state}: what a third
  framework would write. Missing states are created on first use."""

  module_name = "DictMLP"

  def __init__(self, values):
    self.values = values

  def has(self, name):
    return name in self.values

  def can_create(self):
    return True

  def peek(self, name):
    return self.values[name]

  def state(self, name, mode):
    if not mode.uses_state:
      return None
    return self.values.setdefault(name, mode.init_state())


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_core_with_a_dict_state_store_matches_the_linen_module(rname, fused):
  r = RECIPES[rname]()
  x = rand(0, (2, 64, E))
  linen = tfx.LayerNormMLP(F, activations=("silu", "linear"), layernorm_type="rmsnorm",
                           fuse_activation_quantize=fused)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    v = nn.unbox(jax.jit(linen.init)(jax.random.key(0), x))
    p = v["params"]

    def core(params, states, x):
      values = dict(states)
      y = mlp_lib.layernorm_mlp(
          DictStates(values), read_settings(), x,
          norm=norm_dense.NormParams(params["scale"], None, "rmsnorm", 1e-6, False),
          wi=params["wi_kernel"], wo=params["wo_kernel"], bi=None, bo=None,
          activations=("silu", "linear"), dtype=jnp.float32, owner="DictMLP",
          kernel_axes=(("embed", "act", "mlp"), ("mlp", "embed")),
          fuse_activation_quantize=fused)
      return jnp.sum(jnp.sin(y)), values

    states = v.get(COLL, {})
    got, got_grads = jax.value_and_grad(lambda p, s: core(p, s, x)[0], argnums=(0, 1))(
        p, states)
    want, want_grads = jax.value_and_grad(
        lambda p, s: jnp.sum(jnp.sin(linen.apply({"params": p, **({COLL: s} if s else {})},
                                                 x))), argnums=(0, 1))(p, states)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if rname == "delayed":   # the states' "gradients" are their updates: the amaxes moved
    assert set(states) == set(mlp_lib.FP8_GEMMS)
    assert float(got_grads[1]["wi_fp8_meta"]["x"]["amax_history"][0]) > 0


def test_use_axis_rules_wins_over_flax_rules_context():
  mr = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
  with nn.logical_axis_rules((("mlp", "fsdp"),)):
    assert sharding.logical_to_mesh_axes(("mlp",)) == (("fsdp",),)
    with sharding.use_axis_rules(sharding.logical_axis_rules(mr)):
      assert sharding.logical_to_mesh_axes(("mlp",)) == (("tp",),)
    assert sharding.logical_to_mesh_axes(("mlp",)) == (("fsdp",),)
  assert sharding.logical_to_mesh_axes(("mlp",), mesh_resource=mr) == (("tp",),)


MR = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
USER_RULES = (("batch", "fsdp"), ("embed", None), ("mlp", None))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_settings_carry_the_frameworks_axis_rules(framework):
  read = {"linen": fp8_module.read_autocast, "nnx": tnx.state.read_autocast}[framework]
  context = {"linen": nn.logical_axis_rules, "nnx": nnx.logical_axis_rules}[framework]
  with te_jax.fp8_autocast(True, RECIPES["current"](), mesh_resource=MR):
    assert read().axis_rules == sharding.logical_axis_rules(MR)
    with context(USER_RULES):
      assert read().axis_rules == USER_RULES


def test_the_core_puts_its_axis_rules_in_effect_for_the_functional_layer(monkeypatch):
  seen = []
  monkeypatch.setattr(gemm_lib.dense_lib, "dense_general", lambda x, *a, **k: seen.append(
      sharding.logical_to_mesh_axes(("embed", "mlp"))) or x[..., :F])
  swapped = (("embed", "tp"), ("mlp", "fsdp"))
  with te_jax.fp8_autocast(True, RECIPES["current"](), mesh_resource=MR):
    settings = read_settings(axis_rules=swapped)
  gemm_lib.gemm_output(jnp.ones((4, F)), jnp.ones((F, F)), None, settings, None,
                       contract_ndim=1, kernel_axes=("embed", "mlp"))
  assert seen == [(("tp",), ("fsdp",))]    # the settings' rules
  assert sharding.logical_to_mesh_axes(("embed", "mlp"), mesh_resource=MR) == (
      ("fsdp",), ("tp",))                 # and only inside the call


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices: "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_nnx_gemms_follow_nnx_logical_axis_rules(monkeypatch):
  """An NNX Linear's sharded FP8 GEMM maps its kernel axes with the rules of
  ``nnx.logical_axis_rules`` (the ones NNX's own sharding tools read), and
  with the defaults for the mesh resource outside any."""
  modes = []
  real = sharded_dense.make_plan
  monkeypatch.setattr(sharded_dense, "make_plan",
                      lambda *a, **k: modes.append(getattr(real(*a, **k), "tp_mode", None))
                      or real(*a, **k))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
  model = tnx.Linear(E, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  x = jnp.ones((8, 16, E), jnp.float32)
  with jax.set_mesh(mesh), te_jax.fp8_autocast(True, RECIPES["current"](), mesh_resource=MR):
    jax.eval_shape(lambda x: model(x), x)          # defaults: mlp on tp, column parallel
    with nnx.logical_axis_rules(USER_RULES):
      jax.eval_shape(lambda x: model(x), x)        # the user's rules: nothing on tp
  assert modes == ["col", "none"], modes
