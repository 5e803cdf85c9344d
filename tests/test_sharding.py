"""te_jax.sharding: MeshResource, logical axis rules; runs the 8-device suite.

The sharded runs need 8 devices, which XLA only fakes on CPU when
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before jax is
imported. Other test files import jax first, so
:func:`test_eight_device_suite` runs the files of :data:`EIGHT_DEVICE_FILES`
(``tests/test_sharding_mesh.py``, ``tests/test_explicit_sharding.py``, the
mesh tests of ``tests/test_nnx_checkpoint.py``) in a subprocess with that
flag (two processes in parallel, to use both CPU cores of CI runners),
unless this process already has 8 devices, in which case pytest collects
those files directly.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from te_jax import sharding

from subprocess_flags import subprocess_xla_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


# ------------------------------------------------------------ MeshResource --

def test_mesh_resource_defaults_and_validation():
  mr = sharding.MeshResource()
  assert (mr.dp_resource, mr.fsdp_resource, mr.tp_resource) == (None, None, None)
  assert not mr.sequence_parallel and not mr.pad_tokens
  sharding.MeshResource(dp_resource=("a", "b"), fsdp_resource="f", tp_resource="t")
  with pytest.raises(ValueError, match="sequence_parallel"):
    sharding.MeshResource(fsdp_resource="fsdp", sequence_parallel=True)
  with pytest.raises(ValueError, match="one role"):
    sharding.MeshResource(dp_resource="x", tp_resource="x")
  with pytest.raises(TypeError, match="tp_resource"):
    sharding.MeshResource(tp_resource=("a", "b"))
  with pytest.raises(TypeError, match="sequence_parallel"):
    sharding.MeshResource(tp_resource="t", sequence_parallel=1)


def test_default_rules():
  mr = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")
  rules = dict(sharding.logical_axis_rules(mr))
  assert rules["batch"] == ("dp", "fsdp")
  assert rules["embed"] == "fsdp"
  for name in ("mlp", "heads", "joined_kv", "vocab", "kv_heads"):
    assert rules[name] == "tp"
  assert rules["kv"] is None and rules["length"] is None
  sp = dict(sharding.logical_axis_rules(
      sharding.MeshResource(tp_resource="tp", sequence_parallel=True)))
  assert sp["length"] == "tp" and sp["batch"] is None and sp["embed"] is None


def test_user_rules_come_first():
  mr = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
  rules = sharding.logical_axis_rules(mr, extra_rules=[("mlp", None), ("vocab", "fsdp")])
  assert rules[0] == ("mlp", None)
  axes = sharding.logical_to_mesh_axes(("embed", "mlp"), rules)
  assert axes == (("fsdp",), ())
  with pytest.raises(ValueError, match="pair"):
    sharding.logical_axis_rules(mr, extra_rules=["mlp"])


def test_every_module_axis_name_has_a_default_rule():
  """Each logical axis name a te_jax.nnx module (same names as the Linen
  ones) gives its parameters has a default rule, so that Flax's
  ``nnx.get_partition_spec`` / ``nnx.eval_shape`` under a mesh and
  ``te_jax.sharding.logical_axis_rules(mr)`` map every dim: a name without
  a rule is taken for a mesh axis and fails. (The gated MLP's "act" dim had
  none.)"""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from te_jax import nnx as tnx  # pylint: disable=import-outside-toplevel
  rngs = nnx.Rngs(0)
  models = [tnx.Linear(64, 32, use_bias=True, rngs=rngs),
            tnx.LayerNormLinear(64, (3, 4, 16), use_bias=True, rngs=rngs),
            tnx.LayerNormMLP(64, 128, activations=("silu", "linear"), use_bias=True, rngs=rngs),
            tnx.MultiHeadAttention(4, 64, num_gqa_groups=2, use_bias=True, rngs=rngs),
            tnx.TransformerLayer(64, 128, 4, rngs=rngs)]
  names = set()
  for model in models:
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      names.update(n for n in var.get_metadata().get("out_sharding", ()) if n is not None)
  ruled = {name for name, _ in sharding.logical_axis_rules()}
  assert names and names <= ruled, sorted(names - ruled)


def test_logical_to_mesh_axes_flax_semantics():
  mr = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")
  rules = sharding.logical_axis_rules(mr)
  # An activation (batch, length, embed): batch takes fsdp, so embed stays unsharded.
  assert sharding.logical_to_mesh_axes(("batch", "length", "embed"), rules) == (
      ("dp", "fsdp"), (), ())
  # Flattened dims: sharded as their leading mapped names.
  assert sharding.logical_to_mesh_axes(("embed", ("heads", "kv")), rules) == (
      ("fsdp",), ("tp",))
  assert sharding.logical_to_mesh_axes((None, ("kv",)), rules) == ((), ())


def test_unnamed_and_size_one_mesh_axes_are_unused():
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  mr = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp",
                             sequence_parallel=True)
  rules = sharding.logical_axis_rules(mr)
  assert sharding.logical_to_mesh_axes(("embed", "mlp"), rules, mesh=mesh) == ((), ())
  assert sharding.batch_axes(mr, mesh) == ()
  assert sharding.tp_axis(mr, mesh) is None
  assert sharding.token_shards(mr, mesh) == 1
  assert sharding.activation_spec(mr, mesh, 3) == P(None, None, None)


def test_get_mesh_from_context():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  assert sharding.get_mesh(mesh) is mesh
  with jax.set_mesh(mesh):
    assert dict(sharding.get_mesh().shape) == {"data": 1}


def test_gemms_unsharded():
  """The one "would these GEMMs be sharded?" answer of the fused FP8 paths."""
  mr = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
  ones = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  # mesh_axis_size reads the shape only: an abstract mesh stands for 2 devices
  tp2 = jax.sharding.AbstractMesh((1, 2), ("fsdp", "tp"))
  assert sharding.gemms_unsharded(None, tp2)          # no mesh resource
  assert sharding.gemms_unsharded(mr, None)           # no mesh
  assert sharding.gemms_unsharded(mr, ones)           # every named axis of size 1
  assert not sharding.gemms_unsharded(mr, tp2)        # tp of size 2
  fsdp2 = jax.sharding.AbstractMesh((2, 1), ("fsdp", "tp"))
  assert not sharding.gemms_unsharded(mr, fsdp2)      # fsdp of size 2
  assert sharding.gemms_unsharded(sharding.MeshResource(tp_resource="tp"), fsdp2)
  # "dp" is named by the resource but not in the mesh: it counts as size 1
  with_dp = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")
  assert sharding.gemms_unsharded(with_dp, ones)
  assert not sharding.gemms_unsharded(with_dp, tp2)
  # an explicit-axes context mesh counts as sharded, even of size 1 and
  # without a mesh resource or a mesh given
  explicit = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(explicit):
    assert not sharding.gemms_unsharded(None, None)
    assert not sharding.gemms_unsharded(mr, ones)
  auto = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(auto):
    assert sharding.gemms_unsharded(None, None)


def test_unsharded_mesh_falls_back_to_plain_fp8_dense():
  import jax.numpy as jnp
  import te_jax
  from te_jax import dense, recipe
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  mr = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(1), (128, 256), jnp.float32) * 0.1
  r = recipe.Float8CurrentScaling()
  want = dense.fp8_dense(x, w, recipe=r)
  # The functional layer takes the mesh resource as an argument (it does not
  # read the autocast's): a mesh whose axes all have size 1 shards nothing.
  with jax.set_mesh(mesh), te_jax.fp8_autocast(True, r, mesh_resource=mr):
    got = dense.dense(x, w, recipe=r, kernel_axes=("embed", "mlp"), mesh_resource=mr)
    got_nd = dense.dense_general(x, w, recipe=r, kernel_axes=("embed", "mlp"),
                                 mesh_resource=mr)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_nd), np.asarray(want))


# ------------------------------------------------------- 8-device suite --

EIGHT_DEVICE_FILES = ("test_sharding_mesh.py", "test_explicit_sharding.py",
                      "test_nnx_checkpoint.py")

def _run_groups(groups, timeout=900):
  env = dict(os.environ)
  # Compiled to compile fast (tests/subprocess_flags.py): each test compares
  # a sharded program with the single-device one, both compiled with the
  # same flags.
  env["XLA_FLAGS"] = subprocess_xla_flags(devices=8)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  procs = []
  for expr in groups:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *(os.path.join(_HERE, f) for f in EIGHT_DEVICE_FILES), "-k", expr]
    procs.append(subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      p.kill()
      out, _ = p.communicate()
      out += "\n[timed out]"
    outs.append((p.returncode, out))
  return outs


@pytest.mark.skipif(len(jax.devices()) >= 8,
                    reason="this process has 8 devices: test_sharding_mesh.py runs directly")
def test_eight_device_suite():
  """Sharded == single device for every mesh, SP setting and recipe under
  auto axes, and a half of them under explicit axes; HLO checks;
  explicit-axes NNX training; sharded NNX checkpoints."""
  split = "transformer_layer or hlo or nnx_model"
  # (the one_device tests of those files run in this process already)
  outs = _run_groups([split, f"not ({split}) and not one_device"])
  failed = [out for rc, out in outs if rc != 0]
  assert not failed, "\n\n".join(out[-6000:] for out in failed)
