"""The experts: a gated (SwiGLU, GeGLU) or plain MLP per expert over a sorted buffer.

``y[rows_e] = act(x[rows_e] @ wi[e]) @ wo[e]``, both products grouped dense
GEMMs (``te_jax.grouped_dense``) in FP8 under the recipe. Activations are
named as everywhere in te_jax (``te_jax.ops.act_quantize.ACTIVATIONS``):
one name, or two for a gated unit ``act0(h0) * act1(h1)`` (("silu",
"linear") = SwiGLU). The activation runs in float32 between the GEMMs (the
fused activation-quantize of ``te_jax.fused_mlp`` has no grouped form yet).

Weights: ``wi`` (E, H, n_act, F) -- the layout of ``LayerNormMLP``'s
``wi_kernel`` with an expert dim in front, so F can be split over tensor
parallelism without separating a gate from its partner -- and ``wo``
(E, F, H). No biases: a padding row of the buffer then stays 0 through
every expert.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import grouped_dense as gd
from te_jax.ops.act_quantize import ACTIVATIONS

__all__ = ["check_activations", "activate", "token_block", "init_expert_states",
           "expert_mlp"]


def check_activations(activations) -> Tuple[str, ...]:
  """The activation names as a tuple of one or two known names."""
  if isinstance(activations, str) or not isinstance(activations, (tuple, list)):
    raise TypeError(f"activations must be a tuple of one or two names such as "
                    f"('gelu',) or ('silu', 'linear'), got {activations!r}.")
  acts = tuple(activations)
  if len(acts) not in (1, 2) or any(a not in ACTIVATIONS for a in acts):
    raise ValueError(f"activations must be one or two names from {sorted(ACTIVATIONS)}, "
                     f"got {acts!r}.")
  return acts


def activate(h: jax.Array, activations: Sequence[str]) -> jax.Array:
  """(M, n_act, F) -> (M, F): ``act0(h0)`` or ``act0(h0) * act1(h1)``, in
  float32, returned in ``h.dtype``."""
  hf = h.astype(jnp.float32)
  z = ACTIVATIONS[activations[0]].jax_fn(hf[:, 0])
  for i, name in enumerate(activations[1:], 1):
    z = z * ACTIVATIONS[name].jax_fn(hf[:, i])
  return z.astype(h.dtype)


def token_block(recipe) -> int:
  """Rows each expert group is padded to: the recipe's ``token_block``, 1
  with FP8 off."""
  return 1 if recipe is None else dense_lib.scaling_mode_of(recipe).token_block


def init_expert_states(recipe, num_experts: int):
  """``{"wi": ..., "wo": ...}`` grouped-dense states (None if stateless)."""
  wi = gd.init_grouped_state(recipe, num_experts)
  if wi is None:
    return None
  return {"wi": wi, "wo": gd.init_grouped_state(recipe, num_experts)}


def expert_mlp(x: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array, *,
               activations: Sequence[str], recipe=None, fp8_state=None,
               impl: str = "auto", wi_axes: gd.GroupedAxes = gd.GroupedAxes(),
               wo_axes: gd.GroupedAxes = gd.GroupedAxes()) -> jax.Array:
  """Each expert's MLP on its rows of the sorted buffer ``x``.

  Args:
    x: (M, H) rows sorted by expert, groups padded to the recipe's block.
    group_sizes: (E,) int32 rows per expert.
    wi: (E, H, n_act, F) up-projections (n_act = len(activations)).
    wo: (E, F, H) down-projections.
    activations: one or two names of ``ACTIVATIONS``.
    recipe: a ``te_jax.recipe`` recipe, or None (FP8 off).
    fp8_state: ``init_expert_states`` (``DelayedScaling``), else None.
    impl: "auto" or "reference".
    wi_axes, wo_axes: mesh axes of the two grouped GEMMs inside
      ``shard_map`` (``te_jax.grouped_dense.GroupedAxes``).

  Returns:
    (M, H) in ``x.dtype``; rows outside every group are 0.
  """
  acts = check_activations(activations)
  e, h, n_act, f = wi.shape
  if n_act != len(acts):
    raise ValueError(f"wi (E, H, n_act, F) has n_act = {n_act}, but {len(acts)} "
                     f"activation(s) {acts} were given.")
  if wo.shape[:2] != (e, f):
    raise ValueError(f"wo must be (E, F, H) = ({e}, {f}, H) for wi {wi.shape}, got "
                     f"{wo.shape}.")
  states: Optional[dict] = fp8_state or {}
  hid = gd.grouped_dense(x, wi.reshape(e, h, n_act * f), group_sizes, recipe=recipe,
                         fp8_state=states.get("wi"), impl=impl, axes=wi_axes)
  z = activate(hid.reshape(x.shape[0], n_act, f), acts)
  return gd.grouped_dense(z, wo, group_sizes, recipe=recipe, fp8_state=states.get("wo"),
                          impl=impl, axes=wo_axes)
