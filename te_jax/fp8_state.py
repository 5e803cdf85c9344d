"""Delayed-scaling state: amax histories and scales, and how they update.

Each FP8 GEMM under ``DelayedScaling`` keeps, for its input ``x``, its
``kernel`` and its output gradient ``grad``, a dict::

  {"amax_history": float32[amax_history_len],  # newest first
   "scale":        float32[]}                   # the scale quantizing this step

The state lives in the Flax collection ``FP8_COLLECTION``
(``"_overwrite_with_gradient"``, the name Flax's own FP8 ops use). The
backward pass returns the *updated* state as the state's "gradient", so:

* ``flax.training.train_state.TrainState.apply_gradients`` replaces it (it
  treats that collection as overwrite-with-gradient) -- no extra code;
* in a plain ``jax.grad`` + optax loop, call :func:`apply_fp8_updates`.

Update rules (Transformer Engine's): the amax of this step is pushed into
the history; ``scale = fp8_max / reduce(history) / 2**margin``, clamped to
the float32 max (a tiny amax gives FLT_MAX, never inf); when the reduced
amax is 0 (a step whose tensor or gradient is all zeros) or this step's
amax is not finite, the previous scale is kept (recorded in the history as
0). The scale itself is stored and used to quantize: the GEMM reads
``1 / scale``, and no ``1 / (1 / scale)`` round trip ever changes it.

Outlier guard (``DelayedScaling.outlier_factor``, default 2**12; None is
TE's rule): without it, one batch holding a huge finite value (say 1e30)
puts its amax in the history, and for the next ``amax_history_len`` steps
every value of that tensor quantizes to zero. With it, the reduce looks at
the largest and second-largest amax of its window (the whole history for
"max", the three newest entries for "most_recent"); when the largest is
more than ``outlier_factor`` times the second and at least two other
entries are positive (with one, which of the two is odd is unclear), the
second sets the scale. So an outlier saturates in its own step only (it
was quantized with the scale from before it) and later steps keep their
scale; a second amax of the same size (a real, lasting jump) is no longer
an outlier and takes over, after one saturated step. The guard adds a few
scalar operations per tensor to the state update; the quantize and GEMM
kernels are untouched. :func:`ignored_outliers` counts the tensors whose
scale currently ignores an outlier, for a training loop to log.

A state whose "gradient" came back as zeros (its module's output did not
reach the loss) has scale 0; that reads as "no scale yet": the module
quantizes with scale 1 until its next update.

A GEMM used several times in one step (a shared layer, tied weights, a
block applied twice) reads its state through :func:`merge_uses`
(``te_jax.fp8_merge``): autodiff would otherwise SUM the uses' new states;
with it they merge into one update, the largest amax in one history entry.

Microbatches merge exactly (:func:`accumulate_gradients`): the histories with
``max`` (the newest entry becomes the largest microbatch amax) and the scales
with ``min`` over the positive ones (the scale falls as the amax grows), which
is the state one big batch would give.

Checkpoints from before 2026-12-02 stored ``scale_inv`` (0 meaning scale 1)
instead of ``scale``: :func:`migrate_scale_inv` converts such a tree.

Example (plain optax loop with gradient accumulation)::

  grads = None
  for mb in microbatches:
    g = jax.grad(loss_fn)(variables, mb)
    grads = g if grads is None else te_jax.accumulate_gradients(grads, g)
  param_grads = jax.tree.map(lambda g: g / len(microbatches), grads["params"])
  updates, opt_state = tx.update(param_grads, opt_state, variables["params"])
  variables = te_jax.apply_fp8_updates(variables, grads)
  variables["params"] = optax.apply_updates(variables["params"], updates)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict

import jax
import jax.numpy as jnp

from te_jax.fp8_merge import (checkpoint_bodies, merge_uses, share_tree, shared_state,
                              tie_unused, unshare_tree)
from te_jax.ops.quantize import compute_scale, is_positive_amax

__all__ = [
    "FP8_COLLECTION",
    "FP8StateWarning",
    "init_tensor_state",
    "init_dense_state",
    "scale_from_state",
    "update_tensor_state",
    "accumulate_gradients",
    "apply_fp8_updates",
    "keep_where_unused",
    "ignored_outliers",
    "migrate_scale_inv",
    "merge_uses",
    "shared_state",
    "tie_unused",
    "share_tree",
    "unshare_tree",
    "checkpoint_bodies",
]

FP8_COLLECTION = "_overwrite_with_gradient"


class FP8StateWarning(UserWarning):
  """A module's delayed-scaling FP8 state is not doing what training needs:
  it does not advance across steps (``te_jax.nnx.apply_fp8_updates`` not
  called), or the module runs with FP8 off or another recipe (the state is
  kept, unused). Raised once per module (``warnings``: filter it with
  ``warnings.filterwarnings("ignore", category=FP8StateWarning)``)."""
DENSE_TENSORS = ("x", "kernel", "grad")


def init_tensor_state(amax_history_len: int) -> Dict[str, jax.Array]:
  """Fresh state of one tensor: empty history, scale 1.

  >>> init_tensor_state(2)["scale"].tolist()
  1.0
  """
  return {"amax_history": jnp.zeros((amax_history_len,), jnp.float32),
          "scale": jnp.ones((), jnp.float32)}


def init_dense_state(amax_history_len: int) -> Dict[str, Dict[str, jax.Array]]:
  """State of one FP8 GEMM: ``{"x": ..., "kernel": ..., "grad": ...}``."""
  return {name: init_tensor_state(amax_history_len) for name in DENSE_TENSORS}


def scale_from_state(state) -> jax.Array:
  """The scale to quantize with this step (float32 scalar).

  A zero or non-finite stored scale (a state whose backward pass never ran,
  so its "gradient" came back as zeros) means scale 1.
  """
  s = state["scale"]
  ok = jnp.isfinite(s) & (s > 0)
  return jnp.where(ok, s, 1.0).astype(jnp.float32)


def update_tensor_state(state, amax: jax.Array, recipe, dtype):
  """Pushes this step's ``amax`` and computes the scale of the next step.

  Keeps the previous scale when the reduced amax is 0 or ``amax`` is not
  finite (which the history records as 0); see the module docstring.

  >>> from te_jax import recipe
  >>> r = recipe.DelayedScaling(amax_history_len=2)
  >>> st = update_tensor_state(init_tensor_state(2), jnp.float32(2.0), r, jnp.float8_e4m3fn)
  >>> st["amax_history"].tolist(), st["scale"].tolist()
  ([2.0, 0.0], 224.0)
  >>> update_tensor_state(st, jnp.float32(jnp.inf), r, jnp.float8_e4m3fn)["scale"].tolist()
  224.0
  """
  amax = amax.astype(jnp.float32)
  finite = jnp.isfinite(amax)
  history = jnp.roll(state["amax_history"], 1).at[0].set(jnp.where(finite, amax, 0.0))
  reduced = _reduce_history(history, recipe.amax_compute_algo,
                            getattr(recipe, "outlier_factor", None))
  new = compute_scale(reduced, dtype, margin=recipe.margin)
  scale = jnp.where(finite & is_positive_amax(reduced), new, scale_from_state(state))
  return {"amax_history": history, "scale": scale.astype(jnp.float32)}


# An amax is judged against at least this many other positive amaxes of its
# window: with one other, it is unclear which of the two is the odd one (a
# near-zero step followed by a normal one must not be read as an outlier).
_OUTLIER_MIN_OTHERS = 2


def _top2_and_positives(values):
  """(largest, second-largest, number of positive entries) of a 1-D array,
  in one reduction pass; equal largest entries give second == largest."""
  def combine(a, b):
    (a1, a2, an), (b1, b2, bn) = a, b
    return (jnp.maximum(a1, b1), jnp.maximum(jnp.minimum(a1, b1), jnp.maximum(a2, b2)),
            an + bn)
  inf = jnp.float32(-jnp.inf)
  return jax.lax.reduce((values, jnp.full_like(values, -jnp.inf), (values > 0).astype(jnp.int32)),
                        (inf, inf, jnp.int32(0)), combine, (0,))


def _outlier_and_reduced(history, algo, factor):
  """(is the window's largest amax an outlier, the amax the scale comes
  from): the window is the whole history for "max", the three newest
  entries for "most_recent". The largest is an outlier when it exceeds
  ``factor`` times every other entry and at least ``_OUTLIER_MIN_OTHERS``
  others are positive (for "most_recent", only when it is the newest);
  equal largest entries are no outlier. The scale then comes from the
  second-largest instead of the recipe's reduce.

  For "max", one reduction pass over the history gives the largest (the
  recipe's reduce), the second and the count: the guard runs in every
  GEMM's state update of every step."""
  if algo == "max":
    window = history
    if window.shape[0] < _OUTLIER_MIN_OTHERS + 1:
      return jnp.zeros((), bool), jnp.max(history)
    top, second, positives = _top2_and_positives(window)
    others_positive = positives - (top > 0)
    plain = top
  else:               # "most_recent": only the newest entry can be the outlier
    window = history[:_OUTLIER_MIN_OTHERS + 1]
    plain = history[0]
    if window.shape[0] < _OUTLIER_MIN_OTHERS + 1:
      return jnp.zeros((), bool), plain
    top, second = window[0], jnp.max(window[1:])
    others_positive = jnp.sum(window[1:] > 0)
  outlier = (others_positive >= _OUTLIER_MIN_OTHERS) & (top > jnp.float32(factor) * second)
  return outlier, jnp.where(outlier, jnp.maximum(second, 0.0), plain)


def _reduce_history(history, algo, factor):
  """The amax this step's update computes the scale from: the recipe's
  reduce ("max" of the history or its newest entry), or with the outlier
  guard on (``factor`` not None) the second-largest amax when the largest
  is an outlier."""
  if factor is not None:
    return _outlier_and_reduced(history, algo, factor)[1]
  return jnp.max(history) if algo == "max" else history[0]


def ignored_outliers(tree: Any, recipe) -> jax.Array:
  """How many tensors' scales ignore an outlier amax in their history now.

  Args:
    tree: a variables dict, its FP8 collection, or any pytree holding
      per-tensor states (``{"amax_history": ..., "scale": ...}`` dicts).
    recipe: the ``DelayedScaling`` recipe the states were updated with.

  Returns:
    int32 scalar (0 when ``recipe.outlier_factor`` is None). Nonzero for
    ``amax_history_len`` steps after an outlier (for "most_recent", one).
  """
  factor = getattr(recipe, "outlier_factor", None)
  count = jnp.zeros((), jnp.int32)
  if factor is None:
    return count
  def visit(node):
    nonlocal count
    if isinstance(node, Mapping) and "amax_history" in node and "scale" in node:
      hist = jnp.asarray(node["amax_history"], jnp.float32)
      flat = hist.reshape(-1, hist.shape[-1])   # stacked layers (nn.scan) too
      flags = jax.vmap(
          lambda h: _outlier_and_reduced(h, recipe.amax_compute_algo, factor)[0])(flat)
      count = count + jnp.sum(flags, dtype=jnp.int32)
    elif isinstance(node, Mapping):   # a dict or a flax FrozenDict
      for v in node.values():
        visit(v)
  visit(tree)
  return count


def _merge(path, a, b):
  """One leaf of two microbatches' states: ``scale`` by the min of the positive
  ones (0 is a state that did not run), everything else by max."""
  if path and getattr(path[-1], "key", None) == "scale":
    return jnp.where(a > 0, jnp.where(b > 0, jnp.minimum(a, b), a), b)
  return jnp.maximum(a, b)


def _fp8_part(tree: Any):
  """``tree[FP8_COLLECTION]``, or None when ``tree`` is not a mapping holding it.
  A mapping is a dict or a ``flax.core.FrozenDict`` (not a dict subclass)."""
  if isinstance(tree, Mapping) and FP8_COLLECTION in tree:
    return tree[FP8_COLLECTION]
  return None


def _check_same_state_tree(a, b, what: str):
  """Raises a ValueError naming the paths that only one of two FP8 state
  trees holds (a model changed between them, or two models' trees)."""
  paths_a = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]}
  paths_b = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(b)[0]}
  if paths_a != paths_b:
    raise ValueError(
        f"{what}: the two FP8 states ('{FP8_COLLECTION}') hold different tensors: only in "
        f"the first {sorted(paths_a - paths_b)[:5]}, only in the second "
        f"{sorted(paths_b - paths_a)[:5]}. Pass trees of the same model.")


