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

FP8_COLLECTION = "_overwrite_with_gradient"

__all__ = ["FP8_COLLECTION", "carry_fp8_state"]


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
