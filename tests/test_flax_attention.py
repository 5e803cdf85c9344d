"""te_jax.flax.MultiHeadAttention: reference, masks, packing, GQA, rotary, FP8."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx

from flax_cases import RECIPES, rel
from te_jax.layers import attention as attn_lib

# Q/K/V and output projections are FP8 GEMMs (~3.5 % each, see
# test_flax_dense.py); the softmax can amplify logit errors slightly, so the
# forward bound is 0.1 and the gradient bound 0.2 (E5M2 gradients).
FWD_TOL = 0.1
GRAD_TOL = 0.2
E, H, D = 32, 4, 8


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """These tests check exact identities in float32 (packed == separate,
  RoPE is relative) at 1e-5..1e-4. On a GPU, XLA runs float32 dots in TF32
  by default (10-bit mantissa, ~1e-3 error), so the identities only hold
  there at full float32 precision; on the CPU this changes nothing."""
  with jax.default_matmul_precision("float32"):
    yield


def rand(key, shape):
  """Gaussian test data from numpy (jax.random would compile per shape)."""
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape), jnp.float32)


def reference_self_attention(p, x, causal):
  qkv = jnp.einsum("bse,ethd->bsthd", x, p["qkv"]["kernel"])
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
  if causal:
    s = x.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
  w = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", w, v)
  return jnp.einsum("bqhd,hde->bqe", o, p["out"]["kernel"])


@pytest.mark.parametrize("causal", [True, False])
def test_self_attention_matches_reference(causal):
  x = rand(0, (2, 12, E))
  m = tfx.MultiHeadAttention(H, attn_mask_type="causal" if causal else "no_mask")
  v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
  ref = reference_self_attention(v["params"], x, causal)
  np.testing.assert_allclose(jax.jit(m.apply)(v, x), ref, rtol=1e-5, atol=1e-5)


def test_every_param_has_logical_names():
  x = rand(0, (2, 8, E)); enc = rand(1, (2, 5, 16))
  for m, args in [(tfx.MultiHeadAttention(H, use_bias=True), (x,)),
                  (tfx.MultiHeadAttention(H, num_gqa_groups=2, use_bias=True), (x, enc))]:
    boxed = jax.eval_shape(m.init, jax.random.key(0), *args)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda l: isinstance(l, nn.Partitioned))
    assert len(leaves) >= 4
    for leaf in leaves:
      assert isinstance(leaf, nn.LogicallyPartitioned), leaf
      assert len(leaf.names) == len(leaf.value.shape) and None not in leaf.names


def test_causal_mask_blocks_future():
  x = rand(0, (1, 10, E))
  m = tfx.MultiHeadAttention(H, attn_mask_type="causal")
  v = jax.jit(m.init)(jax.random.key(1), x)
  f = jax.jit(m.apply)
  x2 = x.at[:, 6:].set(rand(5, (1, 4, E)))
  y1, y2 = f(v, x), f(v, x2)
  np.testing.assert_allclose(y1[:, :6], y2[:, :6], rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(y1[:, 6:] - y2[:, 6:]).max()) > 1e-3
  mb = tfx.MultiHeadAttention(H, attn_mask_type="no_mask")
  yb1, yb2 = jax.jit(mb.apply)(v, x), jax.jit(mb.apply)(v, x2)
  assert float(jnp.abs(yb1[:, :6] - yb2[:, :6]).max()) > 1e-3   # control


def _pack(docs, seq_len):
  """docs: list of rows, each a list of (B=1, L, E) arrays -> packed arrays."""
  rows, segs, poss = [], [], []
  for row in docs:
    parts, seg, pos = [], [], []
    for i, d in enumerate(row):
      parts.append(d[0]); seg += [i + 1] * d.shape[1]; pos += list(range(d.shape[1]))
    pad = seq_len - len(seg)
    parts.append(rand(99, (pad, E)) * 5.0)   # garbage in the padding
    rows.append(jnp.concatenate(parts)); segs.append(seg + [0] * pad)
    poss.append(pos + [0] * pad)
  return (jnp.stack(rows), jnp.asarray(segs, jnp.int32), jnp.asarray(poss, jnp.int32))


@pytest.mark.parametrize("mask_type,groups", [("causal", 2), ("no_mask", None)])
def test_packed_equals_separate_documents(mask_type, groups):
  lens = [[5, 7, 4], [7, 5]]     # two rows, padding at the end of each
  docs = [[rand(10 * r + i, (1, n, E)) for i, n in enumerate(row)]
          for r, row in enumerate(lens)]
  x, seg, pos = _pack(docs, 16)
  m = tfx.MultiHeadAttention(H, num_gqa_groups=groups, attn_mask_type=mask_type,
                             enable_rotary_pos_emb=True, attention_impl="xla")
  v = jax.jit(m.init)(jax.random.key(1), x)
  f = jax.jit(m.apply)
  packed = f(v, x, segment_ids=seg, segment_positions=pos)
  assert bool(jnp.all(jnp.isfinite(packed)))
  for r, row in enumerate(docs):
    start = 0
    for d in row:
      alone = f(v, d)                  # positions default to arange: 0..L-1
      n = d.shape[1]
      np.testing.assert_allclose(packed[r, start:start + n], alone[0], rtol=2e-5, atol=2e-5)
      start += n
  # control: without segment ids the packed rows do mix documents
  mixed = f(v, x, segment_positions=pos)
  assert float(jnp.abs(mixed[0, 5:12] - packed[0, 5:12]).max()) > 1e-3


def test_rotary_relative_and_changes_output():
  x = rand(0, (1, 8, E))
  m = tfx.MultiHeadAttention(H, attn_mask_type="no_mask", enable_rotary_pos_emb=True)
  v = jax.jit(m.init)(jax.random.key(1), x)
  pos = jnp.arange(8)[None]
  f = jax.jit(m.apply)
  y0 = f(v, x, segment_positions=pos)
  y_shift = f(v, x, segment_positions=pos + 7)    # RoPE is relative
  np.testing.assert_allclose(y0, y_shift, rtol=1e-4, atol=1e-5)
  y_plain = jax.jit(tfx.MultiHeadAttention(H, attn_mask_type="no_mask").apply)(v, x)
  assert rel(y0, y_plain) > 1e-3
  # rotation preserves norms
  q = rand(3, (1, 8, H, D))
  np.testing.assert_allclose(jnp.linalg.norm(attn_lib.apply_rotary(q, pos), axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def _split_gqa_kernel(kernel, h, g, axis=1):
  """The fused grouped-query kernel (E, h + 2 g, D) (its bias (h + 2 g, D):
  ``axis=0``) as (query, key, value)."""
  return tuple(jnp.split(kernel, [h, h + g], axis=axis))


def test_gqa_equals_mha_with_repeated_kv_heads():
  x = rand(0, (2, 9, E))
  g = 2
  gqa = tfx.MultiHeadAttention(H, num_gqa_groups=g, enable_rotary_pos_emb=True)
  vg = nn.unbox(jax.jit(gqa.init)(jax.random.key(1), x))
  assert set(vg["params"]) == {"qkv", "out"}
  assert vg["params"]["qkv"]["kernel"].shape == (E, H + 2 * g, D)
  q, k, v = _split_gqa_kernel(vg["params"]["qkv"]["kernel"], H, g)
  mha = tfx.MultiHeadAttention(H, fuse_qkv=False, enable_rotary_pos_emb=True)
  p = {"query": {"kernel": q}, "out": vg["params"]["out"],
       "kv": {"kernel": jnp.stack([jnp.repeat(k, H // g, axis=1),
                                   jnp.repeat(v, H // g, axis=1)], axis=1)}}
  assert set(jax.eval_shape(mha.init, jax.random.key(1), x)["params"]) == {"query", "kv", "out"}
  np.testing.assert_allclose(jax.jit(gqa.apply)(vg, x), jax.jit(mha.apply)({"params": p}, x),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_bias", [False, True])
def test_fused_gqa_equals_the_query_and_key_value_pair(use_bias):
  """fuse_qkv=True with grouped-query attention is the unfused module's
  query and key/value projections from the blocks of one kernel: outputs and
  every gradient, FP8 off (the FP8 paths: test_attention_fp8_close_to_fp32
  and tests/test_norm_attention.py)."""
  x = rand(0, (2, 9, E)); cot = rand(5, (2, 9, E))
  g = 2
  kw = dict(num_gqa_groups=g, enable_rotary_pos_emb=True, use_bias=use_bias)
  fused = tfx.MultiHeadAttention(H, **kw)
  pair = tfx.MultiHeadAttention(H, fuse_qkv=False, **kw)
  vf = nn.unbox(jax.jit(fused.init)(jax.random.key(1), x))
  qkv = vf["params"]["qkv"]
  if use_bias:   # non-zero biases, so that a misplaced block shows
    qkv = dict(qkv, bias=rand(7, qkv["bias"].shape))
    vf = {"params": dict(vf["params"], qkv=qkv)}
  q, k, v = _split_gqa_kernel(qkv["kernel"], H, g)
  pq = {"kernel": q}
  pkv = {"kernel": jnp.stack([k, v], axis=1)}
  if use_bias:
    bq, bk, bv = _split_gqa_kernel(qkv["bias"], H, g, axis=0)
    pq["bias"], pkv["bias"] = bq, jnp.stack([bk, bv], axis=0)
  vp = {"params": {"query": pq, "kv": pkv, "out": vf["params"]["out"]}}
  yf, vjp_f = jax.vjp(lambda v, x: fused.apply(v, x), vf, x)
  yp, vjp_p = jax.vjp(lambda v, x: pair.apply(v, x), vp, x)
  np.testing.assert_allclose(yf, yp, rtol=1e-5, atol=1e-5)
  (gf, gxf), (gp, gxp) = vjp_f(cot), vjp_p(cot)
  np.testing.assert_allclose(gxf, gxp, rtol=1e-4, atol=1e-5)
  got = _split_gqa_kernel(gf["params"]["qkv"]["kernel"], H, g)
  want = (gp["params"]["query"]["kernel"],) + tuple(
      gp["params"]["kv"]["kernel"][:, i] for i in range(2))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  if use_bias:
    got = _split_gqa_kernel(gf["params"]["qkv"]["bias"], H, g, axis=0)
    want = (gp["params"]["query"]["bias"],) + tuple(gp["params"]["kv"]["bias"])
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fused_gqa_under_tensor_parallelism_warns_once():
  """A grouped-query fused Q/K/V kernel where the autocast's tensor-parallel
  axis splits the mesh: one warning naming the axis and fuse_qkv=False;
  none for multi-head attention, none without the split."""
  import warnings  # pylint: disable=import-outside-toplevel
  from te_jax import recipe, sharding  # pylint: disable=import-outside-toplevel
  from te_jax.layers import qkv_projection  # pylint: disable=import-outside-toplevel
  mr = sharding.MeshResource(tp_resource="tp")

  def messages(heads, groups, tp):
    qkv_projection._warn_joined_heads.cache_clear()   # once per process: start afresh
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling(), mesh_resource=mr), \
          jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((tp,), ("tp",))):
        attn_lib.warn_if_heads_split(heads, groups)
        attn_lib.warn_if_heads_split(heads, groups)   # a second layer: no second warning
    return [str(w.message) for w in seen]

  got = messages(8, 2, 2)
  assert len(got) == 1 and "over 'tp' splits heads" in got[0] and "fuse_qkv=False" in got[0]
  assert messages(4, 4, 2) == [] and messages(4, 2, 1) == []


def test_cross_attention_ignores_padded_keys():
  x = rand(0, (2, 6, E)); enc = rand(1, (2, 7, 16))
  kv_seg = jnp.array([[1] * 5 + [0] * 2, [1] * 7], jnp.int32)
  m = tfx.MultiHeadAttention(H, attn_mask_type="no_mask")
  v = jax.jit(m.init)(jax.random.key(1), x, enc)
  f = jax.jit(m.apply)
  y1 = f(v, x, enc, kv_segment_ids=kv_seg)
  enc2 = enc.at[0, 5:].set(100.0)
  y2 = f(v, x, enc2, kv_segment_ids=kv_seg)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(f(v, x, enc) - f(v, x, enc2))[0].max()) > 1e-3
  y_trim = f(v, x[:1], enc[:1, :5])
  np.testing.assert_allclose(y1[:1], y_trim, rtol=1e-5, atol=1e-5)


def test_attention_dropout_and_explicit_core():
  x = rand(0, (2, 8, E))
  m = tfx.MultiHeadAttention(H, attention_dropout=0.5)
  v = jax.jit(m.init)(jax.random.key(1), x)
  y_det = jax.jit(m.apply)(v, x)
  np.testing.assert_allclose(y_det, jax.jit(tfx.MultiHeadAttention(H).apply)(v, x), rtol=1e-6)
  y_drop = jax.jit(lambda v, x, k: m.apply(v, x, deterministic=False, rngs={"dropout": k}))(
      v, x, jax.random.key(3))
  assert rel(y_drop, y_det) > 0.05
  # the explicit core used for dropout equals jax.nn.dot_product_attention
  q, k, vv = rand(1, (2, 8, 4, 8)), rand(2, (2, 8, 2, 8)), rand(3, (2, 8, 2, 8))
  mask = attn_lib.segment_attention_mask(jnp.array([[1] * 5 + [2] * 3] * 2),
                                         jnp.array([[1] * 5 + [2] * 3] * 2))
  ref = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
      q, k, v, mask=m, is_causal=True))(q, k, vv, mask)
  got = jax.jit(lambda q, k, v, m: attn_lib._reference_attention(
      q, k, v, m, True, None, 0.0))(q, k, vv, mask)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_attention_fp8_close_to_fp32(name, impl):
  x = rand(0, (2, 16, E)); cot = rand(5, (2, 16, E))
  m = tfx.MultiHeadAttention(H, num_gqa_groups=2, enable_rotary_pos_emb=True, impl=impl)
  v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))

  def run(v):
    # A fresh function per call: the recipe is read at trace time, so a
    # cached trace from outside the autocast must not be reused.
    def f(v):
      y, vjp = jax.vjp(lambda v, x: m.apply(v, x), v, x)
      return y, vjp(cot)
    return jax.jit(f)(v)

  ry, (rgv, rgx) = run(v)
  with te_jax.fp8_autocast(True, RECIPES[name]()):
    init = jax.eval_shape(m.init, jax.random.key(1), x)
    if name == "delayed":
      v = dict(v, **{fp8_state.FP8_COLLECTION: jax.tree.map(
          jnp.zeros_like, init[fp8_state.FP8_COLLECTION])})
      step = jax.jit(lambda v: jax.vjp(lambda v, x: m.apply(v, x), v, x)[1](cot))
      g, _ = step(v)          # zero state = scale 1; one step gives real scales
      v = fp8_state.apply_fp8_updates(v, g)
    else:
      assert fp8_state.FP8_COLLECTION not in init
    y, (gv, gx) = run(v)
  assert 1e-4 < rel(y, ry) < FWD_TOL, rel(y, ry)
  assert rel(gx, rgx) < GRAD_TOL, rel(gx, rgx)
  assert set(gv["params"]) == {"qkv", "out"}   # grouped-query Q/K/V fused
  for sub in ("qkv", "out"):
    e = rel(gv["params"][sub]["kernel"], rgv["params"][sub]["kernel"])
    assert e < GRAD_TOL, (sub, e)


def test_query_segment_ids_without_key_segment_ids_raise():
  from te_jax.layers.attention import segment_attention_mask
  ids = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="kv_segment_ids"):
    segment_attention_mask(ids, None)
  assert segment_attention_mask(None, None) is None


# --- packed rows in cuDNN's packed layout (te_jax.layers.packed_attention) ---

def _well_formed_ids(seed, b, s):
  """Rows of contiguous documents with increasing (gappy) ids, padding between/after."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(b):
    row, next_id = [], 1
    while len(row) < s:
      row += [0] * int(rng.integers(0, 3))                 # padding between documents
      row += [next_id] * int(rng.integers(1, 9))
      next_id += int(rng.integers(1, 3))                   # ids need not be consecutive
    rows.append(row[:s - 2] + [0, 0])                      # padding at the end
  return jnp.asarray(rows, jnp.int32)