def accumulate_gradients(acc: Any, grads: Any) -> Any:
  """Adds two gradient trees, merging the FP8 state with ``max``.

  Args:
    acc: accumulated gradients, a Flax variables-like dict or FrozenDict (or
      any pytree).
    grads: gradients of one more microbatch, same structure.

  Returns:
    ``acc + grads`` for parameters; for ``FP8_COLLECTION`` the exact merge of
    the module docstring (histories by max, scales by min), in the container
    type of ``acc``.

  Raises:
    ValueError: only one of the two holds FP8 state (one microbatch's
      gradients were taken with respect to the parameters alone, so its
      amaxes would be lost), or their FP8 states hold different tensors.
  """
  acc_state, new_state = _fp8_part(acc), _fp8_part(grads)
  if acc_state is None and new_state is None:
    return jax.tree.map(jnp.add, acc, grads)
  if acc_state is None or new_state is None:
    has, lacks = ("acc", "grads") if new_state is None else ("grads", "acc")
    raise ValueError(
        f"accumulate_gradients: {has} holds the FP8 state ('{FP8_COLLECTION}') but {lacks} "
        "does not, so that microbatch's amaxes would be lost. Take every microbatch's "
        "gradients with respect to the whole variables (jax.grad(loss_fn)(variables, "
        "batch), parameters and FP8 state), not variables['params'] alone.")
  if set(acc) != set(grads):
    raise ValueError(f"accumulate_gradients: acc has collections {sorted(acc)} but grads "
                     f"has {sorted(grads)}; pass gradients of the same variables.")
  _check_same_state_tree(acc_state, new_state, "accumulate_gradients")
  out = {k: jax.tree.map(jnp.add, v, grads[k]) for k, v in acc.items()
         if k != FP8_COLLECTION}
  out[FP8_COLLECTION] = jax.tree_util.tree_map_with_path(_merge, acc_state, new_state)
  return type(acc)(out)


