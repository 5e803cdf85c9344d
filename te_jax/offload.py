"""Optimizer state (and optionally the master weights) kept in host memory between steps.

An FP8 step holds the activations of FP8 GEMMs at 1 byte per element, but
the optimizer still keeps two float32 moments per parameter (AdamW: 8 bytes
per parameter, against 4 for the float32 master weights and 1-2 for the FP8
and 16-bit copies the step computes with). Between steps those moments are
only read and written by the update, so they can live in the host's pinned
memory (JAX memory kind ``"pinned_host"``) and visit the device for the
update alone: the forward and backward passes, where the step's peak is,
then run without them. MaxText's ``optimizer_memory_host_offload`` does the
same; this module is the piece a Flax/optax training loop needs:

* :func:`offload_optimizer` wraps an ``optax.GradientTransformation``: its
  state is created in host memory, and each ``update`` brings it to device
  memory once the gradients exist, runs the wrapped update there and sends
  the new state back (inside ``jax.jit``: XLA inserts the transfers);
* :func:`host_shardings` gives the shardings to declare for such a state
  (the same partition specs in host memory), for ``jax.jit``'s
  ``in_shardings``/``out_shardings`` or ``jax.device_put``: a jitted step
  whose output shardings say device memory would bring the state back.

The arithmetic is the wrapped transformation's, on the same values: a step
gives the same result bit for bit with or without the offload (only where
the state waits between steps changes). Sharded states keep their sharding
(each device's shard goes to its own host's memory), so this composes with
FSDP: te_jax's FP8 weights are still all-gathered in FP8 in the forward and
backward passes, which never see the offloaded state.

Master weights: ``host_shardings`` on the parameters too, and
:func:`to_device` on them at the start of the step (the optimizer update
then returns them to host memory through the jit's output shardings). This
moves all the parameters to the device at the start of each step and keeps
them there until their last use, so it only pays where the parameters are
sharded (FSDP) or the step's peak is before some layers run.

Where a device has no ``"pinned_host"`` memory (:func:`host_memory_kind`
returns None), :func:`offload_optimizer` raises at construction, naming the
memories the device has.

>>> import jax, jax.numpy as jnp, optax
>>> from te_jax import offload
>>> tx = offload.offload_optimizer(optax.adamw(1e-3))
>>> params = {"w": jnp.ones((4, 4))}
>>> state = tx.init(params)
>>> jax.tree.leaves(state)[1].sharding.memory_kind
'pinned_host'
>>> updates, state = jax.jit(tx.update)(params, state, params)
>>> jax.tree.leaves(state)[1].sharding.memory_kind
'pinned_host'
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import optax
from jax.sharding import Sharding

__all__ = ["HOST_MEMORY_KIND", "host_memory_kind", "host_shardings", "to_device", "to_host",
           "offload_optimizer", "is_offloaded"]

HOST_MEMORY_KIND = "pinned_host"


def host_memory_kind(devices: Optional[Sequence[jax.Device]] = None) -> Optional[str]:
  """``"pinned_host"`` when every device in ``devices`` (default: all) has
  that memory, else None."""
  devices = jax.devices() if devices is None else devices
  for d in devices:
    if HOST_MEMORY_KIND not in {m.kind for m in d.addressable_memories()}:
      return None
  return HOST_MEMORY_KIND


def _check_host_memory():
  if host_memory_kind() is None:
    d = jax.devices()[0]
    raise ValueError(
        f"optimizer offload needs the {HOST_MEMORY_KIND!r} memory, which {d.platform} "
        f"device {d.id} does not have (it has "
        f"{sorted(m.kind for m in d.addressable_memories())}); keep the optimizer state "
        "on the device (no offload) here.")


def host_shardings(shardings):
  """``shardings`` (a pytree of ``jax.sharding.Sharding``) with every leaf in
  host memory: the same devices and partition specs, memory kind
  ``"pinned_host"``."""
  def one(s):
    if not isinstance(s, Sharding):
      raise TypeError(f"host_shardings takes a pytree of jax.sharding.Sharding, got a "
                      f"{type(s).__name__} leaf.")
    return s.with_memory_kind(HOST_MEMORY_KIND)
  return jax.tree.map(one, shardings)


def to_device(tree):
  """Every array of ``tree`` in device memory (a transfer inside ``jax.jit``;
  a no-op for arrays already there). Shardings are kept."""
  return jax.device_put(tree, jax.memory.Space.Device)


def to_host(tree):
  """Every array of ``tree`` in host memory (``"pinned_host"``). Shardings are kept."""
  return jax.device_put(tree, jax.memory.Space.Host)


def _tie_to_gradients(updates, state):
  """``(updates, state)`` with each part of the state readable only once its
  gradients exist (``jax.lax.optimization_barrier``).

  Untied, XLA brought the state to the device at the start of the step, and
  it sat there beside the activations at the step's peak. Tied to all the
  gradients at once, its transfer waited for the whole backward pass and
  then ran alone. So every subtree of the state shaped like the parameters
  (AdamW's two moments) is tied leaf by leaf: the moments of a parameter
  can come to the device as soon as its gradient exists, while the backward
  pass goes on through the layers before it, whose activations that
  gradient's layer no longer needs. The rest of the state (step counts,
  anything not shaped like the parameters) waits for every gradient.
  """
  g_leaves, g_def = jax.tree.flatten(updates)

  def like_params(node):
    return not isinstance(node, jax.Array) and jax.tree.structure(node) == g_def
  parts, s_def = jax.tree.flatten(state, is_leaf=like_params)
  per_leaf = [i for i, p in enumerate(parts) if like_params(p)]
  rest = [i for i, p in enumerate(parts) if not like_params(p)]
  if not per_leaf:
    return jax.lax.optimization_barrier((updates, state))
  moments = [jax.tree.leaves(parts[i]) for i in per_leaf]
  tied = [jax.lax.optimization_barrier((g, [m[j] for m in moments]))
          for j, g in enumerate(g_leaves)]
  for k, i in enumerate(per_leaf):
    parts[i] = jax.tree.unflatten(g_def, [t[1][k] for t in tied])
  g_leaves = [t[0] for t in tied]
  g_leaves, rest_parts = jax.lax.optimization_barrier((g_leaves, [parts[i] for i in rest]))
  for i, p in zip(rest, rest_parts):
    parts[i] = p
  return jax.tree.unflatten(g_def, g_leaves), jax.tree.unflatten(s_def, parts)


class _Offloaded(optax.GradientTransformationExtraArgs):
  """Marks a transformation made by :func:`offload_optimizer`."""


def offload_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` whose state lives in host memory between updates.

  ``init`` returns ``tx.init(params)`` in host memory; ``update`` brings the
  state to device memory, runs ``tx.update`` there (extra arguments are
  passed on) and returns the updates in device memory and the new state in
  host memory. Same values as ``tx`` bit for bit. Under ``jax.jit``, declare
  the state's shardings with :func:`host_shardings` (a device-memory output
  sharding would bring it back). For ``flax.training.train_state.TrainState``
  pass the wrapped transformation as ``tx``.

  Raises:
    ValueError: the devices have no ``"pinned_host"`` memory.
  """
  _check_host_memory()
  if isinstance(tx, _Offloaded):
    return tx

  def init(params):
    return to_host(tx.init(params))

  def update(updates, state, params=None, **extra):
    updates, state = _tie_to_gradients(updates, state)
    new_updates, new_state = optax.with_extra_args_support(tx).update(
        updates, to_device(state), params, **extra)
    return new_updates, to_host(new_state)

  return _Offloaded(init, update)


def is_offloaded(tx) -> bool:
  """Whether ``tx`` came from :func:`offload_optimizer`."""
  return isinstance(tx, _Offloaded)
