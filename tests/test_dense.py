"""The functional FP8 dense: numerics, wiring of the custom VJP, transforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import dense, fp8_state, recipe
from te_jax.ops import quantize as qop

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
    "blockwise_hybrid": recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID,
                                                  power_2_scale=False),
}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(m=3 * 100, k=256, n=384, seed=0, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k1, (3, m // 3, k), dtype)
  w = (jax.random.normal(k2, (k, n)) * k ** -0.5).astype(dtype)
  b = jax.random.normal(k3, (n,), dtype)
  return x, w, b


def _state_for(r, warm_x=None, warm_w=None):
  """A delayed-scaling state warmed by one step (so scales are not 1)."""
  if not isinstance(r, recipe.DelayedScaling):
    return None
  st = fp8_state.init_dense_state(r.amax_history_len)
  return jax.grad(lambda s: jnp.sum(jnp.sin(dense.fp8_dense(warm_x, warm_w, recipe=r,
                                                            fp8_state=s))))(st)


def _loss(y):
  return jnp.sum(jnp.sin(y))


# Tolerances on the relative Frobenius error against float32. FP8 rounds each
# operand with a relative error of at most half an ulp: 2**-4 for E4M3 (rms
# about 2.5% over a random mantissa), 2**-3 for E5M2. Products of two
# quantized operands, summed over K with random signs, keep roughly that rms
# error times sqrt(2). Measured on these inputs: forward 2.3%, E4M3 grads
# 4.4%, E5M2 grads 5.9%. The bounds leave ~1.5x headroom over those.
FWD_TOL = 0.04
GRAD_TOL = {jnp.dtype(jnp.float8_e4m3fn): 0.065, jnp.dtype(jnp.float8_e5m2): 0.09}


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_and_grads_close_to_fp32(name):
  r = RECIPES[name]
  x, w, b = _inputs()
  st = _state_for(r, x, w)
  ref_y = x @ w + b
  ref_g = jax.grad(lambda x, w, b: _loss(x @ w + b), (0, 1, 2))(x, w, b)
  f = lambda x, w, b: _loss(dense.fp8_dense(x, w, b, recipe=r, fp8_state=st))
  y = dense.fp8_dense(x, w, b, recipe=r, fp8_state=st)
  g = jax.jit(jax.grad(f, (0, 1, 2)))(x, w, b)
  assert y.shape == (3, 100, 384) and y.dtype == x.dtype
  assert _rel(y, ref_y) < FWD_TOL
  tol = GRAD_TOL[jnp.dtype(r.bwd_dtype)]
  assert _rel(g[0], ref_g[0]) < tol and _rel(g[1], ref_g[1]) < tol
  # the bias gradient is the plain f32 sum of the incoming gradient cos(y)
  assert _rel(g[2], jnp.sum(jnp.cos(y), axis=(0, 1))) < 1e-5


def _emulated(x2d, w, g, r, st):
  """Independent quantize-dequantize emulation of the three FP8 GEMMs."""
  def blocks(t, block, dtype):
    q = qop.quantize_blockwise_reference(t, block, dtype, r.power_2_scale)
    return q.data, q.scale_inv

  def qd(t, role):
    dtype = r.bwd_dtype if role == "grad" else r.fwd_dtype
    if isinstance(r, recipe.Float8BlockScaling):
      if role == "kernel":
        return qop.dequantize_blockwise_reference(
            *blocks(t, (128, 128), dtype), (128, 128)), None
      rows = qop.dequantize_blockwise_reference(*blocks(t, (1, 128), dtype), (1, 128))
      cols = qop.dequantize_blockwise_reference(*blocks(t.T, (1, 128), dtype), (1, 128)).T
      return rows, cols
    if st is None:
      scale = qop.compute_scale(jnp.max(jnp.abs(t)), dtype)
    else:
      scale = fp8_state.scale_from_state(st[role])
    d = qop.saturating_cast(t * scale, dtype).astype(jnp.float32) / scale
    return d, d
  hp = jax.lax.Precision.HIGHEST
  xr, xc = qd(x2d, "x")
  wr, _ = qd(w, "kernel")
  gr, gc = qd(g, "grad")
  return (jnp.dot(xr, wr, precision=hp), jnp.dot(gr, wr.T, precision=hp),
          jnp.dot(xc.T, gc, precision=hp))


@pytest.mark.parametrize("name", list(RECIPES))
def test_custom_vjp_quantizes_the_right_operands(name):
  """fprop/dgrad/wgrad equal an emulation that quantizes exactly as docs/design.md says."""
  r = RECIPES[name]
  x, w, _ = _inputs(m=3 * 128)
  x2d = x.reshape(-1, x.shape[-1])
  g = jax.random.normal(jax.random.PRNGKey(9), (3 * 128, 384))
  st = _state_for(r, x, w)
  y, vjp = jax.vjp(lambda x, w: dense.fp8_dense(x, w, recipe=r, fp8_state=st), x2d, w)
  dx, dw = vjp(g)
  ey, edx, edw = _emulated(x2d, w, g, r, st)
  for got, want in ((y, ey), (dx, edx), (dw, edw)):
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise"])
def test_padding_never_changes_the_result(name):
  r = RECIPES[name]
  x, w, b = _inputs(m=3 * 37, k=200, n=72)  # no dim a multiple of 16 or 128
  st = _state_for(r, x, w)
  f = lambda x: _loss(dense.fp8_dense(x, w, b, recipe=r, fp8_state=st))
  y = dense.fp8_dense(x, w, b, recipe=r, fp8_state=st)
  gx = jax.grad(f)(x)
  # The same tokens followed by explicit zero tokens.
  xz = jnp.concatenate([x.reshape(-1, 200), jnp.zeros((17, 200))], 0)
  yz = dense.fp8_dense(xz, w, b, recipe=r, fp8_state=st)
  np.testing.assert_array_equal(np.asarray(y).reshape(-1, 72), np.asarray(yz)[:111])
  gz = jax.grad(lambda xz: _loss(dense.fp8_dense(xz, w, b, recipe=r, fp8_state=st)
                                 [:111]))(xz)
  np.testing.assert_array_equal(np.asarray(gx).reshape(-1, 200), np.asarray(gz)[:111])
  assert _rel(y, x @ w + b) < FWD_TOL


def test_delayed_state_history_and_scale_over_steps():
  """Scale at step t comes from amaxes before t; margin and both algorithms."""
  x, w, _ = _inputs(m=48, k=32, n=32)
  factors = [1.0, 8.0, 0.5, 2.0]
  for algo in ("max", "most_recent"):
    r = recipe.DelayedScaling(amax_history_len=3, margin=1, amax_compute_algo=algo)
    st = fp8_state.init_dense_state(3)
    hist = []
    for f in factors:
      xs = x * f
      used_scale = float(fp8_state.scale_from_state(st["x"]))
      # step t quantizes with the scale from earlier steps (1 at the start)
      want = 1.0 if not hist else 448.0 / (max(hist[-3:]) if algo == "max"
                                           else hist[-1]) / 2
      assert used_scale == pytest.approx(want, rel=1e-6)
      st = jax.grad(lambda s: _loss(dense.fp8_dense(xs, w, recipe=r, fp8_state=s)))(st)
      hist.append(float(jnp.max(jnp.abs(xs))))
      np.testing.assert_allclose(st["x"]["amax_history"], hist[::-1][:3] +
                                 [0.0] * (3 - len(hist[-3:])), rtol=1e-6)
    assert float(st["kernel"]["amax_history"][0]) == pytest.approx(
        float(jnp.max(jnp.abs(w))))
    assert float(st["grad"]["amax_history"][0]) > 0  # came back through backward


def test_nonfinite_amax_keeps_the_previous_scale():
  r = recipe.DelayedScaling(amax_history_len=2)
  x, w, _ = _inputs(m=48, k=32, n=32)
  st = fp8_state.init_dense_state(2)
  st = jax.grad(lambda s: _loss(dense.fp8_dense(x, w, recipe=r, fp8_state=s)))(st)
  before = float(st["x"]["scale"])
  xbad = x.at[0, 0, 0].set(jnp.inf)
  st2 = jax.grad(lambda s: jnp.sum(dense.fp8_dense(xbad, w, recipe=r, fp8_state=s)))(st)
  assert float(st2["x"]["scale"]) == before
  assert np.all(np.isfinite(np.asarray(st2["x"]["amax_history"])))


def test_jit_scan_and_checkpoint_agree_with_eager():
  r = RECIPES["delayed"]
  x, _, _ = _inputs(m=3 * 32, k=64, n=64)
  ws = jax.random.normal(jax.random.PRNGKey(5), (3, 64, 64)) * 0.125
  states = jax.tree.map(lambda *a: jnp.stack(a), *[fp8_state.init_dense_state(4)] * 3)

  def unrolled(ws, states):
    h = x
    for i in range(3):
      h = jnp.tanh(dense.fp8_dense(h, ws[i], recipe=r,
                                   fp8_state=jax.tree.map(lambda s: s[i], states)))
    return jnp.sum(h ** 2)

  def scanned(ws, states, remat=False):
    def body(h, layer):
      w, s = layer
      return jnp.tanh(dense.fp8_dense(h, w, recipe=r, fp8_state=s)), None
    if remat:
      body = jax.checkpoint(body)
    h, _ = jax.lax.scan(body, x, (ws, states))
    return jnp.sum(h ** 2)

  want = jax.grad(unrolled, (0, 1))(ws, states)
  for fn in (jax.jit(jax.grad(unrolled, (0, 1))),
             jax.jit(jax.grad(scanned, (0, 1))),
             jax.jit(jax.grad(functools.partial(scanned, remat=True), (0, 1)))):
    got = fn(ws, states)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # every layer's state was updated through the backward pass
  assert np.all(np.asarray(want[1]["grad"]["amax_history"][:, 0]) > 0)


def test_microbatch_accumulation_merges_amax_with_max():
  """Two microbatches accumulate to exactly the state of one big batch."""
  r = RECIPES["delayed"]
  x, w, _ = _inputs(m=3 * 64, k=64, n=32)
  x = x.at[0].multiply(10.0)  # microbatch 0 has the larger amax
  st = fp8_state.init_dense_state(4)
  variables = {"params": {"w": w}, fp8_state.FP8_COLLECTION: st}

  def loss(v, xb):
    return jnp.sum(dense.fp8_dense(xb, v["params"]["w"], recipe=r,
                                   fp8_state=v[fp8_state.FP8_COLLECTION]) ** 2)

  big = jax.grad(loss)(variables, x)
  g0 = jax.grad(loss)(variables, x[:1])
  g1 = jax.grad(loss)(variables, x[1:])
  acc = fp8_state.accumulate_gradients(g0, g1)
  for a, b in zip(jax.tree.leaves(acc[fp8_state.FP8_COLLECTION]),
                  jax.tree.leaves(big[fp8_state.FP8_COLLECTION])):
    np.testing.assert_array_equal(a, b)
  # a plain sum would have doubled the history: make sure we did not
  summed = jax.tree.map(jnp.add, g0, g1)
  assert not np.allclose(summed[fp8_state.FP8_COLLECTION]["x"]["amax_history"],
                         big[fp8_state.FP8_COLLECTION]["x"]["amax_history"])
  np.testing.assert_allclose(acc["params"]["w"], g0["params"]["w"] + g1["params"]["w"])
  # scan over microbatches with a zeros accumulator gives the same state
  def step(carry, xb):
    return fp8_state.accumulate_gradients(carry, jax.grad(loss)(variables, xb[None])), None
  zeros = jax.tree.map(jnp.zeros_like, variables)
  scanned, _ = jax.lax.scan(step, zeros, x)
  for a, b in zip(jax.tree.leaves(scanned[fp8_state.FP8_COLLECTION]),
                  jax.tree.leaves(big[fp8_state.FP8_COLLECTION])):
    np.testing.assert_array_equal(a, b)


def test_plain_dense_without_recipe():
  x, w, b = _inputs(m=30, k=16, n=8)
  np.testing.assert_allclose(dense.dense(x, w, b), x @ w + b, rtol=1e-6)


def test_bad_inputs_name_the_argument():
  x, w, b = _inputs(m=30, k=16, n=8)
  r = RECIPES["current"]
  with pytest.raises(ValueError, match="kernel's first dim"):
    dense.fp8_dense(x, w.T, recipe=r)
  with pytest.raises(ValueError, match="kernel must be 2-D"):
    dense.fp8_dense(x, w[None], recipe=r)
  with pytest.raises(ValueError, match="bias must have shape"):
    dense.fp8_dense(x, w, b[:3], recipe=r)
  with pytest.raises(TypeError, match="x must be"):
    dense.fp8_dense(x.astype(jnp.int32), w, recipe=r)
  with pytest.raises(ValueError, match="needs fp8_state"):
    dense.fp8_dense(x, w, recipe=RECIPES["delayed"])
  with pytest.raises(ValueError, match="fp8_state must be None"):
    dense.fp8_dense(x, w, recipe=r, fp8_state=fp8_state.init_dense_state(2))
  with pytest.raises(TypeError, match="recipe must be"):
    dense.fp8_dense(x, w, recipe="delayed")


def test_zero_amax_state_merges_exactly():
  """A microbatch whose amax is 0 must not win the max-merge with scale 1."""
  r = recipe.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
  st = fp8_state.init_tensor_state(1)
  upd = lambda a: fp8_state.update_tensor_state(st, jnp.float32(a), r, jnp.float8_e5m2)
  zero, real = upd(0.0), upd(5.0)
  assert float(fp8_state.scale_from_state(zero)) == 1.0  # amax 0 -> scale 1
  merged = jax.tree.map(jnp.maximum, zero, real)
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(real)):
    np.testing.assert_array_equal(a, b)
  assert float(fp8_state.scale_from_state(merged)) == pytest.approx(57344.0 / 5.0)
