"""Dispatch and combine with static shapes: tokens sorted by expert into one buffer.

A routing of T tokens, k experts each, is T*k *assignments*, flattened
choice-major (assignment ``i = j * T + t`` is token t's j-th choice), so that
where a capacity cuts, first choices of every token come before second
choices. They are placed, sorted by expert, into one buffer whose row count
is fixed at trace time:

* each expert's rows form one group, zero-padded to ``block`` rows (the
  recipe's ``ScalingMode.token_block``: 128 blockwise, 16 per tensor, 1 with
  FP8 off), so no FP8 tile spans two experts and the grouped GEMM reads
  ``group_sizes`` from the device;
* dropless (the default): the buffer holds every routing. Groups padded to
  ``block`` need at most ``A + min(E, A) * (block - 1)`` rows for A
  assignments over E experts, rounded down to a multiple of ``block``
  (:func:`rows_bound`): whatever the routing, nothing is dropped, the shapes
  never change and nothing is recompiled;
* capacity mode (``capacity`` rows per expert, a multiple of ``block``): an
  expert keeps its first ``capacity`` assignments in the order above; the
  others are dropped (their output is 0) and counted in ``Dispatch.dropped``.

The experts may be split into ``segments`` (the devices of an expert-parallel
axis, ``te_jax.moe.parallel``): segment s holds experts
``[s * E/segments, (s+1) * E/segments)`` in its own ``segment_rows`` rows,
so the buffer is ``segments`` equal chunks, one per device, for
``jax.lax.all_to_all``.

Row movement is written as gathers (``jnp.take``) both ways: the gradient
of placing tokens in the buffer gathers each token's k rows back and sums
them in float32, and the gradient of picking the buffer's rows places them
back (the kept ``dest`` entries are distinct). Autodiff of a gather would
give scatter-adds instead: bfloat16 atomic adds on a GPU, whose sums
depend on the order the k copies arrive in.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

__all__ = ["Dispatch", "rows_bound", "capacity_rows", "segment_rows", "plan",
           "place_rows", "pick_rows", "dispatch_rows", "combine_rows", "flat_assignments"]


class Dispatch(NamedTuple):
  """Where each assignment sits in the buffer (device arrays).

  Attributes:
    dest: (A,) int32 buffer row of each assignment; the buffer's row count
      (one past its end) for a dropped or unrouted one.
    group_sizes: (E,) int32 rows of each expert's group (a multiple of block).
    dropped: () int32 assignments dropped by the capacity.
  """

  dest: jax.Array
  group_sizes: jax.Array
  dropped: jax.Array


def _check_positive(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}.")


def rows_bound(assignments: int, experts: int, block: int) -> int:
  """Rows that hold any routing of ``assignments`` among ``experts`` groups,
  each padded to a multiple of ``block``.

  >>> rows_bound(10, 4, 4)   # e.g. counts (7, 1, 1, 1) -> 8 + 4 + 4 + 4
  20
  """
  for name, v in (("assignments", assignments), ("experts", experts), ("block", block)):
    _check_positive(name, v)
  nonempty = min(experts, assignments)
  return block * ((assignments + nonempty * (block - 1)) // block)


def capacity_rows(capacity_factor: float, assignments: int, experts: int,
                  block: int) -> int:
  """Rows per expert in capacity mode: ``capacity_factor`` times the mean
  load ``assignments / experts``, rounded up to ``block``."""
  if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
      or not capacity_factor > 0 or not math.isfinite(capacity_factor)):
    raise ValueError(f"capacity_factor must be a finite number > 0 (None: dropless), "
                     f"got {capacity_factor!r}.")
  mean = capacity_factor * assignments / experts
  return block * max(1, math.ceil(mean / block))


def segment_rows(assignments: int, experts: int, block: int,
                 capacity: Optional[int] = None) -> int:
  """Rows of one segment holding ``experts`` experts: :func:`rows_bound`,
  or at most ``experts * capacity`` in capacity mode."""
  bound = rows_bound(assignments, experts, block)
  return bound if capacity is None else min(bound, experts * capacity)


def _exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def flat_assignments(expert_ids: jax.Array) -> jax.Array:
  """(T, k) expert ids -> (T*k,) choice-major (``i = j * T + t``)."""
  return expert_ids.T.reshape(-1)


def plan(expert_ids: jax.Array, *, num_experts: int, block: int, rows_per_segment: int,
         segments: int = 1, capacity: Optional[int] = None) -> Dispatch:
  """Places assignments into a buffer of ``segments * rows_per_segment`` rows.

  Args:
    expert_ids: (A,) int32 in [0, E]; E means routed nowhere.
    num_experts: E, a multiple of ``segments``.
    block: each group is padded to a multiple of it.
    rows_per_segment: static rows of one segment (:func:`segment_rows`).
    segments: chunks of the buffer (the expert-parallel devices).
    capacity: rows per expert (a multiple of ``block``), or None (dropless;
      then ``rows_per_segment`` must bound every routing).

  Returns:
    A :class:`Dispatch`.
  """
  e = num_experts
  a = expert_ids.shape[0]
  if e % segments:
    raise ValueError(f"num_experts ({e}) must be a multiple of segments ({segments}).")
  if capacity is not None and capacity % block:
    raise ValueError(f"capacity ({capacity}) must be a multiple of block ({block}).")
  ids = expert_ids.astype(jnp.int32)
  counts = jnp.bincount(ids, length=e + 1).astype(jnp.int32)   # [E]: routed nowhere
  order = jnp.argsort(ids, stable=True)
  starts = _exclusive_cumsum(counts)
  rank = jnp.zeros((a,), jnp.int32).at[order].set(
      jnp.arange(a, dtype=jnp.int32) - starts[ids[order]])
  kept = counts[:e] if capacity is None else jnp.minimum(counts[:e], capacity)
  padded = -(-kept // block) * block
  local = _exclusive_cumsum(padded.reshape(segments, e // segments), axis=1)
  offsets = (local + rows_per_segment * jnp.arange(segments, dtype=jnp.int32)[:, None])
  routed = ids < e
  safe = jnp.minimum(ids, e - 1)
  keep = routed & (rank < kept[safe])
  dest = jnp.where(keep, offsets.reshape(e)[safe] + rank, segments * rows_per_segment)
  dropped = jnp.sum(routed & ~keep).astype(jnp.int32)
  return Dispatch(dest.astype(jnp.int32), padded.astype(jnp.int32), dropped)


def place_rows(source: jax.Array, src_index: jax.Array, dest: jax.Array,
               rows: int) -> jax.Array:
  """``out[dest[i]] = source[src_index[i]]``, other rows 0: (rows, H).

  ``dest`` entries at or past ``rows`` are skipped; the kept ones are
  distinct. A gather (each output row reads one source row, or 0)."""
  n = source.shape[0]
  src_of_row = jnp.full((rows,), n, jnp.int32).at[dest].set(src_index, mode="drop")
  return jnp.take(source, src_of_row, axis=0, mode="fill", fill_value=0)


def pick_rows(buffer: jax.Array, dest: jax.Array) -> jax.Array:
  """``buffer[dest]`` with 0 for ``dest`` past the end: (len(dest), H)."""
  return jnp.take(buffer, dest, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _place_tokens(x, dest, rows):
  a = dest.shape[0]
  return place_rows(x, jnp.arange(a, dtype=jnp.int32) % x.shape[0], dest, rows)


def _place_tokens_fwd(x, dest, rows):
  # x[:, :0]: x's row count and dtype, no bytes.
  return _place_tokens(x, dest, rows), (dest, x[:, :0])


def _place_tokens_bwd(rows, res, g):
  del rows
  dest, x_proto = res
  t = x_proto.shape[0]
  choices = dest.reshape(dest.shape[0] // max(t, 1), t)   # (k, T): choice-major
  # One gather per choice, summed as they come: of the forms compiled for an
  # H100 (docs/benchmarks-log-2026-12.md, MoE layer memory), the one that
  # held less than autodiff's scatter-adds in every case measured.
  total = jnp.zeros(x_proto.shape[:1] + g.shape[1:], jnp.float32)
  for j in range(choices.shape[0]):
    total = total + pick_rows(g, choices[j]).astype(jnp.float32)
  return total.astype(x_proto.dtype), None


_place_tokens.defvjp(_place_tokens_fwd, _place_tokens_bwd)


def dispatch_rows(x: jax.Array, dispatch: Dispatch, rows: int) -> jax.Array:
  """The buffer (rows, H): each kept assignment's token row at its ``dest``.

  ``x``: (T, H); ``dispatch.dest``: (k*T,) choice-major. The gradient of
  ``x`` sums each token's k rows of the buffer's gradient in float32."""
  t, a = x.shape[0], dispatch.dest.shape[0]
  if t and a % t:
    raise ValueError(f"dispatch.dest ({a} assignments) must hold k choices for each of the "
                     f"{t} rows of x (a multiple of {t}).")
  return _place_tokens(x, dispatch.dest, rows)


@jax.custom_vjp
def _pick_distinct(buffer, dest):
  return pick_rows(buffer, dest)


def _pick_distinct_fwd(buffer, dest):
  return pick_rows(buffer, dest), (dest, buffer[:, :0])


def _pick_distinct_bwd(res, g):
  dest, buffer_proto = res
  back = place_rows(g, jnp.arange(dest.shape[0], dtype=jnp.int32), dest,
                    buffer_proto.shape[0])
  return back.astype(buffer_proto.dtype), None


_pick_distinct.defvjp(_pick_distinct_fwd, _pick_distinct_bwd)


def combine_rows(buffer: jax.Array, dispatch: Dispatch, weights: jax.Array) -> jax.Array:
  """``y[t] = sum_j weights[t, j] * buffer[dest of (t, j)]`` in float32: (T, H)
  in ``buffer.dtype``; dropped and unrouted assignments add 0."""
  t, k = weights.shape
  rows = _pick_distinct(buffer, dispatch.dest).reshape(k, t, buffer.shape[1])
  w = weights.astype(jnp.float32).T[:, :, None]
  return jnp.sum(rows.astype(jnp.float32) * w, axis=0).astype(buffer.dtype)
