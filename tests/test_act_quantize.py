"""Fused activation + FP8 quantize (te_jax/ops/act_quantize.py).

CPU (CI): the pure-JAX spec against independent oracles:
  * activations in float64 numpy (their textbook formulas) and derivatives
    by central finite differences of those, within float32 accuracy;
  * the quantized outputs bit for bit against a numpy float32 + ml_dtypes
    quantizer applied to the reference's float32 v (so no bf16 rounding of v
    sneaks in), and within half an FP8 ulp of the float64 v;
  * argument errors.
  * output selection (one copy, or dact's extra columnwise act(h)) against
    the both-copies results and the forward's act_quantize, bit for bit; the
    CUDA program's custom call asks for exactly the selected copies (lowered
    for CUDA without a GPU).
GPU (``gpu`` marker, skipped elsewhere): the CUDA path against the reference
evaluated on the CPU backend (IEEE division; see test_cuda_ops.py), and the
selected or extra outputs against the CUDA kernels' own both-copies results
bit for bit.
"""

import math
import re
import zlib

import jax
import jax.numpy as jnp
import flax.linen as nn
import ml_dtypes
import numpy as np
import pytest

from te_jax.ops import _native
from te_jax.ops import act_quantize as aq
from te_jax.ops import quantize as quantize_op
from te_jax.ops.fp8 import QuantizedTensor

from cuda_lowering import cuda_text, custom_calls, gpu_host  # pylint: disable=unused-import

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FMAX = {E4M3: 448.0, E5M2: 57344.0}
NP_FP8 = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
# Half an FP8 ulp relative to the value (normal range) and half the subnormal
# step below the smallest normal.
HALF_ULP = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
MIN_NORMAL = {E4M3: 2.0 ** -6, E5M2: 2.0 ** -14}
SUB_HALF_STEP = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
# float32 reference vs float64 oracle over [-9, 9], measured: values within
# 1.2e-6 absolute (silu(9) = 9: 1.3e-7 relative), derivatives within 3.5e-6
# (gelu' near x = -5, where 1 + tanh(u) cancels in float32 as it does in
# jax.nn.gelu) and 2.6e-5 relative where they are small (tanh', 1 - t^2).
# Formula mistakes show up orders of magnitude above these bounds.
RTOL, ATOL = 3e-5, 5e-6

NAMES = aq.ACTIVATION_NAMES
# Gated pairs that put every activation in both positions.
PAIRS = [("silu", "linear"), ("gelu", "linear"), ("gelu_exact", "sigmoid"),
         ("relu", "tanh"), ("quick_gelu", "gelu"), ("linear", "swish"),
         ("sigmoid", "gelu_exact"), ("tanh", "relu"), ("swish", "quick_gelu")]


# ------------------------------------------------------------- oracles ---

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _np_act(name, x):
  """float64 textbook formulas (independent of the float32 spec's)."""
  x = np.asarray(x, np.float64)
  if name == "linear":
    return x
  if name == "gelu":
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
  if name == "gelu_exact":
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))
  if name == "relu":
    return np.maximum(x, 0.0)
  if name in ("silu", "swish"):
    return x / (1.0 + np.exp(-x))
  if name == "sigmoid":
    return 1.0 / (1.0 + np.exp(-x))
  if name == "tanh":
    return np.tanh(x)
  if name == "quick_gelu":
    return x / (1.0 + np.exp(-1.702 * x))
  raise AssertionError(name)


def _np_dact(name, x):
  """Central finite difference of the float64 oracle (truncation ~1e-10)."""
  x = np.asarray(x, np.float64)
  e = 1e-5
  return (_np_act(name, x + e) - _np_act(name, x - e)) / (2 * e)


def _np_dact_terms(name, x):
  """float64 sum of the magnitudes of the terms the kernels add to form
  act'(x) (activation.h): the scale of act'(x)'s float32 error, which a
  difference of nearly equal terms keeps while the result shrinks (gelu'
  = cdf + x pdf vanishes near x = -0.75, silu' = s + x s (1 - s) near
  -1.28). Equal to |act'(x)| where nothing cancels."""
  x = np.asarray(x, np.float64)
  if name == "gelu_exact":
    return 0.5 * (1.0 + _erf(x / np.sqrt(2.0))) + np.abs(x) * np.exp(-0.5 * x * x) / np.sqrt(
        2.0 * np.pi)
  if name == "gelu":
    k = np.sqrt(2.0 / np.pi)
    t = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + np.abs(x * 0.5 * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x))
  if name in ("silu", "swish", "quick_gelu"):
    a = 1.702 if name == "quick_gelu" else 1.0
    s = 1.0 / (1.0 + np.exp(-a * x))
    return s + np.abs(a * x * s * (1.0 - s))
  return np.abs(_np_dact(name, x))  # linear, relu, sigmoid, tanh: products


def _np_backward_terms(dz, h, acts):
  """_np_backward with every derivative replaced by _np_dact_terms and every
  factor by its magnitude: the float32 error scale of each element of dh."""
  dz, h = np.abs(np.asarray(dz, np.float64)), np.asarray(h, np.float64)
  f = dz.shape[1]
  if len(acts) == 1:
    return dz * _np_dact_terms(acts[0], h)
  h0, h1 = h[:, :f], h[:, f:]
  return np.concatenate([dz * _np_dact_terms(acts[0], h0) * np.abs(_np_act(acts[1], h1)),
                         dz * np.abs(_np_act(acts[0], h0)) * _np_dact_terms(acts[1], h1)],
                        axis=1)


def _np_forward(h, acts):
  h = np.asarray(h, np.float64)
  f = h.shape[1] // len(acts)
  z = _np_act(acts[0], h[:, :f])
  return z if len(acts) == 1 else z * _np_act(acts[1], h[:, f:])


def _np_backward(dz, h, acts):
  dz, h = np.asarray(dz, np.float64), np.asarray(h, np.float64)
  f = dz.shape[1]
  if len(acts) == 1:
    return dz * _np_dact(acts[0], h)
  h0, h1 = h[:, :f], h[:, f:]
  return np.concatenate([dz * _np_dact(acts[0], h0) * _np_act(acts[1], h1),
                         dz * _np_act(acts[0], h0) * _np_dact(acts[1], h1)], axis=1)


def _np_scale(amax, dtype, pow2):
  """compute_scale() in numpy float32 (IEEE division)."""
  amax = np.asarray(amax, np.float32)
  valid = np.isfinite(amax) & (amax > 0)
  with np.errstate(divide="ignore", over="ignore"):
    s = np.float32(FMAX[dtype]) / np.where(valid, amax, np.float32(1))
  s = np.minimum(s, np.finfo(np.float32).max).astype(np.float32)
  if pow2:
    s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
  return np.where(valid, s, np.float32(1)).astype(np.float32)


