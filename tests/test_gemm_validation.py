"""Input validation of the cuBLASLt GEMM (``te_jax_gemm``).

Two layers: ``gemm_cuda.gemm`` rejects bad operands at trace time (these tests
run anywhere: the checks come before the custom call), and the FFI handler
itself rejects them when the target is called directly through
``jax.ffi.ffi_call`` (GPU tests: the error comes back from the execution as a
``JaxRuntimeError`` carrying the handler's message).
"""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax.ops import _native
from te_jax.ops import gemm_cuda
from te_jax.scaled_tensor import ScaledTensor

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
_RUNTIME_ERROR = getattr(jax.errors, "JaxRuntimeError", RuntimeError)


def _st(shape, dtype=E4M3, block=None, scale=None):
  data = jnp.zeros(shape, dtype)
  if scale is None:
    scale = (jnp.ones((), F32) if block is None else
             jnp.ones((-(-shape[0] // block[0]), -(-shape[1] // block[1])), F32))
  return ScaledTensor(data, scale, block)


# ------------------------------------------- trace time (gemm_cuda.gemm) ---

@pytest.mark.parametrize("a, b, out_dtype, exc, msg", [
    (_st((32, 64), BF16), _st((48, 64)), BF16, TypeError, r"a\.data must be float8"),
    (_st((32, 64)), _st((48, 64), jnp.int8), BF16, TypeError, r"b\.data must be float8"),
    (_st((32, 64), E5M2), _st((48, 64), E5M2), BF16, TypeError, "E5M2 x E5M2"),
    (_st((32, 64)), _st((48, 80)), BF16, ValueError, "must share K"),
    (_st((32, 64)), _st((48, 64)), E4M3, TypeError, "out_dtype"),
    (_st((32, 64)), _st((48, 64)), jnp.int32, TypeError, "out_dtype"),
    (_st((40, 64)), _st((48, 64)), BF16, ValueError, r"a\.shape\[0\]"),
    (_st((32, 72)), _st((48, 72)), BF16, ValueError, "K"),
    (_st((32, 64), scale=jnp.ones((), BF16)), _st((48, 64)), BF16, TypeError,
     r"a\.scale_inv must be float32"),
    (_st((32, 64), scale=jnp.ones((2,), F32)), _st((48, 64)), BF16, ValueError,
     r"a\.scale_inv must be a scalar"),
    (_st((32, 256), block=(1, 128)), _st((48, 256), block=(128, 128), scale=jnp.ones((1, 3), F32)),
     BF16, ValueError, r"b\.scale_inv must have shape \(1, 2\)"),
    (_st((32, 256), block=(128, 128)), _st((48, 256), block=(128, 128)), BF16, ValueError,
     "unsupported scaling pair"),
    (_st((32, 256)), _st((48, 256), block=(1, 128)), BF16, ValueError, "unsupported scaling pair"),
])
def test_trace_time_errors(a, b, out_dtype, exc, msg):
  with pytest.raises(exc, match=msg):
    gemm_cuda.gemm(a, b, out_dtype)


@pytest.mark.parametrize("bias, exc, msg", [
    (jnp.zeros((48,), jnp.int32), TypeError, "bias must be"),
    (jnp.zeros((48,), E4M3), TypeError, "bias must be"),
    (jnp.zeros((32,), BF16), ValueError, r"bias must have shape \(48,\)"),
    (jnp.zeros((1, 48), BF16), ValueError, r"bias must have shape \(48,\)"),
])
def test_trace_time_bias_errors(bias, exc, msg):
  with pytest.raises(exc, match=msg):
    gemm_cuda.gemm(_st((32, 64)), _st((48, 64)), BF16, bias)


@pytest.mark.parametrize("residual, exc, msg", [
    (jnp.zeros((32, 48), F32), TypeError, "residual must have out_dtype"),
    (jnp.zeros((48, 32), BF16), ValueError, r"residual must have the output's shape \(32, 48\)"),
    (jnp.zeros((32 * 48,), BF16), ValueError, "residual must have the output's shape"),
])
def test_trace_time_residual_errors(residual, exc, msg):
  with pytest.raises(exc, match=msg):
    gemm_cuda.gemm(_st((32, 64)), _st((48, 64)), BF16, residual=residual)


def test_reference_adds_the_residual_before_the_one_rounding():
  """ops.gemm's reference (the spec of the residual): (a @ b.T + bias +
  residual) in float32, rounded once to out_dtype; the checks name it."""
  from te_jax.ops import gemm as gemm_ops
  rng = np.random.default_rng(0)
  # Small integers: every product and sum of the GEMM is exact in float32,
  # so the only rounding is the final one.
  a = ScaledTensor(jnp.asarray(rng.integers(-3, 4, (32, 64)), E4M3), jnp.asarray(0.5, F32))
  b = ScaledTensor(jnp.asarray(rng.integers(-3, 4, (48, 64)), E4M3), jnp.asarray(2.0, F32))
  res = jnp.asarray(rng.standard_normal((32, 48)) * 3, BF16)
  bias = jnp.asarray(rng.standard_normal(48), F32)
  got = gemm_ops.gemm(a, b, out_dtype=BF16, bias=bias, residual=res, impl="reference")
  prod = (np.asarray(a.data, np.float32) @ np.asarray(b.data, np.float32).T) * 0.5 * 2.0
  want = (prod + np.asarray(bias) + np.asarray(res, np.float32)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got), want)
  # two roundings (the product to bf16, then the sum) differ somewhere
  twice = (prod.astype(jnp.bfloat16).astype(np.float32) + np.asarray(bias)).astype(
      jnp.bfloat16).astype(np.float32) + np.asarray(res, np.float32)
  assert np.any(twice.astype(jnp.bfloat16) != want)
  with pytest.raises(TypeError, match="residual must have out_dtype"):
    gemm_ops.gemm(a, b, out_dtype=BF16, residual=res.astype(F32), impl="reference")
  with pytest.raises(ValueError, match=r"residual must have the output's shape \(32, 48\)"):
    gemm_ops.gemm(a, b, out_dtype=BF16, residual=res.T, impl="reference")


def test_workspace_is_a_result():
  """The custom call asks XLA for cuBLASLt's workspace as a second result (a
  temporary XLA allocates), so the handler allocates nothing and XLA may
  record it in command buffers; the op returns only the product. Checked on
  the GPU lowering, which a CPU machine can produce."""
  a, b = _st((32, 256)), _st((48, 256))
  lowered = jax.jit(lambda a, b: gemm_cuda.gemm(a, b, BF16)).trace(a, b).lower(
      lowering_platforms=("cuda",))
  calls = [l for l in lowered.as_text().splitlines() if "te_jax_gemm" in l]
  assert len(calls) == 1, calls
  nbytes = gemm_cuda.WORKSPACE.shape[0]
  assert nbytes >= 32 << 20 and gemm_cuda.WORKSPACE.dtype == jnp.uint8
  assert f"-> (tensor<32x48xbf16>, tensor<{nbytes}xui8>)" in calls[0], calls[0]
  assert lowered.out_info.shape == (32, 48)


# ------------------------------------------------ the handler (GPU only) ---

def _compile(a, b, a_sinv, b_sinv, out_shape, out_dtype=BF16, bias=None, a_mode=0, b_mode=0,
             fast_accum=0, compiler_options=None, pre=None, workspace=None, residual=None,
             has_residual=None):
  """(compiled jit(ffi_call("te_jax_gemm")), its arguments), bypassing
  gemm_cuda's checks; `pre` maps the operand tuple inside the jit;
  `workspace` replaces the scratch result's shape (default: gemm_cuda's);
  `has_residual` overrides the attribute (default: whether `residual` is given)."""
  _native.resolve_impl("cuda")  # registers the targets (or raises)
  has_bias = bias is not None
  bias = jnp.zeros((0,), BF16) if bias is None else bias
  if has_residual is None:
    has_residual = residual is not None
  residual = jnp.zeros((0, 0), out_dtype) if residual is None else residual
  workspace = gemm_cuda.WORKSPACE if workspace is None else workspace
  call = jax.ffi.ffi_call(
      "te_jax_gemm", (jax.ShapeDtypeStruct(out_shape, jnp.dtype(out_dtype)), workspace))

  def f(*ops):
    ops = pre(*ops) if pre else ops
    out, _ = call(*ops, a_mode=np.int64(a_mode), b_mode=np.int64(b_mode),
                  fast_accum=np.int64(fast_accum), has_bias=np.int64(has_bias),
                  has_residual=np.int64(has_residual))
    return out

  args = (a, b, a_sinv, b_sinv, bias, residual)
  lowered = jax.jit(f).lower(*args)
  return (lowered.compile(compiler_options) if compiler_options else lowered.compile()), args


def _call(*args, **kw):
  compiled, ops = _compile(*args, **kw)
  return jax.block_until_ready(compiled(*ops))


def _rand_fp8(shape, dtype, seed):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jnp.asarray(x, dtype)


def _ref(a, b, sa, sb):
  af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return (af @ bf.T) * float(sa) * float(sb)


_ONE = jnp.ones((), F32)


def _expect(msg, **kw):
  kw.setdefault("a", jnp.zeros((32, 256), E4M3))
  kw.setdefault("b", jnp.zeros((48, 256), E4M3))
  kw.setdefault("a_sinv", _ONE)
  kw.setdefault("b_sinv", _ONE)
  kw.setdefault("out_shape", (32, 48))
  with pytest.raises(_RUNTIME_ERROR, match=re.escape("te_jax gemm: " + msg)):
    _call(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32, jnp.int8])
def test_handler_rejects_non_fp8_operands(dtype):
  _expect("a and b must be float8_e4m3fn or float8_e5m2", a=jnp.zeros((32, 256), dtype))
  _expect("a and b must be float8_e4m3fn or float8_e5m2", b=jnp.zeros((48, 256), dtype))


@pytest.mark.gpu
def test_handler_rejects_e5m2_pair():
  _expect("E5M2 x E5M2", a=jnp.zeros((32, 256), E5M2), b=jnp.zeros((48, 256), E5M2))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2, jnp.int32, jnp.float64])