def _documents_of_layout(seqlens, offsets, s):
  """(B, S) document index of each token under (seqlens, offsets), -1 outside."""
  pos = jnp.arange(s)[None, None, :]
  start, n = offsets[:, :-1, None], seqlens[:, :, None]
  inside = (n > 0) & (pos >= start) & (pos < start + n)     # (B, M, S)
  assert int(inside.sum(axis=1).max()) <= 1                 # documents do not overlap
  return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1)


@pytest.mark.parametrize("seed", range(4))
def test_segment_layout_reproduces_the_segment_mask(seed):
  from te_jax.layers.packed_attention import segment_layout
  ids = _well_formed_ids(seed, 3, 40)
  m = int(max(len(set(np.asarray(r).tolist()) - {0}) for r in ids))
  seqlens, offsets, fits = jax.jit(segment_layout, static_argnums=1)(ids, m)
  assert bool(fits)
  assert seqlens.shape == (3, m) and offsets.shape == (3, m + 1)
  doc = _documents_of_layout(seqlens, offsets, 40)
  np.testing.assert_array_equal(doc >= 0, ids != 0)
  same_doc = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
  same_id = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
  np.testing.assert_array_equal(same_doc, same_id)
  # one document fewer than the fullest row holds: does not fit
  assert not bool(segment_layout(ids, m - 1)[2])


