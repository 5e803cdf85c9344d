"""Rematerialization policies that see te_jax's FP8 GEMMs.

``jax.checkpoint_policies.checkpoint_dots`` saves the outputs of XLA dots
and recomputes the rest in the backward pass. te_jax's FP8 GEMMs are CUDA
custom calls, which that policy does not see: under it, every FP8 dense of a
rematerialized block runs its forward GEMM a second time in the backward
pass. So every FP8 product's output is named :data:`FP8_GEMM_NAME` (with
``jax.ad_checkpoint.checkpoint_name``, outside its ``custom_vjp``): the
output of ``te_jax.dense.fp8_dense`` / ``dense_general`` / ``fp8_dense_split``
(hence every te_jax Linen projection and ``te_jax.flax.Fp8DotGeneral``),
``te_jax.fused_mlp.fp8_mlp`` and ``te_jax.norm_dense.fp8_norm_dense``. The
policies here save those outputs:

* :data:`checkpoint_fp8_gemms`: the FP8 GEMM outputs, nothing else;
* :data:`checkpoint_dots_and_fp8_gemms`: those and every XLA dot (the
  policy to use where ``checkpoint_dots`` was used: a model mixing FP8
  layers with plain ones, attention's score and value products);
* :data:`checkpoint_dots_with_no_batch_dims_and_fp8_gemms`: the same with
  ``checkpoint_dots_with_no_batch_dims`` (MaxText's "minimal" policy).

What is recomputed in the backward pass under them: the FP8 quantization of
each GEMM's inputs (a memory-bound pass; the custom VJP's FP8 residuals are
not saved) and everything between the GEMMs (norms, activations). The
saved output is the layer's output in its compute dtype (bf16: 2 bytes per
element, as ``checkpoint_dots`` saves a bf16 dot). The fused MLP saves its
block output only; its hidden activation is recomputed with its first GEMM.

>>> import jax, jax.numpy as jnp
>>> from te_jax import dense, recipe, remat
>>> r = recipe.Float8CurrentScaling()
>>> def block(x, w1, w2):
...   h = jax.nn.gelu(dense.fp8_dense(x, w1, recipe=r))
...   return jnp.sum(dense.fp8_dense(h, w2, recipe=r))
>>> x, w = jnp.ones((32, 64)), jnp.ones((64, 64)) * 0.1
>>> str(jax.make_jaxpr(block)(x, w, w)).count(f"name={remat.FP8_GEMM_NAME}")
2
>>> f = jax.checkpoint(block, policy=remat.checkpoint_fp8_gemms)
>>> jax.grad(f, argnums=1)(x, w, w).shape
(64, 64)

With Flax: ``nn.remat(Block, policy=te_jax.remat.checkpoint_dots_and_fp8_gemms)``.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["FP8_GEMM_NAME", "tag_fp8_gemm", "checkpoint_fp8_gemms",
           "checkpoint_dots_and_fp8_gemms",
           "checkpoint_dots_with_no_batch_dims_and_fp8_gemms"]

FP8_GEMM_NAME = "te_jax_fp8_gemm"

_policies = jax.checkpoint_policies

checkpoint_fp8_gemms = _policies.save_only_these_names(FP8_GEMM_NAME)
checkpoint_dots_and_fp8_gemms = _policies.save_from_both_policies(
    _policies.checkpoint_dots, checkpoint_fp8_gemms)
checkpoint_dots_with_no_batch_dims_and_fp8_gemms = _policies.save_from_both_policies(
    _policies.checkpoint_dots_with_no_batch_dims, checkpoint_fp8_gemms)


def tag_fp8_gemm(y):
  """``y`` (an array or pytree of arrays, the output of an FP8 GEMM layer)
  named :data:`FP8_GEMM_NAME` for the policies of this module; an identity
  outside ``jax.checkpoint``."""
  return checkpoint_name(y, FP8_GEMM_NAME)
