"""The router of a mixture of experts, in float32: scores, top-k, balancing.

For tokens ``x`` (T, H) and a router kernel (H, E):

* ``logits = x @ kernel`` in float32 (``Precision.HIGHEST``: no TF32);
* scores: ``softmax(logits)`` (Mixtral, Qwen-MoE) or ``sigmoid(logits)``
  (DeepSeek-V3);
* each token goes to the ``k`` experts of highest ``score + bias`` (the bias
  of DeepSeek-V3's auxiliary-loss-free balancing; zero without it) and is
  weighted by its *scores* of those experts (the bias picks, it never
  weights), optionally normalized to sum to 1 over the k, times a scaling
  factor.

Balancing, all optional:

* :func:`load_balancing_loss`: the Switch/GShard auxiliary loss
  ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of the T*k assignments
  that went to expert e and ``P_e`` the mean over tokens of its normalized
  score (softmax probability; for sigmoid scores, each token's scores
  divided by their sum, as DeepSeek-V3's balance loss). 1 when perfectly
  balanced; only ``P`` carries a gradient.
* :func:`router_z_loss`: the mean over tokens of ``logsumexp(logits)**2``
  (ST-MoE), which keeps the logits small.
* Bias-based balancing (DeepSeek-V3): the bias is state, not a parameter. A
  training loop keeps it next to the parameters and after each step calls
  ``bias = update_balance_bias(bias, aux.tokens_per_expert, rate)``, which
  raises the bias of experts that got fewer assignments than the mean and
  lowers it for those that got more, by ``rate`` (1e-3 in DeepSeek-V3). The
  counts come back from the MoE block summed over every device, so every
  device's bias stays the same. It takes no gradient (``stop_gradient``).

A token with ``token_mask`` False (padding of a packed batch) is routed
nowhere: its expert ids are ``E`` (one past the last expert), its weights 0,
and it counts in neither loss nor in the expert loads.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["SCORE_FUNCTIONS", "Routing", "route", "tokens_per_expert",
           "load_balancing_loss", "router_z_loss", "update_balance_bias"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class Routing(NamedTuple):
  """The routing of T tokens among E experts, k per token.

  Attributes:
    expert_ids: (T, k) int32, the chosen experts (best first); E for a
      masked token.
    weights: (T, k) float32 combine weights; 0 for a masked token.
    probs: (T, E) float32 normalized scores (what the balancing loss averages).
    logits: (T, E) float32 router logits.
    mask: (T,) bool, the tokens that are routed.
  """

  expert_ids: jax.Array
  weights: jax.Array
  probs: jax.Array
  logits: jax.Array
  mask: jax.Array


def _check_route_args(x, kernel, k, score_function, bias, token_mask):
  if getattr(x, "ndim", None) != 2 or getattr(kernel, "ndim", None) != 2:
    raise ValueError(f"x must be (T, H) and kernel (H, E), got shapes "
                     f"{getattr(x, 'shape', None)} and {getattr(kernel, 'shape', None)}.")
  if x.shape[1] != kernel.shape[0]:
    raise ValueError(f"x (T, H) and the router kernel (H, E) must share H, got x "
                     f"{x.shape} and kernel {kernel.shape}.")
  e = kernel.shape[1]
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
    raise ValueError(f"num_experts_per_token must be an int in [1, {e}] (the number of "
                     f"experts), got {k!r}.")
  if score_function not in SCORE_FUNCTIONS:
    raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got "
                     f"{score_function!r}.")
  if bias is not None and getattr(bias, "shape", None) != (e,):
    raise ValueError(f"bias must have shape ({e},) (one per expert), got "
                     f"{getattr(bias, 'shape', None)}.")
  if token_mask is not None and getattr(token_mask, "shape", None) != (x.shape[0],):
    raise ValueError(f"token_mask must have shape ({x.shape[0]},) (one per token), got "
                     f"{getattr(token_mask, 'shape', None)}.")


def route(x: jax.Array, kernel: jax.Array, *, num_experts_per_token: int,
          score_function: str = "softmax", normalize_weights: bool = True,
          scaling_factor: float = 1.0, bias: Optional[jax.Array] = None,
          token_mask: Optional[jax.Array] = None,
          top_k_ids: Optional[Callable[[jax.Array, int], jax.Array]] = None) -> Routing:
  """Routes each token to its top-k experts.

  Args:
    x: (T, H) tokens (any float dtype; the router computes in float32).
    kernel: (H, E) router weight.
    num_experts_per_token: k, in [1, E].
    score_function: "softmax" or "sigmoid".
    normalize_weights: divide each token's k weights by their sum.
    scaling_factor: multiplies the weights (DeepSeek-V3's routed scaling).
    bias: optional (E,) selection bias (bias-based balancing; no gradient).
    token_mask: optional (T,) bool; False tokens are routed nowhere.
    top_k_ids: ``(select (T, E), k) -> (T, k) int32`` ids of each row's k
      largest entries; default ``lax.top_k``. A sharded block passes one
      that selects on each device's own tokens (XLA's partitioner would
      gather every token's scores onto every device for ``lax.top_k``).

  Returns:
    A :class:`Routing`.
  """
  _check_route_args(x, kernel, num_experts_per_token, score_function, bias, token_mask)
  e = kernel.shape[1]
  logits = lax.dot_general(x.astype(jnp.float32), kernel.astype(jnp.float32),
                           (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)
  if score_function == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  select = scores if bias is None else scores + lax.stop_gradient(bias.astype(jnp.float32))
  ids = (top_k_ids or _top_k_ids)(lax.stop_gradient(select), num_experts_per_token)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if normalize_weights:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights * jnp.float32(scaling_factor)
  mask = (jnp.ones((x.shape[0],), bool) if token_mask is None
          else token_mask.astype(bool))
  ids = jnp.where(mask[:, None], ids, e).astype(jnp.int32)
  weights = jnp.where(mask[:, None], weights, 0.0)
  return Routing(ids, weights, probs, logits, mask)


def _top_k_ids(select: jax.Array, k: int) -> jax.Array:
  return lax.top_k(select, k)[1]


def tokens_per_expert(routing: Routing, num_experts: int) -> jax.Array:
  """(E,) float32: how many assignments each expert got (before any capacity
  drop); masked tokens count nowhere."""
  ids = routing.expert_ids.reshape(-1)
  return jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.float32)


def _masked_mean(values, mask):
  """Mean over the rows of ``values`` where ``mask``; 0 when none is."""
  n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  return jnp.sum(jnp.where(mask.reshape(mask.shape + (1,) * (values.ndim - 1)), values,
                           0.0), axis=0) / n


def load_balancing_loss(routing: Routing) -> jax.Array:
  """``E * sum_e f_e * P_e`` over the routed tokens (see the module doc);
  float32 scalar, 1 for a perfectly balanced routing."""
  e = routing.probs.shape[1]
  k = routing.expert_ids.shape[1]
  n = jnp.maximum(jnp.sum(routing.mask), 1).astype(jnp.float32)
  fraction = tokens_per_expert(routing, e) / (n * k)
  mean_prob = _masked_mean(routing.probs, routing.mask)
  return e * jnp.sum(fraction * mean_prob)


def router_z_loss(routing: Routing) -> jax.Array:
  """Mean over the routed tokens of ``logsumexp(logits)**2``; float32 scalar."""
  z = jax.nn.logsumexp(routing.logits, axis=-1)
  return _masked_mean(z * z, routing.mask)


def update_balance_bias(bias: jax.Array, loads: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's bias update: ``bias + rate * sign(mean_load - load)``.

  Args:
    bias: (E,) float32 selection bias.
    loads: (E,) the assignments per expert of this step
      (``MoEAux.tokens_per_expert``).
    rate: the update speed (>= 0).

  Returns:
    (E,) float32: raised where an expert was under the mean load, lowered
    where over it, unchanged where equal.
  """
  if getattr(bias, "ndim", None) != 1 or bias.shape != getattr(loads, "shape", None):
    raise ValueError(f"bias and loads must have the same shape (E,), got "
                     f"{getattr(bias, 'shape', None)} and {getattr(loads, 'shape', None)}.")
  load = loads.astype(jnp.float32)
  return (bias.astype(jnp.float32) +
          jnp.float32(rate) * jnp.sign(jnp.mean(load) - load))
