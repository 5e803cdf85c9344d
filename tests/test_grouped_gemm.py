"""te_jax.ops.grouped_gemm: the grouped GEMM op against a float64 loop.

The reference (the spec, and what runs wherever the CUDA kernel does not) must give
per group ``lhs[rows_e] @ rhs[e]`` (and, grouped over the contraction,
``lhs_t[:, rows_e] @ rhs_t[:, rows_e].T``) for any group sizes: odd shapes,
empty groups, one group, one row, rows past the groups; FP8 operands exactly
as their scales say; with static shapes (one compilation for any routing) and
without a dense (g, m, ...) expansion.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import grouped_gemm as gg
from te_jax.ops import grouped_gemm_cuda as ggc
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


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_wgrad_rows_matches_float64_loop(case):
  """The row-major wgrad on x (m, k) and grad (m, n) as stored: per group
  x[rows_e].T @ grad[rows_e] (odd shapes, empty groups, one row, rows past
  the groups)."""
  m, k, n, sizes = CASES[case]
  rng = _rng(4)
  x = rng.standard_normal((m, k)).astype(np.float32)
  grad = rng.standard_normal((m, n)).astype(np.float32)
  out = jax.jit(gg.grouped_wgrad_rows)(jnp.asarray(x), jnp.asarray(grad),
                                       jnp.asarray(sizes, jnp.int32))
  assert out.shape == (len(sizes), k, n) and out.dtype == jnp.float32
  _close(out, loop_wgrad(x.T, grad.T, sizes))


@pytest.mark.parametrize("sizes", [[-1, 5], [6, 5], [2 ** 31 - 1, 2 ** 31 - 1, 4]])
def test_grouped_wgrad_rows_sizes_that_cannot_describe_x_give_nan(sizes):
  x = jnp.ones((10, 4))
  gs = jnp.asarray(sizes, jnp.int32)
  assert np.isnan(np.asarray(gg.grouped_wgrad_rows(x, x[:, :3], gs))).all()


@pytest.mark.parametrize("x, grad, error, says", [
    (ScaledTensor(jnp.ones((8, 4), E4M3), jnp.ones((), jnp.float32)), jnp.ones((8, 3)),
     TypeError, "grouped_wgrad_rows takes float arrays, got an FP8 ScaledTensor x"),
    (jnp.ones((8, 4)), jnp.ones((7, 3)), ValueError,
     "x (m, k) and grad (m, n) must share the grouped dim m, got x (8, 4) and grad (7, 3)"),
    (jnp.ones((8, 4)), jnp.ones((8, 3), jnp.int32), TypeError, "grad must be a float32"),
    (jnp.ones((8,)), jnp.ones((8, 3)), ValueError, "x must be 2-D"),
])
def test_grouped_wgrad_rows_refuses_bad_operands(x, grad, error, says):
  with pytest.raises(error, match=re.escape(says)):
    gg.grouped_wgrad_rows(x, grad, jnp.asarray([4, 4], jnp.int32))


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


@pytest.mark.parametrize("sizes", [[-1, 5], [6, 5], [2 ** 31 - 1, 2 ** 31 - 1, 4]])
def test_group_sizes_that_cannot_describe_lhs_give_nan(sizes):
  """A negative size or a sum above m (also one whose int32 sum wraps to
  within m) is device data: it surfaces as NaN."""
  a, b = jnp.ones((10, 4)), jnp.ones((len(sizes), 4, 3))
  gs = jnp.asarray(sizes, jnp.int32)
  assert np.isnan(np.asarray(gg.grouped_gemm(a, b, gs, out_dtype=jnp.float32))).all()
  assert np.isnan(np.asarray(gg.grouped_wgrad(a.T, a.T, gs))).all()
  ok = gg.grouped_gemm(a, b, jnp.asarray([5, 5] + [0] * (len(sizes) - 2), jnp.int32),
                       out_dtype=jnp.float32)
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


def test_impl_without_a_gpu(caplog):
  """On this CPU machine: "cuda" raises as every op does, a bad impl is named,
  "auto" is the reference without a word."""
  a, b = jnp.ones((4, 8)), jnp.ones((2, 8, 3))
  with pytest.raises(RuntimeError, match="impl='cuda' was requested"):
    gg.grouped_gemm(a, b, GS2, impl="cuda")
  with pytest.raises(ValueError, match="impl must be one of"):
    gg.grouped_gemm(a, b, GS2, impl="fast")
  with caplog.at_level(logging.INFO, logger="te_jax"):
    out = gg.grouped_gemm(a, b, GS2)
  assert not caplog.records
  np.testing.assert_array_equal(np.asarray(gg.grouped_gemm(a, b, GS2, impl="reference")),
                                np.asarray(out))


# --------------------------------------------------- the CUDA kernel's path ---
# What runs here without a GPU: the wrapper's layout conversions (fed to a
# numpy model of the kernel's documented contract), the ffi_call it stages,
# the dispatcher's choice and its log, with the GPU and the build faked.

_BUILT_NOTE = ("built with the CUDA toolkit: system at /usr/local/cuda; XLA FFI headers of jax "
               "0.11.2; CUDA architectures 90a; sm90 GEMMs: built with the CUTLASS 4.2.0 "
               "headers in /x/include")
_LEFT_OUT_NOTE = ("built with the CUDA toolkit: system at /usr/local/cuda; CUDA architectures "
                  "90a; sm90 GEMMs: left out (no CUTLASS headers (neither "
                  "-DTE_JAX_CUTLASS_INCLUDE=DIR nor an installed nvidia-cutlass package))")


def test_build_reason_reads_the_build_note():
  assert ggc.build_reason(_BUILT_NOTE) == ""
  why = ggc.build_reason(_LEFT_OUT_NOTE)
  assert why.startswith("the native module was built without the sm90 GEMMs (no CUTLASS")
  assert why.endswith("nvidia-cutlass package))"), why
  assert "does not list the sm90 GEMMs" in ggc.build_reason("built with the CUDA toolkit: x")
  assert "does not list" in ggc.build_reason("")


def test_device_reason():
  class Dev:  # pylint: disable=too-few-public-methods
    def __init__(self, cc):
      self.compute_capability = cc
  assert ggc.device_reason(Dev("9.0")) == ""
  assert "compute capability 10.0" in ggc.device_reason(Dev("10.0"))
  assert ggc.device_reason(object()) == ""     # a device that does not say (the CPU)


def _cdiv(a, b):
  return -(-a // b)


def kernel_model(axis, ops, sizes):
  """float64 numpy model of the kernel's contract (custom_calls/kernels/
  gemm_sm90.cuh): TN operands; blockwise scales read as CUTLASS's grouped
  mainloop reads them (Sm90BlockwiseScaleConfig::tile_atom_to_shape_SFA/SFB
  of the group's own problem shape), from each group's pointer:
  1x128 (row i, k-block j) at ``ptr + i + j * rows`` (``rows`` the group's
  M, or N), 128x128 (row block q, k-block j) at ``ptr + q * kb + j``.
  Pointers: rows, a ``start * kb``, b ``group * nb * kb``; contraction,
  ``(start / 128) * rows``. ``NONE`` (bfloat16): no scales.
  ``CONTRACTION_ROW_MAJOR`` (bfloat16): row-major ``a (m, k)`` and ``b (m,
  n)``, group e's rows of both, ``a[rows].T @ b[rows]``. Valid sizes only."""
  a = np.asarray(ops.a.astype(jnp.float32), np.float64)
  b = np.asarray(ops.b.astype(jnp.float32), np.float64)
  sa = np.ravel(np.asarray(ops.a_sinv, np.float64))
  sb = np.ravel(np.asarray(ops.b_sinv, np.float64))
  bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  if axis == ggc.CONTRACTION_ROW_MAJOR:
    assert ops.scaling == ggc.NONE and a.shape[0] == b.shape[0]
    return np.stack([a[bounds[e]:bounds[e + 1]].T @ b[bounds[e]:bounds[e + 1]]
                     for e in range(len(sizes))])
  if axis == ggc.ROWS:
    (m, k), (g, n, _) = a.shape, b.shape
    kb, nb = _cdiv(k, 128), _cdiv(n, 128)
    kcol, nrow = np.arange(k) // 128, np.arange(n) // 128
    out = np.zeros((m, n))
    for e in range(g):
      start, rows = bounds[e], sizes[e]
      r = slice(start, start + rows)
      if ops.scaling != ggc.BLOCKWISE:
        out[r] = a[r] @ b[e].T * (1.0 if ops.scaling == ggc.NONE else sa[0] * sb[e])
        continue
      sfa = sa[start * kb + np.arange(rows)[:, None] + np.arange(kb)[None, :] * rows]
      sfb = sb[e * nb * kb + np.arange(nb)[:, None] * kb + np.arange(kb)[None, :]]
      out[r] = (a[r] * sfa[:, kcol]) @ (b[e] * sfb[nrow][:, kcol]).T
    return out
  (m, k), n = a.shape, b.shape[0]
  out = np.zeros((len(sizes), m, n))
  for e, rows in enumerate(sizes):
    t = slice(bounds[e], bounds[e + 1])
    if ops.scaling != ggc.BLOCKWISE:
      out[e] = a[:, t] @ b[:, t].T * (1.0 if ops.scaling == ggc.NONE else sa[0] * sb[0])
      continue
    kcol = np.arange(rows) // 128      # the group's own k-blocks
    ptr = bounds[e] // 128
    sfa = sa[ptr * m + np.arange(m)[:, None] + kcol[None, :] * m]
    sfb = sb[ptr * n + np.arange(n)[:, None] + kcol[None, :] * n]
    out[e] = (a[:, t] * sfa) @ (b[:, t] * sfb).T
  return out


def _scaled(x, dtype, block):
  """A ScaledTensor of float array x: per tensor (block None) or tiled."""
  if block is None:
    q = qop.quantize_current_reference(x, dtype)
  else:
    q = qop.quantize_blockwise_reference(x, block, dtype, power_2_scale=True)
  return ScaledTensor(q.data, q.scale_inv, block)


def _spread(rng, shape):
  """Normal values with magnitudes spread over rows and 128-column blocks
  (so that a scale read from the wrong tile shows)."""
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, size=(shape[0], 1))
  cols = 10.0 ** rng.uniform(-2, 2, size=-(-shape[1] // 128)).repeat(128)[:shape[1]]
  return jnp.asarray(x * cols, jnp.float32)


def _rows_operands(scaling, dtypes, rng, m=202, k=400, n=272, g=4):
  a = _spread(rng, (m, k))
  w = jnp.stack([_spread(rng, (k, n)) * 10.0 ** e for e in (-2, 0, 1, 3)][:g])
  if scaling == "tensor":
    lhs = _scaled(a, dtypes[0], None)
    q = jax.vmap(lambda v: qop.quantize_current_reference(v, dtypes[1]))(w)
    return lhs, gg.GroupedScaledTensor(q.data, q.scale_inv)
  q = jax.vmap(lambda v: qop.quantize_blockwise_reference(v, (128, 128), dtypes[1], True))(w)
  return _scaled(a, dtypes[0], (1, 128)), gg.GroupedScaledTensor(q.data, q.scale_inv, (128, 128))


@pytest.mark.parametrize("scaling, dtypes, transposed", [
    ("tensor", (E4M3, E4M3), False),         # fprop
    ("tensor", (E5M2, E4M3), True),          # HYBRID dgrad: grad x kernel.T
    ("blockwise", (E4M3, E4M3), False),      # fprop
    ("blockwise", (E4M3, E4M3), True),       # dgrad
])
def test_rows_layout_conversions_meet_the_kernel_contract(scaling, dtypes, transposed):
  """The operands the wrapper hands the kernel, read as gemm_sm90.cuh says,
  give the reference's product: m not a multiple of 4 (the native 1x128
  grid pads it), k, n not multiples of 128, k blocks != n blocks (a
  transposed scale grid shows), empty and 1-row groups, tail rows."""
  lhs, rhs = _rows_operands(scaling, dtypes, _rng(10))
  if transposed:   # the dgrad operand: kernel.T (g, n, k) against a (m, n) lhs
    rhs = rhs.T
    lhs = _scaled(_spread(_rng(11), (202, 272)), dtypes[0], lhs.block_shape)
  sizes = [0, 1, 130, 37]
  ops = jax.jit(ggc.rows_operands)(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert ops.scaling == (ggc.PER_TENSOR if scaling == "tensor" else ggc.BLOCKWISE)
  want = gg.grouped_gemm_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.float32)
  _close(kernel_model(ggc.ROWS, ops, sizes), want)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scaling, dtypes", [
    ("tensor", (E4M3, E4M3)), ("tensor", (E4M3, E5M2)),   # HYBRID wgrad: swapped for bf16
    ("tensor", (E5M2, E4M3)), ("blockwise", (E4M3, E4M3))])
