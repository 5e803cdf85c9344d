"""Moving variables between the Linen and the NNX modules.

The NNX modules keep the Linen modules' names (submodules, parameters, FP8
state), so a Linen variables dict ``{"params": ..., "_overwrite_with_gradient":
...}`` maps onto an NNX model path by path: a Linen checkpoint restores into an
NNX model, and the NNX model's variables export as a Linen dict.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from te_jax import flax as tfx, nnx as tnx
>>> x = jnp.ones((2, 8, 16))
>>> variables = tfx.DenseGeneral(32).init(jax.random.key(0), x)
>>> model = tnx.Linear(16, 32, rngs=nnx.Rngs(0))
>>> tnx.load_linen_variables(model, variables)
>>> bool(jnp.all(model(x) == tfx.DenseGeneral(32).apply(variables, x)))
True
"""

from __future__ import annotations

from typing import Any, Dict

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from te_jax import fp8_state as state_lib
from te_jax.nnx.state import FP8State

__all__ = ["load_linen_variables", "linen_variables"]

_COLLECTIONS = (("params", nnx.Param), (state_lib.FP8_COLLECTION, FP8State))


def _lookup(tree, path):
  for k in path:
    if not isinstance(tree, dict) or str(k) not in tree:
      return None
    tree = tree[str(k)]
  return tree


def _leaf_paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaf_paths(v, prefix + (str(k),))
  else:
    yield prefix


def load_linen_variables(model: nnx.Module, variables: Dict[str, Any]) -> None:
  """Sets ``model``'s parameters and FP8 state from a Linen variables dict.

  Args:
    model: a te_jax.nnx module (or a model made of them).
    variables: the variables of the matching ``te_jax.flax`` module (from
      ``init``, a ``TrainState``'s params plus its FP8 collection, or a
      restored checkpoint); ``nn.Partitioned`` boxes are unboxed.

  Raises:
    ValueError: a parameter or FP8 state of the model has no counterpart of
      the same shape in ``variables``, or ``variables`` holds leaves the model
      does not have.
  """
  variables = meta.unbox(variables)
  for coll, var_type in _COLLECTIONS:
    tree = variables.get(coll, {})
    used = set()
    for path, var in nnx.iter_graph(model):
      if not isinstance(var, var_type):
        continue
      path = tuple(str(p) for p in path)
      value = _lookup(tree, path)
      where = f"{coll}/{'/'.join(path)}"
      if value is None:
        raise ValueError(f"load_linen_variables: the Linen variables have no {where}.")
      got = jax.tree.map(jnp.shape, value)
      want = jax.tree.map(jnp.shape, var.get_value())
      if jax.tree.structure(got) != jax.tree.structure(want) or got != want:
        raise ValueError(f"load_linen_variables: {where} has shape {got}, the model "
                         f"needs {want}.")
      var.set_value(jax.tree.map(lambda a, b: jnp.asarray(a, jnp.result_type(b)),
                                 value, var.get_value()))
      used.update(path + rest for rest in _leaf_paths(value))
    extra = sorted("/".join(p) for p in _leaf_paths(tree) if p not in used)
    if extra:
      raise ValueError(f"load_linen_variables: the Linen '{coll}' hold leaves the model "
                       f"does not have: {extra[:5]}")


def linen_variables(model: nnx.Module) -> Dict[str, Any]:
  """``model``'s parameters and FP8 state as a Linen variables dict (for the
  matching ``te_jax.flax`` module, or a Linen checkpoint)."""
  out: Dict[str, Any] = {}
  for coll, var_type in _COLLECTIONS:
    tree: Dict[str, Any] = {}
    for path, var in nnx.iter_graph(model):
      if isinstance(var, var_type):
        node = tree
        for k in path[:-1]:
          node = node.setdefault(str(k), {})
        node[str(path[-1])] = var.get_value()
    if tree:
      out[coll] = tree
  return out
