"""A fused projection whose output is used in blocks (attention's Q/K/V).

The blocks come out of their own GEMMs (``ScalingMode.gemm(num_splits=)``
in FP8, one dot each with FP8 off), never as slices of one (tokens, 3 *
heads * head_dim) product: each slice would be a copy of the block (three
128 MiB copies per step at 16384 tokens, hidden 4096).

* ``ScaledTensor.row_blocks``: the blocks dequantize to the rows of the whole;
  bad splits are refused with the reason.
* CPU: the programs of ``fp8_dense_split`` and
  ``fp8_norm_dense(num_splits=3)`` hold no product as wide as the whole
  output but the weight gradient's. (Their values and gradients equal those
  of splitting the whole output: ``test_concat_quantize.py``,
  ``test_norm_attention.py``.)
* FP8 off: ``te_jax.layers.gemm.plain_split_gemm``, one dot per block behind its
  own ``optimization_barrier``, equals the split of the one dot (values and
  gradients) and leaves no 1536-wide product in the attention program.
* GPU (``gpu`` marker): the compiled attention step, every recipe and FP8
  off, holds no floating-point array the size of the whole Q/K/V output or
  its gradient.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import te_jax
from te_jax import dense, fp8_state, norm_dense, recipe
from te_jax import flax as tfx
from te_jax.layers import gemm as gemm_lib
from te_jax.ops import quantize as qop
from te_jax.ops.fp8 import ScaledTensor

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}


def _state(r):
  return fp8_state.init_dense_state(r.amax_history_len) if r.scaling_mode().uses_state else None


# ------------------------------------------------------------ row_blocks ---

@pytest.mark.parametrize("block_shape", [None, (1, 128), (128, 128)])
def test_row_blocks_dequantize_to_the_rows_of_the_whole(block_shape):
  x = jax.random.normal(jax.random.PRNGKey(0), (768, 256)) * jnp.linspace(0.1, 30, 768)[:, None]
  if block_shape is None:
    q = qop.quantize_tensorwise(x, jnp.float32(2.0), impl="reference")
  else:
    q = qop.quantize_blockwise(x, block_shape=block_shape, impl="reference")
  whole = ScaledTensor(q.data, q.scale_inv, q.block_shape)
  parts = whole.row_blocks(3)
  assert len(parts) == 3 and all(p.shape == (256, 256) for p in parts)
  assert all(p.block_shape == whole.block_shape for p in parts)
  np.testing.assert_array_equal(
      np.concatenate([np.asarray(p.dequantize()) for p in parts]),
      np.asarray(whole.dequantize()))
  # The scales differ between blocks (the rows were scaled 0.1 to 30), so a
  # block given another block's scales would not dequantize as asserted.
  if block_shape is not None:
    assert float(parts[0].scale_inv.max()) < float(parts[2].scale_inv.min())


@pytest.mark.parametrize("block_shape", [(1, 128), (128, 128)])
def test_rows_keep_their_scales_up_to_a_partial_last_tile(block_shape):
  x = jax.random.normal(jax.random.PRNGKey(1), (300, 256)) * jnp.linspace(0.1, 30, 300)[:, None]
  q = qop.quantize_blockwise(x, block_shape=block_shape, impl="reference")
  whole = ScaledTensor(q.data, q.scale_inv, q.block_shape)
  want = np.asarray(whole.dequantize())
  for start, stop in ((0, 128), (128, 300), (256, 300)):   # 300: inside the last tile
    np.testing.assert_array_equal(np.asarray(whole.rows(start, stop).dequantize()),
                                  want[start:stop])
  if block_shape == (128, 128):
    for start, stop in ((64, 128), (0, 200), (128, 128), (0, 301)):
      with pytest.raises(ValueError, match=r"do not start and end on 128-row scale tiles"):
        whole.rows(start, stop)


def test_row_blocks_refuses_blocks_that_cut_a_scale_tile():
  t = ScaledTensor(jnp.zeros((384, 128), jnp.float8_e4m3fn), jnp.ones((3, 1)), (128, 128))
  with pytest.raises(ValueError, match="cannot split 384 rows into 2 .* 128-row"):
    t.row_blocks(2)   # 192-row blocks would cut the second 128-row tile
  with pytest.raises(ValueError, match="cannot split 384 rows into 5"):
    ScaledTensor(t.data, jnp.float32(1.0)).row_blocks(5)
  for bad in (0, True, 1.5):
    with pytest.raises(ValueError, match="n must be an int >= 1"):
      t.row_blocks(bad)


def test_gemm_num_splits_is_checked():
  mode = recipe.Float8CurrentScaling().scaling_mode()
  a = ScaledTensor(jnp.ones((32, 32), jnp.float8_e4m3fn), jnp.float32(1.0))
  b = ScaledTensor(jnp.ones((48, 32), jnp.float8_e4m3fn), jnp.float32(2.0))
  parts = mode.gemm("fprop", a, b, out_dtype=jnp.float32, num_splits=3, impl="reference")
  assert len(parts) == 3 and all(p.shape == (32, 16) for p in parts)
  np.testing.assert_array_equal(np.asarray(parts[2]), np.full((32, 16), 64.0, np.float32))
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
      mode.gemm("fprop", a, b, out_dtype=jnp.float32, num_splits=bad, impl="reference")
  with pytest.raises(ValueError, match="cannot split 48 rows into 5"):
    mode.gemm("fprop", a, b, out_dtype=jnp.float32, num_splits=5, impl="reference")


def test_gemm_split_sizes_gives_blocks_of_those_widths():
  """ScalingMode.gemm(split_sizes=): one GEMM per row block of b, widths as
  given (blocks that cut a scale tile: ScaledTensor.rows refuses them,
  test_row_blocks_refuses_blocks_that_cut_a_scale_tile)."""
  mode = recipe.Float8CurrentScaling().scaling_mode()
  a = ScaledTensor(jnp.ones((32, 32), jnp.float8_e4m3fn), jnp.float32(1.0))
  b = ScaledTensor(jnp.arange(48 * 32).reshape(48, 32).astype(jnp.float8_e4m3fn),
                   jnp.float32(2.0))
  parts = mode.gemm("fprop", a, b, out_dtype=jnp.float32, split_sizes=(32, 8, 8),
                    impl="reference")
  whole = mode.gemm("fprop", a, b, out_dtype=jnp.float32, impl="reference")
  assert [p.shape for p in parts] == [(32, 32), (32, 8), (32, 8)]
  np.testing.assert_array_equal(np.concatenate(parts, axis=1), np.asarray(whole))
  for bad, err in (((32, 8), "must sum to the output's 48"), ((), "non-empty"),
                   ((48.0,), "ints >= 1"), ((0, 48), "ints >= 1")):
    with pytest.raises(ValueError, match=err):
      mode.gemm("fprop", a, b, out_dtype=jnp.float32, split_sizes=bad, impl="reference")
  with pytest.raises(ValueError, match="not both"):
    mode.gemm("fprop", a, b, out_dtype=jnp.float32, num_splits=3, split_sizes=(16,) * 3,
              impl="reference")


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("normed", [False, True])
def test_unequal_split_equals_the_split_of_the_whole(rname, normed):
  """fp8_dense_split / fp8_norm_dense with split_sizes (grouped-query Q/K/V:
  256 | 128 | 128) against the unsplit op's output split afterwards: the same
  values, gradients and FP8 state bit for bit (same operands, same scales:
  each block's GEMM reads the rows of the one FP8 kernel)."""
  r = RECIPES[rname]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 128, 256)).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.PRNGKey(2), (256, 512)) * 0.06).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.PRNGKey(3), (512,)).astype(jnp.bfloat16)
  gamma = (1 + 0.1 * jax.random.normal(jax.random.PRNGKey(4), (256,))).astype(jnp.bfloat16)
  sizes = (256, 128, 128)

  def run(x, w, b, st, **kw):
    if normed:
      return norm_dense.fp8_norm_dense(x, gamma, None, w, b, norm_type="rmsnorm",
                                       epsilon=1e-6, zero_centered_gamma=False, recipe=r,
                                       fp8_state=st, impl="reference", **kw)
    return dense.fp8_dense_split(x, w, b, recipe=r, fp8_state=st, impl="reference", **kw)

  def split(x, w, b, st):
    return run(x, w, b, st, split_sizes=sizes)

  def whole(x, w, b, st):
    y = run(x, w, b, st) if normed else run(x, w, b, st, num_splits=1)[0]
    return dense.split_columns(y, sizes)

  def loss(fn, x, w, b, st):
    return sum(jnp.sum(y.astype(jnp.float32) * (i + 1)) for i, y in enumerate(fn(x, w, b, st)))

  st = _state(r)
  for fn in (split, whole):
    assert [y.shape for y in fn(x, w, b, st)] == [(2, 128, f) for f in sizes]
  got = (split(x, w, b, st), jax.grad(lambda *a: loss(split, *a), (0, 1, 2, 3))(x, w, b, st))
  want = (whole(x, w, b, st), jax.grad(lambda *a: loss(whole, *a), (0, 1, 2, 3))(x, w, b, st))
  for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
  widths = _dot_widths(split, x, w, b, st)
  assert sorted(w for w in widths if w in sizes) == [128, 128, 256] and 512 not in widths


