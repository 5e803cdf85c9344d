"""Saving and restoring te_jax.nnx models the way Flax's NNX guides do.

Flax's guide saves ``nnx.split(model)``'s state with orbax and restores into
``nnx.split(nnx.eval_shape(lambda: Model(...)))``'s abstract state, then
``nnx.merge``; under a mesh it builds the abstract state with
``nnx.get_abstract_model(init_fn, mesh)``. For te_jax models under a mesh
``te_jax.nnx.get_abstract_model`` takes that place: Flax's attaches one
sharding per variable, which the delayed-scaling state (an ``FP8State`` of
dicts) cannot take, and reads the parameters' logical axis names through
rules the user must know (``te_jax.sharding.logical_axis_rules``).

Each test trains, saves, restores into a fresh abstract target, trains on,
and checks the result bit for bit against a run that never stopped:
parameters, optimizer state and FP8 state. The mesh tests need 8 devices
(``tests/test_sharding.py`` runs them in its 8-device subprocess; the
``one_device`` tests run in every process).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import te_jax
from te_jax import checkpoint, recipe, sharding
from te_jax import nnx as tnx
from test_nnx_conventions import train_step

ocp = pytest.importorskip("orbax.checkpoint")   # a [test] extra: installed in CI

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}
HIDDEN, MLP, HEADS = 128, 256, 4
MR = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
needs8 = pytest.mark.skipif(len(jax.devices()) < 8,
                            reason="needs 8 devices (tests/test_sharding.py runs this file "
                                   "with XLA_FLAGS=--xla_force_host_platform_device_count=8)")


def _make():
  """The model and its optimizer (what a training run checkpoints)."""
  model = tnx.TransformerLayer(HIDDEN, MLP, HEADS, layer_type="decoder", attention_impl="xla",
                               impl="reference", rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _batch(i):
  x = jax.random.normal(jax.random.key(10 + i), (8, 64, HIDDEN), jnp.float32)
  return x, jnp.roll(x, 1, axis=-1)


def _train(pair, steps, start=0, place=lambda a: a):
  model, optimizer = pair
  return [float(train_step(model, optimizer, *map(place, _batch(start + i))))
          for i in range(steps)]


def _assert_same(got, want):
  """Every leaf of the two (model, optimizer) states equal bit for bit, with
  the same sharding where the arrays have one."""
  g, w = jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))
  assert len(g) == len(w)
  for a, b in zip(g, w):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)


def _save_orbax(path, pair):
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, nnx.state(pair))
  ckptr.wait_until_finished()
  ckptr.close()


def _restore_orbax(path, graphdef, abstract_state):
  ckptr = ocp.StandardCheckpointer()
  try:
    return nnx.merge(graphdef, ckptr.restore(path, abstract_state))
  finally:
    ckptr.close()


@pytest.mark.parametrize("rname", list(RECIPES))
def test_one_device_guide_restore_resumes_bit_identical(tmp_path, rname):
  """Flax's guide on one device: save nnx.split's state with orbax, restore
  into nnx.eval_shape's abstract state, merge, train on: identical to the
  run that never stopped, FP8 state included."""
  with te_jax.fp8_autocast(True, RECIPES[rname]):
    straight = _make()
    _train(straight, 4)
    first = _make()
    _train(first, 2)
    _save_orbax(tmp_path / "state", first)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(_make))
    resumed = _restore_orbax(tmp_path / "state", graphdef, abstract_state)
    _assert_same(resumed, first)
    _train(resumed, 2, start=2)
  _assert_same(resumed, straight)
  if rname == "delayed":
    hist = resumed[0].mlp.wi_fp8_meta.get_value()["x"]["amax_history"]
    assert int(jnp.sum(hist > 0)) == 4      # 2 steps before the save, 2 after


@pytest.mark.parametrize("backend", ["orbax", "numpy"])
def test_one_device_te_jax_checkpoint_restores_nnx_state(tmp_path, backend):
  """te_jax.checkpoint.save / restore take an NNX state as any pytree (both
  backends): restored into the abstract state, the model resumes bit for bit."""
  with te_jax.fp8_autocast(True, RECIPES["delayed"]):
    straight = _make()
    _train(straight, 3)
    first = _make()
    _train(first, 1)
    checkpoint.save(str(tmp_path), 1, nnx.state(first), backend=backend)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(_make))
    state = checkpoint.restore(str(tmp_path), 1, target=abstract_state, backend=backend)
    resumed = nnx.merge(graphdef, state)
    _train(resumed, 2, start=1)
  _assert_same(resumed, straight)


def test_one_device_restore_refuses_biases_the_model_lacks(tmp_path):
  """A checkpoint of flax.nnx layers (biases on by default) does not restore
  into te_jax layers built without biases (te_jax's default): orbax refuses
  the extra leaves; nnx.update accepts them, and the te_jax module then
  refuses to run, instead of dropping them."""
  donor = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  _, donor_state = nnx.split(donor)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "s", donor_state)
  ckptr.wait_until_finished()
  _, abstract_state = nnx.split(nnx.eval_shape(lambda: tnx.Linear(64, 32, rngs=nnx.Rngs(0))))
  with pytest.raises(ValueError):
    ckptr.restore(tmp_path / "s", abstract_state)
  ckptr.close()
  model = tnx.Linear(64, 32, rngs=nnx.Rngs(0))
  nnx.update(model, donor_state)
  with pytest.raises(ValueError, match="use_bias=True"):
    model(jnp.ones((2, 64)))
  ported = tnx.Linear(64, 32, use_bias=True, rngs=nnx.Rngs(0))
  nnx.update(ported, donor_state)
  np.testing.assert_allclose(ported(jnp.ones((2, 64))), donor(jnp.ones((2, 64))), rtol=1e-6)


# ------------------------------------------------------------ under a mesh --

def _mesh(axis_type):
  kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
  return jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(kind, kind))


def _sharded_make(mesh):
  """_make, with the variables placed by their logical names."""
  pair = _make()
  state = nnx.state(pair)
  nnx.update(pair, jax.device_put(state, tnx.get_named_sharding(state, mesh)))
  return pair


@needs8
# The delayed state (a dict per GEMM) under explicit axes, the blockwise
# recipe's stateless model under auto axes.
@pytest.mark.parametrize("rname,axis_type", [("delayed", "explicit"), ("block", "auto")])
def test_sharded_restore_resumes_bit_identical(tmp_path, rname, axis_type):
  """Under an FSDP x TP mesh (auto and explicit axes) with a MeshResource:
  save the sharded state with orbax, restore into
  te_jax.nnx.get_abstract_model's target (each leaf lands sharded as it was
  trained, the FP8 state replicated), train on: identical to the run that
  never stopped. Flax's nnx.get_abstract_model and nnx.eval_shape under the
  mesh fail on the delayed-scaling state (TypeError: a NamedSharding of spec
  None for a dict-valued variable)."""
  mesh = _mesh(axis_type)
  place = lambda a: jax.device_put(a, P("fsdp", None, None))   # noqa: E731
  rules = sharding.logical_axis_rules(MR)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules), \
       te_jax.fp8_autocast(True, RECIPES[rname], mesh_resource=MR):
    straight = _sharded_make(mesh)
    _train(straight, 4, place=place)
    first = _sharded_make(mesh)
    _train(first, 2, place=place)
    _save_orbax(tmp_path / "state", first)
    graphdef, abstract_state = tnx.get_abstract_model(_make, mesh)
    resumed = _restore_orbax(tmp_path / "state", graphdef, abstract_state)
    assert resumed[0].mlp.wi_kernel[...].sharding.spec == P("fsdp", None, "tp")
    _assert_same(resumed, first)
    _train(resumed, 2, start=2, place=place)
  _assert_same(resumed, straight)
  if rname == "delayed":
    with pytest.raises(TypeError):
      with jax.set_mesh(mesh), te_jax.fp8_autocast(True, RECIPES[rname], mesh_resource=MR):
        nnx.get_abstract_model(_make, mesh)


@needs8
def test_flax_get_abstract_model_with_te_jax_rules():
  """Without delayed-scaling state, Flax's own nnx.get_abstract_model works on
  te_jax models once te_jax's rules are in effect (every logical name the
  modules use has one, the gated MLP's "act" included) and agrees with
  te_jax.nnx.get_abstract_model."""
  mesh = _mesh("auto")
  with nnx.logical_axis_rules(sharding.logical_axis_rules(MR)), \
       te_jax.fp8_autocast(True, RECIPES["current"], mesh_resource=MR):
    make = lambda: tnx.LayerNormMLP(HIDDEN, MLP, activations=("silu", "linear"),  # noqa: E731
                                    rngs=nnx.Rngs(0))
    _, flax_state = nnx.get_abstract_model(make, mesh)
    _, te_state = tnx.get_abstract_model(make, mesh)
  flax_leaves, te_leaves = jax.tree.leaves(flax_state), jax.tree.leaves(te_state)
  assert [a.sharding.spec for a in flax_leaves] == [a.sharding.spec for a in te_leaves]
  assert P("fsdp", None, "tp") in [a.sharding.spec for a in te_leaves]   # wi_kernel
