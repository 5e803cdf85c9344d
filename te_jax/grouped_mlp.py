"""FP8 grouped MLP ``act(x[rows_e] @ wi[e]) @ wo[e]`` with the activation fused into quantization.

The experts of a mixture of experts as one custom VJP, as ``te_jax.fused_mlp``
is for a dense MLP, so that neither the activation output ``z`` nor its
gradient ``dh`` is written in 16 bits:

* forward: ``h = x @ wi[e]`` (grouped FP8 GEMM, ``x.dtype`` out); one pass
  over ``h`` computes ``z = act(h)`` and writes ``z`` quantized both ways
  (``ops.act_quantize.act_quantize``): rowwise for the second grouped GEMM,
  columnwise for the weight gradient of ``wo``;
* backward: ``dz = g @ wo[e].T``; one pass over ``dz`` and ``h`` computes
  ``dh = dz * act'(h)`` and writes it quantized both ways
  (``dact_quantize``) for the dgrad and wgrad GEMMs of ``wi``.

Against ``te_jax.grouped_dense`` twice with the activation between them in
XLA (``te_jax.moe.experts``' other path) this saves a write and a read of
``z`` in the forward and of ``dh`` in the backward, each rows x F (x n_act for
``dh``) in 16 bits, and the separate float32 activation passes.

The row buffer is quantized as ``grouped_dense`` quantizes it: ``x``, ``z``
and the gradients are one tensor each (one per-tensor scale, or 1x128 tiles;
the caller pads every expert's group to the recipe's ``token_block`` rows,
so no tile spans two experts), each expert weight on its own
(``grouped_dense.quantize_experts``). The delayed-scaling states are the
two grouped GEMMs' (``grouped_dense.init_grouped_state``): ``wi``'s for
``x``, ``wi`` and ``dh``, ``wo``'s for ``z``, ``wo`` and ``g``. So the FP8
values are the unfused path's, but for ``z`` and ``dh`` being quantized from
float32 instead of from their 16-bit roundings.

Residuals, as on the unfused path: ``x.T`` and ``z.T`` in FP8, the FP8 expert
weights (rowwise, for the dgrads), ``h`` in ``x.dtype`` (or, with
``store_act_input_in_fp8``, its E4M3 copy in 1x128 tiles, written by the
forward's activation pass).

Inside ``shard_map`` (expert, tensor and data parallelism,
``te_jax.moe.parallel``) the two GEMMs take their ``grouped_dense.GroupedAxes``
and do what ``grouped_dense`` does with them (amaxes max-reduced over the
token axes, FSDP-sharded kernel dims all-gathered in FP8 and their gradients
reduce-scattered, partial gradients summed); ``z``'s and ``dh``'s amaxes are
max-reduced after the fused pass, which delayed scaling allows (the scale
came from the replicated state) and blockwise does not need. Current scaling
takes its scale from the amax inside the fused pass, so under ``shard_map``
it keeps the unfused path (:func:`why_not_supported` says so).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax

from te_jax import dense as dense_lib
from te_jax import grouped_dense as gd
from te_jax import remat
from te_jax import scaling
from te_jax.ops import act_quantize as act_op

__all__ = ["fp8_grouped_mlp", "why_not_supported", "check_args"]


class _Config(NamedTuple):
  mode: scaling.ScalingMode
  impl: str
  activations: Tuple[str, ...]
  store_act_input_in_fp8: bool
  wi_axes: gd.GroupedAxes
  wo_axes: gd.GroupedAxes


def why_not_supported(m: int, h: int, f: int, recipe, *, sharded: bool = False,
                      gathered_dims: Tuple[int, ...] = ()) -> str:
  """Why :func:`fp8_grouped_mlp` cannot take a buffer of ``m`` rows, hidden
  ``h`` and (local) expert width ``f`` under ``recipe`` ('' when it can).

  It needs ``m`` a multiple of the recipe's ``token_block`` and ``h``, ``f``
  and every FSDP-gathered local kernel dim (``gathered_dims``) multiples of
  128 (``grouped_dense`` pads other sizes; the fused passes do not), FP8 on,
  and inside ``shard_map`` (``sharded``) a recipe whose scales do not come
  from the whole tensor's amax (delayed, blockwise)."""
  if recipe is None:
    return "FP8 is off"
  mode = dense_lib.scaling_mode_of(recipe)
  if sharded and mode.scales_from_whole_tensor:
    return (f"{type(recipe).__name__} takes z's scale from its amax over every device, "
            "which the fused pass cannot reduce")
  if m % mode.token_block or h % 128 or f % 128 or any(d % 128 for d in gathered_dims):
    return (f"the buffer's {m} rows must be a multiple of {mode.token_block} and the hidden "
            f"size {h}, expert width {f} and FSDP-gathered kernel dims {list(gathered_dims)} "
            "multiples of 128")
  return ""


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mlp(x, wi, wo, group_sizes, states, cfg):
  y, _ = _mlp_fwd(x, wi, wo, group_sizes, states, cfg)
  return y


