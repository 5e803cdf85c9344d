"""fp8_autocast checks its arguments on entry, not later inside a layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import te_jax
from te_jax import dense, recipe, sharding


@pytest.mark.parametrize("bad", ["fsdp", {"fsdp_resource": "fsdp"}, ("dp", "fsdp"), 1,
                                 Mesh(np.array(jax.devices()[:1]), ("fsdp",))],
                         ids=["str", "dict", "tuple", "int", "mesh"])
def test_mesh_resource_of_the_wrong_type_raises_on_entry(bad):
  with pytest.raises(TypeError) as info:
    with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling(), mesh_resource=bad):
      pytest.fail("the body must not run")
  msg = str(info.value)
  assert "mesh_resource" in msg                      # names the argument,
  assert type(bad).__name__ in msg                    # what it got,
  assert 'MeshResource(fsdp_resource="fsdp")' in msg  # and the fix.


def test_dict_of_mesh_resource_fields_suggests_unpacking_it():
  with pytest.raises(TypeError, match=r"MeshResource\(\*\*mesh_resource\)"):
    with te_jax.fp8_autocast(mesh_resource={"fsdp_resource": "fsdp", "tp_resource": "tp"}):
      pass


def test_none_and_mesh_resource_are_accepted():
  mr = sharding.MeshResource(fsdp_resource="fsdp")
  with te_jax.fp8_autocast(True, mesh_resource=mr) as ctx:
    assert ctx.mesh_resource is mr
    assert te_jax.get_fp8_context().mesh_resource is mr
  with te_jax.fp8_autocast(True, mesh_resource=None) as ctx:
    assert ctx.mesh_resource is None


def test_context_is_restored_after_a_rejected_entry():
  before = te_jax.get_fp8_context()
  with pytest.raises(TypeError):
    with te_jax.fp8_autocast(True, mesh_resource="fsdp"):
      pass
  assert te_jax.get_fp8_context() is before


def test_valid_mesh_resource_still_runs_a_gemm():
  """A MeshResource on a one-device mesh: the dense call runs as without one."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  mr = sharding.MeshResource(fsdp_resource="fsdp")
  r = recipe.Float8CurrentScaling()
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 128), jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(1), (128, 128), jnp.float32) * 0.1
  want = dense.fp8_dense(x, w, recipe=r)
  with jax.set_mesh(mesh), te_jax.fp8_autocast(True, r, mesh_resource=mr):
    got = dense.dense(x, w, recipe=r, kernel_axes=("embed", "mlp"))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