def test_handler_rejects_output_type(out_dtype):
  if out_dtype == jnp.float64 and not jax.config.jax_enable_x64:
    pytest.skip("float64 needs jax_enable_x64")
  _expect("out must be bfloat16, float16 or float32", out_dtype=out_dtype)


@pytest.mark.gpu
def test_handler_rejects_shapes():
  _expect("a (M, K) and b (N, K) must be 2-D with equal K", b=jnp.zeros((48, 128), E4M3))
  _expect("a (M, K) and b (N, K) must be 2-D with equal K", a=jnp.zeros((32, 256, 1), E4M3))
  _expect("out must have shape (M, N) = (32, 48), got (48, 32)", out_shape=(48, 32))
  _expect("out must have shape (M, N) = (32, 48), got (32, 48, 1)", out_shape=(32, 48, 1))
  _expect("M, N and K must be multiples of 16", a=jnp.zeros((40, 256), E4M3), out_shape=(40, 48))
  _expect("M, N and K must be multiples of 16", a=jnp.zeros((32, 264), E4M3),
          b=jnp.zeros((48, 264), E4M3))


@pytest.mark.gpu
def test_handler_rejects_scales():
  _expect("a_sinv must be float32", a_sinv=jnp.ones((), BF16))
  _expect("b_sinv must be float32", b_sinv=jnp.ones((), jnp.int32))
  _expect("a_sinv must hold 1 float for per-tensor scaling", a_sinv=jnp.ones((2,), F32))
  _expect("b_sinv must hold 1 float for per-tensor scaling", b_sinv=jnp.ones((0,), F32))
  vec_a = jnp.ones((2, 32), F32)  # VEC128 a: (ceil(K/128), M)
  vec_b = jnp.ones((2, 48), F32)
  blk_b = jnp.ones((1, 4), F32)   # BLK128x128 b: (ceil(N/128), roundup(ceil(K/128), 4))
  _expect("a_sinv must have shape (2, 32) for VEC128", a_sinv=jnp.ones((32, 2), F32),
          b_sinv=vec_b, a_mode=1, b_mode=1)
  _expect("b_sinv must have shape (2, 48) for VEC128", a_sinv=vec_a,
          b_sinv=jnp.ones((2, 47), F32), a_mode=1, b_mode=1)
  _expect("b_sinv must have shape (1, 4) for BLK128x128", a_sinv=vec_a,
          b_sinv=jnp.ones((1, 2), F32), a_mode=1, b_mode=2)
  _expect("b_sinv must be float32", a_sinv=vec_a, b_sinv=blk_b.astype(BF16), a_mode=1, b_mode=2)
  _expect("unsupported scale modes a_mode=2 b_mode=2", a_sinv=jnp.ones((1, 4), F32),
          b_sinv=blk_b, a_mode=2, b_mode=2)
  _expect("unsupported scale modes a_mode=0 b_mode=1", b_sinv=vec_b, b_mode=1)
  _expect("unsupported scale modes a_mode=3 b_mode=3", a_mode=3, b_mode=3)


