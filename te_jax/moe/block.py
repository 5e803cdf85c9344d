"""The functional MoE block: router, dispatch, experts in FP8, combine, shared experts.

:func:`moe_block` is the whole mixture-of-experts layer as one function of
its parameters (the Linen and NNX modules declare those and call it):

1. route in float32 (``te_jax.moe.router``);
2. sort the assignments by expert into a buffer of static size, each group
   padded to the recipe's token block (``te_jax.moe.dispatch``);
3. run every expert's MLP with grouped FP8 GEMMs (``te_jax.moe.experts``);
4. combine each token's k outputs weighted by the router;
5. add the shared experts (an ordinary MLP every token goes through).

With a mesh, step 2-4 run per device inside ``shard_map`` with the experts
sharded over an expert-parallel axis and tokens exchanged by all-to-all
(``te_jax.moe.parallel``); routing, losses and shared experts stay outside,
where XLA partitions them like any other layer.

Parameters (a dict; H hidden, E experts, F the expert width, n_act the
number of activations, 2 for a gated unit):

=============  =====================  ==========================================
name           shape                  logical axes (sharding)
=============  =====================  ==========================================
router         (H, E)                 ("embed", None); replicated in practice
wi             (E, H, n_act, F)       ("expert", "embed", "act", "mlp")
wo             (E, F, H)              ("expert", "mlp", "embed")
shared_wi      (H, n_act, Fs)         ("embed", "act", "mlp"), optional
shared_wo      (Fs, H)                ("mlp", "embed"), optional
=============  =====================  ==========================================

FP8 state (``DelayedScaling`` only, :func:`init_fp8_state`): ``{"wi": g,
"wo": g}`` with ``g`` a grouped-dense state (one amax history per expert
weight), plus ``"shared_wi"``/``"shared_wo"`` dense states with shared
experts. As for every te_jax GEMM, its update comes back as its gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import explicit_axes as explicit_lib
from te_jax import fused_mlp
from te_jax import sharding as sharding_lib
from te_jax.moe import dispatch as dispatch_lib
from te_jax.moe import experts as experts_lib
from te_jax.moe import parallel
from te_jax.moe import router as router_lib
from te_jax.moe.scopes import SCOPES

__all__ = ["MoEConfig", "MoEAux", "moe_block", "init_params", "init_fp8_state",
           "aux_totals", "SCOPES"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """What a mixture-of-experts layer is (static; the parameters carry the sizes).

  Attributes:
    num_experts: E, routed experts.
    num_experts_per_token: k.
    score_function: "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3).
    normalize_topk_weights: each token's k weights divided by their sum.
    routed_scaling_factor: multiplies the routed experts' weights.
    activations: one or two names of ``te_jax.ops.act_quantize.ACTIVATIONS``;
      ("silu", "linear") is SwiGLU, ("gelu",) a plain GELU MLP.
    capacity_factor: None (dropless, the default) or > 0: each expert keeps
      ``capacity_factor * T * k / E`` assignments (rounded up to the token
      block) per device; the rest are dropped and counted.
    load_balancing_coef: weight of ``router.load_balancing_loss`` in
      ``MoEAux.loss`` (0: reported, not added).
    z_loss_coef: weight of ``router.router_z_loss`` in ``MoEAux.loss``.
    shared_intermediate_dim: width of the shared experts' MLP (every token
      goes through it), or None: none. The modules (``te_jax.flax.MoE``,
      ``te_jax.nnx.MoE``) declare them from it; :func:`moe_block` takes them
      from ``params`` and checks the width when it is set.
    router_bias_update_rate: DeepSeek-V3's bias-based balancing: the rate of
      ``router.update_balance_bias`` (1e-3 in DeepSeek-V3), or None: no
      bias. The modules keep the bias and update it in their training
      calls; :func:`moe_block` needs it as ``router_bias`` when this is set
      (the caller then updates it).
  """

  num_experts: int
  num_experts_per_token: int
  score_function: str = "softmax"
  normalize_topk_weights: bool = True
  routed_scaling_factor: float = 1.0
  activations: Tuple[str, ...] = ("silu", "linear")
  capacity_factor: Optional[float] = None
  load_balancing_coef: float = 0.0
  z_loss_coef: float = 0.0
  shared_intermediate_dim: Optional[int] = None
  router_bias_update_rate: Optional[float] = None

  def __post_init__(self):
    for name in ("num_experts", "num_experts_per_token"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}.")
    if self.num_experts_per_token > self.num_experts:
      raise ValueError(f"num_experts_per_token ({self.num_experts_per_token}) must be at "
                       f"most num_experts ({self.num_experts}).")
    if self.score_function not in router_lib.SCORE_FUNCTIONS:
      raise ValueError(f"score_function must be one of {router_lib.SCORE_FUNCTIONS}, got "
                       f"{self.score_function!r}.")
    if not isinstance(self.normalize_topk_weights, bool):
      raise TypeError(f"normalize_topk_weights must be a bool, got "
                      f"{self.normalize_topk_weights!r}.")
    object.__setattr__(self, "activations",
                       experts_lib.check_activations(self.activations))
    if self.capacity_factor is not None:
      dispatch_lib.capacity_rows(self.capacity_factor, 1, 1, 1)   # validates it
    for name in ("routed_scaling_factor", "load_balancing_coef", "z_loss_coef"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}.")
    f = self.shared_intermediate_dim
    if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
      raise ValueError(f"shared_intermediate_dim must be None (no shared experts) or an int "
                       f">= 1, got {f!r}.")
    rate = self.router_bias_update_rate
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not 0 <= rate < math.inf):
      raise ValueError(f"router_bias_update_rate must be None (no router bias) or a finite "
                       f"number >= 0, got {rate!r}.")


class MoEAux(NamedTuple):
  """What the block reports besides its output (float32 / int32 scalars unless noted).

  Attributes:
    loss: ``load_balancing_coef * load_balancing_loss + z_loss_coef *
      router_z_loss``, to add to the training loss.
    load_balancing_loss: ``router.load_balancing_loss`` (1 when balanced).
    router_z_loss: ``router.router_z_loss``.
    tokens_per_expert: (E,) float32 assignments per expert over every
      device (the input of ``router.update_balance_bias``).
    dropped: int32 assignments dropped by the capacity over every device (0
      when dropless).
  """

  loss: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  tokens_per_expert: jax.Array
  dropped: jax.Array


def init_params(key: jax.Array, config: MoEConfig, hidden: int, intermediate: int, *,
                shared_intermediate: Optional[int] = None, dtype=jnp.float32) -> dict:
  """Parameters of :func:`moe_block` (see the module doc), fan-in scaled normals."""
  e, n_act = config.num_experts, len(config.activations)
  keys = jax.random.split(key, 5)
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32) *
                                     fan_in ** -0.5).astype(dtype)
  params = {"router": normal(keys[0], (hidden, e), hidden),
            "wi": normal(keys[1], (e, hidden, n_act, intermediate), hidden),
            "wo": normal(keys[2], (e, intermediate, hidden), intermediate)}
  if shared_intermediate:
    params["shared_wi"] = normal(keys[3], (hidden, n_act, shared_intermediate), hidden)
    params["shared_wo"] = normal(keys[4], (shared_intermediate, hidden), shared_intermediate)
  return params


def init_fp8_state(recipe, config: MoEConfig, *, shared: bool = False):
  """Fresh FP8 state of :func:`moe_block` under ``recipe`` (None if stateless)."""
  states = experts_lib.init_expert_states(recipe, config.num_experts)
  if states is None or not shared:
    return states
  dense_state = dense_lib.scaling_mode_of(recipe).init_state()
  return dict(states, shared_wi=dense_state,
              shared_wo=jax.tree.map(jnp.copy, dense_state))


def _check_params(params, config, x):
  h = x.shape[-1]
  e, n_act = config.num_experts, len(config.activations)
  for name in ("router", "wi", "wo"):
    if name not in params:
      raise ValueError(f"params must hold {name!r} (see te_jax.moe.block), got keys "
                       f"{sorted(params)}.")
  if params["router"].shape != (h, e):
    raise ValueError(f"params['router'] must be (H, E) = ({h}, {e}), got "
                     f"{params['router'].shape}.")
  wi = params["wi"]
  if wi.ndim != 4 or wi.shape[:3] != (e, h, n_act):
    raise ValueError(f"params['wi'] must be (E, H, n_act, F) = ({e}, {h}, {n_act}, F), "
                     f"got {wi.shape}.")
  if params["wo"].shape != (e, wi.shape[3], h):
    raise ValueError(f"params['wo'] must be (E, F, H) = ({e}, {wi.shape[3]}, {h}), got "
                     f"{params['wo'].shape}.")
  if ("shared_wi" in params) != ("shared_wo" in params):
    raise ValueError("params must hold both shared_wi and shared_wo, or neither.")
  fs = config.shared_intermediate_dim
  if fs is not None and ("shared_wi" not in params or params["shared_wi"].shape[-1] != fs
                         or params["shared_wo"].shape[0] != fs):
    got = (params["shared_wi"].shape, params["shared_wo"].shape) if "shared_wi" in params \
        else "none"
    raise ValueError(f"config.shared_intermediate_dim={fs}: params must hold shared_wi "
                     f"(H, n_act, {fs}) and shared_wo ({fs}, H), got {got}.")


@functools.lru_cache(maxsize=None)
def _log_shared_unfused(reason: str):
  """Says once per reason why the shared experts run as two FP8 dense layers."""
  logging.getLogger("te_jax").info(
      "te_jax: the MoE's shared experts run as two FP8 dense layers (not the fused "
      "activation-quantize MLP, which is faster and holds less memory): %s", reason)


def shared_unfused_reason(x_shape, params, config, recipe, mesh_resource, mesh,
                          expert_parallel: bool) -> Optional[str]:
  """Why the shared experts of an FP8 block cannot run as one fused MLP
  (``te_jax.fused_mlp.fp8_mlp``: the activation and its quantization in one
  pass, forward and backward), or None when they can. ``x_shape``: (..., H);
  ``expert_parallel``: the routed experts run under an expert-parallel plan."""
  if expert_parallel or not sharding_lib.gemms_unsharded(mesh_resource, mesh):
    return "the block is sharded (the fused MLP has no sharding rule)"
  m, h, fs = math.prod(x_shape[:-1]), x_shape[-1], params["shared_wo"].shape[0]
  return fused_mlp.why_not_supported(m, h, fs, h, recipe, config.activations) or None


def _shared_mlp(x, params, config, recipe, fp8_state, impl, mesh_resource, mesh,
                store_act_input_in_fp8, fused: bool = False, keep_fp8_copies: bool = False):
  """The shared experts: one MLP every token goes through, sharded like
  ``LayerNormMLP`` (FSDP on embed, tensor parallelism on mlp). ``fused``
  (FP8, unsharded: :func:`shared_unfused_reason`): one
  ``te_jax.fused_mlp.fp8_mlp`` with the activation fused into the
  quantization of its output, keeping what ``keep_fp8_copies`` says for the
  backward; else two dense GEMMs around an XLA activation."""
  states = fp8_state or {}
  if fused:
    h = x.shape[-1]
    y = fused_mlp.fp8_mlp(
        x.reshape(-1, h), params["shared_wi"].reshape(h, -1), params["shared_wo"],
        activations=config.activations, recipe=recipe, wi_state=states.get("shared_wi"),
        wo_state=states.get("shared_wo"), impl=impl, dtype=x.dtype,
        save_original_input=not keep_fp8_copies, save_original_kernel=not keep_fp8_copies,
        store_act_input_in_fp8=store_act_input_in_fp8)
    return y.reshape(x.shape)
  sharded = dict(mesh_resource=mesh_resource, mesh=mesh)
  hid = dense_lib.dense_general(x, params["shared_wi"], recipe=recipe,
                                fp8_state=states.get("shared_wi"), impl=impl,
                                kernel_axes=("embed", "act", "mlp"), **sharded)
  n_act = params["shared_wi"].shape[1]
  z = experts_lib.activate(hid.reshape(-1, n_act, hid.shape[-1]), config.activations,
                           store_act_input_in_fp8=store_act_input_in_fp8, impl=impl)
  z = z.reshape(hid.shape[:-2] + z.shape[-1:])
  return dense_lib.dense_general(z, params["shared_wo"], recipe=recipe,
                                 fp8_state=states.get("shared_wo"), impl=impl,
                                 kernel_axes=("mlp", "embed"), **sharded)


def _local_experts(x2, routing, params, config, recipe, fp8_state, impl,
                   store_act_input_in_fp8):
  """Steps 2-4 on one device: (T, H) -> (T, H) and the dropped count."""
  t, k = routing.expert_ids.shape
  e, block = config.num_experts, experts_lib.token_block(recipe)
  capacity = None
  if config.capacity_factor is not None:
    capacity = dispatch_lib.capacity_rows(config.capacity_factor, t * k, e, block)
  rows = dispatch_lib.segment_rows(t * k, e, block, capacity)
  with jax.named_scope(SCOPES["dispatch"]):
    d = dispatch_lib.plan(dispatch_lib.flat_assignments(routing.expert_ids), num_experts=e,
                          block=block, rows_per_segment=rows, capacity=capacity)
    buf = dispatch_lib.dispatch_rows(x2, d, rows)
  with jax.named_scope(SCOPES["experts"]):
    out = experts_lib.expert_mlp(buf, d.group_sizes, params["wi"], params["wo"],
                                 activations=config.activations, recipe=recipe,
                                 fp8_state=fp8_state, impl=impl,
                                 store_act_input_in_fp8=store_act_input_in_fp8)
  with jax.named_scope(SCOPES["combine"]):
    return dispatch_lib.combine_rows(out, d, routing.weights), d.dropped


def moe_block(x: jax.Array, params: dict, *, config: MoEConfig, recipe=None,
              fp8_state=None, router_bias: Optional[jax.Array] = None,
              token_mask: Optional[jax.Array] = None, impl: str = "auto",
              mesh_resource: Optional[sharding_lib.MeshResource] = None,
              ep_axis: Optional[str] = None, mesh=None,
              store_act_input_in_fp8: bool = False,
              keep_fp8_copies: bool = False) -> Tuple[jax.Array, MoEAux]:
  """The mixture-of-experts layer ``y = sum_j w_j * expert_j(x) + shared(x)``.

  Args:
    x: (..., H) tokens: (T, H), or (batch, seq, H) under sequence parallelism.
    params: see the module doc.
    config: a :class:`MoEConfig`.
    recipe: a ``te_jax.recipe`` recipe (the expert and shared GEMMs run in
      FP8), or None (FP8 off: the same grouped GEMMs unquantized).
    fp8_state: :func:`init_fp8_state` for ``DelayedScaling``, else None.
    router_bias: optional (E,) selection bias (bias-based balancing; update
      it with ``router.update_balance_bias`` after each step).
    token_mask: optional bool (...,) like x's leading dims; False tokens
      (padding) are routed nowhere and their output is the shared experts'
      alone (0 without them).
    impl: "auto" or "reference" for the ops.
    mesh_resource: ``te_jax.sharding.MeshResource`` of the mesh (dp, ep,
      fsdp, tp, sequence parallelism): the experts are sharded over its
      ``ep_resource`` (expert parallelism), tokens split over it as over the
      data axes; None with no ``ep_axis``: unsharded.
    ep_axis: the expert axis by name, for a mesh resource without an
      ``ep_resource`` (the same as setting it there).
    mesh: the mesh; default the active one.
    store_act_input_in_fp8: keep the experts' activation inputs (h, rows x
      n_act * F) for the backward in E4M3 1x128 tiles with power-of-two
      scales instead of x's dtype (``te_jax.moe.experts.activate``): the
      routed experts always, the shared experts when nothing is sharded
      (else they keep h in x's dtype and a warning says so once).
    keep_fp8_copies: what the shared experts' fused MLP keeps for its
      backward (``fp8_autocast``'s option of that name): False, the memory
      plan (x and the kernels, quantized again in the backward); True, the
      forward's FP8 copies. The shared experts run fused under FP8 when
      nothing is sharded and the shapes allow it
      (:func:`shared_unfused_reason`; else two FP8 dense layers, logged
      once at INFO, which keep their FP8 copies either way).

  Returns:
    ``(y, aux)``: y like x, aux a :class:`MoEAux`.
  """
  if not isinstance(config, MoEConfig):
    raise TypeError(f"config must be a te_jax.moe.MoEConfig, got {config!r}.")
  _check_params(params, config, x)
  lead, h = x.shape[:-1], x.shape[-1]
  mask = None if token_mask is None else jnp.asarray(token_mask).reshape(-1)
  if token_mask is not None and jnp.shape(token_mask) != lead:
    raise ValueError(f"token_mask must have shape {lead} (x's leading dims), got "
                     f"{jnp.shape(token_mask)}.")
  if config.router_bias_update_rate is not None and router_bias is None:
    raise ValueError("config.router_bias_update_rate is set (bias-based balancing): pass the "
                     "router_bias (E,) (zeros at first) and update it after each step with "
                     "te_jax.moe.update_balance_bias.")
  for name, flag in (("store_act_input_in_fp8", store_act_input_in_fp8),
                     ("keep_fp8_copies", keep_fp8_copies)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}.")
  plan = parallel.make_plan(x.shape, config, recipe, mesh_resource, ep_axis, mesh,
                            store_act_input_in_fp8)
  with jax.named_scope(SCOPES["router"]):
    routing = router_lib.route(
        x.reshape(-1, h), params["router"], num_experts_per_token=config.num_experts_per_token,
        score_function=config.score_function, normalize_weights=config.normalize_topk_weights,
        scaling_factor=config.routed_scaling_factor, bias=router_bias, token_mask=mask,
        top_k_ids=None if plan is None else parallel.top_k_ids(plan, lead))
  if fp8_state is not None and not (isinstance(fp8_state, dict) and
                                    {"wi", "wo"} <= set(fp8_state)):
    raise ValueError("fp8_state must be the dict of te_jax.moe.init_fp8_state (with 'wi' "
                     f"and 'wo'), got {type(fp8_state).__name__}.")
  expert_states = None if fp8_state is None else {r: fp8_state[r] for r in ("wi", "wo")}
  if plan is None:
    y2, dropped = _local_experts(x.reshape(-1, h), routing, params, config, recipe,
                                 expert_states, impl, store_act_input_in_fp8)
    y = y2.reshape(x.shape)
  else:
    y, dropped = parallel.sharded_experts(x, routing, params["wi"], params["wo"],
                                          expert_states, plan=plan, impl=impl)
  if "shared_wi" in params:
    # the expert axis is a data axis for the shared experts
    shared_mr = parallel.dense_mesh_resource(mesh_resource, ep_axis)
    fused = False
    if recipe is not None:
      reason = shared_unfused_reason(x.shape, params, config, recipe, shared_mr,
                                     sharding_lib.get_mesh(mesh), plan is not None)
      fused = reason is None
      if not fused:
        _log_shared_unfused(reason)
    # XLA partitions the unfused shared experts: their h stays in x's dtype
    # unless nothing is sharded (the quantize keeping it has no sharding rule)
    shared_fp8 = store_act_input_in_fp8 and plan is None and not explicit_lib.explicit_axes()
    if store_act_input_in_fp8 and not shared_fp8:
      fused_mlp.warn_act_input_not_in_fp8(
          "the MoE's shared experts", "they run sharded by XLA's partitioner, and the "
          "quantize that would keep it has no sharding rule (the routed experts keep "
          "theirs in FP8)")
    with jax.named_scope(SCOPES["shared"]):
      y = y + _shared_mlp(x, params, config, recipe, fp8_state, impl, shared_mr,
                          mesh, shared_fp8, fused, keep_fp8_copies).astype(y.dtype)
  with jax.named_scope(SCOPES["router"]):
    lb = router_lib.load_balancing_loss(routing)
    z = router_lib.router_z_loss(routing)
    loss = jnp.float32(config.load_balancing_coef) * lb + jnp.float32(config.z_loss_coef) * z
    aux = MoEAux(loss, lb, z, router_lib.tokens_per_expert(routing, config.num_experts),
                 dropped)
  return y, aux


def aux_totals(tree) -> dict:
  """What a training loop logs of every :class:`MoEAux` in ``tree``.

  ``tree``: any pytree holding MoEAux values: the ``"intermediates"`` a
  Linen model sowed (``te_jax.flax.MoE``), the ``te_jax.nnx.MoEMetrics``
  state of an NNX model, a list of ``moe_block`` results. Stacked layers
  (``nn.scan``) hold one entry per layer.

  Returns:
    ``{"aux_loss": sum of the losses (add it to the training loss),
    "dropped": int32 sum of the dropped assignments, "load_balancing_loss",
    "router_z_loss": their means over the layers, "layers": how many}``;
    zeros (and ``layers`` 0) when ``tree`` holds none.
  """
  found = [a for a in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, MoEAux))
           if isinstance(a, MoEAux)]
  n = sum(int(math.prod(jnp.shape(a.loss))) for a in found)

  def total(field, dtype=jnp.float32):
    return sum((jnp.sum(getattr(a, field)).astype(dtype) for a in found), jnp.zeros((), dtype))

  mean = lambda field: total(field) / max(n, 1)
  return {"aux_loss": total("loss"), "dropped": total("dropped", jnp.int32),
          "load_balancing_loss": mean("load_balancing_loss"),
          "router_z_loss": mean("router_z_loss"), "layers": n}

