"""The key/value cache of ``MultiHeadAttention(decode=True)``.

Autoregressive decoding follows the convention of Flax's
``MultiHeadDotProductAttention(decode=True)``:

1. Allocate. A call whose ``"cache"`` collection is mutable but holds no cache
   yet (``init``, or ``apply(..., mutable=["cache"])`` on variables without
   one) creates, for input (B, L, E),

   * ``cached_key``, ``cached_value``: (B, L, groups, head_dim) zeros in the
     compute dtype (keys are stored *after* rotary, at their positions);
   * ``cache_index``: int32 scalar 0, the number of positions filled;

   and computes the ordinary full forward (the cache stays empty). L is the
   longest sequence the cache can hold.
2. Decode. Each later call ``apply(variables, x, mutable=["cache"])`` with
   ``x`` (B, n, E), 1 <= n <= L, appends the keys and values of its n new
   tokens at ``cache_index``, attends from them to every filled position
   (causally: token i of the call sees positions <= cache_index + i; with
   ``attn_mask_type="no_mask"`` every filled position, its own call's
   included), and advances ``cache_index`` by n. Rotary positions are
   ``cache_index + arange(n)``. A prompt can be prefilled in one call (n =
   its length) and then extended one token per call.

The cache is one set of positions shared by the batch: every row advances
together (rows of different prompt lengths must be left-padded by the
caller, with ``mask`` hiding the padding).

Past the end. ``cache_index`` is a traced value, so running past L cannot be
an error at trace time. The rule: outputs of positions >= L are NaN (after
the output projection, so no NaN enters an FP8 scale), and the write that
overflowed is clamped by ``lax.dynamic_update_slice`` to the last n slots
(the cache is then wrong for any later call). Stopping at L is the caller's
responsibility; ``n > L`` is a ValueError.

Not supported with decode: cross attention (``inputs_kv``), segment ids and
explicit segment positions (ValueError).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import flax.linen as nn

__all__ = ["CACHE_COLLECTION", "DecodeStep", "check_decode_inputs", "decode_step",
           "mark_overflow"]

CACHE_COLLECTION = "cache"


class DecodeStep(NamedTuple):
  """What one decode call attends with (the cache already updated).

  Attributes:
    q: (B, n, heads, head_dim) queries, rotated at their positions when rotary.
    k, v: (B, L, groups, head_dim) the whole cache after this call's write.
    mask: (1, 1, n, L) bool, True where a query may see a cache slot.
    valid: (n,) bool, False for positions >= L (their outputs become NaN).
  """

  q: jax.Array
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  valid: jax.Array


def check_decode_inputs(inputs_kv, **segment_args) -> None:
  """Raises ValueError for arguments ``decode=True`` does not take.

  Args:
    inputs_kv: must be None (the cache holds self-attention keys).
    **segment_args: name -> value of segment ids/positions; each must be None
      (positions follow ``cache_index``).
  """
  if inputs_kv is not None:
    raise ValueError("decode=True caches self-attention keys and values: inputs_kv must "
                     "be None (run cross attention without decode).")
  for name, value in segment_args.items():
    if value is not None:
      raise ValueError(f"{name} is not supported with decode=True: the cache is one "
                       "sequence per row whose positions follow cache_index.")


def decode_step(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, *,
                causal: bool,
                rotate: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None
                ) -> Optional[DecodeStep]:
  """Declares ``module``'s cache and appends this call's keys and values.

  Args:
    module: the attention module (inside its ``__call__``).
    q: (B, n, heads, head_dim) projected queries of the new tokens.
    k, v: (B, n, groups, head_dim) projected keys/values of the new tokens.
    causal: the module's mask type is "causal".
    rotate: None, or ``rotate(x, positions)`` applying rotary embeddings to a
      (B, n, heads, head_dim) ``x`` at (B, n) ``positions``; q and k are
      rotated at ``cache_index + arange(n)`` before k is stored.

  Returns:
    None when this call allocated the cache (the caller runs its ordinary
    forward), else the :class:`DecodeStep` to attend with.

  Raises:
    ValueError: no cache and the collection is immutable; a cache but the
      collection is immutable (it could not advance); a cache whose batch,
      groups, head_dim or dtype differ from this call's; n > L.
  """
  initialized = module.has_variable(CACHE_COLLECTION, "cached_key")
  mutable = module.is_mutable_collection(CACHE_COLLECTION)
  where = f"{type(module).__name__} {'/'.join(module.path) if hasattr(module, 'path') else ''}"
  if not initialized and not mutable:
    raise ValueError(
        f"{where}: decode=True needs a '{CACHE_COLLECTION}' collection, and the variables "
        "passed to apply() have none. Allocate it first by calling init (or apply with "
        f"mutable=['{CACHE_COLLECTION}']) with decode=True on an input of the full length "
        "(batch, max_length, hidden).")
  if initialized and not mutable:
    raise ValueError(
        f"{where}: decode=True appends to the '{CACHE_COLLECTION}' collection: pass "
        f"mutable=['{CACHE_COLLECTION}'] to apply() and keep the returned cache.")
  cached_key = module.variable(CACHE_COLLECTION, "cached_key", jnp.zeros, k.shape, k.dtype)
  cached_value = module.variable(CACHE_COLLECTION, "cached_value", jnp.zeros, v.shape,
                                 v.dtype)
  cache_index = module.variable(CACHE_COLLECTION, "cache_index",
                                lambda: jnp.zeros((), jnp.int32))
  if not initialized:
    return None

  b, length, g, d = cached_key.value.shape
  n = k.shape[1]
  if (k.shape[0], k.shape[2], k.shape[3]) != (b, g, d):
    raise ValueError(
        f"{where}: the cache holds (batch, max_length, groups, head_dim) = "
        f"{cached_key.value.shape}, but this call's keys are {k.shape}: decode with the "
        "batch size and head layout the cache was allocated with.")
  if n > length:
    raise ValueError(f"{where}: a decode call of {n} tokens does not fit the cache of "
                     f"max_length {length}.")
  if k.dtype != cached_key.value.dtype:
    raise ValueError(f"{where}: the cache holds {cached_key.value.dtype.name} keys but "
                     f"this call computes {k.dtype.name}: decode with the dtype the cache "
                     "was allocated with.")

  start = cache_index.value
  pos = start + jnp.arange(n, dtype=jnp.int32)                       # (n,)
  if rotate is not None:
    bpos = jnp.broadcast_to(pos[None], (b, n))
    q, k = rotate(q, bpos), rotate(k, bpos)
  zero = jnp.zeros((), jnp.int32)
  cached_key.value = lax.dynamic_update_slice(cached_key.value, k, (zero, start, zero, zero))
  cached_value.value = lax.dynamic_update_slice(cached_value.value, v,
                                                (zero, start, zero, zero))
  cache_index.value = start + n
  slots = jnp.arange(length, dtype=jnp.int32)
  if causal:
    mask = slots[None, :] <= pos[:, None]                              # (n, L)
  else:   # every filled slot, this call's included
    mask = jnp.broadcast_to(slots[None, :] < start + n, (n, length))
  return DecodeStep(q, cached_key.value, cached_value.value, mask[None, None],
                    pos < length)


def mark_overflow(out: jax.Array, valid: jax.Array) -> jax.Array:
  """``out`` (B, n, ...) with NaN at positions where ``valid`` (n,) is False."""
  keep = valid.reshape((1, -1) + (1,) * (out.ndim - 2))
  return jnp.where(keep, out, jnp.asarray(jnp.nan, out.dtype))