def test_split_sizes_arguments_are_checked():
  r = recipe.Float8CurrentScaling()
  x = jnp.ones((2, 128, 256), jnp.bfloat16); w = jnp.ones((256, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs num_splits .* or split_sizes"):
    dense.fp8_dense_split(x, w, recipe=r)
  with pytest.raises(ValueError, match="not both"):
    dense.fp8_dense_split(x, w, num_splits=2, split_sizes=(256, 256), recipe=r)
  with pytest.raises(ValueError, match="must sum to the output's 512"):
    dense.fp8_dense_split(x, w, split_sizes=(256, 128), recipe=r)
  # Blocks off the recipe's alignment: the whole output split afterwards.
  ys = dense.fp8_dense_split(x, w, split_sizes=(500, 12), recipe=r, impl="reference")
  assert [y.shape for y in ys] == [(2, 128, 500), (2, 128, 12)]
  for bad in (True, (2, 3), (3.0,), 0):
    with pytest.raises(ValueError, match="split_output"):
      gemm_lib.check_split_output(bad, (3,) if bad is True else (4, 8))


# ------------------------------------------------------------------ CPU ----

def _dot_widths(fn, *args):
  """The last dims of every dot_general result in ``fn``'s lowered program."""
  text = jax.jit(fn).lower(*args).as_text()
  return [int(m.group(1)) for m in
          re.finditer(r"stablehlo\.dot_general.*-> tensor<(?:\d+x)*(\d+)x\w+>", text)]


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_fp8_split_forward_has_no_whole_product(rname):
  """fp8_dense_split and fp8_norm_dense(num_splits=3): the forward's output
  blocks are three GEMMs of width 128, and no product (forward or backward)
  is 384 wide but the weight gradient's (K, N) one."""
  r = RECIPES[rname]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 128, 256)).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.PRNGKey(2), (256, 384)) * 0.06).astype(jnp.bfloat16)
  gamma, beta = jnp.ones((256,), jnp.bfloat16), jnp.zeros((256,), jnp.bfloat16)
  st = _state(r)

  def plain(x, w, st):
    return dense.fp8_dense_split(x, w, num_splits=3, recipe=r, fp8_state=st,
                                 impl="reference")

  def normed(x, w, st):
    return norm_dense.fp8_norm_dense(x, gamma, beta, w, None, norm_type="layernorm",
                                     epsilon=1e-6, zero_centered_gamma=False, recipe=r,
                                     fp8_state=st, impl="reference", num_splits=3)

  for fn in (plain, normed):
    assert _dot_widths(fn, x, w, st).count(128) == 3, fn.__name__
    assert 384 not in _dot_widths(fn, x, w, st), fn.__name__

    def loss(x, w, st, fn=fn):
      return sum(jnp.sum(y.astype(jnp.float32) * (i + 1)) for i, y in enumerate(fn(x, w, st)))
    widths = _dot_widths(jax.grad(loss, argnums=(0, 1)), x, w, st)
    # Backward: dgrad (tokens, K=256) and the one wgrad (K, N=384): 384 once.
    assert widths.count(384) == 1, (fn.__name__, widths)


