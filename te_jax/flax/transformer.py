"""``TransformerLayer``: a pre-LN transformer block whose GEMMs run in FP8."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax.flax.attention import MultiHeadAttention
from te_jax.flax.mlp import LayerNormMLP
from te_jax.flax.moe import MoE
from te_jax.flax.norm import LayerNorm, NormParameters, RMSNorm
from te_jax.layers import kv_cache
from te_jax.layers import transformer as layer_lib
from te_jax.layers import checks
from te_jax.layers.checks import compute_dtype
from te_jax.layers.init import default_kernel_init
from te_jax.moe import MoEConfig

__all__ = ["TransformerLayer"]

Dtype = Any
Initializer = Callable[..., jax.Array]


class TransformerLayer(nn.Module):
  """Pre-LN transformer block: attention and MLP sublayers with residuals, FP8 GEMMs.

  ``encoder``: ``x = x + drop(SelfAttn(LN(x)))``; ``x = x + drop(MLP(x))``
  (the MLP holds its own norm). ``decoder``: the self attention is causal
  (``self_attn_mask_type`` default "causal"), and when ``encoded`` is given a
  cross-attention sublayer ``x = x + drop(CrossAttn(LN(x), encoded))`` comes
  between the two.

  Shapes: ``inputs`` (B, S, hidden_size) -> (B, S, hidden_size); ``encoded``
  (B, S_enc, E_enc).

  While the hidden dropout is inactive (``hidden_dropout=0`` or
  ``deterministic``) the attention (with its norm fused, see
  ``fuse_norm_quantize``) and the MLP add their residuals themselves
  (``add_residual=True``): in FP8 inside their output GEMMs and norm
  backward kernels, which XLA cannot fuse a separate add into. The sum is
  then rounded once, not twice (``docs/design.md``).

  Submodules (parameter names and logical axes as documented on each):
  ``pre_attention_norm`` (LayerNorm/RMSNorm, ("embed",)), ``self_attention``
  (MultiHeadAttention), ``pre_cross_attention_norm`` and ``cross_attention``
  (decoder with ``encoded``), ``mlp`` (LayerNormMLP), or with
  ``mlp_type="moe"`` ``pre_mlp_norm`` and ``moe`` (``te_jax.flax.MoE``:
  ``x = x + drop(MoE(LN(x)))``, its aux values sown and its router bias kept
  as that module says). Under ``DelayedScaling``
  each projection keeps its FP8 state in collection
  ``"_overwrite_with_gradient"``.

  Attributes:
    hidden_size: model width E (must equal the input's last dim).
    mlp_hidden_size: MLP intermediate width.
    num_attention_heads: query heads.
    num_gqa_groups: key/value heads (default = num_attention_heads).
    fuse_qkv: the self attention's Q/K/V projection as one kernel (default
      True; ``MultiHeadAttention``'s layouts); False: query and key/value
      kernels (grouped-query attention under tensor parallelism over heads).
    head_dim: per-head size (default hidden_size // num_attention_heads).
    layer_type: "encoder" (default) or "decoder".
    self_attn_mask_type: "causal" or "no_mask"; default "no_mask" for an
      encoder, "causal" for a decoder. Segment ids add document/padding masks.
    layernorm_type: "layernorm" (default) or "rmsnorm".
    epsilon: norm epsilon (default 1e-6).
    zero_centered_gamma: store norm scales as gamma - 1.
    hidden_dropout: dropout on each sublayer output before the residual add.
    attention_dropout: dropout on the attention probabilities.
    intermediate_dropout: dropout after the MLP activation.
    activations: MLP activations, e.g. ("gelu",) or ("silu", "linear")
      (``mlp_type="moe"``: the experts' come from ``moe``).
    mlp_type: "dense" (default: the LayerNormMLP sublayer) or "moe": a
      mixture of experts in its place, ``moe`` saying which, each expert
      ``mlp_hidden_size`` wide (no biases, no intermediate dropout: setting
      ``use_bias`` or ``intermediate_dropout`` then is an error; the
      LayerNormMLP options do not apply).
    moe: a ``te_jax.moe.MoEConfig`` with ``mlp_type="moe"``, else None.
    fuse_activation_quantize: see ``LayerNormMLP`` (default True).
    mlp_backward_chunks: the MLP's ``LayerNormMLP.backward_chunks`` (default 1).
    fuse_norm_quantize: in FP8, each norm is fused into the quantization of
      the GEMM input after it (default True): the MLP's (see
      ``LayerNormMLP``) and the attention pre-norms, which the attention
      applies to its input (``MultiHeadAttention(...)(x, input_norm=...)``);
      the norm parameters keep their names either way. With FP8 off they run
      on te_jax's unquantized norm kernels (hidden >= 4096). False: every
      norm in XLA (to compare).
    enable_rotary_pos_emb: rotary embeddings in self attention (default False).
    rotary_base: rotary frequency base.
    use_bias: biases on every projection (default False).
    attention_impl: "auto", "xla" or "cudnn" (see MultiHeadAttention).
    max_segments_per_seq: documents per packed row in cuDNN's packed layout
      (default 8; see MultiHeadAttention).
    max_document_length: the self attention's (default None; causal only; see
      MultiHeadAttention): the longest packed document, for a banded core.
    dtype: compute/output dtype; None promotes input and param dtype.
    param_dtype: parameter dtype (default float32).
    kernel_init, bias_init: initializers of the projections.
    impl: "auto" (default), "cuda" or "reference": the implementation of every
      FP8 op of the layer (``TE_JAX_IMPL`` overrides "auto").
    decode: autoregressive decoding: the self attention keeps a key/value
      cache in collection ``"cache"`` (``MultiHeadAttention(decode=True)``,
      ``te_jax.flax.kv_cache``); init on the full-length input allocates it,
      each ``apply(..., mutable=["cache"])`` on (B, n, hidden_size) appends n
      tokens. Cross attention (``encoded``) is recomputed every call; segment
      ids and positions are not supported (positions follow the cache).

  Dropout uses the "dropout" RNG when ``deterministic=False``.
  """

  hidden_size: int
  mlp_hidden_size: int
  num_attention_heads: int
  num_gqa_groups: Optional[int] = None
  fuse_qkv: bool = True
  head_dim: Optional[int] = None
  layer_type: str = "encoder"
  self_attn_mask_type: Optional[str] = None
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  hidden_dropout: float = 0.0
  attention_dropout: float = 0.0
  intermediate_dropout: float = 0.0
  activations: Sequence[str] = ("gelu",)
  mlp_type: str = "dense"
  moe: Optional[MoEConfig] = None
  fuse_activation_quantize: bool = True
  mlp_backward_chunks: int = 1
  fuse_norm_quantize: bool = True
  enable_rotary_pos_emb: bool = False
  rotary_base: float = 10000.0
  use_bias: bool = False
  attention_impl: str = "auto"
  max_segments_per_seq: int = 8
  max_document_length: Optional[int] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  impl: str = "auto"
  decode: bool = False

  def _norm(self, name, dtype):
    cls = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}.get(self.layernorm_type)
    if cls is None:
      raise ValueError(f"layernorm_type must be 'layernorm' or 'rmsnorm', got "
                       f"{self.layernorm_type!r}.")
    return cls(epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
               dtype=dtype, param_dtype=self.param_dtype, name=name)

  def _residual_attention(self, norm_name, attention, x, deterministic, **kw):
    """``x + drop(attention(norm(x), **kw))``, the norm fused into the
    projection's quantization (``fuse_norm_quantize``) or applied first.
    With the norm fused and the hidden dropout inactive the attention adds x
    itself (its output projection's C input in FP8)."""
    if not self.fuse_norm_quantize:
      h = attention(self._norm(norm_name, attention.dtype)(x), deterministic=deterministic,
                    **kw)
      return x + self._drop(h, deterministic)
    norm = NormParameters(norm_type=self.layernorm_type, epsilon=self.epsilon,
                          zero_centered_gamma=self.zero_centered_gamma,
                          param_dtype=self.param_dtype, name=norm_name)(x.shape[-1])
    if self._folds_residual(deterministic):
      return attention(x, input_norm=norm, deterministic=deterministic, add_residual=True, **kw)
    h = attention(x, input_norm=norm, deterministic=deterministic, **kw)
    return x + self._drop(h, deterministic)

  def _folds_residual(self, deterministic) -> bool:
    return layer_lib.folds_residuals(self.hidden_dropout, deterministic)

  def _attention(self, name, mask_type, rotary, dtype, decode=False, max_document_length=None):
    return MultiHeadAttention(
        num_attention_heads=self.num_attention_heads, head_dim=self.head_dim,
        num_gqa_groups=self.num_gqa_groups, attn_mask_type=mask_type,
        attention_dropout=self.attention_dropout, enable_rotary_pos_emb=rotary,
        rotary_base=self.rotary_base, use_bias=self.use_bias,
        out_features=self.hidden_size, attention_impl=self.attention_impl,
        max_segments_per_seq=self.max_segments_per_seq,
        max_document_length=max_document_length, fuse_qkv=self.fuse_qkv,
        dtype=dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, impl=self.impl, decode=decode, name=name)

  def _drop(self, x, deterministic):
    if self.hidden_dropout > 0.0:
      return nn.Dropout(rate=self.hidden_dropout)(x, deterministic=deterministic)
    return x

  @nn.compact
  def __call__(self, inputs: jax.Array, encoded: Optional[jax.Array] = None, *,
               segment_ids: Optional[jax.Array] = None,
               segment_positions: Optional[jax.Array] = None,
               encoder_segment_ids: Optional[jax.Array] = None,
               deterministic: bool = True) -> jax.Array:
    """Applies the block.

    Args:
      inputs: (B, S, hidden_size).
      encoded: (B, S_enc, E_enc) encoder output for cross attention
        (decoder only; None skips the cross-attention sublayer).
      segment_ids: (B, S) document ids of packed rows (0 = padding).
      segment_positions: (B, S) positions within each document (rotary).
      encoder_segment_ids: (B, S_enc) document ids of ``encoded``.
      deterministic: disables dropout when True.

    Returns:
      (B, S, hidden_size) in the compute dtype.
    """
    layer_lib.check_layer_type(self.layer_type)
    layer_lib.check_mlp_type(self.mlp_type, self.moe, use_bias=self.use_bias,
                             intermediate_dropout=self.intermediate_dropout)
    checks.transformer_options(
        self.hidden_size, self.mlp_hidden_size, self.num_attention_heads,
        num_gqa_groups=self.num_gqa_groups, head_dim=self.head_dim,
        hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
        intermediate_dropout=self.intermediate_dropout)
    if self.decode:
      kv_cache.check_decode_inputs(None, segment_ids=segment_ids,
                                   segment_positions=segment_positions)
    layer_lib.check_layer_inputs(inputs, self.hidden_size, segment_ids=segment_ids,
                                 segment_positions=segment_positions, encoded=encoded,
                                 encoder_segment_ids=encoder_segment_ids)
    if encoded is not None and self.layer_type != "decoder":
      raise ValueError("encoded inputs (cross attention) need layer_type='decoder'.")
    mask_type = layer_lib.self_attn_mask_type(self.layer_type, self.self_attn_mask_type)
    compute = compute_dtype(self.dtype, inputs.dtype, self.param_dtype)
    x = inputs.astype(compute)

    attention = self._attention("self_attention", mask_type, self.enable_rotary_pos_emb,
                                compute, decode=self.decode,
                                max_document_length=self.max_document_length)
    x = self._residual_attention("pre_attention_norm", attention, x, deterministic,
                                 segment_ids=segment_ids, segment_positions=segment_positions)

    if encoded is not None:
      attention = self._attention("cross_attention", "no_mask", False, compute)
      x = self._residual_attention(
          "pre_cross_attention_norm", attention, x, deterministic, inputs_kv=encoded,
          segment_ids=segment_ids if encoder_segment_ids is not None else None,
          kv_segment_ids=encoder_segment_ids)

    if self.mlp_type == "moe":
      h = MoE(intermediate_dim=self.mlp_hidden_size, **dataclasses.asdict(self.moe),
              dtype=compute, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
              impl=self.impl, name="moe")(self._norm("pre_mlp_norm", compute)(x),
                                          token_mask=layer_lib.token_mask(segment_ids))
      return x + self._drop(h, deterministic)
    # Without dropout on its output the block adds the residual itself:
    # inside its GEMM and norm backward on the fused FP8 path.
    fold = self._folds_residual(deterministic)
    h = LayerNormMLP(
        intermediate_dim=self.mlp_hidden_size, activations=tuple(self.activations),
        intermediate_dropout_rate=self.intermediate_dropout,
        fuse_activation_quantize=self.fuse_activation_quantize,
        backward_chunks=self.mlp_backward_chunks,
        fuse_norm_quantize=self.fuse_norm_quantize, layernorm_type=self.layernorm_type, epsilon=self.epsilon,
        zero_centered_gamma=self.zero_centered_gamma, use_bias=self.use_bias,
        dtype=compute, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, impl=self.impl, name="mlp")(x, deterministic=deterministic,
                                                              add_residual=fold)
    return h if fold else x + self._drop(h, deterministic)
