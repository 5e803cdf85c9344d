"""Flax NNX modules of te_jax whose GEMMs run in FP8 under ``fp8_autocast``.

The NNX counterparts of ``te_jax.flax``: same parameters (names, shapes,
logical axes), the same functional layer underneath, hence the same numbers
from the same parameters (``load_linen_variables`` copies a Linen model's
variables in).

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> import te_jax
>>> from te_jax import nnx as tnx, recipe
>>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
...   layer = tnx.TransformerLayer(128, 256, 2, layer_type="decoder", rngs=nnx.Rngs(0))
...   y = layer(jax.random.normal(jax.random.key(1), (2, 32, 128), jnp.bfloat16))
>>> y.shape
(2, 32, 128)

The recipe is read where the modules run: construct (delayed-scaling state is
created then) and call -- or trace the first call of a jitted step -- inside
the autocast. Under ``DelayedScaling`` each GEMM keeps an :class:`FP8State`;
a training step differentiates it with the parameters and writes its update
back with :func:`apply_fp8_updates` (see ``docs/nnx.md``)::

  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, tnx.WRT))(model)
    optimizer.update(model, grads)
    tnx.apply_fp8_updates(model, grads)
    return loss

  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
    for x, y in batches:
      loss = train_step(model, optimizer, x, y)

Forgetting ``apply_fp8_updates`` raises an :class:`FP8StateWarning` after the
second step, read on the host without waiting for the device (a loop over
``nnx.split`` states calls :func:`check_fp8_updates`;
:func:`remove_update_check` takes the check out of a model).
"""

from te_jax.nnx.state import (FP8State, FP8Counters, FP8StateWarning, WRT, diff_state,
                              apply_fp8_updates, accumulate_gradients, init_fp8_state,
                              remove_update_check, check_fp8_updates, shared_fp8_state)
from te_jax.nnx.linear import Linear, LayerNormLinear, LayerNorm, RMSNorm
from te_jax.nnx.mlp import LayerNormMLP
from te_jax.nnx.moe import MoE, MoEMetrics, RouterBias
from te_jax.nnx.attention import MultiHeadAttention
from te_jax.nnx.dot_general import Fp8DotGeneral
from te_jax.nnx.transformer import TransformerLayer
from te_jax.nnx.convert import (load_linen_variables, linen_variables, get_named_sharding,
                                get_abstract_model)

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNorm",
    "RMSNorm",
    "LayerNormMLP",
    "MoE",
    "MoEMetrics",
    "RouterBias",
    "MultiHeadAttention",
    "TransformerLayer",
    "Fp8DotGeneral",
    "FP8State",
    "FP8Counters",
    "FP8StateWarning",
    "WRT",
    "diff_state",
    "apply_fp8_updates",
    "accumulate_gradients",
    "init_fp8_state",
    "remove_update_check",
    "check_fp8_updates",
    "shared_fp8_state",
    "load_linen_variables",
    "linen_variables",
    "get_named_sharding",
    "get_abstract_model",
]
