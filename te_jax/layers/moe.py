"""The mixture-of-experts block of the te_jax modules (Linen and NNX), framework-neutral.

:func:`moe_layer` is what ``te_jax.flax.MoE`` and ``te_jax.nnx.MoE`` call
once per call: it reads nothing but the :class:`~te_jax.layers.settings.Settings`
the module read once, takes the FP8 state of the module's GEMMs through its
:class:`~te_jax.layers.state.GemmStates`, and runs ``te_jax.moe.moe_block``
on the path the settings give: unsharded, or sharded over the autocast's
mesh resource (experts over its ``ep_resource``, FSDP, tensor and sequence
parallelism; ``te_jax.moe.parallel``).

``fp8_autocast(store_act_input_in_fp8=True)`` reaches the experts: they keep
their activation's input in E4M3 1x128 tiles for the backward (the shared
experts only where nothing is sharded; ``te_jax.moe.moe_block``). Under FP8
with nothing sharded the shared experts run as one fused MLP
(``te_jax.fused_mlp.fp8_mlp``), keeping what ``keep_fp8_copies`` says.

Parameters (module names; H hidden, E experts, F ``intermediate_dim``, Fs
``shared_intermediate_dim``, n_act the activations, 2 for SwiGLU):

==================  =====================  =================================
name                shape                  logical axes
==================  =====================  =================================
router_kernel       (H, E)                 (None, None): replicated, float32
wi_kernel           (E, H, n_act, F)       ("expert", "embed", "act", "mlp")
wo_kernel           (E, F, H)              ("expert", "mlp", "embed")
shared_wi_kernel    (H, n_act, Fs)         ("embed", "act", "mlp")
shared_wo_kernel    (Fs, H)                ("mlp", "embed")
==================  =====================  =================================

FP8 state (``DelayedScaling`` only; :data:`FP8_GEMMS`): ``wi_fp8_meta`` and
``wo_fp8_meta`` hold one amax history per expert weight,
``{"x": s, "kernel": {"amax_history": (E, L), "scale": (E, 1)}, "grad": s}``
(:class:`GroupedMode`; the scale is (E, 1) so that it broadcasts against its
histories in the generic state helpers, ``te_jax.nnx.apply_fp8_updates`` and
``te_jax.fp8_state.apply_fp8_updates``); ``shared_wi_fp8_meta`` and
``shared_wo_fp8_meta`` are ordinary dense states. Each GEMM runs once per
call, so each step pushes one entry into each history (the rule of every te_jax
GEMM; microbatches merge by max, ``te_jax.fp8_state.accumulate_gradients``).

The router bias of DeepSeek-V3's balancing (``router_bias_update_rate``) is
(E,) float32 state outside the parameters; :func:`next_router_bias` is its
update after a training step, which the modules apply in their training
calls.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from te_jax import grouped_dense as gd
from te_jax import moe as moe_lib
from te_jax import sharding as sharding_lib
from te_jax.layers.gemm import gemm_kernel
from te_jax.layers.settings import Settings
from te_jax.layers.state import GemmStates

__all__ = ["EXPERT_GEMMS", "SHARED_GEMMS", "FP8_GEMMS", "CONFIG_FIELDS", "KERNEL_AXES",
           "ROUTER_BIAS_COLLECTION", "ROUTER_BIAS_NAME",
           "GroupedMode", "expert_kernel_init", "config_of", "moe_layer", "next_router_bias",
           "zero_aux"]

# Where the Linen module keeps the router bias (variable "bias" of this
# collection); the NNX module's is its attribute "router_bias".
ROUTER_BIAS_COLLECTION, ROUTER_BIAS_NAME = "router_bias", "bias"
EXPERT_GEMMS = ("wi_fp8_meta", "wo_fp8_meta")
SHARED_GEMMS = ("shared_wi_fp8_meta", "shared_wo_fp8_meta")
FP8_GEMMS = EXPERT_GEMMS + SHARED_GEMMS
# The te_jax.moe.MoEConfig fields a module takes as attributes of the same names.
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(moe_lib.MoEConfig))
# Default logical axis names of the parameters (the module docs' table).
KERNEL_AXES = {"router_kernel": (None, None),
               "wi_kernel": ("expert", "embed", "act", "mlp"),
               "wo_kernel": ("expert", "mlp", "embed"),
               "shared_wi_kernel": ("embed", "act", "mlp"),
               "shared_wo_kernel": ("mlp", "embed")}


class GroupedMode:
  """A recipe's ``ScalingMode`` seen by a grouped GEMM of ``num_experts``
  experts: what ``GemmStates.state`` creates and checks a state against.

  ``init_state()`` is ``te_jax.grouped_dense.init_grouped_state`` in the
  modules' layout (the kernel's scale (E, 1), see the module docs); the
  rest is the mode's.
  """

  def __init__(self, mode, num_experts: int):
    self.mode = mode
    self.num_experts = num_experts
    self.recipe = mode.recipe
    self.uses_state = mode.uses_state

  def init_state(self):
    state = gd.init_grouped_state(self.recipe, self.num_experts)
    return None if state is None else _module_layout(state)

  def update_state(self, state, amaxes):
    """The mode's own update (``te_jax.fp8_state.merge_uses`` merges several
    uses of a state with it, one history row at a time)."""
    return self.mode.update_state(state, amaxes)


def _module_layout(state):
  """A grouped-dense state with its kernel scale (E,) as (E, 1)."""
  kernel = dict(state["kernel"], scale=state["kernel"]["scale"][:, None])
  return dict(state, kernel=kernel)


def _block_layout(state):
  """The inverse of :func:`_module_layout` (a reshape: the state's update,
  which comes back as its gradient, is reshaped back the same way)."""
  kernel = dict(state["kernel"], scale=state["kernel"]["scale"].reshape(-1))
  return dict(state, kernel=kernel)


def expert_kernel_init(init, unbox=None):
  """The initializer of a stacked expert kernel (E, *shape): ``init`` once per
  expert on (*shape) with its own key; ``unbox`` as in
  ``te_jax.layers.init.kernel_fan_in_init`` (applied to what ``init``
  returns). Pass an ``init`` of the per-expert kernel (e.g.
  ``gated_kernel_init`` for wi), so that fan-in scaling sees one expert's GEMM.

  The per-expert calls are one ``jax.vmap`` over the E keys: a Python loop
  would trace ``init`` E times, and the init program (and its compile time)
  would grow with the number of experts. Expert e's kernel is the same as
  ``init(split(key, E)[e], shape[1:])`` either way."""

  def one(key, shape, dtype):
    value = init(key, shape, dtype)
    return value if unbox is None else unbox(value)

  def wrapped(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, shape[0])
    return jax.vmap(lambda k: one(k, tuple(shape[1:]), dtype))(keys)
  return wrapped


def config_of(module) -> moe_lib.MoEConfig:
  """The ``te_jax.moe.MoEConfig`` of a module's attributes of the same names
  (:data:`CONFIG_FIELDS`); its checks raise for a bad one."""
  values = {f: getattr(module, f) for f in CONFIG_FIELDS}
  if isinstance(values["activations"], list):
    values["activations"] = tuple(values["activations"])
  return moe_lib.MoEConfig(**values)


def zero_aux(num_experts: int) -> moe_lib.MoEAux:
  """A :class:`te_jax.moe.MoEAux` of zeros (what a module reports before its
  first call)."""
  z = jnp.zeros((), jnp.float32)
  return moe_lib.MoEAux(z, z, z, jnp.zeros((num_experts,), jnp.float32),
                        jnp.zeros((), jnp.int32))


def next_router_bias(bias: jax.Array, aux: moe_lib.MoEAux,
                     config: moe_lib.MoEConfig) -> jax.Array:
  """The router bias after a training step: ``te_jax.moe.update_balance_bias``
  with this step's loads (``aux.tokens_per_expert``, summed over every
  device) and ``config.router_bias_update_rate``."""
  return moe_lib.update_balance_bias(bias, aux.tokens_per_expert,
                                     config.router_bias_update_rate)


def _gemm_states(states: GemmStates, settings: Settings, config, shared: bool):
  """({block state name: state} or None, the names of the states this call
  does not use): the module's FP8 state as ``moe_block`` takes it."""
  names = EXPERT_GEMMS + (SHARED_GEMMS if shared else ())
  if settings.mode is None or not settings.mode.uses_state:
    return None, tuple(n for n in FP8_GEMMS if states.has(n))
  grouped = GroupedMode(settings.mode, config.num_experts)
  block = {"wi": _block_layout(states.state(EXPERT_GEMMS[0], grouped)),
           "wo": _block_layout(states.state(EXPERT_GEMMS[1], grouped))}
  if shared:
    block["shared_wi"] = states.state(SHARED_GEMMS[0], settings.mode)
    block["shared_wo"] = states.state(SHARED_GEMMS[1], settings.mode)
  return block, tuple(n for n in FP8_GEMMS if n not in names and states.has(n))


