"""te_jax under meshes with ``Explicit`` axes (sharding in types).

``jax.make_mesh`` makes Explicit axes by default, and current JAX examples
and Flax's NNX tutorials run under them (``jax.set_mesh``). There every array
carries its sharding in its type and an operation whose result the types do
not determine raises ``ShardingTypeError``; te_jax's GEMMs run with the axes
switched to Auto (``te_jax.explicit_axes.with_auto_axes``) and give their outputs
the layout the sharded GEMM produces. The FSDP / TP / SP matrix of
``tests/test_sharding_mesh.py`` runs under both axis types (explicit axes on
every mesh and SP choice, half its recipes); this file covers
what is particular to explicit axes: an NNX model trained as Flax's
tutorials write it, with and without a ``MeshResource``, output types that do
not depend on FP8 being on, a mesh of mixed axis types, eager calls.

Needs 8 devices (``tests/test_sharding.py`` runs it in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import te_jax
from te_jax import dense as dense_lib
from te_jax import recipe, sharding
from te_jax import flax as tfx
from te_jax import nnx as tnx

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
           "(tests/test_sharding.py runs this file in such a subprocess)")

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
    "off": None,
}
HIDDEN, MLP, HEADS = 256, 512, 4
# Data parallel over "data", tensor parallel over "model": the axes of the
# NNX MiniGPT tutorial's mesh.
MR = sharding.MeshResource(dp_resource="data", tp_resource="model")


def _mesh(*types):
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=types)


def _autocast(rname, mesh_resource):
  rec = RECIPES[rname]
  return te_jax.fp8_autocast(rec is not None, rec, mesh_resource=mesh_resource)


def _close(a, b, what, tol=0.1, tol_mean=0.07):
  """max|a-b| / max|a| <= tol and mean|a-b| / mean|a| <= tol_mean: the
  measure (and bounds) of tests/test_sharding_mesh.py's sharded against
  single-device runs. Two FP8 runs whose bf16 inputs differ by rounding
  noise alone (XLA partitions the bf16 ops around the GEMMs differently
  under the two axis types, so partial sums round in another order) differ
  by up to a few percent: a rounding flip in E4M3 moves an element by up
  to 6%. Measured here: mean 1.3-2.7% in FP8, 0.25% with FP8 off."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  err = float(np.abs(a - b).max()) / max(float(np.abs(a).max()), 1e-6)
  mean_err = float(np.abs(a - b).mean()) / max(float(np.abs(a).mean()), 1e-6)
  assert err <= tol and mean_err <= tol_mean, (what, err, mean_err)


def _nnx_train(rname, mesh, mesh_resource, steps=2):
  """Builds a TransformerLayer under ``mesh``, shards its variables by their
  logical names and trains ``steps`` Adam steps. Returns the first step's
  output and parameter gradients, the losses, the final FP8 state of the
  MLP's first GEMM (or None), the output's type spec and wi's spec."""
  rules = sharding.logical_axis_rules(mesh_resource or MR)
  x = jax.random.normal(jax.random.key(1), (8, 128, HIDDEN), jnp.bfloat16)
  w_out = jax.random.normal(jax.random.key(2), (HIDDEN,), jnp.float32)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules), _autocast(rname, mesh_resource):
    model = tnx.TransformerLayer(HIDDEN, MLP, HEADS, dtype=jnp.bfloat16, attention_impl="xla",
                                 impl="reference", rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tnx.get_named_sharding(state, mesh)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    xs = jax.device_put(x, P("data", None, None))

    @nnx.jit
    def step(model, optimizer, x):
      def loss_fn(model):
        y = model(x)
        return jnp.mean(jnp.sum(y.astype(jnp.float32) * w_out, axis=-1)), y
      (loss, y), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, tnx.WRT),
                                            has_aux=True)(model)
      optimizer.update(model, grads)
      tnx.apply_fp8_updates(model, grads)
      return loss, y, nnx.state(grads, nnx.Param)

    out = [step(model, optimizer, xs) for _ in range(steps)]
    meta = getattr(model.mlp, "wi_fp8_meta", None)
    return dict(losses=[float(o[0]) for o in out], y=out[0][1], grads=out[0][2],
                fp8=None if meta is None else meta.get_value(),
                y_spec=jax.typeof(out[0][1]).sharding.spec,
                wi_spec=model.mlp.wi_kernel[...].sharding.spec)