def test_segment_layout_rejects_ids_in_two_runs_and_checks_arguments():
  from te_jax.layers.packed_attention import segment_layout
  ok = jnp.array([[1, 1, 0, 2, 2, 0], [0, 0, 0, 0, 0, 0]], jnp.int32)
  seqlens, offsets, fits = segment_layout(ok, 2)
  assert bool(fits)
  np.testing.assert_array_equal(seqlens, [[2, 2], [-1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, -1], [-1, -1, -1]])
  for bad in ([1, 1, 0, 1, 0, 0],        # id 1 split by padding
              [2, 2, 1, 1, 0, 0],        # decreasing: 2 could reappear unseen
              [1, 2, 1, 0, 0, 0]):       # id 1 in two runs
    assert not bool(segment_layout(jnp.array([bad], jnp.int32), 4)[2]), bad
  with pytest.raises(ValueError, match="max_segments"):
    segment_layout(ok, 0)
  with pytest.raises(TypeError, match="integers"):
    segment_layout(ok.astype(jnp.float32), 2)
  with pytest.raises(ValueError, match="batch, seq"):
    segment_layout(ok[0], 2)


def test_padding_queries_output_zero():
  x = rand(0, (1, 8, E))
  seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0]], jnp.int32)
  m = tfx.MultiHeadAttention(H, attention_impl="xla")
  v = jax.jit(m.init)(jax.random.key(1), x)
  y = jax.jit(m.apply)(v, x, segment_ids=seg)
  assert float(jnp.abs(y[0, 5:]).max()) == 0.0
  assert float(jnp.abs(y[0, :5]).max(axis=-1).min()) > 0.0      # real tokens are not


