"""Mesh resources and logical axis rules.

A :class:`MeshResource` names which axes of a ``jax.sharding.Mesh`` play
which role: data parallelism (``dp_resource``), fully sharded data
parallelism (``fsdp_resource``), tensor parallelism (``tp_resource``) and
expert parallelism (``ep_resource``, the experts of ``te_jax.moe``);
``sequence_parallel=True`` additionally shards the token (sequence) dimension
of the activations between blocks over the tensor-parallel axis. Roles left
as None, and names the mesh does not have (or of size 1), are simply unused.

The te_jax modules (Linen and NNX) name the dims of their parameters with logical axis
names (``"embed"``, ``"mlp"``, ``"heads"``, ``"kv"``, ``"joined_kv"``, ...);
:func:`logical_axis_rules` maps those names to mesh axes, MaxText/Flax style.
User rules come first and therefore win:

  >>> import jax
  >>> import flax.linen as nn
  >>> import te_jax
  >>> from te_jax import recipe, sharding
  >>> mr = sharding.MeshResource(fsdp_resource="fsdp", tp_resource="tp")
  >>> sharding.logical_to_mesh_axes(("embed", "mlp"), rules=sharding.logical_axis_rules(mr))
  (('fsdp',), ('tp',))
  >>> rules = sharding.logical_axis_rules(mr, extra_rules=[("embed", None), ("vocab", "fsdp")])
  >>> sharding.logical_to_mesh_axes(("embed", "mlp", "vocab"), rules=rules)
  ((), ('tp',), ('fsdp',))

A model then runs under the mesh, the rules and the autocast together (a
1 x 1 mesh here; the modules look the rules up themselves):

  >>> mesh = jax.make_mesh((1, 1), ("fsdp", "tp"))
  >>> with (jax.set_mesh(mesh), nn.logical_axis_rules(rules),
  ...       te_jax.fp8_autocast(True, recipe.Float8BlockScaling(), mesh_resource=mr)):
  ...   sharding.logical_to_mesh_axes(("embed", "mlp"))  # the rules in effect
  ((), ('tp',))

Under ``fp8_autocast(..., mesh_resource=mr)`` the FP8 GEMMs of
``te_jax.dense`` run as a ``shard_map`` over the active mesh (see
``te_jax.distributed``): weights are quantized while still sharded and
all-gathered in FP8, amaxes are max-reduced over the mesh, gradients are
reduce-scattered.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Iterator, Optional, Sequence, Tuple, Union

import jax
from jax.sharding import PartitionSpec

from te_jax import explicit_axes as explicit_lib

__all__ = [
    "MeshResource",
    "logical_axis_rules",
    "logical_to_mesh_axes",
    "use_axis_rules",
    "get_mesh",
    "mesh_axis_size",
    "batch_axes",
    "tp_axis",
    "token_shards",
    "activation_spec",
    "gemms_unsharded",
]

AxisNames = Union[None, str, Tuple[str, ...]]


def _as_tuple(axes) -> Tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(a for a in axes if a is not None)


@dataclasses.dataclass(frozen=True)
class MeshResource:
  """Which mesh axes serve which kind of parallelism.

  Attributes:
    dp_resource: mesh axis (or tuple of axes) of pure data parallelism: the
      batch is split over it, parameters are replicated.
    fsdp_resource: mesh axis (or tuple) of fully sharded data parallelism:
      the batch is split over it *and* parameters are sharded over it (their
      ``"embed"`` dim by default); FP8 GEMMs all-gather the weight in FP8 and
      reduce-scatter its gradient.
    tp_resource: mesh axis of tensor parallelism (Megatron column- then
      row-parallel GEMMs in the MLP and attention).
    ep_resource: mesh axis of expert parallelism: the experts of a mixture
      of experts (``te_jax.moe``; logical name ``"expert"``) are split over
      it and tokens move to their experts by all-to-all. Every other layer
      sees it as a data axis: the batch is split over it (between dp and
      fsdp), their parameters are replicated over it.
    sequence_parallel: shard the token dim of activations between blocks over
      ``tp_resource`` (gathered before the column-parallel GEMM, reduce-scattered
      after the row-parallel one). Needs ``tp_resource``.
    pad_tokens: if True, sharded FP8 GEMMs zero-pad each device's token count
      to the recipe's ``token_block`` instead of raising. Padding once in the
      input pipeline (``te_jax.packing.pad_batch``) is cheaper.
  """

  dp_resource: AxisNames = None
  fsdp_resource: AxisNames = None
  tp_resource: Optional[str] = None
  sequence_parallel: bool = False
  pad_tokens: bool = False
  ep_resource: Optional[str] = None

  def __post_init__(self):
    for name in ("dp_resource", "fsdp_resource"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, str) and not (
          isinstance(v, tuple) and all(isinstance(a, str) for a in v)):
        raise TypeError(f"{name} must be None, a mesh axis name or a tuple of "
                        f"names, got {v!r}.")
    for name in ("tp_resource", "ep_resource"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, str):
        raise TypeError(f"{name} must be None or a mesh axis name, got {v!r}.")
    for name in ("sequence_parallel", "pad_tokens"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
    if self.sequence_parallel and self.tp_resource is None:
      raise ValueError("sequence_parallel=True needs a tp_resource (the sequence "
                       "is sharded over the tensor-parallel axis).")
    used = self.axes
    if len(set(used)) != len(used):
      raise ValueError(f"a mesh axis may serve one role only, got {self}.")

  @property
  def axes(self) -> Tuple[str, ...]:
    """Every mesh axis name this resource uses, in role order (dp, ep, fsdp, tp)."""
    return (_as_tuple(self.dp_resource) + _as_tuple(self.ep_resource) +
            _as_tuple(self.fsdp_resource) + _as_tuple(self.tp_resource))


# --------------------------------------------------------------- rules ------

def logical_axis_rules(mesh_resource: Optional[MeshResource] = None,
                       extra_rules: Sequence[Tuple[str, AxisNames]] = ()
                       ) -> Tuple[Tuple[str, AxisNames], ...]:
  """Flax-style ``(logical_name, mesh_axes)`` rules for the te_jax modules.

  ``extra_rules`` come first, so a user's rule for a name overrides the
  default one. Names left to None (no rule) are replicated. Defaults:

  ============================  ===============================
  logical name                  mesh axes
  ============================  ===============================
  batch, activation_batch       (dp..., ep, fsdp...)
  embed                         fsdp (parameters only)
  expert                        ep
  mlp, heads, kv_heads,         tp
  joined_kv, vocab
  length, activation_length,    tp when ``sequence_parallel``
  seq                           else None
  kv, qkv, norm, act            None
  ============================  ===============================

  (An activation's ``embed`` dim stays unsharded because Flax gives each
  mesh axis to the first logical dim of a spec that asks for it, and
  ``batch`` comes first.)
  """
  mr = mesh_resource if mesh_resource is not None else MeshResource()
  batch = _data_axes(mr)
  fsdp = _as_tuple(mr.fsdp_resource)
  tp = mr.tp_resource
  seq = tp if mr.sequence_parallel else None

  def one(axes):
    axes = _as_tuple(axes)
    if not axes:
      return None
    return axes[0] if len(axes) == 1 else axes

  defaults = (
      ("batch", one(batch)),
      ("activation_batch", one(batch)),
      ("embed", one(fsdp)),
      ("expert", mr.ep_resource),
      ("mlp", tp),
      ("heads", tp),
      ("kv_heads", tp),
      ("joined_kv", tp),
      ("vocab", tp),
      ("length", seq),
      ("activation_length", seq),
      ("seq", seq),
      ("kv", None),
      ("qkv", None),
      # Grouped-query attention's joined query/key/value head dim
      # (te_jax.layers.attention.fused_qkv_layout): no contiguous split of it
      # gives a device its own heads.
      ("qkv_heads", None),
      ("norm", None),
      ("act", None),
  )
  for rule in extra_rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"each rule must be a (logical_name, mesh_axes) pair, got {rule!r}.")
  return tuple((n, a) for n, a in extra_rules) + defaults


# The rules a te_jax module put in effect around its GEMMs (use_axis_rules).
_MODULE_RULES = contextvars.ContextVar("te_jax_axis_rules", default=None)


@contextlib.contextmanager
def use_axis_rules(rules: Sequence[Tuple[str, AxisNames]]) -> Iterator[None]:
  """Makes ``rules`` the logical axis rules of the te_jax GEMMs run inside.

  The module layer (``te_jax.layers``) wraps its calls into the functional
  layer in it, with the rules its framework reads: Flax's
  ``nn.logical_axis_rules`` for the Linen modules, ``nnx.logical_axis_rules``
  for the NNX ones, or the defaults of :func:`logical_axis_rules`.
  """
  token = _MODULE_RULES.set(tuple(rules))
  try:
    yield
  finally:
    _MODULE_RULES.reset(token)


def _flax_context_rules():
  """Flax's logical axis rules context (set by ``nn.logical_axis_rules`` and
  ``nnx.logical_axis_rules`` alike), for a functional-layer call made outside
  any te_jax module; () where flax is not installed."""
  try:
    from flax.core import spmd  # pylint: disable=import-outside-toplevel
  except ImportError:
    return ()
  return tuple(spmd.get_logical_axis_rules())


def _active_rules(mesh_resource):
  """The rules of :func:`use_axis_rules`, else Flax's context, else the defaults."""
  rules = _MODULE_RULES.get()
  if rules is None:
    rules = _flax_context_rules()
  return rules if rules else logical_axis_rules(mesh_resource)