# Each recipe once, with and without a MeshResource twice each (the sharded
# GEMMs and XLA's partitioning of the plain ones): the cross product repeats
# the same paths.
@pytest.mark.parametrize("rname,with_mesh_resource", [
    ("delayed", True), ("current", False), ("block", True), ("off", False)])
def test_nnx_model_trains_under_explicit_mesh_as_under_auto(rname, with_mesh_resource):
  """An NNX TransformerLayer trains under an explicit-axes mesh, FP8 on (all
  recipes, the delayed state advanced by apply_fp8_updates) and off, with a
  MeshResource (sharded FP8 GEMMs) and without one (only the autocast's
  recipe, as a ported tutorial writes it): output and gradients as under an
  auto-axes mesh, the output in the input's batch layout, the gradients in
  the parameters' types. On the code before explicit support every FP8 case
  raised ShardingTypeError (a kernel reshape, or a contraction over sharded
  dims)."""
  mr = MR if with_mesh_resource else None
  explicit = _nnx_train(rname, _mesh(AxisType.Explicit, AxisType.Explicit), mr)
  auto = _nnx_train(rname, _mesh(AxisType.Auto, AxisType.Auto), mr)
  assert all(np.isfinite(explicit["losses"])), explicit["losses"]
  assert explicit["y_spec"] == P("data", None, None), explicit["y_spec"]
  assert explicit["wi_spec"] == P(None, None, "model")    # wi: (embed, act, mlp)
  _close(auto["y"], explicit["y"], "output")
  flat_e = dict(nnx.to_flat_state(explicit["grads"]))
  for path, g in nnx.to_flat_state(auto["grads"]):
    _close(g.get_value(), flat_e[path].get_value(), path)
  if rname == "delayed":   # the FP8 state advanced: the histories hold amaxes
    hist = explicit["fp8"]["x"]["amax_history"]
    assert float(jnp.max(hist)) > 0
    np.testing.assert_allclose(np.asarray(hist), np.asarray(auto["fp8"]["x"]["amax_history"]),
                               rtol=0.05)


def _linen_out_spec(module, rname, x, mesh):
  with _autocast(rname, None):
    variables = module.init(jax.random.key(0), x)
  rules = sharding.logical_axis_rules(MR)
  with jax.set_mesh(mesh), _autocast(rname, MR):
    specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)
    variables = jax.device_put(nn.meta.unbox(variables), nn.meta.unbox(specs))
    xs = jax.device_put(x, P("data", None, None))
    with nn.logical_axis_rules(rules):
      y = jax.jit(module.apply)(variables, xs)
  return jax.typeof(y).sharding.spec, y


@pytest.mark.parametrize("kind", ["column", "row", "mlp"])
def test_output_types_do_not_depend_on_fp8(kind):
  """Under an explicit-axes mesh and a MeshResource, a Linen GEMM's output
  has the same type with FP8 on (every recipe) as off: the layout of the
  sharded GEMM (column parallel: features on the tp axis; row parallel and
  the MLP block: replicated there), and the same values up to FP8."""
  mesh = _mesh(AxisType.Explicit, AxisType.Explicit)
  if kind == "column":
    module = tfx.DenseGeneral(MLP, kernel_axes=("embed", "mlp"), dtype=jnp.bfloat16)
    want = P("data", None, "model")
    width = HIDDEN
  elif kind == "row":
    module = tfx.DenseGeneral(HIDDEN, kernel_axes=("mlp", "embed"), dtype=jnp.bfloat16)
    want = P("data", None, None)
    width = MLP
  else:
    module = tfx.LayerNormMLP(intermediate_dim=MLP, dtype=jnp.bfloat16)
    want = P("data", None, None)
    width = HIDDEN
  x = jax.random.normal(jax.random.key(3), (8, 128, width), jnp.bfloat16)
  off_spec, off = _linen_out_spec(module, "off", x, mesh)
  assert off_spec == want
  for rname in ("delayed", "current", "block"):
    spec, y = _linen_out_spec(module, rname, x, mesh)
    assert spec == want, (rname, spec)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - off.astype(jnp.float32))))
    assert err <= 0.1 * float(jnp.max(jnp.abs(off.astype(jnp.float32)))), (rname, err)