def test_packed_routing(monkeypatch):
  """Which calls take the packed cuDNN path (stubbed: no cuDNN on the CPU)."""
  from te_jax.layers import packed_attention as pa
  calls = []
  def spy(q, k, v, segment_ids, *, is_causal, max_segments, scale, zero_padding_queries):
    assert not zero_padding_queries          # attention_core zeroes them itself
    calls.append((is_causal, max_segments, scale))
    return jnp.zeros_like(q)
  monkeypatch.setattr(pa, "log_if_unavailable", lambda: True)
  monkeypatch.setattr(pa, "packed_self_attention", spy)
  xla_attention = jax.nn.dot_product_attention        # the other paths, on the CPU
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **k:
                      xla_attention(*a, implementation="xla", **k))
  x = rand(0, (1, 8, E)); enc = rand(1, (1, 8, E))
  seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0]], jnp.int32)
  m = tfx.MultiHeadAttention(H, attention_impl="cudnn", max_segments_per_seq=3)
  v = m.init(jax.random.key(1), x)
  m.apply(v, x, segment_ids=seg)
  assert calls == [(True, 3, D ** -0.5)]
  m.apply(v, x, segment_ids=seg, kv_segment_ids=seg + 0)     # other key ids: not packed self
  m.apply(m.init(jax.random.key(1), x, enc), x, enc, segment_ids=seg,
          kv_segment_ids=seg)                                  # cross attention
  m.apply(v, x, segment_ids=seg, mask=jnp.ones((1, 1, 8, 8), bool))
  tfx.MultiHeadAttention(H, attention_impl="xla").apply(v, x, segment_ids=seg)
  assert len(calls) == 1
  with pytest.raises(ValueError, match="max_segments_per_seq"):
    tfx.MultiHeadAttention(H, max_segments_per_seq=0).apply(v, x, segment_ids=seg)


