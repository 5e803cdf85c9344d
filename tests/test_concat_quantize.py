"""Quantizing a concatenation from its parts, and the split-output dense.

``ops/concat_quantize.py`` is the quantization of ``concatenate(parts, 1)``
bit for bit, without writing the concatenation on the CUDA path;
``dense.fp8_dense_split`` uses it for the gradients of its output blocks, so
its values and gradients must equal those of splitting ``fp8_dense``'s output.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import te_jax
from te_jax import dense, fp8_state, recipe
from te_jax import flax as tfx
from te_jax.ops import concat_quantize as cq
from te_jax.ops import quantize as qop
from te_jax.ops.fp8 import QuantizedTensor

from cuda_lowering import cuda_text, custom_calls, gpu_host  # pylint: disable=unused-import

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}


def _parts(n, m, f, dtype=jnp.bfloat16, seed=0):
  return _parts_of(m, (f,) * n, dtype, seed)


def _parts_of(m, widths, dtype=jnp.bfloat16, seed=0):
  """Parts (m, widths[i]); widths may differ (a grouped-query Q/K/V)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(widths))
  # Different magnitudes per part, so that the joint amax / the tiles that
  # straddle no part boundary are actually exercised.
  return [(jax.random.normal(k, (m, f)) * 2.0 ** (3 * i - 2)).astype(dtype)
          for i, (k, f) in enumerate(zip(keys, widths))]


def _fields(q):
  """(data, scale_inv, data_t, scale_inv_t, amax) of a QuantizedTensor."""
  if isinstance(q, QuantizedTensor):
    return q.data, q.scale_inv, q.data_t, q.scale_inv_t, q.amax
  return tuple(q)


def _assert_same(got, want):
  """Same fields (bit for bit) and, for QuantizedTensors, same block_shape."""
  if isinstance(got, QuantizedTensor) and isinstance(want, QuantizedTensor):
    assert got.block_shape == want.block_shape, (got.block_shape, want.block_shape)
  got, want = _fields(got), _fields(want)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    if w is None:
      assert g is None
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _direct(parts, mode, dtype, scale=None, p2=False, impl="reference"):
  """What the plain quantize ops give for the concatenation (the spec), as a
  QuantizedTensor; the per-tensor scale_inv are spelled out (1/scale, and the
  same for both copies)."""
  v = jnp.concatenate(parts, axis=1)
  if mode == "tensorwise":
    q = qop.quantize_tensorwise(v, scale, dtype, columnwise=True, impl=impl)
    s = 1.0 / jnp.asarray(scale, jnp.float32)
    return QuantizedTensor(q.data, s, q.data_t, s, q.amax)
  if mode == "current":
    q = qop.quantize_current(v, dtype, columnwise=True, impl=impl)
    return QuantizedTensor(q.data, q.scale_inv, q.data_t, q.scale_inv, q.amax)
  q = qop.quantize_blockwise(v, (1, 128), dtype, p2, columnwise=True, impl=impl)
  return QuantizedTensor(q.data, q.scale_inv, q.data_t, q.scale_inv_t, None, (1, 128))


# ------------------------------------------------------------ the op -------

@pytest.mark.parametrize("mode", cq.MODES)
def test_reference_is_quantize_of_concat(mode):
  parts = _parts(3, 200, 136)
  scale = jnp.float32(3.0) if mode == "tensorwise" else None
  got = cq.concat_quantize(parts, mode=mode, dtype=E5M2, scale=scale, impl="reference")
  assert isinstance(got, QuantizedTensor)
  _assert_same(got, _direct(parts, mode, E5M2, scale))
  assert got.data.shape == (200, 3 * 136) and got.data_t.shape == (3 * 136, 200)
  assert got.block_shape == ((1, 128) if mode == "blockwise" else None)
  assert (got.amax is None) == (mode == "blockwise")


@pytest.mark.parametrize("mode", cq.MODES)
@pytest.mark.parametrize("m,widths", [(200, (256, 64, 64)), (37, (128, 8, 24)), (1, (8, 256)),
                                      (130, (24, 136, 8, 40))])
