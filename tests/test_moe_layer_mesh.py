"""The MoE modules on 8 devices with ``MeshResource.ep_resource`` equal one device.

``te_jax.flax.MoE`` under ``fp8_autocast(mesh_resource=...)`` and a mesh, its
parameters sharded by te_jax's logical axis rules ("expert" over the ep
axis): EP=8, EP=4 x TP=2 with sequence parallelism (and shared experts),
FSDP=2 x EP=4 -- output and gradients equal to the same module on one
device (FP8 off to float rounding, FP8 within the block's mesh tolerance of
``test_moe_mesh.py``); the TransformerLayer option under EP x TP with SP;
the whole training step with no host callback.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8``;
``tests/test_moe_layer_sharding.py`` runs this file in such a subprocess,
and runs :func:`digest` in two fresh processes (determinism). ``python3
tests/test_moe_layer_mesh.py --digest`` prints that digest.
"""

import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from jax.sharding import Mesh

import te_jax
from te_jax import flax as tfx, moe, sharding

from test_moe_block import host_transfers, rel
# the functional block's recipes and tolerances on the same meshes
from test_moe_mesh import FP8_TOL, OFF_TOL, RECIPES

# (axis names, shape, MeshResource kwargs, shared experts)
MESHES = {
    "ep8": (("ep",), (8,), dict(ep_resource="ep"), False),
    # pad_tokens: the shared experts' sharded dense GEMMs see 16 tokens per
    # device, below blockwise's 128-token tile
    "ep4_tp2_sp": (("ep", "tp"), (4, 2), dict(ep_resource="ep", tp_resource="tp",
                                              sequence_parallel=True, pad_tokens=True), True),
    "fsdp2_ep4": (("fsdp", "ep"), (2, 4), dict(fsdp_resource="fsdp", ep_resource="ep"),
                  False),
}
# Each mesh once, two of them under an FP8 recipe (the functional block's
# recipes and FP8 off on these meshes: test_moe_mesh.py); delayed scaling
# carries the per-expert state through the expert-sharded path.
CASES = [("ep8", "delayed"), ("ep4_tp2_sp", "blockwise"), ("fsdp2_ep4", "off")]
B, S, H, F = 8, 16, 256, 128
KW = dict(num_experts=8, num_experts_per_token=2, intermediate_dim=F, impl="reference")


def _mesh(name):
  axes, shape, kw, shared = MESHES[name]
  return (Mesh(np.array(jax.devices()[:8]).reshape(shape), axes),
          sharding.MeshResource(**kw), shared)


def _inputs():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32),
          jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32))


def _grads(module, g, **apply_kw):
  """The step's loss gradient w.r.t. the variables and the input, and the output."""
  def step(v, x):
    def loss(v, x):
      y, st = module.apply(v, x, mutable=["intermediates"], **apply_kw)
      return jnp.sum(y * g) + moe.aux_totals(st)["aux_loss"], y
    (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(v, x)
    return y, grads
  return step


def _run(module, r, x, g, mesh=None, mr=None, variables=None, **apply_kw):
  """(variables, y, grads): init on one device, then the step on ``mesh``
  (variables placed by the logical axis rules of ``mr``) or on one device."""
  ctx = te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r, mesh_resource=mr)
  step = _grads(module, g, **apply_kw)
  if mesh is None:
    with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
      if variables is None:
        variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x, **apply_kw))
      return variables, *jax.jit(step)(variables, x)
  rules = sharding.logical_axis_rules(mr)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), ctx:
    specs = nn.get_partition_spec(jax.eval_shape(module.init, jax.random.key(0), x,
                                                 **apply_kw))
    placed = jax.device_put(variables, nn.logical_to_mesh_sharding(specs, mesh, rules))
    return variables, *jax.jit(step)(placed, x)


def _compare(got, want, tol):
  (_, y, (dv, dx)), (_, ry, (rdv, rdx)) = got, want
  assert rel(y, ry) < tol
  assert rel(dx, rdx) < tol
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(dv["params"]),
                          jax.tree.leaves(rdv["params"])):
    assert rel(a, b) < tol, jax.tree_util.keystr(path)
  for a, b in zip(jax.tree.leaves(dv.get(te_jax.FP8_COLLECTION, {})),
                  jax.tree.leaves(rdv.get(te_jax.FP8_COLLECTION, {}))):
    np.testing.assert_allclose(a, b, rtol=1e-6)


needs8 = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
           "(tests/test_moe_layer_sharding.py runs this file so)")


@needs8
@pytest.mark.parametrize("mesh_name, recipe_name", CASES)
def test_module_on_a_mesh_equals_one_device(mesh_name, recipe_name):
  r = RECIPES[recipe_name]
  mesh, mr, shared = _mesh(mesh_name)
  module = tfx.MoE(shared_intermediate_dim=128 if shared else None,
                   load_balancing_coef=0.01, **KW)
  x, g = _inputs()
  want = _run(module, r, x, g)
  got = _run(module, r, x, g, mesh, mr, variables=want[0])
  _compare(got, want, OFF_TOL if r is None else FP8_TOL)


LAYER_CFG = moe.MoEConfig(num_experts=8, num_experts_per_token=2, load_balancing_coef=0.01)
LAYER = dict(hidden_size=H, mlp_hidden_size=F, num_attention_heads=2, layer_type="decoder",
             enable_rotary_pos_emb=True, mlp_type="moe", moe=LAYER_CFG, impl="reference")


@needs8
def test_transformer_layer_with_moe_on_ep_tp_sp_equals_one_device():
  """Attention sharded over tp with SP, the MoE over ep x tp, padding tokens
  masked out of the routing: the whole layer equals one device."""
  mesh, mr, _ = _mesh("ep4_tp2_sp")
  layer = tfx.TransformerLayer(**LAYER)
  x, g = _inputs()
  seg = jnp.ones((B, S), jnp.int32).at[:, -3:].set(0)
  want = _run(layer, None, x, g, segment_ids=seg)
  got = _run(layer, None, x, g, mesh, mr, variables=want[0], segment_ids=seg)
  _compare(got, want, OFF_TOL)


@needs8
def test_whole_training_step_has_no_host_callback():
  """A TransformerLayer(moe) training step on FSDP x EP under delayed scaling:
  nothing in its jaxpr or compiled HLO talks to the host."""
  r = RECIPES["delayed"]
  mesh, mr, _ = _mesh("fsdp2_ep4")
  layer = tfx.TransformerLayer(**LAYER)
  x, g = _inputs()
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    variables = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x))
  with (jax.set_mesh(mesh), nn.logical_axis_rules(sharding.logical_axis_rules(mr)),
        te_jax.fp8_autocast(enabled=True, fp8_recipe=r, mesh_resource=mr)):
    assert host_transfers(_grads(layer, g), variables, x) == []


def digest() -> str:
  """sha256 of a delayed-scaling training step's output, gradients and new
  FP8 state of the MoE on EP=4 x TP=2 with SP (8 devices)."""
  r = RECIPES["delayed"]
  mesh, mr, _ = _mesh("ep4_tp2_sp")
  module = tfx.MoE(shared_intermediate_dim=128, load_balancing_coef=0.01, **KW)
  x, g = _inputs()
  variables = _run(module, r, x, g)[0]
  _, y, grads = _run(module, r, x, g, mesh, mr, variables=variables)
  h = hashlib.sha256()
  for leaf in jax.tree.leaves((y, grads)):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


if __name__ == "__main__" and "--digest" in sys.argv:
  print("DIGEST", digest())
