"""The bf16 grouped GEMM's CUDA path (the FP8-off MoE GEMMs) on a CPU machine.

What runs here without a GPU (the kernel itself: tests/test_gpu_grouped_gemm.py
and benchmarks/grouped_gemm_sm90.cu): the operands the wrapper hands the
kernel, fed to the numpy model of its contract (``kernel_model``), against
the reference; the ``te_jax_grouped_gemm`` call the dispatcher stages for
bfloat16 operands (jaxpr, and the StableHLO lowered for CUDA): the wgrad on
the row-major operands as they are (axis 2), with any group sizes; the
clear refusal of float32 and mixed operands and of rows that are not 16
bytes; and the FP8-off ``grouped_dense`` (recipe None) reaching the same
calls, its wgrad with no transpose or gather of the activations.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import grouped_dense as gd
from te_jax.ops import grouped_gemm as gg
from te_jax.ops import grouped_gemm_cuda as ggc

from cuda_lowering import cuda_text
# pylint: disable=unused-import  # fake_gpu is a fixture used by name
from test_grouped_gemm import CASES, _close, _ffi_calls, _staged, fake_gpu, kernel_model

BF16 = jnp.bfloat16


def _bf16(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), BF16)


def _sizes(sizes):
  return jnp.asarray(sizes, jnp.int32)


# ----------------------------------------- operands against the contract ---

@pytest.mark.parametrize("case", list(CASES))
def test_rows_operands_meet_the_kernel_contract(case):
  """fprop/dgrad on bfloat16: a = lhs, b = rhs per group transposed, no
  scales; read as the kernel reads them they give the reference's product
  (odd shapes, empty groups, one group, one row, rows past the groups)."""
  m, k, n, sizes = CASES[case]
  rng = np.random.default_rng(0)
  lhs, rhs, gs = _bf16(rng, (m, k)), _bf16(rng, (len(sizes), k, n)), _sizes(sizes)
  ops = jax.jit(ggc.rows_operands)(lhs, rhs, gs)
  assert ops.scaling == ggc.NONE == 2
  assert ops.a.dtype == ops.b.dtype == BF16 and ops.b.shape == (len(sizes), n, k)
  assert ops.a_sinv.shape == ops.b_sinv.shape == (1,)
  want = gg.grouped_gemm_reference(lhs, rhs, gs, jnp.float32)
  _close(kernel_model(ggc.ROWS, ops, sizes), want)


WGRAD_SIZES = {               # (m, sizes): any sizes, as FP8-off layers pad none
    "odd_with_empty_groups": (37, [3, 0, 20, 1, 0, 9]),
    "one_group": (16, [16]),
    "one_row": (1, [0, 1, 0]),
    "rows_past_the_groups": (40, [5, 0, 7]),
    "all_empty": (9, [0, 0]),
    "multiples_of_8": (64, [8, 16, 40]),
}


@pytest.mark.parametrize("case", list(WGRAD_SIZES))
def test_wgrad_reads_the_row_major_operands_as_they_are(case):
  """wgrad on bfloat16 x (m, k) and grad (m, n): the kernel (axis 2) reads
  them unchanged, no scales, with the caller's sizes (none a multiple of 8
  needed: each group's rows start 16-byte aligned as k and n are multiples
  of 8); read as the kernel reads them they give the reference's product,
  which is grouped_wgrad_reference of the transposes."""
  m, sizes = WGRAD_SIZES[case]
  rng = np.random.default_rng(1)
  k, n = 24, 40
  x, grad = _bf16(rng, (m, k)), _bf16(rng, (m, n))
  ops = ggc.row_major_wgrad_operands(x, grad)
  assert ops.scaling == ggc.NONE and ops.a is x and ops.b is grad
  assert ops.a_sinv.shape == ops.b_sinv.shape == (1,)
  want = gg.grouped_wgrad_rows(x, grad, _sizes(sizes), impl="reference")
  _close(kernel_model(ggc.CONTRACTION_ROW_MAJOR, ops, sizes), want)


# ------------------------------------------------- what the dispatcher stages ---

def _kernel_calls(fn, *args):
  """(attributes, operand avals, result avals) of each te_jax_grouped_gemm call."""
  return [(dict(c.params["attributes"]), [(tuple(v.aval.shape), v.aval.dtype) for v in c.invars],
           [(tuple(v.aval.shape), v.aval.dtype) for v in c.outvars])
          for c in _staged(fn, *args) if c.params["target_name"] == ggc.TARGET]


def test_dispatcher_stages_the_bf16_kernel(fake_gpu):
  """bfloat16 x bfloat16 with a bfloat16 output under "auto": one
  te_jax_grouped_gemm call per op, scaling 2 (none), (1,) float32 dummy
  scales; fast_accum is FP8's and reaches the handler as 0."""
  del fake_gpu
  rng = np.random.default_rng(2)
  m, k, n, g = 200, 136, 72, 4
  lhs, rhs, gs = _bf16(rng, (m, k)), _bf16(rng, (g, k, n)), _sizes([50, 0, 101, 30])
  (call,) = _kernel_calls(lambda a, b, s: gg.grouped_gemm(a, b, s, fast_accum=True), lhs, rhs, gs)
  assert call[0] == {"axis": 0, "scaling": 2, "fast_accum": 0}
  assert call[1] == [((m, k), BF16), ((g, n, k), BF16), ((1,), jnp.float32),
                     ((1,), jnp.float32), ((g,), jnp.int32)]
  assert call[2] == [((m, n), BF16), ((ggc.workspace_bytes(g),), jnp.uint8)]
  # wgrad, row major: x (m, k) and dy (m, n) as they are, the caller's
  # sizes (one of 101 rows: not a multiple of 8); out (g, k, n)
  x, dy = _bf16(rng, (m, k)), _bf16(rng, (m, n))
  row_major = ([((m, k), BF16), ((m, n), BF16), ((1,), jnp.float32), ((1,), jnp.float32),
                ((g,), jnp.int32)], [((g, k, n), BF16), ((ggc.workspace_bytes(g),), jnp.uint8)])
  (call,) = _kernel_calls(lambda a, b, s: gg.grouped_wgrad_rows(a, b, s, out_dtype=BF16),
                          x, dy, gs)
  assert call[0] == {"axis": 2, "scaling": 2, "fast_accum": 0}
  assert (call[1], call[2]) == row_major
  # wgrad on lhs_t (k, m), rhs_t (n, m): the same kernel on their transposes
  (call,) = _kernel_calls(lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=BF16),
                          x.T, dy.T, gs)
  assert call[0] == {"axis": 2, "scaling": 2, "fast_accum": 0}
  assert (call[1], call[2]) == row_major