def _np_cast(v32, dtype):
  m = np.float32(FMAX[dtype])
  return np.clip(v32, -m, m).astype(NP_FP8[dtype])


def _np_blockwise_1x128(v32, dtype, pow2):
  """1x128 tiles along the last dim: (data, scale_inv (M, ceil(W/128)), scale)."""
  m, w = v32.shape
  wt = -(-w // 128)
  vp = np.zeros((m, wt * 128), np.float32)
  vp[:, :w] = v32
  tiles = vp.reshape(m, wt, 128)
  scale = _np_scale(np.max(np.abs(tiles), axis=2), dtype, pow2)
  data = _np_cast(tiles * scale[:, :, None], dtype).reshape(m, -1)[:, :w]
  return data, (np.float32(1) / scale).astype(np.float32), scale


def _bits(a):
  return np.asarray(a).view(np.uint8)


def _check_half_ulp(data, scale, v64, slack, dtype):
  """|fp8 - v * scale| <= half an FP8 ulp (+ the float32 error of v), with v
  clipped to the FP8 range; `scale` broadcasts against v64."""
  scale = np.asarray(scale, np.float64)
  x = np.clip(v64 * scale, -FMAX[dtype], FMAX[dtype])
  got = np.asarray(data, np.float64)
  bound = np.where(np.abs(x) >= MIN_NORMAL[dtype], np.abs(x) * HALF_ULP[dtype],
                   SUB_HALF_STEP[dtype]) + slack * scale
  err = np.abs(got - x)
  assert np.all(err <= bound * (1 + 1e-6)), float(np.max(err - bound))


# --------------------------------------------------- activation formulas ---

M, F = 72, 200  # partial 1x128 tiles along both dims; every test uses these
# shapes so that the op-by-op (eager) compilations are shared across tests.


def _points():
  """(M, F): a dense grid over [-9, 9] (where every activation saturates) plus
  tiny values and 0 (the last element)."""
  x = np.concatenate([np.linspace(-9.0, 9.0, M * F - 5), [1e-30, -1e-30, 1e-6, -1e-6, 0.0]])
  return x.astype(np.float32).reshape(M, F)


@pytest.mark.parametrize("name", NAMES)
def test_activation_values_and_derivatives(name):
  x = _points()
  got = np.asarray(aq.activation_forward(jnp.asarray(x), (name,)), np.float64)
  np.testing.assert_allclose(got, _np_act(name, x), rtol=RTOL, atol=ATOL)

  dgot = np.asarray(aq.activation_backward(jnp.ones_like(x), jnp.asarray(x), (name,)),
                    np.float64)
  keep = np.ones_like(x, bool) if name != "relu" else np.abs(x) > 1e-3  # kink at 0
  np.testing.assert_allclose(dgot[keep], _np_dact(name, x)[keep], rtol=RTOL, atol=ATOL)
  if name == "relu":
    assert float(dgot[-1, -1]) == 0.0  # relu'(0) = 0, as jax.nn.relu


@pytest.mark.parametrize("name", NAMES)
def test_dact_terms_bound_the_derivative(name):
  """_np_dact_terms (the GPU comparison's error scale for blockwise scales)
  is at least |act'(x)|, equal to it where the kernels add no terms of
  opposite sign, and far above it at the zeros of gelu' and silu'."""
  x = _points().astype(np.float64)
  terms, d = _np_dact_terms(name, x), np.abs(_np_dact(name, x))
  assert np.all(terms >= d * (1 - 1e-6) - 1e-9)
  if name in ("linear", "relu", "sigmoid", "tanh"):
    np.testing.assert_allclose(terms, d, rtol=1e-6, atol=1e-9)
  else:
    np.testing.assert_allclose(terms[x > 0], d[x > 0], rtol=1e-6, atol=1e-9)  # all terms >= 0
    zero = {"gelu": -0.7517916, "gelu_exact": -0.7517916, "silu": -1.2784645,
            "swish": -1.2784645, "quick_gelu": -1.2784645 / 1.702}[name]
    near = np.array([zero])
    assert _np_dact_terms(name, near)[0] > 1e3 * abs(_np_dact(name, near)[0])


def test_activations_match_flax():
  """The names mean what flax's do (LayerNormMLP's table)."""
  x = jnp.asarray(_points())
  flax_fns = {"gelu": lambda v: nn.gelu(v, approximate=True),
              "gelu_exact": lambda v: nn.gelu(v, approximate=False),
              "relu": nn.relu, "silu": nn.silu, "swish": nn.silu, "sigmoid": nn.sigmoid,
              "tanh": jnp.tanh, "quick_gelu": lambda v: v * nn.sigmoid(1.702 * v),
              "linear": lambda v: v}
  assert set(flax_fns) == set(NAMES)
  for name, fn in flax_fns.items():
    # flax's function evaluated in float64: in float32 its gelu, 0.5 x (1 +
    # tanh u), cancels where tanh u is within a few ulps of -1 and so depends
    # on how XLA's float32 tanh rounds there (the LLVM IR emitters that the
    # test run's XLA flags select, tests/conftest.py, round it otherwise than
    # the MLIR ones); ours (x * sigmoid(2u)) keeps the tiny true value.
    with jax.enable_x64(True):
      want = np.asarray(fn(jnp.asarray(_points(), jnp.float64)))
    np.testing.assert_allclose(np.asarray(aq.activation_forward(x, (name,))),
                               want, rtol=1e-6, atol=1e-7, err_msg=name)
    # The table's jax_fn (what LayerNormMLP's unfused path applies) is flax's.
    np.testing.assert_allclose(np.asarray(aq.ACTIVATIONS[name].jax_fn(x)),
                               np.asarray(fn(x)), rtol=1e-6, atol=1e-7, err_msg=name)


def test_kernel_ids_match_the_cuda_enum():
  """Each table entry's kernel_id is the ActId the kernels switch on
  (custom_calls/kernels/quantize.h), "swish" sharing silu's."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  header = (pathlib.Path(__file__).resolve().parents[1] / "custom_calls" / "kernels" /
            "quantize.h").read_text()
  enum = re.search(r"enum ActId : int \{(.*?)\};", header, re.S).group(1)
  ids = {re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(1)).lower(): int(m.group(2))
         for m in re.finditer(r"kAct(\w+) = (\d+)", enum)}
  ids["swish"] = ids["silu"]
  assert {n: a.kernel_id for n, a in aq.ACTIVATIONS.items()} == ids
  assert len(set(ids.values())) == int(re.search(r"kNumAct = (\d+)", enum).group(1))


def test_activation_nonfinite_inputs():
  """The spec's behaviour on inf/NaN (the kernels mirror the formulas)."""
  x = np.zeros((M, F), np.float32)
  x[0, :5] = [np.inf, -np.inf, np.nan, -100.0, 100.0]
  x = jnp.asarray(x)
  f = lambda n: np.asarray(aq.activation_forward(x, (n,)))
  np.testing.assert_array_equal(f("sigmoid")[0, :2], [1.0, 0.0])
  np.testing.assert_array_equal(f("tanh")[0, :2], [1.0, -1.0])
  assert np.isnan(f("relu")[0, 2])  # relu keeps NaN (as jnp.maximum)
  d = np.asarray(aq.activation_backward(jnp.ones_like(x), x, ("silu",)))
  assert np.all(np.isfinite(d[0, 3:5]))  # no inf * 0 for large finite |x|


@pytest.mark.parametrize("acts", PAIRS[:5])
def test_gated_forward_backward(acts):
  rng = np.random.default_rng(0)
  h = (rng.standard_normal((M, 2 * F)) * 3).astype(np.float32)
  dz = rng.standard_normal((M, F)).astype(np.float32)
  z = np.asarray(aq.activation_forward(jnp.asarray(h), acts), np.float64)
  assert z.shape == (M, F)
  np.testing.assert_allclose(z, _np_forward(h, acts), rtol=2 * RTOL, atol=4 * ATOL)
  dh = np.asarray(aq.activation_backward(jnp.asarray(dz), jnp.asarray(h), acts), np.float64)
  assert dh.shape == (M, 2 * F)
  keep = ~_relu_kink(acts, h)  # finite differences straddle relu's kink
  np.testing.assert_allclose(dh[keep], _np_backward(dz, h, acts)[keep],
                             rtol=4 * RTOL, atol=8 * ATOL)


def test_backward_is_the_gradient():
  """activation_backward == jax.vjp of activation_forward (another oracle)."""
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.standard_normal((M, 2 * F)) * 3, F32)
  dz = jnp.asarray(rng.standard_normal((M, F)), F32)
  sets = (("gelu", "linear"), ("gelu_exact", "silu"), ("quick_gelu", "tanh"))
  # One jit for the three (eager vjp compiles op by op).
  got, want = jax.jit(lambda dz, h: (
      [aq.activation_backward(dz, h, a) for a in sets],
      [jax.vjp(lambda v, a=a: aq.activation_forward(v, a), h)[1](dz)[0] for a in sets]))(dz, h)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------- quantization ---


