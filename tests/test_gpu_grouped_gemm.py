"""te_jax's own sm_90a FP8 GEMMs (CUTLASS-based) against the references (``gpu``).

Needs a Hopper GPU and a native module built with the CUTLASS headers
(``-DTE_JAX_CUTLASS_INCLUDE=...``; ``te_jax/_te_jax_ffi_build.txt`` ends
"sm90 GEMMs: built ..."); skipped elsewhere.

1. The grouped GEMM (``te_jax_grouped_gemm``, impl="cuda") against
   ``grouped_gemm_reference`` / ``grouped_wgrad_reference`` computed on the
   CPU backend in float32: per tensor (split and fast accumulation, E5M2 x
   E4M3 as HYBRID's dgrad, E4M3 x E5M2 as its wgrad) and blockwise; odd
   shapes (m, k, n not multiples of 128), empty groups, one group, one row,
   rows past the groups, skewed sizes, 64 groups and the most the kernel
   takes (6144, whose workspace the handler checks against the device's
   SM count). Relative Frobenius error
   within the bfloat16 output's tolerance (tests/test_cuda_ops.py: 1e-2; the
   FP8 operands are exact inputs to both sides), tail rows and empty
   groups' blocks exactly 0, no stray non-finite value, and a second run
   equal bit for bit. The wgrad also with a float32 output (the float32
   epilogue kernels), within the kernel's accumulation error, and the FP8
   grouped_dense's float32 weight gradient against its reference path.
2. One jitted function, group sizes changed between calls: traced once,
   every call right (sizes are read on the device).
3. Sizes that cannot describe the buffer make the whole output NaN (the
   reference's rule; for the contraction also sizes off the 16 / 128
   multiple, which the kernel needs and the reference does not).
4. The bf16 variants (the FP8-off GEMMs: scaling "none") on bfloat16
   operands, fprop / dgrad / wgrad on the same odd shapes, empty groups,
   tail rows, any wgrad group sizes (the wgrad reads row-major x (m, k)
   and grad (m, n) as stored: grouped_wgrad_rows, and grouped_wgrad on
   their transposes), one row, new sizes without recompiling, invalid
   sizes -> NaN, and the FP8-off grouped_dense's weight gradient: every
   element within one bfloat16 ulp of the float32 reference plus the
   float32 summation-order bound.
5. The dense sm90 variants in the GEMM autotuner (TE_JAX_GEMM_SM90, read once
   per process: subprocesses): with "only" the selection log names an sm90
   winner for the blockwise pairs and results match the reference and
   cuBLASLt's; with "1" the sm90 variants are timed beside cuBLASLt's answers.
"""

import json
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax.ops import _native
from te_jax.ops import grouped_gemm as gg
from te_jax.ops import grouped_gemm_cuda as ggc
from te_jax.ops import quantize as q
from te_jax.ops.fp8 import ScaledTensor

from test_gpu_gemm_autotune import _run, _selections  # the subprocess helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available() or bool(ggc.build_reason())
                       or bool(ggc.device_reason()),
                       reason="needs a Hopper GPU and te_jax built with the sm90 GEMMs (CUTLASS)"),
]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_TOL = 1e-2                      # bfloat16 output (tests/test_cuda_ops.py)
_CPU = jax.devices("cpu")[0]