def logical_to_mesh_axes(names: Sequence[Union[None, str, Sequence[Optional[str]]]],
                         rules=None, mesh_resource: Optional[MeshResource] = None,
                         mesh=None) -> Tuple[Tuple[str, ...], ...]:
  """Maps the logical names of each dim to a tuple of mesh axes.

  Follows Flax: a dim takes the first rule for its name whose mesh axes are
  all still unused in this spec. An entry of ``names`` may itself be a tuple
  of names (the dims of a flattened view, major first): the flattened dim is
  sharded over the axes of its leading mapped names (put the sharded dims
  first, as ``te_jax.dense.dense_general`` does; unmapped names before them
  are assumed to be of size 1).

  Mesh axes absent from ``mesh`` (when given) or of size 1 are dropped.

  Args:
    names: one entry per dim: None, a logical name, or a tuple of them.
    rules: ``(name, mesh_axes)`` pairs; default: those of an enclosing
      :func:`use_axis_rules` (a te_jax module's GEMMs), else of Flax's
      ``nn.logical_axis_rules`` / ``nnx.logical_axis_rules`` context, else
      ``logical_axis_rules(mesh_resource)``.
    mesh_resource: used for the default rules.
    mesh: optional mesh to drop unknown/size-1 axes.

  Returns:
    One tuple of mesh axis names per dim (empty = replicated).
  """
  if rules is None:
    rules = _active_rules(mesh_resource)
  used = set()
  out = []
  for entry in names:
    group = (entry,) if entry is None or isinstance(entry, str) else tuple(entry)
    axes: Tuple[str, ...] = ()
    for name in group:
      found: Tuple[str, ...] = ()
      if name is not None:
        for rule_name, rule_axes in rules:
          if rule_name != name:
            continue
          cand = _as_tuple(rule_axes)
          if mesh is not None:
            cand = tuple(a for a in cand if mesh_axis_size(mesh, a) > 1)
          if any(a in used or a in axes for a in cand):
            continue
          found = cand
          break
      if found:
        axes += found
      elif axes:   # the sharded dims of a flattened group must lead it
        break
    used.update(axes)
    out.append(axes)
  return tuple(out)


