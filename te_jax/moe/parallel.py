"""Expert parallelism: experts sharded over a mesh axis, tokens moved by all-to-all.

The expert part of the MoE block (dispatch, experts, combine) runs per device
inside ``shard_map``; every buffer has a size fixed at trace time, so every
device runs the same collectives whatever the routing and its token count.

Layout on a mesh with an expert-parallel axis ``ep`` (P devices; the mesh
resource's ``ep_resource``, or ``moe_block``'s ``ep_axis``), data axes
(dp, fsdp), a tensor-parallel axis ``tp``:

* tokens (batch, seq, H) split over (dp, ep, fsdp) on batch, over tp on seq
  under sequence parallelism (SP); routed outside the ``shard_map``;
* ``wi`` (E, H, n_act, F) and ``wo`` (E, F, H): E over ep, H over fsdp, F over
  tp; the delayed-scaling histories of the expert weights over ep with them.

Per device:

1. SP: all-gather the tokens (and their routing) of the tp group: the tp
   ranks then hold the same tokens (Megatron's MoE with SP does the same).
2. Dispatch into P chunks of ``S`` rows, chunk p holding the rows for the
   experts of ep rank p, sorted by expert, each group padded to the token
   block. Dropless, ``S`` bounds every routing of this device's T*k
   assignments among E/P experts (``dispatch.segment_rows``); with a
   capacity, ``E/P * capacity``.
3. ``all_to_all`` of the per-expert row counts (P x E/P int32), then of the
   rows: chunk p goes to rank p. A device receives P chunks, one per sender.
4. Regroup: the received rows of each local expert, from every sender, are
   moved next to each other (a gather; groups stay padded to the block).
5. The experts' grouped FP8 GEMMs (``grouped_dense``): per-tensor amaxes
   max-reduced over the mesh (the scales one device would use), the expert
   weights quantized per device and all-gathered in FP8 over fsdp, their
   gradient reduce-scattered; the tp shards of F each make a partial output.
6. The inverse gather, ``all_to_all`` back, combine with the router weights;
   then tp: reduce-scatter over the tp group (SP) or sum (no SP).

Memory: dropless, a device receives P chunks of ``S`` rows, i.e. up to P
times its own assignments (what every routing may send it), and the
buffers are that size whatever the routing; capacity mode bounds them by
the capacity. ``jax.lax.ragged_all_to_all`` would move only the filled
rows, but XLA:CPU has no implementation of it (jax 0.10.2), so the tests
could not run it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax import grouped_dense as gd
from te_jax import sharded_dense
from te_jax import sharding as sharding_lib
from te_jax.moe import dispatch as dispatch_lib
from te_jax.moe import experts as experts_lib
from te_jax.moe.scopes import SCOPES

__all__ = ["ExpertPlan", "make_plan", "sharded_experts", "regroup",
           "dense_mesh_resource", "with_ep_axis"]


class ExpertPlan(NamedTuple):
  """Everything static about one sharded MoE expert block."""
  mesh: object
  ep_axis: Optional[str]
  ep_size: int
  tp_axis: Optional[str]
  sequence_parallel: bool
  fsdp_axes: Tuple[str, ...]
  batch_axes: Tuple[str, ...]   # the token (batch) dim: dp, ep, fsdp
  x_spec: P
  num_experts: int
  k: int
  block: int
  capacity_factor: Optional[float]
  activations: Tuple[str, ...]
  recipe: object
  store_act_input_in_fp8: bool = False   # the experts keep h in E4M3 (experts.activate)


def _names(axes) -> Tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _present(mesh, axes):
  return tuple(a for a in _names(axes) if sharding_lib.mesh_axis_size(mesh, a) > 1)


def _check_divides(what, size, axes, mesh):
  n = sharding_lib.mesh_axis_size(mesh, axes)
  if size % n:
    raise ValueError(f"te_jax MoE: {what} ({size}) must divide over the {n} devices of "
                     f"mesh axes {axes}.")
  return size // n


def with_ep_axis(mesh_resource: Optional[sharding_lib.MeshResource],
                 ep_axis: Optional[str]) -> Optional[sharding_lib.MeshResource]:
  """``mesh_resource`` with ``ep_axis`` as its ``ep_resource`` (the expert
  axis named apart from the resource, as ``moe_block(ep_axis=...)`` takes
  it); unchanged when ``ep_axis`` is None or already its ``ep_resource``.

  Raises:
    TypeError: ``ep_axis`` is not a name.
    ValueError: the resource names another expert axis, or gives
      ``ep_axis`` another role.
  """
  if ep_axis is None:
    return mesh_resource
  if not isinstance(ep_axis, str):
    raise TypeError(f"ep_axis must be a mesh axis name or None, got {ep_axis!r}.")
  mr = mesh_resource if mesh_resource is not None else sharding_lib.MeshResource()
  if mr.ep_resource == ep_axis:
    return mr
  if mr.ep_resource is not None:
    raise ValueError(f"ep_axis={ep_axis!r} but the mesh resource names the expert axis "
                     f"ep_resource={mr.ep_resource!r}; give one of them.")
  if ep_axis in mr.axes:
    raise ValueError(f"ep_axis {ep_axis!r} already serves another role in {mr}.")
  return dataclasses.replace(mr, ep_resource=ep_axis)


def dense_mesh_resource(mesh_resource: Optional[sharding_lib.MeshResource],
                        ep_axis: Optional[str]) -> Optional[sharding_lib.MeshResource]:
  """The mesh resource of the layers outside the experts (shared experts,
  attention, dense layers) on a mesh with an expert axis: the resource with
  its ``ep_resource`` set, which those layers treat as a data axis (the
  tokens are split over it, their weights replicated there;
  ``te_jax.sharding.batch_axes``)."""
  return with_ep_axis(mesh_resource, ep_axis)


def make_plan(x_shape, config, recipe, mesh_resource, ep_axis, mesh,
              store_act_input_in_fp8: bool = False) -> Optional[ExpertPlan]:
  """The sharding of the expert block, or None when nothing is sharded;
  ``store_act_input_in_fp8`` is carried to the experts (``experts.expert_mlp``)."""
  if mesh_resource is None and ep_axis is None:
    return None
  mr = with_ep_axis(mesh_resource, ep_axis)
  mesh = sharding_lib.get_mesh(mesh)
  if mesh is None or (ep_axis is None and sharded_dense.warn_if_unsharded(mr, mesh)):
    if ep_axis is not None:
      raise ValueError(f"ep_axis={ep_axis!r} needs a mesh (jax.set_mesh or mesh=).")
    return None
  if ep_axis is not None and ep_axis not in mesh.axis_names:
    # an axis asked for by name must exist (a MeshResource role the mesh
    # lacks is unused, as every other role)
    raise ValueError(f"ep_axis {ep_axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}.")
  ep = _present(mesh, mr.ep_resource)
  fsdp = _present(mesh, mr.fsdp_resource)
  tp = sharding_lib.tp_axis(mr, mesh)
  sp = bool(mr.sequence_parallel and tp)
  # the token dim as the layers around split it: (dp..., ep, fsdp...)
  batch = sharding_lib.batch_axes(mr, mesh)
  if not (batch or tp):
    return None
  if len(x_shape) not in (2, 3):
    raise ValueError(f"te_jax MoE on a mesh takes x as (tokens, H) or (batch, seq, H), "
                     f"got shape {tuple(x_shape)}.")
  seq = (tp,) if sp else ()
  if len(x_shape) == 2:
    _check_divides("the token count", x_shape[0], batch + seq, mesh)
    x_spec = P(_entry(batch + seq), None)
  else:
    _check_divides("the batch size", x_shape[0], batch, mesh)
    _check_divides("the sequence length", x_shape[1], seq, mesh)
    x_spec = P(_entry(batch), _entry(seq), None)
  e = config.num_experts
  _check_divides("num_experts", e, ep, mesh)
  return ExpertPlan(mesh, ep[0] if ep else None, sharding_lib.mesh_axis_size(mesh, ep),
                    tp, sp, fsdp, batch, x_spec, e, config.num_experts_per_token,
                    experts_lib.token_block(recipe), config.capacity_factor,
                    config.activations, recipe, store_act_input_in_fp8)


def regroup(recv_sizes: jax.Array, rows_per_chunk: int) -> Tuple[jax.Array, jax.Array]:
  """Where each received row goes so each local expert's rows are contiguous.

  Args:
    recv_sizes: (P, El) int32, the padded rows sender p sent for each local
      expert (its chunk holds them in expert order from its start).
    rows_per_chunk: S, the rows of one chunk.

  Returns:
    ``(dest, group_sizes)``: dest (P*S,) int32 the row in the regrouped
    buffer of each received row (P*S for a chunk's unused rows), groups
    ordered by expert then sender; group_sizes (El,) int32.
  """
  p, el = recv_sizes.shape
  ends = jnp.cumsum(recv_sizes, axis=1)
  src_start = ends - recv_sizes
  sizes = jnp.sum(recv_sizes, axis=0)
  dst_start = (jnp.cumsum(sizes) - sizes)[None, :] + (jnp.cumsum(recv_sizes, axis=0) -
                                                      recv_sizes)
  r = jnp.arange(rows_per_chunk, dtype=jnp.int32)
  expert = jax.vmap(lambda c: jnp.searchsorted(c, r, side="right"))(ends)   # (P, S)
  safe = jnp.minimum(expert, el - 1)
  dest = (jnp.take_along_axis(dst_start, safe, axis=1) + r[None, :] -
          jnp.take_along_axis(src_start, safe, axis=1))
  dest = jnp.where(expert < el, dest, p * rows_per_chunk)
  return dest.reshape(-1).astype(jnp.int32), sizes.astype(jnp.int32)


def _grouped_axes(plan: ExpertPlan):
  """GroupedAxes of the two expert GEMMs: (wi, wo)."""
  all_axes = tuple(plan.mesh.axis_names)
  kernel = plan.fsdp_axes + ((plan.tp_axis,) if plan.tp_axis else ())
  common = dict(token_axes=all_axes, kernel_axes=kernel)
  return (gd.GroupedAxes(k_gather_axes=plan.fsdp_axes, **common),
          gd.GroupedAxes(n_gather_axes=plan.fsdp_axes, **common))


def _body(plan: ExpertPlan, impl, x, ids, weights, wi, wo, states):
  h, k, e = x.shape[-1], plan.k, plan.num_experts
  x2, ids2, w2 = x.reshape(-1, h), ids.reshape(-1, k), weights.reshape(-1, k)
  if plan.sequence_parallel:   # the tp group's tokens, in chunk order
    gather = functools.partial(lax.all_gather, axis_name=plan.tp_axis, axis=0, tiled=True)
    x2, ids2, w2 = gather(x2), gather(ids2), gather(w2)
  a = x2.shape[0] * k
  p = plan.ep_size
  capacity = None
  if plan.capacity_factor is not None:
    capacity = dispatch_lib.capacity_rows(plan.capacity_factor, a, e, plan.block)
  s = dispatch_lib.segment_rows(a, e // p, plan.block, capacity)
  exchange = functools.partial(lax.all_to_all, axis_name=plan.ep_axis, split_axis=0,
                               concat_axis=0, tiled=True)
  with jax.named_scope(SCOPES["dispatch"]):
    d = dispatch_lib.plan(dispatch_lib.flat_assignments(ids2), num_experts=e,
                          block=plan.block, rows_per_segment=s, segments=p,
                          capacity=capacity)
    buf, sizes = dispatch_lib.dispatch_rows(x2, d, p * s), d.group_sizes
    if plan.ep_axis:
      recv_sizes = exchange(sizes.reshape(p, e // p))
      dest, sizes = regroup(recv_sizes, s)
      buf = dispatch_lib.place_rows(exchange(buf), jnp.arange(p * s, dtype=jnp.int32),
                                    dest, p * s)
  wi_axes, wo_axes = _grouped_axes(plan)
  with jax.named_scope(SCOPES["experts"]):
    out = experts_lib.expert_mlp(buf, sizes, wi, wo, activations=plan.activations,
                                 recipe=plan.recipe, fp8_state=states, impl=impl,
                                 wi_axes=wi_axes, wo_axes=wo_axes,
                                 store_act_input_in_fp8=plan.store_act_input_in_fp8)
  with jax.named_scope(SCOPES["combine"]):
    if plan.ep_axis:
      out = exchange(dispatch_lib.pick_rows(out, dest))
    y2 = dispatch_lib.combine_rows(out, d, w2)
    if plan.tp_axis:   # the tp ranks' partial sums over their slices of F
      y2 = (lax.psum_scatter(y2, plan.tp_axis, scatter_dimension=0, tiled=True)
            if plan.sequence_parallel else lax.psum(y2, plan.tp_axis))
  dropped = d.dropped
  if plan.batch_axes:
    dropped = lax.psum(dropped, _entry(plan.batch_axes))
  if plan.tp_axis:   # the tp ranks of a group counted the same tokens
    dropped = lax.pmax(dropped, plan.tp_axis)
  return y2.reshape(x.shape), dropped


def _state_specs(states, ep_axis):
  """Per-expert kernel histories shard with the experts; the rest is replicated."""
  def spec(path, _):
    on_kernel = any(getattr(k, "key", None) == "kernel" for k in path)
    return P(ep_axis) if on_kernel and ep_axis else P()
  return jax.tree_util.tree_map_with_path(spec, states)


def top_k_ids(plan: ExpertPlan, lead: Tuple[int, ...]):
  """``route``'s top-k selection on each device's own tokens: ``(select (T,
  E), k) -> (T, k)`` ids, the T tokens x's ``lead`` dims flattened."""
  spec = P(*plan.x_spec[:-1], None)

  def select_ids(select, k):
    per_device = jax.shard_map(lambda s: lax.top_k(s, k)[1], mesh=plan.mesh,
                               in_specs=spec, out_specs=spec)
    return per_device(select.reshape(lead + select.shape[-1:])).reshape(-1, k)
  return select_ids


def sharded_experts(x: jax.Array, routing, wi: jax.Array, wo: jax.Array, states, *,
                    plan: ExpertPlan, impl: str = "auto"):
  """Steps 1-6 of the module doc over ``plan.mesh``.

  Args:
    x: (tokens, H) or (batch, seq, H).
    routing: the ``router.Routing`` of x's tokens (flattened in x's order).
    wi: (E, H, n_act, F); wo: (E, F, H).
    states: ``{"wi": ..., "wo": ...}`` grouped-dense states, or None.
    plan: from :func:`make_plan`.
    impl: "auto" or "reference".

  Returns:
    ``(y, dropped)``: y like x; dropped the int32 count over every device.
  """
  lead = x.shape[:-1]
  ids = routing.expert_ids.reshape(lead + (plan.k,))
  weights = routing.weights.reshape(lead + (plan.k,))
  ep, tp = _entry(_names(plan.ep_axis)), plan.tp_axis
  fsdp = _entry(plan.fsdp_axes)
  for what, size, axes in (("the hidden size H", wi.shape[1], plan.fsdp_axes),
                           ("the expert width F", wi.shape[3], _names(tp))):
    _check_divides(what, size, axes, plan.mesh)
  wi_spec, wo_spec = P(ep, fsdp, None, tp), P(ep, tp, fsdp)
  # JAX differentiates through this shard_map with its mesh-axis type checks
  # on (unlike te_jax.sharded_dense, which has its own custom VJP around it):
  # with them, a replicated input's gradient (the delayed-scaling state that
  # comes back as one) is not summed over the devices, and the grouped
  # dense's gradients are reduced exactly over the axes their inputs are
  # replicated on.
  f_sharded = jax.shard_map(
      functools.partial(_body, plan, impl), mesh=plan.mesh,
      in_specs=(plan.x_spec, plan.x_spec, plan.x_spec, wi_spec, wo_spec,
                _state_specs(states, ep)),
      out_specs=(plan.x_spec, P()))
  return f_sharded(x, ids, weights, wi, wo, states)
