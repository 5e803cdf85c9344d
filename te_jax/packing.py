"""Sequence packing and token-count padding for FP8 training.

In JAX every shape is static, so te_jax makes the token dimension regular by
construction (see docs/design.md): the input pipeline packs variable-length
documents into fixed ``(num_rows, seq_len)`` buffers, and the token dimension
is padded so that every shard's share is a multiple of the FP8 scaling block.
Every device then runs the same shapes and the same collectives.

Conventions of a packed batch (all ``int32``, shape ``(num_rows, seq_len)``):

* ``tokens``: token ids, ``pad_id`` on padding.
* ``segment_ids``: ``1, 2, 3, ...`` for the documents of a row, in the order
  they sit in the row; ``0`` marks padding (and only padding).
* ``positions``: ``0, 1, 2, ...`` restarting at every document; ``0`` on padding.

Packing runs on the host in numpy; the loss helpers (:func:`segment_mask`,
:func:`masked_mean`, :func:`next_token_targets`) accept numpy or jax arrays.

Example: four documents into rows of 6 tokens, padded for 2 shards with a
4-token block (real runs use e.g. ``seq_len=2048, block=128``); ``loss``
stands in for a model's per-token loss:

  >>> import numpy as np
  >>> from te_jax import packing
  >>> docs = [[11, 12, 13], [21, 22], [31, 32, 33, 34, 35], [41]]
  >>> tokens, seg, pos = packing.pack_sequences(docs, seq_len=6)
  >>> tokens.tolist(), seg.tolist()
  ([[31, 32, 33, 34, 35, 41], [11, 12, 13, 21, 22, 0]],
   [[1, 1, 1, 1, 1, 2], [1, 1, 1, 2, 2, 0]])
  >>> pos.tolist()
  [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
  >>> tokens, seg, pos = packing.pad_batch(tokens, seg, pos, block=4, num_shards=2)
  >>> tokens.shape  # 2 rows per shard: 12 tokens, a multiple of 4
  (4, 6)
  >>> targets, loss_mask = packing.next_token_targets(tokens, seg)
  >>> targets[:2].tolist(), loss_mask[:2].astype(int).tolist()
  ([[32, 33, 34, 35, 0, 0], [12, 13, 0, 22, 0, 0]],
   [[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0]])
  >>> loss = np.arange(24.0).reshape(4, 6)
  >>> float(packing.masked_mean(loss, mask=loss_mask))  # (0+1+2+3 + 6+7+9) / 7
  4.0
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["pack_sequences", "padded_token_count", "pad_batch",
           "segment_mask", "documents_per_row", "masked_mean", "next_token_targets"]

_STRATEGIES = ("first_fit", "best_fit")
_SPLIT_LONG = ("chunk", "error")
_I32 = np.iinfo(np.int32)


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


def _as_documents(sequences) -> list[np.ndarray]:
  """Converts and validates the documents; empty ones are dropped here."""
  if isinstance(sequences, np.ndarray) and sequences.ndim == 1:
    # A flat array is almost always one document passed without its list.
    raise TypeError(
        "sequences must be a list of 1-D token sequences, got a 1-D array; "
        "wrap a single document as [doc].")
  docs = []
  for i, seq in enumerate(sequences):
    arr = np.asarray(seq)
    if arr.ndim != 1:
      raise TypeError(
          f"sequences[{i}] must be a 1-D sequence of token ids, got shape "
          f"{arr.shape}; pass a list of documents, e.g. [[1, 2], [3]].")
    if arr.size == 0:
      continue  # Empty documents carry nothing to train on: skip them.
    if arr.dtype.kind not in "iu":  # cheaper than np.issubdtype per document
      raise TypeError(
          f"sequences[{i}] must hold integer token ids, got dtype {arr.dtype}; "
          "convert it with np.asarray(doc, dtype=np.int32).")
    # Narrow dtypes cannot overflow int32, so only wide ones pay for min/max.
    if arr.dtype.itemsize >= 4 and arr.dtype != np.int32:
      lo, hi = int(arr.min()), int(arr.max())
      if lo < _I32.min or hi > _I32.max:
        raise ValueError(
            f"sequences[{i}] holds token ids outside int32 range ({lo}..{hi}).")
    docs.append(arr)
  return docs


def _first_fit(lengths: list[int], seq_len: int, num_big: int, max_bins: int):
  """First-fit over a max segment tree of remaining capacities, O(log bins).

  Unopened bins are leaves with full capacity, so "leftmost leaf that fits"
  opens a new bin exactly when no open bin fits, and open bins form a prefix.
  """
  size = 1 << max(max_bins - 1, 0).bit_length()
  leaves = np.full(size, seq_len, dtype=np.int64)
  # Items longer than seq_len/2 cannot share a bin: each opened its own.
  leaves[:num_big] = seq_len - np.asarray(lengths[:num_big], dtype=np.int64)
  levels = [leaves]
  while levels[-1].size > 1:
    levels.append(levels[-1].reshape(-1, 2).max(axis=1))
  tree = [0]
  for level in reversed(levels):  # heap layout: root at 1, leaves at size..
    tree.extend(level.tolist())
  bins = list(range(num_big))
  cols = [0] * num_big
  for length in lengths[num_big:]:
    i = 1
    while i < size:  # descend to the leftmost leaf whose capacity fits
      i <<= 1
      if tree[i] < length:
        i += 1
    cap = tree[i]
    tree[i] = cap - length
    bins.append(i - size)
    cols.append(seq_len - cap)
    i >>= 1
    while i:  # refresh the maxima above; stop once one is unchanged
      a, b = tree[2 * i], tree[2 * i + 1]
      m = a if a > b else b
      if tree[i] == m:
        break
      tree[i] = m
      i >>= 1
  return bins, cols


def _best_fit(lengths: list[int], seq_len: int, num_big: int):
  """Best-fit via buckets of bins by remaining capacity.

  Bit c of the Python int ``mask`` says "some open bin has capacity c"; bit
  ``seq_len`` stands for a fresh bin and is always set. The tightest bin that
  fits is then the lowest set bit at or above the item length.
  """
  buckets: dict[int, list[int]] = {}
  mask = 1 << seq_len
  bins = list(range(num_big))
  cols = [0] * num_big
  for b, length in enumerate(lengths[:num_big]):
    cap = seq_len - length
    if cap:
      buckets.setdefault(cap, []).append(b)
      mask |= 1 << cap
  num_bins = num_big
  for length in lengths[num_big:]:
    m = mask >> length
    cap = length + (m & -m).bit_length() - 1
    if cap == seq_len:
      b = num_bins
      num_bins += 1
    else:
      stack = buckets[cap]
      b = stack.pop()
      if not stack:
        del buckets[cap]
        mask ^= 1 << cap
    bins.append(b)
    cols.append(seq_len - cap)
    left = cap - length
    if left:
      stack = buckets.get(left)
      if stack is None:
        buckets[left] = [b]
        mask |= 1 << left
      else:
        stack.append(b)
  return bins, cols


def pack_sequences(
    sequences: Iterable[Sequence[int] | np.ndarray],
    seq_len: int,
    *,
    num_rows: int | None = None,
    strategy: str = "first_fit",
    pad_id: int = 0,
    split_long: str = "chunk",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Packs variable-length documents into fixed-length rows.

  Documents are placed largest first, each into the first row with room
  (``"first_fit"``, first-fit-decreasing) or the fullest row with room
  (``"best_fit"``, best-fit-decreasing). A document is never split to fill a
  gap; its tokens stay contiguous and in order within its segment.

  Documents longer than ``seq_len``: with ``split_long="chunk"`` they are cut
  into consecutive chunks of ``seq_len`` tokens plus a shorter last chunk, and
  each chunk is packed as a document of its own: it gets its own segment id
  and its positions restart at 0, so attention and next-token targets never
  cross from one chunk to the next. With ``split_long="error"`` they raise.

  Args:
    sequences: iterable of documents, each a list or 1-D array of integer
      token ids (any int dtype; values must fit int32). Empty ones are skipped.
    seq_len: tokens per row, a positive int.
    num_rows: if given, the output has exactly this many rows (extra rows are
      all padding); raises ValueError if the documents need more. If None,
      as many rows as the packing needs (0 for no tokens).
    strategy: ``"first_fit"`` or ``"best_fit"``.
    pad_id: token id written on padding.
    split_long: ``"chunk"`` or ``"error"``, see above.

  Returns:
    ``(tokens, segment_ids, positions)``, int32 numpy arrays of shape
    ``(num_rows, seq_len)``. ``segment_ids`` is 1, 2, ... per document within
    a row and 0 exactly on padding; ``positions`` restart at 0 per document
    and are 0 on padding.

  Example:
    >>> tok, seg, pos = pack_sequences([[1, 2, 3], [4, 5], [6]], seq_len=4)
    >>> tok.tolist(), seg.tolist(), pos.tolist()
    ([[1, 2, 3, 6], [4, 5, 0, 0]], [[1, 1, 1, 2], [1, 1, 0, 0]], [[0, 1, 2, 0], [0, 1, 0, 0]])
  """
  seq_len = _check_int("seq_len", seq_len, 1)
  if num_rows is not None:
    num_rows = _check_int("num_rows", num_rows, 0)
  pad_id = _check_int("pad_id", pad_id, _I32.min)
  if pad_id > _I32.max:
    raise ValueError(f"pad_id must fit int32, got {pad_id}.")
  if strategy not in _STRATEGIES:
    raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}.")
  if split_long not in _SPLIT_LONG:
    raise ValueError(f"split_long must be one of {_SPLIT_LONG}, got {split_long!r}.")

  docs = _as_documents(sequences)
  doc_len = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
  if split_long == "error" and doc_len.size and doc_len.max() > seq_len:
    i = int(np.argmax(doc_len > seq_len))
    raise ValueError(
        f"a document of {doc_len[i]} tokens is longer than seq_len={seq_len}; "
        "pass split_long='chunk' to cut it into seq_len-sized chunks, or raise seq_len.")

  # Pieces = documents cut into chunks of at most seq_len, in input order.
  n_chunks = -(-doc_len // seq_len)
  piece_doc = np.repeat(np.arange(len(docs)), n_chunks)
  first = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
  piece_start = (np.arange(piece_doc.size) - first) * seq_len
  piece_len = np.minimum(seq_len, doc_len[piece_doc] - piece_start)

  # Largest first; a stable sort keeps equal lengths in input order.
  order = np.argsort(-piece_len, kind="stable")
  lengths = piece_len[order].tolist()
  num_big = int(np.count_nonzero(2 * piece_len > seq_len))
  total = int(doc_len.sum())
  if strategy == "first_fit":
    # Any-fit packings leave every pair of rows holding > seq_len tokens, so
    # they use fewer than 2 * total / seq_len + 1 rows.
    max_bins = max(1, min(len(lengths), 2 * (-(-total // seq_len)) + 1))
    bins, cols = _first_fit(lengths, seq_len, num_big, max_bins)
  else:
    bins, cols = _best_fit(lengths, seq_len, num_big)
  needed = max(bins) + 1 if bins else 0
  if num_rows is None:
    num_rows = needed
  elif needed > num_rows:
    raise ValueError(
        f"the documents ({total} tokens) need {needed} rows of seq_len={seq_len} "
        f"with strategy={strategy!r}, but num_rows={num_rows}; raise num_rows "
        "or pass num_rows=None.")

  tokens = np.full((num_rows, seq_len), pad_id, dtype=np.int32)
  segment_ids = np.zeros((num_rows, seq_len), dtype=np.int32)
  positions = np.zeros((num_rows, seq_len), dtype=np.int32)
  # Visit pieces in output order (row, then column) so the writes stream
  # through memory; in that order a row's segment ids are just 1, 2, 3, ...
  rows_a, cols_a = np.asarray(bins, dtype=np.int64), np.asarray(cols, dtype=np.int64)
  by_pos = np.lexsort((cols_a, rows_a))
  rows_a = rows_a[by_pos]
  seg = np.arange(rows_a.size) - np.searchsorted(rows_a, rows_a, side="left") + 1
  offsets = (rows_a * seq_len + cols_a[by_pos]).tolist()
  src = order[by_pos]
  ramp = np.arange(seq_len, dtype=np.int32)
  # Flat 1-D views slice faster than 2-D (row, slice) indexing. One iteration
  # per piece, never per token: each line is a C-speed slice copy.
  flat_t, flat_s, flat_p = tokens.reshape(-1), segment_ids.reshape(-1), positions.reshape(-1)
  for o, n, d, s, k in zip(offsets, piece_len[src].tolist(), piece_doc[src].tolist(),
                           piece_start[src].tolist(), seg.tolist()):
    e = o + n
    flat_t[o:e] = docs[d][s:s + n]
    flat_s[o:e] = k
    flat_p[o:e] = ramp[:n]
  return tokens, segment_ids, positions


def padded_token_count(num_tokens: int, *, block: int = 128, num_shards: int = 1) -> int:
  """Smallest token count >= ``num_tokens`` that splits into aligned shards.

  The result is a multiple of ``block * num_shards``, so each of the
  ``num_shards`` equal shares is a multiple of ``block``: FP8 scaling tiles
  (128 for the blockwise recipe, 16 for per-tensor GEMM alignment) are never
  split across devices and every device gets the same shape.

  Args:
    num_tokens: token count, int >= 0.
    block: alignment of each shard's share, int >= 1.
    num_shards: number of devices the token dimension is split over, int >= 1.

  Returns:
    An int ``n`` with ``n >= num_tokens`` and ``n % (block * num_shards) == 0``.

  Example:
    >>> padded_token_count(1000, block=128, num_shards=2)
    1024
    >>> padded_token_count(1030, block=128, num_shards=2)
    1280
  """
  num_tokens = _check_int("num_tokens", num_tokens, 0)
  block = _check_int("block", block, 1)
  num_shards = _check_int("num_shards", num_shards, 1)
  step = block * num_shards
  return -(-num_tokens // step) * step


def pad_batch(tokens, segment_ids, positions, *, block: int = 128,
              num_shards: int = 1, axis: int = 0, pad_id: int = 0):
  """Pads a packed batch so each shard's token count is a multiple of ``block``.

  A packed batch is ``(rows, seq_len)``; the tokens a shard feeds to its GEMMs
  are the flattened ``rows_per_shard * seq_len`` (batch sharding) or the
  ``seq_len / num_shards`` slice of every row (sequence sharding), so:

  * ``axis=0`` (data/FSDP sharding of rows): appends the fewest all-padding
    rows so that rows divide evenly into ``num_shards`` and
    ``rows_per_shard * seq_len`` is a multiple of ``block``. ``seq_len`` (the
    attention shape) is unchanged. Pick ``seq_len`` a multiple of ``block``
    and this only rounds rows up to ``num_shards``; an odd ``seq_len`` can
    need up to ``block`` rows per shard.
  * ``axis=1`` (sequence/context parallelism): pads every row on the right to
    ``padded_token_count(seq_len, block=block, num_shards=num_shards)``.

  Padding has token ``pad_id``, segment id 0 and position 0, so masks and
  losses built from ``segment_ids`` ignore it. Numpy inputs give numpy
  outputs; jax inputs give jax outputs (shapes are static, so this also works
  under ``jit``).

  Args:
    tokens, segment_ids, positions: arrays of shape ``(rows, seq_len)``.
    block: per-shard alignment (128 blockwise FP8, 16 per-tensor FP8).
    num_shards: devices the padded axis is split over.
    axis: 0 to pad rows, 1 to pad the sequence dimension.
    pad_id: token id written on padding.

  Returns:
    ``(tokens, segment_ids, positions)`` padded along ``axis``.

  Example:
    >>> t, s, p = pack_sequences([[1, 2, 3]], seq_len=96)
    >>> pad_batch(t, s, p, block=128, num_shards=2)[0].shape  # 4 rows/shard = 3 * 128
    (8, 96)
  """
  block = _check_int("block", block, 1)
  num_shards = _check_int("num_shards", num_shards, 1)
  if axis not in (0, 1):
    raise ValueError(f"axis must be 0 (rows) or 1 (sequence), got {axis!r}.")
  arrays = (tokens, segment_ids, positions)
  shapes = {tuple(np.shape(a)) for a in arrays}
  if len(shapes) != 1 or len(next(iter(shapes))) != 2:
    raise ValueError(
        "tokens, segment_ids and positions must share one (rows, seq_len) "
        f"shape, got {[np.shape(a) for a in arrays]}.")
  rows, seq_len = next(iter(shapes))
  if axis == 0:
    # rows_per_shard must be a multiple of block / gcd(block, seq_len).
    step = num_shards * (block // math.gcd(block, seq_len))
    extra = -(-rows // step) * step - rows
  else:
    extra = padded_token_count(seq_len, block=block, num_shards=num_shards) - seq_len
  xp = _xp(*arrays)
  widths = [(0, 0), (0, 0)]
  widths[axis] = (0, extra)
  return tuple(
      xp.pad(xp.asarray(a), widths, constant_values=v)
      for a, v in zip(arrays, (pad_id, 0, 0)))


def _xp(*arrays):
  """jax.numpy if any input is a jax array (or tracer), else numpy."""
  return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def segment_mask(segment_ids):
  """Boolean mask, True on real tokens and False on padding (segment id 0).

  Example:
    >>> segment_mask(np.array([[1, 1, 2, 0]])).tolist()
    [[True, True, True, False]]
  """
  return _xp(segment_ids).asarray(segment_ids) != 0


def documents_per_row(segment_ids):
  """Number of documents (runs of one nonzero segment id) in each row.

  Packed attention in cuDNN's layout needs room for the fullest row:
  size ``MultiHeadAttention.max_segments_per_seq`` /
  ``TransformerLayer.max_segments_per_seq`` from batches like yours.

  Example:
    >>> documents_per_row(np.array([[1, 1, 2, 0], [1, 1, 1, 1]])).tolist()
    [2, 1]
  """
  xp = _xp(segment_ids)
  ids = xp.asarray(segment_ids)
  if ids.ndim != 2:
    raise ValueError(f"segment_ids must be (rows, seq_len), got shape {ids.shape}.")
  prev = xp.concatenate([xp.zeros_like(ids[:, :1]), ids[:, :-1]], axis=1)
  return xp.sum((ids != 0) & (ids != prev), axis=1)


def masked_mean(values, segment_ids=None, *, mask=None):
  """Mean of ``values`` over real tokens only.

  Give either ``segment_ids`` (padding = id 0) or a boolean ``mask`` such as
  the ``loss_mask`` of :func:`next_token_targets`. The sum is taken in at
  least float32; an all-padding batch gives 0 rather than NaN.

  Args:
    values: per-token values, e.g. losses, shape ``(rows, seq_len)``.
    segment_ids: int array of the same shape, or None when ``mask`` is given.
    mask: bool array of the same shape, True where the value counts.

  Returns:
    A scalar (numpy for numpy inputs, jax for jax inputs).

  Example:
    >>> float(masked_mean(np.array([[1., 3., 100.]]), np.array([[1, 2, 0]])))
    2.0
  """
  if (segment_ids is None) == (mask is None):
    raise ValueError("masked_mean needs exactly one of segment_ids or mask.")
  where = mask if mask is not None else segment_mask(segment_ids)
  xp = _xp(values, where)
  values, where = xp.asarray(values), xp.asarray(where)
  if values.shape != where.shape:
    raise ValueError(
        f"values shape {values.shape} must equal the mask/segment_ids shape {where.shape}.")
  dtype = xp.promote_types(values.dtype, xp.float32)
  where = where.astype(bool)
  total = xp.sum(xp.where(where, values.astype(dtype), 0))
  count = xp.sum(where).astype(dtype)
  return total / xp.maximum(count, 1)


def next_token_targets(tokens, segment_ids):
  """Next-token targets and loss mask that never cross a document boundary.

  ``targets[:, t] = tokens[:, t + 1]``; ``loss_mask[:, t]`` is True only when
  tokens ``t`` and ``t + 1`` are real and in the same segment. So the last
  token of every document (or chunk), the last column, and padding are masked,
  and their targets are set to 0 (a valid id, safe to embed or one-hot).

  Args:
    tokens: int array ``(rows, seq_len)``.
    segment_ids: int array ``(rows, seq_len)``, 0 on padding.

  Returns:
    ``(targets, loss_mask)``: int array like ``tokens`` and bool array.

  Example:
    >>> t, m = next_token_targets(np.array([[5, 6, 7, 8]]), np.array([[1, 1, 2, 2]]))
    >>> t.tolist(), m.tolist()
    ([[6, 0, 8, 0]], [[True, False, True, False]])
  """
  xp = _xp(tokens, segment_ids)
  tokens, segment_ids = xp.asarray(tokens), xp.asarray(segment_ids)
  if tokens.shape != segment_ids.shape or tokens.ndim != 2:
    raise ValueError(
        "tokens and segment_ids must share one (rows, seq_len) shape, got "
        f"{tokens.shape} and {segment_ids.shape}.")
  zeros = xp.zeros_like(segment_ids[:, :1])
  next_seg = xp.concatenate([segment_ids[:, 1:], zeros], axis=1)
  next_tok = xp.concatenate([tokens[:, 1:], xp.zeros_like(tokens[:, :1])], axis=1)
  loss_mask = (segment_ids != 0) & (next_seg == segment_ids)
  targets = xp.where(loss_mask, next_tok, xp.zeros_like(next_tok))
  return targets, loss_mask