@pytest.mark.gpu
def test_handler_rejects_bias_and_flags():
  _expect("bias must be bfloat16, float16 or float32", bias=jnp.zeros((48,), jnp.int32))
  _expect("bias must be bfloat16, float16 or float32", bias=jnp.zeros((48,), E4M3))
  _expect("bias must have shape (48,), got (32,)", bias=jnp.zeros((32,), BF16))
  _expect("bias must have shape (48,), got (1, 48)", bias=jnp.zeros((1, 48), BF16))
  _expect("fast_accum, has_bias and has_residual must be 0 or 1", fast_accum=2)
  _expect("fast_accum, has_bias and has_residual must be 0 or 1",
          residual=jnp.zeros((32, 48), BF16), has_residual=2)


@pytest.mark.gpu
def test_handler_rejects_residual():
  _expect("residual must have out's shape (32, 48), got (48, 32)",
          residual=jnp.zeros((48, 32), BF16))
  _expect("residual must have out's shape (32, 48), got (0, 0)", has_residual=1)
  _expect("residual must have out's dtype", residual=jnp.zeros((32, 48), F32))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_handler_direct_call_ok(out_dtype):
  """The same direct call with valid buffers computes the product (so the
  error tests above fail for the reason they name)."""
  a, b = _rand_fp8((32, 256), E4M3, 0), _rand_fp8((48, 256), E5M2, 1)
  sa, sb = jnp.asarray(0.5, F32), jnp.asarray(2.0, F32)
  got = _call(a, b, sa, sb, (32, 48), out_dtype)
  want = _ref(a, b, sa, sb)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)




