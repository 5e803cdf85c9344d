"""Where ``MultiHeadAttention(decode=True)`` keeps its key/value cache in Linen.

Flax's convention (``MultiHeadDotProductAttention(decode=True)``):

1. Allocate. A call whose ``"cache"`` collection is mutable but holds no cache
   yet (``init``, or ``apply(..., mutable=["cache"])`` on variables without
   one) creates, for input (B, L, E), ``cached_key`` and ``cached_value``
   (B, L, groups, head_dim) zeros in the compute dtype and ``cache_index``
   (int32 scalar 0), and computes the ordinary full forward (the cache stays
   empty). L is the longest sequence the cache can hold. An ``apply`` on one
   token that would allocate (a decode step given variables without their
   cache) is a ValueError: it would make a cache of length 1.
2. Decode. Each later ``apply(variables, x, mutable=["cache"])`` with ``x``
   (B, n, E) appends n tokens: what that does, and what happens past L, is
   ``te_jax.layers.kv_cache``.

A module with ``decode=False`` given variables that hold its cache ignores
the cache (each call attends within its own input only): it warns once
(:func:`warn_unused_cache`), since that is mostly a decode loop whose
module lost its ``decode=True``.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax.layers import kv_cache

__all__ = ["CACHE_COLLECTION", "decode_step", "warn_unused_cache"]

CACHE_COLLECTION = "cache"


def decode_step(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, *,
                causal: bool,
                rotate: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None
                ) -> Optional[kv_cache.DecodeStep]:
  """Declares ``module``'s cache and appends this call's keys and values.

  Args:
    module: the attention module (inside its ``__call__``).
    q, k, v, causal, rotate: as ``te_jax.layers.kv_cache.append``.

  Returns:
    None when this call allocated the cache (the caller runs its ordinary
    forward), else the ``DecodeStep`` to attend with.

  Raises:
    ValueError: no cache and the collection is immutable; a cache but the
      collection is immutable (it could not advance); an ``apply`` that would
      allocate a cache of length 1 (``te_jax.layers.kv_cache.check_allocation``);
      the errors of ``te_jax.layers.kv_cache.append``.
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
  if not initialized:
    kv_cache.check_allocation(k.shape[1], module.is_initializing(), where, CACHE_COLLECTION)
  cached_key = module.variable(CACHE_COLLECTION, "cached_key", jnp.zeros, k.shape, k.dtype)
  cached_value = module.variable(CACHE_COLLECTION, "cached_value", jnp.zeros, v.shape,
                                 v.dtype)
  cache_index = module.variable(CACHE_COLLECTION, "cache_index",
                                lambda: jnp.zeros((), jnp.int32))
  if not initialized:
    return None
  cache, step = kv_cache.append(
      kv_cache.Cache(cached_key.value, cached_value.value, cache_index.value), q, k, v,
      causal=causal, rotate=rotate, where=where)
  cached_key.value, cached_value.value, cache_index.value = cache
  return step


# (module class, path) of every module warn_unused_cache warned about.
_WARNED = set()


def warn_unused_cache(module: nn.Module) -> None:
  """Warns once per module when ``module`` (``decode=False``) was given a
  key/value cache, which it does not read."""
  if not module.has_variable(CACHE_COLLECTION, "cached_key"):
    return
  key = (type(module).__name__, tuple(getattr(module, "path", ())))
  if key in _WARNED:
    return
  _WARNED.add(key)
  warnings.warn(
      f"te_jax: {type(module).__name__} {'/'.join(key[1])} was given a key/value cache "
      f"(collection '{CACHE_COLLECTION}') but has decode=False, so it ignores it: each "
      "call attends within its own input only. To decode with the cache, apply the module "
      "with decode=True (module.clone(decode=True)); otherwise leave the "
      f"'{CACHE_COLLECTION}' collection out of the variables.", UserWarning, stacklevel=3)
