"""Save and restore a training state (parameters, optimizer and FP8 state).

A thin layer over `orbax-checkpoint <https://orbax.readthedocs.io>`_ for the
common case: one pytree (e.g. a ``flax.training.train_state.TrainState``
whose ``params`` hold the ``"_overwrite_with_gradient"`` FP8 collection)
saved as ``<directory>/<step>/``. Restoring needs a *target* of the same
structure (the freshly initialized state, e.g. ``TrainState.create(...)``, or
``jax.ShapeDtypeStruct`` leaves) whose leaves give the shapes, dtypes and
shardings of the result. What each kind of target leaf restores as, with
either backend:

* a ``jax.Array``, or a ``jax.ShapeDtypeStruct`` with a sharding: an array
  with that sharding, whatever layout the checkpoint was saved with (so a
  state can be restored into another mesh layout);
* a numpy array, or a ``jax.ShapeDtypeStruct`` without a sharding (what a
  plain ``jax.eval_shape`` gives): an array on the default device, where
  ``jnp.asarray`` would put it;
* a Python scalar (``bool``/``int``/``float``/``complex``; a fresh
  ``TrainState``'s ``step`` is the int 0): the saved value as the array a
  jitted step makes of that scalar: weakly typed, of JAX's default dtype for
  it (int32/float32 unless ``jax_enable_x64``), on the default device. The
  saved leaf must be a scalar of a kind the Python type holds (an int target
  takes bool or integer values, not float ones); a value that does not fit
  the default dtype raises.

orbax is imported lazily. When it is missing, ``backend="auto"`` falls back
to a single-host ``.npz`` file per step (exact bytes, same directory layout)
that stores each leaf's key path beside it: a target whose leaves have other
names (a changed model with same-shape layers renamed) is refused with the
differing paths, as orbax refuses it; ``backend="orbax"`` raises an
ImportError that says what to install.

Example::

  from te_jax import checkpoint
  checkpoint.save("/tmp/ckpt", step, state)                 # after a step
  step = checkpoint.latest_step("/tmp/ckpt")                # None if empty
  state = checkpoint.restore("/tmp/ckpt", step, target=state)

NNX models save and restore the same way, as their ``nnx.State`` (with the
optimizer's when resuming); the target is the abstract state of a model
that was never allocated, as Flax's guide builds it. On one device that is
``nnx.split(nnx.eval_shape(make))``; under a mesh it is
``te_jax.nnx.get_abstract_model(make, mesh)``, whose leaves carry the
shardings the model trains with (parameters by their logical axis names,
the delayed-scaling state replicated)::

  checkpoint.save(directory, step, nnx.state((model, optimizer)))
  graphdef, target = te_jax.nnx.get_abstract_model(make, mesh)  # make() -> (model, optimizer)
  model, optimizer = nnx.merge(graphdef, checkpoint.restore(directory, step, target=target))
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Optional

import jax
import ml_dtypes
import numpy as np

__all__ = ["save", "restore", "latest_step", "available_steps", "orbax_available"]

_BACKENDS = ("auto", "orbax", "numpy")
_NPZ = "state.npz"
_META = "te_jax_meta.json"
_PY_SCALARS = (bool, int, float, complex)
# The saved dtype kinds a Python scalar target of each type takes: those whose
# values the type holds (an int target refuses a float checkpoint, which
# restoring would truncate).
_SCALAR_KINDS = {bool: "b", int: "biu", float: "biuf", complex: "biufc"}


def orbax_available() -> bool:
  """Whether ``orbax.checkpoint`` can be imported."""
  try:
    import orbax.checkpoint  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    return False


def _ocp(required: bool):
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    return ocp
  except ImportError as e:
    if required:
      raise ImportError(
          "te_jax.checkpoint with backend='orbax' needs orbax-checkpoint: "
          "python3 -m pip install orbax-checkpoint (or te_jax[examples]); "
          "backend='auto' falls back to .npz files on one host.") from e
    return None


def _backend(backend: str):
  if backend not in _BACKENDS:
    raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}.")
  if backend == "numpy":
    return None
  return _ocp(required=backend == "orbax")


def available_steps(directory: str) -> list[int]:
  """Steps with a finished checkpoint under ``directory``, ascending."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def latest_step(directory: str) -> Optional[int]:
  """The newest saved step under ``directory``, or None."""
  steps = available_steps(directory)
  return steps[-1] if steps else None


