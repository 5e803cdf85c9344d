"""te_jax.offload: the optimizer state in host memory between steps, same math.

jax's CPU devices have a ``pinned_host`` memory, so placement is checked
here for real (each array's ``sharding.memory_kind``), and the math
everywhere: the same updates and losses bit for bit with and without the
offload, one device and FSDP over 8 (faked in a subprocess).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from te_jax import offload

import train_gpt  # pylint: disable=import-error  (examples/ is on pytest's path)
from subprocess_flags import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(offload.host_memory_kind() is None,
                                reason="these devices have no pinned_host memory")


def _kinds(tree):
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_wrapped_optimizer_lives_on_host_and_computes_the_same():
  params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), "b": jnp.ones((8,))}
  plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
  tx = offload.offload_optimizer(plain)
  state, ref_state = tx.init(params), plain.init(params)
  assert _kinds(state) == {"pinned_host"} and _kinds(ref_state) == {"device"}
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  ref_step = jax.jit(lambda g, s, p: plain.update(g, s, p))
  for i in range(3):
    grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1)), params)
    updates, state = step(grads, state, params)
    ref_updates, ref_state = ref_step(grads, ref_state, params)
    assert _kinds(state) == {"pinned_host"} and _kinds(updates) == {"device"}
    _assert_same(updates, ref_updates)
    _assert_same(state, ref_state)
    params = optax.apply_updates(params, updates)
  assert offload.is_offloaded(tx) and offload.offload_optimizer(tx) is tx


def test_state_comes_to_the_device_only_after_its_gradients():
  """Every transfer of the state to the device reads it through an
  optimization barrier that also takes gradients, so XLA cannot start it
  before the backward pass (where it would sit beside the activations): the
  moments of each parameter through a barrier with that parameter's
  gradient alone (so their transfer can overlap the rest of the backward),
  the step count through one with every gradient."""
  params = {"w": jnp.ones((8, 8)), "b": jnp.ones((8,))}
  tx = offload.offload_optimizer(optax.adamw(1e-2))
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(params, state, params).jaxpr
  n_state = len(jax.tree.leaves(state))
  grads, state_in = jaxpr.invars[:2], jaxpr.invars[2:2 + n_state]
  origin = {g: {g.aval.shape} for g in grads}     # var -> shapes of the gradients it waits for
  tied_to = {}                                    # state var out of a barrier -> its grads
  for e in jaxpr.eqns:
    if e.primitive.name != "optimization_barrier":
      continue
    waits = set().union(*(origin.get(v, set()) for v in e.invars))
    for i, o in zip(e.invars, e.outvars):
      if i in origin:
        origin[o] = waits
      if i in set(state_in):
        tied_to[o] = waits
  to_device = [e for e in jaxpr.eqns if e.primitive.name == "device_put"
               and any(v in set(state_in) | set(tied_to) for v in e.invars)]
  assert len(to_device) >= 1, jaxpr
  seen = []
  for e in to_device:
    assert not set(e.invars) & set(state_in), e      # only through a barrier
    for v in e.invars:
      shape = v.aval.shape
      want = {shape} if shape else {(8, 8), (8,)}     # a moment: its gradient; the count: all
      assert tied_to[v] == want, (shape, tied_to[v])
      seen.append(shape)
  assert sorted(seen, key=len) == sorted([(), (8,), (8,), (8, 8), (8, 8)], key=len)


def test_host_shardings_keep_specs_and_refuse_other_leaves():
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  tree = {"a": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P())}
  host = offload.host_shardings(tree)
  assert {s.memory_kind for s in host.values()} == {"pinned_host"}
  assert host["a"].spec == P("fsdp") and host["a"].mesh == mesh
  with pytest.raises(TypeError, match="jax.sharding.Sharding"):
    offload.host_shardings({"a": P("fsdp")})


def test_train_gpt_offload_gives_the_same_losses_with_the_state_on_host():
  cfg = dict(preset="tiny", steps=3, out_dir=None, progress=False, eval_batches=0,
             sample_chars=0)
  ref = train_gpt.train(train_gpt.Config(**cfg))
  got = train_gpt.train(train_gpt.Config(offload_optimizer=True, **cfg))
  assert got["losses"] == ref["losses"]
  assert _kinds(got["state"].opt_state) == {"pinned_host"}
  assert _kinds(got["state"].params) == {"device"}
  assert _kinds(ref["state"].opt_state) == {"device"}


_FSDP_SCRIPT = """
import json, jax, train_gpt
cfg = dict(preset="tiny", batch=8, steps=3, out_dir=None, progress=False, eval_batches=0,
           sample_chars=0)
out = {}
for offload in (False, True):
  r = train_gpt.train(train_gpt.Config(offload_optimizer=offload, **cfg))
  leaves = jax.tree.leaves(r["state"].opt_state)
  big = [l for l in leaves if l.ndim == 2]
  out[str(offload)] = {
      "losses": r["losses"], "mesh": dict(r["state"].step.sharding.mesh.shape),
      "kinds": sorted({l.sharding.memory_kind for l in leaves}),
      "sharded": any(not l.sharding.is_fully_replicated for l in big)}
print("JSON " + json.dumps(out))
"""


def test_train_gpt_offload_under_fsdp_on_8_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=subprocess_xla_flags(devices=8),   # compiling is the cost
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "examples")]))
  proc = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=900, check=False)
  line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
  assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = json.loads(line[0][5:])
  off, on = out["False"], out["True"]
  assert on["mesh"]["fsdp"] == 8 and on["sharded"] and off["sharded"]
  assert off["kinds"] == ["device"] and on["kinds"] == ["pinned_host"]
  assert on["losses"] == off["losses"]
