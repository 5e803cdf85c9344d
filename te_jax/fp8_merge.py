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

A call that holds the state but does not use it (FP8 off, another recipe)
ties it to its output with :func:`tie_unused`, as a use that contributes
nothing: alone, the state comes back as it was (its own "gradient", which
``TrainState.apply_gradients`` writes back unchanged); beside a use of the
same step, that use's update (tied separately, the two would add up).

Internal JAX APIs it relies on (present from jax 0.10.2, the floor, through
0.11): the extended-dtype protocol (``jax._src.dtypes.ExtendedDType`` and its
``_rules``: ``add``, ``zero``, ``tangent_dtype``, ``convert_from/to``,
``physical_element_aval``, ``global_sharded_result_handler``), eager arrays
of such a dtype (``jax._src.earray.EArray``, ``pxla.global_result_handlers``,
``ad_util.raw_jaxval_adders``), and a tracer's ``_trace`` with
``jax._src.core.set_current_trace``, to make the one conversion in the trace
a state belongs to; a trace's ``parent_trace`` and ``frame.debug_info`` to
find the ``jax.checkpoint`` bodies around a read (:func:`checkpoint_bodies`).
"""

from __future__ import annotations

import dataclasses
import math
import functools
import weakref
from collections.abc import Mapping
from typing import Any, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import ad_util
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes
from jax._src import earray
from jax._src.interpreters import pxla

__all__ = ["merge_uses", "shared_state", "tie_unused", "share_tree", "unshare_tree",
           "checkpoint_bodies"]


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


class _ModeOfUses:
  """The scaling mode the uses of one shared state run under.

  Each read (:func:`merge_uses`, :func:`shared_state`) notes its mode here;
  the backward pass of several uses, traced after every forward read, needs
  it to compute the one update. A conversion made by a call that keeps the
  state unused (:func:`tie_unused`: FP8 off, another recipe) has no mode
  until a use notes one; with no use, none is needed.
  """

  __slots__ = ("mode",)

  def __init__(self):
    self.mode = None

  def note(self, mode) -> None:
    if self.mode is not None and self.mode != mode:
      raise ValueError(
          "One FP8 state is read under two delayed-scaling recipes in one step "
          f"({self.mode.recipe} and {mode.recipe}): its uses cannot merge into one "
          "update. Run every call of the module under one fp8_autocast recipe.")
    self.mode = mode


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _share(state, uses_mode):
  """``state`` in the merging dtypes; its cotangent comes back float32 (see above)."""
  del uses_mode
  return _convert(state, True)


def _share_fwd(state, uses_mode):
  del uses_mode
  return _convert(state, True), state


def _share_bwd(uses_mode, old, merged):
  merged = _convert(merged, False)
  new = {}
  for role, ct in merged.items():
    uses = ct["scale"]
    if uses_mode.mode is None:   # no read noted a mode: no use, or one (its own update)
      several = old[role]
    else:
      several = _update_rows(uses_mode.mode, role, old[role], ct["amax_history"][..., 0])
    new[role] = {}
    for k in ct:
      # One count per history row (per expert of a grouped state, per layer of
      # a stacked one): shaped to broadcast against this leaf.
      u = uses if k == "scale" else uses.reshape(ct[k].shape[:-1] + (1,))
      new[role][k] = jnp.where(u == 0, old[role][k], jnp.where(u > 0, ct[k], several[k]))
  return (new,)


def _update_rows(mode, role, old, amax):
  """``mode.update_state`` of one role's state with one amax per history row:
  a GEMM's state (history (H,), scale ()) or one with leading dims (a
  grouped GEMM's per-expert kernel state, history (E, H) and scale (E,) or
  (E, 1)), each row on its own."""
  hist, scale = old["amax_history"], old["scale"]
  lead = hist.shape[:-1]
  if not lead:
    return mode.update_state({role: old}, {role: amax})[role]
  n = math.prod(lead)
  one = lambda h, s, a: mode.update_state(
      {role: {"amax_history": h, "scale": s}}, {role: a})[role]
  out = jax.vmap(one)(hist.reshape(n, hist.shape[-1]), scale.reshape(n), amax.reshape(n))
  return {"amax_history": out["amax_history"].reshape(hist.shape),
          "scale": out["scale"].reshape(scale.shape)}


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


def _identity_like(shared):
  """The merge identity ("no use") in the merging dtypes, shaped like ``shared``."""
  return {role: {leaf: jax.lax.convert_element_type(
      jnp.full(v.shape, -np.inf if leaf == "amax_history" else 0.0, jnp.float32),
      _MERGE_OF_LEAF[leaf]) for leaf, v in t.items()} for role, t in shared.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tie(y, state, merging: bool):
  """``y``; the state's cotangent is "no use" (``merging``: ``state`` is a
  shared value) or the state itself (a float32 state tied alone)."""
  del state, merging
  return y


def _tie_fwd(y, state, merging):
  del merging
  return y, state


def _tie_bwd(merging, state, g):
  return g, _identity_like(state) if merging else state


_tie.defvjp(_tie_fwd, _tie_bwd)

# id(first leaf) -> (weak references to the state's leaves, its shared value,
# the _ModeOfUses of its reads); an entry lives as long as the arrays it was
# made for.
_SHARED: Dict[int, Any] = {}


def _check_layout(state) -> Dict[str, Dict[str, Any]]:
  """``state`` as plain dicts (a FrozenDict too); raises unless it is one
  GEMM's per-tensor state ``{role: {"amax_history": (..., H), "scale": (...)
  or (..., 1)}}``: one history per scale (leading dims: the experts of a
  grouped GEMM's kernel, each with its own history)."""
  if not _is_gemm_state(state):
    raise ValueError(
        "merge_uses takes the state of one FP8 GEMM, {role: {'amax_history': (..., H), "
        f"'scale': (...) or (..., 1)}}, got {jax.tree.map(jnp.shape, state)}.")
  return {role: dict(t) for role, t in state.items()}


def _is_gemm_state(state) -> bool:
  def one(t):
    if not (isinstance(t, Mapping) and set(t) == set(_MERGE_OF_LEAF)
            and jnp.ndim(t["amax_history"]) >= 1):
      return False
    lead = tuple(jnp.shape(t["amax_history"]))[:-1]
    return tuple(jnp.shape(t["scale"])) in (lead, lead + (1,))
  return isinstance(state, Mapping) and all(one(t) for t in state.values())


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

  Raises:
    ValueError: ``state`` is not one GEMM's state, or the same state is read
      under two different delayed-scaling recipes in one step.
  """
  if state is None or not mode.uses_state:
    return state
  state = _check_layout(state)
  leaves = jax.tree.leaves(state)
  if any(_is_merging(leaf) for leaf in leaves):
    return _read(state)
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return state            # a constant: nothing is differentiated with respect to it
  return _read(_shared_value(state, leaves, mode))


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
  return _shared_value(state, jax.tree.leaves(state), mode)


def tie_unused(y, state):
  """``y`` (any pytree of arrays), tied to an FP8 state that its call does
  not use (FP8 off, another recipe), so that the state's "gradient" is the
  state itself and ``TrainState.apply_gradients`` leaves it as it is.

  One GEMM's state (the layout :func:`merge_uses` takes) is tied through
  its shared conversion as a use that contributes nothing: a call that
  keeps it and a call that uses it in the same step give that use's update
  (tied separately, the two "gradients" would add: old state + new state).
  Any other state (an old layout, a stack) is returned as its own gradient.
  """
  if state is None:
    return y
  leaves = jax.tree.leaves(state)
  if not _is_gemm_state(state) or not any(
      isinstance(leaf, jax.core.Tracer) or _is_merging(leaf) for leaf in leaves):
    return _tie(y, state, False)
  state = _check_layout(state)
  shared = state if any(_is_merging(leaf) for leaf in leaves) else _shared_value(state, leaves)
  return _tie(y, shared, True)


def share_tree(tree, mode=None):
  """``tree`` (nested mappings: an FP8 collection, a module's part of it)
  with every one-GEMM state that is being traced converted once into the
  merging dtype (:func:`shared_state`), as plain dicts; any other node (a
  stack of per-layer states, a constant) as it is. For handing a whole
  collection to a lifted transform called several times
  (``te_jax.flax.share_fp8_state``). ``mode``: the active
  ``ScalingMode`` or None; a state that only calls keeping it unused read
  (FP8 off, another recipe) is shared too, so that it comes back unchanged
  rather than once per call."""
  if not isinstance(tree, Mapping):
    return tree
  if _is_gemm_state(tree):
    leaves = jax.tree.leaves(tree)
    if any(_is_merging(leaf) for leaf in leaves) or not any(
        isinstance(leaf, jax.core.Tracer) for leaf in leaves):
      return tree
    uses = mode if mode is not None and mode.uses_state else None
    return _shared_value(_check_layout(tree), leaves, uses)
  return {k: share_tree(v, mode) for k, v in tree.items()}


def unshare_tree(tree):
  """:func:`share_tree` undone: every merging-dtype state in ``tree`` read
  back as float32 (differentiable, as one use)."""
  if not isinstance(tree, Mapping):
    return tree
  if _is_gemm_state(tree) and any(_is_merging(leaf) for leaf in jax.tree.leaves(tree)):
    return _read(_check_layout(tree))
  return {k: unshare_tree(v) for k, v in tree.items()}


# A jax.checkpoint body's trace says so (``nn.remat`` and ``nnx.remat`` are
# jax.checkpoint); the traces that differentiate a step are these.
_CHECKPOINT_BODY = "checkpoint / remat"
_DIFFERENTIATING = ("JVPTrace", "LinearizeTrace")


def checkpoint_bodies(state) -> List[Tuple[Any, Any]]:
  """``[(outer trace, body trace)]`` of the ``jax.checkpoint`` bodies
  (``nn.remat``, ``nnx.remat``) around this read of a float32 ``state``,
  innermost first, each one called from a step that differentiates it.

  A state handed to such a body as an argument is a new value in there:
  the body's reads merge, but several calls of the body on one state add
  their updates in the outer trace, where no te_jax code runs. Empty for a
  shared (merging-dtype) state, a constant, and outside any body. Read from
  the trace's ``parent_trace`` and its ``frame.debug_info.traced_for``
  (internal; where a JAX version lacks them, the answer is empty).
  """
  leaves = jax.tree.leaves(state)
  if not leaves or any(_is_merging(leaf) for leaf in leaves):
    return []
  chain, trace = [], getattr(leaves[0], "_trace", None)
  while trace is not None:
    chain.append(trace)
    trace = getattr(trace, "parent_trace", None)
  out = []
  for i, body in enumerate(chain[:-1]):
    info = getattr(getattr(body, "frame", None), "debug_info", None)
    if (getattr(info, "traced_for", None) == _CHECKPOINT_BODY
        and any(type(t).__name__ in _DIFFERENTIATING for t in chain[i + 1:])):
      out.append((chain[i + 1], body))
  return out


def _shared_value(state, leaves, mode=None):
  """The one merging-dtype conversion of ``state`` (found by its leaves'
  identity), made in the trace its leaves belong to so that inner traces
  (scan, checkpoint bodies) that close over the state reuse it; ``mode`` (a
  use's scaling mode, None for a call that keeps the state) is noted."""
  if any(_is_merging(leaf) for leaf in leaves):
    return state            # shared already
  key = id(leaves[0])
  hit = _SHARED.get(key)
  if hit is not None and all(ref() is leaf for ref, leaf in zip(hit[0], leaves)):
    shared, uses_mode = hit[1], hit[2]
  else:
    uses_mode = _ModeOfUses()
    traces = {id(t): t for t in (getattr(leaf, "_trace", None) for leaf in leaves)}
    if len(traces) == 1 and None not in traces.values():
      with jax_core.set_current_trace(next(iter(traces.values()))):
        shared = _share(state, uses_mode)
    else:                     # leaves of several traces: convert in the current one
      shared = _share(state, uses_mode)
    _SHARED[key] = ([weakref.ref(leaf, _forget(key)) for leaf in leaves], shared, uses_mode)
  if mode is not None:
    uses_mode.note(mode)
  return shared


def _forget(key: int):
  """A weakref callback that drops the entry ``key`` of :data:`_SHARED` once
  a leaf it was made for is gone (its trace has ended)."""
  shared = _SHARED    # bound now: at interpreter exit the module's globals are gone

  def callback(ref):
    entry = shared.get(key)
    if entry is not None and any(r is ref for r in entry[0]):
      del shared[key]
  return callback


def _is_merging(leaf) -> bool:
  return isinstance(getattr(leaf, "dtype", None), _MergingDType)