def test_fp8_off_split_equals_the_split_of_one_dot():
  """plain_split_gemm (one dot per block) against one dot and a split:
  values and the gradients of x, kernel and bias, float32 on the CPU."""
  kx, kw, kb, kc = jax.random.split(jax.random.PRNGKey(3), 4)
  x = jax.random.normal(kx, (2, 64, 96))
  w = jax.random.normal(kw, (96, 3, 4, 16)) * 0.1
  b = jax.random.normal(kb, (3, 4, 16))
  cots = jax.random.normal(kc, (3, 2, 64, 4, 16))

  def split(x, w, b):
    return gemm_lib.plain_split_gemm(x, w, b, contract_ndim=1)

  def whole(x, w, b):
    y = dense.dense_general(x, w, b, contract_ndim=1)
    return tuple(y[:, :, i] for i in range(3))

  def loss(fn, x, w, b):
    return sum(jnp.sum(y * c) for y, c in zip(fn(x, w, b), cots))

  got = (split(x, w, b), jax.grad(loss, (1, 2, 3))(split, x, w, b))
  want = (whole(x, w, b), jax.grad(loss, (1, 2, 3))(whole, x, w, b))
  for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
  assert 192 not in _dot_widths(split, x, w, b)
  assert _dot_widths(split, x, w, b).count(64) == 3


