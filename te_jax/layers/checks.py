"""Option and input checks shared by the te_jax modules of both frameworks.

Each module of ``te_jax.flax`` and its twin in ``te_jax.nnx`` call the same
check for the same option, so both accept and refuse the same values; each
check raises a ValueError (a TypeError for a value of the wrong kind) naming
the argument and what it must be.

>>> to_tuple("features", 8), to_tuple("features", (3, 4))
((8,), (3, 4))
>>> compute_dtype(None, "bfloat16", "float32")
dtype('float32')
>>> attention_options(8, num_gqa_groups=2)
(8, 2, None, None, 0.0)
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import jax.numpy as jnp

__all__ = ["to_tuple", "compute_dtype", "check_add_residual", "check_rate", "positive_int",
           "optional_positive_int", "check_input_rank", "attention_options", "mlp_options",
           "transformer_options"]


def to_tuple(name: str, value) -> Tuple[int, ...]:
  """``value`` (an int or a sequence of ints > 0) as a tuple; ValueError naming
  ``name`` otherwise."""
  t = (value,) if isinstance(value, int) else value
  try:
    t = tuple(t)
  except TypeError:
    t = None
  if not t or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in t):
    raise ValueError(f"{name} must be a positive int or a non-empty sequence of them, "
                     f"got {value!r}.")
  return t


def compute_dtype(dtype, x_dtype, param_dtype):
  """The module ``dtype``, or the promotion of input and parameter dtypes."""
  return dtype if dtype is not None else jnp.result_type(x_dtype, param_dtype)


def positive_int(name: str, value) -> int:
  """``value`` as an int; ValueError naming ``name`` unless an int >= 1."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
  return int(value)


def optional_positive_int(name: str, value) -> Optional[int]:
  """None, or ``value`` as :func:`positive_int` checks it."""
  return None if value is None else positive_int(name, value)


def check_rate(name: str, rate) -> float:
  """``rate`` as a float; ValueError naming ``name`` unless a number with
  0 <= rate < 1 (a dropout rate of 1 or more drops everything)."""
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
    raise ValueError(f"{name} must be a number in [0, 1), got {rate!r}.")
  return float(rate)


def check_input_rank(name: str, x, min_ndim: int = 1) -> None:
  """Raises unless ``x`` (argument ``name``) is an array of at least
  ``min_ndim`` dims: a TypeError for a Python list or scalar (whose shape a
  module cannot read), a ValueError for too few dims."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array (jax.Array or numpy), got a "
                    f"{type(x).__name__}; convert it with jnp.asarray({name}).")
  if len(x.shape) < min_ndim:
    raise ValueError(f"{name} must have at least {min_ndim} dim(s) (..., features), got "
                     f"shape {tuple(x.shape)}.")


def check_add_residual(owner: str, x, dtype, out_width: int) -> None:
  """A module's ``add_residual=True``: its output is ``x + y``, so x must
  have the output's width and come in the compute dtype (ValueError naming
  what differs)."""
  if x.shape[-1] != out_width:
    raise ValueError(f"{owner}: add_residual=True adds the input to the output, whose width "
                     f"{out_width} differs from the input's {x.shape[-1]}.")
  if jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise ValueError(f"{owner}: add_residual=True adds the input to the output, so the input "
                     f"must come in the compute dtype {jnp.dtype(dtype).name}; got "
                     f"{x.dtype}. Cast it first.")


def attention_options(num_attention_heads, num_gqa_groups=None, head_dim=None,
                      out_features=None, attention_dropout=0.0):
  """The checked options of ``MultiHeadAttention``: ``(heads, groups or None,
  head_dim or None, out_features or None, attention_dropout)``. Heads and
  the optional sizes are ints >= 1 (a 0 is not "the default"), the rate in
  [0, 1). Whether the groups divide the heads and the heads the width is
  ``te_jax.layers.attention.head_layout``'s."""
  return (positive_int("num_attention_heads", num_attention_heads),
          optional_positive_int("num_gqa_groups", num_gqa_groups),
          optional_positive_int("head_dim", head_dim),
          optional_positive_int("out_features", out_features),
          check_rate("attention_dropout", attention_dropout))


def mlp_options(intermediate_dim, intermediate_dropout_rate=0.0) -> Tuple[int, float]:
  """The checked options of ``LayerNormMLP``: ``(intermediate_dim,
  intermediate_dropout_rate)``."""
  return (positive_int("intermediate_dim", intermediate_dim),
          check_rate("intermediate_dropout_rate", intermediate_dropout_rate))


def transformer_options(hidden_size, mlp_hidden_size, num_attention_heads, *,
                        num_gqa_groups=None, head_dim=None, hidden_dropout=0.0,
                        attention_dropout=0.0, intermediate_dropout=0.0) -> None:
  """Checks the options of ``TransformerLayer`` under their own names (its
  sublayers would name theirs: ``intermediate_dim`` for ``mlp_hidden_size``)."""
  positive_int("hidden_size", hidden_size)
  positive_int("mlp_hidden_size", mlp_hidden_size)
  attention_options(num_attention_heads, num_gqa_groups, head_dim,
                    attention_dropout=attention_dropout)
  check_rate("hidden_dropout", hidden_dropout)
  check_rate("intermediate_dropout", intermediate_dropout)