def _spread(rng, shape):
  """Normal values, magnitudes spread over rows and 128-column blocks."""
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, size=(shape[0], 1))
  cols = 10.0 ** rng.uniform(-2, 2, size=-(-shape[1] // 128)).repeat(128)[:shape[1]]
  return (x * cols).astype(np.float32)


def _scaled(x, dtype, block):
  x = jnp.asarray(x)
  if block is None:
    t = q.quantize_current_reference(x, dtype)
  else:
    t = q.quantize_blockwise_reference(x, block, dtype, power_2_scale=True)
  return ScaledTensor(t.data, t.scale_inv, block)


def _experts(rng, g, k, n, dtype, blockwise):
  """(g, k, n) expert weights, one magnitude per expert, quantized per expert."""
  w = jnp.asarray(np.stack([_spread(rng, (k, n)) * 10.0 ** rng.uniform(-2, 2)
                            for _ in range(g)]))
  if blockwise:
    t = jax.vmap(lambda v: q.quantize_blockwise_reference(v, (128, 128), dtype, True))(w)
    return gg.GroupedScaledTensor(t.data, t.scale_inv, (128, 128))
  t = jax.vmap(lambda v: q.quantize_current_reference(v, dtype))(w)
  return gg.GroupedScaledTensor(t.data, t.scale_inv)


def _on_cpu(fn, *args):
  return np.asarray(jax.jit(fn)(*jax.device_put(args, _CPU)), np.float64)


def _compare(got, want, zero_mask=None):
  """Relative Frobenius error within _TOL, no stray non-finite value, and
  exact zeros where ``zero_mask`` says."""
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), "non-finite values in the kernel's output"
  if zero_mask is not None:
    assert (got[zero_mask] == 0).all(), "rows / blocks no group covers must be 0"
  norm = np.linalg.norm(want)
  err = np.linalg.norm(got - want) / (norm if norm > 0 else 1.0)
  assert err < _TOL, f"relative error {err:.3g} >= {_TOL}"


ROWS_VARIANTS = {   # name: (lhs dtype, rhs dtype, blockwise, fast_accum)
    "tensor_e4m3_split": (E4M3, E4M3, False, False),
    "tensor_e4m3_fast": (E4M3, E4M3, False, True),
    "tensor_e5m2xe4m3": (E5M2, E4M3, False, False),
    "blockwise": (E4M3, E4M3, True, False),
}
ROWS_CASES = {      # name: (m, k, n, sizes)
    "odd_with_empty_and_tail": (200, 400, 272, [0, 1, 130, 37]),
    "one_group": (256, 256, 128, [256]),
    "one_row": (1, 128, 16, [0, 1]),
    "skewed": (1024, 512, 256, [512, 0, 64, 448]),
    "all_empty": (64, 128, 32, [0, 0, 0]),
    "64_groups": (640, 256, 128, [10] * 64),
    "max_groups": (ggc.MAX_GROUPS, 128, 16, [1] * ggc.MAX_GROUPS),   # the largest workspace
}


@pytest.mark.parametrize("case", list(ROWS_CASES))
@pytest.mark.parametrize("variant", list(ROWS_VARIANTS))
def test_grouped_gemm_rows(variant, case):
  ta, tb, blockwise, fast = ROWS_VARIANTS[variant]
  m, k, n, sizes = ROWS_CASES[case]
  rng = np.random.default_rng(len(case) * 7 + len(variant))
  lhs = _scaled(_spread(rng, (m, k)), ta, (1, 128) if blockwise else None)
  rhs = _experts(rng, len(sizes), k, n, tb, blockwise)
  gs = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda l, r, s: gg.grouped_gemm(l, r, s, out_dtype=jnp.bfloat16,
                                              fast_accum=fast, impl="cuda"))
  got, again = np.asarray(f(lhs, rhs, gs), np.float32), np.asarray(f(lhs, rhs, gs), np.float32)
  np.testing.assert_array_equal(got, again)
  want = _on_cpu(lambda l, r, s: gg.grouped_gemm_reference(l, r, s, jnp.float32), lhs, rhs, gs)
  tail = np.zeros((m, n), bool)
  tail[sum(sizes):] = True
  _compare(got, want, tail)