def test_reference_of_unequal_widths_is_quantize_of_concat(mode, m, widths):
  """Parts of different widths (grouped-query Q/K/V): the quantization of
  their (M, sum of widths) concatenation."""
  parts = _parts_of(m, widths, seed=m)
  k = sum(widths)
  scale = jnp.float32(3.0) if mode == "tensorwise" else None
  got = cq.concat_quantize(parts, mode=mode, dtype=E4M3, scale=scale, impl="reference")
  _assert_same(got, _direct(parts, mode, E4M3, scale))
  assert got.data.shape == (m, k) and got.data_t.shape == (k, m)
  if mode == "blockwise":
    assert got.scale_inv.shape == (m, math.ceil(k / 128))
    assert got.scale_inv_t.shape == (k, math.ceil(m / 128))


@pytest.mark.parametrize("bad,exc,msg", [
    (dict(parts=[]), TypeError, "non-empty"),
    (dict(parts="x"), TypeError, "non-empty"),
    (dict(parts=[jnp.ones((8, 16)), jnp.ones((9, 16))]), ValueError,
     r"rows M of parts\[0\] \(M = 8; the widths may differ\); parts\[1\] has shape \(9, 16\)"),
    (dict(parts=[jnp.ones((8, 16)), jnp.ones((8, 24)), jnp.ones((7, 8))]), ValueError,
     r"parts\[2\] has shape"),
    (dict(parts=[jnp.ones((8, 16)), jnp.ones((8, 16), jnp.bfloat16)]), ValueError,
     r"dtype of parts\[0\] \(float32\); parts\[1\] is bfloat16"),
    (dict(parts=[jnp.ones((8, 16)), jnp.ones((8, 0))]), ValueError,
     r"parts\[1\] must not be empty"),
    (dict(parts=[jnp.ones((2, 8, 16))]), ValueError, "2-D"),
    (dict(parts=[jnp.ones((8, 16), jnp.int32)]), TypeError, "float32, bfloat16"),
    (dict(mode="rowwise"), ValueError, "mode must be one of"),
    (dict(mode="tensorwise"), ValueError, "needs scale"),
    (dict(mode="current", scale=jnp.float32(2)), ValueError, "scale must be None"),
    (dict(mode="current", power_2_scale=True), ValueError, "blockwise. only"),
    (dict(power_2_scale=1), TypeError, "Python bool"),
    (dict(dtype=jnp.bfloat16), (TypeError, ValueError), "float8"),
])
def test_bad_arguments_raise_at_trace_time(bad, exc, msg):
  kw = dict(parts=[jnp.ones((8, 16))] * 2, mode="blockwise", dtype=E4M3)
  kw.update(bad)
  with pytest.raises(exc, match=msg):
    cq.concat_quantize(**kw)


def test_supported_shapes():
  assert cq.concat_quantize_supported(1, [8])
  assert cq.concat_quantize_supported(16384, [4096] * 3)
  assert cq.concat_quantize_supported(16384, (4096, 1024, 1024))  # grouped-query Q, K, V
  assert cq.concat_quantize_supported(37, (128, 8, 24, 16))
  assert cq.concat_quantize_supported(8, np.array([16, 8]))
  assert cq.concat_quantize_supported(8, (w for w in (16, 8)))
  assert not cq.concat_quantize_supported(128, [12] * 3)          # F_i % 8
  assert not cq.concat_quantize_supported(128, (128, 64, 12))     # one part's F_i % 8
  assert not cq.concat_quantize_supported(128, (128, 0))          # an empty part
  assert not cq.concat_quantize_supported(128, [128] * 5)         # more than 4 parts
  assert not cq.concat_quantize_supported(128, [])                # no part
  assert not cq.concat_quantize_supported(128, [128, 128.0])      # not an int
  assert not cq.concat_quantize_supported(128, [128, True])       # a bool is no width
  assert not cq.concat_quantize_supported(128, 128)               # not a sequence
  assert not cq.concat_quantize_supported(128.0, [128])
  assert not cq.concat_quantize_supported(0, [128])
  assert not cq.concat_quantize_supported(65535 * 128 + 1, [8])
  assert cq.concat_quantize_supported(65535 * 128, [8])


@pytest.mark.parametrize("mode", cq.MODES)
def test_cuda_call_of_unequal_widths(gpu_host, mode):  # pylint: disable=unused-argument
  """Lowered for CUDA (no GPU needed): one custom call takes the parts as
  they are, (M, F_i) each, and writes (M, K) and (K, M), K = sum F_i, with
  the blockwise scales of K columns."""
  m, widths = 300, (512, 128, 128)
  k = sum(widths)
  parts = [jnp.zeros((m, w), jnp.bfloat16) for w in widths]
  scale = jnp.float32(2.0) if mode == "tensorwise" else None
  text = cuda_text(lambda ps: cq.concat_quantize(ps, mode=mode, dtype=E4M3, scale=scale), parts)
  ((target, operands, results),) = custom_calls(text, "te_jax_concat_quantize")
  assert target == f"te_jax_concat_quantize_{mode}"
  assert operands[-3:] == [f"{m}x{w}xbf16" for w in widths], operands
  fp8 = [r for r in results if r.endswith("f8E4M3FN")]
  assert fp8 == [f"{m}x{k}xf8E4M3FN", f"{k}x{m}xf8E4M3FN"], results