def _inputs(acts, seed, h_dtype=BF16, dz_dtype=BF16):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((M, len(acts) * F)) * 3, h_dtype)
  dz = jnp.asarray(rng.standard_normal((M, F)), dz_dtype)
  return h, dz


def _relu_kink(acts, h):
  """(M, n_act*F) mask of the dh elements that take relu' within 1e-4 of 0."""
  f = h.shape[1] // len(acts)
  parts = [h[:, i * f:(i + 1) * f] for i in range(len(acts))]
  return np.concatenate([(np.abs(parts[i]) < 1e-4) & (a == "relu")
                         for i, a in enumerate(acts)], axis=1)


def _call(direction, acts, h, dz, **kw):
  if direction == "fwd":
    return aq.act_quantize(h, acts, impl="reference", **kw)
  return aq.dact_quantize(dz, h, acts, impl="reference", **kw)


def _v(direction, acts, h, dz):
  """(v as the reference's float32, v as the float64 oracle)."""
  if direction == "fwd":
    return np.asarray(aq.activation_forward(h, acts)), _np_forward(h, acts)
  return np.asarray(aq.activation_backward(dz, h, acts)), _np_backward(dz, h, acts)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("gated", [False, True])
def test_quantize_matches_numpy_and_half_ulp(direction, mode, gated):
  dtype = E4M3 if direction == "fwd" else E5M2
  # Both settings of power_2_scale where it exists (a blockwise option; the
  # per-tensor modes refuse it: test_power_2_scale_is_blockwise_only).
  pow2 = mode == "blockwise" and not gated
  act_sets = PAIRS if gated else [(n,) for n in NAMES]
  for k, acts in enumerate(act_sets):
    h, dz = _inputs(acts, k, *((F32, BF16) if k == 1 else (BF16, BF16)))
    v32, v64 = _v(direction, acts, h, dz)
    if direction == "bwd":  # finite differences are off at relu's kink: skip it
      kink = _relu_kink(acts, np.asarray(h, np.float32))
      v64 = np.where(kink, v32, v64)
    w = v32.shape[1]
    slack = RTOL * 8 * np.abs(v64) + ATOL * 8
    kw = dict(mode=mode, dtype=dtype, power_2_scale=pow2)
    if mode == "tensorwise":  # saturate the top half of the range
      kw["scale"] = _np_scale(np.max(np.abs(v32)) / 2, dtype, False)
    q = _call(direction, acts, h, dz, **kw)
    assert isinstance(q, QuantizedTensor)
    data, s, data_t, s_t, amax = q.data, q.scale_inv, q.data_t, q.scale_inv_t, q.amax
    tag = f"{acts} {direction} {mode}"
    assert data.shape == (M, w) and data_t.shape == (w, M) and data.dtype == dtype, tag
    if mode == "blockwise":
      assert amax is None and q.block_shape == (1, 128), tag
      want, want_s, scale = _np_blockwise_1x128(v32, dtype, pow2)
      want_t, want_s_t, scale_t = _np_blockwise_1x128(v32.T, dtype, pow2)
      np.testing.assert_array_equal(np.asarray(s), want_s, err_msg=tag)
      np.testing.assert_array_equal(np.asarray(s_t), want_s_t, err_msg=tag)
      np.testing.assert_array_equal(_bits(data_t), _bits(want_t), err_msg=tag)
      _check_half_ulp(data, np.repeat(scale, 128, axis=1)[:, :w], v64, slack, dtype)
      _check_half_ulp(data_t, np.repeat(scale_t, 128, axis=1)[:, :M], v64.T, slack.T,
                      dtype)
    else:
      assert q.block_shape is None, tag
      assert s.shape == s_t.shape == amax.shape == (), tag
      assert float(amax) == np.max(np.abs(v32)), tag
      scale = kw.get("scale", _np_scale(np.max(np.abs(v32)), dtype, pow2))
      want = _np_cast(v32 * scale, dtype)
      assert float(s) == float(s_t) == np.float32(1) / scale, tag
      np.testing.assert_array_equal(_bits(data_t), _bits(data).T, err_msg=tag)
      _check_half_ulp(data, scale, v64, slack, dtype)
    np.testing.assert_array_equal(_bits(data), _bits(want), err_msg=tag)


