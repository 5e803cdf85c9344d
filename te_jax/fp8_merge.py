"""One FP8 state used several times in a step: its uses merge, never add.

JAX's autodiff SUMS the cotangents of a value used more than once, and the
delayed-scaling state's "cotangent" is its new state (``te_jax.fp8_state``):
a GEMM called twice in one step (a shared layer, tied weights, a block
applied twice, a scan that closes over the state) would get the sum of two
new states -- an amax entry the sum of the amaxes, a scale too large.

:func:`merge_uses` (re-exported by ``te_jax.fp8_state``) is what a module
calls once per read of a GEMM's state. Reads of one state value share one
conversion into an extended dtype whose cotangents merge instead of adding:
``amax_history`` by max, ``scale`` by counting the uses (0: none, a positive
scale: that one use's, -1: several). The backward of that conversion turns
the merged cotangent back into a float32 state: the old state (no use), the
one use's new state (bit for bit what it is without this), or, for several,
``mode.update_state`` of the old state with the largest of their amaxes --
one history entry per step. The stored state keeps its float32 layout.

Internal JAX APIs it relies on (present from jax 0.10.2, the floor, through
0.11): the extended-dtype protocol (``jax._src.dtypes.ExtendedDType`` and its
``_rules``: ``add``, ``zero``, ``tangent_dtype``, ``convert_from/to``,
``physical_element_aval``, ``global_sharded_result_handler``), eager arrays
of such a dtype (``jax._src.earray.EArray``, ``pxla.global_result_handlers``,
``ad_util.raw_jaxval_adders``), and a tracer's ``_trace`` with
``jax._src.core.set_current_trace``, to make the one conversion in the trace
a state belongs to.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_util
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes
from jax._src import earray
from jax._src.interpreters import pxla

__all__ = ["merge_uses", "shared_state"]


class _merging(jax.dtypes.extended):
  """Scalar type of the merging dtypes (for ``jnp.issubdtype``)."""


class _MergingRules:
  """How JAX stores, converts and accumulates a :class:`_MergingDType`
  (the ``_rules`` protocol of ``jax._src.dtypes.ExtendedDType``)."""

  @staticmethod
  def physical_element_aval(dtype):
    del dtype
    return jax.core.ShapedArray((), jnp.float32)

  @staticmethod
  def convert_from(dtype, other) -> bool:
    del dtype
    return other == jnp.float32

  @staticmethod
  def convert_to(other, dtype) -> bool:
    del dtype
    return other == jnp.float32

  @staticmethod
  def add(dtype, x, y):
    a = jax.lax.convert_element_type(x, jnp.float32)
    b = jax.lax.convert_element_type(y, jnp.float32)
    if dtype.merge == "max":
      out = jnp.maximum(a, b)
    else:   # "uses": 0 is no use, so a + 0 = a; two uses make -1
      out = jnp.where(a == 0, b, jnp.where(b == 0, a, jnp.float32(-1.0)))
    return jax.lax.convert_element_type(out, dtype)

  @staticmethod
  def zero(dtype):
    identity = -np.inf if dtype.merge == "max" else 0.0
    return jax.lax.convert_element_type(np.float32(identity), dtype)

  @staticmethod
  def tangent_dtype(dtype):
    return dtype

  @staticmethod
  def full(shape, fill_value, dtype):
    return jax.lax.convert_element_type(jax.lax.full(shape, fill_value, jnp.float32), dtype)

  @staticmethod
  def global_sharded_result_handler(aval, out_sharding, committed):
    # Eager jax.grad computes the primal op by op: an array of this dtype
    # then exists outside any trace, held as a float32 buffer.
    physical = pxla.global_result_handlers[jax.core.ShapedArray](
        jax_core.physical_aval(aval), out_sharding, committed)
    return physical.wrap(lambda buf: earray.EArray(aval, buf))


@dataclasses.dataclass(frozen=True)
class _MergingDType(jax_dtypes.ExtendedDType):
  """float32 whose autodiff accumulation is ``merge`` ("max" or "uses")."""

  merge: str
  type = _merging
  _rules = _MergingRules
  itemsize = 4

  @property
  def name(self) -> str:
    return f"fp8_state_{self.merge}"

  def __repr__(self) -> str:
    return self.name


_MERGE_OF_LEAF = {"amax_history": _MergingDType("max"), "scale": _MergingDType("uses")}
# Eager (un-jitted) backward passes add cotangents op by op; JAX has no adder
# for arrays of an extended dtype there.
ad_util.raw_jaxval_adders.setdefault(
    earray.EArray, lambda x, y: x.dtype._rules.add(x.dtype, x, y))


def _convert(state, to_merging: bool):
  """``state`` ({role: {"amax_history", "scale"}}) in the merging dtypes, or back."""
  return {role: {leaf: jax.lax.convert_element_type(
      v, _MERGE_OF_LEAF[leaf] if to_merging else jnp.float32) for leaf, v in t.items()}
          for role, t in state.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _share(state, mode):
  """``state`` in the merging dtypes; its cotangent comes back float32 (see above)."""
  del mode
  return _convert(state, True)


def _share_fwd(state, mode):
  del mode
  return _convert(state, True), state


def _share_bwd(mode, old, merged):
  merged = _convert(merged, False)
  new = {}
  for role, ct in merged.items():
    uses = ct["scale"]
    several = mode.update_state(old, {role: ct["amax_history"][0]})[role]
    new[role] = {k: jnp.where(uses == 0, old[role][k], jnp.where(uses > 0, ct[k], several[k]))
                 for k in ct}
  return (new,)


_share.defvjp(_share_fwd, _share_bwd)


@jax.custom_vjp
def _read(shared):
  """One use of a shared state: float32 forward, merging-dtype cotangent."""
  return _convert(shared, False)


def _read_fwd(shared):
  return _convert(shared, False), None


def _read_bwd(_, ct):
  return (_convert(ct, True),)


_read.defvjp(_read_fwd, _read_bwd)

# id(first leaf) -> (weak references to the state's leaves, its shared value);
# an entry lives as long as the arrays it was made for.
_SHARED: Dict[int, Any] = {}


def _check_layout(state) -> Dict[str, Dict[str, Any]]:
  """``state`` as plain dicts (a FrozenDict too); raises unless it is one
  GEMM's per-tensor state ``{role: {"amax_history": (H,), "scale": ()}}``."""
  if not isinstance(state, Mapping) or not all(
      isinstance(t, Mapping) and set(t) == set(_MERGE_OF_LEAF)
      and jnp.ndim(t["amax_history"]) == 1 and jnp.ndim(t["scale"]) == 0
      for t in state.values()):
    raise ValueError(
        "merge_uses takes the state of one FP8 GEMM, {role: {'amax_history': (H,), "
        f"'scale': ()}}, got {jax.tree.map(jnp.shape, state)}; a state stacked per layer "
        "is read per layer (inside the scan).")
  return {role: dict(t) for role, t in state.items()}