def test_functional_dense_types_follow_operands_without_mesh_resource():
  """``te_jax.dense.dense`` on explicitly sharded operands with no mesh
  resource: the output takes x's sharding on its leading dims and the
  kernel's on the output dim, with the values of the unsharded call."""
  mesh = _mesh(AxisType.Explicit, AxisType.Explicit)
  x = jax.random.normal(jax.random.key(4), (8, 128, HIDDEN), jnp.float32)
  w = jax.random.normal(jax.random.key(5), (HIDDEN, MLP), jnp.float32) * 0.05
  r = RECIPES["current"]
  want = dense_lib.dense(x, w, recipe=r)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("data", None, None))
    ws = jax.device_put(w, P(None, "model"))
    got = jax.jit(lambda x, w: dense_lib.dense(x, w, recipe=r))(xs, ws)
    eager = dense_lib.dense(xs, ws, recipe=r)
  assert jax.typeof(got).sharding.spec == P("data", None, "model")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(want))


@pytest.mark.parametrize("split", [dict(num_splits=2), dict(split_sizes=(256, 128, 128))])
def test_functional_split_dense_under_explicit_mesh(split):
  """``te_jax.dense.fp8_dense_split`` on explicitly sharded operands: one
  output type per block (equal blocks or unequal ``split_sizes``), each the
  value of the unsharded call's block."""
  mesh = _mesh(AxisType.Explicit, AxisType.Explicit)
  x = jax.random.normal(jax.random.key(6), (8, 128, HIDDEN), jnp.float32)
  w = jax.random.normal(jax.random.key(7), (HIDDEN, MLP), jnp.float32) * 0.05
  r = RECIPES["current"]
  want = dense_lib.fp8_dense_split(x, w, recipe=r, **split)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("data", None, None))
    got = jax.jit(lambda x, w: dense_lib.fp8_dense_split(x, w, recipe=r, **split))(xs, w)
  assert len(got) == len(want)
  for g, v in zip(got, want):
    assert jax.typeof(g).sharding.spec == P("data", None, None)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(v))


def test_mixed_axis_types_mesh():
  """A mesh with one Explicit and one Auto axis: only the explicit one is
  switched around the GEMMs; training runs and matches the all-auto mesh."""
  mixed = _nnx_train("current", _mesh(AxisType.Explicit, AxisType.Auto), MR, steps=1)
  auto = _nnx_train("current", _mesh(AxisType.Auto, AxisType.Auto), MR, steps=1)
  _close(auto["y"], mixed["y"], "output")


def test_eager_call_under_explicit_mesh():
  """An un-jitted NNX forward under an explicit-axes mesh with a MeshResource
  (the GEMMs' auto-axes regions and shard_maps run eagerly) gives the jitted
  forward's values and type."""
  mesh = _mesh(AxisType.Explicit, AxisType.Explicit)
  with jax.set_mesh(mesh), _autocast("block", MR):
    model = tnx.LayerNormMLP(HIDDEN, MLP, impl="reference", rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tnx.get_named_sharding(state, mesh)))
    x = jax.device_put(jnp.ones((8, 128, HIDDEN), jnp.bfloat16), P("data", None, None))
    eager = model(x)
    jitted = nnx.jit(lambda m, x: m(x))(model, x)
  assert jax.typeof(eager).sharding.spec == jax.typeof(jitted).sharding.spec
  np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))


def test_named_sharding_of_every_variable():
  """``te_jax.nnx.get_named_sharding`` gives every leaf of a model with
  delayed-scaling state a NamedSharding on the mesh: parameters by their
  logical names through te_jax's default rules (no rules context needed:
  the gated MLP's "act" dim included), the FP8 state replicated."""
  mesh = _mesh(AxisType.Explicit, AxisType.Explicit)
  with _autocast("delayed", MR):
    model = tnx.LayerNormMLP(HIDDEN, MLP, activations=("silu", "linear"), rngs=nnx.Rngs(0))
    shardings = tnx.get_named_sharding(nnx.state(model), mesh)
  flat = dict(nnx.to_flat_state(shardings))
  assert flat[("wi_kernel",)].get_value().spec == P(None, None, "model")
  assert flat[("wo_kernel",)].get_value().spec == P("model", None)
  state_specs = jax.tree.leaves(flat[("wi_fp8_meta",)].get_value(),
                                is_leaf=lambda s: isinstance(s, NamedSharding))
  assert state_specs and all(s.spec == P() for s in state_specs)
  assert len(jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))) == \
      len(jax.tree.leaves(nnx.state(model)))
