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
slower). Other masks (cross attention with segment ids, an explicit
``mask``) take XLA under "auto" (cuDNN in jax takes a mask only as a dense
additive bias); "cudnn" forces cuDNN (the mask then becomes that bias).
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
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import norm_dense
from te_jax.flax import kv_cache, packed_attention
from te_jax.flax.packed_attention import segment_attention_mask
from te_jax.flax.dense import DenseGeneral, default_kernel_init

__all__ = ["MultiHeadAttention", "apply_rotary", "segment_attention_mask", "check_input_3d",
           "check_segment_arg", "check_attention_options", "attention_core",
           "resolve_segments"]

Dtype = Any
Initializer = Callable[..., jax.Array]
_MASK_TYPES = ("causal", "no_mask")
_IMPLS = ("auto", "xla", "cudnn")


def apply_rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotates (B, S, H, D) ``x`` by (B, S) integer ``positions`` (rotate-half layout)."""
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {d}.")
  half = d // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq     # (B, S, half)
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _and_masks(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


def check_input_3d(name: str, x) -> None:
  """Raises ValueError unless ``x`` (argument ``name``) is (batch, seq, hidden)."""
  shape = tuple(jnp.shape(x))
  if len(shape) != 3:
    raise ValueError(f"{name} must have shape (batch, seq, hidden), got {shape} "
                     f"({len(shape)}-D).")


def check_segment_arg(name: str, ids, like_name: str, like) -> None:
  """Checks that ``ids`` (argument ``name``; None passes) is an integer
  (batch, seq) array matching the first two dims of ``like`` (argument
  ``like_name``); raises ValueError/TypeError naming both."""
  if ids is None:
    return
  shape, want = tuple(jnp.shape(ids)), tuple(jnp.shape(like)[:2])
  if shape != want:
    raise ValueError(f"{name} must have shape (batch, seq) = {want} matching "
                     f"{like_name}, got {shape}.")
  dtype = getattr(ids, "dtype", None)
  dtype = jnp.asarray(ids).dtype if dtype is None else dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {jnp.dtype(dtype).name}.")


def _reference_attention(q, k, v, mask, is_causal, dropout_rng, rate):
  """Explicit attention (fp32 softmax) with dropout on the probabilities."""
  h, g = q.shape[2], k.shape[2]
  if h != g:
    k = jnp.repeat(k, h // g, axis=2)
    v = jnp.repeat(v, h // g, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                      preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  if is_causal:
    sq, sk = q.shape[1], k.shape[1]
    causal = jnp.tril(jnp.ones((sq, sk), jnp.bool_))[None, None]
    mask = _and_masks(mask, causal)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def check_attention_options(attn_mask_type: str, attention_impl: str,
                            max_segments_per_seq: int) -> None:
  """Raises ValueError for an unknown mask type or attention implementation, or
  ``max_segments_per_seq < 1`` (the options of ``MultiHeadAttention``)."""
  if attn_mask_type not in _MASK_TYPES:
    raise ValueError(f"attn_mask_type must be one of {_MASK_TYPES}, got "
                     f"{attn_mask_type!r}.")
  if max_segments_per_seq < 1:
    raise ValueError(f"max_segments_per_seq must be >= 1, got {max_segments_per_seq}.")
  if attention_impl not in _IMPLS:
    raise ValueError(f"attention_impl must be one of {_IMPLS}, got "
                     f"{attention_impl!r}.")


def _flash_shapes(q) -> bool:
  return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
          and q.shape[-1] <= 128 and q.shape[-1] % 8 == 0)


def _use_cudnn(attention_impl, q, has_mask) -> bool:
  if attention_impl == "cudnn":
    return True
  if attention_impl == "xla":
    return False
  return not has_mask and _flash_shapes(q)


def _use_packed(attention_impl, q, packed_self, extra_mask) -> bool:
  """Packed self attention in cuDNN's packed layout (see the module docs)."""
  if not packed_self or extra_mask or attention_impl == "xla":
    return False
  if attention_impl == "auto" and not _flash_shapes(q):
    return False
  return packed_attention.log_if_unavailable()


