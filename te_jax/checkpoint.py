"""Save and restore a training state (parameters, optimizer and FP8 state).

A thin layer over `orbax-checkpoint <https://orbax.readthedocs.io>`_ for the
common case: one pytree (e.g. a ``flax.training.train_state.TrainState``
whose ``params`` hold the ``"_overwrite_with_gradient"`` FP8 collection)
saved as ``<directory>/<step>/``. Restoring needs a *target* of the same
structure (the freshly initialized state, or its ``jax.eval_shape``) whose
leaves carry the shapes, dtypes and shardings to restore into, so a sharded
state comes back sharded the same way.

orbax is imported lazily. When it is missing, ``backend="auto"`` falls back
to a single-host ``.npz`` file per step (exact bytes, same directory layout);
``backend="orbax"`` raises an ImportError that says what to install.

Example::

  from te_jax import checkpoint
  checkpoint.save("/tmp/ckpt", step, state)                 # after a step
  step = checkpoint.latest_step("/tmp/ckpt")                # None if empty
  state = checkpoint.restore("/tmp/ckpt", step, target=state)
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import jax
import ml_dtypes
import numpy as np

__all__ = ["save", "restore", "latest_step", "available_steps", "orbax_available"]

_BACKENDS = ("auto", "orbax", "numpy")
_NPZ = "state.npz"
_META = "te_jax_meta.json"


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
    tree: pytree of arrays (a TrainState, a variables dict, ...).
    keep: keep only the newest ``keep`` steps (None keeps all).
    backend: "auto" (orbax if installed, else npz), "orbax" or "numpy".

  Returns:
    The path of the step's checkpoint directory.
  """
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"step must be a non-negative int, got {step!r}.")
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
    leaves = jax.tree.leaves(tree)
    arrays, dtypes = {}, []
    for i, leaf in enumerate(leaves):
      a = np.asarray(jax.device_get(leaf))
      dtypes.append(a.dtype.name)
      if a.dtype.kind == "V" or a.dtype.name not in np.sctypeDict:
        a = a.view(f"u{a.dtype.itemsize}")      # bfloat16 / float8: keep the bytes
      arrays[f"leaf_{i}"] = a
    os.makedirs(tmp)
    np.savez(os.path.join(tmp, _NPZ), **arrays)
    with open(os.path.join(tmp, _META), "w") as fh:
      json.dump({"num_leaves": len(leaves), "dtypes": dtypes}, fh)
  old = path + ".old"
  if os.path.exists(path):
    if os.path.exists(old):
      shutil.rmtree(old)
    os.replace(path, old)
  os.replace(tmp, path)
  shutil.rmtree(old, ignore_errors=True)
  _prune(directory, keep)
  return path


def _abstract(target):
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  return jax.tree.map(one, target)


def restore(directory: str, step: Optional[int] = None, *, target: Any,
            backend: str = "auto") -> Any:
  """Restores step ``step`` (default: the latest) into the structure of ``target``.

  Args:
    directory: checkpoint root given to :func:`save`.
    step: step to restore; None = :func:`latest_step`.
    target: pytree like the saved one (arrays or ``jax.ShapeDtypeStruct``);
      its shapes, dtypes and shardings are those of the result.
    backend: as in :func:`save`; "auto" reads whichever format is on disk.

  Returns:
    A pytree of the same structure as ``target``.
  """
  directory = os.path.abspath(directory)
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory}.")
  path = os.path.join(directory, str(int(step)))
  if not os.path.isdir(path):
    raise FileNotFoundError(
        f"no checkpoint for step {step} under {directory}; have {available_steps(directory)}.")
  abstract = _abstract(target)
  if os.path.exists(os.path.join(path, _META)) and backend != "orbax":
    with open(os.path.join(path, _META)) as fh:
      meta = json.load(fh)
    leaves, treedef = jax.tree.flatten(abstract)
    if meta["num_leaves"] != len(leaves):
      raise ValueError(f"checkpoint {path} has {meta['num_leaves']} arrays but the "
                       f"target has {len(leaves)}; restore into the same structure.")
    with np.load(os.path.join(path, _NPZ)) as data:
      out = []
      for i, (leaf, dt) in enumerate(zip(leaves, meta["dtypes"])):
        a = data[f"leaf_{i}"]
        if a.dtype.name != dt:  # saved as raw bytes (e.g. bfloat16, float8)
          a = a.view(np.dtype(getattr(ml_dtypes, dt, dt)))
        if a.dtype != np.dtype(leaf.dtype):
          raise ValueError(f"leaf {i}: checkpoint dtype {a.dtype} != target "
                           f"{np.dtype(leaf.dtype)}.")
        if a.shape != tuple(leaf.shape):
          raise ValueError(f"leaf {i}: checkpoint shape {a.shape} != target {leaf.shape}.")
        sh = getattr(leaf, "sharding", None)
        out.append(jax.device_put(a, sh) if sh is not None else jax.numpy.asarray(a))
    return jax.tree.unflatten(treedef, out)
  ocp = _ocp(required=True)
  ckptr = ocp.StandardCheckpointer()
  try:
    return ckptr.restore(path, abstract)
  finally:
    ckptr.close()