def merge_uses(state, mode):
  """The state one FP8 GEMM call reads, such that every use of it merges.

  Call it once per read of a GEMM's state (each call of the module), and
  pass the result to ``te_jax.dense`` & co. as ``fp8_state``. Reads of the
  same state value share one conversion into a dtype whose autodiff
  accumulation merges instead of adding, so a state used n times in one
  step gets back ONE update: its amax history gains one entry, the largest
  of the n amaxes (a use whose amax was not finite counts as 0, as one use
  records it), and its scale is the one that history gives. One use gives
  exactly the update it gives without this; a state no use reached comes
  back unchanged (or, where JAX drops its cotangent altogether, as zeros,
  which ``apply_fp8_updates`` reads as "keep").

  Reads share their conversion when they read the same array: in one
  function, and in scan, ``jax.checkpoint`` or ``cond`` bodies that close
  over it. A state passed *as an argument* into a lifted transform
  (``nn.remat``, ``jax.checkpoint(f)(state)``) is a new value there; to
  merge its uses across several such calls pass ``merge_uses``' input
  through :func:`shared_state` before them.

  Args:
    state: one GEMM's state (``init_dense_state``; a dict or FrozenDict), a
      :func:`shared_state`, or None.
    mode: the active ``te_jax.scaling.ScalingMode`` (its ``update_state``
      merges several uses).

  Returns:
    The state as float32 dicts (None stays None).
  """
  if state is None or not mode.uses_state:
    return state
  state = _check_layout(state)
  leaves = jax.tree.leaves(state)
  if any(_is_merging(leaf) for leaf in leaves):
    return _read(state)
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return state            # a constant: nothing is differentiated with respect to it
  return _read(_shared_value(state, mode, leaves))


def shared_state(state, mode):
  """``state`` in the merging dtypes, for passing into a lifted transform.

  ``jax.checkpoint(f)(shared_state(state, mode))`` called twice (``f``
  reading it with :func:`merge_uses`) merges the two calls' uses, which
  passing the float32 state would sum. The cotangent of ``state`` is
  float32, as for :func:`merge_uses`. Same arguments.
  """
  if state is None or not mode.uses_state:
    return state
  state = _check_layout(state)
  return _shared_value(state, mode, jax.tree.leaves(state))


def _shared_value(state, mode, leaves):
  """The one merging-dtype conversion of ``state`` (found by its leaves'
  identity), made in the trace its leaves belong to so that inner traces
  (scan, checkpoint bodies) that close over the state reuse it."""
  if any(_is_merging(leaf) for leaf in leaves):
    return state            # shared already
  key = id(leaves[0])
  hit = _SHARED.get(key)
  if hit is not None and all(ref() is leaf for ref, leaf in zip(hit[0], leaves)):
    return hit[1]
  traces = {id(t): t for t in (getattr(leaf, "_trace", None) for leaf in leaves)}
  if len(traces) == 1 and None not in traces.values():
    with jax_core.set_current_trace(next(iter(traces.values()))):
      shared = _share(state, mode)
  else:                     # leaves of several traces: convert in the current one
    shared = _share(state, mode)
  _SHARED[key] = ([weakref.ref(leaf, _forget(key)) for leaf in leaves], shared)
  return shared


def _forget(key: int):
  """A weakref callback that drops the entry ``key`` of :data:`_SHARED` once
  a leaf it was made for is gone (its trace has ended)."""
  def callback(ref):
    entry = _SHARED.get(key)
    if entry is not None and any(r is ref for r in entry[0]):
      del _SHARED[key]
  return callback


def _is_merging(leaf) -> bool:
  return isinstance(getattr(leaf, "dtype", None), _MergingDType)
