"""Mixture of experts in FP8 with static shapes (DESIGN.md, "Mixture of experts").

* :mod:`te_jax.moe.router`: float32 router, top-k, balancing losses and bias;
* :mod:`te_jax.moe.dispatch`: assignments sorted by expert into a buffer of
  trace-time size, groups padded to the recipe's token block;
* :mod:`te_jax.moe.experts`: the experts' MLPs as grouped FP8 GEMMs
  (``te_jax.grouped_dense``);
* :mod:`te_jax.moe.parallel`: expert parallelism (all-to-all of fixed-size
  buffers) with FSDP, tensor and sequence parallelism;
* :mod:`te_jax.moe.block`: the whole layer, :func:`moe_block`, and
  :func:`aux_totals` (what a training loop adds to its loss and logs).

The modules over it: ``te_jax.flax.MoE``, ``te_jax.nnx.MoE`` and the
``TransformerLayer`` option ``mlp_type="moe"`` (through the framework-neutral
core ``te_jax.layers.moe``).
"""

from te_jax.moe import dispatch
from te_jax.moe import experts
from te_jax.moe import parallel
from te_jax.moe import router
from te_jax.moe.block import (MoEAux, MoEConfig, aux_totals, init_fp8_state, init_params,
                              moe_block)
from te_jax.moe.router import update_balance_bias
from te_jax.moe.scopes import SCOPES

__all__ = ["dispatch", "experts", "parallel", "router", "MoEAux", "MoEConfig",
           "aux_totals", "init_fp8_state", "init_params", "moe_block", "update_balance_bias",
           "SCOPES"]
