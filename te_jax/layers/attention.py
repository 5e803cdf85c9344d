"""The attention of ``MultiHeadAttention`` (Linen and NNX) around its projections.

Which projections compute Q, K and V (one fused kernel, or a query and a
key/value projection, a pre-norm fused into them): see
``te_jax.layers.qkv_projection``, whose names this module re-exports.

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

Implementation choice (``attention_impl``, :func:`attention_core`): "xla",
"cudnn" or "auto". "auto" picks cuDNN flash attention on GPU for
bfloat16/float16 with head_dim <= 128 and a multiple of 8 and no attention
dropout. Packed self attention (``segment_ids`` alone: no ``kv_segment_ids``
of its own, no ``mask``) then runs in cuDNN's packed layout
(``te_jax.layers.packed_attention``): per-document offsets instead of a
mask, for rows of at most ``max_segments_per_seq`` documents, each one
contiguous run of its id; a batch that breaks either rule is detected on the
device and runs cuDNN attention under the (B, 1, S, S) segment mask instead
(same answer, slower). With ``max_document_length`` W (causal only), packed
self attention takes neither: under the segment mask it computes only the
band of keys at most W - 1 positions back (cuDNN's sliding window skips the
tiles outside it), which is exact while every document fits in W tokens; a
batch with a longer document is detected on the device and runs the full
masked attention (``te_jax.layers.packed_attention.banded_self_attention``).
Other masks (cross attention with segment ids, an explicit ``mask``) take
XLA under "auto" (cuDNN in jax takes a mask only as a dense additive bias);
"cudnn" forces cuDNN (the mask then becomes that bias). Under "auto" the
cuDNN path is staged beside the XLA one with ``jax.lax.platform_dependent``,
so a computation compiled for a GPU host's CPU (arrays placed there) runs
XLA attention. Every cuDNN path keeps for its backward only cuDNN's output
and softmax statistics besides its inputs: masks, and the dense bias jax
makes of them, are rebuilt there (a remat policy), never kept per layer.
Attention dropout uses an explicit softmax in float32. With
``segment_ids``, queries at padding positions (id 0) output 0 on every path.

Rotary position embeddings (:func:`apply_rotary`) rotate the two halves of
each head's Q and K ("rotate-half"/GPT-NeoX layout) by angle
``position * rotary_base ** (-2i / head_dim)``; positions default to
``arange(S)`` and come from ``segment_positions`` for packed rows (restarting
at 0 in each document), which makes a packed document see exactly the
rotations it would see alone.

Decoding with a key/value cache (``te_jax.layers.kv_cache``): the cache's
step, rotated and masked already, attends through :func:`attention` as a
plain masked core.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp

from te_jax import explicit_axes as explicit_lib
from te_jax.layers import packed_attention
from te_jax.layers.checks import check_input_rank
from te_jax.layers.packed_attention import segment_attention_mask
from te_jax.layers.qkv_projection import (QKVLayout, fused_qkv_layout, fuses_qkv,  # noqa: F401
                                         head_layout, project_qkv, warn_if_heads_split)

__all__ = ["apply_rotary", "segment_attention_mask", "and_masks", "check_input_3d",
           "check_segment_arg", "check_attention_options", "attention_core", "attention",
           "resolve_segments", "head_layout", "fuses_qkv", "QKVLayout", "fused_qkv_layout",
           "warn_if_heads_split", "project_qkv"]

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


def and_masks(a, b):
  """The logical AND of two boolean masks, either of which may be None."""
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


def check_input_3d(name: str, x) -> None:
  """Raises ValueError unless ``x`` (argument ``name``) is a (batch, seq,
  hidden) array (TypeError for a Python list: convert it first)."""
  check_input_rank(name, x, 0)
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
  # A nested Python list has a shape and an integer dtype to jnp, but the
  # attention indexes it as an array (and fails with "list indices must be
  # integers" far from here).
  check_input_rank(name, ids, 0)
  shape, want = tuple(jnp.shape(ids)), tuple(jnp.shape(like)[:2])
  if shape != want:
    raise ValueError(f"{name} must have shape (batch, seq) = {want} matching "
                     f"{like_name}, got {shape}.")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {jnp.dtype(ids.dtype).name}.")


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
    mask = and_masks(mask, causal)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def check_attention_options(attn_mask_type: str, attention_impl: str,
                            max_segments_per_seq: int,
                            max_document_length: Optional[int] = None) -> None:
  """Raises ValueError for an unknown mask type or attention implementation,
  ``max_segments_per_seq < 1``, or a ``max_document_length`` that is not None
  or an int >= 1 with causal masking (the options of ``MultiHeadAttention``)."""
  if attn_mask_type not in _MASK_TYPES:
    raise ValueError(f"attn_mask_type must be one of {_MASK_TYPES}, got "
                     f"{attn_mask_type!r}.")
  if max_segments_per_seq < 1:
    raise ValueError(f"max_segments_per_seq must be >= 1, got {max_segments_per_seq}.")
  if max_document_length is not None:
    if (isinstance(max_document_length, bool) or not isinstance(max_document_length, int)
        or max_document_length < 1):
      raise ValueError(f"max_document_length must be None or an int >= 1, got "
                       f"{max_document_length!r}.")
    if attn_mask_type != "causal":
      raise ValueError(f"max_document_length bands causal attention (cuDNN's window "
                       f"looks left only); attn_mask_type is {attn_mask_type!r}. Use "
                       "attn_mask_type='causal' or max_document_length=None.")
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


@functools.lru_cache(maxsize=None)
def _log_no_band(reason: str):
  logging.getLogger("te_jax").info(
      "te_jax: MultiHeadAttention's max_document_length is not used here (full "
      "attention instead of the band): %s", reason)


def _full_mask(segment_ids, kv_segment_ids, mask):
  """The segment mask and ``mask`` (True = attend) in one boolean mask, or None."""
  return and_masks(segment_attention_mask(segment_ids, kv_segment_ids),
                   None if mask is None else mask.astype(jnp.bool_))


def _saves_cudnn_forward_outputs(prim, *_, **__) -> bool:
  """Remat policy of cuDNN attention: its backward keeps what cuDNN's forward
  call returned (output, softmax statistics) and rebuilds everything else.

  jax's cuDNN wrapper turns a boolean mask into a dense additive bias before
  its custom VJP, which then keeps the bias for the backward: for the segment
  mask (B, 1, Sq, Skv) in the compute dtype, 256 MiB a layer at batch 8 x
  4096 tokens in bfloat16, and a ``lax.cond`` (packed or banded paths) keeps
  it even when the branch taken has none. Rebuilt from the segment ids in
  the backward instead, it is one elementwise pass there.
  """
  return prim.name.startswith("dot_product_attention_fwd")


def _fused_or_xla(attention_impl, max_segments, q, k, v, segment_ids, kv_segment_ids,
                  self_attn, mask, full_mask, is_causal, head_dim, max_document_length=None):
  """Attention without dropout: cuDNN (packed, banded or plain) where chosen, else XLA.

  With attention_impl="auto" the cuDNN path is staged beside the XLA one by
  ``lax.platform_dependent``, so that a computation compiled for the host
  CPU of a GPU machine (CPU arrays) lowers the XLA path instead of failing.
  """
  def xla_attention():
    return jax.nn.dot_product_attention(q, k, v, mask=full_mask, is_causal=is_causal,
                                        implementation="xla")
  packed_self = segment_ids is not None and self_attn and kv_segment_ids is segment_ids
  banded = max_document_length is not None and packed_self and is_causal and mask is None
  if max_document_length is not None and not banded:
    _log_no_band("it needs causal self attention over segment_ids without an extra mask")
  fused, xla = None, xla_attention
  # Padding queries are left to attention_core, which zeroes them on every
  # path (a second `where` costs a pass over the output in the backward).
  if banded:
    band = functools.partial(packed_attention.banded_self_attention, q, k, v, segment_ids,
                             window=max_document_length, scale=head_dim ** -0.5,
                             zero_padding_queries=False)
    # In XLA the band saves no work; the answer is the same.
    xla = functools.partial(band, implementation="xla")
    if _use_cudnn(attention_impl, q, has_mask=False):
      fused = functools.partial(band, implementation="cudnn")
  elif _use_packed(attention_impl, q, packed_self, mask is not None):
    def fused():
      return packed_attention.packed_self_attention(
          q, k, v, segment_ids, is_causal=is_causal,
          max_segments=max_segments, scale=head_dim ** -0.5, zero_padding_queries=False)
  elif _use_cudnn(attention_impl, q, full_mask is not None):
    def fused():
      # The mask is built again in here, under the checkpoint below, so that
      # the backward rebuilds it instead of keeping it.
      return jax.nn.dot_product_attention(q, k, v, mask=_full_mask(segment_ids, kv_segment_ids,
                                                                   mask),
                                          is_causal=is_causal, implementation="cudnn")
  if fused is None:
    return xla()
  fused = jax.checkpoint(fused, policy=_saves_cudnn_forward_outputs)
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
                   dropout_rng: Optional[jax.Array] = None,
                   max_document_length: Optional[int] = None) -> jax.Array:
  """The attention of ``MultiHeadAttention`` between its projections.

  Rotary embeddings, segment and extra masks, the choice of implementation
  (module docs) and the zeroing of padding queries, on projected heads.

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
    max_document_length: the module's option: with it, causal packed self
      attention computes only a band of this width where every document
      fits in it (``packed_attention.banded_self_attention``).

  Returns:
    (B, Sq, heads, head_dim), in the dtype the core computed.
  """
  d = q.shape[-1]
  # Under an explicit-axes mesh the per-token inputs take the layout of the
  # heads they mask (the sequence gathered there under sequence parallelism).
  # (Self attention's kv ids stay the same object: the packed paths check it.)
  same = kv_segment_ids is segment_ids
  segment_ids = explicit_lib.reshard_like(segment_ids, q)
  kv_segment_ids = segment_ids if same else explicit_lib.reshard_like(kv_segment_ids, k)
  segment_positions = explicit_lib.reshard_like(segment_positions, q)
  kv_segment_positions = explicit_lib.reshard_like(kv_segment_positions, k)
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

  full_mask = _full_mask(segment_ids, kv_segment_ids, mask)
  is_causal = attn_mask_type == "causal"
  if dropout_rate > 0.0:
    if max_document_length is not None:
      _log_no_band("attention dropout runs an explicit softmax")
    out = _reference_attention(q, k, v, full_mask, is_causal, dropout_rng, dropout_rate)
  else:
    out = _fused_or_xla(attention_impl, max_segments_per_seq, q, k, v, segment_ids,
                        kv_segment_ids, self_attn, mask, full_mask, is_causal, d,
                        max_document_length)
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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, step=None,
              mask: Optional[jax.Array] = None, attention_impl: str = "auto",
              dropout_rate: float = 0.0, dropout_rng: Optional[jax.Array] = None,
              **core_kw) -> jax.Array:
  """:func:`attention_core` of the projected heads, or of a decode ``step``
  (a ``te_jax.layers.kv_cache.DecodeStep``: its queries against the whole
  cache, already rotated and masked, so a plain masked core) when one is
  given. ``core_kw``: :func:`attention_core`'s other arguments (unused with
  a step). Returns (B, Sq, heads, head_dim)."""
  if mask is not None:
    check_input_rank("mask", mask, 0)
  drop = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  if step is not None:
    return attention_core(step.q, step.k, step.v, self_attn=False,
                          mask=and_masks(mask, step.mask), attn_mask_type="no_mask",
                          attention_impl=attention_impl, **drop)
  return attention_core(q, k, v, mask=mask, attention_impl=attention_impl, **drop, **core_kw)
