"""Quantize references against independent numpy implementations.

Two oracles: (1) a float32 numpy + ml_dtypes implementation of the same
formula, which must agree bit for bit; (2) float64 bounds: every dequantized
value is within half an FP8 ulp of the input (relative 2**-4 for E4M3,
2**-3 for E5M2 in the normal range), never above the FP8 max.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_jax import quantize as q
from te_jax.ops import quantize as qop

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
NP_DTYPE = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
# Half an ulp relative to the value, for normal FP8 numbers (3 / 2 mantissa bits).
HALF_ULP = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
# Smallest normal: below it FP8 spacing is absolute (subnormal step / 2).
MIN_NORMAL = {E4M3: 2.0 ** -6, E5M2: 2.0 ** -14}
SUBNORMAL_HALF_STEP = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}


def _np_scale(amax, dtype, power_2=False):
  """float32 numpy version of compute_scale."""
  amax = np.float32(amax)
  if not np.isfinite(amax) or amax == 0:
    return np.float32(1.0)
  s = np.float32(np.float32(FMAX[dtype]) / amax)
  s = min(s, np.finfo(np.float32).max)
  if power_2:
    s = np.float32(2.0 ** np.floor(np.log2(np.float64(s))))
  return np.float32(s)


def _np_cast(v32, dtype):
  m = np.float32(FMAX[dtype])
  return np.clip(v32, -m, m).astype(NP_DTYPE[dtype])


def _np_blockwise(x, block, dtype, power_2):
  x = np.asarray(x, np.float32)
  m, k = x.shape
  bm, bk = block
  data = np.zeros((m, k), NP_DTYPE[dtype])
  s_inv = np.zeros((-(-m // bm), -(-k // bk)), np.float32)
  for i in range(s_inv.shape[0]):
    for j in range(s_inv.shape[1]):
      tile = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
      s = _np_scale(np.max(np.abs(tile)), dtype, power_2)
      data[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = _np_cast(tile * s, dtype)
      s_inv[i, j] = np.float32(1.0) / s
  return data, s_inv


def _bits(a):
  return np.asarray(a).view(np.uint8)


def _check_error_bound(x64, x_hat, dtype, scale):
  """|x_hat - x| within half an FP8 ulp (after scaling), for finite inputs."""
  xs = np.abs(x64) * scale
  err = np.abs(x_hat - x64) * scale
  bound = np.where(xs >= MIN_NORMAL[dtype], xs * HALF_ULP[dtype],
                   SUBNORMAL_HALF_STEP[dtype])
  assert np.all(err <= bound * (1 + 1e-6) + 1e-30), float(np.max(err - bound))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(64, 256), (7, 300), (129, 1)])
def test_tensorwise_matches_numpy_and_error_bound(dtype, shape):
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), shape), np.float64) * 3
  scale = _np_scale(np.max(np.abs(x.astype(np.float32))), dtype)
  data, amax = q.quantize_tensorwise(jnp.asarray(x, jnp.float32), scale, dtype)
  ref = _np_cast(x.astype(np.float32) * scale, dtype)
  np.testing.assert_array_equal(_bits(data), _bits(ref))
  assert float(amax) == np.float32(np.max(np.abs(x)))
  x_hat = np.asarray(data, np.float64) / np.float64(scale)
  _check_error_bound(x, x_hat, dtype, np.float64(scale))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tensorwise_saturates_and_keeps_nan(dtype):
  x = jnp.array([1e9, -1e9, jnp.inf, -jnp.inf, jnp.nan, 1.0], jnp.float32)
  data, amax = q.quantize_tensorwise(x, 1.0, dtype)
  out = np.asarray(data, np.float32)
  assert out[0] == FMAX[dtype] and out[1] == -FMAX[dtype]
  assert out[2] == FMAX[dtype] and out[3] == -FMAX[dtype]
  assert np.isnan(out[4]) and out[5] == 1.0
  assert np.isnan(float(amax))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (32, 64)])
@pytest.mark.parametrize("power_2", [False, True])
def test_blockwise_matches_numpy(dtype, block, power_2):
  x = np.array(jax.random.normal(jax.random.PRNGKey(1), (200, 300)), np.float32)
  x[:, :5] *= 1000.0  # tiles with very different ranges
  x[128:, 256:] = 0.0  # all-zero (partial) edge tiles for every block shape
  data, s_inv = q.quantize_blockwise(jnp.asarray(x), block, dtype, power_2)
  ref_data, ref_s_inv = _np_blockwise(x, block, dtype, power_2)
  assert s_inv.shape == ref_s_inv.shape == (-(-200 // block[0]), -(-300 // block[1]))
  np.testing.assert_array_equal(np.asarray(s_inv), ref_s_inv)
  np.testing.assert_array_equal(_bits(data), _bits(ref_data))
  assert np.asarray(s_inv)[-1, -1] == 1.0  # zero tile -> scale 1
  x_hat = np.asarray(q.dequantize_blockwise(data, s_inv, block), np.float64)
  scale_full = np.repeat(np.repeat(1.0 / np.asarray(s_inv, np.float64), block[0], 0),
                         block[1], 1)[:200, :300]
  err = np.abs(x_hat - x) * scale_full
  xs = np.abs(x) * scale_full
  bound = np.where(xs >= MIN_NORMAL[dtype], xs * HALF_ULP[dtype],
                   SUBNORMAL_HALF_STEP[dtype])
  assert np.all(err <= bound * (1 + 1e-6) + 1e-30)
  assert np.max(np.abs(np.asarray(data, np.float32))) <= FMAX[dtype]


def test_power_2_scales_are_powers_of_two_rounded_down():
  x = jax.random.uniform(jax.random.PRNGKey(2), (4, 512), minval=0.1, maxval=77.0)
  _, s_inv = q.quantize_blockwise(x, (1, 128), E4M3, power_2_scale=True)
  scale = 1.0 / np.asarray(s_inv, np.float64)
  assert np.all(np.log2(scale) == np.round(np.log2(scale)))
  amax = np.max(np.abs(np.asarray(x)).reshape(4, 4, 128), axis=-1)
  exact = 448.0 / amax
  assert np.all(scale <= exact) and np.all(scale > exact / 2)


def test_blockwise_nonfinite_tiles_are_nan_and_others_unaffected():
  # An Inf or NaN never saturates into a finite tile (issue 23): the tile's
  # scale, FP8 values and scale_inv are NaN, so a GEMM reading it is
  # non-finite; the other tiles are quantized as usual.
  x = np.array(jax.random.normal(jax.random.PRNGKey(3), (2, 256)), np.float32)
  x[0, 3] = np.inf
  x[1, 200] = np.nan
  data, s_inv = q.quantize_blockwise(jnp.asarray(x), (1, 128))
  s_inv = np.asarray(s_inv)
  assert np.isnan(s_inv[0, 0]) and np.isnan(s_inv[1, 1])
  assert np.isfinite(s_inv[0, 1]) and np.isfinite(s_inv[1, 0])
  assert s_inv[0, 1] != 1.0 and s_inv[1, 0] != 1.0
  out = np.asarray(data, np.float32)
  assert np.all(np.isnan(out[0, :128])) and np.all(np.isnan(out[1, 128:]))
  assert np.all(np.isfinite(out[0, 128:])) and np.all(np.isfinite(out[1, :128]))


def test_compute_scale_edge_cases():
  # 1e-37 is a normal float32 whose exact scale overflows; 3e-39 is subnormal
  # (decided on the bits: XLA may flush it to zero).
  amax = jnp.array([0.0, jnp.inf, jnp.nan, 1e-37, 2.0, -0.0, 3e-39])
  s = np.asarray(q.compute_scale(amax, E4M3))
  assert s[0] == 1 and s[5] == 1          # amax 0: scale 1
  assert np.isnan(s[1]) and np.isnan(s[2])  # non-finite amax: NaN, never a silent 1
  assert np.isfinite(s[3]) and s[3] == np.finfo(np.float32).max
  assert s[4] == 224.0
  assert s[6] == np.finfo(np.float32).max   # subnormal: TE's FLT_MAX, not scale 1
  assert float(q.compute_scale(jnp.float32(2.0), E4M3, margin=2)) == 56.0


def test_columnwise_copies():
  x = jax.random.normal(jax.random.PRNGKey(4), (256, 384))
  qt = qop.quantize_blockwise(x, (1, 128), E4M3, columnwise=True)
  d2, s2 = q.quantize_blockwise(x.T, (1, 128))
  np.testing.assert_array_equal(_bits(qt.data_t), _bits(d2))
  np.testing.assert_array_equal(qt.scale_inv_t, s2)
  qt = qop.quantize_blockwise(x, (128, 128), E4M3, columnwise=True)
  np.testing.assert_array_equal(_bits(qt.data_t), _bits(np.asarray(qt.data).T))
  np.testing.assert_array_equal(qt.scale_inv_t, np.asarray(qt.scale_inv).T)
  qt = qop.quantize_tensorwise(x, jnp.float32(3.0), E5M2, columnwise=True)
  np.testing.assert_array_equal(_bits(qt.data_t), _bits(np.asarray(qt.data).T))


def test_bad_inputs_name_the_argument():
  x = jnp.ones((4, 128))
  with pytest.raises(ValueError, match="block_shape"):
    q.quantize_blockwise(x, (0, 128))
  with pytest.raises(ValueError, match="x must be 2-D"):
    q.quantize_blockwise(jnp.ones((2, 3, 128)))
  with pytest.raises(TypeError, match="dtype"):
    q.quantize_blockwise(x, (1, 128), jnp.int8)
  with pytest.raises(TypeError, match="x must be"):
    q.quantize_tensorwise(jnp.ones((4,), jnp.int32), 1.0)
  with pytest.raises(ValueError, match="scale must be a scalar"):
    q.quantize_tensorwise(x, jnp.ones((2,)))
  data, s_inv = q.quantize_blockwise(x)
  with pytest.raises(ValueError, match="scale_inv must have shape"):
    q.dequantize_blockwise(data, s_inv[:, :0])
  with pytest.raises(ValueError, match="impl"):
    q.quantize_blockwise(x, impl="triton")


def test_gemm_rejects_non_fp8_operands():
  from te_jax import ScaledTensor
  from te_jax.ops import gemm as gemm_op
  a = ScaledTensor(jnp.ones((16, 32), jnp.bfloat16), jnp.float32(1.0))
  b = ScaledTensor(jnp.ones((16, 32), jnp.float8_e4m3fn), jnp.float32(1.0))
  with pytest.raises(TypeError, match="a.data must be float8"):
    gemm_op.gemm(a, b)


def test_quantize_from_amax_reference():
  x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 96)) * 3, jnp.bfloat16)
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  for dtype in (E4M3, E5M2):
    cur = qop.quantize_current(x, dtype, columnwise=True, impl="reference")
    frm = qop.quantize_from_amax(x, amax, dtype, columnwise=True, impl="reference")
    np.testing.assert_array_equal(np.asarray(frm.data, np.float32),
                                  np.asarray(cur.data, np.float32))
    np.testing.assert_array_equal(np.asarray(frm.data_t, np.float32),
                                  np.asarray(cur.data_t, np.float32))
    assert float(frm.scale_inv) == float(cur.scale_inv)
  # a larger (e.g. mesh-wide) amax gives a smaller scale
  s_one = qop.quantize_from_amax(x, amax, E4M3, impl="reference").scale_inv
  s_big = qop.quantize_from_amax(x, 4 * amax, E4M3, impl="reference").scale_inv
  assert float(s_big) == pytest.approx(4 * float(s_one), rel=1e-6)
  with pytest.raises(ValueError, match="amax must be a scalar"):
    qop.quantize_from_amax(x, jnp.ones((2,)), E4M3)


def test_every_quantize_op_returns_a_quantized_tensor():
  """One result type for the quantize family: fields by name, a pytree (so it
  crosses jit), rowwise()/columnwise() as GEMM operands."""
  from te_jax import ScaledTensor
  from te_jax.ops.fp8 import QuantizedTensor
  x = jax.random.normal(jax.random.PRNGKey(5), (64, 256))
  cases = {
      "tensorwise": lambda c: qop.quantize_tensorwise(x, jnp.float32(4.0), E4M3,
                                                       columnwise=c),
      "current": lambda c: qop.quantize_current(x, E4M3, columnwise=c),
      "from_amax": lambda c: qop.quantize_from_amax(x, jnp.float32(8.0), E4M3,
                                                     columnwise=c),
      "blockwise": lambda c: qop.quantize_blockwise(x, (1, 128), E4M3, columnwise=c),
  }
  for name, op in cases.items():
    both, row = op(True), op(False)
    assert isinstance(both, QuantizedTensor) and isinstance(row, QuantizedTensor), name
    assert both.data.shape == (64, 256) and both.data_t.shape == (256, 64), name
    assert row.data_t is None and row.scale_inv_t is None, name
    with pytest.raises(ValueError, match="no columnwise copy"):
      row.columnwise()
    r, c = both.rowwise(), both.columnwise()
    assert isinstance(r, ScaledTensor) and isinstance(c, ScaledTensor), name
    assert r.data is both.data and r.scale_inv is both.scale_inv
    assert c.data is both.data_t and c.scale_inv is both.scale_inv_t
    assert r.block_shape == c.block_shape == both.block_shape, name
    if name == "blockwise":
      assert both.block_shape == (1, 128) and both.amax is None
      assert both.scale_inv.shape == (64, 2) and both.scale_inv_t.shape == (256, 1)
    else:
      assert both.block_shape is None and both.scale_inv.shape == () and both.amax.shape == ()
      assert float(both.scale_inv_t) == float(both.scale_inv)
    # a pytree: through jit and back, field for field
    out = jax.jit(lambda: op(True))()
    assert jax.tree.structure(out) == jax.tree.structure(both), name
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(both)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # per-tensor values: scale_inv = 1/scale, amax = max|x| (or the given amax)
  t = cases["tensorwise"](False)
  assert float(t.scale_inv) == 0.25 and float(t.amax) == float(jnp.max(jnp.abs(x)))
  assert float(cases["from_amax"](False).amax) == 8.0
  assert float(cases["from_amax"](False).scale_inv) == np.float32(1) / np.float32(448 / 8)


def test_references_return_quantized_tensors():
  """The *_reference functions return what their dispatchers return off the GPU."""
  from te_jax.ops.fp8 import QuantizedTensor
  x = jax.random.normal(jax.random.PRNGKey(6), (48, 300))
  pairs = [
      (qop.quantize_tensorwise_reference(x, jnp.float32(2.0), E5M2, columnwise=True),
       qop.quantize_tensorwise(x, jnp.float32(2.0), E5M2, columnwise=True, impl="reference")),
      (qop.quantize_current_reference(x, E5M2, columnwise=True),
       qop.quantize_current(x, E5M2, columnwise=True, impl="reference")),
      (qop.quantize_from_amax_reference(x, jnp.float32(3.0), E5M2, columnwise=True),
       qop.quantize_from_amax(x, jnp.float32(3.0), E5M2, columnwise=True, impl="reference")),
      (qop.quantize_blockwise_reference(x, (32, 64), E5M2, True, columnwise=True),
       qop.quantize_blockwise(x, (32, 64), E5M2, True, columnwise=True, impl="reference")),
  ]
  for ref, disp in pairs:
    assert isinstance(ref, QuantizedTensor) and ref.block_shape == disp.block_shape
    assert jax.tree.structure(ref) == jax.tree.structure(disp)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(disp)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # columnwise defaults to False for the references
  assert qop.quantize_current_reference(x, E5M2).data_t is None
  assert qop.quantize_blockwise_reference(x).data_t is None
