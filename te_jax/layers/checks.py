"""Option checks and dtype rules shared by the te_jax modules of both frameworks.

Each check raises a ValueError naming the argument and what it must be.

>>> to_tuple("features", 8), to_tuple("features", (3, 4))
((8,), (3, 4))
>>> compute_dtype(None, "bfloat16", "float32")
dtype('float32')
"""

from __future__ import annotations

from typing import Tuple

import jax.numpy as jnp

__all__ = ["to_tuple", "compute_dtype", "check_rate"]


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


def check_rate(name: str, rate) -> float:
  """``rate`` as a float; ValueError naming ``name`` unless 0 <= rate < 1."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {rate}.")
  return float(rate)
