"""How the core reaches the FP8 state of a module's GEMMs, without naming a framework.

Under ``DelayedScaling`` each FP8 GEMM of a module keeps a state (the
``te_jax.fp8_state`` layout, one per GEMM name); the other recipes keep none.
Where that state lives is the framework's business: a Linen variable in the
collection ``FP8_COLLECTION``, an NNX ``FP8State`` attribute. The core sees it
through a :class:`GemmStates` object the module passes in, implemented once
per framework (``te_jax.flax.fp8_module.LinenStates``,
``te_jax.nnx.state.NnxStates``).

The state's "gradient" is its update (``te_jax.dense``). Every read goes
through ``te_jax.fp8_state.merge_uses`` (:meth:`GemmStates.state`), so a
module called several times in one step gets one update, the largest amax
in one history entry, where autodiff would add the uses' updates. A state
the call does not use -- FP8 switched off, or another recipe than the one it
was made for -- must come back unchanged: :meth:`GemmStates.keep_unused`
ties it to the output with :func:`keep_state` where the framework's update
would otherwise overwrite it, and says so when the user did not choose it
(:func:`warn_unused_state`). Reads inside ``nn.remat`` / ``nnx.remat``,
whose calls would add their updates out of te_jax's sight, are checked by
:func:`checkpoint_read_problem`.
"""

from __future__ import annotations

import abc
import math
import warnings
import weakref
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import fp8_state as state_lib
from te_jax.layers import settings as settings_lib

__all__ = ["GemmStates", "keep_state", "state_shapes", "fused_states",
           "checkpoint_read_problem", "warn_unused_state", "kernel_probe"]


class GemmStates(abc.ABC):
  """The FP8 state of one module's GEMMs, as the core asks for it.

  :meth:`state` and :meth:`keep_unused` are the core's two questions, the
  same for every framework: every read goes through
  ``te_jax.fp8_state.merge_uses`` (a module called several times in one
  step gets one merged update, not the sum of its uses'), and a state the
  call does not use is warned about when the user did not choose that
  (:func:`warn_unused_state`). A framework says where its state lives
  (:meth:`read`), what a read inside a lifted transform must satisfy
  (:meth:`check_read`) and how a kept state is tied (:meth:`tie`).

  Attributes:
    module_name: the module's class name (for the log lines that name it).
    warn_name: the module as the warnings name it (default module_name).
    warn_where: the instance, for the warnings (or None).
    drop_fix: how a user of the framework drops the state (for a warning).
  """

  module_name: str
  warn_name: Optional[str] = None
  warn_where: Optional[str] = None
  drop_fix: str = "drop it from the module's variables"

  @abc.abstractmethod
  def has(self, name: str) -> bool:
    """Whether the module holds a state for GEMM ``name`` now."""

  @abc.abstractmethod
  def can_create(self) -> bool:
    """Whether :meth:`state` would create a missing state (e.g. Linen's init)."""

  @abc.abstractmethod
  def peek(self, name: str):
    """The value of the existing state of GEMM ``name``; declares nothing."""

  def read(self, name: str, mode):
    """The stored state of GEMM ``name`` for the ``ScalingMode`` ``mode``,
    created where the framework creates it; None when ``mode`` keeps none.
    (A store that overrides :meth:`state` itself need not implement it; its
    reads then do not merge.)

    Raises:
      ValueError: the state is missing and cannot be created, or its shapes
        are not the ones ``mode`` needs (the message names the fix).
    """
    raise NotImplementedError(f"{type(self).__name__} implements neither read() nor state().")

  def check_read(self, name: str, state) -> None:
    """Raises where reading ``state`` here would add up its updates (a read
    inside a rematerialized call: :func:`checkpoint_read_problem`).
    Default: nothing."""
    del name, state

  def tie(self, y, names: Sequence[str]):
    """``y`` tied to the existing states ``names`` so that the framework's
    update leaves them as they are. Default: ``y`` (nothing to tie)."""
    del names
    return y

  def state(self, name: str, mode):
    """The state of GEMM ``name`` for ``mode`` (:meth:`read`), as the
    functional layer takes it (``te_jax.fp8_state.merge_uses``); None when
    ``mode`` keeps none (an existing state is then warned about: another
    recipe's)."""
    state = self.read(name, mode)
    if state is not None:
      self.check_read(name, state)
    elif self.has(name):
      self.warn_unused(mode)
    return state_lib.merge_uses(state, mode)

  def keep_unused(self, y, names: Sequence[str]):
    """``y`` (any pytree of arrays), tied to the states ``names`` that exist
    but that this call does not use (:meth:`tie`). FP8 is then off, or the
    state is another recipe's (warned about by :meth:`state`); off outside
    any autocast is warned about here."""
    if any(self.has(n) for n in names):
      self.warn_unused(None)
    return self.tie(y, names)

  def warn_unused(self, mode) -> None:
    """:func:`warn_unused_state` for this module."""
    warn_unused_state(self.warn_name or self.module_name, self.warn_where, mode,
                      self.drop_fix)

  def track_updates(self, kernel: jax.Array) -> None:
    """Records one forward pass that uses the module's FP8 state with
    parameter ``kernel`` (the NNX modules count training steps). Default:
    nothing."""
    del kernel