def keep_where_unused(new, old):
  """``new``, except the tensors whose state came back as zeros (scale 0: no
  GEMM used that state in the step, e.g. its output did not reach the
  loss), which keep ``old``: their amax history is not wiped."""
  if isinstance(new, Mapping) and "scale" in new and "amax_history" in new:
    used = jnp.asarray(new["scale"]) > 0
    # One scale per history row (a GEMM's (H,) history with a () scale, or
    # per expert / per layer rows): the row's mask, shaped for each leaf.
    rows = jnp.shape(new["amax_history"])[:-1]
    mask = {"scale": used, "amax_history": used.reshape(rows + (1,))}
    return {k: jnp.where(mask.get(k, used), v, old[k]) if k in old else v
            for k, v in new.items()}
  if isinstance(new, Mapping):
    return {k: keep_where_unused(v, old[k]) if k in old else v for k, v in new.items()}
  return new


def apply_fp8_updates(variables: Mapping[str, Any], grads: Mapping[str, Any]) -> Any:
  """Returns ``variables`` with its FP8 state replaced by the one in ``grads``.

  For training loops that do not use ``TrainState.apply_gradients``. A
  tensor whose state came back as zeros (no GEMM used it in the step) keeps
  its state, as ``te_jax.nnx.apply_fp8_updates`` does. The result has the
  container type of ``variables`` (dict or ``flax.core.FrozenDict``).

  Args:
    variables: the model's variables (``"params"``, ``FP8_COLLECTION``, ...).
    grads: ``jax.grad`` of the loss with respect to the whole ``variables``
      (or their ``accumulate_gradients``).

  Raises:
    ValueError: ``variables`` holds FP8 state but ``grads`` holds none (the
      gradients were taken with respect to ``variables["params"]`` only: the
      scales would silently stay frozen), or the two FP8 states hold
      different tensors.
  """
  old = _fp8_part(variables)
  new = _fp8_part(grads)
  if old is not None and new is None:
    raise ValueError(
        f"apply_fp8_updates: variables hold the delayed-scaling FP8 state "
        f"('{FP8_COLLECTION}') but grads has none, so the scales would stay frozen. "
        "Differentiate with respect to the whole variables, jax.grad(loss_fn)(variables, "
        "...) (parameters and FP8 state), and update the parameters from grads['params'].")
  out = dict(variables)
  if new is not None:
    if old is not None:
      _check_same_state_tree(old, new, "apply_fp8_updates")
      new = keep_where_unused(new, old)
    out[FP8_COLLECTION] = new
  return type(variables)(out) if isinstance(variables, Mapping) else out


def migrate_scale_inv(tree: Any) -> Any:
  """Converts FP8 state saved before 2026-12-02 to today's layout.

  Every ``{"amax_history": h, "scale_inv": s}`` dict in ``tree`` (a variables
  dict, a TrainState's params, or the FP8 collection) becomes
  ``{"amax_history": h, "scale": 1 / s}`` (``scale_inv`` 0 meant scale 1);
  everything else is returned as it is.

  >>> old = {"x": {"amax_history": jnp.zeros(2), "scale_inv": jnp.float32(0.25)}}
  >>> migrate_scale_inv(old)["x"]["scale"].tolist()
  4.0
  """
  if isinstance(tree, Mapping):   # a dict or a flax FrozenDict
    if set(tree) == {"amax_history", "scale_inv"}:
      s_inv = jnp.asarray(tree["scale_inv"], jnp.float32)
      ok = jnp.isfinite(s_inv) & (s_inv > 0)
      return {"amax_history": tree["amax_history"],
              "scale": jnp.where(ok, 1.0 / jnp.where(ok, s_inv, 1.0), 1.0)}
    return type(tree)((k, migrate_scale_inv(v)) for k, v in tree.items())
  return tree
