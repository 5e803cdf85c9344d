"""``MoE`` as an NNX module: a mixture-of-experts MLP whose expert GEMMs run in FP8.

Same parameters (names, shapes, logical axes), the same call into the core
(``te_jax.layers.moe.moe_layer``) and the same numbers as
``te_jax.flax.MoE``. NNX holds the rest as variables of the module:

* :class:`MoEMetrics` ``aux``: the ``te_jax.moe.MoEAux`` of the last call
  (auxiliary losses, tokens per expert, dropped assignments), for the loss
  and the log;
* :class:`RouterBias` ``router_bias`` (with ``router_bias_update_rate``):
  DeepSeek-V3's selection bias, zeros at construction, moved towards
  balance by each training call (``deterministic`` False, i.e.
  ``model.train()``; ``model.eval()`` leaves it), as ``nnx.BatchNorm``
  updates its statistics. Neither is an ``nnx.Param`` (``nnx.Optimizer(...,
  wrt=nnx.Param)`` leaves them) nor differentiated (not in
  ``te_jax.nnx.WRT``); both are written back by ``nnx.jit`` /
  ``nnx.value_and_grad`` like any state a call changes.

A training step::

  def loss_fn(model):
    logits = model(x)
    totals = te_jax.moe.aux_totals(nnx.state(model, tnx.MoEMetrics))
    return cross_entropy(logits) + totals["aux_loss"], totals["dropped"]

  (loss, dropped), grads = nnx.value_and_grad(
      loss_fn, argnums=nnx.DiffState(0, tnx.WRT), has_aux=True)(model)
  optimizer.update(model, grads)
  tnx.apply_fp8_updates(model, grads)     # delayed scaling's FP8 state
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import moe as moe_lib
from te_jax.layers import moe as moe_core
from te_jax.layers.checks import compute_dtype
from te_jax.layers.init import default_kernel_init, gated_kernel_init
from te_jax.nnx import state as st
from te_jax.nnx.linear import kernel_fan_in_init, param, unboxed

__all__ = ["MoE", "MoEMetrics", "RouterBias"]

Dtype = Any
Initializer = Callable[..., jax.Array]
_AXES = moe_core.KERNEL_AXES


class MoEMetrics(nnx.Variable):
  """The ``te_jax.moe.MoEAux`` of a ``MoE`` module's last call (zeros before
  the first). ``te_jax.moe.aux_totals(nnx.state(model, MoEMetrics))`` sums a
  model's."""


class RouterBias(nnx.Variable):
  """DeepSeek-V3's router selection bias (E,) float32, updated by the module
  in its training calls (see the module docs)."""