@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [0, 100, (1 << 20) + 7])
def test_handler_any_workspace_size(nbytes):
  """The workspace is whatever the caller passes: none, less than the
  handler's 256-byte alignment skip, or an odd size. cuBLASLt must then be
  asked for an algorithm within it (a larger one would write past it)."""
  a, b = _rand_fp8((256, 512), E4M3, 4), _rand_fp8((128, 512), E4M3, 5)
  got = _call(a, b, _ONE, _ONE, (256, 128), F32,
              workspace=jax.ShapeDtypeStruct((nbytes,), jnp.uint8))
  # The direct-call bounds (test_handler_direct_call_ok), not 1e-3: Hopper's
  # FP8 tensor cores accumulate in less than float32 between promotions, and
  # the kernel cuBLASLt picks without workspace was measured (H200,
  # 2026-12-01) up to 0.025 off at |x| ~ 11 and 0.011 at 0.35 on 6 of 32768
  # elements; a wrong workspace would be garbage, not a few ulps of FP8 sums.
  np.testing.assert_allclose(np.asarray(got), _ref(a, b, 1.0, 1.0), rtol=1e-2, atol=1e-2)
@pytest.mark.gpu
def test_handler_k_zero():
  """K = 0 is an empty sum: zeros plus the bias (cuBLASLt does not take k = 0)."""
  bias = jnp.arange(48, dtype=F32)
  got = _call(jnp.zeros((32, 0), E4M3), jnp.zeros((48, 0), E4M3), _ONE, _ONE, (32, 48), BF16,
                 bias=bias)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.broadcast_to(np.asarray(bias), (32, 48)))


@pytest.mark.gpu
def test_handler_residual():
  """The residual is added (beta 1) to the product, and alone at K = 0 (the
  residual plus the bias, copied, where cuBLASLt takes no k = 0)."""
  rng = np.random.default_rng(6)
  res = jnp.asarray(rng.standard_normal((32, 48)) * 8, F32)
  a, b = _rand_fp8((32, 256), E4M3, 7), _rand_fp8((48, 256), E4M3, 8)
  got = _call(a, b, _ONE, _ONE, (32, 48), F32, residual=res)
  np.testing.assert_allclose(np.asarray(got), _ref(a, b, 1.0, 1.0) + np.asarray(res),
                             rtol=1e-2, atol=1e-2)
  bias = jnp.arange(48, dtype=F32)
  got = _call(jnp.zeros((32, 0), E4M3), jnp.zeros((48, 0), E4M3), _ONE, _ONE, (32, 48), F32,
              bias=bias, residual=res)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(res) + np.asarray(bias))


@pytest.mark.gpu
def test_handler_unaligned_operand():
  """An operand that starts 16 bytes past a 256-byte boundary. Only
  dynamic-slice fusion hands a custom call a sub-buffer (a row slice of a
  parameter, offset K bytes); without it XLA copies the slice into its own
  aligned buffer and the case cannot be built, so the test skips."""
  m, n, k = 32, 48, 272  # offset of row 1: 272 bytes = 256 + 16
  big = _rand_fp8((m + 1, k), E4M3, 2)
  b = _rand_fp8((n, k), E4M3, 3)
  pre = lambda big, *rest: (jax.lax.slice_in_dim(big, 1, m + 1, axis=0),) + rest
  try:
    compiled, ops = _compile(big, b, _ONE, _ONE, (m, n), F32, pre=pre,
                             compiler_options={"xla_gpu_enable_dynamic_slice_fusion": True})
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"dynamic-slice fusion not available: {e}")
  hlo = compiled.as_text()
  if not any(s in hlo for s in ("address_computation", "dynamic_slice_fusion",
                                "address-computation", "dynamic-slice-fusion")):
    pytest.skip("XLA copied the slice (no dynamic-slice fusion): operand stays aligned")
  got = jax.block_until_ready(compiled(*ops))
  want = _ref(big[1:], b, 1.0, 1.0)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-2)
