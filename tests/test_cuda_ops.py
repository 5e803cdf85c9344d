"""CUDA custom calls vs the pure-JAX reference (run on the H200).

Quantize: bit-exact (FP8 bytes, scale_inv and amax; NaN compared as NaN)
against the reference evaluated on the CPU backend, except where the CPU
backend itself departs from the spec: denormal results (XLA:CPU flushes
them); there numpy float32 is the reference. (The reference's amax
propagates NaN on every backend: ``te_jax.ops.fp8.amax``.) Not against the reference
compiled for the GPU: XLA:GPU's float32 division is not correctly rounded
(seen on the H200, jax 0.11.2: 1/1.8211383 -> 0.54910707 instead of the IEEE
0.54910713), so its `fp8_max / amax` and `1 / scale` can be 1 ulp off, which
flips FP8 roundings near ties. The kernels divide with IEEE rounding, like the
CPU and numpy.
GEMM: relative Frobenius error against ``gemm_reference`` (dequantized
operands, fp32 HIGHEST dot). The FP8 operands are exact inputs to both, so the
error is only accumulation order plus the output rounding: tolerances are a
few units of the output format's epsilon (bf16 2^-8 -> 1e-2, fp16 2^-11 ->
4e-3) and 1e-4 for fp32 output with split (fp32) accumulation; fast
accumulation (Hopper's reduced-precision FP8 accumulator) gets 5e-3.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax import quantize as public_quantize
from te_jax.ops import _native
from te_jax.ops import gemm as gemm_ops
from te_jax.ops import quantize as q
from te_jax.scaled_tensor import ScaledTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(),
                       reason="needs a GPU and the te_jax CUDA custom calls"),
]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


# ------------------------------------------------------------- helpers ---

_CPU = jax.devices("cpu")[0]


def _jit_cpu(fn, *args):
  """Runs jit(fn) on the CPU backend (IEEE division; see module doc)."""
  return jax.jit(fn)(*jax.device_put(args, _CPU))


def _bits_equal(got, want, what):
  """Bitwise equality; positions where `want` is NaN only need a NaN."""
  g, w = np.asarray(got), np.asarray(want)
  assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
  assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
  gf, wf = g.astype(np.float32), w.astype(np.float32)
  nan = np.isnan(wf)
  np.testing.assert_array_equal(np.isnan(gf), nan, err_msg=f"{what}: NaN positions")
  ui = {1: np.uint8, 2: np.uint16, 4: np.uint32}[g.dtype.itemsize]
  gb, wb = g.view(ui)[~nan], w.view(ui)[~nan]
  bad = np.flatnonzero(gb != wb)
  assert bad.size == 0, (f"{what}: {bad.size} of {gb.size} differ, first at flat index "
                         f"{bad[0]}: got {gf[~nan][bad[0]]} want {wf[~nan][bad[0]]}")


def _np_amax(x):
  """max|x| with NaN propagation (jnp.max semantics). XLA:CPU's reduce-max
  drops NaNs (seen with jax 0.11.2: amax inf where x holds inf and NaN)."""
  return np.float32(np.max(np.abs(np.asarray(x, np.float32))))


def _np_scale(amax, fp8, pow2):
  """compute_scale() in numpy float32 (IEEE division, NaN-propagating): 1
  where amax is 0, NaN where it is not finite."""
  amax = np.asarray(amax, np.float32)
  valid = np.isfinite(amax) & (amax > 0)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s = np.float32(448.0 if fp8 == E4M3 else 57344.0) / np.where(valid, amax, np.float32(1))
  s = np.minimum(s, np.finfo(np.float32).max).astype(np.float32)
  if pow2:
    s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
  # 1 for a zero amax, NaN for a non-finite one (the tile's data goes NaN).
  fallback = np.where(np.isfinite(amax), np.float32(1), np.float32(np.nan))
  return np.where(valid, s, fallback).astype(np.float32)


def _np_blockwise(x, block, fp8, pow2):
  """quantize_blockwise_reference in numpy: the spec for inputs holding NaN,
  where the CPU backend's NaN-dropping max would pick a different scale."""
  x = np.asarray(x, np.float32)
  (m, k), (bm, bk) = x.shape, block
  mt, kt = -(-m // bm), -(-k // bk)
  xp = np.zeros((mt * bm, kt * bk), np.float32)
  xp[:m, :k] = x
  tiles = xp.reshape(mt, bm, kt, bk)
  amax = np.max(np.abs(tiles), axis=(1, 3))  # NaN-propagating
  scale = _np_scale(amax, fp8, pow2)
  mx = np.float32(448.0 if fp8 == E4M3 else 57344.0)
  with np.errstate(invalid="ignore", over="ignore"):
    v = np.clip(tiles * scale[:, None, :, None], -mx, mx)
  data = v.astype(jnp.dtype(fp8)).reshape(mt * bm, kt * bk)[:m, :k]
  return data, (np.float32(1) / scale).astype(np.float32)


def _input(shape, dtype, seed, special=False, spread=False):
  """Random input; `spread` varies magnitudes per row and column block,
  `special` adds inf, -inf, NaN, huge values and an all-zero 128x128 tile."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * 50.0
  m, k = shape
  if spread:
    x *= 10.0 ** rng.uniform(-3, 3, size=(m, 1))
    x *= 10.0 ** rng.uniform(-2, 2, size=(1, -(-k // 128))).repeat(128, axis=1)[:, :k]
  if special:
    if m >= 256 and k >= 256:
      x[128:256, 128:256] = 0.0
    x[0, 0] = np.inf
    x[min(3, m - 1), k // 2] = -np.inf
    x[m // 2, min(5, k - 1)] = 1e6
    x[m - 1, k - 1] = -3e5
  x = jnp.asarray(x, dtype)
  if special and m > 1:
    x = x.at[m // 3, k // 3].set(jnp.nan)
  return x


SHAPES = [(256, 512), (200, 72), (130, 300), (1, 7), (384, 1040)]


# ------------------------------------------------------------ quantize ---

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", [BF16, F32, F16])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("special", [False, True])
def test_quantize_tensorwise(shape, in_dtype, fp8, special):
  x = _input(shape, in_dtype, 1, special=special)
  scale = jnp.float32(3.0 if fp8 == E4M3 else 300.0)  # pushes some values past the max
  # One jit per impl holding both the columnwise and the rowwise-only call.
  f = lambda impl: lambda x, s: (
      q.quantize_tensorwise(x, s, fp8, columnwise=True, impl=impl),
      q.quantize_tensorwise(x, s, fp8, impl=impl))
  (got, got_r), (want, _) = jax.jit(f("cuda"))(x, scale), _jit_cpu(f("reference"), x, scale)
  _bits_equal(got.data, want.data, "data")
  _bits_equal(got.data_t, want.data_t, "data_t")
  _bits_equal(got.amax, _np_amax(x), "amax")
  assert got_r.data_t is None and got_r.scale_inv_t is None
  _bits_equal(got_r.data, want.data, "data (rowwise only)")
  _bits_equal(got_r.amax, _np_amax(x), "amax (rowwise only)")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", [BF16, F32])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("case", ["normal", "special", "zeros", "tiny"])
def test_quantize_current(shape, in_dtype, fp8, case):
  if case == "zeros":
    x = jnp.zeros(shape, in_dtype)
  elif case == "tiny":  # amax so small that fp8_max/amax overflows: scale clips to f32 max
    rng = np.random.default_rng(2)  # normal floats only (CPU XLA flushes denormals)
    x = jnp.asarray(rng.uniform(0.5, 1.0, shape) * rng.choice([-1.0, 1.0], shape) * 1e-36,
                    in_dtype)
  else:
    x = _input(shape, in_dtype, 2, special=case == "special")
  f = lambda impl: lambda x: (q.quantize_current(x, fp8, columnwise=True, impl=impl),
                              q.quantize_current(x, fp8, impl=impl))
  (got, got_r), (want, _) = jax.jit(f("cuda"))(x), _jit_cpu(f("reference"), x)
  want_scale_inv = want.scale_inv
  if case == "tiny":
    # scale = f32 max, so scale_inv = 1/f32max is a denormal, which the CPU
    # backend flushes to 0: compare with numpy's IEEE result instead.
    want_scale_inv = np.float32(1) / np.finfo(np.float32).max
  for g, tag in ((got, ""), (got_r, " (rowwise only)")):
    _bits_equal(g.data, want.data, "data" + tag)
    _bits_equal(g.scale_inv, want_scale_inv, "scale_inv" + tag)
    _bits_equal(g.amax, _np_amax(x), "amax" + tag)
  _bits_equal(got.data_t, want.data_t, "data_t")
  _bits_equal(got.scale_inv_t, want_scale_inv, "scale_inv_t")
  assert got_r.data_t is None and got_r.scale_inv_t is None


@pytest.mark.parametrize("shape", [(256, 512), (300, 200)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_from_amax_equals_current(shape, fp8):
  """The sharded current-scaling path (amax max-reduced elsewhere) must
  quantize exactly as the unsharded quantize_current, and a larger amax must
  give the scale the reference derives from it."""
  x = _input(shape, BF16, 3)
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  cur = jax.jit(lambda x: q.quantize_current(x, fp8, columnwise=True, impl="cuda"))(x)
  got = jax.jit(lambda x, a: q.quantize_from_amax(x, a, fp8, columnwise=True,
                                                  impl="cuda"))(x, amax)
  for field in ("data", "data_t", "scale_inv"):
    _bits_equal(getattr(got, field), getattr(cur, field), field)
  big = amax * 3.0
  got3 = jax.jit(lambda x, a: q.quantize_from_amax(x, a, fp8, columnwise=True,
                                                   impl="cuda"))(x, big)
  want3 = _jit_cpu(lambda x, a: q.quantize_from_amax(x, a, fp8, columnwise=True,
                                                     impl="reference"), x, big)
  for field in ("data", "data_t", "scale_inv"):
    _bits_equal(getattr(got3, field), getattr(want3, field), field + " (amax x3)")


BLOCK_SHAPES = [(256, 512), (300, 200), (128, 128), (17, 1000), (1000, 17), (1, 130), (640, 384)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("in_dtype", [BF16, F32])
@pytest.mark.parametrize("fp8,pow2", [(E4M3, True), (E4M3, False), (E5M2, False)])
def test_quantize_blockwise(shape, block, in_dtype, fp8, pow2):
  x = _input(shape, in_dtype, 3, spread=True)
  _check_blockwise(x, block, fp8, pow2)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260)])
def test_quantize_blockwise_special(block, shape):
  x = _input(shape, BF16, 4, special=True, spread=True)
  for fp8, pow2 in ((E4M3, True), (E5M2, False)):
    got = jax.jit(lambda x: q.quantize_blockwise(
        x, block, fp8, pow2, columnwise=True, impl="cuda"))(x)
    data, s, data_t, s_t = got.data, got.scale_inv, got.data_t, got.scale_inv_t
    want, want_s = _np_blockwise(x, block, fp8, pow2)
    want_t, want_s_t = _np_blockwise(np.asarray(x).T, block, fp8, pow2)
    _bits_equal(data, want, "data")
    _bits_equal(s, want_s, "scale_inv")
    _bits_equal(data_t, want_t, "data_t")
    _bits_equal(s_t, want_s_t, "scale_inv_t")


def _check_blockwise(x, block, fp8, pow2):
  f = lambda impl: lambda x: (
      q.quantize_blockwise(x, block, fp8, pow2, columnwise=True, impl=impl),
      q.quantize_blockwise(x, block, fp8, pow2, impl=impl))
  (got, got_r), (want, _) = jax.jit(f("cuda"))(x), _jit_cpu(f("reference"), x)
  for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
    _bits_equal(getattr(got, name), getattr(want, name), name)
  assert got.block_shape == want.block_shape == tuple(block)
  assert got.amax is None and want.amax is None
  got = got_r
  assert got.data_t is None and got.scale_inv_t is None
  _bits_equal(got.data, want.data, "data (rowwise only)")
  _bits_equal(got.scale_inv, want.scale_inv, "scale_inv (rowwise only)")


# The public one-pass quantize, every recipe's layout (te_jax.quantize).
ROWWISE_COLUMNWISE_LAYOUTS = [
    ("tensorwise", dict(scale=3.0)),
    ("current", {}),
    ("blockwise", dict(block_shape=(1, 128), power_2_scale=True)),
    ("blockwise", dict(block_shape=(1, 128))),
    ("blockwise", dict(block_shape=(128, 128), power_2_scale=True)),
]


@pytest.mark.parametrize("shape", [(256, 512), (130, 300), (1, 130), (640, 384)])
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_rowwise_columnwise(shape, special, fp8):
  x = _input(shape, BF16, 5, special=special, spread=True)
  for mode, options in ROWWISE_COLUMNWISE_LAYOUTS:
    f = lambda impl, mode=mode, options=options: lambda x: (
        public_quantize.quantize_rowwise_columnwise(x, mode, fp8, impl=impl, **options))
    got, want = jax.jit(f("cuda"))(x), _jit_cpu(f("reference"), x)
    for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
      if getattr(want, name) is None:
        assert getattr(got, name) is None, (mode, name)
      else:
        _bits_equal(getattr(got, name), getattr(want, name), f"{mode} {options} {name}")
    assert got.block_shape == want.block_shape


def test_quantize_blockwise_bad_block_shape():
  x = jnp.ones((128, 128), BF16)
  with pytest.raises(ValueError, match="block_shape"):
    q.quantize_blockwise(x, (1, 64), impl="cuda")


# ---------------------------------------------------------------- gemm ---

def _rel_err(got, want):
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(g - w) / np.linalg.norm(w)


def _operand(shape, dtype, block, seed, spread=None):
  spread = block is not None if spread is None else spread
  x = _input(shape, F32, seed, spread=spread) / 50.0
  if block is None:
    qt = q.quantize_current_reference(x, dtype)
    return ScaledTensor(qt.data, qt.scale_inv)
  qt = q.quantize_blockwise_reference(x, block, dtype, power_2_scale=True)
  return ScaledTensor(qt.data, qt.scale_inv, block)


# fp32 output: measured 1.2e-4 on the H200 even without fast accumulation
# (Hopper's FP8 tensor cores keep fewer accumulator bits between cuBLASLt's
# fp32 promotions; the same 1.28e-4 at K=16384): 5e-4.
_TOL = {BF16: 1e-2, F16: 4e-3, F32: 5e-4}
GEMM_SHAPES = [(128, 256, 512), (96, 160, 1024), (384, 256, 640)]


@pytest.mark.parametrize("mnk", GEMM_SHAPES)
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gemm_per_tensor(mnk, dtypes, out_dtype, fast_accum):
  m, n, k = mnk
  a, b = _operand((m, k), dtypes[0], None, 5), _operand((n, k), dtypes[1], None, 6)
  got = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=out_dtype, fast_accum=fast_accum,
                                           impl="cuda"))(a, b)
  want = gemm_ops.gemm_reference(a, b, F32)
  assert got.shape == (m, n) and got.dtype == out_dtype
  tol = max(_TOL[out_dtype], 5e-3) if fast_accum else _TOL[out_dtype]
  err = _rel_err(got, want)
  assert err < tol, f"relative error {err:.3g} >= {tol}"


BLOCK_PAIRS = [((1, 128), (128, 128)), ((1, 128), (1, 128)), ((128, 128), (1, 128))]


@pytest.mark.parametrize("mnk", [(128, 256, 512), (256, 384, 640), (384, 128, 1024),
                                 (144, 272, 512), (256, 256, 400)])
@pytest.mark.parametrize("blocks", BLOCK_PAIRS)
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_gemm_blockwise(mnk, blocks, out_dtype):
  m, n, k = mnk
  a, b = _operand((m, k), E4M3, blocks[0], 7), _operand((n, k), E4M3, blocks[1], 8)
  got = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=out_dtype, impl="cuda"))(a, b)
  want = gemm_ops.gemm_reference(a, b, F32)
  err = _rel_err(got, want)
  assert err < _TOL[out_dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("bias_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("blocks", [None, ((1, 128), (128, 128))])
def test_gemm_bias(out_dtype, bias_dtype, blocks):
  m, n, k = 128, 384, 512
  ba, bb = blocks if blocks else (None, None)
  # No magnitude spread: its 1e5-sized products would overflow fp16 output.
  a, b = _operand((m, k), E4M3, ba, 9, False), _operand((n, k), E4M3, bb, 10, False)
  bias = jnp.asarray(np.random.default_rng(11).standard_normal(n) * 4, bias_dtype)
  got = jax.jit(lambda a, b, c: gemm_ops.gemm(a, b, out_dtype=out_dtype, bias=c,
                                              impl="cuda"))(a, b, bias)
  want = gemm_ops.gemm_reference(a, b, F32, bias)
  err = _rel_err(got, want)
  assert err < _TOL[out_dtype] * 2, f"relative error {err:.3g}"


@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("blocks,fast_accum", [(None, False), (None, True),
                                               (((1, 128), (128, 128)), False),
                                               (((1, 128), (1, 128)), False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_residual(out_dtype, blocks, fast_accum, with_bias):
  """A residual (cuBLASLt's C, beta 1) of the output's size and magnitude,
  alone and beside a bias, with fast accumulation where per-tensor recipes
  ask for it, against the reference that adds it in float32."""
  m, n, k = 256, 384, 512
  ba, bb = blocks if blocks else (None, None)
  a, b = _operand((m, k), E4M3, ba, 12, False), _operand((n, k), E4M3, bb, 13, False)
  rng = np.random.default_rng(14)
  res = jnp.asarray(rng.standard_normal((m, n)) * 4, out_dtype)
  bias = jnp.asarray(rng.standard_normal(n), BF16) if with_bias else None
  got = jax.jit(lambda a, b, r: gemm_ops.gemm(a, b, out_dtype=out_dtype, bias=bias, residual=r,
                                              fast_accum=fast_accum, impl="cuda"))(a, b, res)
  want = gemm_ops.gemm_reference(a, b, F32, bias, res)
  err = _rel_err(got, want)
  assert err < _TOL[out_dtype] * 2, f"relative error {err:.3g}"
  # the residual is in the sum (not dropped, not added twice)
  plain = gemm_ops.gemm_reference(a, b, F32, bias)
  assert _rel_err(got, plain) > 10 * err


def test_gemm_alignment_errors():
  a = _operand((100, 256), E4M3, None, 12)
  b = _operand((128, 256), E4M3, None, 13)
  with pytest.raises(ValueError, match=r"a\.shape\[0\]"):
    gemm_ops.gemm(a, b, impl="cuda")
  with pytest.raises(ValueError, match=r"b\.shape\[0\]"):
    gemm_ops.gemm(b, a, impl="cuda")
  a = _operand((128, 264), E4M3, None, 12)
  b = _operand((128, 264), E4M3, None, 13)
  with pytest.raises(ValueError, match="K"):
    gemm_ops.gemm(a, b, impl="cuda")


def test_quantize_gemm_layout_cancels():
  """Under jit the logical<->cuBLASLt scale layout round trip leaves no
  transpose/pad between the quantize custom call and the GEMM."""
  x = _input((256, 512), BF16, 14)
  w = _input((384, 512), BF16, 15)

  def f(x, w):
    xa = q.quantize_blockwise(x, (1, 128), E4M3, True, impl="cuda")
    wb = q.quantize_blockwise(w, (128, 128), E4M3, True, impl="cuda")
    return gemm_ops.gemm(ScaledTensor(xa.data, xa.scale_inv, (1, 128)),
                         ScaledTensor(wb.data, wb.scale_inv, (128, 128)), impl="cuda")

  hlo = jax.jit(f).lower(x, w).compile().as_text()
  ops = [l for l in hlo.splitlines() if "=" in l and ("transpose(" in l or " pad(" in l)]
  assert not ops, "scale layout ops left between quantize and gemm:\n" + "\n".join(ops)
  xr = q.quantize_blockwise_reference(x, (1, 128), E4M3, True)
  wr = q.quantize_blockwise_reference(w, (128, 128), E4M3, True)
  want = gemm_ops.gemm_reference(ScaledTensor(xr.data, xr.scale_inv, (1, 128)),
                                 ScaledTensor(wr.data, wr.scale_inv, (128, 128)), F32)
  assert _rel_err(jax.jit(f)(x, w), want) < 1e-2