@pytest.mark.parametrize("lhs_dtype, rhs_dtype, out_dtype, says", [
    (jnp.float32, jnp.float32, BF16,
     "float32 x float32 float operands: the FP8-off grouped kernel takes bfloat16 x bfloat16"),
    (BF16, jnp.float32, BF16,
     "bfloat16 x float32 float operands: the FP8-off grouped kernel takes bfloat16 x bfloat16"),
    (jnp.float16, jnp.float16, BF16, "float16 x float16 float operands"),
    (BF16, BF16, jnp.float32,
     "out_dtype=float32: the sm90 grouped kernels write float32 for FP8 wgrads"),
])
@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_wgrad", "grouped_wgrad_rows"])
def test_what_the_bf16_kernel_cannot_run_is_refused_clearly(fake_gpu, caplog, op, lhs_dtype,
                                                            rhs_dtype, out_dtype, says):
  """impl="cuda" raises a ValueError that names the dtypes and the fix;
  "auto" runs the reference, warning why once (a GPU user loses the kernel)."""
  del fake_gpu
  gs = _sizes([30, 10])
  if op == "grouped_gemm":
    args = (jnp.ones((64, 128), lhs_dtype), jnp.ones((2, 128, 32), rhs_dtype), gs)
  elif op == "grouped_wgrad":
    args = (jnp.ones((128, 40), lhs_dtype), jnp.ones((32, 40), rhs_dtype), gs)
  else:
    args = (jnp.ones((40, 128), lhs_dtype), jnp.ones((40, 32), rhs_dtype), gs)
  fn = getattr(gg, op)
  with pytest.raises(ValueError, match="impl='cuda'.*" + re.escape(says)):
    fn(*args, out_dtype=out_dtype, impl="cuda")
  with caplog.at_level(logging.INFO, logger="te_jax"):
    assert not _staged(lambda: fn(*args, out_dtype=out_dtype))
  assert [r.levelno for r in caplog.records if says in r.getMessage()] == [logging.WARNING]