# ---------------------------------------------------------------- mesh ------

def get_mesh(mesh=None):
  """The mesh to shard over: ``mesh``, else ``jax.set_mesh``'s, else ``with mesh:``'s.

  Inside a region whose axis types differ from the mesh's own (te_jax's
  GEMMs under an explicit-axes mesh run in one,
  ``te_jax.explicit_axes.with_auto_axes``) the context's abstract mesh is
  returned instead: same axes and sizes, the axis types a ``shard_map``
  there must be given. Returns None when there is no mesh (or it has no
  axes).
  """
  if mesh is not None:
    return explicit_lib.as_context_types(mesh)
  try:
    m = jax.sharding.get_mesh()
    if m is not None and not m.empty:
      return explicit_lib.as_context_types(m)
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
    m = mesh_lib.thread_resources.env.physical_mesh
    if m is not None and not m.empty:
      return explicit_lib.as_context_types(m)
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    m = jax.sharding.get_abstract_mesh()
    if m is not None and not m.empty:
      return m
  except Exception:  # pylint: disable=broad-except
    pass
  return None


def mesh_axis_size(mesh, axes) -> int:
  """Product of the sizes of ``axes`` in ``mesh``; 1 for names it lacks."""
  shape = dict(mesh.shape)
  return math.prod(shape.get(a, 1) for a in _as_tuple(axes))


