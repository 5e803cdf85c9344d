"""``MultiHeadAttention``: FP8 projections around a fused attention attn.

The Q/K/V and output projections are ``DenseGeneral`` modules, so they run in
FP8 under ``fp8_autocast``; the attention between them (softmax(QK^T)V, in
the compute dtype) is ``te_jax.layers.attention``'s, whose module docs give
the rules: which projections (fused Q/K/V or query + key/value), masks and
packed sequences (``segment_ids``), the choice of implementation
(``attention_impl``: XLA, cuDNN flash attention, cuDNN's packed layout, the
causal band of ``max_document_length``) and rotary embeddings.

Decoding (``decode=True``): a key/value cache in collection ``"cache"``,
Flax's convention; see ``te_jax.flax.kv_cache`` and ``te_jax.layers.kv_cache``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import norm_dense
from te_jax.flax import kv_cache
from te_jax.flax.dense import DenseGeneral
from te_jax.layers import attention as attn
from te_jax.layers import kv_cache as cache_lib
from te_jax.layers import checks
from te_jax.layers.checks import compute_dtype
from te_jax.layers.init import default_kernel_init

__all__ = ["MultiHeadAttention"]

Dtype = Any
Initializer = Callable[..., jax.Array]


class MultiHeadAttention(nn.Module):
  """Multi-head (optionally grouped-query) self/cross attention with FP8 projections.

  Shapes: ``inputs_q`` (B, Sq, E); ``inputs_kv`` (B, Skv, E_kv) or None for
  self attention; output (B, Sq, out_features or E).

  Parameters (logical axis names), as submodules:
    self attention with ``fuse_qkv``: ``qkv/kernel`` (E, 3, heads, head_dim)
    ("embed", "qkv", "heads", "kv") when ``num_gqa_groups ==
    num_attention_heads``, else (E, heads + 2 * groups, head_dim)
    ("embed", "qkv_heads", "kv"): the query heads, then the keys', then the
    values' (``te_jax.layers.attention.fused_qkv_layout``; "qkv_heads" is
    not sharded, so tensor parallelism over heads takes ``fuse_qkv=False``);
    otherwise ``query/kernel`` (E, heads, head_dim) ("embed", "heads", "kv")
    and ``kv/kernel`` (E_kv, 2, groups, head_dim) ("embed", "qkv", "heads",
    "kv"). ``out/kernel`` (heads, head_dim, E) ("heads", "kv", "embed").
    Biases (``use_bias``) carry the names of the output dims.

  FP8 state (``DelayedScaling`` only): ``fp8_meta`` of each projection
  submodule, in collection ``"_overwrite_with_gradient"``.

  Decoding (``decode=True``, self attention only): ``init`` (or ``apply`` with
  ``mutable=["cache"]`` on variables without a cache) on the full-length input
  (B, L, E) allocates collection ``"cache"``: ``cached_key``,
  ``cached_value`` (B, L, groups, head_dim) and ``cache_index`` (int32 scalar);
  each later ``apply(..., mutable=["cache"])`` on (B, n, E) appends n tokens
  and attends to the filled positions (``te_jax.layers.kv_cache`` has the
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
    fuse_qkv: one fused Q/K/V kernel for self attention (default True),
      also with grouped-query attention (layout above); False: a query and
      a key/value projection.
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
               input_norm: Optional[norm_dense.NormParams] = None,
               add_residual: bool = False) -> jax.Array:
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
        in one pass for fused self attention, the query (whose normalized
        output then feeds the key/value projection) otherwise.
      add_residual: return ``inputs_q + attention`` (a residual connection:
        ``out_features`` equal to E, ``inputs_q`` in the compute dtype); in
        FP8 the output projection's GEMM adds it (its C input).

    Returns:
      (B, Sq, out_features) in the compute dtype.
    """
    attn.check_attention_options(self.attn_mask_type, self.attention_impl,
                                 self.max_segments_per_seq, self.max_document_length)
    checks.attention_options(self.num_attention_heads, self.num_gqa_groups, self.head_dim,
                             self.out_features, self.attention_dropout)
    if self.decode:
      cache_lib.check_decode_inputs(inputs_kv, segment_ids=segment_ids,
                                    kv_segment_ids=kv_segment_ids,
                                    segment_positions=segment_positions,
                                    kv_segment_positions=kv_segment_positions)
    self_attn = inputs_kv is None
    attn.check_input_3d("inputs_q", inputs_q)
    if not self_attn:
      attn.check_input_3d("inputs_kv", inputs_kv)
    inputs_kv, kv_segment_ids, kv_segment_positions = attn.resolve_segments(
        inputs_q, inputs_kv, segment_ids, segment_positions, kv_segment_ids,
        kv_segment_positions)
    embed = inputs_q.shape[-1]
    h, g, d = attn.head_layout(embed, self.num_attention_heads, self.num_gqa_groups,
                               self.head_dim)
    compute = compute_dtype(self.dtype, inputs_q.dtype, self.param_dtype)
    if attn.fuses_qkv(self_attn, self.fuse_qkv):
      layout = attn.fused_qkv_layout(h, g, d)
      attn.warn_if_heads_split(h, g)
      proj = dict(qkv=self._dense(layout.features, "qkv", layout.axes, dtype=compute,
                                  split=layout.split))
    else:
      proj = dict(query=self._dense((h, d), "query", ("embed", "heads", "kv"), dtype=compute),
                  kv=lambda x: self._dense((2, g, d), "kv", ("embed", "qkv", "heads", "kv"),
                                           dtype=compute, split=True)(x))
    # The residual: inputs_q as passed through the projection's norm, so
    # that its cotangent is added in the norm's backward kernel.
    q, k, v, *residual = attn.project_qkv(inputs_q, inputs_kv, self_attn=self_attn,
                                          input_norm=input_norm, return_input=add_residual,
                                          **proj)

    step = None
    if not self.decode:
      kv_cache.warn_unused_cache(self)
    else:
      rotate = (functools.partial(attn.apply_rotary, base=self.rotary_base)
                if self.enable_rotary_pos_emb else None)
      step = kv_cache.decode_step(self, q, k, v, causal=self.attn_mask_type == "causal",
                                  rotate=rotate)
    dropout = self.attention_dropout > 0.0 and not deterministic
    out = attn.attention(
        q, k, v, step=step, mask=mask, attention_impl=self.attention_impl,
        dropout_rate=self.attention_dropout if dropout else 0.0,
        dropout_rng=self.make_rng("dropout") if dropout else None, self_attn=self_attn,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        segment_positions=segment_positions, kv_segment_positions=kv_segment_positions,
        attn_mask_type=self.attn_mask_type, enable_rotary_pos_emb=self.enable_rotary_pos_emb,
        rotary_base=self.rotary_base, max_segments_per_seq=self.max_segments_per_seq,
        max_document_length=self.max_document_length)
    width = self.out_features or embed
    if add_residual:
      checks.check_add_residual("MultiHeadAttention", inputs_q, compute, width)
    out = self._dense(width, "out", ("heads", "kv", "embed"), axis=(-2, -1), dtype=compute)(
        out.astype(compute), residual=residual[0] if residual else None)
    return out if step is None else cache_lib.mark_overflow(out, step.valid)