def test_bf16_rows_need_16_byte_rows(fake_gpu):
  """k must be a multiple of 8 bf16 elements (16 bytes) for TMA; n a
  multiple of 8 for the output rows. The CUDA wrapper says so itself too."""
  del fake_gpu
  gs = _sizes([3, 1])
  with pytest.raises(ValueError, match=re.escape("k (lhs.shape[1])=12 is not a multiple of 8")):
    gg.grouped_gemm(jnp.ones((4, 12), BF16), jnp.ones((2, 12, 8), BF16), gs, impl="cuda")
  with pytest.raises(ValueError, match="last dim 12 is not a multiple of 8"):
    ggc.grouped_gemm(jnp.ones((4, 16), BF16), jnp.ones((2, 16, 12), BF16), gs)
  with pytest.raises(ValueError, match="last dim 12 is not a multiple of 8"):
    ggc.grouped_wgrad(jnp.ones((16, 4), BF16), jnp.ones((12, 4), BF16), gs)
  with pytest.raises(ValueError, match="last dim 12 is not a multiple of 8"):
    ggc.grouped_wgrad_rows(jnp.ones((4, 16), BF16), jnp.ones((4, 12), BF16), gs)
  # the wgrad's k is its operands' contiguous dim now (read MN-major)
  with pytest.raises(ValueError, match=re.escape("k (lhs_t.shape[0])=12 is not a multiple of 8")):
    ggc.grouped_wgrad(jnp.ones((12, 4), BF16), jnp.ones((16, 4), BF16), gs)


@pytest.mark.parametrize("k, n, says", [
    (12, 16, "k (x.shape[1])=12 is not a multiple of 8 (16-byte bfloat16 rows for TMA)"),
    (16, 20, "the output's last dim 20 is not a multiple of 8"),
])
def test_row_major_wgrad_needs_16_byte_rows(fake_gpu, caplog, k, n, says):
  """The row-major wgrad takes any group sizes but needs k and n multiples
  of 8 (each group's rows of x and grad start 16-byte aligned only then):
  impl="cuda" raises naming the dim, "auto" warns why once and runs the
  reference, whose value it returns."""
  del fake_gpu
  rng = np.random.default_rng(6)
  x, grad, gs = _bf16(rng, (10, k)), _bf16(rng, (10, n)), _sizes([3, 7])
  with pytest.raises(ValueError, match="impl='cuda'.*" + re.escape(says)):
    gg.grouped_wgrad_rows(x, grad, gs, out_dtype=BF16, impl="cuda")
  with caplog.at_level(logging.INFO, logger="te_jax"):
    assert not _staged(lambda: gg.grouped_wgrad_rows(x, grad, gs, out_dtype=BF16))
    got = gg.grouped_wgrad_rows(x, grad, gs, out_dtype=BF16)
  assert [r.levelno for r in caplog.records if says in r.getMessage()] == [logging.WARNING]
  want = gg.grouped_wgrad_reference(x.T, grad.T, gs, BF16)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # k = 24: not 16-byte rows for FP8 (16 elements), but for bf16 (8 elements) it is
  assert len(_staged(lambda: gg.grouped_gemm(jnp.ones((4, 24), BF16),
                                             jnp.ones((2, 24, 8), BF16), gs))) == 1


# ------------------------------------------- FP8-off grouped_dense reaches it ---

def _fp8_off_step(x, kernel, gs):
  """Forward and both gradients of the FP8-off grouped dense."""
  def loss(x, kernel):
    return jnp.sum(gd.grouped_dense(x, kernel, gs, recipe=None).astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1))(x, kernel)


def test_fp8_off_grouped_dense_reaches_the_bf16_kernel(fake_gpu):
  """recipe None with bfloat16 x and kernel: fprop and dgrad (rows) and
  wgrad (contraction) are three te_jax_grouped_gemm calls with scaling 2,
  in the jaxpr and in the StableHLO lowered for CUDA."""
  del fake_gpu
  rng = np.random.default_rng(3)
  m, k, n, g = 96, 64, 48, 3
  x, kernel, gs = _bf16(rng, (m, k)), _bf16(rng, (g, k, n)), _sizes([40, 0, 50])
  calls = _kernel_calls(_fp8_off_step, x, kernel, gs)
  assert [(c[0]["axis"], c[0]["scaling"]) for c in calls] == [(0, 2), (0, 2), (2, 2)]
  assert [c[2][0] for c in calls] == [((m, n), BF16), ((m, k), BF16), ((g, k, n), BF16)]
  text = cuda_text(_fp8_off_step, x, kernel, gs)
  targets = re.findall(r'custom_call @(\w+)\(', text) + re.findall(
      r'call_target_name = "(\w+)"', text)
  assert targets.count(ggc.TARGET) == 3, targets
  assert len(re.findall(r"scaling = 2 : i64", text)) == 3