def keep_state(y, state):
  """``y``, tied to the delayed-scaling ``state`` that its call does not use
  (FP8 off, or another recipe) so that the state's "gradient" is the state
  itself: ``TrainState.apply_gradients`` then leaves it untouched instead of
  overwriting it with zeros. Through ``te_jax.fp8_state.tie_unused``: where
  another call of the same step uses the state, the two merge into that
  use's update instead of adding up.
  """
  return state_lib.tie_unused(y, state)


def state_shapes(tree):
  """The shapes of a state pytree (a pytree of tuples)."""
  return jax.tree.map(lambda a: tuple(jnp.shape(a)), tree)


def fused_states(states: GemmStates, names: Sequence[str], mode
                 ) -> Tuple[Optional[tuple], Optional[str]]:
  """(the states of GEMMs ``names``, None) for a fused path that calls the
  functional layer with them, or (None, reason) when the module should take
  its unfused path instead, whose GEMMs then handle them: the module holds
  another recipe's state (kept as it is there), or the states are missing or
  of another shape (the unfused GEMM raises its error there). Declares
  nothing unless it returns states; a recipe without state gives a tuple of
  Nones.
  """
  have = [states.has(n) for n in names]
  if not mode.uses_state:
    if any(have):
      return None, "it holds FP8 state that the active recipe does not use"
    return (None,) * len(names), None
  if not all(have) and not states.can_create():
    return None, "its FP8 state variables are missing"
  want = state_shapes(jax.eval_shape(mode.init_state))
  for n, h in zip(names, have):
    if h and state_shapes(states.peek(n)) != want:
      return None, f"its FP8 state '{n}' does not fit the active recipe"
  return tuple(states.state(n, mode) for n in names), None


# Per outer trace: {(module, GEMM name): weak reference to the jax.checkpoint
# body (an nn.remat call) that read that state from it}.
_BODY_OF_READ = weakref.WeakKeyDictionary()


def checkpoint_read_problem(state, key, seen_levels: int) -> Optional[str]:
  """Whether this read of a float32 FP8 ``state`` inside ``jax.checkpoint``
  bodies (``nn.remat``, ``nnx.remat``) of a differentiated step would have
  its update summed with another call's (``te_jax.fp8_state.checkpoint_bodies``).

  Args:
    state: the state as the module found it.
    key: what identifies the state across calls (hashable).
    seen_levels: how many of those bodies trace every call anew (Flax's
      ``nn.remat`` makes a new function per call); the others may reuse one
      call's trace for the next, unseen.

  Returns:
    None, "unseen" (a body that may reuse its trace: a second call could not
    be told apart, so any read is refused), or "twice" (a second call of a
    body on this state in one step).
  """
  bodies = state_lib.checkpoint_bodies(state)
  if len(bodies) > seen_levels:
    return "unseen"
  for outer, body in bodies:
    reads = _BODY_OF_READ.setdefault(outer, {})
    first = reads.setdefault(key, weakref.ref(body))
    if first() is not body:
      return "twice"
  return None


# (module class, reason) of every warning warn_unused_state gave.
_WARNED_UNUSED = set()