def test_contraction_layout_conversions_meet_the_kernel_contract(scaling, dtypes, out_dtype):
  rng = _rng(12)
  k, m, n = 146, 640, 264   # k (the kernel's rows) not a multiple of 4
  block = None if scaling == "tensor" else (1, 128)
  lhs_t = _scaled(_spread(rng, (k, m)), dtypes[0], block)
  rhs_t = _scaled(_spread(rng, (n, m)), dtypes[1], block)
  u = 16 if block is None else 128
  sizes = [0, u, 3 * u, m - 4 * u]
  ops, swapped = ggc.contraction_operands(lhs_t, rhs_t, out_dtype)
  # the float32 kernels take E4M3 x E5M2 in that order: no swap
  assert swapped == (dtypes == (E4M3, E5M2) and out_dtype == jnp.bfloat16)
  got = kernel_model(ggc.CONTRACTION, ops, sizes)
  got = np.swapaxes(got, 1, 2) if swapped else got
  want = gg.grouped_wgrad_reference(lhs_t, rhs_t, jnp.asarray(sizes, jnp.int32), jnp.float32)
  _close(got, want)


def _numbered_vec128(rows, cols):
  """A 1x128 ScaledTensor (rows, cols) whose scales are 1, 2, 3, ... (each
  one telling where it came from); the data does not matter here."""
  scales = np.arange(1, rows * _cdiv(cols, 128) + 1, dtype=np.float32)
  return ScaledTensor(jnp.zeros((rows, cols), E4M3),
                      jnp.asarray(scales.reshape(rows, -1)), (1, 128))