def _mlp_fwd(x, wi, wo, group_sizes, states, cfg):
  mode, impl, ai, ao = cfg.mode, cfg.impl, cfg.wi_axes, cfg.wo_axes
  si, so = states
  qx = mode.quantize(x, "x", si, impl=impl, amax_axes=ai.token_axes)
  h, wi_rows, wi_amax = gd.fprop_gemm(mode, qx.rowwise(), wi, si, group_sizes, ai, x.dtype,
                                      impl)
  qz = mode.quantize_fused(act_op.act_quantize, "x", so, impl=impl, h=h,
                           activations=cfg.activations, h_copy=cfg.store_act_input_in_fp8)
  kept_h = h
  if cfg.store_act_input_in_fp8:
    qz, kept_h = qz
  qz = scaling.reduce_amax(qz, ao.token_axes)
  y, wo_rows, wo_amax = gd.fprop_gemm(mode, qz.rowwise(), wo, so, group_sizes, ao, x.dtype,
                                      impl)
  new = (gd.update_grouped_state(mode, si, {"x": qx.amax}, wi_amax),
         gd.update_grouped_state(mode, so, {"x": qz.amax}, wo_amax))
  # Kept: the wgrads' FP8 x.T and z.T, the dgrads' FP8 weight shards, h for
  # the activation's backward; empty slices carry the dtypes and mesh-axis
  # types of x, h and the weight shards.
  protos = (x[:0, 0], h[:0, 0], wi[:0, 0, 0], wo[:0, 0, 0])
  return y, (qx.columnwise(), wi_rows, kept_h, qz.columnwise(), wo_rows, group_sizes, new,
             protos)


def _mlp_bwd(cfg, res, g):
  mode, impl, ai, ao = cfg.mode, cfg.impl, cfg.wi_axes, cfg.wo_axes
  x_t, wi_rows, h, z_t, wo_rows, group_sizes, (si, so), (x_p, h_p, wi_p, wo_p) = res
  # h is read again behind g (te_jax.dense.after_cotangent): on the
  # reference path XLA would otherwise merge the activation's recomputation
  # with the forward's and keep its intermediates alive in between.
  (h,) = dense_lib.after_cotangent(g, h)
  qg = mode.quantize(g, "grad", so, impl=impl, amax_axes=ao.token_axes)
  # dz as grouped_dense returns z's gradient (z has h's type).
  dz, dwo = gd.backward_gemms(mode, qg, z_t, wo_rows, group_sizes, ao, h_p, wo_p, impl)
  qdh = mode.quantize_fused(act_op.dact_quantize, "grad", si, impl=impl, dz=dz, h=h,
                            activations=cfg.activations)
  qdh = scaling.reduce_amax(qdh, ai.token_axes)
  dx, dwi = gd.backward_gemms(mode, qdh, x_t, wi_rows, group_sizes, ai, x_p, wi_p, impl)
  new = (gd.update_grouped_state(mode, si, {"grad": qdh.amax}),
         gd.update_grouped_state(mode, so, {"grad": qg.amax}))
  return dx, dwi, dwo, None, new


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _gathered_dims(wi, wo, wi_axes: gd.GroupedAxes, wo_axes: gd.GroupedAxes):
  """The local kernel dims that are all-gathered over FSDP axes."""
  dims = []
  for kernel, axes in ((wi, wi_axes), (wo, wo_axes)):
    dims += [kernel.shape[1]] if axes.k_gather_axes else []
    dims += [kernel.shape[2]] if axes.n_gather_axes else []
  return tuple(dims)