def _prune(directory: str, keep: Optional[int]):
  if keep is None:
    return
  for s in available_steps(directory)[:-keep]:
    shutil.rmtree(os.path.join(directory, str(s)), ignore_errors=True)


def save(directory: str, step: int, tree: Any, *, keep: Optional[int] = 3,
         backend: str = "auto") -> str:
  """Saves ``tree`` as step ``step`` under ``directory`` and waits until done.

  Args:
    directory: checkpoint root (created if needed).
    step: int step number; an existing checkpoint of that step is replaced
      only once the new one is completely written.
    tree: pytree of arrays and Python scalars (a TrainState, a variables
      dict, ...). The npz backend stores a Python scalar as the array JAX
      makes of it (an int as int32 unless ``jax_enable_x64``); orbax stores
      Python scalars itself.
    keep: keep only the newest ``keep`` steps (None keeps all).
    backend: "auto" (orbax if installed, else npz), "orbax" or "numpy".

  Returns:
    The path of the step's checkpoint directory.

  Raises:
    ValueError: ``step`` is not a non-negative int; or this is one of several
      JAX processes (``jax.process_count() > 1``): every process would write
      and swap in the same files. Save with orbax's multi-process
      checkpointing there, as ``examples/train_gpt.py`` does.
  """
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}.")
  if jax.process_count() > 1:
    raise ValueError(
        f"te_jax.checkpoint.save runs in one process, and this is process "
        f"{jax.process_index()} of {jax.process_count()}: the processes would write and "
        "rename the same directory at once. With several processes save with orbax "
        "(all processes call ocp.StandardCheckpointer().save on a shared file system; see "
        "save_checkpoint in examples/train_gpt.py).")
  step = int(step)
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, str(step))
  # Written beside the final name and swapped in only when complete, so a
  # save that fails (or is killed) never costs the checkpoint already there.
  tmp = path + ".tmp"
  if os.path.exists(tmp):
    shutil.rmtree(tmp)
  ocp = _backend(backend)
  if ocp is not None:
    ckptr = ocp.StandardCheckpointer()
    try:
      ckptr.save(tmp, tree)
      ckptr.wait_until_finished()
    finally:
      ckptr.close()
  else:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in flat]
    arrays, dtypes = {}, []
    for i, leaf in enumerate(leaves):
      if _is_python_scalar(leaf):
        # Stored as the array JAX holds it as (a fresh TrainState's step 0 as
        # int32, not numpy's int64), so it restores into a target that has
        # been through a jitted step as well as into a fresh one.
        try:
          leaf = jax.numpy.asarray(leaf)
        except OverflowError:   # an int beyond int32 without x64: numpy's int64
          pass
      a = np.asarray(jax.device_get(leaf))
      dtypes.append(a.dtype.name)
      if a.dtype.kind == "V" or a.dtype.name not in np.sctypeDict:
        a = a.view(f"u{a.dtype.itemsize}")      # bfloat16 / float8: keep the bytes
      arrays[f"leaf_{i}"] = a
    os.makedirs(tmp)
    np.savez(os.path.join(tmp, _NPZ), **arrays)
    with open(os.path.join(tmp, _META), "w") as fh:
      json.dump({"num_leaves": len(leaves), "dtypes": dtypes,
                 "paths": [list(_path_key(p)) for p, _ in flat]}, fh)
  old = path + ".old"
  if os.path.exists(path):
    if os.path.exists(old):
      shutil.rmtree(old)
    os.replace(path, old)
  os.replace(tmp, path)
  shutil.rmtree(old, ignore_errors=True)
  _prune(directory, keep)
  return path


def _is_python_scalar(x) -> bool:
  # numpy scalars subclass float/complex (np.float64) but carry their own dtype.
  return isinstance(x, _PY_SCALARS) and not isinstance(x, np.generic)


def _python_type(x) -> type:
  """bool, int, float or complex: the Python scalar type ``x`` is (or subclasses)."""
  return next(t for t in _PY_SCALARS if isinstance(x, t))   # bool before int