@pytest.mark.parametrize("blockwise", [False, True])
def test_grouped_gemm_dgrad_operand(blockwise):
  """The dgrad form: grad (m, n) against kernel.T, the transposed stack."""
  rng = np.random.default_rng(3)
  m, k, n, sizes = 200, 400, 272, [64, 0, 100, 36]
  w = _experts(rng, 4, k, n, E4M3, blockwise)
  grad = _scaled(_spread(rng, (m, n)), E4M3 if blockwise else E5M2,
                 (1, 128) if blockwise else None)
  gs = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda a, b, s: gg.grouped_gemm(a, b.T, s, impl="cuda"))(grad, w, gs)
  want = _on_cpu(lambda a, b, s: gg.grouped_gemm_reference(a, b.T, s, jnp.float32),
                 grad, w, gs)
  _compare(got, want)


WGRAD_CASES = {     # name: (lhs_t dtype, rhs_t dtype, blockwise, k, m, n, sizes)
    "tensor_e4m3": (E4M3, E4M3, False, 144, 640, 264, [0, 16, 48, 144]),
    "tensor_hybrid_swapped": (E4M3, E5M2, False, 144, 640, 264, [32, 0, 608]),
    "tensor_e5m2xe4m3": (E5M2, E4M3, False, 200, 256, 136, [256]),
    "blockwise": (E4M3, E4M3, True, 144, 640, 264, [0, 128, 384]),
    "blockwise_one_group": (E4M3, E4M3, True, 130, 512, 96, [512]),
}


# float32 wgrad output: no bfloat16 rounding (about 1.1e-3 relative, which
# this fails), only the kernel's accumulation: FP8 wgmma sums each 128-wide K
# step at reduced precision before the fp32 promotion (1.3e-4 at K = 16384,
# BENCHMARKS.md; these groups are at most 608 deep).
_TOL_F32 = 3e-4


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case", list(WGRAD_CASES))
def test_grouped_wgrad(case, out_dtype):
  ta, tb, blockwise, k, m, n, sizes = WGRAD_CASES[case]
  rng = np.random.default_rng(len(case))
  block = (1, 128) if blockwise else None
  lhs_t, rhs_t = _scaled(_spread(rng, (k, m)), ta, block), _scaled(_spread(rng, (n, m)), tb, block)
  gs = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=out_dtype, impl="cuda"))
  out = f(lhs_t, rhs_t, gs)
  assert out.dtype == out_dtype and out.shape == (len(sizes), k, n)
  got = np.asarray(out, np.float32)
  np.testing.assert_array_equal(got, np.asarray(f(lhs_t, rhs_t, gs), np.float32))
  want = _on_cpu(lambda a, b, s: gg.grouped_wgrad_reference(a, b, s, jnp.float32),
                 lhs_t, rhs_t, gs)
  empty = np.zeros(got.shape, bool)
  empty[[e for e, s in enumerate(sizes) if s == 0]] = True
  _compare(got, want, empty)
  if out_dtype == jnp.float32 and ta == E4M3:   # the float32 epilogue (E5M2 lhs_t: widened)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < _TOL_F32, f"float32 output: relative error {err:.3g} >= {_TOL_F32}"


def test_new_group_sizes_without_recompiling():
  rng = np.random.default_rng(5)
  m, k, n = 512, 256, 128
  lhs = _scaled(_spread(rng, (m, k)), E4M3, (1, 128))
  rhs = _experts(rng, 4, k, n, E4M3, True)
  traces = []

  @jax.jit
  def step(l, r, s):
    traces.append(1)
    return gg.grouped_gemm(l, r, s, impl="cuda")

  for sizes in ([128, 128, 128, 128], [512, 0, 0, 0], [0, 1, 300, 11], [0, 0, 0, 0]):
    gs = jnp.asarray(sizes, jnp.int32)
    want = _on_cpu(lambda l, r, s: gg.grouped_gemm_reference(l, r, s, jnp.float32), lhs, rhs, gs)
    _compare(step(lhs, rhs, gs), want)
  assert len(traces) == 1


