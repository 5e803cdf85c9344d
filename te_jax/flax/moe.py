"""``MoE``: a mixture-of-experts MLP (Linen) whose expert GEMMs run in FP8.

The module declares the router, the experts and the optional shared experts
(``te_jax.layers.moe`` lists the parameters, their shapes and logical axes)
and makes one call into the core (``te_jax.layers.moe.moe_layer``), which
runs the functional block ``te_jax.moe.moe_block``: a float32 router,
tokens sorted by expert into a buffer of static size, every expert's MLP as
grouped FP8 GEMMs under the active recipe, and on a mesh expert parallelism
over the mesh resource's ``ep_resource``.

What a training loop does with it (``examples/train_gpt.py`` does all of it)::

  # the auxiliary losses and the dropped assignments, sown each call
  logits, updates = model.apply(variables, x, mutable=["intermediates", "router_bias"])
  totals = te_jax.moe.aux_totals(updates["intermediates"])
  loss = cross_entropy(logits) + totals["aux_loss"]     # log totals["dropped"]
  # with router_bias_update_rate: the updated router bias, for the next step
  variables = {**variables, "router_bias": updates["router_bias"]}

* ``self.sow("intermediates", "moe_aux", aux)``: a ``te_jax.moe.MoEAux``
  (loss, load-balancing and z losses, tokens per expert, dropped
  assignments) when ``"intermediates"`` is mutable.
* The router bias (DeepSeek-V3's auxiliary-loss-free balancing) is the
  variable ``"bias"`` of the collection :data:`ROUTER_BIAS_COLLECTION`,
  zeros at init. A call that may change that collection (and is not
  ``init``) moves it by ``router_bias_update_rate`` towards balance with
  the loads of its own tokens (``te_jax.layers.moe.next_router_bias``), as
  ``nn.BatchNorm`` updates its statistics; a call without it mutable
  (evaluation) leaves it. Keep the collection out of the optimizer's
  parameters. Under ``nn.scan``, scan it (and "intermediates") with the
  parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import moe as moe_lib
from te_jax.flax import fp8_module
from te_jax.flax.dense import logical_partitioning_of, unboxed
from te_jax.layers import moe as moe_core
from te_jax.layers.checks import compute_dtype
from te_jax.layers.init import default_kernel_init, gated_kernel_init, kernel_fan_in_init

__all__ = ["MoE", "ROUTER_BIAS_COLLECTION", "AUX_NAME"]

Dtype = Any
Initializer = Callable[..., jax.Array]
ROUTER_BIAS_COLLECTION = moe_core.ROUTER_BIAS_COLLECTION
AUX_NAME = "moe_aux"
_AXES = moe_core.KERNEL_AXES


class MoE(nn.Module):
  """Mixture-of-experts MLP: ``y = sum_j w_j(x) * expert_j(x) + shared(x)``.

  Each token goes to its ``num_experts_per_token`` best experts (float32
  router), weighted by their router scores; every expert is an MLP of width
  ``intermediate_dim`` (SwiGLU by default) whose GEMMs run in FP8 under
  ``fp8_autocast``. Shapes: ``inputs`` (..., H) -> (..., H) in the compute
  dtype; with ``return_aux`` also the ``te_jax.moe.MoEAux``.

  Parameters, FP8 state and logical axes: see ``te_jax.layers.moe``
  (``router_kernel``, ``wi_kernel``, ``wo_kernel``, ``shared_wi_kernel``,
  ``shared_wo_kernel``; under ``DelayedScaling`` ``wi_fp8_meta``,
  ``wo_fp8_meta`` with one history per expert, and ``shared_*_fp8_meta``, in
  collection ``"_overwrite_with_gradient"``). The aux values and the router
  bias: see the module docs.

  Attributes:
    num_experts, num_experts_per_token, score_function,
    normalize_topk_weights, routed_scaling_factor, activations,
    capacity_factor, load_balancing_coef, z_loss_coef,
    shared_intermediate_dim, router_bias_update_rate: as
      ``te_jax.moe.MoEConfig`` (SwiGLU, softmax scores, normalized top-k,
      dropless, no aux-loss weight, no shared experts, no bias by default).
    intermediate_dim: F, each expert's hidden width.
    dtype: compute dtype; None promotes input and param dtype.
    param_dtype: parameter dtype (default float32; the router computes in
      float32 whatever it is).
    kernel_init: initializer of the expert and shared kernels, called per
      expert and per activation branch on the (fan-in, fan-out) view of one
      GEMM; a plain initializer (the names come from the ``*_axes``).
    router_init: initializer of the router kernel (H, E).
    router_axes, wi_axes, wo_axes, shared_wi_axes, shared_wo_axes: logical
      axis names of the kernels.
    return_aux: return ``(y, aux)`` instead of y (the aux values are sown
      either way).
    impl: "auto" (default), "cuda" or "reference": the ops'
      implementation (the experts' grouped GEMMs, FP8 under every recipe and
      bf16 with FP8 off, run te_jax's sm_90a kernels where the native module
      has them, on Hopper; everywhere else the reference, logged once:
      ``te_jax.ops.grouped_gemm_cuda.auto_reference_reason`` says why).
  """

  num_experts: int
  num_experts_per_token: int
  intermediate_dim: int
  score_function: str = "softmax"
  normalize_topk_weights: bool = True
  routed_scaling_factor: float = 1.0
  activations: Sequence[str] = ("silu", "linear")
  capacity_factor: Optional[float] = None
  load_balancing_coef: float = 0.0
  z_loss_coef: float = 0.0
  shared_intermediate_dim: Optional[int] = None
  router_bias_update_rate: Optional[float] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  router_init: Initializer = default_kernel_init
  router_axes: Tuple[Optional[str], ...] = _AXES["router_kernel"]
  wi_axes: Tuple[Optional[str], ...] = _AXES["wi_kernel"]
  wo_axes: Tuple[Optional[str], ...] = _AXES["wo_kernel"]
  shared_wi_axes: Tuple[Optional[str], ...] = _AXES["shared_wi_kernel"]
  shared_wo_axes: Tuple[Optional[str], ...] = _AXES["shared_wo_kernel"]
  return_aux: bool = False
  impl: str = "auto"

  def config(self) -> moe_lib.MoEConfig:
    """The module's ``te_jax.moe.MoEConfig`` (validates the attributes)."""
    return moe_core.config_of(self)

  @nn.compact
  def __call__(self, inputs: jax.Array, token_mask: Optional[jax.Array] = None):
    """Applies the block.

    Args:
      inputs: (T, H) or (B, S, H) tokens.
      token_mask: optional bool like the leading dims; False tokens (the
        padding of packed rows) go to no expert and count in no loss.

    Returns:
      y like ``inputs`` (compute dtype), or ``(y, aux)`` with ``return_aux``.
    """
    config = self.config()
    settings = fp8_module.read_autocast(self.impl)
    params = self._declare(inputs.shape[-1], config)
    bias = None
    if config.router_bias_update_rate is not None:
      bias_var = self.variable(ROUTER_BIAS_COLLECTION, moe_core.ROUTER_BIAS_NAME, jnp.zeros,
                               (config.num_experts,), jnp.float32)
      bias = bias_var.value
    y, aux = moe_core.moe_layer(
        fp8_module.LinenStates(self), settings, inputs, params=params, config=config,
        dtype=compute_dtype(self.dtype, inputs.dtype, self.param_dtype), router_bias=bias,
        token_mask=token_mask)
    if (bias is not None and self.is_mutable_collection(ROUTER_BIAS_COLLECTION)
        and not self.is_initializing()):
      bias_var.value = moe_core.next_router_bias(bias, aux, config)
    self.sow("intermediates", AUX_NAME, aux)
    return (y, aux) if self.return_aux else y

  def _declare(self, hidden: int, config: moe_lib.MoEConfig) -> dict:
    """Declares the parameters for inputs (..., hidden): {name: value}."""
    if logical_partitioning_of(self.kernel_init, (hidden, self.intermediate_dim),
                               self.param_dtype) is not None:
      raise ValueError(
          "MoE: kernel_init is wrapped in nn.with_logical_partitioning; one initializer "
          "serves every expert and shared kernel, whose names come from wi_axes, wo_axes, "
          "shared_wi_axes and shared_wo_axes: set those and pass it unwrapped.")
    e, f, n_act = config.num_experts, self.intermediate_dim, len(config.activations)
    gated = gated_kernel_init(self.kernel_init, unboxed)
    plain = kernel_fan_in_init(self.kernel_init, 1, 1, unboxed)
    declare = lambda name, init, shape, axes: self.param(
        name, nn.with_logical_partitioning(init, tuple(axes)), shape, self.param_dtype)
    params = {
        "router_kernel": declare("router_kernel", kernel_fan_in_init(self.router_init, 1, 1,
                                                                     unboxed),
                                 (hidden, e), self.router_axes),
        "wi_kernel": declare("wi_kernel", moe_core.expert_kernel_init(gated),
                             (e, hidden, n_act, f), self.wi_axes),
        "wo_kernel": declare("wo_kernel", moe_core.expert_kernel_init(plain),
                             (e, f, hidden), self.wo_axes)}
    fs = config.shared_intermediate_dim
    if fs is not None:
      params["shared_wi_kernel"] = declare("shared_wi_kernel", gated, (hidden, n_act, fs),
                                           self.shared_wi_axes)
      params["shared_wo_kernel"] = declare("shared_wo_kernel", plain, (fs, hidden),
                                           self.shared_wo_axes)
    return params