class MoE(nnx.Module):
  """Mixture-of-experts MLP: ``y = sum_j w_j(x) * expert_j(x) + shared(x)``.

  ``te_jax.flax.MoE`` as an NNX module. Shapes: ``x`` (..., in_features) ->
  (..., in_features) in the compute dtype.

  Args:
    in_features: H, the input's (and output's) last dim.
    num_experts, num_experts_per_token, intermediate_dim: E, k and each
      expert's hidden width F.
    score_function, normalize_topk_weights, routed_scaling_factor,
    activations, capacity_factor, load_balancing_coef, z_loss_coef,
    shared_intermediate_dim, router_bias_update_rate, dtype, param_dtype,
    kernel_init, router_init, router_axes, wi_axes, wo_axes,
    shared_wi_axes, shared_wo_axes, impl: as the Linen module.
    deterministic: default of the call argument; False (``model.train()``)
      updates the router bias, True (``model.eval()``) does not.
    rngs: ``nnx.Rngs`` (its "params" stream initializes the kernels).

  FP8 state under ``DelayedScaling`` (``te_jax.layers.moe``): ``wi_fp8_meta``
  and ``wo_fp8_meta`` with one amax history per expert, and
  ``shared_wi_fp8_meta``, ``shared_wo_fp8_meta`` with shared experts.
  ``te_jax.nnx.init_fp8_state`` gives them the same shapes (see
  :meth:`__setattr__`).
  """

  FP8_GEMMS = moe_core.FP8_GEMMS

  def __init__(self, in_features: int, num_experts: int, num_experts_per_token: int,
               intermediate_dim: int, *, score_function: str = "softmax",
               normalize_topk_weights: bool = True, routed_scaling_factor: float = 1.0,
               activations: Sequence[str] = ("silu", "linear"),
               capacity_factor: Optional[float] = None, load_balancing_coef: float = 0.0,
               z_loss_coef: float = 0.0, shared_intermediate_dim: Optional[int] = None,
               router_bias_update_rate: Optional[float] = None,
               dtype: Optional[Dtype] = None, param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               router_init: Initializer = default_kernel_init,
               router_axes=_AXES["router_kernel"], wi_axes=_AXES["wi_kernel"],
               wo_axes=_AXES["wo_kernel"], shared_wi_axes=_AXES["shared_wi_kernel"],
               shared_wo_axes=_AXES["shared_wo_kernel"], deterministic: bool = False,
               impl: str = "auto", rngs: nnx.Rngs):
    self.config = moe_lib.MoEConfig(
        num_experts, num_experts_per_token, score_function=score_function,
        normalize_topk_weights=normalize_topk_weights,
        routed_scaling_factor=routed_scaling_factor, activations=tuple(activations),
        capacity_factor=capacity_factor, load_balancing_coef=load_balancing_coef,
        z_loss_coef=z_loss_coef, shared_intermediate_dim=shared_intermediate_dim,
        router_bias_update_rate=router_bias_update_rate)
    for name, v in (("in_features", in_features), ("intermediate_dim", intermediate_dim)):
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MoE: {name} must be an int >= 1, got {v!r}.")
    self.in_features, self.intermediate_dim = in_features, intermediate_dim
    self.dtype, self.param_dtype, self.impl = dtype, param_dtype, impl
    self.deterministic = deterministic
    h, e, f = in_features, num_experts, intermediate_dim
    n_act = len(self.config.activations)
    gated = gated_kernel_init(kernel_init, unboxed)
    plain = kernel_fan_in_init(kernel_init, 1, 1)
    self.router_kernel = param(rngs, kernel_fan_in_init(router_init, 1, 1), (h, e),
                               param_dtype, router_axes)
    self.wi_kernel = param(rngs, moe_core.expert_kernel_init(gated), (e, h, n_act, f),
                           param_dtype, wi_axes)
    self.wo_kernel = param(rngs, moe_core.expert_kernel_init(plain), (e, f, h),
                           param_dtype, wo_axes)
    fs = shared_intermediate_dim
    if fs is not None:
      self.shared_wi_kernel = param(rngs, gated, (h, n_act, fs), param_dtype, shared_wi_axes)
      self.shared_wo_kernel = param(rngs, plain, (fs, h), param_dtype, shared_wo_axes)
    self.router_bias = (RouterBias(jnp.zeros((e,), jnp.float32))
                        if router_bias_update_rate is not None else None)
    self.aux = MoEMetrics(moe_core.zero_aux(e))
    st.add_fp8_state(self, st.construction_mode(impl))

  def __setattr__(self, name, value):
    """Gives an ``FP8State`` set on a GEMM of this module the shapes that GEMM
    needs: an expert GEMM's dense-shaped state (from
    ``te_jax.nnx.init_fp8_state``, which creates one layout for every GEMM)
    becomes one kernel history per expert; a shared-expert state on a module
    without shared experts is not kept."""
    config = getattr(self, "config", None)   # None while NNX rebuilds a module
    if isinstance(value, st.FP8State) and name in moe_core.FP8_GEMMS and config is not None:
      if name in moe_core.SHARED_GEMMS and config.shared_intermediate_dim is None:
        return
      if name in moe_core.EXPERT_GEMMS:
        value = st.FP8State(_per_expert(value.get_value(), config.num_experts))
    super().__setattr__(name, value)

  def __call__(self, x: jax.Array, token_mask: Optional[jax.Array] = None,
               deterministic: Optional[bool] = None) -> jax.Array:
    """Applies the block; ``token_mask`` as the Linen module's; a call with
    ``deterministic`` False (default: the attribute) updates the router bias."""
    if x.shape[-1] != self.in_features:
      raise ValueError(f"MoE: the input's last dim ({x.shape[-1]}) must equal in_features "
                       f"({self.in_features}).")
    deterministic = self.deterministic if deterministic is None else deterministic
    params = {name: getattr(self, name)[...] for name in moe_core.KERNEL_AXES
              if hasattr(self, name)}
    bias = None if self.router_bias is None else self.router_bias[...]
    y, aux = moe_core.moe_layer(
        st.NnxStates(self), st.read_autocast(self.impl), x, params=params,
        config=self.config, dtype=compute_dtype(self.dtype, x.dtype, self.param_dtype),
        router_bias=bias, token_mask=token_mask)
    self.aux.set_value(aux)
    if bias is not None and not deterministic:
      self.router_bias.set_value(moe_core.next_router_bias(bias, aux, self.config))
    return y


def _per_expert(state, num_experts: int):
  """A dense GEMM state (``te_jax.fp8_state`` layout) as a grouped one in the
  modules' layout: the kernel's history and scale repeated per expert
  (``te_jax.layers.moe.GroupedMode``); a grouped one as it is."""
  kernel = state["kernel"]
  if jnp.ndim(kernel["scale"]) == 2:
    return state
  return dict(state, kernel={
      "amax_history": jnp.broadcast_to(kernel["amax_history"],
                                       (num_experts,) + jnp.shape(kernel["amax_history"])),
      "scale": jnp.broadcast_to(kernel["scale"], (num_experts, 1))})