def test_jit_with_traced_scale():
  h, dz = _inputs(("silu", "linear"), 3)
  f = jax.jit(lambda dz, h, s: aq.dact_quantize(dz, h, ("silu", "linear"), mode="tensorwise",
                                                 dtype=E5M2, scale=s, impl="reference"))
  got = f(dz, h, jnp.float32(100.0))
  want = _call("bwd", ("silu", "linear"), h, dz, mode="tensorwise", dtype=E5M2,
               scale=np.float32(100.0))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert len(jax.tree.leaves(got)) == 5  # data, scale_inv, data_t, scale_inv_t, amax
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g).reshape(-1).view(np.uint8),
                                  np.asarray(w).reshape(-1).view(np.uint8))


# ------------------------------------------------------ output selection ---

def _mode_kw(mode, dtype, scale=64.0):
  """Options of one act/dact call: a given scale for "tensorwise", power-of-2
  tile scales for "blockwise"."""
  kw = dict(mode=mode, dtype=dtype, power_2_scale=mode == "blockwise")
  if mode == "tensorwise":
    kw["scale"] = jnp.float32(scale)
  return kw


def _same_bits(got, want, what):
  """Arrays (or None) equal bit for bit; NaN equals NaN."""
  assert (got is None) == (want is None), what
  if got is not None:
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape)
    g, w = g.reshape(-1), w.reshape(-1)
    if np.issubdtype(g.dtype, np.floating):
      # Any NaN equals any NaN: a scale from a NaN amax and a canonical NaN
      # differ in their payload bits (seen on the H100), not in meaning.
      both_nan = np.isnan(g) & np.isnan(w)
      g, w = g[~both_nan], w[~both_nan]
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=what)


def _check_selection(both, rows, cols, mode, tag):
  """rows / cols (one copy each) are both's fields, the other copy None."""
  _same_bits(rows.data, both.data, f"{tag} rows data")
  _same_bits(rows.scale_inv, both.scale_inv, f"{tag} rows scale_inv")
  _same_bits(rows.amax, both.amax, f"{tag} rows amax")
  assert rows.data_t is None and rows.scale_inv_t is None, tag
  _same_bits(cols.data_t, both.data_t, f"{tag} cols data_t")
  _same_bits(cols.scale_inv_t, both.scale_inv_t, f"{tag} cols scale_inv_t")
  _same_bits(cols.amax, both.amax, f"{tag} cols amax")
  assert cols.data is None, tag
  # The per-tensor scale_inv is both copies' one scale: it stays.
  _same_bits(cols.scale_inv, None if mode == "blockwise" else both.scale_inv, tag)
  assert rows.block_shape == cols.block_shape == both.block_shape, tag


@pytest.mark.parametrize("mode", aq.MODES)
def test_output_selection_writes_those_copies_of_both(mode):
  for acts in (("gelu",), ("silu", "linear")):
    h, _ = _inputs(acts, 11)
    run = lambda **kw: aq.act_quantize(h, acts, impl="reference", **_mode_kw(mode, E4M3), **kw)
    _check_selection(run(), run(columnwise=False), run(rowwise=False), mode, f"{acts} {mode}")


def _forward_and_spec(h, acts, mode):
  """The forward's act_quantize (both copies, E4M3) and the ActColumnwise
  that asks dact for its columnwise copy."""
  kw = _mode_kw(mode, E4M3, scale=40.0)
  fwd = aq.act_quantize(h, acts, impl="reference", **kw)
  return fwd, aq.act_columnwise_like(amax=fwd.amax, **kw)


@pytest.mark.parametrize("mode", aq.MODES)
def test_dact_writes_the_forwards_columnwise_act(mode):
  """dact_quantize(act_columnwise=...) returns dh unchanged and act(h)'s
  columnwise copy exactly as the forward's act_quantize wrote it, for a
  backward format and scale other than the forward's."""
  for acts in (("gelu",), ("silu", "linear"), ("relu", "tanh")):
    h, dz = _inputs(acts, 12)
    fwd, spec = _forward_and_spec(h, acts, mode)
    kw = _mode_kw(mode, E5M2, scale=1000.0)
    plain = aq.dact_quantize(dz, h, acts, impl="reference", **kw)
    q, z_t = aq.dact_quantize(dz, h, acts, impl="reference", act_columnwise=spec, **kw)
    tag = f"{acts} {mode}"
    for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
      _same_bits(getattr(q, name), getattr(plain, name), f"{tag} dh {name}")
    assert z_t.block_shape == fwd.block_shape, tag
    _same_bits(z_t.data, fwd.data_t, f"{tag} z_t")
    _same_bits(z_t.scale_inv, fwd.scale_inv_t, f"{tag} z_t scale_inv")


@pytest.mark.parametrize("mode", ["tensorwise", "current"])
def test_dact_act_columnwise_keeps_a_nonfinite_amax_visible(mode):
  """An Inf in h: the forward's copy has a NaN scale_inv (saturation must not
  hide it), and so has the copy dact writes from the forward's amax."""
  acts = ("silu", "linear")
  h, dz = _inputs(acts, 13)
  h = h.at[3, 5].set(jnp.inf)
  fwd, spec = _forward_and_spec(h, acts, mode)
  assert not np.isfinite(float(fwd.amax))
  _, z_t = aq.dact_quantize(dz, h, acts, impl="reference", act_columnwise=spec,
                            **_mode_kw(mode, E5M2))
  assert np.isnan(float(z_t.scale_inv))
  _same_bits(z_t.scale_inv, fwd.scale_inv_t, mode)


@pytest.mark.parametrize("mode", ["tensorwise", "blockwise"])
def test_join_columnwise_of_row_chunks_is_the_whole(mode):
  """Row chunks quantized alone (one scale, or whole 128-token tiles) join
  into the whole tensor's columnwise copy."""
  acts = ("gelu",)
  h = jnp.asarray(np.random.default_rng(14).standard_normal((384, F)) * 3, BF16)
  kw = _mode_kw(mode, E4M3)
  whole = aq.act_quantize(h, acts, impl="reference", **kw).columnwise()
  parts = [aq.act_quantize(h[r0:r1], acts, impl="reference", rowwise=False, **kw).columnwise()
           for r0, r1 in ((0, 256), (256, 384))]
  joined = aq.join_columnwise(parts, impl="reference")
  assert joined.block_shape == whole.block_shape
  _same_bits(joined.data, whole.data, mode)
  _same_bits(joined.scale_inv, whole.scale_inv, mode)


