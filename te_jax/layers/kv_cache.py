"""The key/value cache of autoregressive decoding: what one decode call does.

The cache (:class:`Cache`) holds, for a cache of L positions,

* ``key``, ``value``: (B, L, groups, head_dim) in the compute dtype (keys
  are stored *after* rotary, at their positions);
* ``index``: int32 scalar, the number of positions filled.

A decode call with n new tokens, 1 <= n <= L (:func:`append`), writes their
keys and values at ``index``, attends from them to every filled position
(causally: token i of the call sees positions <= index + i; without the
causal mask every filled position, its own call's included), and advances
``index`` by n. Rotary positions are ``index + arange(n)``. A prompt can be
prefilled in one call (n = its length) and then extended one token per call.

The cache is one set of positions shared by the batch: every row advances
together (rows of different prompt lengths must be left-padded by the
caller, with ``mask`` hiding the padding).

Past the end. ``index`` is a traced value, so running past L cannot be an
error at trace time. The rule: a call that does not fit (``index + n > L``)
outputs NaN at EVERY position, those below L included (:func:`mark_overflow`,
after the output projection, so no NaN enters an FP8 scale): its write was
clamped by ``lax.dynamic_update_slice`` to the last n slots, over keys that
earlier positions attend to, so none of its outputs can be trusted. The
index still advances past L, so every later call is NaN too. Stopping at L
is the caller's responsibility; ``n > L`` is a ValueError.

Not supported with decode: cross attention (``inputs_kv``), segment ids and
explicit segment positions (ValueError, :func:`check_decode_inputs`).
Where the cache lives is the framework's: ``te_jax.flax.kv_cache`` keeps it
in the Linen collection ``"cache"``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Cache", "DecodeStep", "check_decode_inputs", "check_allocation", "refuse_decode",
           "append", "mark_overflow"]


class Cache(NamedTuple):
  """A key/value cache (see the module docs).

  Attributes:
    key, value: (B, L, groups, head_dim).
    index: int32 scalar, the positions filled.
  """

  key: jax.Array
  value: jax.Array
  index: jax.Array


class DecodeStep(NamedTuple):
  """What one decode call attends with (the cache already updated).

  Attributes:
    q: (B, n, heads, head_dim) queries, rotated at their positions when rotary.
    k, v: (B, L, groups, head_dim) the whole cache after this call's write.
    mask: (1, 1, n, L) bool, True where a query may see a cache slot.
    valid: (n,) bool, all False when the call does not fit the cache (its
      outputs become NaN), else all True.
  """

  q: jax.Array
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  valid: jax.Array


def check_decode_inputs(inputs_kv, **segment_args) -> None:
  """Raises ValueError for arguments decoding does not take.

  Args:
    inputs_kv: must be None (the cache holds self-attention keys).
    **segment_args: name -> value of segment ids/positions; each must be None
      (positions follow the cache index).
  """
  if inputs_kv is not None:
    raise ValueError("decode=True caches self-attention keys and values: inputs_kv must "
                     "be None (run cross attention without decode).")
  for name, value in segment_args.items():
    if value is not None:
      raise ValueError(f"{name} is not supported with decode=True: the cache is one "
                       "sequence per row whose positions follow cache_index.")


def check_allocation(length: int, initializing: bool, where: str, collection: str) -> None:
  """Raises unless a call may allocate a cache of ``length`` positions.

  A call allocates where the variables hold no cache and the collection is
  mutable: ``init``, or ``apply(..., mutable=[collection])`` on the
  full-length input. An ``apply`` on one token is a decode step given
  variables without their cache: it would allocate a cache of max_length 1
  (and compute the ordinary forward), then every later call overflows.
  """
  if length == 1 and not initializing:
    raise ValueError(
        f"{where}: decode=True, but the variables passed to apply() hold no "
        f"'{collection}' collection, so this one-token call would allocate a cache of "
        "max_length 1 instead of decoding. Allocate the cache first, with init (or apply "
        f"with mutable=['{collection}']) on an input of the full length (batch, "
        f"max_length, hidden), and pass its '{collection}' collection to every decode call.")


def refuse_decode(decode, owner: str, alternative: str) -> None:
  """Raises a ValueError naming ``alternative`` when ``decode`` is truthy, for
  a module that has no key/value cache (``decode=False`` and None pass)."""
  if decode:
    raise ValueError(f"{owner}: decode=True (key/value-cache decoding) is not supported; "
                     f"{alternative}")


def append(cache: Cache, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
           rotate: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None,
           where: str = "") -> Tuple[Cache, DecodeStep]:
  """Writes this call's keys and values into ``cache``.

  Args:
    cache: the cache before the call.
    q: (B, n, heads, head_dim) projected queries of the new tokens.
    k, v: (B, n, groups, head_dim) projected keys/values of the new tokens.
    causal: the attention's mask type is "causal".
    rotate: None, or ``rotate(x, positions)`` applying rotary embeddings to a
      (B, n, heads, head_dim) ``x`` at (B, n) ``positions``; q and k are
      rotated at ``index + arange(n)`` before k is stored.
    where: the module, for the errors.

  Returns:
    (the cache after the call, the :class:`DecodeStep` to attend with).

  Raises:
    ValueError: a cache whose batch, groups, head_dim or dtype differ from
      this call's; n > L.
  """
  b, length, g, d = cache.key.shape
  n = k.shape[1]
  if (k.shape[0], k.shape[2], k.shape[3]) != (b, g, d):
    raise ValueError(
        f"{where}: the cache holds (batch, max_length, groups, head_dim) = "
        f"{cache.key.shape}, but this call's keys are {k.shape}: decode with the "
        "batch size and head layout the cache was allocated with.")
  if n > length:
    raise ValueError(f"{where}: a decode call of {n} tokens does not fit the cache of "
                     f"max_length {length}.")
  if k.dtype != cache.key.dtype:
    raise ValueError(f"{where}: the cache holds {cache.key.dtype.name} keys but "
                     f"this call computes {k.dtype.name}: decode with the dtype the cache "
                     "was allocated with.")

  start = cache.index
  pos = start + jnp.arange(n, dtype=jnp.int32)                       # (n,)
  if rotate is not None:
    bpos = jnp.broadcast_to(pos[None], (b, n))
    q, k = rotate(q, bpos), rotate(k, bpos)
  zero = jnp.zeros((), jnp.int32)
  new = Cache(lax.dynamic_update_slice(cache.key, k, (zero, start, zero, zero)),
              lax.dynamic_update_slice(cache.value, v, (zero, start, zero, zero)),
              start + n)
  slots = jnp.arange(length, dtype=jnp.int32)
  if causal:
    mask = slots[None, :] <= pos[:, None]                              # (n, L)
  else:   # every filled slot, this call's included
    mask = jnp.broadcast_to(slots[None, :] < start + n, (n, length))
  fits = jnp.broadcast_to(start + n <= length, (n,))
  return new, DecodeStep(q, new.key, new.value, mask[None, None], fits)


def mark_overflow(out: jax.Array, valid: jax.Array) -> jax.Array:
  """``out`` (B, n, ...) with NaN at positions where ``valid`` (n,) is False."""
  keep = valid.reshape((1, -1) + (1,) * (out.ndim - 2))
  return jnp.where(keep, out, jnp.asarray(jnp.nan, out.dtype))