@pytest.mark.parametrize("sizes", [[-5, 10, 20], [100, 0, 200]])
def test_rows_sizes_that_cannot_describe_the_rows_give_nan(sizes):
  rng = np.random.default_rng(6)
  lhs = _scaled(_spread(rng, (200, 128)), E4M3, None)
  rhs = _experts(rng, 3, 128, 32, E4M3, False)
  out = gg.grouped_gemm(lhs, rhs, jnp.asarray(sizes, jnp.int32), impl="cuda")
  assert np.isnan(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("blockwise, sizes", [(False, [16, 24]), (True, [128, 64]),
                                               (False, [-16, 32]), (True, [512, 256])])
def test_contraction_sizes_the_kernel_cannot_take_give_nan(blockwise, sizes):
  rng = np.random.default_rng(7)
  block = (1, 128) if blockwise else None
  a, b = _scaled(_spread(rng, (64, 512)), E4M3, block), _scaled(_spread(rng, (32, 512)), E4M3,
                                                                 block)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    out = gg.grouped_wgrad(a, b, jnp.asarray(sizes, jnp.int32), out_dtype=out_dtype,
                           impl="cuda")
    assert out.dtype == out_dtype and np.isnan(np.asarray(out, np.float32)).all()


def test_auto_takes_the_kernel():
  """impl="auto" on this GPU stages te_jax_grouped_gemm for FP8 with bf16 out."""
  rng = np.random.default_rng(8)
  lhs = _scaled(_spread(rng, (64, 128)), E4M3, None)
  rhs = _experts(rng, 2, 128, 32, E4M3, False)
  gs = jnp.asarray([30, 34], jnp.int32)
  hlo = jax.jit(lambda l, r, s: gg.grouped_gemm(l, r, s)).lower(lhs, rhs, gs).as_text()
  assert ggc.TARGET in hlo


# --------------------------------------------- 4. bf16 (FP8 off) ---

BF16 = jnp.bfloat16


def _bf16(rng, shape):
  """bfloat16 values spread as _spread's, per matrix of a stack."""
  x = _spread(rng, shape) if len(shape) == 2 else np.stack([_spread(rng, shape[1:])
                                                            for _ in range(shape[0])])
  return jnp.asarray(x, BF16)


def _compare_bf16(got, ref_fn, a, b, gs):
  """Every element within the kernel's documented distance of the float32
  reference on the same bf16 values: one bfloat16 ulp of the result (2**-8
  relative: the output's rounding, which a float32 sum one ulp away can tip
  to the next bf16) plus the float32 recursive-summation bound, k * 2**-24
  of sum |a_i b_i| (the kernel adds in another order). ``ref_fn(a, b, s)``
  is the reference; run on |a|, |b| it gives sum |a_i b_i|."""
  got = np.asarray(got, np.float64)
  want = _on_cpu(ref_fn, a, b, gs)
  magnitude = _on_cpu(ref_fn, jnp.abs(a), jnp.abs(b), gs)
  k = a.shape[1]
  bound = 2.0 ** -8 * np.abs(want) + k * 2.0 ** -24 * magnitude
  assert np.isfinite(got).all(), "non-finite values in the kernel's output"
  worst = np.max(np.abs(got - want) - bound)
  assert worst <= 0, f"an element is {worst:.3g} past its bound"
  return got


def _rows_ref(a, b, s):
  return gg.grouped_gemm_reference(a, b, s, jnp.float32)


def _wgrad_ref(a, b, s):
  return gg.grouped_wgrad_reference(a, b, s, jnp.float32)


@pytest.mark.parametrize("case", list(ROWS_CASES))
def test_bf16_grouped_gemm_rows(case):
  m, k, n, sizes = ROWS_CASES[case]
  rng = np.random.default_rng(len(case) * 11)
  lhs, rhs, gs = _bf16(rng, (m, k)), _bf16(rng, (len(sizes), k, n)), jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda l, r, s: gg.grouped_gemm(l, r, s, out_dtype=BF16, impl="cuda"))
  got = _compare_bf16(f(lhs, rhs, gs), _rows_ref, lhs, rhs, gs)
  np.testing.assert_array_equal(got, np.asarray(f(lhs, rhs, gs), np.float64))
  assert (got[sum(sizes):] == 0).all(), "rows past the groups must be 0"


