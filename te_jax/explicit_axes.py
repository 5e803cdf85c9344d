"""Meshes with ``Explicit`` axes: the helpers te_jax's GEMMs use under them.

Under a mesh with ``AxisType.Explicit`` axes (``jax.make_mesh`` makes them by
default; ``jax.set_mesh`` puts the mesh in effect) every array carries its
sharding in its type and every operation must give a result those types
allow: a reshape of a sharded dim, a product whose contracting dims are
sharded, a ``shard_map`` whose in_specs differ from its inputs' types all
raise. te_jax's GEMMs (the functional dense, the modules' GEMMs) run their
computation with those axes switched to ``Auto`` (:func:`with_auto_axes`):
inside, sharding is XLA's and ``te_jax.sharded_dense``'s exactly as under an
auto-axes mesh; the result comes out with an explicit sharding that the
caller names. (jax.sharding.auto_axes / reshard / get_abstract_mesh /
AxisType and jax.typeof: public from jax 0.7 on, unchanged since.)

This module knows nothing of ``te_jax.sharding.MeshResource``: it reads the
context's mesh and the arrays' types only (``te_jax.sharding`` builds on it).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax
from jax.sharding import PartitionSpec

__all__ = [
    "explicit_axes",
    "with_auto_axes",
    "gather_explicit",
    "reshard_like",
    "spec_of",
    "as_context_types",
]


def _context_mesh():
  """The context's abstract mesh, or None when there is none."""
  m = jax.sharding.get_abstract_mesh()
  return None if m is None or m.empty else m


def as_context_types(mesh):
  """``mesh``, or the context's abstract mesh when that one has the same
  axes and sizes under other axis types (inside :func:`with_auto_axes`)."""
  ctx = _context_mesh()
  own = getattr(mesh, "abstract_mesh", mesh)
  if ctx is None or own == ctx:
    return mesh
  if tuple(own.axis_names) == tuple(ctx.axis_names) and dict(own.shape) == dict(ctx.shape):
    return ctx
  return mesh


def explicit_axes() -> Tuple[str, ...]:
  """The names of the context mesh's ``Explicit`` axes (any size: an axis of
  size 1 is in the types too), in mesh order; () without a mesh, or under
  an auto-axes one."""
  m = _context_mesh()
  if m is None:
    return ()
  explicit = jax.sharding.AxisType.Explicit
  return tuple(n for n, t in zip(m.axis_names, m.axis_types) if t == explicit)


def spec_of(x) -> Tuple:
  """The partition spec of ``x``'s type, one entry per dim (None: unsharded)."""
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (len(jax.typeof(x).shape) - len(spec))


def _keep_axes(spec, axes) -> PartitionSpec:
  """``spec`` with every mesh axis not in ``axes`` taken out of it."""
  out = []
  for entry in spec:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(a for a in names if a is not None and a in axes)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*out)


def with_auto_axes(fn, args: Sequence, out_specs):
  """``fn(*args)`` with the context mesh's Explicit axes switched to Auto.

  Every array ``fn`` uses must come in through ``args`` (a value closed
  over would keep the explicit types, which JAX refuses to mix with the
  auto ones). The outputs come back with the shardings ``out_specs`` (a
  PartitionSpec per output, same tree as the outputs), restricted to the
  explicit axes. Without explicit axes in the context, ``fn(*args)``.
  """
  axes = explicit_axes()
  if not axes:
    return fn(*args)
  out_specs = jax.tree.map(lambda p: _keep_axes(p, axes), out_specs,
                           is_leaf=lambda p: isinstance(p, PartitionSpec))
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_specs)(*args)


def gather_explicit(x):
  """``x`` replicated over the context's Explicit axes (an all-gather of a
  parameter sharded over them, as FSDP does before using it); ``x`` itself
  when it is None, already replicated there, or no axis is explicit."""
  if x is None or not explicit_axes():
    return x
  if all(entry is None for entry in spec_of(x)):
    return x
  return jax.sharding.reshard(x, PartitionSpec())


def reshard_like(x, like):
  """``x`` with the sharding of ``like``'s leading ``x.ndim`` dims, under the
  context's Explicit axes (e.g. (B, S) segment ids sequence-sharded between
  blocks, given the layout of the (B, S, heads, head_dim) queries they
  mask); ``x`` itself when it is None, already so, or no axis is explicit."""
  if x is None or not explicit_axes():
    return x
  want = spec_of(like)[:len(jax.typeof(x).shape)]
  if spec_of(x) == want:
    return x
  return jax.sharding.reshard(x, PartitionSpec(*want))
