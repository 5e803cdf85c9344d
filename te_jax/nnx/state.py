"""The FP8 state of the NNX modules, and how a training step advances it.

Under ``DelayedScaling`` every FP8 GEMM of a ``te_jax.nnx`` module keeps its
amax histories and scales (the layout of ``te_jax.fp8_state``: ``{"x" |
"kernel" | "grad": {"amax_history", "scale"}}``) in an :class:`FP8State`
variable, created when the module is constructed inside
``te_jax.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...))`` (or
added later by :func:`init_fp8_state`). The other recipes keep no state.

The functional layer returns the *updated* state as the state's gradient
(the state of step t+1 depends on the gradient amax of step t, known only in
the backward pass). A training step therefore

1. differentiates with respect to the parameters *and* the FP8 state:
   ``nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, te_jax.nnx.WRT))``
   (``WRT = (nnx.Param, FP8State)``);
2. updates the parameters as usual (``nnx.Optimizer(model, tx,
   wrt=nnx.Param)`` ignores the FP8 state's "gradients");
3. writes the new state into the model: ``te_jax.nnx.apply_fp8_updates(model,
   grads)`` -- the one te_jax call of the loop.

A state whose "gradient" is zero (its GEMM did not run in FP8 with this
state in that step: FP8 switched off, another recipe, or an output that did
not reach the loss) is kept as it was.

Forgetting step 3 (or step 1) would freeze the scales at their initial
values. Each module with FP8 state therefore keeps an :class:`FP8Counters`
variable: a forward pass that sees the parameters changed since the previous
forward pass counts one step, :func:`apply_fp8_updates` resets the count,
and a count of 2 (a second optimizer step without an update of the FP8
state) raises an :class:`FP8StateWarning` once per module. The count is
computed on the device; it is read on the host when the step's results are
written into the model (``nnx.jit``, ``nnx.update``, eager calls), and only
once it is ready, so the check never makes the host wait for the device (a
step's count is usually read when the next step is written back). A loop
that carries ``nnx.split`` states through ``jax.jit`` itself never writes
them into the model: call :func:`check_fp8_updates` on its state now and
then. Gradient accumulation (several forward passes on the same parameters,
one update) and evaluation passes do not count as steps. A change of the
parameters is seen through a probe spread over each kernel
(``te_jax.layers.state.kernel_probe``); counts that a step jitted with
``donate_argnums`` deletes are never read (a private copy is, instead).

Every read of a state merges (``te_jax.fp8_state.merge_uses``): a module
called several times in one step gets one update. Inside ``nnx.remat`` the
state is a new value per call and later calls reuse the first call's trace,
so their updates would add unseen: a read there gives an ``FP8StateWarning``
(once per module and state; one call per step is correct) unless the
model's states are shared for the calls (:func:`shared_fp8_state`), which
merges them.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx
from flax.core import spmd

from te_jax import fp8_state as state_lib
from te_jax.fp8_state import FP8StateWarning
from te_jax.layers import settings as layer_settings
from te_jax.layers import state as layer_state

__all__ = ["FP8State", "FP8Counters", "FP8StateWarning", "WRT", "diff_state",
           "apply_fp8_updates", "accumulate_gradients", "init_fp8_state",
           "remove_update_check", "check_fp8_updates", "read_autocast", "NnxStates",
           "gemm_state", "track_updates", "add_fp8_state", "shared_fp8_state"]

COUNTERS = "fp8_counters"


class FP8State(nnx.Variable):
  """The delayed-scaling state of one FP8 GEMM (a ``te_jax.fp8_state`` dict).

  Its "gradient" is the updated state: differentiate with respect to it
  (``nnx.DiffState(0, te_jax.nnx.WRT)``) and write it back with
  :func:`apply_fp8_updates`. Not a ``nnx.Param``: ``nnx.Optimizer(...,
  wrt=nnx.Param)`` leaves it alone.
  """


class FP8Counters(nnx.Variable):
  """Bookkeeping of a module's FP8 state updates (see the module docstring):
  ``{"pending": int32, "probe": float32}``. Never differentiated.

  Every write of a concrete (not traced) value is checked on the host,
  without waiting for the device (:func:`_check_when_ready`).
  """

  def set_value(self, value, **kwargs):
    super().set_value(value, **kwargs)
    _check_when_ready(self, value)

  def set_raw_value(self, value, **kwargs):      # nnx.jit writes results back here
    super().set_raw_value(value, **kwargs)
    _check_when_ready(self, value)

  def update_from_state(self, variable_state):   # ... and nnx.update here
    super().update_from_state(variable_state)
    _check_when_ready(self, self.get_raw_value())


# The filter of everything a training step differentiates.
WRT = (nnx.Param, FP8State)


def diff_state(argnum: int = 0) -> nnx.DiffState:
  """``nnx.DiffState(argnum, (nnx.Param, FP8State))``: the ``argnums`` of
  ``nnx.value_and_grad`` / ``nnx.grad`` for a model with FP8 state."""
  return nnx.DiffState(argnum, WRT)


# ------------------------------------------------------------- creation ---

_UIDS = itertools.count(1)


def add_fp8_state(module: nnx.Module, mode) -> None:
  """Gives ``module`` one :class:`FP8State` per name of its ``FP8_GEMMS`` and
  its :class:`FP8Counters`, when ``mode`` (a ``ScalingMode``) keeps state."""
  if mode is None or not mode.uses_state:
    return
  for name in type(module).FP8_GEMMS:
    setattr(module, name, FP8State(mode.init_state()))
  setattr(module, COUNTERS, FP8Counters(
      {"pending": jnp.zeros((), jnp.int32), "probe": jnp.full((), jnp.nan, jnp.float32)},
      uid=next(_UIDS), module=type(module).__name__))


def init_fp8_state(model: nnx.Module, recipe) -> nnx.Module:
  """Gives every te_jax.nnx FP8 GEMM of ``model`` the state ``recipe`` needs.

  For a model constructed outside ``fp8_autocast`` (or under another recipe)
  that is to train under ``recipe``: fresh delayed-scaling state (existing
  state is replaced); for a recipe without state, the existing state and
  its update counters are removed (a module holding state that its recipe
  does not use warns). Returns ``model`` (changed in place).
  """
  mode = recipe.scaling_mode()
  for _, m in list(nnx.iter_modules(model)):
    if getattr(type(m), "FP8_GEMMS", None):
      if mode.uses_state:
        add_fp8_state(m, mode)
        continue
      for name in type(m).FP8_GEMMS + (COUNTERS,):
        if isinstance(getattr(m, name, None), (FP8State, FP8Counters)):
          delattr(m, name)
  return model


def remove_update_check(model: nnx.Module) -> nnx.Module:
  """Removes the "FP8 state advanced" check from ``model``.

  Deletes every :class:`FP8Counters` of the te_jax.nnx modules in
  ``model``, so a forgotten :func:`apply_fp8_updates` is no longer reported
  (and the step no longer computes the counts: a few scalar operations per
  module). Changes ``model`` in place and returns it; :func:`init_fp8_state`
  adds the check back.
  """
  for _, m in nnx.iter_modules(model):
    if isinstance(getattr(m, COUNTERS, None), FP8Counters):
      delattr(m, COUNTERS)
  return model


def read_autocast(impl: str = "auto") -> layer_settings.Settings:
  """The innermost ``fp8_autocast`` as ``te_jax.layers.settings.Settings``
  (FP8 off outside any), with the logical axis rules ``nnx.logical_axis_rules``
  puts in effect.

  Args:
    impl: the calling module's ``impl`` ("auto", "cuda", "reference");
      ``TE_JAX_IMPL`` still overrides "auto".
  """
  return layer_settings.read_settings(impl, spmd.get_logical_axis_rules())


def construction_mode(impl: str):
  """The scaling mode of the autocast active while a module is constructed
  (None with FP8 off); ``impl`` is checked."""
  return read_autocast(impl).mode


# ------------------------------------------------------------- forward ---

def _state_shapes_error(name, got, want, mode):
  hint = "construct the model under the recipe used for training (or call "
  hint += "te_jax.nnx.init_fp8_state(model, recipe))."
  if "scale_inv" in str(got):
    hint = ("this is the layout of checkpoints from before 2026-12-02 (scale_inv): "
            "convert the restored state with te_jax.fp8_state.migrate_scale_inv.")
  return ValueError(f"FP8 state '{name}' has shapes {got} but the active recipe "
                    f"{mode.recipe} needs {want} (e.g. another amax_history_len); {hint}")


def gemm_state(module: nnx.Module, name: str, mode):
  """The state value of GEMM ``name`` of ``module`` for ``mode``; None when
  ``mode`` keeps none. Raises ValueError when it is missing or misshapen."""
  if not mode.uses_state:
    return None
  var = getattr(module, name, None)
  recipe_name = type(mode.recipe).__name__
  if not isinstance(var, FP8State):
    raise ValueError(
        f"{type(module).__name__}: {recipe_name} needs the FP8 state '{name}', but the "
        f"module has none. Construct the model inside fp8_autocast(enabled=True, "
        f"fp8_recipe={recipe_name}(...)) with the recipe used for training, or call "
        f"te_jax.nnx.init_fp8_state(model, recipe) first.")
  state = var.get_value()
  want = layer_state.state_shapes(jax.eval_shape(mode.init_state))
  got = layer_state.state_shapes(state)
  if got != want:
    raise _state_shapes_error(name, got, want, mode)
  return state


class NnxStates(layer_state.GemmStates):
  """The FP8 state of an NNX module's GEMMs, for the core: its :class:`FP8State`
  attributes, one per name of its ``FP8_GEMMS``; each forward pass that uses
  them is counted for the update check (:func:`track_updates`).

  Args:
    module: the module that owns the GEMMs.
  """

  def __init__(self, module: nnx.Module):
    self.module = module
    self.module_name = type(module).__name__
    self.warn_name = f"te_jax.nnx.{self.module_name}"
    self.drop_fix = "te_jax.nnx.init_fp8_state(model, recipe) with that recipe removes it"

  def has(self, name: str) -> bool:
    return isinstance(getattr(self.module, name, None), FP8State)

  def can_create(self) -> bool:
    return False   # created with the module (or by init_fp8_state), never in a call

  def peek(self, name: str):
    return getattr(self.module, name).get_value()

  def read(self, name: str, mode):
    return gemm_state(self.module, name, mode)

  def check_read(self, name: str, state) -> None:
    _check_remat_read(self.module_name, name, state)

  # tie: the base's (none). A kept state's "gradient" is zero, which
  # apply_fp8_updates reads as "keep".

  def track_updates(self, kernel: jax.Array) -> None:
    track_updates(self.module, kernel)


def _check_remat_read(module_name: str, name: str, state) -> None:
  """Raises when a float32 FP8 state is read inside ``nnx.remat`` (any
  ``jax.checkpoint``) of a differentiated step: the remat receives it as a new
  value, and its next call on the same model reuses this trace (nothing of
  te_jax runs then), so two calls would add their updates unseen. Read
  through :func:`shared_fp8_state`, the calls merge."""
  if layer_state.checkpoint_read_problem(state, None, seen_levels=0) is not None:
    layer_state.warn_unseen_calls(
        module_name, name,
        "call the remat'd function inside `with te_jax.nnx.shared_fp8_state(model):` "
        "(in the differentiated function); its calls then merge into one update.")


@contextlib.contextmanager
def shared_fp8_state(model: nnx.Module):
  """Inside the block, ``model``'s delayed-scaling FP8 states are shared:
  calls of ``nnx.remat`` (or ``jax.checkpoint``) on the model in a
  differentiated step merge their updates into one (the largest amax in one
  history entry) instead of adding them.

  Use it in the differentiated function, around the remat'd calls::

    def loss_fn(model):
      with te_jax.nnx.shared_fp8_state(model):
        return loss(block(model, a), block(model, b))   # block = nnx.remat(...)

  Each :class:`FP8State` being differentiated holds, inside, its state in
  the merging dtype of ``te_jax.fp8_state.merge_uses``, converted once in
  this trace (``te_jax.fp8_state.share_tree``); the float32 values are put
  back on exit, and the gradients come back float32. With FP8 off, a recipe
  without state or nothing differentiated it changes nothing.
  """
  mode = read_autocast().mode
  replaced = []
  for _, var in nnx.iter_graph(model):
    if isinstance(var, FP8State):
      value = var.get_value()
      shared = state_lib.share_tree(value, mode)
      if shared is not value:
        replaced.append((var, value))
        var.set_value(shared)
  try:
    yield model
  finally:
    for var, value in replaced:
      var.set_value(value)


_WARNED = set()
# uid -> the counts written last, not yet read (they were not ready).
_UNREAD: Dict[int, list] = {}
# uids whose counts a jitted step deleted (donate_argnums): read from copies.
_DONATED = set()


def _frozen_warning(module_name: str, pending: int) -> FP8StateWarning:
  return FP8StateWarning(
      f"te_jax.nnx: the delayed-scaling FP8 state of {module_name} has not advanced "
      f"over {pending} optimizer steps (its parameters changed, its amax "
      "histories and scales did not): its scales are frozen. After each step call "
      "te_jax.nnx.apply_fp8_updates(model, grads), with grads from "
      "nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, te_jax.nnx.WRT)) "
      "(parameters and FP8 state). See docs/nnx.md.")


def _check_when_ready(var: FP8Counters, value) -> None:
  """Warns once per module when a count written into ``var`` reached 2.

  Reads only counts the device has finished (``is_ready``); the others wait
  for the next write. The counts only grow until ``apply_fp8_updates``
  resets them, so reading the newest finished one is enough.

  A step jitted with ``donate_argnums`` (Flax's NNX tutorials write it so)
  deletes the counts it was given: the one this function kept waiting is
  gone by the next write. It is dropped, never read, and from then on the
  module's counts are read from a private device copy, one at a time (the
  copy is made when a count is written, before the next step can donate it).
  """
  pending = value.get("pending") if isinstance(value, dict) else None
  if not isinstance(pending, jax.Array) or isinstance(pending, jax.core.Tracer):
    return
  uid = var.get_metadata("uid", 0)
  if uid in _WARNED:
    return
  unread = _UNREAD.setdefault(uid, [])
  if any(p.is_deleted() for p in unread):
    _DONATED.add(uid)
    unread[:] = [p for p in unread if not p.is_deleted()]
  if uid not in _DONATED:
    unread.append(pending)
  elif not unread:
    unread.append(jnp.copy(pending))
  ready = [p.is_ready() for p in unread]          # once: a count may finish meanwhile
  done = [p for p, r in zip(unread, ready) if r]
  unread[:] = [p for p, r in zip(unread, ready) if not r][-2:]   # the newest matter
  if not done:
    return
  count = int(np.max(np.asarray(done[-1])))      # stacked layers: one per layer
  if count >= 2:
    _WARNED.add(uid)
    _UNREAD.pop(uid, None)
    warnings.warn(_frozen_warning(var.get_metadata("module", "a te_jax.nnx module"), count),
                  stacklevel=3)


def check_fp8_updates(tree) -> None:
  """Checks the update counts in ``tree`` now (waits for them).

  For loops that never write their results into an NNX model (``jax.jit``
  over ``nnx.split`` states): ``tree`` is the model or its ``nnx.State``.
  Warns (:class:`FP8StateWarning`, once per module) when a module's FP8
  state has not advanced over two optimizer steps.
  """
  if isinstance(tree, nnx.State):
    variables = [v for _, v in nnx.to_flat_state(nnx.filter_state(tree, FP8Counters))]
  else:
    variables = [v for _, v in nnx.iter_graph(tree)]
  for var in variables:
    if isinstance(var, FP8Counters):
      value = jax.block_until_ready(var.get_value())
      _check_when_ready(var, value)


def track_updates(module: nnx.Module, kernel: jax.Array) -> None:
  """Counts a forward pass of ``module`` (whose FP8 state is in use) that sees
  ``kernel`` changed since its previous one (see the module docstring). The
  count is read on the host, never inside the step: a host read in the step
  (a callback, or a ``lax.cond`` on the count) would make the device wait for
  the host every step."""
  var = getattr(module, COUNTERS, None)
  if not isinstance(var, FP8Counters):
    return
  c = var.get_value()
  if isinstance(c["pending"], jax.core.Tracer) and _COUNTED_IN_TRACE.get(id(var)) is c["pending"]:
    # A second use in this trace (a Fp8DotGeneral shared by several layers
    # sees their different kernels): the step was counted by its first use.
    return
  probe = layer_state.kernel_probe(lax.stop_gradient(kernel))
  changed = probe != c["probe"]          # the stored NaN: a first pass counts
  pending = c["pending"] + changed.astype(jnp.int32)
  var.set_value({"pending": pending, "probe": probe})
  _COUNTED_IN_TRACE[id(var)] = pending


# id(FP8Counters variable) -> the count its last traced use wrote: finding it
# there again means the same trace uses the module again.
_COUNTED_IN_TRACE: Dict[int, Any] = {}


# ------------------------------------------------------------- training ---

def _flat(tree, var_type) -> Dict[Tuple, Any]:
  """{path: value} of the ``var_type`` variables of a module or State."""
  if isinstance(tree, nnx.State):
    st = nnx.filter_state(tree, var_type)
  else:
    st = nnx.state(tree, var_type)
  return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
          for p, v in nnx.to_flat_state(st)}


def _path_str(p):
  return ".".join(str(k) for k in p)


def apply_fp8_updates(model: nnx.Module, grads) -> None:
  """Writes the updated FP8 state from ``grads`` into ``model`` (in place).

  Args:
    model: the te_jax.nnx model (or any nnx graph holding te_jax modules).
    grads: the gradients of ``model`` from ``nnx.grad`` / ``nnx.value_and_grad``
      with ``argnums=nnx.DiffState(0, te_jax.nnx.WRT)`` (an ``nnx.State``),
      possibly summed over microbatches with :func:`accumulate_gradients`.

  Does nothing for a model without FP8 state. Resets every module's step
  count (:class:`FP8Counters`).

  Raises:
    ValueError: the model has FP8 state but ``grads`` holds none of it (it
      was not differentiated), or the two disagree on where it is.
  """
  cur = _flat(model, FP8State)
  if cur:
    new = _flat(grads, FP8State)
    if not new:
      raise ValueError(
          "apply_fp8_updates: the model holds delayed-scaling FP8 state but grads has "
          "none: differentiate with respect to it too, "
          "nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, te_jax.nnx.WRT)).")
    if set(cur) != set(new):
      miss = sorted(_path_str(p) for p in set(cur) - set(new))
      extra = sorted(_path_str(p) for p in set(new) - set(cur))
      raise ValueError(f"apply_fp8_updates: grads and model disagree on the FP8 state: "
                       f"missing from grads {miss[:5]}, not in the model {extra[:5]} "
                       "(pass the gradients of this model).")
    for path, var in nnx.iter_graph(model):
      if isinstance(var, FP8State):
        var.set_value(state_lib.keep_where_unused(new[tuple(path)], var.get_value()))
  for _, var in nnx.iter_graph(model):
    if isinstance(var, FP8Counters):
      c = var.get_value()
      var.set_value({"pending": jnp.zeros_like(c["pending"]), "probe": c["probe"]})


def accumulate_gradients(acc: nnx.State, grads: nnx.State) -> nnx.State:
  """Sums two microbatches' gradients (``nnx.State``s of the same model),
  merging their FP8 state exactly as ``te_jax.fp8_state.accumulate_gradients``
  does (histories by max, scales by the min of the positive ones)."""
  coll = state_lib.FP8_COLLECTION

  def merge(a, b):
    if isinstance(a, FP8State):
      merged = state_lib.accumulate_gradients({coll: a.get_value()}, {coll: b.get_value()})
      return a.replace(merged[coll])
    if isinstance(a, nnx.Variable):
      return a.replace(jax.tree.map(jnp.add, a.get_value(), b.get_value()))
    return jnp.add(a, b)

  return jax.tree.map(merge, acc, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
