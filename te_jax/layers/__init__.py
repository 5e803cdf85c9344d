"""The framework-neutral core of the te_jax modules (imports no flax).

The Linen modules (``te_jax.flax``) and the NNX modules (``te_jax.nnx``)
declare parameters and FP8 state, then make one call into this package,
which owns every decision about which path a block takes. One module per
concern:

* :mod:`te_jax.layers.settings`: the autocast read once per module call
  (recipe resolved to its ``ScalingMode``, mesh resource, mesh, logical axis
  rules, implementation): a :class:`~te_jax.layers.settings.Settings`;
* :mod:`te_jax.layers.state`: :class:`~te_jax.layers.state.GemmStates`, the
  protocol through which the core reaches a module's FP8 state (one
  implementation per framework), and the fused paths' state lookup;
* :mod:`te_jax.layers.gemm`: every GEMM of a module (FP8 or not, sharded or
  not, split Q/K/V outputs) and the fused MLP core call;
* :mod:`te_jax.layers.norm`: norms, and whether a norm runs fused into an FP8
  quantization, on te_jax's kernels or in XLA;
* :mod:`te_jax.layers.dense`: the projection and the norm + projection block;
* :mod:`te_jax.layers.mlp`: the ``LayerNormMLP`` block;
* :mod:`te_jax.layers.attention` (with :mod:`~te_jax.layers.packed_attention`
  and :mod:`~te_jax.layers.kv_cache`): the attention around the projections;
* :mod:`te_jax.layers.transformer`: the options and inputs of a transformer
  layer;
* :mod:`te_jax.layers.init` and :mod:`te_jax.layers.checks`: kernel
  initializers, logical axis names and option validation.

Below it sits the functional layer (``te_jax.dense``, ``te_jax.norm_dense``,
``te_jax.fused_mlp``), which takes recipe, mesh resource and implementation
as arguments.
"""