def warn_unused_state(module_name: str, where: Optional[str], mode, drop_fix: str) -> None:
  """Warns (``te_jax.fp8_state.FP8StateWarning``) that a module holds
  delayed-scaling FP8 state which this call does not use, when that is not
  what the user chose:

  * ``mode`` None outside any ``fp8_autocast`` (a model built for FP8 run,
    or a step traced, outside it: FP8 off by default). Inside an explicit
    ``fp8_autocast(enabled=False)`` nothing is said: that is the way to run
    without FP8 on purpose.
  * ``mode`` of a recipe without state (current or blockwise scaling): the
    delayed-scaling state is kept, not updated.

  Once per module class and reason: a model repeats its layers, and one
  line per layer would bury the others.

  Args:
    module_name: the module's class, as the message names it.
    where: the instance (its path), for the message, or None.
    mode: the active ``ScalingMode`` (None with FP8 off).
    drop_fix: how the framework's user drops the state, for the message.
  """
  if mode is None and settings_lib.in_autocast():
    return
  reason = "off" if mode is None else type(mode.recipe).__name__
  if (module_name, reason) in _WARNED_UNUSED:
    return
  _WARNED_UNUSED.add((module_name, reason))
  seen = f" (the first seen: {where})" if where else ""
  who = f"te_jax: {module_name} modules{seen} hold delayed-scaling FP8 state"
  if mode is None:
    msg = (f"{who} but run outside fp8_autocast, so with FP8 off: their GEMMs are not "
           "quantized and the state is not used. Apply the model (and trace its jitted "
           "step) inside te_jax.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...)) "
           "with the recipe it was made with; to run it without FP8 on purpose, say so "
           "with te_jax.fp8_autocast(enabled=False).")
  else:
    msg = (f"{who} but run under {reason}, which does not use it (it is kept, not "
           "updated). Apply the model under the DelayedScaling recipe it was made with; "
           f"to train it under {reason}, drop the state: {drop_fix}.")
  warnings.warn(state_lib.FP8StateWarning(msg), stacklevel=3)


# (module class, state name) of every warning warn_unseen_calls gave.
_WARNED_UNSEEN = set()


def warn_unseen_calls(module_name: str, name: str, fix: str) -> None:
  """Warns once per (module class, state) (``te_jax.fp8_state.FP8StateWarning``)
  that a state is read inside a ``jax.checkpoint`` body whose later calls may
  reuse this trace, where te_jax cannot see them: ONE call per step is
  correct; several would have autodiff sum their updates. ``fix``: how to
  share the state across the calls so that they merge."""
  if (module_name, name) in _WARNED_UNSEEN:
    return
  _WARNED_UNSEEN.add((module_name, name))
  warnings.warn(state_lib.FP8StateWarning(
      f"te_jax: the FP8 state '{name}' of {module_name} is read inside a rematerialized "
      "call (nnx.remat / jax.checkpoint) of a differentiated step, which receives it as "
      "a new value; a later call of the same checkpoint may reuse this trace, unseen by "
      "te_jax. One call per step is correct. If the block runs more than once per step, "
      "autodiff would SUM the calls' new states (silently wrong FP8 scales): " + fix),
      stacklevel=4)


# Kernel entries the update check reads per module and forward pass.
PROBE_ENTRIES = 1024


def kernel_probe(kernel: jax.Array) -> jax.Array:
  """A float32 scalar of ``kernel`` (any shape) that changes when the kernel
  does, for the NNX modules' update check
  (``te_jax.nnx.state.track_updates``).

  A weighted sum (weights 1 + j / n, all distinct) of n <= PROBE_ENTRIES
  entries spread over the whole kernel: every ``stride``-th entry of the
  flattened kernel, the stride coprime with the last dim, so the entries
  fall in rows from first to last and in different columns. A training step
  that changes any of them changes the probe (up to an exact float32
  cancellation of weighted changes); it misses a step only when every one
  of those rows or columns got no update. One entry (what the check read
  before) missed a whole run when its input feature was always 0. Cost per
  module and forward pass: a strided read of n entries and their sum,
  nothing beside the GEMMs; a sum over the whole kernel would read every
  weight once more per step.

  >>> float(kernel_probe(jnp.ones((4, 3))))   # 12 entries, weights 1 + j / 12
  17.5
  """
  flat = jnp.ravel(kernel)
  size, last = flat.shape[0], (kernel.shape[-1] if kernel.ndim else 1)
  stride = max(1, size // PROBE_ENTRIES)
  while math.gcd(stride, last) != 1:
    stride += 1
  sample = flat[::stride][:PROBE_ENTRIES].astype(jnp.float32)
  n = sample.shape[0]
  weights = 1.0 + jnp.arange(n, dtype=jnp.float32) / n
  return jnp.sum(sample * weights)