def test_bf16_grouped_gemm_dgrad_operand():
  """grad (m, n) against kernel.T: the transposes cancel, no copy of it."""
  rng = np.random.default_rng(13)
  m, k, n, sizes = 200, 400, 272, [64, 0, 100, 36]
  grad, w, gs = _bf16(rng, (m, n)), _bf16(rng, (4, k, n)), jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda a, b, s: gg.grouped_gemm(a, jnp.swapaxes(b, 1, 2), s, impl="cuda"))(
      grad, w, gs)
  _compare_bf16(got, lambda a, b, s: _rows_ref(a, jnp.swapaxes(b, 1, 2), s), grad, w, gs)


BF16_WGRAD_CASES = {   # name: (k, m, n, sizes): any sizes (FP8-off layers pad none)
    "aligned": (144, 640, 264, [0, 16, 48, 144]),
    "odd_sizes_and_tail": (136, 300, 96, [3, 0, 120, 1, 0, 77]),
    "one_group": (200, 256, 136, [256]),
    "64_groups": (64, 700, 128, [10] * 64),
}


@pytest.mark.parametrize("case", list(BF16_WGRAD_CASES))
def test_bf16_grouped_wgrad(case):
  k, m, n, sizes = BF16_WGRAD_CASES[case]
  rng = np.random.default_rng(len(case) * 17)
  lhs_t, rhs_t, gs = _bf16(rng, (k, m)), _bf16(rng, (n, m)), jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=BF16, impl="cuda"))
  got = _compare_bf16(f(lhs_t, rhs_t, gs), _wgrad_ref, lhs_t, rhs_t, gs)
  np.testing.assert_array_equal(got, np.asarray(f(lhs_t, rhs_t, gs), np.float64))
  assert (got[[e for e, s in enumerate(sizes) if s == 0]] == 0).all()


BF16_WGRAD_ROWS_CASES = {   # name: (m, k, n, sizes): x (m, k), grad (m, n); any sizes
    "odd_sizes_and_tail": (300, 136, 96, [3, 0, 120, 1, 0, 77]),
    "one_row": (1, 64, 32, [0, 1, 0]),
    "one_group": (256, 200, 136, [256]),
    "64_ragged_groups": (700, 64, 128, [9, 11] * 32),
    "all_empty": (40, 64, 64, [0, 0]),
}


@pytest.mark.parametrize("case", list(BF16_WGRAD_ROWS_CASES))
def test_bf16_grouped_wgrad_rows(case):
  """The row-major wgrad (axis 2) on x and grad as stored, group sizes off
  multiples of 8 included: within the bound of the float32 reference,
  repeatable bit for bit, empty groups' matrices exactly 0."""
  m, k, n, sizes = BF16_WGRAD_ROWS_CASES[case]
  rng = np.random.default_rng(len(case) * 31)
  x, grad, gs = _bf16(rng, (m, k)), _bf16(rng, (m, n)), jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda a, b, s: gg.grouped_wgrad_rows(a, b, s, out_dtype=BF16, impl="cuda"))
  got = _compare_bf16(f(x, grad, gs), _wgrad_ref, x.T, grad.T, gs)
  np.testing.assert_array_equal(got, np.asarray(f(x, grad, gs), np.float64))
  assert (got[[e for e, s in enumerate(sizes) if s == 0]] == 0).all()


@pytest.mark.parametrize("sizes", [[-5, 10, 20], [100, 0, 201], [2 ** 31 - 1, 2 ** 31 - 1, 4]])
def test_bf16_grouped_wgrad_rows_invalid_sizes_give_nan(sizes):
  rng = np.random.default_rng(37)
  out = gg.grouped_wgrad_rows(_bf16(rng, (200, 64)), _bf16(rng, (200, 32)),
                              jnp.asarray(sizes, jnp.int32), out_dtype=BF16, impl="cuda")
  assert np.isnan(np.asarray(out, np.float32)).all()


