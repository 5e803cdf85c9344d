"""Packed-sequence self attention in cuDNN's flash kernel, from segment ids.

A packed row holds several documents, each a contiguous run of one nonzero
segment id, with padding (id 0) between or after them. cuDNN's flash
attention takes such rows as per-document offsets and lengths ("ragged"
layout): it never forms a mask and skips every tile that crosses documents.
``jax.nn.dot_product_attention`` does not expose that layout (jax 0.10-0.11),
so it is reached through jax's own cuDNN wrapper
(``jax._src.cudnn.fused_attention_stablehlo``), guarded: where that wrapper,
its ``q_offsets`` argument, cuDNN >= 9.6 or a Hopper GPU is missing,
``packed_cudnn_available()`` is False and ``MultiHeadAttention`` keeps its
other paths.

The offsets have a static width, ``max_segments`` documents per row, and the
layout needs every document to be one run. Both are properties of the data,
known only on the device, so ``packed_self_attention`` checks them there and
``lax.cond`` falls back to cuDNN attention with the segment mask as a dense
(B, 1, S, S) bias (shared by all heads) for a batch that breaks either rule:
the answer is the same, only slower. Queries at padding positions get output
0 and send no gradient, on both branches.

Example (on a Hopper GPU)::

  ids = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0]])        # 2 documents + padding
  seqlens, offsets, ok = segment_layout(ids, max_segments=4)
  # seqlens [[3, 2, -1, -1]], offsets [[0, 3, -1, -1, -1]], ok True
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["segment_attention_mask", "segment_layout", "packed_cudnn_available",
           "packed_self_attention", "document_spans_fit", "banded_self_attention"]

# cuDNN's ragged (packed) layout in flash attention: 9.6.0 and later.
_MIN_CUDNN = 90600


def segment_attention_mask(q_segment_ids: Optional[jax.Array],
                           kv_segment_ids: Optional[jax.Array]) -> Optional[jax.Array]:
  """(B, 1, Sq, Skv) boolean mask: True where query and key share a segment.

  With only ``kv_segment_ids`` given, every query may attend to every
  non-padding key (segment id != 0).
  """
  if kv_segment_ids is None:
    if q_segment_ids is not None:
      raise ValueError("q_segment_ids were given without kv_segment_ids: pass the "
                       "key/value segment ids too (for self-attention, the same ids).")
    return None
  kv = kv_segment_ids[:, None, None, :]
  if q_segment_ids is None:
    return jnp.broadcast_to(kv != 0, kv.shape)
  return q_segment_ids[:, None, :, None] == kv


def _document_runs(segment_ids: jax.Array):
  """Checks (B, S) integer ``segment_ids``; returns them as int32, where each
  run of a nonzero id starts (bool (B, S)), and a () bool: no id has two runs."""
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_ids must be (batch, seq), got shape {segment_ids.shape}.")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be integers, got {segment_ids.dtype}.")
  ids = segment_ids.astype(jnp.int32)
  prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
  start = (ids != 0) & (ids != prev)
  # A run's id must exceed every id before it: then no id has two runs
  # (ids that decrease or repeat after padding fail the check).
  one_run_each = jnp.all(~start | (ids > lax.cummax(prev, axis=1)))
  return ids, start, one_run_each


def segment_layout(segment_ids: jax.Array,
                   max_segments: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Per-row document lengths and start offsets of packed ``segment_ids``.

  A document is a maximal run of one nonzero id; 0 is padding.

  Args:
    segment_ids: (B, S) integer segment ids.
    max_segments: static number of documents a row may hold.

  Returns:
    ``(seqlens, offsets, fits)``: ``seqlens`` (B, max_segments) int32, the
    length of each document in order, -1 after the last; ``offsets``
    (B, max_segments + 1) int32, the position where each starts, -1 after
    the last (the layout of jax's cuDNN wrapper); ``fits`` a () bool, True
    when every row has at most ``max_segments`` documents and no nonzero id
    occurs in two runs (which the ragged layout would split into two
    documents that cannot see each other, unlike the segment mask).
  """
  if max_segments < 1:
    raise ValueError(f"max_segments must be >= 1, got {max_segments}.")
  ids, start, one_run_each = _document_runs(segment_ids)
  b, s = ids.shape
  m = max_segments
  count = jnp.sum(start, axis=1)
  fits = one_run_each & jnp.all(count <= m)

  seg = jnp.cumsum(start, axis=1) - 1            # document index of each token
  rows = jnp.arange(b)[:, None]
  # Out-of-range slots (m + 1) are dropped by the scatters.
  start_slot = jnp.where(start & (seg < m), seg, m + 1)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  offsets = jnp.full((b, m + 1), -1, jnp.int32).at[rows, start_slot].set(pos, mode="drop")
  token_slot = jnp.where((ids != 0) & (seg < m), seg, m + 1)
  seqlens = jnp.zeros((b, m), jnp.int32).at[rows, token_slot].add(1, mode="drop")
  seqlens = jnp.where(seqlens > 0, seqlens, -1)
  return seqlens, offsets, fits


