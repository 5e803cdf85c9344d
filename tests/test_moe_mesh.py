"""The MoE block sharded over 8 devices equals the same block on one device.

Meshes: expert parallelism over all 8 devices (EP=8), EP=4 x TP=2 with
sequence parallelism (and shared experts), FSDP=2 x EP=4 (expert weights
all-gathered in FP8), DP=2 x EP=2 x TP=2 without SP. FP8 off must agree to float rounding; FP8 within
``FP8_TOL`` (see below); gradients, the dropped count and the delayed-scaling
state too. The compiled step moves tokens by all-to-all with buffers fixed
at trace time, all-gathers FSDP expert weights in FP8, and has no host
callback.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8``;
``tests/test_moe_sharding.py`` runs this file in such a subprocess.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from te_jax import fused_mlp, hlo_inspect, moe, recipe, sharding

from test_moe_block import host_transfers, rel

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
           "(tests/test_moe_sharding.py runs this file so)")

RECIPES = {
    "off": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}
# (axis names, shape, MeshResource kwargs, with shared experts)
MESHES = {
    "ep8": (("ep",), (8,), {}, False),
    "ep4_tp2_sp": (("ep", "tp"), (4, 2), dict(tp_resource="tp", sequence_parallel=True,
                                              pad_tokens=True), True),
    "fsdp2_ep4": (("fsdp", "ep"), (2, 4), dict(fsdp_resource="fsdp"), False),
    # data parallelism (the expert gradients summed over dp) and tensor
    # parallelism without SP (tokens replicated over tp, outputs summed)
    "dp2_ep2_tp2": (("dp", "ep", "tp"), (2, 2, 2), dict(dp_resource="dp", tp_resource="tp"),
                    False),
}
# FP8 off on the mesh with every kind of axis (the routing, all-to-alls and
# reductions are the FP8 cases' too); each mesh under an FP8 recipe.
CASES = [("dp2_ep2_tp2", "off"), ("ep4_tp2_sp", "off")] + [("ep8", "delayed"), ("ep4_tp2_sp", "blockwise"),
                                        ("fsdp2_ep4", "blockwise"), ("fsdp2_ep4", "current"),
                                        ("dp2_ep2_tp2", "delayed")]
# FP8 off: float32 sums in another order. FP8: the sharded and one-device
# runs quantize with the same scales (amaxes max-reduced over the mesh); they
# differ where such a reordered sum moves a value across an FP8 rounding
# boundary (one E4M3 step is 6% of that value) and, blockwise, where the
# 128-token tiles of the weight-gradient operands group other rows (the
# regrouped buffer holds each sender's rows apart); a few such values in
# these tensors stay far below this bound, which is 1/4 of the FP8-vs-fp32
# tolerance of test_moe_block.py.
OFF_TOL, FP8_TOL = 1e-5, 0.02
CFG = moe.MoEConfig(num_experts=8, num_experts_per_token=2)
B, S, H, F = 8, 16, 256, 256   # F: whole 128-blocks per tp=2 rank (the fused experts)


def _mesh(name):
  axes, shape, kw, shared = MESHES[name]
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), axes)
  return mesh, sharding.MeshResource(**kw), shared


def _inputs(shared):
  params = moe.init_params(jax.random.PRNGKey(0), CFG, H, F,
                           shared_intermediate=128 if shared else None)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
  return x, params, g


def _step(r, config=CFG, **kw):
  """y, aux and the gradients of x, params and the FP8 state for output gradient g."""
  def step(x, params, st, g):
    def f(x, params, st):
      return moe.moe_block(x, params, config=config, recipe=r, fp8_state=st, **kw)
    (y, aux), vjp = jax.vjp(f, x, params, st)
    return y, aux, vjp((g, jax.tree.map(jnp.zeros_like, aux)))
  return step


@pytest.mark.parametrize("mesh_name, recipe_name", CASES)
def test_sharded_equals_one_device(mesh_name, recipe_name):
  r = RECIPES[recipe_name]
  mesh, mr, shared = _mesh(mesh_name)
  x, params, g = _inputs(shared)
  st = moe.init_fp8_state(r, CFG, shared=shared) if r is not None else None
  want = jax.jit(_step(r))(x, params, st, g)
  with jax.set_mesh(mesh):
    got = jax.jit(_step(r, mesh_resource=mr, ep_axis="ep"))(x, params, st, g)
  tol = OFF_TOL if r is None else FP8_TOL
  (y, aux, grads), (ry, raux, rgrads) = got, want
  assert rel(y, ry) < tol
  np.testing.assert_array_equal(aux.tokens_per_expert, raux.tokens_per_expert)
  assert int(aux.dropped) == int(raux.dropped) == 0
  assert rel(grads[0], rgrads[0]) < tol
  for name in rgrads[1]:
    assert rel(grads[1][name], rgrads[1][name]) < tol, name
  if st is not None:   # the new delayed-scaling state, history by history
    for a, b in zip(jax.tree.leaves(grads[2]), jax.tree.leaves(rgrads[2])):
      np.testing.assert_allclose(a, b, rtol=1e-6)


def test_capacity_mode_is_per_device():
  """With a capacity, each device keeps its own tokens' first assignments: the
  sharded block equals the one-device block run on each device's tokens, and
  the dropped count is their sum."""
  config = moe.MoEConfig(num_experts=8, num_experts_per_token=2, capacity_factor=0.5)
  mesh, mr, _ = _mesh("ep8")
  x, params, _ = _inputs(False)
  f = lambda x, **kw: moe.moe_block(x, params, config=config, **kw)
  with jax.set_mesh(mesh):
    y, aux = jax.jit(lambda x: f(x, mesh_resource=mr, ep_axis="ep"))(x)
  parts = [jax.jit(f)(x[i:i + 1]) for i in range(B)]
  np.testing.assert_allclose(y, jnp.concatenate([p[0] for p in parts]), rtol=1e-5,
                             atol=1e-5)
  assert int(aux.dropped) == sum(int(p[1].dropped) for p in parts) > 0


def test_compiled_step_collectives_and_no_host_callback():
  """FSDP x EP, blockwise: tokens go by all-to-all, expert weights are
  all-gathered in FP8 (never in float), nothing talks to the host."""
  r = RECIPES["blockwise"]
  mesh, mr, _ = _mesh("fsdp2_ep4")
  x, params, g = _inputs(False)

  def step(x, params, g):   # a training step's gradients (a program not compiled
    def loss(x, params):    # before in this process: the persistent cache would
      y, aux = moe.moe_block(x, params, config=CFG, recipe=r, mesh_resource=mr,
                             ep_axis="ep")   # skip the passes that write the dump)
      return jnp.sum(y * g) + aux.loss
    return jax.grad(loss, (0, 1))(x, params)

  with jax.set_mesh(mesh):
    text, _ = hlo_inspect.partitioned_hlo(jax.jit(step).lower(x, params, g))
    assert host_transfers(step, x, params, g) == []
  colls = hlo_inspect.collectives(text)
  kinds = {(c.kind, c.dtype) for c in colls}
  assert ("all-to-all", "f32") in kinds
  # the local experts' weights: (2 experts, H, 2 F) and (2, F, H) in FP8
  fp8_gathers = {c.shape for c in colls if c.kind == "all-gather" and c.dtype == "f8e4m3fn"}
  assert {(2, H, 2 * F), (2, F, H)} <= fp8_gathers, fp8_gathers
  # of the local experts' arrays, only the blocks' scales (one per 128 x 128
  # block) are gathered in float, never a weight
  float_gathers = [c for c in colls if c.kind == "all-gather" and c.dtype in ("f32", "bf16")
                   and len(c.shape) == 3 and c.shape[0] == 2]
  most = 2 * (H // 128) * (2 * F // 128)   # wi's block scales
  assert float_gathers and max(np.prod(c.shape) for c in float_gathers) <= most, float_gathers


def test_ep_axis_checks():
  mesh, mr, _ = _mesh("fsdp2_ep4")
  x, params, _ = _inputs(False)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="not an axis of the mesh"):
      moe.moe_block(x, params, config=CFG, mesh_resource=mr, ep_axis="expert")
    with pytest.raises(ValueError, match="another role"):
      moe.moe_block(x, params, config=CFG, mesh_resource=mr, ep_axis="fsdp")
    with pytest.raises(ValueError, match="num_experts"):
      moe.moe_block(x, moe.init_params(jax.random.PRNGKey(0), moe.MoEConfig(6, 2), H, F),
                    config=moe.MoEConfig(6, 2), mesh_resource=mr, ep_axis="ep")
    with pytest.raises(ValueError, match="multiple of 128"):   # 200 / fsdp 2 = 100
      p = moe.init_params(jax.random.PRNGKey(0), CFG, 200, F)
      moe.moe_block(x[..., :200], p, config=CFG, recipe=RECIPES["blockwise"],
                    mesh_resource=mr, ep_axis="ep")


def test_fp8_act_input_reaches_the_experts_on_each_device():
  """store_act_input_in_fp8 on EP=8, blockwise: the experts in the
  shard_map keep h in E4M3 as one device does (1x128 tiles along the
  features: a row's tiles do not depend on where the row is), so the
  sharded gradients equal the one-device ones with the option within the
  bound above, and differ from the sharded ones without it."""
  r = RECIPES["blockwise"]
  mesh, mr, _ = _mesh("ep8")
  x, params, g = _inputs(False)
  want = jax.jit(_step(r, store_act_input_in_fp8=True))(x, params, None, g)
  with jax.set_mesh(mesh):
    got = jax.jit(_step(r, mesh_resource=mr, ep_axis="ep", store_act_input_in_fp8=True))(
        x, params, None, g)
    base = jax.jit(_step(r, mesh_resource=mr, ep_axis="ep"))(x, params, None, g)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(base[0]))   # forward unchanged
  assert rel(got[2][0], want[2][0]) < FP8_TOL
  for name in want[2][1]:
    assert rel(got[2][1][name], want[2][1][name]) < FP8_TOL, name
  assert not np.array_equal(np.asarray(got[2][0]), np.asarray(base[2][0]))


def test_sharded_shared_experts_say_once_they_keep_h_in_the_compute_dtype(caplog):
  """The shared experts run sharded by XLA's partitioner, where the quantize
  that would keep h in FP8 has no sharding rule: under the option they keep
  h in the compute dtype and a warning says so, once."""
  fused_mlp.warn_act_input_not_in_fp8.cache_clear()
  caplog.set_level(logging.WARNING, logger="te_jax")
  r = RECIPES["blockwise"]
  mesh, mr, shared = _mesh("ep4_tp2_sp")
  assert shared
  x, params, g = _inputs(shared)
  with jax.set_mesh(mesh):
    jax.jit(_step(r, mesh_resource=mr, ep_axis="ep"))(x, params, None, g)
    assert not [m for m in caplog.messages if "store_act_input_in_fp8" in m]
    for _ in range(2):
      jax.jit(_step(r, mesh_resource=mr, ep_axis="ep", store_act_input_in_fp8=True))(
          x, params, None, g)
  hits = [m for m in caplog.messages if "store_act_input_in_fp8" in m]
  assert len(hits) == 1 and "shared experts" in hits[0], hits
