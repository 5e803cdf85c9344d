"""``MultiHeadAttention``: FP8 projections around a fused attention core.

The Q/K/V and output projections are ``DenseGeneral`` modules, so they run in
FP8 under ``fp8_autocast``; the attention core (softmax(QK^T)V) stays in the
compute dtype and is computed by ``jax.nn.dot_product_attention``.

Masking. ``attn_mask_type="causal"`` uses ``is_causal=True``. Packed
sequences are given as ``segment_ids`` (B, S) int (1, 2, ... per document, 0 =
padding, as made by ``te_jax.packing.pack_sequences``): a token attends only
to tokens of its own segment, padding only to padding, so no token ever sees
another document or padding. The installed ``jax.nn.dot_product_attention``
has no segment-id argument (only ``query_seq_lengths`` /
``key_value_seq_lengths``, which describe one right-padded document per row),
so segments become one boolean mask of shape (B, 1, Sq, Skv) shared by all
heads (never a per-head mask). An extra boolean ``mask`` (True = attend),
broadcastable to (B, heads, Sq, Skv), can be given as well.

Implementation choice (``attention_impl``): "xla", "cudnn" or "auto". "auto"
picks cuDNN flash attention on GPU for bfloat16/float16 with head_dim <= 128
and a multiple of 8 and no attention dropout. Packed self attention
(``segment_ids`` alone: no ``kv_segment_ids`` of its own, no ``mask``) then
runs in cuDNN's packed layout (``te_jax.flax.packed_attention``):
per-document offsets instead of a mask, for rows of at most
``max_segments_per_seq`` documents, each one contiguous run of its id; a
batch that breaks either rule is detected on the device and runs cuDNN
attention under the (B, 1, S, S) segment mask instead (same answer,
slower). With ``max_document_length`` W (causal only), packed self attention
takes neither: under the segment mask it computes only the band of keys at
most W - 1 positions back (cuDNN's sliding window skips the tiles outside
it), which is exact while every document fits in W tokens; a batch with a
longer document is detected on the device and runs the full masked
attention (``te_jax.flax.packed_attention.banded_self_attention``).
Other masks (cross attention with segment ids, an explicit ``mask``) take
XLA under "auto" (cuDNN in jax takes a mask only as a dense additive bias);
"cudnn" forces cuDNN (the mask then becomes that bias).
Under "auto" the cuDNN path is staged beside the XLA one with
``jax.lax.platform_dependent``, so a computation compiled for a GPU host's
CPU (arrays placed there) runs XLA attention. Attention dropout
(``attention_dropout > 0`` and ``deterministic=False``) uses an explicit
softmax in float32. With ``segment_ids``, queries at padding positions (id
0) output 0 on every path.

Rotary position embeddings (``enable_rotary_pos_emb``) rotate the two halves
of each head's Q and K ("rotate-half"/GPT-NeoX layout) by angle
``position * rotary_base ** (-2i / head_dim)``; positions default to
``arange(S)`` and come from ``segment_positions`` for packed rows (restarting
at 0 in each document), which makes a packed document see exactly the
rotations it would see alone.

Decoding (``decode=True``): a key/value cache in collection ``"cache"``,
Flax's convention; see ``te_jax.flax.kv_cache``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import norm_dense
from te_jax.flax import kv_cache
from te_jax.flax.attention_core import (and_masks, apply_rotary, attention_core,
                                        check_attention_options, check_input_3d,
                                        check_segment_arg, resolve_segments,
                                        segment_attention_mask)
from te_jax.flax.dense import DenseGeneral, default_kernel_init

__all__ = ["MultiHeadAttention", "apply_rotary", "segment_attention_mask", "check_input_3d",
           "check_segment_arg", "check_attention_options", "attention_core",
           "resolve_segments"]

Dtype = Any
Initializer = Callable[..., jax.Array]


class MultiHeadAttention(nn.Module):
  """Multi-head (optionally grouped-query) self/cross attention with FP8 projections.

  Shapes: ``inputs_q`` (B, Sq, E); ``inputs_kv`` (B, Skv, E_kv) or None for
  self attention; output (B, Sq, out_features or E).

  Parameters (logical axis names), as submodules:
    self attention with ``num_gqa_groups == num_attention_heads`` and
    ``fuse_qkv``: ``qkv/kernel`` (E, 3, heads, head_dim)
    ("embed", "qkv", "heads", "kv"); otherwise ``query/kernel`` (E, heads,
    head_dim) ("embed", "heads", "kv") and ``kv/kernel`` (E_kv, 2, groups,
    head_dim) ("embed", "qkv", "heads", "kv"). ``out/kernel`` (heads,
    head_dim, E) ("heads", "kv", "embed"). Biases (``use_bias``) carry the
    names of the output dims.

  FP8 state (``DelayedScaling`` only): ``fp8_meta`` of each projection
  submodule, in collection ``"_overwrite_with_gradient"``.

  Decoding (``decode=True``, self attention only): ``init`` (or ``apply`` with
  ``mutable=["cache"]`` on variables without a cache) on the full-length input
  (B, L, E) allocates collection ``"cache"``: ``cached_key``,
  ``cached_value`` (B, L, groups, head_dim) and ``cache_index`` (int32 scalar);
  each later ``apply(..., mutable=["cache"])`` on (B, n, E) appends n tokens
  and attends to the filled positions (``te_jax.flax.kv_cache`` has the
  rules). The FP8 state need not be mutable: decode steps use the stored
  scales and leave them as they are.

  Attributes:
    num_attention_heads: number of query heads.
    head_dim: size of each head; default ``E // num_attention_heads``.
    num_gqa_groups: number of key/value heads (divides num_attention_heads);
      default ``num_attention_heads`` (plain MHA); 1 = multi-query.
    attn_mask_type: "causal" (default) or "no_mask"; segment ids / ``mask``
      add padding and document masking on top of either.
    attention_dropout: dropout rate on the attention probabilities.
    enable_rotary_pos_emb: apply rotary embeddings to Q and K (default False).
    rotary_base: rotary frequency base (default 10000).
    fuse_qkv: one fused Q/K/V kernel for self attention (default True).
    use_bias: biases on the projections (default False).
    out_features: output width; default the width of ``inputs_q``.
    attention_impl: "auto" (default), "xla" or "cudnn"; see the module docs.
    max_segments_per_seq: documents a packed row may hold in cuDNN's packed
      layout (default 8; ``te_jax.packing.documents_per_row`` counts them); a
      batch with a fuller row takes the masked cuDNN fallback. jax sizes
      cuDNN's buffers by it: each unit adds a float32 (B, S, heads, head_dim)
      gradient accumulator to the backward pass's scratch memory and some
      time, so rows of many short documents gain nothing from a large value
      (measured trade-offs: BENCHMARKS.md, benchmarks/bench_packed_attention.py).
    max_document_length: None (default) or the longest document (in tokens)
      the packed rows are expected to hold; causal only. Packed self
      attention then computes only the band of keys at most
      ``max_document_length - 1`` positions back (cuDNN skips the tiles outside it: about S *
      max_document_length logits per head instead of S**2 / 2), in place of
      the packed layout above. Checked on the device: a batch with a longer
      document runs full causal attention under the segment mask (same
      answer, slower). For rows of many short documents.
    dtype: compute/output dtype; None promotes input and param dtype.
    param_dtype: parameter dtype (default float32).
    kernel_init, bias_init: initializers of the projections.
    impl: "auto" (default), "cuda" or "reference": which implementation the
      FP8 projections' ops use (``TE_JAX_IMPL`` overrides "auto"); the
      attention core is chosen by ``attention_impl``.
    decode: autoregressive decoding with a key/value cache (default False).
  """

  num_attention_heads: int
  head_dim: Optional[int] = None
  num_gqa_groups: Optional[int] = None
  attn_mask_type: str = "causal"
  attention_dropout: float = 0.0
  enable_rotary_pos_emb: bool = False
  rotary_base: float = 10000.0
  fuse_qkv: bool = True
  use_bias: bool = False
  out_features: Optional[int] = None
  attention_impl: str = "auto"
  max_segments_per_seq: int = 8
  max_document_length: Optional[int] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  impl: str = "auto"
  decode: bool = False

  def _dense(self, features, name, kernel_axes, axis=-1, dtype=None, split=False):
    return DenseGeneral(features=features, axis=axis, use_bias=self.use_bias,
                        dtype=dtype, param_dtype=self.param_dtype,
                        kernel_init=self.kernel_init, bias_init=self.bias_init,
                        kernel_axes=kernel_axes, split_output=split, impl=self.impl,
                        name=name)

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: Optional[jax.Array] = None, *,
               segment_ids: Optional[jax.Array] = None,
               kv_segment_ids: Optional[jax.Array] = None,
               segment_positions: Optional[jax.Array] = None,
               kv_segment_positions: Optional[jax.Array] = None,
               mask: Optional[jax.Array] = None,
               deterministic: bool = True,
               input_norm: Optional[norm_dense.NormParams] = None) -> jax.Array:
    """Attends from ``inputs_q`` to ``inputs_kv`` (itself when None).

    Args:
      inputs_q: (B, Sq, E) queries.
      inputs_kv: (B, Skv, E_kv) keys/values source; None = self attention.
      segment_ids: (B, Sq) int document ids of the queries (0 = padding).
      kv_segment_ids: (B, Skv) ids of the keys; defaults to ``segment_ids``
        in self attention.
      segment_positions: (B, Sq) positions of the queries for rotary
        embeddings (default ``arange(Sq)``).
      kv_segment_positions: (B, Skv) key positions; defaults to
        ``segment_positions`` in self attention, else ``arange(Skv)``.
      mask: optional boolean mask (True = attend), broadcastable to
        (B, heads, Sq, Skv); prefer (B, 1, Sq, Skv).
      deterministic: disables attention dropout when True.
      input_norm: optional ``te_jax.norm_dense.NormParams`` of a norm applied
        to ``inputs_q`` before the projections (a pre-norm whose parameters
        the caller owns, e.g. ``te_jax.flax.NormParameters``; ``inputs_kv``
        is not normalized). In FP8 the norm is fused into the quantization
        of the projection's input where ``DenseGeneral`` can fuse it: Q/K/V
        in one pass for self attention, the query (whose normalized output
        then feeds the key/value projection) with grouped-query attention.

    Returns:
      (B, Sq, out_features) in the compute dtype.
    """
    check_attention_options(self.attn_mask_type, self.attention_impl,
                            self.max_segments_per_seq, self.max_document_length)
    if self.decode:
      kv_cache.check_decode_inputs(inputs_kv, segment_ids=segment_ids,
                                   kv_segment_ids=kv_segment_ids,
                                   segment_positions=segment_positions,
                                   kv_segment_positions=kv_segment_positions)
    self_attn = inputs_kv is None
    check_input_3d("inputs_q", inputs_q)
    if not self_attn:
      check_input_3d("inputs_kv", inputs_kv)
    inputs_kv, kv_segment_ids, kv_segment_positions = resolve_segments(
        inputs_q, inputs_kv, segment_ids, segment_positions, kv_segment_ids,
        kv_segment_positions)
    h = self.num_attention_heads
    g = self.num_gqa_groups or h
    if h % g:
      raise ValueError(f"num_gqa_groups ({g}) must divide num_attention_heads ({h}).")
    embed = inputs_q.shape[-1]
    d = self.head_dim or embed // h
    if not self.head_dim and embed % h:
      raise ValueError(f"width {embed} is not divisible by {h} heads; set head_dim.")
    compute = self.dtype if self.dtype is not None else jnp.result_type(
        inputs_q.dtype, self.param_dtype)

    # The fused projections hand back q, k, v (k, v) as separate outputs, so
    # that in FP8 their gradients are quantized without a concatenation.
    norm_kw = {} if input_norm is None else {"input_norm": input_norm}
    if self_attn and g == h and self.fuse_qkv:
      q, k, v = self._dense((3, h, d), "qkv", ("embed", "qkv", "heads", "kv"),
                            dtype=compute, split=True)(inputs_q, **norm_kw)
    else:
      query = self._dense((h, d), "query", ("embed", "heads", "kv"), dtype=compute)
      if input_norm is not None and self_attn:   # K and V read the query's norm output
        q, inputs_kv = query(inputs_q, input_norm=input_norm, return_norm_output=True)
      else:
        q = query(inputs_q, **norm_kw)
      k, v = self._dense((2, g, d), "kv", ("embed", "qkv", "heads", "kv"),
                         dtype=compute, split=True)(inputs_kv)

    step = None
    if self.decode:
      rotate = (functools.partial(apply_rotary, base=self.rotary_base)
                if self.enable_rotary_pos_emb else None)
      step = kv_cache.decode_step(self, q, k, v, causal=self.attn_mask_type == "causal",
                                  rotate=rotate)
    dropout = self.attention_dropout > 0.0 and not deterministic
    drop = dict(dropout_rate=self.attention_dropout if dropout else 0.0,
                dropout_rng=self.make_rng("dropout") if dropout else None)
    if step is not None:   # rotated and masked by the cache: a plain masked core
      out = attention_core(step.q, step.k, step.v, self_attn=False,
                           mask=and_masks(mask, step.mask), attn_mask_type="no_mask",
                           attention_impl=self.attention_impl, **drop)
    else:
      out = attention_core(
          q, k, v, self_attn=self_attn, segment_ids=segment_ids,
          kv_segment_ids=kv_segment_ids, segment_positions=segment_positions,
          kv_segment_positions=kv_segment_positions, mask=mask,
          attn_mask_type=self.attn_mask_type,
          enable_rotary_pos_emb=self.enable_rotary_pos_emb, rotary_base=self.rotary_base,
          attention_impl=self.attention_impl,
          max_segments_per_seq=self.max_segments_per_seq,
          max_document_length=self.max_document_length, **drop)
    out = out.astype(compute)
    out = self._dense(self.out_features or embed, "out", ("heads", "kv", "embed"),
                      axis=(-2, -1), dtype=compute)(out)
    return out if step is None else kv_cache.mark_overflow(out, step.valid)