def test_fp8_off_grouped_dense_weight_gradient():
  """recipe None on the GPU: the kernel gradient (the row-major wgrad on x
  and the output gradient) against the reference, ragged group sizes."""
  from te_jax import grouped_dense as gd  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(41)
  m, k, n, sizes = 520, 256, 128, [0, 37, 200, 1, 250]
  x, w, gs = _bf16(rng, (m, k)), _bf16(rng, (5, k, n)), jnp.asarray(sizes, jnp.int32)
  cot = _bf16(rng, (m, n))
  dw = jax.jit(jax.grad(lambda w: jnp.sum(
      gd.grouped_dense(x, w, gs).astype(jnp.float32) * cot.astype(jnp.float32))))(w)
  _compare_bf16(dw, _wgrad_ref, x.T, cot.T, gs)


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise"])
def test_fp8_grouped_dense_float32_weight_gradient(name):
  """FP8 on the GPU with float32 expert weights: their gradient comes out of
  the float32 wgrad kernel, equal to the reference path's (the same
  quantized operands, float32 GEMMs) within the kernel's accumulation."""
  from te_jax import grouped_dense as gd  # pylint: disable=import-outside-toplevel
  from te_jax import recipe  # pylint: disable=import-outside-toplevel
  r = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
       "blockwise": recipe.Float8BlockScaling}[name]()
  rng = np.random.default_rng(43)
  m, k, n, sizes = 512, 256, 384, [0, 128, 256, 128]
  x, cot, gs = _bf16(rng, (m, k)), _bf16(rng, (m, n)), jnp.asarray(sizes, jnp.int32)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) * 0.05, jnp.float32)
  state = gd.init_grouped_state(r, len(sizes)) if name == "delayed" else None

  def weight_grad(impl):
    loss = lambda w: jnp.sum(gd.grouped_dense(x, w, gs, recipe=r, fp8_state=state, impl=impl)
                             .astype(jnp.float32) * cot.astype(jnp.float32))
    return jax.jit(jax.grad(loss))(w)
  got, want = weight_grad("cuda"), weight_grad("reference")
  assert got.dtype == jnp.float32
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert (got[0] == 0).all() and np.isfinite(got).all()
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < _TOL_F32, f"relative error {err:.3g} >= {_TOL_F32}"


def test_bf16_new_group_sizes_without_recompiling():
  rng = np.random.default_rng(19)
  x, w, dy = _bf16(rng, (512, 256)), _bf16(rng, (4, 256, 128)), _bf16(rng, (512, 128))
  traces = []

  @jax.jit
  def step(x, w, dy, s):
    traces.append(1)
    return (gg.grouped_gemm(x, w, s, impl="cuda"),
            gg.grouped_wgrad_rows(x, dy, s, out_dtype=BF16, impl="cuda"))

  for sizes in ([128, 128, 128, 128], [512, 0, 0, 0], [0, 1, 300, 11], [0, 0, 0, 0]):
    gs = jnp.asarray(sizes, jnp.int32)
    fprop, wgrad = step(x, w, dy, gs)
    _compare_bf16(fprop, _rows_ref, x, w, gs)
    _compare_bf16(wgrad, _wgrad_ref, x.T, dy.T, gs)
  assert len(traces) == 1


@pytest.mark.parametrize("sizes", [[-5, 10, 20], [100, 0, 200], [2 ** 31 - 1, 2 ** 31 - 1, 4]])
def test_bf16_sizes_that_cannot_describe_the_buffer_give_nan(sizes):
  rng = np.random.default_rng(23)
  gs = jnp.asarray(sizes, jnp.int32)
  rows = gg.grouped_gemm(_bf16(rng, (200, 128)), _bf16(rng, (3, 128, 32)), gs, impl="cuda")
  wgrad = gg.grouped_wgrad(_bf16(rng, (64, 200)), _bf16(rng, (32, 200)), gs, out_dtype=BF16,
                           impl="cuda")
  assert np.isnan(np.asarray(rows, np.float32)).all()
  assert np.isnan(np.asarray(wgrad, np.float32)).all()