@functools.lru_cache(maxsize=None)
def _cudnn_module():
  """jax's cuDNN attention wrapper when it takes packed offsets, else None."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  try:
    params = inspect.signature(fa.dot_product_attention).parameters
  except (AttributeError, TypeError, ValueError):
    return None
  if not {"q_offsets", "kv_offsets", "q_seqlen", "kv_seqlen", "mask_type"} <= set(params):
    return None
  return fa


@functools.lru_cache(maxsize=None)
def _unavailable_reason() -> str:
  """Why packed cuDNN attention cannot run here ('' when it can)."""
  if jax.default_backend() != "gpu":
    return f"backend is {jax.default_backend()}, not gpu"
  fa = _cudnn_module()
  if fa is None:
    return ("this jax has no cuDNN attention wrapper with q_offsets "
            "(jax._src.cudnn.fused_attention_stablehlo)")
  try:
    version = fa.check_cudnn_version()
  except Exception as e:  # pylint: disable=broad-except
    return f"cuDNN version check failed: {e}"
  if version < _MIN_CUDNN:
    return f"cuDNN {version} < {_MIN_CUDNN}"
  try:
    major = int(str(jax.devices()[0].compute_capability).split(".", maxsplit=1)[0])
  except (AttributeError, ValueError):
    return "unknown GPU compute capability"
  if major < 9:
    return f"compute capability {major}.x < 9.0 (cuDNN packs sequences on Hopper+)"
  return ""


def packed_cudnn_available() -> bool:
  """True when ``packed_self_attention`` can run here (GPU, jax and cuDNN)."""
  return not _unavailable_reason()


@functools.lru_cache(maxsize=None)
def _log_unavailable(reason: str):
  logging.getLogger("te_jax").warning(
      "te_jax: packed attention (segment_ids) cannot use cuDNN's packed layout: %s; "
      "it runs as attention under a segment mask instead.", reason)


def log_if_unavailable() -> bool:
  """Warns once (logger ``te_jax``) when the packed cuDNN path is missing."""
  reason = _unavailable_reason()
  if reason:
    _log_unavailable(reason)
  return not reason


def _gradient_only_where(keep: jax.Array, x: jax.Array) -> jax.Array:
  """``x`` unchanged; its gradient zeroed where ``keep`` is False.

  cuDNN's packed layout does not specify dq/dk/dv at positions outside every
  document (padding; jax's own tests mask them before comparing); this makes
  them 0, so no garbage reaches the projections' weight gradients.
  """
  keep = keep[:, :, None, None]
  return jnp.where(keep, x, lax.stop_gradient(x))


def _cudnn_packed(q, k, v, seqlens, offsets, valid, *, is_causal, scale):
  """cuDNN flash attention over the documents ``segment_layout`` found.

  Exact only where ``fits``; the output at padding queries is undefined.
  """
  fa = _cudnn_module()
  q, k, v = (_gradient_only_where(valid, t) for t in (q, k, v))
  mask_type = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
  return fa.dot_product_attention(
      q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
      kv_offsets=offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH")


def _cudnn_masked(q, k, v, segment_ids, *, is_causal, scale):
  """cuDNN attention under the segment mask, as a (B, 1, S, S) bias."""
  same = segment_attention_mask(segment_ids, segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=same, scale=scale,
                                      is_causal=is_causal, implementation="cudnn")


def packed_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          segment_ids: jax.Array, *, is_causal: bool,
                          max_segments: int, scale: float,
                          zero_padding_queries: bool = True) -> jax.Array:
  """Self attention of packed rows in cuDNN: tokens see only their document.

  Args:
    q: (B, S, heads, D) queries, bfloat16 or float16.
    k, v: (B, S, groups, D) keys and values (groups divides heads).
    segment_ids: (B, S) integer document ids, 0 = padding.
    is_causal: causal inside each document.
    max_segments: documents per row the packed layout has room for; a batch
      with more (or with an id in two runs) takes the masked fallback.
    scale: logit scale, usually ``D ** -0.5``.
    zero_padding_queries: write 0 at padding queries (default). False
      leaves them undefined, for a caller that zeroes them itself: each
      such ``where`` is one more pass over the output in the backward.

  Returns:
    (B, S, heads, D) attention output, 0 at padding queries.
  """
  if not packed_cudnn_available():
    raise RuntimeError("packed cuDNN attention is not available here: "
                       f"{_unavailable_reason()}")
  seqlens, offsets, fits = segment_layout(segment_ids, max_segments)
  valid = segment_ids != 0
  out = lax.cond(
      fits,
      functools.partial(_cudnn_packed, seqlens=seqlens, offsets=offsets, valid=valid,
                        is_causal=is_causal, scale=scale),
      functools.partial(_cudnn_masked, segment_ids=segment_ids, is_causal=is_causal,
                        scale=scale),
      q, k, v)
  if not zero_padding_queries:
    return out
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


def document_spans_fit(segment_ids: jax.Array, window: int) -> jax.Array:
  """() bool: every document of every row is one run of at most ``window`` tokens.

  A document is the tokens of one nonzero id; padding (0) is not counted.
  An id that occurs in two runs of a row fails the check (its first and
  last token may lie further apart than the runs' lengths say).

  Args:
    segment_ids: (B, S) integer segment ids.
    window: Python int >= 1.
  """
  ids, start, one_run_each = _document_runs(segment_ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  run_start = lax.cummax(jnp.where(start, pos, 0), axis=1)
  run_length = jnp.where(ids != 0, pos - run_start + 1, 0)
  return one_run_each & jnp.all(run_length <= window)


def banded_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          segment_ids: jax.Array, *, window: int, scale: float,
                          implementation: str, zero_padding_queries: bool = True) -> jax.Array:
  """Causal self attention of packed rows whose documents are short: only a band.

  When every document spans at most ``window`` tokens (checked on the device,
  :func:`document_spans_fit`), no query can see a key more than
  ``window - 1`` positions back, so causal attention under the segment mask
  equals the same attention restricted to that band (a left sliding window:
  ``local_window_size=(window - 1, 0)``), which cuDNN computes tile by tile
  and skips everything outside: about S * window instead of S**2 / 2 logits
  per head. A batch with a longer document (or an id in two runs) runs the
  full causal attention under the segment mask instead: the same answer,
  slower.

  Args:
    q: (B, S, heads, D) queries.
    k, v: (B, S, groups, D) keys and values (groups divides heads).
    segment_ids: (B, S) integer document ids, 0 = padding.
    window: Python int >= 1, the longest document the band serves.
    scale: logit scale, usually ``D ** -0.5``.
    implementation: "cudnn" or "xla" (``jax.nn.dot_product_attention``'s).
    zero_padding_queries: write 0 at padding queries (default); False
      leaves them as computed, as in ``packed_self_attention``.

  Returns:
    (B, S, heads, D) attention output, 0 at padding queries.
  """
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"window must be an int >= 1, got {window!r}.")
  def attend(q, k, v, **band):
    # The mask is made here, in each branch of the cond below, where XLA
    # fuses it into the bias cuDNN's wrapper makes of it; a (B, 1, S, S)
    # boolean operand of the cond would be written once and read by every
    # bias (48 a step in the Llama preset, 128 MiB each).
    same = segment_attention_mask(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=same, scale=scale, is_causal=True,
                                        implementation=implementation, **band)
  if window >= q.shape[1]:      # the band is the whole causal triangle
    out = attend(q, k, v)
  else:
    out = lax.cond(document_spans_fit(segment_ids, window),
                   lambda q, k, v: attend(q, k, v, local_window_size=(window - 1, 0)),
                   attend, q, k, v)
  if not zero_padding_queries:
    return out
  return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
