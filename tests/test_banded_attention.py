"""The causal band for packed rows of short documents (``max_document_length``).

``packed_attention.banded_self_attention`` computes causal attention under
the segment mask restricted to a left window of W keys, which is exact while
every document spans at most W tokens, and falls back on the device to the
full masked attention otherwise. On the CPU both run in XLA, where the band
changes which logits are computed but not which are masked: bit-exact.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from te_jax import flax as tfx
from te_jax import nnx as tnnx
from te_jax.layers import attention as core_lib
from te_jax.layers import packed_attention as pa

H, D = 4, 16
E = H * D


def _ids(rows):
  return jnp.asarray(np.array(rows, np.int32))


def test_document_spans_fit_measures_each_run_and_rejects_ids_in_two_runs():
  ids = _ids([[1, 1, 1, 2, 2, 0, 0, 0],
              [1, 1, 1, 1, 1, 1, 0, 0]])
  assert not bool(pa.document_spans_fit(ids, 2))
  assert not bool(pa.document_spans_fit(ids, 5))       # row 1 holds a 6-token document
  assert bool(pa.document_spans_fit(ids[:1], 3))
  assert bool(pa.document_spans_fit(ids, 6))
  # padding is no document, however long
  assert bool(pa.document_spans_fit(_ids([[0, 0, 0, 0, 0, 1, 1, 0]]), 2))
  # id 1 in two runs: its tokens lie 5 apart although each run is short
  assert not bool(pa.document_spans_fit(_ids([[1, 1, 0, 2, 1, 1, 0, 0]]), 8))
  with pytest.raises(ValueError, match="segment_ids must be"):
    pa.document_spans_fit(ids[0], 4)
  with pytest.raises(TypeError, match="integers"):
    pa.document_spans_fit(ids.astype(jnp.float32), 4)


def _case(seed, b=2, s=64, groups=2):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, s, H, D)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, s, groups, D)), jnp.float32) for _ in "kv")
  cot = jnp.asarray(rng.standard_normal((b, s, H, D)), jnp.float32)
  return q, k, v, cot


SHORT = [[1] * 10 + [2] * 12 + [3] * 5 + [0] * 3 + [4] * 12 + [5] * 12 + [6] * 10,
         [1] * 12 + [2] * 12 + [3] * 12 + [4] * 12 + [5] * 12 + [0] * 4]   # docs <= 12
LONG = [SHORT[0], [1] * 40 + [2] * 20 + [0] * 4]                            # a 40-token doc


def _full(q, k, v, ids):
  same = ids[:, None, :, None] == ids[:, None, None, :]
  out = jax.nn.dot_product_attention(q, k, v, mask=same, scale=D ** -0.5, is_causal=True,
                                     implementation="xla")
  return jnp.where((ids != 0)[:, :, None, None], out, 0.0)


def _vjp(f, q, k, v, cot):
  y, vjp = jax.vjp(f, q, k, v)
  return y, vjp(cot)


@pytest.mark.parametrize("rows", ["short", "long"])
def test_band_equals_full_masked_attention_bit_for_bit(rows):
  """Output and dq, dk, dv of the banded core equal the full causal attention
  under the segment mask: through the band where every document fits (short
  rows), through the device-side fallback where one does not (long rows)."""
  ids = _ids(SHORT if rows == "short" else LONG)
  q, k, v, cot = _case(0)
  band = lambda q, k, v: pa.banded_self_attention(q, k, v, ids, window=12, scale=D ** -0.5,
                                                  implementation="xla")
  got = jax.jit(lambda *a: _vjp(band, *a))(q, k, v, cot)
  want = jax.jit(lambda *a: _vjp(lambda q, k, v: _full(q, k, v, ids), *a))(q, k, v, cot)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_the_window_alone_would_cut_a_long_document():
  """What the fallback protects: on the long rows a 12-key window drops keys
  of the 40-token document, so its queries would get another answer."""
  ids = _ids(LONG)
  q, k, v, _ = _case(0)
  same = ids[:, None, :, None] == ids[:, None, None, :]
  cut = jax.nn.dot_product_attention(q, k, v, mask=same, scale=D ** -0.5, is_causal=True,
                                     local_window_size=(11, 0), implementation="xla")
  cut = jnp.where((ids != 0)[:, :, None, None], cut, 0.0)   # padding queries, as _full
  full = _full(q, k, v, ids)
  assert float(jnp.abs(cut[1, 12:40] - full[1, 12:40]).max()) > 1e-3
  np.testing.assert_array_equal(cut[0], full[0])        # the short row: the same


def test_band_checks_its_window_and_covers_short_rows_whole():
  ids = _ids(SHORT)
  q, k, v, _ = _case(1)
  for bad in (0, -3, True, 2.5):
    with pytest.raises(ValueError, match="window must be an int >= 1"):
      pa.banded_self_attention(q, k, v, ids, window=bad, scale=1.0, implementation="xla")
  # a window as long as the row is the whole causal triangle: no cond, same answer
  whole = pa.banded_self_attention(q, k, v, ids, window=64, scale=D ** -0.5,
                                   implementation="xla")
  np.testing.assert_array_equal(whole, _full(q, k, v, ids))


def _x(seed, s=64):
  return jax.random.normal(jax.random.key(seed), (2, s, E), jnp.float32)


def _selects_of_shape(jaxpr, shape):
  """select_n equations with an output of ``shape``, sub-jaxprs included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "select_n" and eqn.outvars[0].aval.shape == shape:
      n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)          # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          n += _selects_of_shape(sub, shape)
  return n