def _packed_case(groups, s=256, b=2, heads=4, d=64):
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((b, s, heads, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((b, s, groups, d)), jnp.bfloat16) for _ in "kv")
  cot = jnp.asarray(rng.standard_normal((b, s, heads, d)), jnp.bfloat16)
  ids = np.zeros((b, s), np.int32)
  ids[0, 0:100], ids[0, 103:163], ids[0, 163:213] = 1, 2, 4   # a gap, a skipped id
  ids[1, 0:128], ids[1, 128:248] = 1, 2
  return q, k, v, cot, jnp.asarray(ids)


def _masked_reference(q, k, v, cot, ids, causal):
  """float32 XLA attention under the segment mask: the same as each document
  alone (test_packed_equals_separate_documents), in one jit."""
  f32 = lambda t: t.astype(jnp.float32)
  def attend(q, k, v):
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=causal,
                                        implementation="xla")
  y, vjp = jax.vjp(attend, f32(q), f32(k), f32(v))
  return y, vjp(f32(cot))


def _rel_on(a, b, where):
  a, b = np.asarray(a, np.float64)[where], np.asarray(b, np.float64)[where]
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,groups", [(True, 4), (False, 2), (True, 1)])
@pytest.mark.parametrize("branch", ["packed", "fallback", "cond"])
def test_cuda_packed_attention_equals_documents_alone(causal, groups, branch):
  from te_jax.layers import packed_attention as pa
  assert pa.packed_cudnn_available(), pa._unavailable_reason()
  q, k, v, cot, ids = _packed_case(groups)
  scale = q.shape[-1] ** -0.5
  valid = ids != 0

  def attend(q, k, v):
    if branch == "packed":     # the cuDNN packed-layout branch alone
      seqlens, offsets, fits = pa.segment_layout(ids, 4)
      out = pa._cudnn_packed(q, k, v, seqlens, offsets, valid, is_causal=causal, scale=scale)
      return jnp.where(valid[:, :, None, None], out, 0)
    # max_segments=1 cannot hold these rows: the masked fallback runs
    return pa.packed_self_attention(q, k, v, ids, is_causal=causal, scale=scale,
                                    max_segments=1 if branch == "fallback" else 4)

  y, vjp = jax.jit(lambda *a: jax.vjp(attend, *a))(q, k, v)
  grads = jax.jit(vjp)(cot)
  ref_y, ref_grads = jax.jit(_masked_reference, static_argnums=5)(q, k, v, cot, ids, causal)
  # bf16 inputs; cuDNN rounds the probabilities to bf16 for P.V: ~0.5% error.
  assert _rel_on(y, ref_y, np.asarray(valid)) < 2e-2
  pad = ~np.asarray(valid)
  assert float(np.abs(np.asarray(y, np.float32)[pad]).max()) == 0.0
  for name, g, rg in zip("qkv", grads, ref_grads):
    # gradients go through two bf16 GEMMs more than the output: 2x the bound
    assert _rel_on(g, rg, np.asarray(valid)) < 4e-2, name
    assert float(np.abs(np.asarray(g, np.float32)[pad]).max()) == 0.0, name


@pytest.mark.gpu
def test_cuda_module_runs_packed_layout_and_matches_xla():
  x = rand(0, (2, 256, 256)).astype(jnp.bfloat16)
  ids = _packed_case(4)[-1]
  auto = tfx.MultiHeadAttention(4, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  xla = tfx.MultiHeadAttention(4, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                               attention_impl="xla")
  v = jax.jit(auto.init)(jax.random.key(1), x)
  hlo = jax.jit(lambda v, x: auto.apply(v, x, segment_ids=ids)).lower(v, x).compile().as_text()
  assert "cudnn" in hlo and "fmha" in hlo, "no cuDNN attention in the compiled module"
  y = jax.jit(lambda v, x: auto.apply(v, x, segment_ids=ids))(v, x)
  y_xla = jax.jit(lambda v, x: xla.apply(v, x, segment_ids=ids))(v, x)
  # both bf16; the XLA path keeps the softmax in f32: ~1% apart
  assert rel(y, y_xla) < 2e-2
  assert float(jnp.abs(y[0, 213:]).max()) == 0.0