def _fused_or_xla(attention_impl, max_segments, q, k, v, segment_ids, kv_segment_ids,
                  self_attn, mask, full_mask, is_causal, head_dim):
  """Attention without dropout: cuDNN (packed or not) where chosen, else XLA.

  With attention_impl="auto" the cuDNN path is staged beside the XLA one by
  ``lax.platform_dependent``, so that a computation compiled for the host
  CPU of a GPU machine (CPU arrays) lowers the XLA path instead of failing.
  """
  def xla():
    return jax.nn.dot_product_attention(q, k, v, mask=full_mask, is_causal=is_causal,
                                        implementation="xla")
  packed_self = segment_ids is not None and self_attn and kv_segment_ids is segment_ids
  if _use_packed(attention_impl, q, packed_self, mask is not None):
    def fused():
      return packed_attention.packed_self_attention(
          q, k, v, segment_ids, is_causal=is_causal,
          max_segments=max_segments, scale=head_dim ** -0.5)
  elif _use_cudnn(attention_impl, q, full_mask is not None):
    def fused():
      return jax.nn.dot_product_attention(q, k, v, mask=full_mask, is_causal=is_causal,
                                          implementation="cudnn")
  else:
    return xla()
  if attention_impl == "auto":
    return jax.lax.platform_dependent(cuda=fused, default=xla)
  return fused()


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, *, self_attn: bool,
                   segment_ids: Optional[jax.Array] = None,
                   kv_segment_ids: Optional[jax.Array] = None,
                   segment_positions: Optional[jax.Array] = None,
                   kv_segment_positions: Optional[jax.Array] = None,
                   mask: Optional[jax.Array] = None, attn_mask_type: str = "causal",
                   enable_rotary_pos_emb: bool = False, rotary_base: float = 10000.0,
                   attention_impl: str = "auto", max_segments_per_seq: int = 8,
                   dropout_rate: float = 0.0,
                   dropout_rng: Optional[jax.Array] = None) -> jax.Array:
  """The attention of ``MultiHeadAttention`` between its projections.

  Rotary embeddings, segment and extra masks, the choice of implementation
  (module docs) and the zeroing of padding queries, on projected heads.
  ``te_jax.nnx.MultiHeadAttention`` calls it too.

  Args:
    q: (B, Sq, heads, head_dim) queries.
    k, v: (B, Skv, groups, head_dim) keys and values (groups divides heads).
    self_attn: whether k and v come from the queries' sequence (packed self
      attention may then take cuDNN's packed layout).
    segment_ids, kv_segment_ids: (B, Sq) / (B, Skv) document ids (0 =
      padding), as given to the module (``kv_segment_ids`` already defaulted).
    segment_positions, kv_segment_positions: rotary positions (default
      ``arange``), already defaulted as in the module.
    mask: optional boolean mask (True = attend) broadcastable to
      (B, heads, Sq, Skv).
    attn_mask_type, enable_rotary_pos_emb, rotary_base, attention_impl,
      max_segments_per_seq: the module's options.
    dropout_rate: dropout on the probabilities; > 0 only when dropout is on.
    dropout_rng: the key of that dropout (needed when ``dropout_rate > 0``).

  Returns:
    (B, Sq, heads, head_dim), in the dtype the core computed.
  """
  d = q.shape[-1]
  if enable_rotary_pos_emb:
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    qpos = segment_positions
    if qpos is None:
      qpos = jnp.broadcast_to(jnp.arange(sq)[None], (b, sq))
    kpos = kv_segment_positions
    if kpos is None:
      kpos = jnp.broadcast_to(jnp.arange(skv)[None], (b, skv))
    q = apply_rotary(q, qpos, rotary_base)
    k = apply_rotary(k, kpos, rotary_base)

  full_mask = _and_masks(segment_attention_mask(segment_ids, kv_segment_ids),
                         None if mask is None else mask.astype(jnp.bool_))
  is_causal = attn_mask_type == "causal"
  if dropout_rate > 0.0:
    out = _reference_attention(q, k, v, full_mask, is_causal, dropout_rng, dropout_rate)
  else:
    out = _fused_or_xla(attention_impl, max_segments_per_seq, q, k, v, segment_ids,
                        kv_segment_ids, self_attn, mask, full_mask, is_causal, d)
  if segment_ids is not None:      # padding queries output 0 on every path
    out = jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out


def resolve_segments(inputs_q, inputs_kv, segment_ids, segment_positions, kv_segment_ids,
                     kv_segment_positions):
  """Checks the segment arguments against their inputs and fills in self attention.

  ``segment_ids``/``segment_positions`` must be (B, Sq) like ``inputs_q``, the
  ``kv_`` ones (B, Skv) like ``inputs_kv`` (``inputs_q`` when it is None).
  Returns ``(inputs_kv, kv_segment_ids, kv_segment_positions)``: for self
  attention (``inputs_kv`` None) the queries' inputs and segments. Shared by
  the Linen and NNX MultiHeadAttention.
  """
  self_attn = inputs_kv is None
  kv_name, kv_like = ("inputs_q", inputs_q) if self_attn else ("inputs_kv", inputs_kv)
  check_segment_arg("segment_ids", segment_ids, "inputs_q", inputs_q)
  check_segment_arg("segment_positions", segment_positions, "inputs_q", inputs_q)
  check_segment_arg("kv_segment_ids", kv_segment_ids, kv_name, kv_like)
  check_segment_arg("kv_segment_positions", kv_segment_positions, kv_name, kv_like)
  if self_attn:
    inputs_kv = inputs_q
    if kv_segment_ids is None:
      kv_segment_ids = segment_ids
    if kv_segment_positions is None:
      kv_segment_positions = segment_positions
  return inputs_kv, kv_segment_ids, kv_segment_positions


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
                            self.max_segments_per_seq)
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
                           mask=_and_masks(mask, step.mask), attn_mask_type="no_mask",
                           attention_impl=self.attention_impl, **drop)
    else:
      out = attention_core(
          q, k, v, self_attn=self_attn, segment_ids=segment_ids,
          kv_segment_ids=kv_segment_ids, segment_positions=segment_positions,
          kv_segment_positions=kv_segment_positions, mask=mask,
          attn_mask_type=self.attn_mask_type,
          enable_rotary_pos_emb=self.enable_rotary_pos_emb, rotary_base=self.rotary_base,
          attention_impl=self.attention_impl,
          max_segments_per_seq=self.max_segments_per_seq, **drop)
    out = out.astype(compute)
    out = self._dense(self.out_features or embed, "out", ("heads", "kv", "embed"),
                      axis=(-2, -1), dtype=compute)(out)
    return out if step is None else kv_cache.mark_overflow(out, step.valid)