def test_output_selection_argument_errors():
  h, dz = _inputs(("gelu",), 15)
  fwd = lambda **kw: aq.act_quantize(h, ("gelu",), mode="current", dtype=E4M3, **kw)
  with pytest.raises(ValueError, match="both False"):
    fwd(rowwise=False, columnwise=False)
  with pytest.raises(TypeError, match="columnwise must be a Python bool"):
    fwd(columnwise=0)
  like = aq.act_columnwise_like
  with pytest.raises(ValueError, match=r"amax \(the forward's max\|act\(h\)\|\) is needed"):
    like(amax=None, mode="current", dtype=E4M3)
  with pytest.raises(ValueError, match="amax must be None for mode='blockwise'"):
    like(amax=jnp.float32(1.0), mode="blockwise", dtype=E4M3)
  with pytest.raises(TypeError, match="amax must be a float32 scalar"):
    like(amax=jnp.ones((2,)), mode="current", dtype=E4M3)
  with pytest.raises(ValueError, match="act_columnwise: mode='tensorwise' needs scale"):
    like(amax=jnp.float32(1.0), mode="tensorwise", dtype=E4M3)
  bwd = lambda spec, mode="current": aq.dact_quantize(dz, h, ("gelu",), mode=mode, dtype=E5M2,
                                                      act_columnwise=spec)
  with pytest.raises(ValueError, match=r"act_columnwise.mode \('current'\) must be"):
    bwd(like(amax=jnp.float32(1.0), mode="current", dtype=E4M3), mode="blockwise")
  with pytest.raises(TypeError, match="act_columnwise must be an ActColumnwise"):
    bwd(dict(mode="current", dtype=E4M3, amax=jnp.float32(1.0)))


@pytest.mark.parametrize("mode", aq.MODES)
def test_cuda_call_writes_only_the_selected_copies(gpu_host, mode):  # pylint: disable=unused-argument
  """Lowered for CUDA (no GPU needed; "auto" stages both paths, so the CUDA
  wrapper's results also match the reference's pytree): one custom call per
  op, whose unselected copies are (0, 0) placeholders, and whose dact call
  writes act(h)'s (F, M) E4M3 copy beside dh's E5M2 ones."""
  acts, m, f = ("silu", "linear"), 256, 384
  h = jnp.zeros((m, 2 * f), BF16)
  dz = jnp.zeros((m, f), BF16)
  fwd_kw = _mode_kw(mode, E4M3)
  for rowwise, columnwise in ((True, False), (False, True)):
    text = cuda_text(lambda h: aq.act_quantize(h, acts, rowwise=rowwise, columnwise=columnwise,
                                               **fwd_kw), h)
    ((target, _, results),) = custom_calls(text, "te_jax_act_quantize")
    fp8 = [r for r in results if r.endswith("f8E4M3FN")]
    want = [f"{m}x{f}xf8E4M3FN" if rowwise else "0x0xf8E4M3FN",
            f"{f}x{m}xf8E4M3FN" if columnwise else "0x0xf8E4M3FN", "0x0xf8E4M3FN"]
    assert fp8 == want, (target, results)
  amax = None if mode == "blockwise" else jnp.float32(3.0)
  spec = aq.act_columnwise_like(amax=amax, **fwd_kw)
  text = cuda_text(lambda dz, h: aq.dact_quantize(dz, h, acts, act_columnwise=spec,
                                                  **_mode_kw(mode, E5M2)), dz, h)
  ((_, _, results),) = custom_calls(text, "te_jax_act_quantize")
  fp8 = [r for r in results if "xf8" in r]
  assert fp8 == [f"{m}x{2 * f}xf8E5M2", f"{2 * f}x{m}xf8E5M2", f"{f}x{m}xf8E4M3FN"], results


# ---------------------------------------------------------------- errors ---

def test_argument_errors():
  h, dz = _inputs(("gelu",), 4)
  fwd = lambda **kw: aq.act_quantize(**{"h": h, "activations": ("gelu",), "mode": "current",
                                        "dtype": E4M3, **kw})
  bwd = lambda **kw: aq.dact_quantize(**{"dz": dz, "h": h, "activations": ("gelu",),
                                         "mode": "current", "dtype": E4M3, **kw})
  with pytest.raises(ValueError, match="unknown activation 'swiglu'"):
    fwd(activations=("swiglu",))
  with pytest.raises(TypeError, match="activations must be a tuple"):
    fwd(activations="gelu")
  with pytest.raises(ValueError, match="one or two names"):
    fwd(activations=("gelu", "gelu", "gelu"))
  with pytest.raises(ValueError, match="mode must be one of"):
    fwd(mode="delayed")
  with pytest.raises(ValueError, match="mode='tensorwise' needs scale"):
    fwd(mode="tensorwise")
  with pytest.raises(ValueError, match="scale must be None"):
    fwd(scale=1.0)
  with pytest.raises(ValueError, match="scale must be a scalar"):
    fwd(mode="tensorwise", scale=jnp.ones((2,)))
  with pytest.raises(TypeError, match="scale must be a float"):
    fwd(mode="tensorwise", scale=3)
  with pytest.raises(ValueError, match="power_2_scale applies"):
    fwd(mode="tensorwise", scale=1.0, power_2_scale=True)
  with pytest.raises(TypeError, match="power_2_scale must be a Python bool"):
    fwd(power_2_scale=1)
  with pytest.raises(TypeError, match="dtype must be"):
    fwd(dtype=BF16)
  with pytest.raises(TypeError, match="h must be a float32"):
    fwd(h=h.astype(jnp.int32))
  with pytest.raises(ValueError, match="h must be 2-D"):
    fwd(h=h[0])
  with pytest.raises(ValueError, match=r"h.shape\[1\] \(199\) must be n_act \* F"):
    fwd(activations=("silu", "linear"), h=h[:, :199])
  with pytest.raises(ValueError, match=r"must be \(dz.shape\[0\], n_act \* dz.shape\[1\]\)"):
    bwd(activations=("silu", "linear"))  # h has F, not 2F, columns
  with pytest.raises(ValueError, match=r"must be \(dz.shape\[0\]"):
    bwd(dz=dz[:-1])
  with pytest.raises(TypeError, match="dz must be a float32"):
    bwd(dz=dz.astype(jnp.int8))
  with pytest.raises(ValueError, match="impl must be one of"):
    fwd(impl="triton")
  with pytest.raises(ValueError, match="unknown activation"):
    aq.activation_forward(h, ("elu",))