def test_padding_queries_are_zeroed_once_per_pass():
  """The band leaves padding queries to attention_core, which zeroes them on
  every path: one `where` over the (B, S, heads, D) output in the forward
  and one in the backward (each a pass over the output on the GPU)."""
  ids = _ids(SHORT)
  q, k, v, cot = _case(1)
  raw = pa.banded_self_attention(q, k, v, ids, window=12, scale=D ** -0.5,
                                 implementation="xla", zero_padding_queries=False)
  zeroed = pa.banded_self_attention(q, k, v, ids, window=12, scale=D ** -0.5,
                                    implementation="xla")
  pad = (ids == 0)[:, :, None, None]
  assert bool(jnp.all(jnp.where(pad, zeroed, 0.0) == 0.0))
  assert bool(jnp.any(jnp.where(pad, raw, 0.0) != 0.0))    # left as computed
  np.testing.assert_array_equal(jnp.where(pad, 0.0, raw), jnp.where(pad, 0.0, zeroed))

  def core(q, k, v):
    return core_lib.attention_core(q, k, v, self_attn=True, segment_ids=ids,
                                   kv_segment_ids=ids, attn_mask_type="causal",
                                   attention_impl="xla", max_document_length=12)
  jaxpr = jax.make_jaxpr(lambda q, k, v: _vjp(core, q, k, v, cot))(q, k, v).jaxpr
  assert _selects_of_shape(jaxpr, q.shape) == 2


def test_the_band_cond_takes_no_dense_mask_operand():
  """The segment mask is made inside each branch (fused into the bias there
  on the GPU), so the cond's operands hold nothing of (B, 1, S, S)."""
  ids = _ids(SHORT)
  q, k, v, _ = _case(2)
  jaxpr = jax.make_jaxpr(lambda q, k, v: pa.banded_self_attention(
      q, k, v, ids, window=12, scale=D ** -0.5, implementation="xla"))(q, k, v).jaxpr
  conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
  assert len(conds) == 1
  s = q.shape[1]
  assert all(tuple(x.aval.shape[-2:]) != (s, s) for x in conds[0].invars)


@pytest.mark.parametrize("groups", [H, 2])
def test_linen_attention_with_max_document_length_is_the_same_function(groups, monkeypatch):
  calls = []
  real = pa.banded_self_attention
  monkeypatch.setattr(pa, "banded_self_attention",
                      lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw))
  x, ids = _x(0), _ids(SHORT)
  plain = tfx.MultiHeadAttention(H, num_gqa_groups=groups, enable_rotary_pos_emb=True)
  band = tfx.MultiHeadAttention(H, num_gqa_groups=groups, enable_rotary_pos_emb=True,
                                max_document_length=12)
  v = plain.init(jax.random.key(1), x)

  def loss(m):
    return lambda v, x: jnp.sum(m.apply(v, x, segment_ids=ids) ** 2)

  want = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1)))(v, x)
  got = jax.jit(jax.value_and_grad(loss(band), argnums=(0, 1)))(v, x)
  assert calls == [12]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_transformer_layers_pass_the_length_to_self_attention_only(monkeypatch):
  calls = []
  real = pa.banded_self_attention
  monkeypatch.setattr(pa, "banded_self_attention",
                      lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw))
  x, ids = _x(2), _ids(SHORT)
  enc = _x(3, 16)
  layer = tfx.TransformerLayer(E, 2 * E, H, layer_type="decoder", max_document_length=12)
  v = layer.init(jax.random.key(4), x, enc, segment_ids=ids)
  y = jax.jit(lambda v: layer.apply(v, x, enc, segment_ids=ids))(v)
  plain = tfx.TransformerLayer(E, 2 * E, H, layer_type="decoder")
  np.testing.assert_array_equal(y, jax.jit(lambda v: plain.apply(v, x, enc, segment_ids=ids))(v))
  assert calls and set(calls) == {12}
  calls.clear()
  nlayer = tnnx.TransformerLayer(E, 2 * E, H, layer_type="decoder", max_document_length=12,
                                 rngs=nnx.Rngs(0))
  nplain = tnnx.TransformerLayer(E, 2 * E, H, layer_type="decoder", rngs=nnx.Rngs(0))
  run = nnx.jit(lambda m, x: m(x, segment_ids=ids))   # both compiled, as the Linen pair
  np.testing.assert_array_equal(run(nlayer, x), run(nplain, x))
  assert calls and set(calls) == {12}


