"""Delayed-scaling state: amax histories and scales, and how they update.

Each FP8 GEMM under ``DelayedScaling`` keeps, for its input ``x``, its
``kernel`` and its output gradient ``grad``, a dict::

  {"amax_history": float32[amax_history_len],  # newest first
   "scale_inv":    float32[]}                   # 1 / scale used this step;
                                                # 0 means scale 1

The state lives in the Flax collection ``FP8_COLLECTION``
(``"_overwrite_with_gradient"``, the name Flax's own FP8 ops use). The
backward pass returns the *updated* state as the state's "gradient", so:

* ``flax.training.train_state.TrainState.apply_gradients`` replaces it (it
  treats that collection as overwrite-with-gradient) -- no extra code;
* in a plain ``jax.grad`` + optax loop, call :func:`apply_fp8_updates`.

Every leaf of the state merges with ``max`` across microbatches: the newest
history entry becomes the max of the microbatches' amaxes, and ``scale_inv``
(monotone in the amax) the max of theirs, which is exactly the state one big
batch would give. Zeros are the identity of that merge, which is why the
state stores ``scale_inv`` rather than ``scale``.

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

from typing import Any, Dict

import jax
import jax.numpy as jnp

from te_jax.ops.quantize import compute_scale

__all__ = [
    "FP8_COLLECTION",
    "init_tensor_state",
    "init_dense_state",
    "scale_from_state",
    "update_tensor_state",
    "accumulate_gradients",
    "apply_fp8_updates",
]

FP8_COLLECTION = "_overwrite_with_gradient"
DENSE_TENSORS = ("x", "kernel", "grad")


def init_tensor_state(amax_history_len: int) -> Dict[str, jax.Array]:
  """Fresh state of one tensor: empty history, scale 1."""
  return {"amax_history": jnp.zeros((amax_history_len,), jnp.float32),
          "scale_inv": jnp.ones((), jnp.float32)}


def init_dense_state(amax_history_len: int) -> Dict[str, Dict[str, jax.Array]]:
  """State of one FP8 GEMM: ``{"x": ..., "kernel": ..., "grad": ...}``."""
  return {name: init_tensor_state(amax_history_len) for name in DENSE_TENSORS}


def scale_from_state(state) -> jax.Array:
  """The scale to quantize with this step: ``1 / scale_inv``.

  A zero or non-finite ``scale_inv`` (a state whose backward pass never ran,
  so its "gradient" came back as zeros) means scale 1.
  """
  s_inv = state["scale_inv"]
  ok = jnp.isfinite(s_inv) & (s_inv > 0)
  return jnp.where(ok, 1.0 / jnp.where(ok, s_inv, 1.0), 1.0).astype(jnp.float32)


def update_tensor_state(state, amax: jax.Array, recipe, dtype):
  """Pushes this step's ``amax`` and recomputes the scale for the next step.

  A non-finite amax is recorded as 0 and leaves ``scale_inv`` unchanged.
  """
  amax = amax.astype(jnp.float32)
  finite = jnp.isfinite(amax)
  history = jnp.roll(state["amax_history"], 1).at[0].set(
      jnp.where(finite, amax, 0.0))
  if recipe.amax_compute_algo == "max":
    reduced = jnp.max(history)
  else:
    reduced = history[0]
  scale = compute_scale(reduced, dtype, margin=recipe.margin)
  # An all-zero history means scale 1, stored as scale_inv 0 (which
  # scale_from_state reads as 1): storing 1 would break the max-merge, since
  # 1 / scale is otherwise monotone in the amax and 1 could exceed a real
  # microbatch's scale_inv.
  scale_inv = jnp.where(reduced > 0, 1.0 / scale, 0.0)
  scale_inv = jnp.where(finite, scale_inv, state["scale_inv"])
  return {"amax_history": history, "scale_inv": scale_inv.astype(jnp.float32)}


def _merge_max(a, b):
  return jax.tree.map(jnp.maximum, a, b)


def accumulate_gradients(acc: Any, grads: Any) -> Any:
  """Adds two gradient trees, merging the FP8 state with ``max``.

  Args:
    acc: accumulated gradients, a Flax variables-like dict (or any pytree).
    grads: gradients of one more microbatch, same structure.

  Returns:
    ``acc + grads`` for parameters; elementwise max for ``FP8_COLLECTION``.
  """
  if isinstance(acc, dict) and FP8_COLLECTION in acc:
    out = {k: jax.tree.map(jnp.add, v, grads[k]) for k, v in acc.items()
           if k != FP8_COLLECTION}
    out[FP8_COLLECTION] = _merge_max(acc[FP8_COLLECTION], grads[FP8_COLLECTION])
    return out
  return jax.tree.map(jnp.add, acc, grads)


def apply_fp8_updates(variables: Dict[str, Any], grads: Dict[str, Any]) -> Dict[str, Any]:
  """Returns ``variables`` with its FP8 state replaced by the one in ``grads``.

  For training loops that do not use ``TrainState.apply_gradients``.
  """
  if FP8_COLLECTION not in grads:
    return dict(variables)
  out = dict(variables)
  out[FP8_COLLECTION] = grads[FP8_COLLECTION]
  return out
