"""Moving variables: between the Linen and the NNX modules, and onto a mesh.

The NNX modules keep the Linen modules' names (submodules, parameters, FP8
state), so a Linen variables dict ``{"params": ..., "_overwrite_with_gradient":
...}`` maps onto an NNX model path by path: a Linen checkpoint restores into an
NNX model, and the NNX model's variables export as a Linen dict.

:func:`get_named_sharding` and :func:`get_abstract_model` are
``nnx.get_named_sharding`` and ``nnx.get_abstract_model`` for models holding
te_jax modules: the parameters' logical axis names go through te_jax's rules
(the ``nnx.logical_axis_rules`` in effect, else the defaults for the
autocast's mesh resource, ``te_jax.sharding.logical_axis_rules``), and the
delayed-scaling state (an ``FP8State`` holds a dict of arrays, which Flax's
functions take for one array) is replicated. Restoring a sharded
checkpoint, as Flax's guide does::

  with te_jax.fp8_autocast(True, recipe, mesh_resource=mr):
    graphdef, abstract_state = te_jax.nnx.get_abstract_model(lambda: Model(...), mesh)
  state = orbax.checkpoint.StandardCheckpointer().restore(path, abstract_state)
  model = nnx.merge(graphdef, state)

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
from jax.sharding import NamedSharding, PartitionSpec
from flax.core import meta

from te_jax import fp8_state as state_lib
from te_jax import sharding as sharding_lib
from te_jax.layers import moe as moe_core
from te_jax.nnx import state as st
from te_jax.nnx.moe import RouterBias
from te_jax.nnx.state import FP8State

__all__ = ["load_linen_variables", "linen_variables", "get_named_sharding",
           "get_abstract_model"]

# (Linen collection, NNX variable type, {NNX attribute: Linen name} where
# the two name the variable differently).
_COLLECTIONS = (("params", nnx.Param, {}), (state_lib.FP8_COLLECTION, FP8State, {}),
                (moe_core.ROUTER_BIAS_COLLECTION, RouterBias,
                 {"router_bias": moe_core.ROUTER_BIAS_NAME}))


def _linen_path(path, rename) -> tuple:
  """The Linen path of the NNX variable at ``path``."""
  path = tuple(str(p) for p in path)
  return path[:-1] + (rename.get(path[-1], path[-1]),)


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
  """Sets ``model``'s parameters, FP8 state and MoE router biases from a Linen
  variables dict.

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
  for coll, var_type, rename in _COLLECTIONS:
    tree = variables.get(coll, {})
    used = set()
    for path, var in nnx.iter_graph(model):
      if not isinstance(var, var_type):
        continue
      path = _linen_path(path, rename)
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
  """``model``'s parameters, FP8 state and MoE router biases as a Linen
  variables dict (for the matching ``te_jax.flax`` module, or a Linen
  checkpoint)."""
  out: Dict[str, Any] = {}
  for coll, var_type, rename in _COLLECTIONS:
    tree: Dict[str, Any] = {}
    for path, var in nnx.iter_graph(model):
      if isinstance(var, var_type):
        path = _linen_path(path, rename)
        node = tree
        for k in path[:-1]:
          node = node.setdefault(k, {})
        node[path[-1]] = var.get_value()
    if tree:
      out[coll] = tree
  return out


def _variable_sharding(var: nnx.Variable, mesh, rules):
  """The NamedSharding(s) of one variable's value: its ``out_sharding``
  logical names through ``rules`` (mesh axes the mesh lacks, or of size 1,
  dropped), or replicated; one per leaf of a pytree value."""
  names = var.get_metadata().get("out_sharding")
  spec = PartitionSpec()
  if names:
    axes = sharding_lib.logical_to_mesh_axes(names, rules=rules, mesh=mesh)
    spec = PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))
  return jax.tree.map(lambda _: NamedSharding(mesh, spec), var.get_value())


def get_named_sharding(tree, mesh):
  """``tree`` (an ``nnx.State``, or a model) with each variable's value
  replaced by its ``NamedSharding`` on ``mesh`` (a dict of them for a
  dict-valued variable such as ``FP8State``): for ``jax.device_put(state,
  get_named_sharding(state, mesh))`` and abstract restore targets.

  Parameters are sharded by their logical axis names under the rules the
  te_jax modules use when called here (``nnx.logical_axis_rules`` in
  effect, else the defaults for the active autocast's mesh resource);
  variables without names (FP8 state and its counters) are replicated.
  """
  state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
  rules = st.read_autocast().axis_rules
  return jax.tree.map(
      lambda v: v.replace(_variable_sharding(v, mesh, rules))
      if isinstance(v, nnx.Variable) else NamedSharding(mesh, PartitionSpec()),
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def get_abstract_model(init_fn, mesh):
  """``(graphdef, abstract_state)`` of the model ``init_fn()`` builds, without
  allocating it: every leaf a ``jax.ShapeDtypeStruct`` with its
  :func:`get_named_sharding` sharding on ``mesh``. The target of a sharded
  restore (``orbax``'s ``StandardCheckpointer().restore(path,
  abstract_state)`` or ``te_jax.checkpoint.restore``), then ``nnx.merge``.

  Build it under the autocast (recipe, mesh resource) the model trains
  under: the delayed-scaling state is created with the modules. The model
  is traced with no mesh in effect (Flax's ``nnx.eval_shape`` attaches a
  sharding from the context mesh to every variable, which a dict-valued
  ``FP8State`` cannot take); the shardings are attached afterwards.
  """
  with jax.set_mesh(None):
    abstract = nnx.eval_shape(init_fn)
  graphdef, state = nnx.split(abstract)
  shardings = get_named_sharding(state, mesh)
  return graphdef, jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