@pytest.mark.parametrize("mode", ["tensorwise", "current"])
def test_power_2_scale_is_blockwise_only(mode):
  """power_2_scale rounds tile scales (mode="blockwise", as quantize_blockwise);
  the per-tensor modes refuse it, forward and backward, as concat_quantize."""
  h, dz = _inputs(("gelu",), 4)
  kw = dict(mode=mode, dtype=E4M3, power_2_scale=True,
            scale=1.0 if mode == "tensorwise" else None)
  with pytest.raises(ValueError, match="power_2_scale applies to mode='blockwise' only"):
    aq.act_quantize(h, ("gelu",), **kw)
  with pytest.raises(ValueError, match="power_2_scale applies to mode='blockwise' only"):
    aq.dact_quantize(dz, h, ("gelu",), **kw)
  with pytest.raises(ValueError, match="power_2_scale applies to mode='blockwise' only"):
    aq.act_quantize_reference(h, ("gelu",), **kw)
  with pytest.raises(ValueError, match="power_2_scale applies to mode='blockwise' only"):
    aq.dact_quantize_reference(dz, h, ("gelu",), **kw)


def test_cuda_shape_support(monkeypatch):
  assert aq.act_quantize_supported(256, 384, 1)
  assert aq.act_quantize_supported(200, 136, 2)
  assert aq.act_quantize_supported(7, 13, 1)        # any F for one activation
  assert not aq.act_quantize_supported(256, 12, 2)  # gated: F % 8
  assert not aq.act_quantize_supported(256, 128, 3)
  assert not aq.act_quantize_supported(65535 * 128 + 1, 128, 1)
  assert not aq.act_quantize_supported(0, 128, 1)
  # With the CUDA path chosen, an unsupported shape is a ValueError at trace
  # time (before any custom call is built). Under jit "auto" traces the CUDA
  # branch too (_native.dispatch), whatever platform it is compiled for.
  monkeypatch.setattr(aq._native, "resolve_impl", lambda impl: "cuda")
  h = jnp.zeros((16, 24), BF16)
  fwd = jax.jit(lambda h: aq.act_quantize(h, ("silu", "linear"), mode="current", dtype=E4M3))
  with pytest.raises(ValueError, match="F % 8 == 0"):
    fwd(h)
  with pytest.raises(ValueError, match="act_quantize_supported"):
    aq.dact_quantize(jnp.zeros((16, 12), BF16), h, ("silu", "linear"), mode="blockwise",
                     dtype=E5M2, impl="cuda")


# ---------------------------------------------------------- GPU vs ref ---
# CUDA's tanhf/expf/erfcf and XLA's own tanh/exp/erfc may differ by a float32
# ulp or two (and XLA may contract a multiply-add into an FMA where the
# kernels round twice), so v can differ in its last bits. That moves amax and
# the scales by ~1e-7 relative and flips an FP8 rounding only for the rare
# element within a few float32 ulps of a rounding tie: we require scales and
# amax within 1e-6 relative, fewer than 0.1% of the FP8 elements different,
# and every difference exactly one FP8 step.

_CPU = jax.devices("cpu")[0]
_GPU_SHAPES = [(256, 384), (1024, 512), (200, 136)]  # (M, F); 200x136: edge tiles
_GPU_ACTS = [(n,) for n in NAMES] + PAIRS


def _ordinal(a):
  """FP8 bytes -> signed ordinal: adjacent FP8 values differ by exactly 1."""
  b = np.asarray(a).view(np.uint8).astype(np.int32)
  return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def _close_fp8(got, want, what):
  g, w = _ordinal(got), _ordinal(want)
  assert g.shape == w.shape, what
  diff = np.abs(g - w)
  assert diff.max(initial=0) <= 1, f"{what}: an FP8 value is {diff.max()} steps off"
  assert np.count_nonzero(diff) <= 1e-3 * diff.size, (
      f"{what}: {np.count_nonzero(diff)} of {diff.size} FP8 values differ")


def _close_f32(got, want, what, rtol=1e-6):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=rtol, atol=0, err_msg=what)