def check_args(x, wi, wo, activations, recipe, wi_axes: gd.GroupedAxes = gd.GroupedAxes(),
               wo_axes: gd.GroupedAxes = gd.GroupedAxes()) -> str:
  """Raises for shapes that disagree; returns why the fused path cannot take
  them ('' when it can: :func:`why_not_supported`). ``wi``/``wo`` are the
  local shards inside ``shard_map``."""
  acts = tuple(activations)
  e, nf = wi.shape[0], wi.shape[2]
  h_dim = gd.gathered_size(wi.shape[1], wi_axes.k_gather_axes)
  if (wo.ndim != 3 or wo.shape[0] != e or nf != len(acts) * wo.shape[1]
      or gd.gathered_size(wo.shape[2], wo_axes.n_gather_axes) != h_dim):
    raise ValueError(f"wi (E, H, n_act * F) and wo (E, F, H) must agree for "
                     f"{len(acts)} activation(s) {acts}, got wi {wi.shape} and wo {wo.shape}.")
  if x.ndim != 2 or x.shape[1] != h_dim:
    raise ValueError(f"x must be (M, H) with H = {h_dim} (wi's), got {x.shape}.")
  sharded = wi_axes != gd.GroupedAxes() or wo_axes != gd.GroupedAxes()
  return why_not_supported(x.shape[0], h_dim, wo.shape[1], recipe, sharded=sharded,
                           gathered_dims=_gathered_dims(wi, wo, wi_axes, wo_axes))


def fp8_grouped_mlp(x: jax.Array, wi: jax.Array, wo: jax.Array, group_sizes: jax.Array, *,
                    activations: Tuple[str, ...], recipe, fp8_state: Optional[dict] = None,
                    impl: str = "auto", store_act_input_in_fp8: bool = False,
                    wi_axes: gd.GroupedAxes = gd.GroupedAxes(),
                    wo_axes: gd.GroupedAxes = gd.GroupedAxes()) -> jax.Array:
  """Each expert's MLP ``act(x[rows_e] @ wi[e]) @ wo[e]`` in FP8, fused.

  Args:
    x: (M, H) rows sorted by expert, each group padded to the recipe's
      ``token_block`` (``te_jax.moe.dispatch``); rows outside every group
      give 0.
    wi: (E, H, n_act * F) up-projections, the n_act activation inputs side
      by side along the last dim (``te_jax.moe.experts``' (E, H, n_act, F)
      reshaped); inside ``shard_map`` the local shard.
    wo: (E, F, H) down-projections (likewise).
    group_sizes: (E,) int32 rows per expert, on the device.
    activations: one or two names of ``te_jax.ops.act_quantize.ACTIVATIONS``
      (two: gated, ``act0(h0) * act1(h1)``).
    recipe: a ``te_jax.recipe`` recipe (not None: FP8 off has nothing to fuse).
    fp8_state: ``{"wi": s, "wo": s}``, each ``grouped_dense.init_grouped_state``
      (``DelayedScaling``), else None; its update comes back as its gradient.
    impl: "auto" or "reference".
    store_act_input_in_fp8: keep ``h`` for the backward as E4M3 in 1x128
      tiles (written by the forward's activation pass) instead of ``x.dtype``.
    wi_axes, wo_axes: the two GEMMs' mesh axes inside ``shard_map``
      (``grouped_dense.GroupedAxes``; default unsharded).

  Returns:
    (M, H) in ``x.dtype`` (inside ``shard_map`` with the kernels' width
    split over tensor parallelism: this device's partial sum).

  Raises:
    ValueError for shapes that disagree, or that :func:`why_not_supported`
    refuses (it says why).
  """
  acts = tuple(activations)
  why = check_args(x, wi, wo, acts, recipe, wi_axes, wo_axes)
  if why:
    raise ValueError(f"fp8_grouped_mlp cannot take these experts: {why}; "
                     "te_jax.moe.experts.expert_mlp runs them unfused.")
  mode = dense_lib.scaling_mode_of(recipe)
  states = (None, None) if fp8_state is None else (fp8_state["wi"], fp8_state["wo"])
  for s in states:
    mode.check_state(s)
  cfg = _Config(mode, impl, acts, store_act_input_in_fp8, wi_axes, wo_axes)
  return remat.tag_fp8_gemm(_mlp(x, wi, wo, group_sizes, states, cfg))