def test_cuda_path_names_the_unaligned_widths(gpu_host):  # pylint: disable=unused-argument
  """The CUDA path's check (traced on any machine under "auto") names the
  widths it does not take."""
  parts = [jnp.zeros((16, 64), jnp.bfloat16), jnp.zeros((16, 12), jnp.bfloat16)]
  with pytest.raises(ValueError, match=r"widths \[64, 12\].*F_i % 8 == 0"):
    cuda_text(lambda ps: cq.concat_quantize(ps, mode="current", dtype=E4M3), parts)


# ------------------------------------------------- the split-output dense --

def _state(r, x, w):
  if not isinstance(r, recipe.DelayedScaling):
    return None
  st = fp8_state.init_dense_state(r.amax_history_len)
  return jax.grad(lambda s: jnp.sum(dense.fp8_dense(x, w, recipe=r, fp8_state=s)
                                    .astype(jnp.float32)), allow_int=True)(st)


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("n_splits,f", [(3, 128), (2, 256), (3, 40), (5, 128)])
def test_split_dense_equals_split_of_dense(rname, n_splits, f):
  """Values and every gradient (x, kernel, bias, FP8 state) bit-equal to
  splitting fp8_dense's output; (3, 40) and (5, 128) take the fallback
  (block width not aligned / more than 4 parts), the others the split VJP."""
  r = RECIPES[rname]
  k = 192
  kx, kw, kb, kc = jax.random.split(jax.random.PRNGKey(1), 4)
  x = jax.random.normal(kx, (2, 100, k)).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n_splits * f)) * k ** -0.5).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n_splits * f,)).astype(jnp.bfloat16)
  cots = [jax.random.normal(c, (2, 100, f)) * (i + 1)
          for i, c in enumerate(jax.random.split(kc, n_splits))]
  st = _state(r, x, w)

  def loss(split, x, w, b, st):
    if split:
      ys = dense.fp8_dense_split(x, w, b, num_splits=n_splits, recipe=r, fp8_state=st)
    else:
      ys = jnp.split(dense.fp8_dense(x, w, b, recipe=r, fp8_state=st), n_splits, axis=-1)
    assert len(ys) == n_splits and all(y.shape == (2, 100, f) for y in ys)
    return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(ys, cots)), ys

  grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True, allow_int=True),
                 static_argnums=0)
  (g1, y1), (g0, y0) = grad(True, x, w, b, st), grad(False, x, w, b, st)
  for a, c in zip(jax.tree.leaves((y1, g1)), jax.tree.leaves((y0, g0))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_split_dense_argument_errors():
  x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16)
  r = recipe.Float8CurrentScaling()
  with pytest.raises(ValueError, match="multiple of num_splits"):
    dense.fp8_dense_split(x, w, num_splits=5, recipe=r)
  with pytest.raises(ValueError, match="num_splits must be an int"):
    dense.fp8_dense_split(x, w, num_splits=0, recipe=r)
  with pytest.raises(ValueError, match="num_splits must be an int"):
    dense.fp8_dense_split(x, w, num_splits=True, recipe=r)
  with pytest.raises(ValueError, match="needs fp8_state"):
    dense.fp8_dense_split(x, w, num_splits=2, recipe=recipe.DelayedScaling())