def _tile_max_1x128(a):
  """(R, C) -> (R, ceil(C / 128)): the max of each 1x128 tile of a row."""
  r, c = a.shape
  padded = np.zeros((r, -(-c // 128) * 128), a.dtype)
  padded[:, :c] = a
  return padded.reshape(r, -1, 128).max(axis=2)


def _close_scale_inv(got, want, terms, what, rtol):
  """|got - want| <= rtol * max(|want|, terms): a scale_inv within rtol of
  the float32 error scale `terms` (a tile's largest term magnitude over the
  FP8 maximum) where its value is a difference smaller than its terms."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape == terms.shape, (what, got.shape, want.shape, terms.shape)
  bound = rtol * np.maximum(np.abs(want), terms)
  err = np.abs(got - want)
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err <= bound), (
      f"{what}: {got[worst]:.6e} vs {want[worst]:.6e} at {worst} (bound {bound[worst]:.3e})")


# Large |h| for the kernels' exp(-|x|) (activation.h ExpNegAbs): below
# 2^-126 (|x| > 87.3) it returns 0 where the reference's exp is subnormal,
# and |x| is capped at 128 inside it; the values around those points.
_LARGE_H = [30.0, -30.0, 87.0, -87.0, 88.0, -88.0, 100.0, -100.0, 1000.0, -1000.0]


def _gpu_case(direction, acts, mode, shape, h_dtype=BF16, dz_dtype=BF16, dtype=None,
              pow2=False, large=False, dz_scale=1.0, fp8_h=False):
  """CUDA against the reference (on the CPU; on the GPU when dz_scale != 1,
  see below) for one call. dz_scale scales dz; fp8_h (backward): h as its
  E4M3 copy (store_act_input_in_fp8: 1x128 tiles, power-of-two scales),
  which both paths read dequantized to dz's dtype."""
  m, f = shape
  rng = np.random.default_rng(zlib.crc32(repr((direction, acts, mode, shape)).encode()))
  h = rng.standard_normal((m, len(acts) * f)) * 3
  if large:  # in the first row of every 128-column tile, among ordinary values
    for c in range(0, h.shape[1], 128):
      h[0, c:c + len(_LARGE_H)] = _LARGE_H[:h.shape[1] - c]
  h = jnp.asarray(h, h_dtype)
  dz = jnp.asarray(rng.standard_normal((m, f)) * dz_scale, dz_dtype)
  h_values = h  # what the kernels compute with
  if fp8_h:
    h = quantize_op.quantize_blockwise(h, (1, 128), E4M3, power_2_scale=True,
                                       impl="reference").rowwise()
    h_values = h.dequantize(dz_dtype)
  dtype = dtype or (E4M3 if direction == "fwd" else E5M2)
  kw = dict(mode=mode, dtype=dtype, power_2_scale=pow2)
  args = (h,) if direction == "fwd" else (dz, h)
  if mode == "tensorwise":  # a scale that saturates some values
    v = (aq.activation_forward(h, acts) if direction == "fwd"
         else aq.activation_backward(dz, h_values, acts))
    kw["scale"] = jnp.float32(FMAX[dtype] / (0.5 * float(jnp.max(jnp.abs(v)))))
    args = args + (kw.pop("scale"),)

  def fn(impl):
    def run(*a):
      extra = dict(kw, scale=a[-1]) if mode == "tensorwise" else kw
      a = a[:-1] if mode == "tensorwise" else a
      if direction == "fwd":
        return aq.act_quantize(a[0], acts, impl=impl, **extra)
      return aq.dact_quantize(a[0], a[1], acts, impl=impl, **extra)
    return run

  got = jax.jit(fn("cuda"))(*args)
  # The reference runs on the CPU, except with a scaled dz: dz x 2^-100
  # makes products float32 subnormals, which JAX's CPU backend flushes to
  # zero (FTZ and DAZ) and the GPU and the kernels (-ftz=false) keep; a
  # 1x128 scale near 2^114 then lifts the flushed values to many FP8 steps
  # (run AR, H100: up to 19). XLA:GPU keeps them, as the kernel does.
  ref_device = _CPU if dz_scale == 1.0 else jax.devices()[0]
  want = jax.jit(fn("reference"))(*jax.device_put(args, ref_device))
  tag = (f"{direction} {acts} {mode} {shape} h={'e4m3' if fp8_h else jnp.dtype(h_dtype).name} "
         f"pow2={pow2} dz*{dz_scale}")
  assert isinstance(got, QuantizedTensor) and isinstance(want, QuantizedTensor), tag
  assert got.block_shape == want.block_shape, tag
  data, s, data_t, s_t, amax = got.data, got.scale_inv, got.data_t, got.scale_inv_t, got.amax
  _close_fp8(data, want.data, f"data {tag}")
  _close_fp8(data_t, want.data_t, f"data_t {tag}")
  # Scales follow the amax of float32 activation values, which CUDA's and
  # XLA's expf/expm1f round differently by an ulp. Forward values keep that
  # ulp. The derivatives cancel: gelu'(x) = cdf(x) + x*pdf(x) for x << 0 and
  # silu'(x) are differences of nearly equal terms, which turn one ulp into
  # tens of ulps of a small result (measured on the H200: 2.6e-6 = 22 ulps in
  # a 1x128 tile of gelu' values ~1e-3). 3e-5 (250 ulps) is still 2000x
  # below the 6% of one E5M2 step, and the FP8 data are checked above.
  rtol = 1e-6 if direction == "fwd" else 3e-5
  if mode == "blockwise" and direction == "bwd" and not pow2:
    # A 1x128 tile's scale follows one value; where that value is such a
    # difference (a column of one row, M = 1, near gelu' = 0: run AL's
    # sigmoid x gelu_exact, 2 ulps of cdf = 4.3e-5 of the result), 250
    # ulps of the result is tighter than the float32 error of its terms.
    # So each tile's scale is held to 3e-5 of its terms' magnitude
    # (_np_backward_terms), which is 3e-5 relative wherever nothing cancels.
    terms = _np_backward_terms(np.asarray(args[0], np.float64),
                               np.asarray(h_values, np.float64), acts) / FMAX[dtype]
    _close_scale_inv(s, want.scale_inv, _tile_max_1x128(terms), f"scale_inv {tag}", rtol)
    _close_scale_inv(s_t, want.scale_inv_t, _tile_max_1x128(terms.T), f"scale_inv_t {tag}",
                     rtol)
  else:
    _close_f32(s, want.scale_inv, f"scale_inv {tag}", rtol)
    _close_f32(s_t, want.scale_inv_t, f"scale_inv_t {tag}", rtol)
  if mode == "blockwise":
    assert amax is None and want.amax is None
    assert s.shape == want.scale_inv.shape and s_t.shape == want.scale_inv_t.shape
  else:
    _close_f32(amax, want.amax, f"amax {tag}", rtol)
    np.testing.assert_array_equal(_ordinal(data_t), _ordinal(data).T, err_msg=tag)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("shape", _GPU_SHAPES)
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("acts", _GPU_ACTS, ids=lambda a: "-".join(a))
def test_cuda_matches_reference(acts, direction, mode, shape):
  _gpu_case(direction, acts, mode, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("case", [
    dict(h_dtype=F32, dz_dtype=F32), dict(h_dtype=F16, dz_dtype=F16),
    dict(h_dtype=BF16, dz_dtype=F32),  # mixed: widened to f32 before the call
    dict(dtype=E4M3, pow2=True), dict(dtype=E5M2, pow2=True)])
@pytest.mark.parametrize("mode", ["current", "blockwise"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_cuda_dtypes(case, mode, direction):
  for acts in (("silu", "linear"), ("gelu",)):
    if case.get("pow2") and mode != "blockwise":
      # power_2_scale is a blockwise option; the CUDA path refuses it for a
      # per-tensor mode as the reference does (test_power_2_scale_is_blockwise_only).
      with pytest.raises(ValueError, match="power_2_scale applies to mode='blockwise'"):
        _gpu_case(direction, acts, mode, (256, 384), **case)
      continue
    _gpu_case(direction, acts, mode, (256, 384), **case)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("shape", [(130, 100), (1, 7)])  # one activation: any F
def test_cuda_odd_shapes(shape):
  for mode in aq.MODES:
    for direction in ("fwd", "bwd"):
      _gpu_case(direction, ("gelu",), mode, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("shape", [(200, 256), (130, 128), (1, 384)])
def test_cuda_paired_gated_backward(shape, mode):
  """A gated backward with F % 128 == 0 runs one block per column tile of h
  that writes both halves of dh (kPaired in the per-tensor kernel and its
  amax pass, kernels/act_quantize_tensor.cu, and in the 1x128 backward,
  kernels/act_quantize_blockwise_bwd.cu):
  against the reference with edge rows (M % 128 != 0), one tile of h, one
  row, and every activation in each position, 16-bit inputs (the paired
  kernels' only ones) of both kinds."""
  for k, acts in enumerate(PAIRS):
    h_dtype = F16 if k % 3 == 2 else BF16
    _gpu_case("bwd", acts, mode, shape, h_dtype=h_dtype, dz_dtype=h_dtype)
  _cuda_selection_case(("silu", "linear"), mode, shape)
  _cuda_selection_case(("gelu_exact", "sigmoid"), mode, shape, h_dtype=F16)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("fp8_h", [False, True], ids=["bf16_h", "e4m3_h"])
@pytest.mark.parametrize("pow2", [False, True], ids=["pow2_off", "pow2_on"])
@pytest.mark.parametrize("shape", [(200, 256), (200, 136), (1, 384)])
def test_cuda_blockwise_backward(shape, pow2, fp8_h):
  """The 1x128 backward (kernels/act_quantize_blockwise_bwd.cu) against the
  reference: gelu and SwiGLU (paired where F % 128 == 0; F = 136: tiles of
  dh straddle h0 and h1), edge rows, one row, a bf16 or an E4M3 h; pow2 on
  (the columnwise bytes cast from the values parked at 16 bits) and off,
  and dz times 2^-100 (column scales above 2^100: the kernel's exact path
  even with pow2 on). Bit for bit where the activations are exact:
  tests/test_dact_blockwise_exact.py."""
  for acts in (("gelu",), ("silu", "linear")):
    for dz_scale in (1.0, 2.0 ** -100):
      _gpu_case("bwd", acts, "blockwise", shape, pow2=pow2, dz_scale=dz_scale, fp8_h=fp8_h)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_cuda_large_inputs(direction, mode):
  for acts in (("gelu",), ("silu",), ("sigmoid",), ("quick_gelu",), ("silu", "linear")):
    _gpu_case(direction, acts, mode, (256, 384), large=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
def test_cuda_writes_no_activation_tensor():
  """The compiled CUDA path is the custom call alone: no XLA op computes the
  activation (or a bf16 copy of it) around it."""
  h = jnp.zeros((256, 2 * 384), BF16)
  dz = jnp.zeros((256, 384), BF16)
  f = jax.jit(lambda dz, h: aq.dact_quantize(dz, h, ("silu", "linear"), mode="blockwise",
                                             dtype=E5M2, impl="cuda"))
  hlo = f.lower(dz, h).compile().as_text()
  assert "te_jax_act_quantize_blockwise" in hlo
  for op in ("exponential(", "tanh(", "logistic(", " erf("):
    assert op not in hlo, f"{op} in the compiled HLO"


# CUDA's selected and extra outputs against its own both-copies results, bit
# for bit (the same kernels' arithmetic; the reference comparison above
# covers the values): act(h)'s copy from the dact pass is the forward
# kernel's data_t. Gated F = 136: a 128-column tile of dh straddles h0 and h1.
_SELECT_CASES = [(("gelu",), (256, 384)), (("silu",), (130, 100)), (("relu",), (200, 136)),
                 (("silu", "linear"), (256, 384)), (("silu", "linear"), (200, 136)),
                 (("gelu", "linear"), (1024, 512)), (("quick_gelu", "tanh"), (130, 136))]


def _cuda_selection_case(acts, mode, shape, h_dtype=BF16, nonfinite=False):
  m, f = shape
  rng = np.random.default_rng(zlib.crc32(repr((acts, mode, shape, "sel")).encode()))
  h = rng.standard_normal((m, len(acts) * f)) * 3
  if nonfinite:
    h[m // 2, 3] = np.inf
  h = jnp.asarray(h, h_dtype)
  dz = jnp.asarray(rng.standard_normal((m, f)), h_dtype)
  fwd_kw, bwd_kw = _mode_kw(mode, E4M3, scale=40.0), _mode_kw(mode, E5M2, scale=1000.0)
  tag = f"{acts} {mode} {shape} {jnp.dtype(h_dtype).name}"

  def fwd(h, rowwise=True, columnwise=True):
    return aq.act_quantize(h, acts, impl="cuda", rowwise=rowwise, columnwise=columnwise,
                           **fwd_kw)
  both = jax.jit(fwd)(h)
  rows = jax.jit(lambda h: fwd(h, columnwise=False))(h)
  cols = jax.jit(lambda h: fwd(h, rowwise=False))(h)
  _check_selection(both, rows, cols, mode, tag)

  spec = aq.act_columnwise_like(amax=both.amax, **fwd_kw)
  plain = jax.jit(lambda dz, h: aq.dact_quantize(dz, h, acts, impl="cuda", **bwd_kw))(dz, h)
  # The spec holds static fields (mode, dtype): closed over, its amax a constant.
  q, z_t = jax.jit(lambda dz, h: aq.dact_quantize(
      dz, h, acts, impl="cuda", act_columnwise=spec, **bwd_kw))(dz, h)
  for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
    _same_bits(getattr(q, name), getattr(plain, name), f"{tag} dh {name}")
  assert z_t.block_shape == both.block_shape, tag
  _same_bits(z_t.data, both.data_t, f"{tag} z_t")
  _same_bits(z_t.scale_inv, both.scale_inv_t, f"{tag} z_t scale_inv")
  if nonfinite:
    assert np.all(np.isnan(np.asarray(z_t.scale_inv))) or mode == "blockwise", tag
    return
  # And the reference's act(h) copy on the CPU (activation ulps: _close_fp8).
  def reference(dz, h):
    ref_fwd = aq.act_quantize(h, acts, impl="reference", **fwd_kw)
    return aq.dact_quantize(dz, h, acts, impl="reference", **bwd_kw, act_columnwise=
                            aq.act_columnwise_like(amax=ref_fwd.amax, **fwd_kw))[1]
  want = jax.jit(reference)(*jax.device_put((dz, h), _CPU))
  _close_fp8(z_t.data, want.data, f"z_t {tag}")
  _close_f32(z_t.scale_inv, want.scale_inv, f"z_t scale_inv {tag}")


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("case", _SELECT_CASES, ids=lambda c: "-".join(c[0]) + f"-{c[1]}")
def test_cuda_selected_and_act_columnwise_outputs(case, mode):
  _cuda_selection_case(case[0], mode, case[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("h_dtype", [F32, F16])
def test_cuda_selected_outputs_other_dtypes(mode, h_dtype):
  _cuda_selection_case(("silu", "linear"), mode, (256, 384), h_dtype=h_dtype)
  _cuda_selection_case(("gelu",), mode, (130, 100), h_dtype=h_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("mode", aq.MODES)
def test_cuda_act_columnwise_with_an_inf_in_h(mode):
  _cuda_selection_case(("silu", "linear"), mode, (256, 384), nonfinite=True)
