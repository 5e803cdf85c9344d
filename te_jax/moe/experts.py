"""The experts: a gated (SwiGLU, GeGLU) or plain MLP per expert over a sorted buffer.

``y[rows_e] = act(x[rows_e] @ wi[e]) @ wo[e]``, both products grouped GEMMs
in FP8 under the recipe. Activations are named as everywhere in te_jax
(``te_jax.ops.act_quantize.ACTIVATIONS``): one name, or two for a gated
unit ``act0(h0) * act1(h1)`` (("silu", "linear") = SwiGLU).

Two paths, one result up to rounding: with FP8 on and sizes that
``te_jax.grouped_mlp.why_not_supported`` takes (hidden and expert width
multiples of 128; inside ``shard_map`` delayed or blockwise scaling),
:func:`expert_mlp` runs ``te_jax.grouped_mlp``, the activation fused into
the quantization of its output and of its gradient (no 16-bit ``z`` or
``dh`` written). Otherwise (FP8 off; current scaling under ``shard_map``;
other sizes: a warning once names why) two ``te_jax.grouped_dense`` calls
with :func:`activate` between them, in float32, rounded to ``x.dtype``.

Memory (the unfused path): :func:`activate` is a custom VJP whose only residual is its input
``h`` (M, n_act, F), from which the backward recomputes what the
derivative needs inside its own fusion. Differentiated directly, the
float32 chain kept more: XLA's forward wrote a full-size mask of the
activation (1 byte per (M, F) element) next to ``z`` and the backward read
it back. With ``store_act_input_in_fp8``
(``fp8_autocast(store_act_input_in_fp8=True)``) ``h`` is kept as
``te_jax.fused_mlp`` keeps it: E4M3 in 1x128 tiles along the n_act * F
features with power-of-two scales (``te_jax.ops.act_quantize.H_COPY_*``), 1 byte an element
plus 4 per 128 instead of 2; the output is unchanged and the gradient is
that of the activation at ``h`` so rounded.

Weights: ``wi`` (E, H, n_act, F) -- the layout of ``LayerNormMLP``'s
``wi_kernel`` with an expert dim in front, so F can be split over tensor
parallelism without separating a gate from its partner -- and ``wo``
(E, F, H). No biases: a padding row of the buffer then stays 0 through
every expert.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import grouped_dense as gd
from te_jax import grouped_mlp
from te_jax.ops import quantize as quantize_op
from te_jax.ops.act_quantize import (ACTIVATIONS, H_COPY_BLOCK, H_COPY_DTYPE,
                                     H_COPY_POWER_2_SCALE)
from te_jax.ops.fp8 import ScaledTensor

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


def _activation(h: jax.Array, activations: Tuple[str, ...]) -> jax.Array:
  """The formula of :func:`activate`: float32, returned in ``h.dtype``."""
  hf = h.astype(jnp.float32)
  z = ACTIVATIONS[activations[0]].jax_fn(hf[:, 0])
  for i, name in enumerate(activations[1:], 1):
    z = z * ACTIVATIONS[name].jax_fn(hf[:, i])
  return z.astype(h.dtype)


class _ActConfig(NamedTuple):
  activations: Tuple[str, ...]
  store_act_input_in_fp8: bool
  impl: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activate(h, cfg: _ActConfig):
  return _activation(h, cfg.activations)


def _activate_fwd(h, cfg: _ActConfig):
  """The output and what the backward keeps: ``h`` (M, n_act, F), or its
  E4M3 copy as (M, n_act * F) in 1x128 tiles (a ``ScaledTensor``)."""
  z = _activation(h, cfg.activations)
  if not cfg.store_act_input_in_fp8:
    return z, h
  q = quantize_op.quantize_blockwise(h.reshape(h.shape[0], -1), H_COPY_BLOCK,
                                     H_COPY_DTYPE, power_2_scale=H_COPY_POWER_2_SCALE,
                                     impl=cfg.impl)
  return z, q.rowwise()


def _activate_bwd(cfg: _ActConfig, kept, dz):
  # The forward's values are computed again here from what was kept, behind
  # a barrier with dz: else XLA merges them with the forward's (the same
  # operations on the same h) and keeps the merged intermediates alive from
  # the forward, the very residuals this VJP exists to drop.
  (kept,) = dense_lib.after_cotangent(dz, kept)
  if isinstance(kept, ScaledTensor):
    # Power-of-two scales: the dequantized h is exact in dz's dtype (h's);
    # a tile holding a NaN or Inf comes back NaN.
    h = kept.dequantize(dz.dtype).reshape(dz.shape[0], len(cfg.activations), -1)
  else:
    h = kept
  _, vjp = jax.vjp(lambda v: _activation(v, cfg.activations), h)
  return vjp(dz)


_activate.defvjp(_activate_fwd, _activate_bwd)


def activate(h: jax.Array, activations: Sequence[str], *,
             store_act_input_in_fp8: bool = False, impl: str = "auto") -> jax.Array:
  """(M, n_act, F) -> (M, F): ``act0(h0)`` or ``act0(h0) * act1(h1)``, in
  float32, returned in ``h.dtype``.

  Differentiable; its backward keeps only ``h`` (see the module doc), or
  with ``store_act_input_in_fp8`` its E4M3 copy in 1x128 tiles with
  power-of-two scales (one quantize pass over ``h``, ``impl`` "auto" or "reference").
  """
  if not isinstance(store_act_input_in_fp8, bool):
    raise TypeError(f"store_act_input_in_fp8 must be a bool, got "
                    f"{store_act_input_in_fp8!r}.")
  if h.ndim != 3:
    raise ValueError(f"h must be (M, n_act, F), got shape {h.shape}.")
  acts = check_activations(activations)
  if h.shape[1] != len(acts):
    raise ValueError(f"h (M, n_act, F) has n_act = {h.shape[1]}, but {len(acts)} "
                     f"activation(s) {acts} were given.")
  return _activate(h, _ActConfig(acts, store_act_input_in_fp8, impl))


def _why_not_fused(x, wi, wo, acts, wi_axes, wo_axes, recipe) -> str:
  """Why the experts cannot run as ``te_jax.grouped_mlp`` ('' when they can);
  ``wi`` (E, H, n_act * F), ``wo`` (E, F, H). Its own function so that tests
  can pin the unfused path."""
  return grouped_mlp.check_args(x, wi, wo, acts, recipe, wi_axes, wo_axes)


@functools.lru_cache(maxsize=None)
def _warn_unfused(reason: str):
  logging.getLogger("te_jax").warning(
      "te_jax: the MoE experts run their activation between two grouped GEMMs instead of "
      "fused into the quantization (te_jax.grouped_mlp): %s.", reason)


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
               wo_axes: gd.GroupedAxes = gd.GroupedAxes(),
               store_act_input_in_fp8: bool = False) -> jax.Array:
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
    store_act_input_in_fp8: keep the activation's input for the backward
      in E4M3 1x128 tiles instead of ``x.dtype`` (:func:`activate`).

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
  wi3 = wi.reshape(e, h, n_act * f)   # the GEMM's (E, K, N)
  if recipe is not None:
    unfused = _why_not_fused(x, wi3, wo, acts, wi_axes, wo_axes, recipe)
    if not unfused:
      return grouped_mlp.fp8_grouped_mlp(x, wi3, wo, group_sizes, activations=acts,
                                         recipe=recipe, fp8_state=fp8_state, impl=impl,
                                         store_act_input_in_fp8=store_act_input_in_fp8,
                                         wi_axes=wi_axes, wo_axes=wo_axes)
    _warn_unfused(unfused)
  states: Optional[dict] = fp8_state or {}
  hid = gd.grouped_dense(x, wi3, group_sizes, recipe=recipe,
                         fp8_state=states.get("wi"), impl=impl, axes=wi_axes)
  z = activate(hid.reshape(x.shape[0], n_act, f), acts,
               store_act_input_in_fp8=store_act_input_in_fp8, impl=impl)
  return gd.grouped_dense(z, wo, group_sizes, recipe=recipe, fp8_state=states.get("wo"),
                          impl=impl, axes=wo_axes)