def moe_layer(states: GemmStates, settings: Settings, x: jax.Array, *, params: dict,
              config: moe_lib.MoEConfig, dtype, router_bias: Optional[jax.Array] = None,
              token_mask: Optional[jax.Array] = None) -> Tuple[jax.Array, moe_lib.MoEAux]:
  """The mixture-of-experts block of a module call.

  Args:
    states, settings: the module's FP8 state (:data:`FP8_GEMMS`) and the
      autocast settings it read.
    x: (T, H) or (B, S, H) tokens (B, S under sequence parallelism).
    params: the module's parameters by their names in the module docs
      (``router_kernel``, ``wi_kernel``, ``wo_kernel``, and
      ``shared_wi_kernel``, ``shared_wo_kernel`` with shared experts), in
      their parameter dtype.
    config: the ``te_jax.moe.MoEConfig`` of the module's attributes.
    dtype: the compute dtype (of x as the experts take it, and of y).
    router_bias: (E,) float32 with ``config.router_bias_update_rate``, else
      None.
    token_mask: optional bool like x's leading dims; False (padding) tokens
      are routed nowhere and count in no loss.

  Returns:
    ``(y, aux)``: y like x in ``dtype``; aux a ``te_jax.moe.MoEAux``.
  """
  shared = "shared_wi_kernel" in params
  block_states, unused = _gemm_states(states, settings, config, shared)
  if block_states is not None:
    states.track_updates(params["wi_kernel"])
  kernel = lambda name: gemm_kernel(settings, params[name], dtype)
  block_params = {"router": params["router_kernel"], "wi": kernel("wi_kernel"),
                  "wo": kernel("wo_kernel")}
  if shared:
    block_params.update(shared_wi=kernel("shared_wi_kernel"),
                        shared_wo=kernel("shared_wo_kernel"))
  with sharding_lib.use_axis_rules(settings.axis_rules):
    y, aux = moe_lib.moe_block(
        x.astype(dtype), block_params, config=config, recipe=settings.recipe,
        fp8_state=block_states, router_bias=router_bias, token_mask=token_mask,
        impl=settings.impl, mesh_resource=settings.mesh_resource, mesh=settings.mesh,
        store_act_input_in_fp8=settings.store_act_input_in_fp8,
        keep_fp8_copies=settings.keep_fp8_copies)
  return (states.keep_unused(y, unused) if unused else y), aux