def gemms_unsharded(mesh_resource: Optional[MeshResource], mesh) -> bool:
  """Whether te_jax's GEMMs would run unsharded: the question the fused FP8
  paths (MLP core, norm + quantize, split Q/K/V, the MoE block's shared
  experts), which have no sharding rule of their own, ask before they are
  taken.

  False under a context mesh with ``Explicit`` axes, of any size: their axes
  are in every array's type, and the fused paths reshape operands whose types
  carry them, which JAX refuses (the GEMMs run through ``te_jax.dense``'s
  auto-axes boundary instead). Otherwise True without ``mesh_resource`` or
  without ``mesh``, else when every axis ``mesh_resource`` names has size 1 in
  ``mesh`` (a name the mesh lacks counts as size 1).
  """
  if explicit_lib.explicit_axes():
    return False
  if mesh_resource is None or mesh is None:
    return True
  return mesh_axis_size(mesh, mesh_resource.axes) == 1


def _present(mesh, axes) -> Tuple[str, ...]:
  return tuple(a for a in _as_tuple(axes) if mesh_axis_size(mesh, a) > 1)


def _data_axes(mesh_resource: MeshResource) -> Tuple[str, ...]:
  """The axes the batch is split over, in order: (dp..., ep, fsdp...)."""
  return (_as_tuple(mesh_resource.dp_resource) + _as_tuple(mesh_resource.ep_resource) +
          _as_tuple(mesh_resource.fsdp_resource))


def batch_axes(mesh_resource: MeshResource, mesh) -> Tuple[str, ...]:
  """Mesh axes the batch (token) dim is split over, dp first: (dp..., ep, fsdp...)."""
  return _present(mesh, _data_axes(mesh_resource))


def tp_axis(mesh_resource: MeshResource, mesh) -> Optional[str]:
  """The tensor-parallel axis if the mesh has it with size > 1, else None."""
  axes = _present(mesh, mesh_resource.tp_resource)
  return axes[0] if axes else None


def token_shards(mesh_resource: MeshResource, mesh) -> int:
  """Devices one token dim is split over between blocks (batch x tp under SP).

  Pass it as ``num_shards`` to ``te_jax.packing.pad_batch`` /
  ``padded_token_count`` so each device's share is FP8-aligned.
  """
  n = mesh_axis_size(mesh, batch_axes(mesh_resource, mesh))
  if mesh_resource.sequence_parallel:
    n *= mesh_axis_size(mesh, tp_axis(mesh_resource, mesh))
  return n


def activation_spec(mesh_resource: MeshResource, mesh, ndim: int,
                    sequence_sharded: Optional[bool] = None) -> PartitionSpec:
  """PartitionSpec of a (batch, seq, ..., hidden) activation between blocks.

  Batch over (dp, ep, fsdp); seq over tp when sequence parallel (for a 2-D
  (tokens, hidden) activation the tp axis joins the token dim, minor-most).
  """
  b = batch_axes(mesh_resource, mesh)
  tp = tp_axis(mesh_resource, mesh)
  sp = mesh_resource.sequence_parallel if sequence_sharded is None else sequence_sharded
  sp_axes = (tp,) if (sp and tp) else ()
  if ndim < 2:
    raise ValueError(f"an activation needs at least 2 dims, got {ndim}.")
  if ndim == 2:
    tok = b + sp_axes
    return PartitionSpec(tok or None, None)
  dims = [b or None, sp_axes or None] + [None] * (ndim - 2)
  return PartitionSpec(*dims)