def test_auto_takes_the_bf16_kernel():
  """impl="auto" on this GPU stages te_jax_grouped_gemm for bf16 x bf16 -> bf16."""
  rng = np.random.default_rng(29)
  x, w, gs = _bf16(rng, (64, 128)), _bf16(rng, (2, 128, 32)), jnp.asarray([30, 34], jnp.int32)
  hlo = jax.jit(lambda l, r, s: gg.grouped_gemm(l, r, s)).lower(x, w, gs).as_text()
  assert ggc.TARGET in hlo


# ------------------------------------------- 5. dense sm90 variants ---

# Blockwise GEMMs (argv[1]: output .npz) at odd shapes, each run twice; prints
# one JSON line per GEMM: relative error against the reference, repeat equality.
_DENSE_SCRIPT = r"""
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from te_jax.ops import gemm as gemm_ops
from te_jax.ops import quantize as q
from te_jax.ops.fp8 import ScaledTensor

def operand(rows, k, block, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-2, 2, size=(rows, 1))
  t = q.quantize_blockwise_reference(jnp.asarray(x, jnp.float32), block, jnp.float8_e4m3fn, True)
  return ScaledTensor(t.data, t.scale_inv, block)

outs = {}
for m, n, k in [(208, 336, 768), (1040, 400, 640), (4096, 1552, 1024)]:
  for bb in [(128, 128), (1, 128)]:
    a, b = operand(m, k, (1, 128), 1), operand(n, k, bb, 2)
    f = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.bfloat16, impl="cuda"))
    first, again = np.asarray(f(a, b), np.float32), np.asarray(f(a, b), np.float32)
    want = np.asarray(gemm_ops.gemm_reference(a, b, jnp.float32), np.float64)
    name = f"{m}x{n}x{k}_b{bb[0]}"
    outs[name] = first
    print(json.dumps({"name": name, "repeat_equal": bool(np.array_equal(first, again)),
                      "rel": float(np.linalg.norm(first - want) / np.linalg.norm(want))}))
np.savez(sys.argv[1], **outs)
"""


def _dense(tmp_path, name, **env):
  out = tmp_path / f"{name}.npz"
  stdout, stderr = _run(_DENSE_SCRIPT, tmp_path, [out], TE_JAX_GEMM_LOG="1", **env)
  runs = [json.loads(l) for l in stdout.splitlines() if l.startswith("{")]
  assert len(runs) == 6, stdout
  for r in runs:
    assert r["repeat_equal"] and r["rel"] < _TOL, r
  return dict(np.load(out)), _selections(stderr), stderr


def test_dense_sm90_variants_match_the_reference_and_cublaslt(tmp_path):
  base, base_sel, _ = _dense(tmp_path, "cublaslt")
  assert all(not s["winner"] or not s["winner"].startswith("sm90") for s in base_sel)
  only, sel, log = _dense(tmp_path, "only", TE_JAX_GEMM_SM90="only")
  winners = [s["winner"] for s in sel if s["winner"]]
  assert len(winners) == 6 and all(w.startswith("sm90 ") for w in winners), log[-4000:]
  assert any("vecvec" in w for w in winners) and any("vecblk" in w for w in winners)
  for name, got in only.items():   # against cuBLASLt's answer, as against the reference
    ref = base[name].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2 * _TOL, name


def test_dense_sm90_variants_join_the_timing(tmp_path):
  _, sel, log = _dense(tmp_path, "added", TE_JAX_GEMM_SM90="1")
  assert len(sel) == 6, log[-4000:]
  for s in sel:
    timed = " ".join(s["timed"])
    assert re.search(r"candidate \d+: sm90 ", timed), log[-4000:]
    assert re.search(r"candidate \d+: algo=", timed), log[-4000:]