def test_fp8_off_attention_has_no_whole_qkv_product():
  """The FP8-off MultiHeadAttention (fused Q/K/V kernel, Linen and NNX)
  computes Q, K and V with one dot each, behind a barrier per block: no
  1536-wide product in its gradient program."""
  mha = tfx.MultiHeadAttention(num_attention_heads=4, dtype=jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 512))
  v = nn.unbox(mha.init(jax.random.PRNGKey(1), x))
  assert v["params"]["qkv"]["kernel"].shape == (512, 3, 4, 128)
  grad = jax.grad(lambda v, x: jnp.sum(mha.apply(v, x) ** 2), argnums=(0, 1))
  widths = _dot_widths(grad, v, x)
  assert 1536 not in widths and widths.count(512) >= 3, widths
  text = jax.jit(grad).lower(v, x).as_text()
  assert text.count("stablehlo.optimization_barrier") >= 3


# ------------------------------------------------------------- CUDA (H200) --

@pytest.mark.gpu
@pytest.mark.parametrize("rname", [None] + sorted(RECIPES))
def test_gpu_attention_step_has_no_whole_qkv_array(rname):
  """The compiled attention step (x 2 x 128 tokens, hidden 512, 4 heads),
  FP8 off and every recipe, has no bf16/f16/f32 array of 256 x 1536
  elements: neither the Q/K/V output sliced into blocks nor its gradient
  assembled from dq, dk, dv. (The FP8 gradient the concat-quantize kernel
  writes has that size and is FP8; the kernel and its gradient, 512 x 1536,
  are another size.) Without the barriers of plain_split_gemm, XLA merged
  the FP8-off per-block dots back into one and this failed."""
  mha = tfx.MultiHeadAttention(num_attention_heads=4, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 512)).astype(jnp.bfloat16)
  with te_jax.fp8_autocast(enabled=rname is not None,
                           fp8_recipe=RECIPES[rname] if rname else None):
    v = nn.unbox(mha.init(jax.random.PRNGKey(1), x))
    hlo = jax.jit(jax.grad(lambda v: jnp.sum(mha.apply(v, x).astype(jnp.float32)))).lower(
        v).compile().as_text()
  whole = []
  for line in hlo.splitlines():   # "%name = (bf16[256,512]{1,0}, u8[..]) op(...)"
    result = re.match(r"\s*(?:ROOT )?%?\S+ = (.*?) [\w.$-]+\(", line)
    for m in re.finditer(r"\b(?:bf16|f16|f32)\[([\d,]+)\]", result.group(1) if result else ""):
      if math.prod(int(d) for d in m.group(1).split(",")) == 256 * 1536:
        whole.append(line.strip()[:300])
  assert ("te_jax_gemm" in hlo) == (rname is not None)
  assert not whole, whole
