"""te_jax.ops.grouped_gemm: the grouped GEMM op against a float64 loop.

The reference (the spec, and what runs until a CUDA kernel exists) must give
per group ``lhs[rows_e] @ rhs[e]`` (and, grouped over the contraction,
``lhs_t[:, rows_e] @ rhs_t[:, rows_e].T``) for any group sizes: odd shapes,
empty groups, one group, one row, rows past the groups; FP8 operands exactly
as their scales say; with static shapes (one compilation for any routing) and
without a dense (g, m, ...) expansion.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import grouped_gemm as gg
from te_jax.ops import quantize as qop
from te_jax.ops.fp8 import ScaledTensor

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# (m, k, n, group sizes): odd sizes with empty groups, one group, one row,
# rows past the groups (their output is 0), every group empty.
CASES = {
    "odd_with_empty_groups": (37, 19, 23, [3, 0, 20, 1, 0, 9]),
    "one_group": (16, 8, 5, [16]),
    "one_row": (1, 7, 3, [0, 1, 0]),
    "rows_past_the_groups": (40, 12, 6, [5, 0, 7]),
    "all_empty": (9, 4, 4, [0, 0]),
}


def _rng(seed=0):
  return np.random.default_rng(seed)


def loop_gemm(a, b, sizes):
  """float64 ``out[rows_e] = a[rows_e] @ b[e]``, rows past the groups 0."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  out = np.zeros((a.shape[0], b.shape[2]))
  start = 0
  for e, size in enumerate(sizes):
    out[start:start + size] = a[start:start + size] @ b[e]
    start += size
  return out


def loop_wgrad(a_t, b_t, sizes):
  """float64 ``out[e] = a_t[:, rows_e] @ b_t[:, rows_e].T``."""
  a_t, b_t = np.asarray(a_t, np.float64), np.asarray(b_t, np.float64)
  out = np.zeros((len(sizes), a_t.shape[0], b_t.shape[0]))
  start = 0
  for e, size in enumerate(sizes):
    out[e] = a_t[:, start:start + size] @ b_t[:, start:start + size].T
    start += size
  return out


def _close(got, want, tol=1e-6):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(np.abs(want).max(), 1.0)
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_matches_float64_loop(case):
  m, k, n, sizes = CASES[case]
  rng = _rng()
  a = rng.standard_normal((m, k)).astype(np.float32)
  b = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
  out = gg.grouped_gemm(jnp.asarray(a), jnp.asarray(b), jnp.asarray(sizes, jnp.int32),
                        out_dtype=jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  _close(out, loop_gemm(a, b, sizes))


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_wgrad_matches_float64_loop(case):
  m, k, n, sizes = CASES[case]
  rng = _rng(1)
  a_t = rng.standard_normal((k, m)).astype(np.float32)
  b_t = rng.standard_normal((n, m)).astype(np.float32)
  out = gg.grouped_wgrad(jnp.asarray(a_t), jnp.asarray(b_t), jnp.asarray(sizes, jnp.int32))
  assert out.shape == (len(sizes), k, n) and out.dtype == jnp.float32
  _close(out, loop_wgrad(a_t, b_t, sizes))


def test_bfloat16_operands_accumulate_in_float32():
  rng = _rng(2)
  a = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((2, 256, 8)), jnp.bfloat16)
  out = gg.grouped_gemm(a, b, jnp.asarray([40, 24], jnp.int32), out_dtype=jnp.float32)
  _close(out, loop_gemm(np.asarray(a, np.float32), np.asarray(b, np.float32), [40, 24]),
         tol=1e-6)


@jax.jit
def _per_group_tensorwise(w):
  """Each group's matrix quantized with its own per-tensor scale."""
  q = jax.vmap(lambda v: qop.quantize_current_reference(v, E4M3))(w)
  return gg.GroupedScaledTensor(q.data, q.scale_inv)


@jax.jit
def _per_group_blocks(w):
  q = jax.vmap(lambda v: qop.quantize_blockwise_reference(v, (128, 128), E4M3))(w)
  return gg.GroupedScaledTensor(q.data, q.scale_inv, (128, 128))


def _dequantized(t):
  """numpy ``data * scale_inv`` per tensor, per group, or per tile (any rank)."""
  data = np.asarray(t.data.astype(jnp.float32), np.float64)
  s = np.asarray(t.scale_inv, np.float64)
  if t.block_shape is None:
    return data * s.reshape(s.shape + (1,) * (data.ndim - s.ndim))
  bm, bk = t.block_shape
  full = np.repeat(np.repeat(s, bm, axis=-2), bk, axis=-1)
  return data * full[..., :data.shape[-2], :data.shape[-1]]