def test_fp8_off_wgrad_reads_x_and_grad_as_stored(fake_gpu):
  """The FP8-off backward's wgrad takes x (m, k) and the output gradient
  (m, n) as they are (axis 2, the caller's group sizes, none a multiple of
  8 here): the StableHLO lowered for CUDA transposes no (m, k) or (m, n)
  array and gathers nothing (the realignment of lhs_t and rhs_t it replaces
  gathered both, from their transposes)."""
  del fake_gpu
  rng = np.random.default_rng(7)
  m, k, n, g = 96, 64, 48, 3
  x, kernel, gs = _bf16(rng, (m, k)), _bf16(rng, (g, k, n)), _sizes([37, 0, 50])
  (wgrad,) = [c for c in _kernel_calls(_fp8_off_step, x, kernel, gs) if c[0]["axis"] == 2]
  assert wgrad[1][:2] == [((m, k), BF16), ((m, n), BF16)]
  assert wgrad[2][0] == ((g, k, n), BF16)
  text = cuda_text(_fp8_off_step, x, kernel, gs)
  assert "gather" not in text
  for rows in (f"{k}x{m}", f"{n}x{m}"):     # the transposes of x and of the gradient
    assert not re.search(rf"transpose.*-> tensor<{rows}xbf16>", text), rows


def test_fp8_off_grouped_dense_with_a_float32_kernel_runs_the_reference(fake_gpu, caplog):
  """A float32 kernel under bfloat16 activations (mixed operands) is not the
  bf16 kernel's: "auto" runs the reference for every GEMM and says why;
  the layer must cast its kernel to bfloat16 to reach the kernel."""
  del fake_gpu
  rng = np.random.default_rng(4)
  x, gs = _bf16(rng, (32, 16)), _sizes([16, 16])
  kernel = jnp.asarray(rng.standard_normal((2, 16, 8)), jnp.float32)
  with caplog.at_level(logging.INFO, logger="te_jax"):
    assert not _kernel_calls(_fp8_off_step, x, kernel, gs)
  assert any("bfloat16 x float32 float operands" in r.getMessage() for r in caplog.records)


def test_fp8_off_flax_moe_reaches_the_bf16_kernel(fake_gpu):
  """The Linen MoE layer without fp8_autocast, computing in bfloat16 over
  float32 parameters (the layer casts its kernels to the compute dtype when
  FP8 is off): its six expert GEMMs (fprop, dgrad, wgrad of wi and wo) are
  te_jax_grouped_gemm calls with scaling 2."""
  del fake_gpu
  from te_jax import flax as tfx  # pylint: disable=import-outside-toplevel
  module = tfx.MoE(num_experts=4, num_experts_per_token=2, intermediate_dim=64, dtype=BF16)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 16, 32)), BF16)
  params = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)   # traced only: no kernel runs

  def step(params, x):
    return jax.grad(lambda p, v: jnp.sum(module.apply(p, v).astype(jnp.float32)),
                    argnums=(0, 1))(params, x)

  calls = _kernel_calls(step, params, x)
  assert sorted((c[0]["axis"], c[0]["scaling"]) for c in calls) == [(0, 2)] * 4 + [(2, 2)] * 2


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_wgrad"])
def test_more_groups_than_the_kernel_holds_are_refused_at_trace_time(fake_gpu, op):
  """The setup kernel keeps at most MAX_GROUPS sizes: more is a ValueError
  under impl="cuda" at trace time, for the wgrad (whose operands do not
  show the group count) as for the rows GEMM; MAX_GROUPS itself stages."""
  del fake_gpu
  def args(g):
    if op == "grouped_gemm":
      return jnp.ones((16, 16), BF16), jnp.ones((g, 16, 8), BF16), jnp.zeros((g,), jnp.int32)
    return jnp.ones((16, 16), BF16), jnp.ones((8, 16), BF16), jnp.zeros((g,), jnp.int32)
  fn = lambda a, b, s: getattr(gg, op)(a, b, s, out_dtype=BF16, impl="cuda")
  over = ggc.MAX_GROUPS + 1
  with pytest.raises(ValueError, match=f"{over} groups: the kernel takes at most"):
    jax.eval_shape(fn, *args(over))
  assert len(_kernel_calls(fn, *args(ggc.MAX_GROUPS))) == 1