def _compact_blocks_spec(logical, cuts):
  """numpy spec of the compact 1x128 layout: the rows of ``logical``
  (rows, kb) cut into blocks [cuts[i], cuts[i + 1]); the block of r rows from
  row s holds (row s + i, k-block j) at s * kb + j * r + i."""
  rows, kb = logical.shape
  flat = np.zeros(rows * kb, logical.dtype)
  for s, e in zip(cuts[:-1], cuts[1:]):
    for i in range(e - s):
      for j in range(kb):
        flat[s * kb + j * (e - s) + i] = logical[s + i, j]
  return flat


@pytest.mark.parametrize("sizes", [
    [0, 5, 130, 0, 37, 3],        # empty groups, sizes not multiples of 4, a 27-row tail
    [202],                        # one group, no tail
    [0, 0],                       # every row in the tail
])
def test_rows_scales_are_where_the_grouped_kernel_reads_them(sizes):
  """Every (row, k-block) 1x128 scale of the rows-grouped ``a`` lands where
  the compact per-group formula says (k-block stride = the group's rows),
  the tail rows in a block of their own; the 128x128 scales as (g, nb, kb)
  with no padding; zeros after them up to the native shapes the handler
  checks. Group sizes traced (device data)."""
  m, k, n = 202, 300, 400                      # kb = 3, nb = 4: a swap of the two shows
  lhs = _numbered_vec128(m, k)
  g = len(sizes)
  rhs_scales = np.arange(1, g * 3 * 4 + 1, dtype=np.float32).reshape(g, 3, 4)
  rhs = gg.GroupedScaledTensor(jnp.zeros((g, k, n), E4M3), jnp.asarray(rhs_scales), (128, 128))
  ops = jax.jit(ggc.rows_operands)(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert ops.a_sinv.shape == (3, 204) and ops.b_sinv.shape == (g, 4, 4)
  cuts = sorted(set(np.concatenate([[0], np.cumsum(sizes), [m]]).tolist()))
  want_a = np.zeros(3 * 204, np.float32)
  want_a[:m * 3] = _compact_blocks_spec(np.asarray(lhs.scale_inv), cuts)
  np.testing.assert_array_equal(np.ravel(ops.a_sinv), want_a)
  want_b = np.zeros(g * 4 * 4, np.float32)
  for e in range(g):
    for q in range(4):           # n-block (row block of b = rhs[e].T)
      for j in range(3):         # k-block
        want_b[e * 4 * 3 + q * 3 + j] = rhs_scales[e, j, q]
  np.testing.assert_array_equal(np.ravel(ops.b_sinv), want_b)


@pytest.mark.parametrize("sizes", [[50, -5, 100, 80], [2 ** 31 - 1, 2 ** 31 - 1, 7]])
def test_rows_scales_relayout_is_a_permutation_for_any_sizes(sizes):
  """Sizes the kernel rejects (a negative one, a sum past m, int32 sums that
  would overflow) still move every scale once: nothing lost or doubled."""
  lhs = _numbered_vec128(202, 300)
  got = jax.jit(ggc.rows_scales_compact)(lhs.scale_inv, jnp.asarray(sizes, jnp.int32))
  np.testing.assert_array_equal(np.sort(np.asarray(got)), np.arange(1, 202 * 3 + 1))


def test_group_bounds_follow_the_setup_kernel():
  """start[e+1] = min(start[e] + max(size, 0), extent), in int32 whatever the sizes."""
  sizes = [3, -2, 10, 2 ** 31 - 1, 5, 2 ** 31 - 1]
  want, start = [0], 0
  for size in sizes:
    start = min(start + max(size, 0), 20)
    want.append(start)
  got = jax.jit(ggc.group_bounds, static_argnums=1)(jnp.asarray(sizes, jnp.int32), 20)
  assert np.asarray(got).tolist() == want == [0, 3, 3, 13, 20, 20, 20]


def test_contraction_scales_are_where_the_grouped_kernel_reads_them():
  """wgrad: (row i, k-block j) of each 1x128-along-m operand at j * rows + i
  (k-block stride exactly the kernel's M or N, not padded to 4), zeros after."""
  k, m, n = 146, 640, 262
  lhs_t, rhs_t = _numbered_vec128(k, m), _numbered_vec128(n, m)
  ops, swapped = jax.jit(ggc.contraction_operands)(lhs_t, rhs_t)
  assert not swapped
  for got, t, rows in ((ops.a_sinv, lhs_t, k), (ops.b_sinv, rhs_t, n)):
    logical = np.asarray(t.scale_inv)
    assert got.shape == (5, -(-rows // 4) * 4)
    want = np.zeros(got.size, np.float32)
    for i in range(rows):
      for j in range(5):
        want[j * rows + i] = logical[i, j]
    np.testing.assert_array_equal(np.ravel(got), want)


def _eqns(jaxpr):
  """Every equation of a (closed) jaxpr, nested ones included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _ffi_calls(jaxpr):
  """The ffi_call equations of a (closed) jaxpr, nested ones included."""
  return [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "ffi_call"]


@pytest.fixture
def fake_gpu(monkeypatch):
  """A GPU with the native module as far as the dispatcher can tell, whose
  build note says ``note`` (the sm90 GEMMs built, unless a test changes it);
  ``_native.dispatch`` takes the CUDA branch, as on a GPU."""
  from te_jax.ops import _native  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("TE_JAX_IMPL", raising=False)
  note = {"text": _BUILT_NOTE}
  monkeypatch.setattr(_native, "resolve_impl",
                      lambda impl: _native.check_impl(impl) if impl == "reference" else "cuda")
  monkeypatch.setattr(_native, "dispatch", lambda impl, cuda_fn, reference_fn: cuda_fn())
  monkeypatch.setattr(ggc, "_build_note", lambda: note["text"])
  gg._log_reference.cache_clear()   # pylint: disable=protected-access
  return note


def _staged(fn, *args):
  return _ffi_calls(jax.make_jaxpr(fn)(*args).jaxpr)


def test_dispatcher_stages_the_kernel(fake_gpu):
  """FP8 operands with a bfloat16 output: one te_jax_grouped_gemm call with
  the kernel's operand layouts, attributes and a static workspace; the
  1x128 scales re-laid per group by a scatter staged with the traced group
  sizes (no host synchronization)."""
  del fake_gpu
  lhs, rhs = _rows_operands("blockwise", (E4M3, E4M3), _rng(13))
  gs = jnp.asarray([50, 0, 100, 50], jnp.int32)
  def fn(l, r, s):
    return gg.grouped_gemm(l, r, s, fast_accum=True, impl="cuda")
  (call,) = _staged(fn, lhs, rhs, gs)
  assert call.params["target_name"] == ggc.TARGET == "te_jax_grouped_gemm"
  assert dict(call.params["attributes"]) == {"axis": 0, "scaling": 1, "fast_accum": 1}
  shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars]
  # the scales' arrays have the native layouts' shapes (the handler checks
  # them), their contents the compact per-group layout (tests above)
  assert shapes == [((202, 400), E4M3), ((4, 272, 400), E4M3), ((4, 204), jnp.float32),
                    ((4, 3, 4), jnp.float32), ((4,), jnp.int32)]
  staged = {e.primitive.name for e in _eqns(jax.make_jaxpr(fn)(lhs, rhs, gs).jaxpr)}
  assert "scatter" in staged
  assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars] == [
      ((202, 272), jnp.bfloat16), ((ggc.workspace_bytes(4),), jnp.uint8)]
  # wgrad, HYBRID per tensor: the E5M2 operand goes first, the result comes back transposed
  x_t = _scaled(_spread(_rng(14), (144, 256)), E4M3, None)
  g_t = _scaled(_spread(_rng(15), (264, 256)), E5M2, None)
  jaxpr = jax.make_jaxpr(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=jnp.bfloat16))(
      x_t, g_t, gs)
  (call,) = _ffi_calls(jaxpr.jaxpr)
  assert dict(call.params["attributes"]) == {"axis": 1, "scaling": 0, "fast_accum": 0}
  assert [tuple(v.aval.shape) for v in call.invars[:2]] == [(264, 256), (144, 256)]
  assert tuple(call.outvars[0].aval.shape) == (4, 264, 144)
  assert jaxpr.out_avals[0].shape == (4, 144, 264)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype, block", [
    (E4M3, E5M2, None), (E4M3, E4M3, None), (E4M3, E4M3, (1, 128))])
def test_dispatcher_stages_the_float32_wgrad(fake_gpu, lhs_dtype, rhs_dtype, block):
  """A float32 wgrad of E4M3 lhs_t: one call whose output is the float32
  (g, k, n) result itself: operands in their own order, no transpose and
  no convert after the kernel (fast_accum asks for nothing it can change:
  the float32 kernels accumulate split)."""
  del fake_gpu
  gs = jnp.asarray([128, 0, 128], jnp.int32)
  x_t = _scaled(_spread(_rng(14), (144, 256)), lhs_dtype, block)
  g_t = _scaled(_spread(_rng(15), (264, 256)), rhs_dtype, block)
  jaxpr = jax.make_jaxpr(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=jnp.float32,
                                                          fast_accum=True))(x_t, g_t, gs)
  (call,) = _ffi_calls(jaxpr.jaxpr)
  assert dict(call.params["attributes"]) == {"axis": 1, "scaling": 0 if block is None else 1,
                                             "fast_accum": 1}
  assert [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars[:2]] == [
      ((144, 256), lhs_dtype), ((264, 256), rhs_dtype)]
  assert (tuple(call.outvars[0].aval.shape), call.outvars[0].aval.dtype) == (
      (3, 144, 264), jnp.float32)
  assert jaxpr.jaxpr.outvars[0] is call.outvars[0]


def test_float32_wgrad_of_an_e5m2_lhs_is_widened(fake_gpu):
  """E5M2 lhs_t has no float32 kernel: the bfloat16 one runs and its result
  is widened (not the reference)."""
  del fake_gpu
  gs = jnp.asarray([128, 128], jnp.int32)
  a = _scaled(_spread(_rng(17), (64, 256)), E5M2, None)
  b = _scaled(_spread(_rng(18), (32, 256)), E4M3, None)
  jaxpr = jax.make_jaxpr(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=jnp.float32))(
      a, b, gs)
  (call,) = _ffi_calls(jaxpr.jaxpr)
  assert call.outvars[0].aval.dtype == jnp.bfloat16
  assert jaxpr.out_avals[0].dtype == jnp.float32 and jaxpr.out_avals[0].shape == (2, 64, 32)


def test_auto_takes_the_blockwise_kernels(fake_gpu):
  """Blockwise operands take the kernel under "auto" as per-tensor ones do
  (the rows form and the wgrad)."""
  del fake_gpu
  rng = _rng(19)
  lhs, rhs = _rows_operands("blockwise", (E4M3, E4M3), rng, m=256, k=256, n=128, g=2)
  gs = jnp.asarray([128, 128], jnp.int32)
  assert len(_staged(lambda: gg.grouped_gemm(lhs, rhs, gs))) == 1
  x_t = _scaled(_spread(rng, (128, 256)), E4M3, (1, 128))
  g_t = _scaled(_spread(rng, (64, 256)), E4M3, (1, 128))
  assert len(_staged(lambda: gg.grouped_wgrad(x_t, g_t, gs, out_dtype=jnp.bfloat16))) == 1
  tensor = _rows_operands("tensor", (E4M3, E4M3), rng, m=64, k=128, n=32, g=2)
  assert len(_staged(lambda: gg.grouped_gemm(*tensor, jnp.asarray([30, 34], jnp.int32)))) == 1


def test_auto_reference_reason_says_what_auto_runs(fake_gpu, monkeypatch):
  """The banners' answer agrees with the dispatcher: no GPU; the kernel;
  the build's reason."""
  assert ggc.auto_reference_reason() == "no GPU"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert ggc.auto_reference_reason() == ""
  fake_gpu["text"] = _LEFT_OUT_NOTE
  assert ggc.auto_reference_reason() == ggc.build_reason()
  assert ggc.build_reason()


@pytest.mark.parametrize("case, says", [
    ("left out", "built without the sm90 GEMMs (no CUTLASS headers"),
    ("float32 operands", "float32 x float32 float operands: the FP8-off grouped kernel takes "
                         "bfloat16 x bfloat16 only"),
    ("float32 out", "out_dtype=float32: the sm90 grouped kernels write float32 for FP8 "
                    "wgrads (grouped_wgrad) only"),
    ("blockwise e5m2", "blockwise float8_e5m2 x float8_e4m3fn"),
    ("k not a multiple of 16", "k (lhs.shape[1])=24 is not a multiple of 16"),
    ("wgrad m not a multiple of 16", "the grouped m (lhs_t.shape[1])=40 is not a multiple"),
])
def test_dispatcher_runs_the_reference_where_the_kernel_cannot(fake_gpu, caplog, case, says):
  """"auto" warns why once and stages the reference; "cuda" raises it."""
  rng = _rng(16)
  out_dtype, op = jnp.bfloat16, gg.grouped_gemm
  lhs, rhs = _rows_operands("tensor", (E4M3, E4M3), rng, m=64, k=128, n=32, g=2)
  if case == "left out":
    fake_gpu["text"] = _LEFT_OUT_NOTE
  elif case == "float32 operands":   # bfloat16 ones take the bf16 kernel (test_grouped_gemm_bf16)
    lhs, rhs = jnp.ones((64, 128), jnp.float32), jnp.ones((2, 128, 32), jnp.float32)
  elif case == "float32 out":
    out_dtype = jnp.float32
  elif case == "blockwise e5m2":
    lhs, rhs = _rows_operands("blockwise", (E5M2, E4M3), rng, m=64, k=128, n=32, g=2)
  elif case == "k not a multiple of 16":
    lhs, rhs = _rows_operands("tensor", (E4M3, E4M3), rng, m=64, k=24, n=32, g=2)
  else:
    op = gg.grouped_wgrad
    lhs, rhs = _scaled(_spread(rng, (32, 40)), E4M3, None), _scaled(_spread(rng, (16, 40)),
                                                                       E4M3, None)
  gs = jnp.asarray([30, 10], jnp.int32)
  run = lambda impl: op(lhs, rhs, gs, out_dtype=out_dtype, impl=impl)  # pylint: disable=unnecessary-lambda-assignment
  with caplog.at_level(logging.INFO, logger="te_jax"):
    assert not _staged(lambda: run("auto"))
    assert not _staged(lambda: run("auto"))
  logged = [r for r in caplog.records if says in r.getMessage()]
  assert len(logged) == 1 and logged[0].levelno == logging.WARNING, caplog.records
  assert "runs its pure-JAX reference" in logged[0].getMessage()
  with pytest.raises(ValueError, match="impl='cuda'.*" + re.escape(says)):
    run("cuda")
  assert not _staged(lambda: run("reference"))


def test_cuda_wrapper_refuses_what_the_kernel_cannot_run():
  lhs, rhs = _rows_operands("tensor", (E4M3, E4M3), _rng(17), m=64, k=128, n=36, g=2)
  with pytest.raises(ValueError, match="last dim 36 is not a multiple of 8"):
    ggc.grouped_gemm(lhs, rhs, jnp.asarray([1, 1], jnp.int32))
  with pytest.raises(ValueError, match="E5M2 as lhs only"):
    ggc.grouped_gemm(*_rows_operands("tensor", (E4M3, E5M2), _rng(18), m=64, k=128, n=32, g=2),
                     jnp.asarray([1, 1], jnp.int32))