def test_nnx_attention_with_max_document_length_matches_the_plain_one():
  x, ids = _x(5), _ids(LONG)
  band = tnnx.MultiHeadAttention(H, E, num_gqa_groups=2, max_document_length=12,
                                 rngs=nnx.Rngs(0))
  plain = tnnx.MultiHeadAttention(H, E, num_gqa_groups=2, rngs=nnx.Rngs(0))
  run = nnx.jit(lambda m, x: m(x, segment_ids=ids))
  np.testing.assert_array_equal(run(band, x), run(plain, x))


def test_bad_max_document_length_is_a_clear_error():
  x = _x(0)
  for bad in (0, True, 3.0):
    with pytest.raises(ValueError, match="max_document_length must be None or an int"):
      tfx.MultiHeadAttention(H, max_document_length=bad).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="bands causal attention"):
    tfx.MultiHeadAttention(H, attn_mask_type="no_mask", max_document_length=8).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="bands causal attention"):
    tnnx.MultiHeadAttention(H, E, attn_mask_type="no_mask", max_document_length=8,
                            rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="bands causal attention"):   # an encoder's self attention
    tfx.TransformerLayer(E, 2 * E, H, layer_type="encoder", max_document_length=8).init(
        jax.random.key(0), x)


def test_unused_max_document_length_is_logged_once(caplog):
  """Without segment ids there are no documents to band: full attention, and
  one INFO line that says why."""
  x = _x(6)
  m = tfx.MultiHeadAttention(H, max_document_length=12)
  core_lib._log_no_band.cache_clear()    # once per process: maybe logged by another test
  with caplog.at_level(logging.INFO, logger="te_jax"):
    v = m.init(jax.random.key(0), x)
    y = m.apply(v, x)
  np.testing.assert_array_equal(y, tfx.MultiHeadAttention(H).apply(v, x))
  assert any("max_document_length is not used here" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["short", "long"])
def test_cuda_band_matches_the_float32_masked_reference(rows):
  """cuDNN's sliding window under the segment bias (short rows) and the
  fallback (long rows) against float32 XLA attention under the segment mask."""
  b, s, heads, groups, d = 2, 512, 4, 2, 64
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((b, s, heads, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((b, s, groups, d)), jnp.bfloat16) for _ in "kv")
  cot = jnp.asarray(rng.standard_normal((b, s, heads, d)), jnp.bfloat16)
  ids = np.zeros((b, s), np.int32)
  starts = list(range(0, 480, 96))                  # documents of 90 tokens, gaps of 6
  for i, st in enumerate(starts):
    ids[:, st:st + 90] = i + 1
  if rows == "long":
    ids[1, :] = 0
    ids[1, :300] = 1                                # 300 tokens > the 128 window
  ids = jnp.asarray(ids)
  band = lambda q, k, v: pa.banded_self_attention(q, k, v, ids, window=128,
                                                  scale=d ** -0.5, implementation="cudnn")
  y, grads = jax.jit(lambda *a: _vjp(band, *a))(q, k, v, cot)
  f32 = lambda t: t.astype(jnp.float32)

  def full(q, k, v):
    same = ids[:, None, :, None] == ids[:, None, None, :]
    out = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                       implementation="xla")
    return jnp.where((ids != 0)[:, :, None, None], out, 0.0)

  ry, rgrads = jax.jit(lambda *a: _vjp(full, *a))(f32(q), f32(k), f32(v), f32(cot))
  valid = np.asarray(ids != 0)

  def rel_on(a, r):
    a, r = np.asarray(a, np.float64)[valid], np.asarray(r, np.float64)[valid]
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))

  # bf16 inputs, probabilities rounded to bf16 for P.V (test_flax_attention's bounds)
  assert rel_on(y, ry) < 2e-2
  for name, g, rg in zip("qkv", grads, rgrads):
    assert rel_on(g, rg) < 4e-2, name
  hlo = jax.jit(band).lower(q, k, v).compile().as_text()
  assert "cudnn" in hlo, "no cuDNN attention in the compiled band"
