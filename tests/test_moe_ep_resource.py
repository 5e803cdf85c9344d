"""``MeshResource.ep_resource``: the expert axis of te_jax.sharding.

The experts of a mixture of experts are split over it (logical name
"expert"); every other layer treats it as a data axis: the batch is split
over (dp, ep, fsdp), in that order, and the token shards count it.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from te_jax import sharding
from te_jax.moe import parallel


MR = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp",
                           ep_resource="ep", sequence_parallel=True)


def test_rules_map_expert_to_ep_and_batch_over_dp_ep_fsdp():
  rules = dict(sharding.logical_axis_rules(MR))
  assert rules["expert"] == "ep"
  assert rules["batch"] == rules["activation_batch"] == ("dp", "ep", "fsdp")
  assert rules["embed"] == "fsdp" and rules["mlp"] == "tp"
  assert MR.axes == ("dp", "ep", "fsdp", "tp")
  # without an expert axis the rule maps to nothing (replicated)
  assert dict(sharding.logical_axis_rules(sharding.MeshResource()))["expert"] is None
  names = sharding.logical_to_mesh_axes(("expert", "embed", "act", "mlp"),
                                        rules=sharding.logical_axis_rules(MR))
  assert names == (("ep",), ("fsdp",), (), ("tp",))


def test_batch_axes_token_shards_and_activation_spec_count_the_expert_axis():
  mesh = jax.sharding.AbstractMesh((1, 2, 2, 2), ("dp", "ep", "fsdp", "tp"))
  assert sharding.batch_axes(MR, mesh) == ("ep", "fsdp")   # dp has size 1
  assert sharding.token_shards(MR, mesh) == 8              # ep x fsdp x tp (SP)
  assert sharding.activation_spec(MR, mesh, 3) == P(("ep", "fsdp"), "tp", None)


def test_ep_resource_is_checked():
  with pytest.raises(TypeError, match="ep_resource must be None or a mesh axis name"):
    sharding.MeshResource(ep_resource=("ep",))
  with pytest.raises(ValueError, match="one role only"):
    sharding.MeshResource(fsdp_resource="ep", ep_resource="ep")


def test_moe_ep_axis_argument_and_ep_resource_agree():
  """``moe_block(ep_axis=...)`` is the same as naming the axis in the resource;
  two different expert axes are an error."""
  mr = sharding.MeshResource(fsdp_resource="fsdp")
  assert parallel.with_ep_axis(mr, "ep") == sharding.MeshResource(fsdp_resource="fsdp",
                                                                  ep_resource="ep")
  with_ep = sharding.MeshResource(ep_resource="ep")
  assert parallel.with_ep_axis(with_ep, "ep") is with_ep
  assert parallel.with_ep_axis(with_ep, None) is with_ep
  with pytest.raises(ValueError, match="give one of them"):
    parallel.with_ep_axis(with_ep, "other")
  with pytest.raises(ValueError, match="another role"):
    parallel.with_ep_axis(mr, "fsdp")