def test_fp8_operands_are_dequantized_as_their_scales_say():
  """Per tensor (one scale per group's matrix) and blockwise (1x128 x 128x128)."""
  rng = _rng(3)
  m, k, n, sizes = 300, 256, 136, [128, 0, 44, 128]
  a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  # groups of very different magnitudes: one shared scale would lose the small ones
  w = jnp.asarray(rng.standard_normal((4, k, n)) * np.array([1, 1e-3, 1e3, 1])[:, None, None],
                  jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  gemm = jax.jit(lambda a, b, gs: gg.grouped_gemm(a, b, gs, out_dtype=jnp.float32))
  qa = jax.jit(lambda a: qop.quantize_current_reference(a, E4M3))(a)
  lhs = ScaledTensor(qa.data, qa.scale_inv)
  rhs = _per_group_tensorwise(w)
  assert rhs.scale_inv.shape == (4,)
  _close(gemm(lhs, rhs, gs), loop_gemm(_dequantized(lhs), _dequantized(rhs), sizes))
  qb = jax.jit(lambda a: qop.quantize_blockwise_reference(a, (1, 128), E4M3))(a)
  lhs_b = ScaledTensor(qb.data, qb.scale_inv, (1, 128))
  rhs_b = _per_group_blocks(w)
  _close(gemm(lhs_b, rhs_b, gs), loop_gemm(_dequantized(lhs_b), _dequantized(rhs_b), sizes))
  # and the transposed stack (the dgrad operand) is the transpose of each group
  np.testing.assert_array_equal(_dequantized(rhs_b.T),
                                np.swapaxes(_dequantized(rhs_b), 1, 2))


def test_fp8_wgrad_operands():
  rng = _rng(4)
  k, m, n, sizes = 160, 384, 96, [128, 256, 0]
  x_t = jnp.asarray(rng.standard_normal((k, m)), jnp.float32)
  g_t = jnp.asarray(rng.standard_normal((n, m)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  for make in (lambda t, d: qop.quantize_current_reference(t, d),
               lambda t, d: qop.quantize_blockwise_reference(t, (1, 128), d)):
    qx, qg = jax.jit(lambda x, g: (make(x, E4M3), make(g, E5M2)))(x_t, g_t)
    a = ScaledTensor(qx.data, qx.scale_inv, qx.block_shape)
    b = ScaledTensor(qg.data, qg.scale_inv, qg.block_shape)
    _close(jax.jit(gg.grouped_wgrad)(a, b, gs),
           loop_wgrad(_dequantized(a), _dequantized(b), sizes))


@pytest.mark.parametrize("sizes", [[-1, 5], [6, 5]])
def test_group_sizes_that_cannot_describe_lhs_give_nan(sizes):
  """A negative size or a sum above m is device data: it surfaces as NaN."""
  a, b = jnp.ones((10, 4)), jnp.ones((2, 4, 3))
  gs = jnp.asarray(sizes, jnp.int32)
  assert np.isnan(np.asarray(gg.grouped_gemm(a, b, gs, out_dtype=jnp.float32))).all()
  assert np.isnan(np.asarray(gg.grouped_wgrad(a.T, a.T, gs))).all()
  ok = gg.grouped_gemm(a, b, jnp.asarray([5, 5], jnp.int32), out_dtype=jnp.float32)
  assert np.isfinite(np.asarray(ok)).all()


def test_non_finite_operands_surface():
  a = jnp.ones((8, 4)).at[2, 1].set(jnp.inf)
  out = gg.grouped_gemm(a, jnp.ones((2, 4, 3)), jnp.asarray([4, 4], jnp.int32),
                        out_dtype=jnp.float32)
  assert np.isinf(np.asarray(out[2])).all() and np.isfinite(np.asarray(out[4:])).all()


def test_one_compilation_for_any_routing():
  traces = []

  @jax.jit
  def f(a, b, gs):
    traces.append(1)
    return gg.grouped_gemm(a, b, gs, out_dtype=jnp.float32)

  rng = _rng(5)
  a = rng.standard_normal((24, 8)).astype(np.float32)
  b = rng.standard_normal((3, 8, 4)).astype(np.float32)
  for sizes in ([8, 8, 8], [24, 0, 0], [0, 1, 20]):
    _close(f(a, b, jnp.asarray(sizes, jnp.int32)), loop_gemm(a, b, sizes))
  assert len(traces) == 1


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_reference_memory_is_not_a_dense_expansion():
  """64 groups of 1024 x 256 rows: the temporaries stay a small multiple of the
  output, where ``jax.lax.ragged_dot``'s default lowering expands lhs to
  (g, m, k) (checked here too, so this test can tell the two apart)."""
  g, m, k, n = 64, 1024, 256, 256
  a = jax.ShapeDtypeStruct((m, k), jnp.float32)
  b = jax.ShapeDtypeStruct((g, k, n), jnp.float32)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  out_bytes = m * n * 4
  ours = _temp_bytes(lambda a, b, gs: gg.grouped_gemm(a, b, gs, out_dtype=jnp.float32),
                     a, b, gs)
  dense = _temp_bytes(lambda a, b, gs: jax.lax.ragged_dot(a, b, gs), a, b, gs)
  assert ours <= 4 * out_bytes, ours
  assert dense >= g * m * k * 4 // 2, dense   # the expansion this op avoids


def test_chunk_rows():
  assert gg.chunk_rows(1, 5) == 1
  assert gg.chunk_rows(1000, 8) == 128
  assert gg.chunk_rows(100, 1) == 100


def _st(shape, dtype=E4M3, block=None, scale_shape=()):
  return ScaledTensor(jnp.zeros(shape, dtype), jnp.ones(scale_shape, jnp.float32), block)


def _gst(shape, dtype=E4M3, block=None, scale_shape=None):
  scale_shape = (shape[0],) if scale_shape is None else scale_shape
  return gg.GroupedScaledTensor(jnp.zeros(shape, dtype), jnp.ones(scale_shape, jnp.float32),
                                block)


GS2 = jnp.asarray([1, 1], jnp.int32)


@pytest.mark.parametrize("lhs, rhs, gs, exc, msg", [
    (jnp.ones((4, 8)), jnp.ones((2, 9, 3)), GS2, ValueError, "must share k"),
    (jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.asarray([1.0, 1.0]), TypeError, "int32"),
    (jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.asarray([1, 1, 1], jnp.int32), ValueError,
     r"shape \(2,\)"),
    (jnp.ones((4, 8)), jnp.ones((8, 3)), GS2, ValueError, "rhs must be 3-D"),
    (jnp.ones((4, 8), jnp.int32), jnp.ones((2, 8, 3)), GS2, TypeError, "lhs must be"),
    (jnp.ones((0, 8)), jnp.ones((2, 8, 3)), GS2, ValueError, "must not be empty"),
    (_st((4, 8)), jnp.ones((2, 8, 3)), GS2, TypeError, "both be FP8"),
    (_st((4, 8), E5M2), _gst((2, 8, 3), E5M2), GS2, TypeError, "E5M2 x E5M2"),
    (_st((4, 8)), _gst((2, 8, 3), scale_shape=()), GS2, ValueError, "one per group"),
    (_st((4, 128), block=(1, 128), scale_shape=(4, 1)), _gst((2, 128, 3)), GS2,
     ValueError, "both be per-tensor or both blockwise"),
    (_st((4, 128), block=(1, 128), scale_shape=(4, 1)),
     _gst((2, 128, 128), block=(1, 128), scale_shape=(2, 128, 1)), GS2, ValueError,
     "unsupported block-shape pair"),
    (_st((4, 8)), _st((8, 3)), GS2, TypeError, "GroupedScaledTensor"),
])
def test_grouped_gemm_argument_checks(lhs, rhs, gs, exc, msg):
  with pytest.raises(exc, match=msg):
    gg.grouped_gemm(lhs, rhs, gs)


def test_grouped_wgrad_argument_checks():
  with pytest.raises(ValueError, match="share the grouped dim m"):
    gg.grouped_wgrad(jnp.ones((4, 8)), jnp.ones((3, 9)), GS2)
  with pytest.raises(ValueError, match="1-D"):
    gg.grouped_wgrad(jnp.ones((4, 8)), jnp.ones((3, 8)), jnp.ones((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="unsupported block-shape pair"):
    gg.grouped_wgrad(_st((128, 8), block=(1, 128), scale_shape=(128, 1)),
                     _st((128, 8), block=(128, 128), scale_shape=(1, 1)), GS2)
  with pytest.raises(TypeError, match="out_dtype"):
    gg.grouped_wgrad(jnp.ones((4, 8)), jnp.ones((3, 8)), GS2, out_dtype=jnp.int32)


def test_impl_cuda_raises_and_auto_logs_once(caplog):
  a, b = jnp.ones((4, 8)), jnp.ones((2, 8, 3))
  with pytest.raises(ValueError, match="no grouped-GEMM CUDA kernel"):
    gg.grouped_gemm(a, b, GS2, impl="cuda")
  with pytest.raises(ValueError, match="impl must be one of"):
    gg.grouped_gemm(a, b, GS2, impl="fast")
  gg._log_no_kernel.cache_clear()   # pylint: disable=protected-access
  with caplog.at_level(logging.INFO, logger="te_jax"):
    gg.grouped_gemm(a, b, GS2)
    gg.grouped_wgrad(a.T, a.T, GS2)
  logged = [r for r in caplog.records if "no grouped-GEMM CUDA kernel" in r.getMessage()]
  assert len(logged) == 1 and logged[0].levelno == logging.INFO
  np.testing.assert_array_equal(np.asarray(gg.grouped_gemm(a, b, GS2, impl="reference")),
                                np.asarray(gg.grouped_gemm(a, b, GS2)))