@pytest.mark.parametrize("rname", ["current", None])
def test_dense_general_split_output(rname):
  """DenseGeneral(split_output=True) returns the output unstacked along its
  first feature dim (FP8 on or off: the same values as indexing), and needs
  at least two feature dims."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 64)).astype(jnp.bfloat16)
  split = tfx.DenseGeneral(features=(3, 2, 16), split_output=True, dtype=jnp.bfloat16)
  plain = tfx.DenseGeneral(features=(3, 2, 16), dtype=jnp.bfloat16)
  with te_jax.fp8_autocast(enabled=rname is not None,
                           fp8_recipe=RECIPES[rname] if rname else None):
    v = nn.unbox(plain.init(jax.random.PRNGKey(1), x))
    parts, whole = split.apply(v, x), plain.apply(v, x)
    assert isinstance(parts, tuple) and len(parts) == 3
    for i, p in enumerate(parts):
      np.testing.assert_array_equal(np.asarray(p, np.float32),
                                    np.asarray(whole[:, :, i], np.float32))
    with pytest.raises(ValueError, match="split_output=True unstacks"):
      tfx.DenseGeneral(features=16, split_output=True).init(jax.random.PRNGKey(1), x)

def test_attention_quantizes_qkv_gradient_from_parts(monkeypatch):
  """MultiHeadAttention's fused Q/K/V projection hands its gradient to the
  concatenation quantize as three (tokens, heads * head_dim) parts (a spy on
  the op), under every recipe, and the fused K/V projection of grouped-query
  attention as two."""
  seen = []
  real = cq.concat_quantize

  def spy(parts, **kw):
    seen.append(tuple(p.shape for p in parts))
    return real(parts, **kw)
  monkeypatch.setattr(cq, "concat_quantize", spy)
  # 4 heads of 64: Q/K/V blocks of 256 columns, K and V of 2 groups 128 (the
  # blockwise recipe needs multiples of 128, else the output is split after
  # a plain FP8 dense: test_split_dense_equals_split_of_dense).
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 256)).astype(jnp.bfloat16)
  for rname, r in sorted(RECIPES.items()):
    # Grouped-query: one fused projection too, the query block twice as wide.
    for groups, want in ((None, [((128, 256),) * 3]),
                         (2, [((128, 256), (128, 128), (128, 128))])):
      seen.clear()
      mha = tfx.MultiHeadAttention(num_attention_heads=4, num_gqa_groups=groups,
                                   dtype=jnp.bfloat16, attention_impl="xla")
      with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
        # traced, not run: the spy sees the parts when the gradient is traced
        v = nn.unbox(jax.eval_shape(mha.init, jax.random.PRNGKey(1), x))
        jax.make_jaxpr(jax.grad(lambda v: jnp.sum(mha.apply(v, x).astype(jnp.float32))))(v)
      assert seen == want, (rname, groups, seen)



@pytest.fixture(scope="module")
def delayed_mha():
  """(mha, x, variables) of a MultiHeadAttention initialized under
  DelayedScaling and trained one step with it (so that the state is not the
  initial one): made once for the recipes that train it further."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 256)).astype(jnp.bfloat16)
  mha = tfx.MultiHeadAttention(num_attention_heads=4, dtype=jnp.bfloat16,
                               attention_impl="xla")
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]):
    v = nn.unbox(jax.jit(mha.init)(jax.random.PRNGKey(1), x))
    g = jax.jit(jax.grad(lambda v: jnp.sum(mha.apply(v, x).astype(jnp.float32))))(v)
    v = fp8_state.apply_fp8_updates(v, g)
  return mha, x, v


@pytest.mark.parametrize("rname", ["current", "blockwise", None])
def test_delayed_state_kept_under_other_recipes(rname, delayed_mha):
  """A MultiHeadAttention initialized under DelayedScaling and trained under
  another recipe (or FP8 off): the split Q/K/V projection's FP8 state comes
  back as its own "gradient", so TrainState.apply_gradients keeps it (zeros
  would wipe the amax histories)."""
  mha, x, v = delayed_mha
  state = v[fp8_state.FP8_COLLECTION]
  assert "qkv" in state
  with te_jax.fp8_autocast(enabled=rname is not None,
                           fp8_recipe=RECIPES[rname] if rname else None):
    g = jax.jit(jax.grad(lambda v: jnp.sum(mha.apply(v, x).astype(jnp.float32))))(v)
  got = g[fp8_state.FP8_COLLECTION]
  assert jax.tree.structure(got) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(float(np.abs(a).max()) > 0 for a in jax.tree.leaves(state["qkv"]))

# ------------------------------------------------------- CUDA (H200) -------

@pytest.mark.gpu
@pytest.mark.parametrize("mode,p2", [("tensorwise", False), ("current", False),
                                     ("blockwise", True), ("blockwise", False)])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("n,m,f", [(3, 256, 256), (3, 200, 136), (1, 130, 8), (4, 129, 264),
                                   (2, 1, 8), (2, 384, 64)])