def _leaf_name(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _path_key(path) -> tuple:
  """A tree path as a tuple of strings, comparable between the target and orbax metadata.

  The target's paths hold attribute and index keys (``.step``, ``[1]``)
  where orbax's metadata tree holds dict keys (``['step']``, ``['1']``).
  """
  def name(k):
    for attr in ("key", "name", "idx"):   # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return tuple(name(k) for k in path)


def _default_sharding():
  # Where jnp.asarray puts a new array (honours jax.default_device), so a
  # target leaf without a sharding restores to the same place with either
  # backend; orbax alone would otherwise reuse the layout of the save.
  return jax.numpy.zeros((), np.int8).sharding


def _abstract_leaf(x, default_sharding):
  """The ShapeDtypeStruct an array-like target leaf restores as (sharding filled in)."""
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                              sharding=default_sharding if sharding is None else sharding)


def _check_scalar_source(name: str, target, shape, dtype):
  """Raises unless a saved leaf of ``shape``/``dtype`` restores into the Python scalar ``target``."""
  kind = _python_type(target).__name__
  if tuple(shape) != ():
    raise ValueError(
        f"leaf {name}: the target holds the Python {kind} {target!r} but the checkpoint "
        f"holds an array of shape {tuple(shape)}; restore into a target of the saved "
        f"structure (e.g. the state as it was saved, or its jax.eval_shape).")
  if np.dtype(dtype).kind not in _SCALAR_KINDS[_python_type(target)]:
    raise TypeError(
        f"leaf {name}: the checkpoint holds a {np.dtype(dtype)} scalar, which the target's "
        f"Python {kind} ({target!r}) cannot hold without changing it; give that leaf "
        f"of the target the saved dtype, e.g. jax.ShapeDtypeStruct((), "
        f"jnp.{np.dtype(dtype).name}).")


def _scalar_result(name: str, target, value) -> jax.Array:
  """The saved scalar ``value`` as the array a jitted step makes of the Python scalar ``target``.

  Weakly typed, of JAX's default dtype for the scalar's type, on the default
  device: the dtype and weak type of ``jax.jit(lambda s: s)(target)``, so a
  restored fresh TrainState has the abstract type of one trained in this
  process and a jitted step does not trace again for it.
  """
  py_type = _python_type(target)
  v = py_type(np.asarray(value).item())
  try:
    return jax.numpy.asarray(v)
  except OverflowError as e:
    raise ValueError(
        f"leaf {name}: the saved value {v} does not fit JAX's default dtype for a Python "
        f"{py_type.__name__}; enable jax_enable_x64 or give that leaf of the target "
        f"a dtype that holds it.") from e


def _orbax_leaf_metadata(ckptr, path: str) -> dict:
  """``{_path_key: metadata with .shape and .dtype}`` of the leaves orbax saved at ``path``."""
  meta = ckptr.metadata(path)
  # orbax >= 0.11 wraps the tree: StepMetadata.item_metadata is a TreeMetadata.
  meta = getattr(meta, "item_metadata", meta)
  meta = getattr(meta, "tree", meta)
  flat, _ = jax.tree_util.tree_flatten_with_path(meta)
  return {_path_key(p): m for p, m in flat}


def _check_npz_paths(path: str, meta: dict, flat) -> None:
  """Raises unless the leaves saved in the npz checkpoint at ``path`` are the
  target's, by key path and in order.

  The npz file stores leaf i as ``leaf_i``: without this check a changed model
  whose layers have the same shapes under other names would silently get each
  layer's weights in another layer. Checkpoints written before the paths were
  stored restore by position, with a warning.
  """
  target = [_path_key(p) for p, _ in flat]
  saved = meta.get("paths")
  if saved is None:
    if meta["num_leaves"] != len(flat):
      raise ValueError(f"checkpoint {path} has {meta['num_leaves']} arrays but the "
                       f"target has {len(flat)}; restore into the same structure.")
    warnings.warn(
        f"te_jax.checkpoint: {path} was saved without key paths (an older te_jax), so "
        "its leaves are restored by position only and a renamed layer of the same shape "
        "would go unnoticed. Save it again to store the paths.", stacklevel=3)
    return
  saved = [tuple(p) for p in saved]
  if saved == target:
    return
  only_saved = [p for p in saved if p not in set(target)]
  only_target = [p for p in target if p not in set(saved)]
  if only_saved or only_target:
    detail = (f"only in the checkpoint: {_show_paths(only_saved)}; "
              f"only in the target: {_show_paths(only_target)}")
  else:
    detail = "the same leaves in another order"
  raise ValueError(
      f"checkpoint {path} does not hold the target's leaves ({detail}). Restore into a "
      "target of the structure that was saved (the same model and optimizer), or "
      "rename the saved leaves first.")


