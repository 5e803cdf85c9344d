"""The Linen side of the te_jax modules' FP8 state, and their autocast read.

A Linen module reads the active ``fp8_autocast`` ONCE per call with
:func:`read_autocast` (``te_jax.layers.settings.read_settings`` with the
logical axis rules of Flax's ``nn.logical_axis_rules`` context) and hands the
settings to the core (``te_jax.layers``) together with a :class:`LinenStates`:
the core's view (``te_jax.layers.state.GemmStates``) of the module's FP8
state, which

* declares each GEMM's state as one variable ``<name>`` in the collection
  ``FP8_COLLECTION`` (``"_overwrite_with_gradient"``) when the recipe's
  scaling mode keeps state (``DelayedScaling``), created with the mode's
  ``init_state()`` (:func:`declare_fp8_state`); no FP8 state exists with FP8
  off or the other recipes;
* when the variables hold FP8 state that the active recipe does not use (FP8
  switched off for a step, or another recipe), makes the state's "gradient"
  the state itself, so ``TrainState.apply_gradients`` leaves it untouched
  (:func:`keep_unused_fp8_state`), and warns unless FP8 was switched off
  with ``fp8_autocast(enabled=False)``;
* reads every state through ``te_jax.fp8_state.merge_uses``: a module called
  several times in a step merges its uses into one update.

``nn.remat`` hands each call the variables as new values, so a remat'd
block applied twice in one differentiated step would add its calls'
updates: :func:`check_remat_calls` refuses that, and
:func:`share_fp8_state` (``share_fp8_state(nn.remat(Block))``) makes the
calls share the state and merge.

Under ``nn.scan`` the FP8 collection must be scanned like the parameters,
``nn.scan(..., variable_axes={"_overwrite_with_gradient": 0, "params": 0})``:
each layer then gets its own state, stacked on axis 0. Broadcast
(``variable_broadcast``), every layer would read one state and the backward
pass would SUM the layers' new states into it (the newest amax becomes the
sum of the layers' amaxes): silently wrong scales, so the state helpers
raise. How that is told apart at trace time, and what escapes it, is in
:func:`check_scanned_state`.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import jax
import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
from jax.extend import core as jex_core

from te_jax import fp8_state as state_lib
from te_jax.layers import settings as layer_settings
from te_jax.layers import state as layer_state

__all__ = ["read_autocast", "LinenStates", "declare_fp8_state", "keep_unused_fp8_state",
           "check_scanned_state", "enclosing_scan", "check_remat_calls", "share_fp8_state"]


def read_autocast(impl: str = "auto") -> layer_settings.Settings:
  """The innermost ``fp8_autocast`` as ``te_jax.layers.settings.Settings``
  (FP8 off outside any), with the rules of Flax's ``nn.logical_axis_rules``.

  Args:
    impl: the calling module's ``impl`` attribute ("auto", "cuda",
      "reference"); ``TE_JAX_IMPL`` still overrides "auto".
  """
  return layer_settings.read_settings(impl, nn_partitioning.get_axis_rules())


class LinenStates(layer_state.GemmStates):
  """The FP8 state of a Linen module's GEMMs, for the core: variables of the
  collection ``FP8_COLLECTION``, one per GEMM name (see the module docs).

  Args:
    module: the module that owns the GEMMs (inside its ``__call__``).
  """

  def __init__(self, module: nn.Module):
    self.module = module
    self.module_name = self.warn_name = type(module).__name__
    self.warn_where = "/".join(module.scope.path) or "the top module"
    self.drop_fix = ("initialize the model under that recipe, or pass apply() the variables "
                     f"without the collection '{state_lib.FP8_COLLECTION}'")

  def has(self, name: str) -> bool:
    return self.module.has_variable(state_lib.FP8_COLLECTION, name)

  def can_create(self) -> bool:
    return (self.module.is_initializing()
            and self.module.is_mutable_collection(state_lib.FP8_COLLECTION))

  def peek(self, name: str):
    return self.module.get_variable(state_lib.FP8_COLLECTION, name)

  def read(self, name: str, mode):
    return declare_fp8_state(self.module, name, mode)

  def check_read(self, name: str, state) -> None:
    check_remat_calls(self.module, name, state)

  def tie(self, y, names: Sequence[str]):
    return keep_unused_fp8_state(self.module, y, names)


def _where(module: nn.Module) -> str:
  return f"{module.__class__.__name__} {module.path if hasattr(module, 'path') else ''}"


def _scan_fix(name: str) -> str:
  return ("nn.scan(..., variable_axes={" f'"{state_lib.FP8_COLLECTION}": 0, "params": 0' "})"
          f" (te_jax.fp8_state.FP8_COLLECTION; keep it out of variable_broadcast), so "
          f"that each layer gets its own state '{name}', stacked on axis 0")


def enclosing_scan(module: nn.Module) -> Optional[str]:
  """The name of the innermost ``nn.scan`` (or ``nn.remat_scan``) that
  ``module`` runs in, or None outside any.

  Read from the scope's ``debug_path``, where Flax's lifted scan marks its
  module as ``scan(<name>)`` (``remat(scan(<name>))`` under ``nn.remat``).
  """
  path = getattr(getattr(module, "scope", None), "debug_path", None) or ()
  for part in reversed(path):
    i = part.find("scan(")
    if i >= 0:
      return part[i + len("scan("):].rstrip(")")
  return None


# Per root scope: the (scope path, name) of the FP8 states created in it. A
# lifted transform (each pass of nn.scan, nn.remat) gives its modules a new
# root scope, so a state present at init but missing here came from outside
# the pass: a broadcast collection. (Keyed by the root: a module called twice
# gets a new, rewound scope object for each call, under the same root.)
_CREATED = weakref.WeakKeyDictionary()


def _created_here(module: nn.Module, name: str, add: bool = False) -> bool:
  scope = getattr(module, "scope", None)
  root = getattr(scope, "root", None)
  if root is None:
    return False
  key = (tuple(getattr(scope, "path", ())), name)
  if add:
    _CREATED.setdefault(root, set()).add(key)
  return key in _CREATED.get(root, ())


def _outside_current_trace(leaf) -> bool:
  """True when ``leaf`` is not a value of the JAX trace the module runs in.

  Inside a traced loop body, a scanned (per-layer) variable is a tracer of
  the body's trace; a broadcast one is a constant closed over by the body:
  a concrete array or a tracer of an outer trace (``jit``, ``grad``). JAX
  has no public way to ask which trace a tracer belongs to, so this reads
  the tracer's ``_trace``; where a JAX version lacks it, the answer is False
  (no check rather than a false alarm).
  """
  current = jex_core.find_top_trace(())
  if isinstance(leaf, jax.core.Tracer):
    trace = getattr(leaf, "_trace", None)
    return trace is not None and trace is not current
  # Concrete inside a traced body means closed over; under jax.disable_jit()
  # the loop runs eagerly and every value is concrete: nothing to tell apart.
  return type(current).__name__ != "EvalTrace"


def check_scanned_state(module: nn.Module, name: str, state, created: bool = False):
  """Raises when the FP8 state ``name`` that ``module`` found in its scope
  reaches it broadcast through an ``nn.scan`` instead of one slice per layer.

  Call it with the state a module is about to use (or to keep unused);
  ``created`` True when this call has just created it (recorded, no check).

  Told apart at trace time, inside an ``nn.scan`` only
  (:func:`enclosing_scan`):

  * the state is not a value of the loop body's trace (a broadcast is a
    constant the body closes over; a scanned slice is a tracer of the body):
    catches a broadcast at init and at apply, under ``jit`` and ``grad``;
  * at init, the state already exists although this pass over the module
    did not create it (a scanned collection starts empty in every pass; a
    broadcast one comes in from Flax's first, broadcast-initializing pass):
    catches a broadcast at init also under ``nn.remat`` inside the scan,
    whose arguments are tracers of its own trace.

  Not caught: at apply, a broadcast state that was never initialized
  broadcast (restored from elsewhere) when ``nn.remat`` sits between the
  scan and the module; a plain ``jax.lax.scan`` around ``apply`` that closes
  over the variables (not a Flax scan). A state stacked per layer under a
  scan that does not slice it fails the shape check in
  :func:`declare_fp8_state`, with the same fix.
  """
  if created:
    _created_here(module, name, add=True)
    return
  scan = enclosing_scan(module)
  if scan is None or _created_here(module, name):
    # Outside a scan, or created by this very pass (a module called twice:
    # Flax's broadcast-finding first pass makes its state a concrete constant).
    return
  closed_over = any(_outside_current_trace(leaf) for leaf in jax.tree.leaves(state))
  if closed_over or module.is_initializing():
    raise ValueError(
        f"{_where(module)}: its FP8 state '{name}' (collection "
        f"'{state_lib.FP8_COLLECTION}') is broadcast by the nn.scan '{scan}' "
        "(in its variable_broadcast, not its variable_axes): every layer would read "
        "the same state and the backward pass would sum the layers' new states into "
        "it (an amax history entry becomes the sum of the layers' amaxes), silently "
        f"wrong FP8 scales. Scan it with the parameters: {_scan_fix(name)}.")


def declare_fp8_state(module: nn.Module, name: str, mode):
  """Declares (or reads) the FP8 state variable ``name`` of one GEMM of ``module``.

  The variable lives in collection ``FP8_COLLECTION`` and is created with
  ``mode.init_state()`` by ``init`` (never by an ``apply``, even one whose
  collections are all mutable: that state would start over every call).

  Args:
    module: the Linen module that owns the GEMM (inside its ``__call__``).
    name: the variable's name, one per GEMM of the module.
    mode: the active recipe's ``te_jax.scaling.ScalingMode``.

  Returns:
    The state pytree, or None when ``mode`` keeps none (no variable declared).

  Raises:
    ValueError: the variable is missing and cannot be created (inside an
      ``nn.scan``: the scan does not carry the FP8 collection), its shapes
      are not the ones ``mode`` needs (another history length, an old
      layout, a per-layer stack that the scan does not slice), or an
      ``nn.scan`` broadcasts it (:func:`check_scanned_state`).
  """
  if not mode.uses_state:
    return None
  coll = state_lib.FP8_COLLECTION
  recipe_name = type(mode.recipe).__name__
  scan = enclosing_scan(module)
  existed = module.has_variable(coll, name)
  # Only init creates the state: created by an apply(mutable=...), a fresh
  # state would start over in every call, and no step would keep it.
  if not existed and not (module.is_mutable_collection(coll) and module.is_initializing()):
    autocast_fix = (f"Initialize the model inside fp8_autocast(enabled=True, "
                    f"fp8_recipe={recipe_name}(...)) with the same recipe (init creates "
                    "the state; an apply does not).")
    if scan is not None and module.is_initializing():
      # init makes every collection mutable: only the scan filtered it out.
      problem = (f", which the nn.scan '{scan}' around it does not carry, so the "
                 f"layers cannot create it. Scan it with the parameters: {_scan_fix(name)}.")
    elif scan is not None:
      problem = (f", but the variables passed to apply() have none inside the nn.scan "
                 f"'{scan}'. Either the scan does not carry that collection: "
                 f"{_scan_fix(name)}; or the model was initialized without "
                 f"{recipe_name}: " + autocast_fix)
    else:
      problem = ", but the variables passed to apply() have none. " + autocast_fix
    raise ValueError(f"{_where(module)}: {recipe_name} needs the FP8 state variable "
                     f"'{name}' in collection '{coll}'" + problem)
  var = module.variable(coll, name, mode.init_state)
  state = var.value
  want = jax.tree.map(lambda a: a.shape, jax.eval_shape(mode.init_state))
  got = jax.tree.map(lambda a: a.shape, state)
  if got != want:
    hint = ("e.g. another amax_history_len: initialize the model with the recipe "
            "used for training.")
    if "scale_inv" in str(got):
      hint = ("this is the layout of checkpoints from before 2026-12-02 (scale_inv): "
              "convert the restored variables with te_jax.fp8_state.migrate_scale_inv.")
    elif scan is not None and _stacked(state, jax.eval_shape(mode.init_state)):
      hint = (f"it is stacked per layer, but the nn.scan '{scan}' does not slice it: "
              f"{_scan_fix(name)}.")
    raise ValueError(
        f"FP8 state '{name}' has shapes {got} but the active recipe "
        f"{mode.recipe} needs {want}; {hint}")
  check_scanned_state(module, name, state, created=not existed)
  return state


def _stacked(state, want) -> bool:
  """True when every leaf of ``state`` is the matching leaf of ``want`` with
  leading (layer) dims: the state of a scan that stacked it per layer."""
  got_leaves, got_tree = jax.tree.flatten(state)
  want_leaves, want_tree = jax.tree.flatten(want)
  return got_tree == want_tree and all(
      len(g.shape) > len(w.shape) and tuple(g.shape[len(g.shape) - len(w.shape):]) == tuple(w.shape)
      for g, w in zip(got_leaves, want_leaves))


def keep_unused_fp8_state(module: nn.Module, y, names: Sequence[str]):
  """``y``, tied to the module's FP8 state variables ``names`` that exist but
  that this call does not use (from an init under another recipe, or FP8
  switched off), so that their "gradient" is themselves and
  ``TrainState.apply_gradients`` leaves them as they are. ``y`` may be any
  pytree of arrays (a split output)."""
  for n in names:
    if module.has_variable(state_lib.FP8_COLLECTION, n):
      state = module.get_variable(state_lib.FP8_COLLECTION, n)
      # Kept state is returned as its own gradient: broadcast, it would be summed too.
      check_scanned_state(module, n, state)
      check_remat_calls(module, n, state)
      y = layer_state.keep_state(y, state)
  return y


def share_fp8_state(target):
  """``target`` (a Linen module class, e.g. ``nn.remat(Block)``) whose calls
  in one step share their FP8 state, so that their updates merge.

  ``nn.remat`` hands each call the variables as new values: a remat'd block
  applied twice in one differentiated step would get the SUM of the two
  calls' new states (and :func:`check_remat_calls` refuses that). Wrapped,
  the block's FP8 collection reaches each call converted once, in the
  caller's trace, into the merging dtype of ``te_jax.fp8_state.merge_uses``
  (``nn.map_variables`` with ``te_jax.fp8_state.share_tree``): the calls'
  uses merge into one update, the largest amax in one history entry. Same
  variables, same paths; with FP8 off or a recipe without state it changes
  nothing.

  >>> import flax.linen as nn
  >>> from te_jax import flax as tfx
  >>> Block = share_fp8_state(nn.remat(tfx.DenseGeneral))
  """
  def share(tree):
    return state_lib.share_tree(tree, read_autocast().mode)

  # init=True: the wrapped module creates its state at init (the mapped
  # collection is otherwise immutable inside).
  return nn.map_variables(target, state_lib.FP8_COLLECTION, trans_in_fn=share,
                          trans_out_fn=state_lib.unshare_tree, init=True)


def _remat_levels(module: nn.Module) -> int:
  """How many ``nn.remat`` calls ``module`` runs in (from the scope's
  ``debug_path``, where Flax marks a lifted remat as ``remat(<name>)``)."""
  path = getattr(getattr(module, "scope", None), "debug_path", None) or ()
  return sum(part.count("remat(") for part in path)


def check_remat_calls(module: nn.Module, name: str, state) -> None:
  """Raises when the FP8 state ``name`` that ``module`` reads reaches it
  through a second ``nn.remat`` call in one differentiated step (each call
  gets the state as a new value and autodiff would sum their updates), or
  through a ``jax.checkpoint`` around ``apply``, whose later calls may reuse
  this call's trace unseen (``te_jax.layers.state.checkpoint_read_problem``).
  A state shared by :func:`share_fp8_state` passes."""
  key = (tuple(getattr(getattr(module, "scope", None), "path", ())), name)
  problem = layer_state.checkpoint_read_problem(state, key, _remat_levels(module))
  if problem is None:
    return
  summed = ("autodiff would SUM the calls' new states (an amax history entry the sum "
            "of their amaxes): silently wrong FP8 scales")
  if problem == "twice":
    raise ValueError(
        f"{_where(module)}: its FP8 state '{name}' is read by a second call of the "
        "nn.remat around it in one differentiated step. Each call receives the state "
        f"as a new value, so {summed}. Share it across the calls: wrap the remat'd "
        "module as te_jax.flax.share_fp8_state(nn.remat(Block)); its calls "
        "then merge into one update.")
  # "unseen": a jax.checkpoint around apply, whose next call may reuse this
  # trace; one call per step is right, so this is said, not refused.
  layer_state.warn_unseen_calls(
      type(module).__name__, name,
      "use nn.remat inside the model (te_jax.flax.share_fp8_state("
      "nn.remat(Block)) for a block called several times), or pass the variables to the "
      "checkpoint as te_jax.fp8_state.share_tree(variables, recipe.scaling_mode()).")
