"""Carrying delayed-scaling state from one benchmark step to the next.

te_jax's Flax modules and Flax's own FP8 ops keep their delayed-scaling state
(amax history, scale) in the ``"_overwrite_with_gradient"`` collection: the
"gradient" a step returns for it is the state of the next step. A benchmark
that times ``value_and_grad`` and feeds the initial variables back every step
never advances it, so every step quantizes with the initial scale of 1. The
gradients (~1e-8 for a mean over 16k x 4k outputs) then all round to zero in
E5M2 and the backward GEMMs multiply zeros, which tensor cores do measurably
faster than real data: the timing is not that of training. Carrying the state
(what a training loop does) makes every timed step use the scales of the
previous one.
"""

from __future__ import annotations

import time

FP8_COLLECTION = "_overwrite_with_gradient"
WARMUP_STEPS = 3

__all__ = ["FP8_COLLECTION", "WARMUP_STEPS", "carry_fp8_state", "run_steps", "time_steps"]


def carry_fp8_state(variables, grads):
  """The variables of the next step: the FP8 collection replaced by its gradient.

  Args:
    variables: the Flax variables the step was called with (a mapping).
    grads: the gradient of the step w.r.t. ``variables`` (same structure).

  Returns:
    ``variables`` unchanged when it has no FP8 collection, else a shallow copy
    whose FP8 collection is ``grads``'s.
  """
  if not hasattr(variables, "keys") or FP8_COLLECTION not in variables:
    return variables
  new = dict(variables)
  new[FP8_COLLECTION] = grads[FP8_COLLECTION]
  return new


def run_steps(step, variables, xs, n, carry=carry_fp8_state):
  """``n`` steps back to back, the state carried from each to the next.

  Args:
    step: ``step(variables, x) -> (loss, (variable grads, input grad))``
      (``jax.value_and_grad(loss, argnums=(0, 1))``, jitted or compiled).
    variables: the variables of the first step.
    xs: inputs, used in turn (``xs[i % len(xs)]`` at step i).
    n: number of steps.
    carry: ``carry(variables, variable_grads)`` -> the next step's variables
      (:func:`carry_fp8_state`; ``lambda v, g: v`` times a frozen state).

  Returns:
    (the variables after the last step, the last step's output); nothing is
    waited for.
  """
  out = None
  for i in range(n):
    out = step(variables, xs[i % len(xs)])
    variables = carry(variables, out[1][0])
  return variables, out


def time_steps(step, variables, xs, k, repeats, carry=carry_fp8_state):
  """The benchmarks' timing protocol: :data:`WARMUP_STEPS` steps (compile,
  then scales from real amaxes), then ``repeats`` timings of ``k`` steps
  back to back with one wait at the end (:func:`run_steps`; arguments as
  there).

  Returns:
    (per-step times in ms, one per timing; the variables after the last
    step; the last step's output).
  """
  import jax  # pylint: disable=import-outside-toplevel
  variables, out = run_steps(step, variables, xs, WARMUP_STEPS, carry)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    out = None   # else the last step's gradients stay alive and count in a memory peak
    t0 = time.perf_counter()
    variables, out = run_steps(step, variables, xs, k, carry)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / k * 1e3)
  return times, variables, out
