"""Kernel initializers and the default logical axis names of the te_jax modules.

A kernel of any rank is initialized on its 2-D (fan-in, fan-out) view
(:func:`kernel_fan_in_init`), so that fan-in scaled initializers see the
contraction a GEMM runs; ``LayerNormMLP``'s up-projection (embed, n_act,
mlp) is one such kernel per activation branch (:func:`gated_kernel_init`).

>>> default_kernel_axes(1, 1), default_kernel_axes(1, 3), default_kernel_axes(2, 1)
(('embed', 'mlp'), ('embed', 'qkv', 'heads', 'kv'), ('heads', 'kv', 'embed'))
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

__all__ = ["default_kernel_init", "default_kernel_axes", "kernel_fan_in_init",
           "gated_kernel_init"]

Initializer = Callable[..., jax.Array]
# Variance scaling 1.0 over fan-in, truncated normal (Flax's lecun_normal).
default_kernel_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")

_IN_NAMES = {1: ("embed",), 2: ("heads", "kv")}
_OUT_NAMES = {1: ("mlp",), 2: ("heads", "kv"), 3: ("qkv", "heads", "kv")}


def default_kernel_axes(n_in: int, n_out: int) -> Tuple[str, ...]:
  """Logical names of a projection kernel when none are given.

  Contracting dims: ("embed",) for one, ("heads", "kv") for two; output dims:
  ("mlp",), ("heads", "kv") or ("qkv", "heads", "kv"); ("embed",) for the
  (heads, kv) -> one-dim output projection. Any other count (or a clash with
  the contracting names) gets distinct placeholder names ``dense_in_i`` /
  ``dense_out_i`` (unmapped by sharding rules, hence replicated).
  """
  ins = _IN_NAMES.get(n_in, tuple(f"dense_in_{i}" for i in range(n_in)))
  outs = _OUT_NAMES.get(n_out, tuple(f"dense_out_{i}" for i in range(n_out)))
  if n_in == 2 and n_out == 1:   # (heads, kv) -> embed: the output projection
    outs = ("embed",)
  if set(ins) & set(outs):       # a name may appear only once in a kernel
    outs = tuple(f"dense_out_{i}" for i in range(n_out))
  return ins + outs


def _identity(value):
  return value


def kernel_fan_in_init(init: Initializer, n_in: int, n_out: int,
                       unbox: Optional[Callable] = None) -> Initializer:
  """``init`` called on the 2-D view (prod(in dims), prod(out dims)) of a
  kernel (*in_dims, *out_dims) and reshaped to it, so that fan-in and
  fan-out are those of the GEMM.

  ``unbox``: applied to what ``init`` returns before the reshape (the
  framework's way to take an array out of a metadata box its initializers
  may return); default none.
  """
  unbox = _identity if unbox is None else unbox

  def wrapped(key, shape, dtype=jnp.float32):
    flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
    return jnp.reshape(unbox(init(key, flat, dtype)), shape)
  return wrapped


def gated_kernel_init(init: Initializer, unbox: Optional[Callable] = None) -> Initializer:
  """The initializer of an up-projection kernel (embed, n_act, mlp): one
  ``init`` call per activation branch on its (embed, mlp) view, each with its
  own key (``unbox`` as in :func:`kernel_fan_in_init`)."""
  branch = kernel_fan_in_init(init, 1, 1, unbox)

  def wrapped(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, shape[1])
    return jnp.stack([branch(k, (shape[0], shape[2]), dtype) for k in keys], axis=1)
  return wrapped