def _show_paths(paths, limit: int = 5) -> str:
  """The first ``limit`` of ``paths`` (``_path_key`` tuples) as ``a/b/c``."""
  shown = ["/".join(p) for p in paths[:limit]]
  return str(shown) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def restore(directory: str, step: Optional[int] = None, *, target: Any,
            backend: str = "auto") -> Any:
  """Restores step ``step`` (default: the latest) into the structure of ``target``.

  Args:
    directory: checkpoint root given to :func:`save`.
    step: step to restore; None = :func:`latest_step`.
    target: pytree of the saved structure, e.g. ``TrainState.create(...)``
      of a fresh model. Its leaves (arrays, ``jax.ShapeDtypeStruct``, or
      Python scalars) give the shapes, dtypes and shardings of the result:
      see the module docstring for the rule of each kind of leaf. The npz
      backend needs the saved dtypes; orbax casts to the target's.
    backend: as in :func:`save`; "auto" reads whichever format is on disk.

  Returns:
    A pytree of the same structure as ``target``, every leaf a ``jax.Array``.
  """
  if backend not in _BACKENDS:
    raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}.")
  directory = os.path.abspath(directory)
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory}.")
  path = os.path.join(directory, str(int(step)))
  if not os.path.isdir(path):
    raise FileNotFoundError(
        f"no checkpoint for step {step} under {directory}; have {available_steps(directory)}.")
  default_sharding = _default_sharding()
  flat, treedef = jax.tree_util.tree_flatten_with_path(target)
  is_npz = os.path.exists(os.path.join(path, _META))
  if backend != "auto" and is_npz != (backend == "numpy"):
    written = "the numpy backend (.npz)" if is_npz else "orbax"
    raise ValueError(f"checkpoint {path} was written by {written}, not with backend="
                     f"{backend!r}; restore it with backend='auto' (reads either format).")
  if is_npz:
    with open(os.path.join(path, _META)) as fh:
      meta = json.load(fh)
    _check_npz_paths(path, meta, flat)
    with np.load(os.path.join(path, _NPZ)) as data:
      out = []
      for i, ((p, leaf), dt) in enumerate(zip(flat, meta["dtypes"])):
        name = _leaf_name(p)
        a = data[f"leaf_{i}"]
        if a.dtype.name != dt:  # saved as raw bytes (e.g. bfloat16, float8)
          a = a.view(np.dtype(getattr(ml_dtypes, dt, dt)))
        if _is_python_scalar(leaf):
          _check_scalar_source(name, leaf, a.shape, a.dtype)
          out.append(_scalar_result(name, leaf, a))
          continue
        want = _abstract_leaf(leaf, default_sharding)
        if a.dtype != np.dtype(want.dtype):
          raise ValueError(f"leaf {name}: checkpoint dtype {a.dtype} != target "
                           f"{np.dtype(want.dtype)}.")
        if a.shape != tuple(want.shape):
          raise ValueError(f"leaf {name}: checkpoint shape {a.shape} != target {want.shape}.")
        out.append(jax.device_put(a, want.sharding))
    return jax.tree.unflatten(treedef, out)

  ocp = _ocp(required=True)
  # orbax restores a Python-scalar target leaf as the saved value itself,
  # converted to the target's type (a float 2.5 would come back as the int 2),
  # so those leaves are first checked against the saved metadata, as the npz
  # path checks them against the saved arrays.
  abstract = [leaf if _is_python_scalar(leaf) else _abstract_leaf(leaf, default_sharding)
              for _, leaf in flat]
  ckptr = ocp.StandardCheckpointer()
  try:
    scalars = [(p, leaf) for p, leaf in flat if _is_python_scalar(leaf)]
    if scalars:
      saved = _orbax_leaf_metadata(ckptr, path)
      for p, leaf in scalars:
        m = saved.get(_path_key(p))
        if m is not None and hasattr(m, "shape") and hasattr(m, "dtype"):
          _check_scalar_source(_leaf_name(p), leaf, m.shape, m.dtype)
    restored = ckptr.restore(path, jax.tree.unflatten(treedef, abstract))
  finally:
    ckptr.close()
  out = [_scalar_result(_leaf_name(p), leaf, r) if _is_python_scalar(leaf) else r
         for (p, leaf), r in zip(flat, treedef.flatten_up_to(restored))]
  return jax.tree.unflatten(treedef, out)