def test_cuda_equals_quantize_of_concat(mode, p2, in_dtype, n, m, f):
  """The kernel reading the parts gives the bytes and scales of the quantize
  kernels on the concatenation, and of the reference: odd M, part widths that
  are not multiples of the 128-wide tiles (tiles straddle parts), 1 to 4
  parts, every input dtype."""
  parts = _parts(n, m, f, in_dtype, seed=n + m + f)
  out = E5M2 if mode == "current" else E4M3
  scale = np.float32(5.0) if mode == "tensorwise" else None
  got = jax.jit(lambda ps: cq.concat_quantize(ps, mode=mode, dtype=out, scale=scale,
                                              power_2_scale=p2, impl="cuda"))(parts)
  _assert_same(got, _direct(parts, mode, out, scale, p2, impl="cuda"))
  # The reference on the CPU backend: XLA's GPU float32 division is not IEEE
  # (fp8_max / amax came out 1 ulp off for some current-scaling cases), the
  # kernels' and the CPU's are (as in test_cuda_ops.py).
  cpu = jax.devices("cpu")[0]
  want = jax.jit(lambda ps: _direct(ps, mode, out, scale, p2, impl="reference"))(
      jax.device_put(parts, cpu))
  _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,p2", [("tensorwise", False), ("current", False),
                                     ("blockwise", True), ("blockwise", False)])
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("widths", [(2048, 512, 512), (128, 8, 24), (8, 256), (24, 136, 8, 40)])
@pytest.mark.parametrize("m", [1, 37, 300])
def test_cuda_equals_quantize_of_concat_unequal_widths(mode, p2, in_dtype, widths, m):
  """Parts of different widths (a grouped-query Q/K/V gradient): the bytes
  and scales of quantizing the concatenation, with part boundaries inside
  128-wide tiles, 8-column parts and partial row tiles (M of 1, 37, 300)."""
  parts = _parts_of(m, widths, in_dtype, seed=m + sum(widths))
  out = E5M2 if mode == "current" else E4M3
  scale = np.float32(5.0) if mode == "tensorwise" else None
  got = jax.jit(lambda ps: cq.concat_quantize(ps, mode=mode, dtype=out, scale=scale,
                                              power_2_scale=p2, impl="cuda"))(parts)
  _assert_same(got, _direct(parts, mode, out, scale, p2, impl="cuda"))
  cpu = jax.devices("cpu")[0]  # see test_cuda_equals_quantize_of_concat
  want = jax.jit(lambda ps: _direct(ps, mode, out, scale, p2, impl="reference"))(
      jax.device_put(parts, cpu))
  _assert_same(got, want)


@pytest.mark.gpu
def test_cuda_rejects_unaligned_parts_at_trace_time():
  with pytest.raises(ValueError, match="F_i % 8 == 0"):
    cq.concat_quantize([jnp.ones((16, 12), jnp.bfloat16)] * 3, mode="current", dtype=E4M3,
                       impl="cuda")
  with pytest.raises(ValueError, match=r"widths \[16, 12\]"):
    cq.concat_quantize([jnp.ones((16, 16), jnp.bfloat16), jnp.ones((16, 12), jnp.bfloat16)],
                       mode="current", dtype=E4M3, impl="cuda")
  with pytest.raises(ValueError, match="1 to 4 parts"):
    cq.concat_quantize([jnp.ones((16, 16), jnp.bfloat16)] * 5, mode="current", dtype=E4M3,
                       impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_attention_step_has_no_qkv_concatenation(rname):
  """On the GPU the attention backward quantizes dq, dk, dv with the
  concatenation custom call; the compiled program has no concatenate (or
  pad) producing the (tokens, 3 * heads * head_dim) gradient. (The same
  search finds the f32 concatenate of the reference path in the CPU program,
  and XLA's pad + add of the old GPU program.)"""
  mha = tfx.MultiHeadAttention(num_attention_heads=4, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 256, 512)).astype(jnp.bfloat16)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[rname]):
    v = nn.unbox(mha.init(jax.random.PRNGKey(1), x))
    hlo = jax.jit(jax.grad(lambda v: jnp.sum(mha.apply(v, x).astype(jnp.float32)))).lower(
        v).compile().as_text()
  assert "te_jax_concat_quantize_" in hlo
  big = []
  for line in hlo.splitlines():   # "%name = bf16[2,256,3,4,128]{...} concatenate(...)"
    m = re.search(r"= (?:bf16|f16|f32)\[([\d,]+)\]\S* (concatenate|pad)\(", line)
    if m and math.prod(int(d) for d in m.group(1).split(",")) == 512 * 1536:
      big.append(line.strip())
  assert not big, big
