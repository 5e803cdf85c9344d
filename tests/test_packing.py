"""Tests of te_jax.packing (CPU, host-side numpy plus a few jax paths)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import packing


def _pieces(docs, seq_len):
  """The documents as pack_sequences must lay them out: chunks of <= seq_len."""
  out = []
  for d in docs:
    d = list(np.asarray(d).tolist())
    out.extend(tuple(d[i:i + seq_len]) for i in range(0, len(d), seq_len))
  return out


def _check_packed(docs, seq_len, tok, seg, pos, pad_id=0):
  """Checks every invariant of a packed batch; returns the number of rows."""
  for a in (tok, seg, pos):
    assert isinstance(a, np.ndarray) and a.dtype == np.int32
    assert a.ndim == 2 and a.shape == tok.shape and a.shape[1] == seq_len
  pad = seg == 0
  assert np.all(tok[pad] == pad_id) and np.all(pos[pad] == 0)
  found = []
  for r in range(tok.shape[0]):
    s = seg[r]
    n_real = int(np.count_nonzero(s))
    # Real tokens first, padding only at the end of the row.
    assert np.all(s[:n_real] != 0) and np.all(s[n_real:] == 0)
    if n_real == 0:
      continue
    starts = [0] + [t for t in range(1, n_real) if s[t] != s[t - 1]]
    ends = starts[1:] + [n_real]
    # Segment ids are 1, 2, 3, ... left to right.
    assert [int(s[a]) for a in starts] == list(range(1, len(starts) + 1))
    for a, b in zip(starts, ends):
      np.testing.assert_array_equal(pos[r, a:b], np.arange(b - a))
      found.append(tuple(tok[r, a:b].tolist()))
  # Every document (chunk) appears exactly once, its tokens in order.
  assert sorted(found) == sorted(_pieces(docs, seq_len))
  return tok.shape[0]


def _random_docs(rng, n, max_len, vocab=1000):
  return [rng.integers(0, vocab, rng.integers(1, max_len + 1)).tolist() for _ in range(n)]


def _naive_fill(lengths, seq_len, strategy):
  """O(docs * rows) reference FFD / BFD; returns the sorted row fills."""
  caps = []
  for n in sorted(lengths, reverse=True):
    fits = [i for i, c in enumerate(caps) if c >= n]
    if not fits:
      caps.append(seq_len - n)
      continue
    i = fits[0] if strategy == "first_fit" else min(fits, key=lambda j: caps[j])
    caps[i] -= n
  return sorted(seq_len - c for c in caps)


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_random_roundtrip_and_matches_naive(strategy):
  rng = np.random.default_rng(0)
  seq_len = 64
  docs = _random_docs(rng, 300, 150)  # some longer than seq_len: chunked
  tok, seg, pos = packing.pack_sequences(docs, seq_len, strategy=strategy)
  _check_packed(docs, seq_len, tok, seg, pos)
  fills = sorted(np.count_nonzero(seg, axis=1).tolist())
  assert fills == _naive_fill([len(p) for p in _pieces(docs, seq_len)], seq_len, strategy)


def test_array_inputs_and_dtypes():
  docs = [np.array([3, 4, 5], np.uint16), np.array([7], np.int64), [1, 2], (9, 9, 9, 9)]
  tok, seg, pos = packing.pack_sequences(docs, 5, pad_id=-1)
  _check_packed(docs, 5, tok, seg, pos, pad_id=-1)
  assert tok.shape == (2, 5)


def test_docstring_example_layout():
  tok, seg, pos = packing.pack_sequences([[1, 2, 3], [4, 5], [6]], seq_len=4)
  assert tok.tolist() == [[1, 2, 3, 6], [4, 5, 0, 0]]
  assert seg.tolist() == [[1, 1, 1, 2], [1, 1, 0, 0]]
  assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]


def test_empty_inputs():
  for docs in ([], [[], np.array([], np.int32)]):
    tok, seg, pos = packing.pack_sequences(docs, 8)
    assert tok.shape == seg.shape == pos.shape == (0, 8)
  tok, seg, pos = packing.pack_sequences([], 8, num_rows=3, pad_id=5)
  assert tok.shape == (3, 8) and np.all(tok == 5) and not seg.any() and not pos.any()
  # Empty documents in between are skipped, not given a segment.
  tok, seg, pos = packing.pack_sequences([[1, 2], [], [3]], 4)
  assert seg.tolist() == [[1, 1, 2, 0]] and tok.tolist() == [[1, 2, 3, 0]]


def test_long_document_is_chunked():
  doc = list(range(1, 11))  # 10 tokens, seq_len 4 -> chunks of 4, 4, 2
  tok, seg, pos = packing.pack_sequences([doc], 4)
  _check_packed([doc], 4, tok, seg, pos)
  assert tok.shape == (3, 4)
  chunks = sorted(tuple(r[s != 0].tolist()) for r, s in zip(tok, seg))
  assert chunks == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10)]
  # Positions restart at 0 in every chunk.
  assert sorted(p[s != 0].tolist() for p, s in zip(pos, seg)) == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]
  with pytest.raises(ValueError, match="split_long"):
    packing.pack_sequences([[1, 2], doc], 4, split_long="error")
  # Exactly seq_len is not "long".
  tok, _, _ = packing.pack_sequences([[1, 2, 3, 4]], 4, split_long="error")
  assert tok.tolist() == [[1, 2, 3, 4]]


def test_all_length_one():
  docs = [[i] for i in range(1, 11)]
  tok, seg, pos = packing.pack_sequences(docs, 4)
  _check_packed(docs, 4, tok, seg, pos)
  assert tok.shape == (3, 4)
  assert seg.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 0, 0]]
  assert not pos.any()


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_exact_fits_leave_no_padding(strategy):
  docs = [[1] * 5, [2] * 3, [3] * 8, [4] * 2, [5] * 6, [6] * 4, [7] * 4]
  tok, seg, pos = packing.pack_sequences(docs, 8, strategy=strategy)
  _check_packed(docs, 8, tok, seg, pos)
  assert tok.shape == (4, 8) and np.all(seg != 0)


def test_num_rows():
  docs = [[1] * 3, [2] * 3, [3] * 3]
  tok, seg, pos = packing.pack_sequences(docs, 4, num_rows=5)
  _check_packed(docs, 4, tok, seg, pos)
  assert tok.shape == (5, 4) and not seg[3:].any()
  with pytest.raises(ValueError, match=r"need 3 rows.*num_rows=2"):
    packing.pack_sequences(docs, 4, num_rows=2)


def test_best_fit_vs_first_fit_and_bounds():
  rng = np.random.default_rng(1)
  seq_len = 256
  lens = rng.integers(1, seq_len + 1, 2000)
  docs = [np.full(n, 1, np.int32) for n in lens]
  lower = -(-int(lens.sum()) // seq_len)
  rows = {}
  for strategy in ("first_fit", "best_fit"):
    tok, seg, _ = packing.pack_sequences(docs, seq_len, strategy=strategy)
    rows[strategy] = tok.shape[0]
    assert int(np.count_nonzero(seg)) == int(lens.sum())
    # Any-fit bound (every pair of rows holds > seq_len tokens), and FFD/BFD
    # are near-optimal on uniform random lengths.
    assert lower <= rows[strategy] < 2 * lens.sum() / seq_len + 1
    assert rows[strategy] <= 1.02 * lower + 1
  assert rows["best_fit"] <= rows["first_fit"]


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(seq_len=0), ValueError, "seq_len"),
    (dict(seq_len=2.5), TypeError, "seq_len"),
    (dict(seq_len=4, strategy="next_fit"), ValueError, "strategy"),
    (dict(seq_len=4, split_long="drop"), ValueError, "split_long"),
    (dict(seq_len=4, num_rows=-1), ValueError, "num_rows"),
    (dict(seq_len=4, pad_id=2**40), ValueError, "pad_id"),
])
def test_argument_validation(kwargs, err, match):
  with pytest.raises(err, match=match):
    packing.pack_sequences([[1, 2]], **kwargs)


def test_token_validation():
  with pytest.raises(TypeError, match=r"sequences\[1\].*integer"):
    packing.pack_sequences([[1, 2], [1.5, 2.0]], 4)
  with pytest.raises(TypeError, match=r"sequences\[0\].*1-D"):
    packing.pack_sequences([[[1, 2]]], 4)
  with pytest.raises(TypeError, match=r"\[doc\]"):
    packing.pack_sequences(np.array([1, 2, 3]), 4)
  with pytest.raises(ValueError, match="int32"):
    packing.pack_sequences([[2**40]], 4)


def test_throughput():
  rng = np.random.default_rng(0)
  lens = rng.integers(1, 2049, 10_000)
  docs = [rng.integers(0, 50_000, n, dtype=np.int32) for n in lens]
  t0 = time.perf_counter()
  tok, seg, _ = packing.pack_sequences(docs, 2048)
  dt = time.perf_counter() - t0
  rate = lens.sum() / dt
  print(f"\npack_sequences: {lens.sum() / 1e6:.1f}M tokens, {len(docs)} docs -> "
        f"{tok.shape[0]} rows in {dt:.2f}s = {rate / 1e6:.1f}M tokens/s")
  assert int(np.count_nonzero(seg)) == lens.sum()
  # Measured 3-6e7 tokens/s on a 2-core CPU box; benchmarks/bench_packing.py
  # gives ~4.4e7 for 100k docs (102M tokens) into seq_len 2048.
  assert rate > 1e6


def test_padded_token_count():
  f = packing.padded_token_count
  assert f(0) == 0 and f(1) == 128 and f(128) == 128 and f(129) == 256
  assert f(1000, block=128, num_shards=2) == 1024
  assert f(1030, block=128, num_shards=2) == 1280
  assert f(17, block=16) == 32 and f(100, block=16, num_shards=8) == 128
  for block in (1, 16, 128):
    for shards in (1, 3, 8):
      step = block * shards
      for n in range(0, 3 * step + 2, max(1, step // 7)):
        p = f(n, block=block, num_shards=shards)
        assert p >= n and p % step == 0 and (p // shards) % block == 0
        assert p - step < n  # minimal
  with pytest.raises(ValueError, match="num_tokens"):
    f(-1)
  with pytest.raises(ValueError, match="block"):
    f(10, block=0)
  with pytest.raises(TypeError, match="num_shards"):
    f(10, num_shards=2.0)


@pytest.mark.parametrize("seq_len, rows, block, shards", [
    (96, 1, 128, 2), (2048, 3, 128, 4), (100, 5, 16, 3), (128, 8, 128, 8), (7, 0, 16, 2)])
def test_pad_batch_rows(seq_len, rows, block, shards):
  rng = np.random.default_rng(seq_len)
  docs = _random_docs(rng, rows, seq_len) if rows else []
  tok, seg, pos = packing.pack_sequences(docs, seq_len, num_rows=rows)
  t2, s2, p2 = packing.pad_batch(tok, seg, pos, block=block, num_shards=shards, pad_id=7)
  r2 = t2.shape[0]
  assert t2.shape == s2.shape == p2.shape == (r2, seq_len)
  assert r2 % shards == 0 and (r2 // shards * seq_len) % block == 0
  # Fewest rows: no smaller count >= rows would do.
  assert not any(r % shards == 0 and (r // shards * seq_len) % block == 0
                 for r in range(rows, r2))
  np.testing.assert_array_equal(t2[:rows], tok)
  np.testing.assert_array_equal(s2[:rows], seg)
  np.testing.assert_array_equal(p2[:rows], pos)
  assert np.all(t2[rows:] == 7) and not s2[rows:].any() and not p2[rows:].any()


def test_pad_batch_sequence_axis_and_jax():
  tok, seg, pos = packing.pack_sequences([[1, 2, 3], [4] * 90], 100)
  t2, s2, p2 = packing.pad_batch(tok, seg, pos, block=16, num_shards=4, axis=1)
  assert t2.shape == (1, 128) and isinstance(t2, np.ndarray)
  np.testing.assert_array_equal(t2[:, :100], tok)
  assert not s2[:, 100:].any() and not t2[:, 100:].any() and not p2[:, 100:].any()
  padded = jax.jit(lambda *a: packing.pad_batch(*a, block=128, num_shards=2))(
      jnp.asarray(tok), jnp.asarray(seg), jnp.asarray(pos))
  assert all(isinstance(a, jax.Array) for a in padded)
  assert padded[0].shape == (64, 100)  # 32 rows/shard * 100 tokens = 25 * 128
  np.testing.assert_array_equal(np.asarray(padded[1][:1]), seg)
  with pytest.raises(ValueError, match="axis"):
    packing.pad_batch(tok, seg, pos, axis=2)
  with pytest.raises(ValueError, match="shape"):
    packing.pad_batch(tok, seg[:, :5], pos)


def test_segment_mask():
  seg = np.array([[1, 1, 2, 0], [0, 0, 0, 0]], np.int32)
  expected = [[True, True, True, False], [False] * 4]
  assert packing.segment_mask(seg).tolist() == expected
  assert np.asarray(packing.segment_mask(jnp.asarray(seg))).tolist() == expected


def test_documents_per_row_counts_runs():
  rows = [[1, 1, 0, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3], [0] * 8, [1, 2, 3, 0, 4, 0, 5, 5]]
  np.testing.assert_array_equal(packing.documents_per_row(np.array(rows)), [2, 1, 0, 5])
  got = jax.jit(packing.documents_per_row)(jnp.asarray(rows, jnp.int32))
  np.testing.assert_array_equal(got, [2, 1, 0, 5])
  # what pack_sequences makes: one run per document
  tokens, seg, _ = packing.pack_sequences([np.arange(n) + 1 for n in (5, 3, 7, 2, 6)], 12)
  want = [len(set(r.tolist()) - {0}) for r in seg]
  np.testing.assert_array_equal(packing.documents_per_row(seg), want)
  with pytest.raises(ValueError, match="rows, seq_len"):
    packing.documents_per_row(np.array([1, 2]))


def test_masked_mean_ignores_padding():
  rng = np.random.default_rng(2)
  _, seg, _ = packing.pack_sequences(_random_docs(rng, 40, 30), 32)
  values = rng.normal(size=seg.shape).astype(np.float32)
  values[seg == 0] = 1e6  # would dominate the mean if padding leaked in
  expected = values[seg != 0].astype(np.float64).mean()
  np.testing.assert_allclose(packing.masked_mean(values, seg), expected, atol=1e-6)
  got = jax.jit(packing.masked_mean)(jnp.asarray(values), jnp.asarray(seg))
  assert isinstance(got, jax.Array)
  np.testing.assert_allclose(float(got), expected, atol=1e-6)
  np.testing.assert_allclose(packing.masked_mean(values, mask=seg != 0), expected, atol=1e-6)
  assert float(packing.masked_mean(values, np.zeros_like(seg))) == 0.0
  with pytest.raises(ValueError, match="exactly one"):
    packing.masked_mean(values)
  with pytest.raises(ValueError, match="shape"):
    packing.masked_mean(values, seg[:, :3])


def test_next_token_targets_never_cross_boundaries():
  rng = np.random.default_rng(3)
  docs = _random_docs(rng, 60, 40)
  tok, seg, pos = packing.pack_sequences(docs, 32)
  targets, mask = packing.next_token_targets(tok, seg)
  assert targets.shape == tok.shape and mask.dtype == bool
  assert not mask[:, -1].any()
  rows, cols = np.nonzero(mask)
  # Every kept target is the next token of the same document.
  assert np.all(seg[rows, cols] != 0)
  assert np.all(seg[rows, cols + 1] == seg[rows, cols])
  assert np.all(pos[rows, cols + 1] == pos[rows, cols] + 1)
  np.testing.assert_array_equal(targets[rows, cols], tok[rows, cols + 1])
  assert not targets[~mask].any()
  # Exactly one masked (last) token per document chunk.
  n_pieces = len(_pieces(docs, 32))
  assert int(mask.sum()) == int((seg != 0).sum()) - n_pieces
  jt, jm = packing.next_token_targets(jnp.asarray(tok), jnp.asarray(seg))
  np.testing.assert_array_equal(np.asarray(jt), targets)
  np.testing.assert_array_equal(np.asarray(jm), mask)


def test_next_token_targets_small_example():
  t, m = packing.next_token_targets(np.array([[5, 6, 7, 8, 0]]), np.array([[1, 1, 2, 2, 0]]))
  assert t.tolist() == [[6, 0, 8, 0, 0]]
  assert m.tolist() == [[True, False, True, False, False]]
