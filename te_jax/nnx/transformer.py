"""``TransformerLayer`` as an NNX module: a pre-LN block whose GEMMs run in FP8."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.layers import transformer as layer_lib
from te_jax.layers import kv_cache
from te_jax.layers.checks import compute_dtype, to_tuple, transformer_options
from te_jax.layers.init import default_kernel_init
from te_jax.layers.norm import check_norm_type
from te_jax.moe import MoEConfig
from te_jax.nnx.attention import MultiHeadAttention
from te_jax.nnx.linear import LayerNorm, RMSNorm, zeros
from te_jax.nnx.mlp import LayerNormMLP
from te_jax.nnx.moe import MoE

__all__ = ["TransformerLayer"]

Dtype = Any
Initializer = Callable[..., jax.Array]

# NNX modules keep no key/value cache; the Linen twin decodes.
_NO_DECODE = ("decode with te_jax.flax.TransformerLayer(..., decode=True), same parameters "
              "and numbers, on the variables te_jax.nnx.linen_variables(model) gives "
              "(docs/nnx.md).")


class TransformerLayer(nnx.Module):
  """Pre-LN transformer block (attention and MLP sublayers with residuals), FP8 GEMMs.

  ``te_jax.flax.TransformerLayer`` as an NNX module: same submodules
  (``pre_attention_norm``, ``self_attention``, ``pre_cross_attention_norm``
  and ``cross_attention`` for a decoder with an encoder, ``mlp``), same
  parameters, same numbers. ``encoder``: ``x = x + drop(SelfAttn(LN(x)))``;
  ``x = x + drop(MLP(x))``; ``decoder``: causal self attention and, when
  built with ``encoder_hidden_size``, a cross-attention sublayer between the
  two (skipped for a call without ``encoded``). With ``mlp_type="moe"``:
  ``pre_mlp_norm`` and ``moe`` (``te_jax.nnx.MoE``) in place of ``mlp``.

  Shapes: ``inputs`` (B, S, hidden_size) -> (B, S, hidden_size); ``encoded``
  (B, S_enc, encoder_hidden_size).

  Args:
    hidden_size, mlp_hidden_size, num_attention_heads, num_gqa_groups,
    fuse_qkv, head_dim, layer_type, self_attn_mask_type, layernorm_type, epsilon,
    zero_centered_gamma, hidden_dropout, attention_dropout,
    intermediate_dropout, activations, mlp_type, moe, fuse_activation_quantize,
    mlp_backward_chunks,
    fuse_norm_quantize,
    enable_rotary_pos_emb, rotary_base, use_bias, attention_impl,
    max_segments_per_seq, max_document_length, dtype, param_dtype,
      kernel_init, bias_init, impl: as the Linen module.
    encoder_hidden_size: width of the encoder output a decoder attends to;
      builds the cross-attention sublayer (decoder only).
    deterministic: default of the call argument (``model.train()`` /
      ``model.eval()`` set it on every submodule).
    decode: must be False (also in the call): no key/value cache in NNX; True
      raises a ValueError naming the Linen module, which decodes.
    rngs: ``nnx.Rngs`` (its "dropout" stream feeds the dropouts).
  """

  def __init__(self, hidden_size: int, mlp_hidden_size: int, num_attention_heads: int, *,
               num_gqa_groups: Optional[int] = None, fuse_qkv: bool = True,
               head_dim: Optional[int] = None, layer_type: str = "encoder", self_attn_mask_type: Optional[str] = None,
               encoder_hidden_size: Optional[int] = None,
               layernorm_type: str = "layernorm", epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, hidden_dropout: float = 0.0,
               attention_dropout: float = 0.0, intermediate_dropout: float = 0.0,
               activations: Sequence[str] = ("gelu",), mlp_type: str = "dense",
               moe: Optional[MoEConfig] = None, fuse_activation_quantize: bool = True,
               mlp_backward_chunks: int = 1, fuse_norm_quantize: bool = True,
               enable_rotary_pos_emb: bool = False, rotary_base: float = 10000.0,
               use_bias: bool = False, attention_impl: str = "auto",
               max_segments_per_seq: int = 8, max_document_length: Optional[int] = None,
               dtype: Optional[Dtype] = None, param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = zeros,
               deterministic: bool = False, impl: str = "auto", decode: bool = False,
               rngs: nnx.Rngs):
    kv_cache.refuse_decode(decode, "te_jax.nnx.TransformerLayer", _NO_DECODE)
    (self.hidden_size,) = to_tuple("hidden_size", hidden_size)
    layer_lib.check_layer_type(layer_type)
    layer_lib.check_mlp_type(mlp_type, moe, use_bias=use_bias,
                             intermediate_dropout=intermediate_dropout)
    if encoder_hidden_size is not None and layer_type != "decoder":
      raise ValueError("encoder_hidden_size (cross attention) needs layer_type='decoder'.")
    check_norm_type(layernorm_type)
    transformer_options(hidden_size, mlp_hidden_size, num_attention_heads,
                        num_gqa_groups=num_gqa_groups, head_dim=head_dim,
                        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                        intermediate_dropout=intermediate_dropout)
    e = self.hidden_size
    self.layer_type, self.dtype, self.param_dtype = layer_type, dtype, param_dtype
    self.deterministic = deterministic
    mask_type = layer_lib.self_attn_mask_type(layer_type, self_attn_mask_type)
    norm_cls = LayerNorm if layernorm_type == "layernorm" else RMSNorm

    def norm():
      return norm_cls(e, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                      dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def attention(attention_type, mask, rotary, kv_features=None, document_length=None):
      return MultiHeadAttention(
          num_attention_heads, e, attention_type=attention_type, kv_features=kv_features,
          head_dim=head_dim, num_gqa_groups=num_gqa_groups, attn_mask_type=mask,
          attention_dropout=attention_dropout, enable_rotary_pos_emb=rotary,
          rotary_base=rotary_base, use_bias=use_bias, out_features=e,
          attention_impl=attention_impl, max_segments_per_seq=max_segments_per_seq,
          max_document_length=document_length, dtype=dtype, param_dtype=param_dtype,
          kernel_init=kernel_init, bias_init=bias_init, deterministic=deterministic, impl=impl,
          fuse_qkv=fuse_qkv, rngs=rngs)

    self.fuse_norm_quantize = bool(fuse_norm_quantize)
    self.pre_attention_norm = norm()
    self.self_attention = attention("self", mask_type, enable_rotary_pos_emb,
                                    document_length=max_document_length)
    self.encoder_hidden_size = encoder_hidden_size
    if encoder_hidden_size is not None:
      self.pre_cross_attention_norm = norm()
      self.cross_attention = attention("cross", "no_mask", False, encoder_hidden_size)
    self.mlp_type = mlp_type
    if mlp_type == "moe":
      self.pre_mlp_norm = norm()
      self.moe = MoE(e, intermediate_dim=mlp_hidden_size, **dataclasses.asdict(moe),
                     dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                     deterministic=deterministic, impl=impl, rngs=rngs)
    else:
      self.mlp = LayerNormMLP(
          e, mlp_hidden_size, activations=tuple(activations),
          intermediate_dropout_rate=intermediate_dropout,
          fuse_activation_quantize=fuse_activation_quantize,
          backward_chunks=mlp_backward_chunks, fuse_norm_quantize=fuse_norm_quantize,
          layernorm_type=layernorm_type, epsilon=epsilon,
          zero_centered_gamma=zero_centered_gamma, use_bias=use_bias, dtype=dtype,
          param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
          deterministic=deterministic, impl=impl, rngs=rngs)
    self.dropout = (nnx.Dropout(hidden_dropout, deterministic=deterministic, rngs=rngs)
                    if hidden_dropout > 0.0 else None)

  def _residual_attention(self, norm, attention, x, deterministic, **kw):
    """``x + drop(attention(norm(x), **kw))``, the attention adding x
    itself where it can (as the Linen layer's)."""
    if not self.fuse_norm_quantize:
      return x + self._drop(attention(norm(x), deterministic=deterministic, **kw),
                            deterministic)
    if layer_lib.folds_residuals(self._hidden_dropout(), deterministic):
      return attention(x, input_norm=norm.norm_params(), deterministic=deterministic,
                       add_residual=True, **kw)
    h = attention(x, input_norm=norm.norm_params(), deterministic=deterministic, **kw)
    return x + self._drop(h, deterministic)

  def _hidden_dropout(self) -> float:
    return 0.0 if self.dropout is None else self.dropout.rate

  def _drop(self, x, deterministic):
    return x if self.dropout is None else self.dropout(x, deterministic=deterministic)

  def __call__(self, inputs: jax.Array, encoded: Optional[jax.Array] = None, *,
               segment_ids: Optional[jax.Array] = None,
               segment_positions: Optional[jax.Array] = None,
               encoder_segment_ids: Optional[jax.Array] = None,
               deterministic: Optional[bool] = None,
               decode: Optional[bool] = None) -> jax.Array:
    """Applies the block (arguments as ``te_jax.flax.TransformerLayer``;
    ``deterministic`` defaults to the module attribute)."""
    kv_cache.refuse_decode(decode, "te_jax.nnx.TransformerLayer", _NO_DECODE)
    if encoded is not None and self.encoder_hidden_size is None:
      raise ValueError("encoded inputs (cross attention) need a decoder layer built with "
                       "encoder_hidden_size=...")
    layer_lib.check_layer_inputs(inputs, self.hidden_size, segment_ids=segment_ids,
                                 segment_positions=segment_positions, encoded=encoded,
                                 encoder_segment_ids=encoder_segment_ids)
    deterministic = self.deterministic if deterministic is None else deterministic
    compute = compute_dtype(self.dtype, inputs.dtype, self.param_dtype)
    x = inputs.astype(compute)

    x = self._residual_attention(self.pre_attention_norm, self.self_attention, x,
                                 deterministic, segment_ids=segment_ids,
                                 segment_positions=segment_positions)

    if encoded is not None:
      x = self._residual_attention(
          self.pre_cross_attention_norm, self.cross_attention, x, deterministic,
          inputs_kv=encoded,
          segment_ids=segment_ids if encoder_segment_ids is not None else None,
          kv_segment_ids=encoder_segment_ids)

    if self.mlp_type == "moe":
      h = self.moe(self.pre_mlp_norm(x), token_mask=layer_lib.token_mask(segment_ids),
                   deterministic=deterministic)
    elif layer_lib.folds_residuals(self._hidden_dropout(), deterministic):
      return self.mlp(x, deterministic=deterministic, add_residual=True)
    else:
      h = self.mlp(x, deterministic=deterministic)
    return x + self._drop(h, deterministic)
