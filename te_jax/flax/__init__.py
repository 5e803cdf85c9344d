"""Flax Linen modules of te_jax whose GEMMs run in FP8 under ``fp8_autocast``.

>>> import jax, jax.numpy as jnp
>>> import te_jax
>>> from te_jax import flax as tfx, recipe
>>> layer = tfx.TransformerLayer(hidden_size=128, mlp_hidden_size=256,
...                              num_attention_heads=2, layer_type="decoder")
>>> x = jax.random.normal(jax.random.key(1), (2, 32, 128), jnp.bfloat16)
>>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
...   variables = layer.init(jax.random.key(0), x)
...   y = layer.apply(variables, x)
>>> y.shape, sorted(variables)
((2, 32, 128), ['_overwrite_with_gradient', 'params'])

The recipe is read when a module is traced, so ``init``/``apply`` (or the
first call of a jitted step) must run inside the autocast. Under
``DelayedScaling`` the variables hold a collection ``"_overwrite_with_gradient"``
(``te_jax.fp8_state.FP8_COLLECTION``) that ``TrainState.apply_gradients``
updates by itself.

``Fp8DotGeneral`` puts an existing Flax model's ``nn.Dense`` / ``nn.DenseGeneral``
in FP8 without changing its parameters: ``nn.Dense(features,
dot_general_cls=tfx.Fp8DotGeneral)``; ``Fp8Einsum`` does the same for an einsum.

``MoE`` is a mixture of experts (``TransformerLayer(mlp_type="moe",
moe=te_jax.moe.MoEConfig(...))`` puts one in place of the MLP); its
auxiliary losses are sown into ``"intermediates"`` and its router bias lives
in the collection ``"router_bias"`` (``te_jax.flax.moe`` says how a training
loop uses both).

``share_fp8_state(nn.remat(Block))`` lets a rematerialized block be called
several times in one step with one merged FP8 state update (see
``docs/recipes.md``).
"""

from te_jax.flax.norm import LayerNorm, NormParameters, RMSNorm
from te_jax.flax.dense import DenseGeneral, LayerNormDenseGeneral
from te_jax.flax.dot_general import Fp8DotGeneral, Fp8Einsum
from te_jax.flax.mlp import LayerNormMLP
from te_jax.flax.moe import MoE
from te_jax.flax.attention import MultiHeadAttention
from te_jax.flax.transformer import TransformerLayer
from te_jax.flax.fp8_module import share_fp8_state

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "NormParameters",
    "DenseGeneral",
    "LayerNormDenseGeneral",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "LayerNormMLP",
    "MoE",
    "MultiHeadAttention",
    "TransformerLayer",
    "share_fp8_state",
]
