"""Fused normalization + FP8 quantize (te_jax/ops/normalization.py), the FP8
norm + dense (te_jax/norm_dense.py), the fused MLP with its norm, and the Flax
modules that use them.

CPU (CI):
  * the references: the forward equals ``te_jax.layers.norm.apply_norm`` bit for
    bit; the closed-form backward equals ``jax.vjp`` of the forward to float32
    accuracy; ``norm_quantize`` is ``quantize_by_mode_reference`` of the
    forward (every mode, both FP8 formats);
  * output selection and ``norm_quantize_with_stats``: one copy is that copy
    of both; quantizing again from the forward's statistics (and amax)
    gives the forward's bytes; the CUDA program asks for exactly that (no
    statistics pass: given statistics), lowered for CUDA without a GPU;
  * ``fp8_norm_dense`` and ``fp8_mlp(norm=...)`` against the unfused path
    (``apply_norm`` then ``fp8_dense`` / ``fp8_mlp``) with float32 inputs, where
    both quantize the same float32 values: the outputs bit for bit, every
    gradient and the FP8 state to float32 accuracy (the norm's backward is the
    closed form in one, autodiff in the other); with bfloat16 inputs (the
    unfused path rounds the norm output to bfloat16 before quantizing) within
    the FP8 tolerances of tests/test_flax_*.py;
  * LayerNormDenseGeneral and LayerNormMLP choosing the fused path (spied),
    its result against the unfused module, the reasons they fall back, FP8
    off untouched, bad arguments.
GPU (``gpu`` marker): every kernel against its reference evaluated on the CPU
backend (XLA:GPU's float32 division is not correctly rounded), on rows not a
multiple of 128, hidden 4096, 8192 and odd sizes, float32/bfloat16/float16
inputs; the selected copies and the quantization from given statistics
against the kernels' own both-copies results bit for bit; the layers and
modules on the CUDA path.
"""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import dense, fp8_state, fused_mlp, norm_dense, recipe
from te_jax import flax as tfx
from te_jax.layers import norm as fused_norm
from te_jax.layers.norm import apply_norm
from te_jax.ops import normalization as nrm
from te_jax.ops import normalization_cuda
from te_jax.ops import quantize as quantize_op

from cuda_lowering import cuda_text, gpu_host  # pylint: disable=unused-import
from flax_cases import RECIPES, rel
from flax_cases import norm_params as _params, rand as _rand, vjp_run

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FWD_TOL, GRAD_TOL = 0.08, 0.15   # tests/test_flax_dense.py, test_flax_mlp.py
COLL = fp8_state.FP8_COLLECTION
EPS = 1e-6
# (norm_type, zero_centered_gamma): every combination.
NORMS = [("layernorm", False), ("layernorm", True), ("rmsnorm", False), ("rmsnorm", True)]


def _bits(a):
  return np.asarray(a).reshape(-1).view(np.uint8)


def _assert_q_equal(got, want, what=""):
  """Every field of two QuantizedTensors bit for bit (NaN-free data)."""
  assert got.block_shape == want.block_shape, what
  for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
    g, w = getattr(got, name), getattr(want, name)
    assert (g is None) == (w is None), (what, name)
    if g is not None:
      assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, w.shape)
      np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{what} {name}")


def _state(r, scale=1.0):
  """A non-trivial delayed-scaling state (None for the other recipes)."""
  if not isinstance(r, recipe.DelayedScaling):
    return None
  st = fp8_state.init_dense_state(r.amax_history_len)
  return jax.tree.map(lambda a: (a + (0.5 if a.ndim == 0 else 3.0)) * scale, st)


# -------------------------------------------------------------- references ---

M, H = 72, 200   # partial 128-tiles along both dims


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_forward_reference_is_apply_norm(dtype):
  x = _rand(0, (M, H), 3.0, 0.5, dtype)
  for norm_type, zc in NORMS:
    gamma, beta = _params(norm_type, zc, H)
    fwd = jax.jit(lambda x, g, b: nrm.norm_forward_reference(
        x, g, b, norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc))
    unfused = jax.jit(lambda x, g, b: apply_norm(
        x, g, b, norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc, dtype=F32))
    y, mean, rstd = fwd(x, gamma, beta)
    tag = f"{norm_type} zc={zc} {jnp.dtype(dtype).name}"
    np.testing.assert_array_equal(np.asarray(y), np.asarray(unfused(x, gamma, beta)),
                                  err_msg=tag)
    assert y.dtype == F32 and rstd.shape == (M,) and rstd.dtype == F32, tag
    x64 = np.asarray(x, np.float64)
    if norm_type == "rmsnorm":
      assert mean is None, tag
      var = np.mean(x64 ** 2, axis=1)
    else:
      np.testing.assert_allclose(np.asarray(mean), x64.mean(axis=1), rtol=1e-6, atol=1e-6)
      var = x64.var(axis=1)
    np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(var + EPS), rtol=1e-6)
    # norm_apply_reference with the reference's statistics is the same y.
    y2 = jax.jit(lambda x, g, b, mu, rs: nrm.norm_apply_reference(
        x, g, b, mu, rs, zero_centered_gamma=zc))(x, gamma, beta, mean, rstd)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y), err_msg=tag)


@pytest.mark.parametrize("norm_type,zc", NORMS)
def test_backward_reference_is_the_gradient(norm_type, zc):
  """The closed form == jax.vjp of the forward (statistics differentiated too)."""
  x = _rand(2, (M, H), 2.0, 0.3)
  dy = _rand(3, (M, H))
  gamma, beta = _params(norm_type, zc, H)

  def run(x, gamma, beta, dy):
    fwd = lambda x, g, b: nrm.norm_forward_reference(
        x, g, b, norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc)
    (_, mean, rstd) = fwd(x, gamma, beta)
    got = nrm.norm_backward_reference(dy, x, gamma, mean, rstd, norm_type=norm_type,
                                      zero_centered_gamma=zc)
    want = jax.vjp(lambda x, g, b: fwd(x, g, b)[0], x, gamma, beta)[1](dy)
    return got, want

  got, want = jax.jit(run)(x, gamma, beta, dy)
  assert (got[2] is None) == (norm_type == "rmsnorm")
  for g, w, name in zip(got, want, ("dx", "dgamma", "dbeta")):
    if w is None:
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, name
    scale = float(np.max(np.abs(np.asarray(w))))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * scale,
                               err_msg=name)


def test_backward_reference_dtypes():
  """dx in x's dtype, dgamma/dbeta in gamma's; dy may come in another dtype."""
  x = _rand(4, (M, H), dtype=BF16)
  gamma, beta = _params("layernorm", False, H, dtype=BF16)
  _, mean, rstd = nrm.norm_forward_reference(x, gamma, beta, norm_type="layernorm",
                                             epsilon=EPS, zero_centered_gamma=False)
  dx, dg, db = nrm.norm_backward(_rand(5, (M, H)), x, gamma, mean, rstd,
                                 norm_type="layernorm", zero_centered_gamma=False,
                                 impl="reference")
  assert dx.dtype == BF16 and dg.dtype == BF16 and db.dtype == BF16


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("which", ["dy_add", "dx_add"])
def test_backward_adds(dtype, which):
  """norm_backward(dy, dy_add=e) is norm_backward(dy + e) bit for bit, the
  sum in dy's dtype (a normalized output with two uses: its gradients);
  with dx_add=e its dx is the dx without e, rounded to x's dtype, plus e
  (an add of the two arrays: a residual connection's cotangent), dgamma and
  dbeta unchanged."""
  x = _rand(4, (M, H), 2.0, 0.3, dtype)
  dy, e = _rand(5, (M, H), dtype=dtype), _rand(6, (M, H), dtype=dtype)
  for norm_type, zc in NORMS:
    gamma, beta = _params(norm_type, zc, H)
    _, mean, rstd = nrm.norm_forward_reference(x, gamma, beta, norm_type=norm_type,
                                               epsilon=EPS, zero_centered_gamma=zc)
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc, impl="reference")
    got = nrm.norm_backward(dy, x, gamma, mean, rstd, **{which: e}, **kw)
    apart = nrm.norm_backward(dy, x, gamma, mean, rstd, **kw)
    if which == "dy_add":
      want = nrm.norm_backward(dy + e, x, gamma, mean, rstd, **kw)
    else:
      want = (apart[0] + e,) + tuple(apart[1:])
    for g, w in zip(got, want):
      assert (g is None) == (w is None)
      if g is not None:
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(apart[0]))  # e is not dropped


def test_norm_dense_hands_the_norm_outputs_gradient_to_the_norm_backward(gpu_host):  # pylint: disable=unused-argument
  """With return_norm_output (a query projection whose normalized input the
  keys and values also read), the CUDA program's norm backward takes that
  output's gradient as its dy_add: no separate add pass over (M, K) before it."""
  r = RECIPES["delayed"]()
  x, gamma, beta, kernel, _ = _dense_args("rmsnorm", False, BF16, bias=False)

  def loss(x, gamma, kernel):
    y, ln = norm_dense.fp8_norm_dense(x, gamma, None, kernel, norm_type="rmsnorm", epsilon=EPS,
                                      zero_centered_gamma=False, recipe=r,
                                      fp8_state=_state(r), return_norm_output=True)
    return jnp.sum(y.astype(F32)) + jnp.sum(jnp.square(ln.astype(F32)))
  text = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, gamma, kernel)
  calls = [line for line in text.splitlines() if "custom_call @te_jax_norm_backward(" in line]
  assert len(calls) == 1, calls
  operands = re.findall(r"tensor<([^>]*)>", calls[0].rsplit(" : (", 1)[1].split(") -> (")[0])
  assert operands[:4] == [f"{DM}x{DK}xbf16"] * 2 + ["0x0xbf16", f"{DM}x{DK}xbf16"], \
      operands   # dy, dy_add, no dx_add, x


@pytest.mark.parametrize("h,expected", [(8, 1056), (1024, 1056), (1536, 660), (2048, 528),
                                         (4096, 264), (6144, 132), (8192, 132)])
def test_norm_backward_grid_fills_the_sms_by_block_width(h, expected):
  """The backward kernel's grid: as many h/8-thread blocks as fit in 132 SMs of 1024
  threads (at most 8 per SM), and never more blocks than rows."""
  assert normalization_cuda.backward_blocks(100_000, h) == expected
  threads = -(-h // 256) * 32      # one thread per 8 columns, whole warps
  per_sm = expected // 132
  assert expected == 132 * per_sm and per_sm * threads <= 1024   # all resident at once
  assert per_sm == 8 or (per_sm + 1) * threads > 1024             # and no SM left half idle
  assert normalization_cuda.backward_blocks(7, h) == 7
  assert normalization_cuda.backward_blocks(1, h) == 1


@pytest.mark.parametrize("blocks", [0, 65536, 2.0, True])
def test_norm_backward_grid_override_is_checked_at_trace_time(blocks):
  x = jnp.zeros((4, 256), BF16)
  with pytest.raises(ValueError, match=r"blocks must be an int in \[1, 65535\]"):
    jax.eval_shape(lambda x: normalization_cuda.norm_backward(
        x, x, jnp.ones((256,), F32), None, jnp.ones((4,), F32), False, blocks=blocks), x)


@pytest.mark.parametrize("mode", nrm.MODES)
def test_quantize_reference_is_quantize_by_mode(mode):
  x = _rand(6, (M, H), 2.0, -0.2, BF16)
  for k, (norm_type, zc) in enumerate(NORMS):
    gamma, beta = _params(norm_type, zc, H, seed=7 + k)
    dtype = (E4M3, E5M2)[k % 2]
    kw = dict(mode=mode, dtype=dtype, power_2_scale=mode == "blockwise" and k < 2)
    y, mean, rstd = nrm.norm_forward_reference(x, gamma, beta, norm_type=norm_type,
                                               epsilon=EPS, zero_centered_gamma=zc)
    if mode == "tensorwise":   # saturates the top of the range
      kw["scale"] = quantize_op.compute_scale(jnp.max(jnp.abs(y)) / 2, dtype)
    q, mean2, rstd2 = nrm.norm_quantize(x, gamma, beta, norm_type=norm_type, epsilon=EPS,
                                        zero_centered_gamma=zc, impl="reference", **kw)
    want = quantize_op.quantize_by_mode_reference(y, mode, jnp.dtype(dtype), kw.get("scale"),
                                                  kw["power_2_scale"])
    tag = f"{mode} {norm_type} zc={zc}"
    _assert_q_equal(q, want, tag)
    assert q.data.shape == (M, H) and q.data_t.shape == (H, M), tag
    assert (mean2 is None) == (norm_type == "rmsnorm"), tag
    np.testing.assert_array_equal(np.asarray(rstd2), np.asarray(rstd), err_msg=tag)
    # And it is an FP8 rounding of y (clipped where the given scale saturates).
    deq = np.asarray(q.rowwise().dequantize(), np.float64)
    yy = np.asarray(y, np.float64)
    if mode == "tensorwise":
      top = (448.0 if dtype == E4M3 else 57344.0) / float(kw["scale"])
      yy = np.clip(yy, -top, top)
    assert rel(deq, yy) < (0.04 if dtype == E4M3 else 0.08), (tag, rel(deq, yy))


def test_quantize_fused_protocol_works_for_every_recipe():
  """ScalingMode.quantize_fused(norm_quantize, "x", ...) maps each recipe to a mode."""
  x = _rand(8, (128, 256), dtype=BF16)
  gamma, beta = _params("layernorm", False, 256)
  for name, make in sorted(RECIPES.items()):
    r = make()
    mode = r.scaling_mode()
    st = mode.init_state()
    q, mean, rstd = mode.quantize_fused(nrm.norm_quantize, "x", st, impl="reference", x=x,
                                        gamma=gamma, beta=beta, norm_type="layernorm",
                                        epsilon=EPS, zero_centered_gamma=False)
    y = nrm.norm_forward_reference(x, gamma, beta, norm_type="layernorm", epsilon=EPS,
                                   zero_centered_gamma=False)[0]
    # The same as quantizing y itself with the mode.
    _assert_q_equal(q, mode.quantize(y, "x", st, impl="reference"), name)
    assert mean.shape == rstd.shape == (128,)


def _select_kw(mode, dtype=E4M3):
  kw = dict(mode=mode, dtype=dtype, power_2_scale=mode == "blockwise")
  if mode == "tensorwise":
    kw["scale"] = jnp.float32(5.0)
  return kw


def _check_copies(both, got, rowwise, columnwise, mode, what):
  """``got`` holds ``both``'s selected copies bit for bit and None elsewhere
  (the per-tensor scale_inv, both copies' one scale, stays)."""
  want = both.replace(
      data=both.data if rowwise else None,
      scale_inv=both.scale_inv if rowwise or mode != "blockwise" else None,
      data_t=both.data_t if columnwise else None,
      scale_inv_t=both.scale_inv_t if columnwise else None)
  _assert_q_equal(got, want, what)


@pytest.mark.parametrize("mode", nrm.MODES)
def test_selected_copies_and_quantizing_again_from_the_statistics(mode):
  """One copy is that copy of both; norm_quantize_with_stats with the
  forward's statistics (and amax) gives the forward's bytes, every copy
  selection, without computing statistics."""
  x = _rand(16, (M, H), 2.0, -0.2, BF16)
  for k, (norm_type, zc) in enumerate(NORMS):
    gamma, beta = _params(norm_type, zc, H, seed=17 + k)
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc, impl="reference",
              **_select_kw(mode))
    both, mean, rstd = nrm.norm_quantize(x, gamma, beta, epsilon=EPS, **kw)
    tag = f"{mode} {norm_type} zc={zc}"
    amax = both.amax if mode != "blockwise" else None
    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
      if not (rowwise and columnwise):
        got, mean2, rstd2 = nrm.norm_quantize(x, gamma, beta, epsilon=EPS, rowwise=rowwise,
                                              columnwise=columnwise, **kw)
        _check_copies(both, got, rowwise, columnwise, mode, f"{tag} {rowwise} {columnwise}")
        np.testing.assert_array_equal(np.asarray(rstd2), np.asarray(rstd), err_msg=tag)
      again = nrm.norm_quantize_with_stats(x, gamma, beta, mean, rstd, amax=amax,
                                           rowwise=rowwise, columnwise=columnwise, **kw)
      _check_copies(both, again, rowwise, columnwise, mode, f"{tag} again {rowwise} {columnwise}")


def test_quantizing_again_argument_errors():
  x = _rand(18, (M, H), dtype=BF16)
  gamma, beta = _params("layernorm", False, H)
  _, mean, rstd = nrm.norm_forward_reference(x, gamma, beta, norm_type="layernorm",
                                             epsilon=EPS, zero_centered_gamma=False)
  base = dict(x=x, gamma=gamma, beta=beta, mean=mean, rstd=rstd, norm_type="layernorm",
              zero_centered_gamma=False, mode="current", dtype=E4M3, amax=jnp.float32(2.0))
  again = lambda **kw: nrm.norm_quantize_with_stats(**{**base, **kw})
  with pytest.raises(ValueError, match="mode='current' with given statistics needs amax"):
    again(amax=None)
  with pytest.raises(ValueError, match="amax must be None for mode='blockwise'"):
    again(mode="blockwise")
  with pytest.raises(TypeError, match="amax must be a float32 scalar"):
    again(amax=jnp.ones((2,)))
  with pytest.raises(ValueError, match="rstd must be float32"):
    again(rstd=rstd[:-1])
  with pytest.raises(ValueError, match="mean must be float32"):
    again(mean=None)
  with pytest.raises(ValueError, match="both False"):
    again(rowwise=False, columnwise=False)
  with pytest.raises(ValueError, match="both False"):
    nrm.norm_quantize(x, gamma, beta, norm_type="layernorm", epsilon=EPS,
                      zero_centered_gamma=False, mode="current", dtype=E4M3,
                      rowwise=False, columnwise=False)


def _norm_calls(text):
  """(operand types, result types) of each norm_quantize custom call."""
  calls = []
  for line in text.splitlines():
    if re.search(r"custom_call @te_jax_norm_quantize_\w+\(", line):
      operands, results = line.rsplit(" : (", 1)[1].split(") -> (")
      calls.append((re.findall(r"tensor<([^>]*)>", operands),
                    re.findall(r"tensor<([^>]*)>", results)))
  return calls


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_fp8_norm_dense_backward_quantizes_from_the_forwards_statistics(gpu_host, rname):  # pylint: disable=unused-argument
  """The CUDA program of fp8_norm_dense's forward and backward (lowered
  without a GPU): the forward's norm call writes the rowwise copy and the
  statistics; the backward's takes those statistics (no statistics pass)
  and writes the columnwise copy alone."""
  r = RECIPES[rname]()
  x, gamma, beta, kernel, _ = _dense_args("layernorm", False, BF16, bias=False)
  st = _state(r)

  def step(x, gamma, beta, kernel):
    return jax.value_and_grad(lambda *a: jnp.sum(norm_dense.fp8_norm_dense(
        *a[:3], a[3], norm_type="layernorm", epsilon=EPS, zero_centered_gamma=False,
        recipe=r, fp8_state=st).astype(F32)), argnums=(0, 1, 2, 3))(x, gamma, beta, kernel)
  calls = _norm_calls(cuda_text(step, x, gamma, beta, kernel))
  assert len(calls) == 2, calls
  (fwd_ops, fwd_res), (bwd_ops, bwd_res) = calls
  fp8 = lambda res: [t for t in res if "xf8" in t]
  assert fp8(fwd_res) == [f"{DM}x{DK}xf8E4M3FN", "0x0xf8E4M3FN"], fwd_res
  assert fp8(bwd_res) == ["0x0xf8E4M3FN", f"{DK}x{DM}xf8E4M3FN"], bwd_res
  assert fwd_res[-2:] == [f"{DM}xf32", f"{DM}xf32"] and bwd_res[-2:] == ["0xf32", "0xf32"]
  assert bwd_ops[-2:] == [f"{DM}xf32", f"{DM}xf32"] and fwd_ops[-2:] == ["0xf32", "0xf32"]


def test_argument_errors():
  x = _rand(9, (M, H), dtype=BF16)
  gamma, beta = _params("layernorm", False, H)
  base = dict(x=x, gamma=gamma, beta=beta, norm_type="layernorm", epsilon=EPS,
              zero_centered_gamma=False, mode="current", dtype=E4M3)
  fwd = lambda **kw: nrm.norm_quantize(**{**base, **kw})
  with pytest.raises(ValueError, match="norm_type must be one of"):
    fwd(norm_type="batchnorm")
  for eps in (-1.0, "1e-6", True, float("nan"), jnp.float32(1e-6)):
    with pytest.raises(TypeError, match="epsilon must be a finite Python float"):
      fwd(epsilon=eps)
  with pytest.raises(TypeError, match="zero_centered_gamma must be a Python bool"):
    fwd(zero_centered_gamma=1)
  with pytest.raises(ValueError, match=r"gamma must have shape \(200,\)"):
    fwd(gamma=gamma[:-1])
  with pytest.raises(ValueError, match=r"beta must have shape \(200,\)"):
    fwd(beta=jnp.zeros((3,)))
  with pytest.raises(ValueError, match="beta must be None for norm_type='rmsnorm'"):
    fwd(norm_type="rmsnorm")
  with pytest.raises(ValueError, match="x must be 2-D"):
    fwd(x=x[0])
  with pytest.raises(TypeError, match="x must be a float32"):
    fwd(x=x.astype(jnp.int32))
  with pytest.raises(TypeError, match="gamma must be a float32"):
    fwd(gamma=gamma.astype(jnp.int32))
  with pytest.raises(ValueError, match="mode='tensorwise' needs scale"):
    fwd(mode="tensorwise")
  with pytest.raises(ValueError, match="power_2_scale applies"):
    fwd(power_2_scale=True)
  with pytest.raises(TypeError, match="dtype must be"):
    fwd(dtype=BF16)
  with pytest.raises(ValueError, match="impl must be one of"):
    fwd(impl="triton")
  _, mean, rstd = nrm.norm_forward_reference(x, gamma, beta, norm_type="layernorm",
                                             epsilon=EPS, zero_centered_gamma=False)
  bwd = lambda **kw: nrm.norm_backward(**{**dict(
      dy=x, x=x, gamma=gamma, mean=mean, rstd=rstd, norm_type="layernorm",
      zero_centered_gamma=False), **kw})
  with pytest.raises(ValueError, match="dy must have x's shape"):
    bwd(dy=x[:-1])
  with pytest.raises(ValueError, match="dy_add must have dy's shape"):
    bwd(dy_add=x[:-1])
  with pytest.raises(ValueError, match="dy_add must have dy's shape .* and dtype"):
    bwd(dy_add=x.astype(F32))
  with pytest.raises(ValueError, match="dx_add must have x's shape"):
    bwd(dx_add=x[:-1])
  with pytest.raises(ValueError, match="dx_add must have x's shape .* and dtype"):
    bwd(dx_add=x.astype(F32))
  with pytest.raises(ValueError, match="mean must be float32"):
    bwd(mean=None)
  with pytest.raises(ValueError, match="mean must be None for norm_type='rmsnorm'"):
    bwd(norm_type="rmsnorm")
  with pytest.raises(ValueError, match="rstd must be float32"):
    bwd(rstd=rstd.astype(BF16))
  with pytest.raises(ValueError, match="rstd must be float32"):
    bwd(rstd=rstd[:-1])


def test_cuda_shape_support(monkeypatch):
  assert nrm.norm_supported(200, 4096) and nrm.norm_supported(1, 8192)
  assert nrm.norm_supported(7, 100)                 # any shape up to the limits
  assert not nrm.norm_supported(128, 8200)          # the backward's limit
  assert not nrm.norm_supported(65535 * 128 + 1, 128)
  assert not nrm.norm_supported(0, 128) and not nrm.norm_supported(128, True)
  # With the CUDA path chosen, an unsupported shape is a ValueError at trace
  # time, also under jit where "auto" traces the CUDA branch.
  monkeypatch.setattr(nrm._native, "resolve_impl", lambda impl: "cuda")
  x = jnp.zeros((16, 8200), BF16)
  with pytest.raises(ValueError, match="norm_supported"):
    jax.jit(lambda x: nrm.norm_quantize(
        x, jnp.ones(8200), None, norm_type="rmsnorm", epsilon=EPS,
        zero_centered_gamma=False, mode="current", dtype=E4M3))(x)
  with pytest.raises(ValueError, match="norm_supported"):
    nrm.norm_backward(x, x, jnp.ones(8200), None, jnp.ones(16), norm_type="rmsnorm",
                      zero_centered_gamma=False, impl="cuda")


# ------------------------------------------------- fp8_norm_dense, fp8_mlp ---

DM, DK, DN = 256, 256, 384


def _dense_args(norm_type, zc, dtype=F32, bias=True):
  x = _rand(10, (DM, DK), 2.0, 0.3, dtype)
  gamma, beta = _params(norm_type, zc, DK, seed=11)
  kernel = _rand(13, (DK, DN), 0.06)
  b = _rand(14, (DN,), 0.1) if bias else None
  return x, gamma, beta, kernel, b


def _check_grads(g1, g0, tol, what):
  for i, (a, b) in enumerate(zip(g1, g0)):
    assert (a is None) == (b is None), (what, i)
    for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert la.dtype == lb.dtype and la.shape == lb.shape, (what, i)
      if np.any(np.asarray(lb, np.float64)):
        assert rel(la, lb) <= tol, (what, i, rel(la, lb))
      else:
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("norm_type,zc,bias,ret", [("layernorm", False, True, False),
                                                   ("rmsnorm", True, False, True),
                                                   ("layernorm", True, False, True)])
def test_norm_dense_matches_unfused(rname, norm_type, zc, bias, ret):
  """float32 input: both paths quantize the same float32 norm output, so the
  forward is bit-identical; the gradients differ by the norm's backward (the
  closed form vs autodiff): float32 rounding only. The FP8 state's update too."""
  r = RECIPES[rname]()
  x, gamma, beta, kernel, b = _dense_args(norm_type, zc, bias=bias)
  st = _state(r)
  cot = _rand(15, (DM, DN))
  if ret:
    cot = (cot, _rand(16, (DM, DK), 0.5))

  def fused(x, gamma, beta, kernel, b, st):
    return norm_dense.fp8_norm_dense(x, gamma, beta, kernel, b, norm_type=norm_type,
                                     epsilon=EPS, zero_centered_gamma=zc, recipe=r,
                                     fp8_state=st, impl="reference", return_norm_output=ret)

  def unfused(x, gamma, beta, kernel, b, st):
    ln = apply_norm(x, gamma, beta, norm_type=norm_type, epsilon=EPS,
                    zero_centered_gamma=zc, dtype=x.dtype)
    y = dense.fp8_dense(ln, kernel, b, recipe=r, fp8_state=st, impl="reference")
    return (y, ln) if ret else y

  args = (x, gamma, beta, kernel, b, st)
  y1, g1 = vjp_run(fused, args, cot)
  y0, g0 = vjp_run(unfused, args, cot)
  for a, c in zip(jax.tree.leaves(y1), jax.tree.leaves(y0)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  _check_grads(g1[:5], g0[:5], 1e-6, rname)
  if st is not None:   # the state's update: exact for every role
    jax.tree.map(lambda a, c: np.testing.assert_array_equal(np.asarray(a), np.asarray(c)),
                 g1[5], g0[5])


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_norm_dense_bf16_within_fp8_tolerance(rname):
  """bfloat16 input and output: the unfused path rounds the norm output to
  bfloat16 first, which moves some FP8 roundings by a step; both are within
  the FP8 tolerances of a float32 reference, and close to each other."""
  r = RECIPES[rname]()
  x, gamma, beta, kernel, b = _dense_args("layernorm", False, BF16)
  st = _state(r)
  cot = _rand(17, (DM, DN), dtype=BF16)

  def fused(x, gamma, beta, kernel, b, st):
    return norm_dense.fp8_norm_dense(x, gamma, beta, kernel, b, norm_type="layernorm",
                                     epsilon=EPS, zero_centered_gamma=False, recipe=r,
                                     fp8_state=st, impl="reference")

  def exact(x, gamma, beta, kernel, b, st):
    del st
    ln = apply_norm(x, gamma, beta, norm_type="layernorm", epsilon=EPS,
                    zero_centered_gamma=False, dtype=F32)
    return ln @ kernel + b

  y1, g1 = vjp_run(fused, (x, gamma, beta, kernel, b, st), cot)
  y0, g0 = vjp_run(exact, (x, gamma, beta, kernel, b, st), cot.astype(F32))
  assert y1.dtype == BF16 and g1[0].dtype == BF16
  assert 1e-4 < rel(y1, y0) < FWD_TOL, rel(y1, y0)
  for i in range(5):
    assert rel(g1[i], g0[i]) < GRAD_TOL, (i, rel(g1[i], g0[i]))


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("norm_type,zc", [("layernorm", False), ("rmsnorm", True)])
def test_fused_mlp_with_norm_matches_unfused(rname, norm_type, zc):
  """fp8_mlp(norm=...) == apply_norm then fp8_mlp: forward bit for bit (float32
  input), gradients and both FP8 states to float32 accuracy."""
  r = RECIPES[rname]()
  m, k, f = 256, 128, 256
  x = _rand(18, (m, k), 2.0, 0.3)
  gamma, beta = _params(norm_type, zc, k, seed=19)
  wi = _rand(21, (k, 2 * f), 0.09)
  wo = _rand(22, (f, k), 0.06)
  si, so = _state(r), _state(r, 0.5)
  cot = (_rand(23, (m, k)), _rand(24, (m, k), 0.3))

  def fused(x, gamma, beta, wi, wo, si, so):
    return fused_mlp.fp8_mlp(x, wi, wo, activations=("silu", "linear"), recipe=r,
                             wi_state=si, wo_state=so, impl="reference",
                             norm=norm_dense.NormParams(gamma, beta, norm_type, EPS, zc),
                             return_norm_output=True)

  def unfused(x, gamma, beta, wi, wo, si, so):
    ln = apply_norm(x, gamma, beta, norm_type=norm_type, epsilon=EPS,
                    zero_centered_gamma=zc, dtype=x.dtype)
    return fused_mlp.fp8_mlp(ln, wi, wo, activations=("silu", "linear"), recipe=r,
                             wi_state=si, wo_state=so, impl="reference"), ln

  args = (x, gamma, beta, wi, wo, si, so)
  y1, g1 = vjp_run(fused, args, cot)
  y0, g0 = vjp_run(unfused, args, cot)
  for a, c in zip(y1, y0):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  _check_grads(g1[:5], g0[:5], 1e-6, rname)
  if si is not None:
    jax.tree.map(lambda a, c: np.testing.assert_array_equal(np.asarray(a), np.asarray(c)),
                 g1[5:], g0[5:])


def test_norm_dense_bad_arguments():
  r = recipe.Float8CurrentScaling()
  x, gamma, beta, kernel, b = _dense_args("layernorm", False)
  call = lambda **kw: norm_dense.fp8_norm_dense(**{**dict(
      x=x, gamma=gamma, beta=beta, kernel=kernel, bias=b, norm_type="layernorm",
      epsilon=EPS, zero_centered_gamma=False, recipe=r), **kw})
  with pytest.raises(ValueError, match=r"tokens % 16 == 0 and hidden % 128 == 0"):
    call(x=x[:100])
  with pytest.raises(ValueError, match="got 256 tokens, hidden 200"):
    call(x=x[:, :200], gamma=gamma[:200], beta=beta[:200], kernel=kernel[:200])
  with pytest.raises(ValueError, match=r"tokens % 128 == 0"):
    call(x=x[:144], recipe=recipe.Float8BlockScaling())
  with pytest.raises(ValueError, match="must agree on K"):
    call(kernel=kernel[:128])
  with pytest.raises(ValueError, match=r"bias must have shape \(384,\)"):
    call(bias=b[:3])
  with pytest.raises(ValueError, match="norm_type must be one of"):
    call(norm_type="groupnorm")
  with pytest.raises(TypeError, match="recipe"):
    call(recipe="current")
  with pytest.raises(ValueError, match="DelayedScaling needs fp8_state"):
    call(recipe=recipe.DelayedScaling())
  with pytest.raises(ValueError, match="fp8_state must be None"):
    call(fp8_state=fp8_state.init_dense_state(4))
  assert norm_dense.supported(256, 256, r) and not norm_dense.supported(256, 8320, r)
  wi, wo = kernel[:, :128], kernel[:128, :256]   # K 256, F 128, N 256
  with pytest.raises(ValueError, match="return_norm_output=True needs a norm"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r, return_norm_output=True)
  with pytest.raises(ValueError, match=r"fp8_mlp takes M % 16"):
    fused_mlp.fp8_mlp(x[:100], wi, wo, activations=("gelu",), recipe=r,
                      norm=norm_dense.NormParams(gamma, beta, "layernorm", EPS, False))


# ------------------------------------------------------------ Flax modules ---

def _spy(monkeypatch):
  """Counts fused-norm calls: fp8_norm_dense, and fp8_mlp with a norm."""
  calls = []
  real_nd, real_mlp = norm_dense.fp8_norm_dense, fused_mlp.fp8_mlp
  monkeypatch.setattr(norm_dense, "fp8_norm_dense",
                      lambda *a, **k: calls.append("dense") or real_nd(*a, **k))
  monkeypatch.setattr(fused_mlp, "fp8_mlp", lambda *a, **k: (
      calls.append("mlp" if k.get("norm") is not None else "mlp-unnormed"))
      or real_mlp(*a, **k))
  return calls


def _module_grads(m, v, x, r, cot):
  def loss(v, x):
    out = m.apply(v, x)
    out = out if isinstance(out, tuple) else (out,)
    return sum(jnp.sum(o.astype(F32) * c) for o, c in zip(out, cot))
  with te_jax.fp8_autocast(True, r):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v, x)


MODULES = {
    "dense": lambda **kw: tfx.LayerNormDenseGeneral(features=(2, 128), use_bias=True, **kw),
    "mlp": lambda **kw: tfx.LayerNormMLP(intermediate_dim=256, activations=("gelu",),
                                         use_bias=True, **kw),
}


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("which", sorted(MODULES))
@pytest.mark.parametrize("norm_type,ret", [("layernorm", False), ("rmsnorm", True)])
def test_modules_take_the_fused_norm(rname, which, norm_type, ret, monkeypatch):
  r = RECIPES[rname]()
  m = MODULES[which](layernorm_type=norm_type, return_layernorm_output=ret,
                     zero_centered_gamma=norm_type == "rmsnorm")
  x = _rand(30, (2, 128, 128), 2.0, 0.3)
  with te_jax.fp8_autocast(True, r):
    v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
  # The same parameters as a module initialized with FP8 off (the unfused path).
  v_off = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
  assert jax.tree.structure(v_off["params"]) == jax.tree.structure(v["params"])
  for a, b in zip(jax.tree.leaves(v_off["params"]), jax.tree.leaves(v["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  v["params"]["scale"] = v["params"]["scale"] + _rand(31, (128,), 0.1)
  out_shape = (2, 128, 2, 128) if which == "dense" else (2, 128, 128)
  cot = (_rand(32, out_shape),) + ((_rand(33, (2, 128, 128), 0.5),) if ret else ())

  calls = _spy(monkeypatch)
  l1, g1 = _module_grads(m, v, x, r, cot)
  assert calls and all(c in ("dense", "mlp") for c in calls), calls
  calls.clear()
  monkeypatch.setattr(norm_dense, "supported", lambda *a, **k: False)
  l0, g0 = _module_grads(m, v, x, r, cot)
  assert "dense" not in calls and "mlp" not in calls, calls
  # float32 input and compute: the same FP8 operands; the norm's backward in
  # another form (float32 rounding).
  assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0)), (float(l1), float(l0))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1[0]["params"]),
                          jax.tree.leaves(g0[0]["params"])):
    assert rel(a, b) < 1e-5, (path, rel(a, b))
  assert rel(g1[1], g0[1]) < 1e-5
  if r.scaling_mode().uses_state:   # the same state variables, the same update
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 g1[0][COLL], g0[0][COLL])
  else:
    assert COLL not in g1[0]


@pytest.mark.parametrize("which", sorted(MODULES))
def test_modules_fuse_norm_quantize_false_keeps_the_xla_norm(which, monkeypatch, caplog):
  """The opt-out: no fused norm, no log about it, and the same result as the
  fused path up to the norm's float32 rounding (the unfused path quantizes
  the compute-dtype norm output, here float32 too)."""
  fused_norm.log_unfused_norm.cache_clear()
  caplog.set_level(logging.INFO, logger="te_jax")
  r = recipe.Float8CurrentScaling()
  x = _rand(34, (2, 128, 128), 2.0, 0.3)
  fused_m, xla_m = MODULES[which](), MODULES[which](fuse_norm_quantize=False)
  with te_jax.fp8_autocast(True, r):
    v = nn.unbox(jax.jit(fused_m.init)(jax.random.key(1), x))
  out_shape = (2, 128, 2, 128) if which == "dense" else (2, 128, 128)
  cot = (_rand(35, out_shape),)
  calls = _spy(monkeypatch)
  l0, g0 = _module_grads(xla_m, v, x, r, cot)
  assert "dense" not in calls and "mlp" not in calls, calls
  assert "quantizes its normalized input in a separate pass" not in caplog.text, caplog.text
  if which == "mlp":   # still the fused activation core, without the norm
    assert "mlp-unnormed" in calls, calls
  calls.clear()
  l1, g1 = _module_grads(fused_m, v, x, r, cot)
  assert calls and all(c in ("dense", "mlp") for c in calls), calls
  assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0)), (float(l1), float(l0))
  assert rel(g1[1], g0[1]) < 1e-5


def _unfused_reason(m, x, r, caplog, calls, init_recipe=None):
  """Applies m (initialized under init_recipe, default r) under r; returns the
  log text. Asserts the fused norm did not run."""
  caplog.clear()
  # Jitted: tracing is where the modules choose (and log); op by op the
  # fused FP8 paths took ~17 s on a CPU.
  with te_jax.fp8_autocast(True, init_recipe or r):
    v = nn.unbox(jax.jit(m.init)(jax.random.key(0), x))
  calls.clear()
  with te_jax.fp8_autocast(True, r):
    g = jax.jit(jax.grad(lambda v: jnp.sum(jax.tree.leaves(m.apply(v, x))[0])))(v)
  assert "dense" not in calls and "mlp" not in calls, calls
  return caplog.text, v, g


def test_modules_fall_back_and_say_why(monkeypatch, caplog):
  fused_norm.log_unfused_norm.cache_clear()
  fused_norm.log_xla_norm.cache_clear()
  caplog.set_level(logging.INFO, logger="te_jax")
  calls = _spy(monkeypatch)
  r = recipe.Float8CurrentScaling()
  dense_m, mlp_m = MODULES["dense"](), MODULES["mlp"]()
  text = _unfused_reason(dense_m, _rand(40, (2, 100, 128)), r, caplog, calls)[0]
  assert ("LayerNormDenseGeneral quantizes its normalized input in a separate pass" in text
          and "200 tokens, embed 128" in text), text
  text = _unfused_reason(dense_m, _rand(41, (2, 128, 192)), r, caplog, calls)[0]
  assert "embed % 128 == 0" in text, text
  # The MLP's fused core runs, but embed is beyond the norm kernels' limit.
  text = _unfused_reason(mlp_m, _rand(43, (1, 16, 8320)), r, caplog, calls)[0]
  assert ("LayerNormMLP quantizes its normalized input in a separate pass" in text
          and "embed <= 8192" in text), text
  # ... and neither do te_jax's unquantized norm kernels: XLA normalizes.
  assert "LayerNormMLP normalizes in XLA (not te_jax's norm kernels)" in text, text
  assert "hidden <= 8192" in text, text
  assert "mlp-unnormed" in calls
  # State of another recipe in the variables: the unfused path keeps it as is.
  for m in (dense_m, mlp_m):
    text, v, g = _unfused_reason(m, _rand(42, (2, 128, 128)), r, caplog, calls,
                                 recipe.DelayedScaling(amax_history_len=4))
    assert "holds FP8 state that the active recipe does not use" in text, text
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 g[COLL], v[COLL])
  # Logged once per reason.
  caplog.clear()
  _unfused_reason(dense_m, _rand(41, (2, 128, 192)), r, caplog, calls)
  assert "separate pass" not in caplog.text
  x = _rand(44, (2, 128, 128))
  # FP8 off: never the fused norm, and no log about it.
  caplog.clear()
  calls.clear()
  for which, make in sorted(MODULES.items()):
    mm = make()
    mm.apply(nn.unbox(mm.init(jax.random.key(0), x)), x)
  assert not calls and "separate pass" not in caplog.text


# ---------------------------------------------------------- GPU vs ref ---

_CPU = jax.devices("cpu")[0]
# (M, H): rows not a multiple of 128 (and fewer than one tile), hidden 4096,
# 8192, and odd sizes (edge tiles, H % 8 != 0: the scalar load paths); at
# 8192 and 2048 more rows than the backward's grid (132 and 528 blocks), so a
# block strides over several rows and the last stride is partial.
_GPU_SHAPES = [(200, 4096), (1000, 8192), (2100, 2048), (72, 200), (130, 100), (256, 1024)]
_GPU_DTYPES = [BF16, F16, F32]


def _gpu_inputs(shape, dtype, norm_type, zc, seed=50):
  m, h = shape
  x = _rand(seed, (m, h), 2.0, 0.5, dtype)
  gamma, beta = _params(norm_type, zc, h, seed=seed + 1)
  return x, gamma, beta


def _on_cpu(fn, *args):
  return jax.jit(fn)(*jax.device_put(args, _CPU))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _GPU_SHAPES)
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_gpu_norm_quantize_matches_reference(shape, dtype):
  """Statistics within STATS_RTOL of the reference's; given those statistics,
  every FP8 byte, scale and amax bit for bit (norm_apply_reference is the
  kernels' formula)."""
  m, h = shape
  for k, (norm_type, zc) in enumerate(NORMS):
    x, gamma, beta = _gpu_inputs(shape, dtype, norm_type, zc, seed=50 + k)
    for mode in nrm.MODES:
      fp8 = (E4M3, E5M2)[(k + len(mode)) % 2]
      pow2 = mode == "blockwise" and k % 2 == 1
      scale = jnp.float32(7.0) if mode == "tensorwise" else None
      kw = dict(norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc, mode=mode,
                dtype=fp8, power_2_scale=pow2)
      q, mean, rstd = jax.jit(lambda x, g, b, s: nrm.norm_quantize(
          x, g, b, scale=s, impl="cuda", **kw))(x, gamma, beta, scale)
      tag = f"{shape} {jnp.dtype(dtype).name} {norm_type} zc={zc} {mode}"
      mean_r, rstd_r = _on_cpu(lambda x: nrm.norm_stats_reference(
          x, norm_type=norm_type, epsilon=EPS), x)
      np.testing.assert_allclose(np.asarray(rstd), np.asarray(rstd_r), rtol=nrm.STATS_RTOL,
                                 atol=0, err_msg=tag)
      if norm_type == "rmsnorm":
        assert mean is None, tag
      else:
        rms = np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, axis=1))
        assert np.all(np.abs(np.asarray(mean, np.float64) - np.asarray(mean_r)) <=
                      nrm.STATS_RTOL * rms), tag
      want = _on_cpu(lambda x, g, b, mu, rs, s: quantize_op.quantize_by_mode_reference(
          nrm.norm_apply_reference(x, g, b, mu, rs, zero_centered_gamma=zc), mode,
          jnp.dtype(fp8), s, pow2), x, gamma, beta, mean, rstd, scale)
      _assert_q_equal(q, want, tag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_gpu_norm_backward_dy_add_is_the_sum(dtype):
  """The kernel summing dy + dy_add as it reads them writes the bytes it
  writes given the sum (XLA's add), for every norm (the reference of the
  sum: test_backward_adds)."""
  shape = (200, 1536)
  for k, (norm_type, zc) in enumerate(NORMS):
    x, gamma, _ = _gpu_inputs(shape, dtype, norm_type, zc, seed=80 + k)
    dy, e = _rand(90 + k, shape, 1.0, 0.0, dtype), _rand(95 + k, shape, 1.0, 0.0, dtype)
    mean, rstd = _on_cpu(lambda x: nrm.norm_stats_reference(
        x, norm_type=norm_type, epsilon=EPS), x)
    args = jax.device_put((dy, e, x, gamma, mean, rstd), jax.devices()[0])
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc, impl="cuda")
    fused = jax.jit(lambda dy, e, *a: nrm.norm_backward(dy, *a, dy_add=e, **kw))(*args)
    summed = jax.jit(lambda dy, e, *a: nrm.norm_backward(dy + e, *a, **kw))(*args)
    tag = f"{jnp.dtype(dtype).name} {norm_type} zc={zc}"
    for g, w in zip(fused, summed):
      assert (g is None) == (w is None), tag
      if g is not None:
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8),
                                      err_msg=tag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_gpu_norm_backward_dx_add_is_the_sum(dtype):
  """The kernel adding dx_add (and dy_add) as it stores dx writes the bytes
  of its dx without them plus XLA's add, for every norm and an odd width."""
  for k, (norm_type, zc) in enumerate(NORMS):
    shape = ((200, 1536), (130, 1000))[k % 2]
    x, gamma, _ = _gpu_inputs(shape, dtype, norm_type, zc, seed=110 + k)
    dy, e = _rand(120 + k, shape, 1.0, 0.0, dtype), _rand(125 + k, shape, 1.0, 0.0, dtype)
    r = _rand(130 + k, shape, 1.0, 0.0, dtype)
    mean, rstd = _on_cpu(lambda x: nrm.norm_stats_reference(
        x, norm_type=norm_type, epsilon=EPS), x)
    args = jax.device_put((dy, e, r, x, gamma, mean, rstd), jax.devices()[0])
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc, impl="cuda")
    tag = f"{jnp.dtype(dtype).name} {norm_type} zc={zc}"
    for dy_add in (False, True):
      fused = jax.jit(lambda dy, e, r, *a: nrm.norm_backward(
          dy, *a, dy_add=e if dy_add else None, dx_add=r, **kw))(*args)
      apart = jax.jit(lambda dy, e, r, *a: nrm.norm_backward(
          dy, *a, dy_add=e if dy_add else None, **kw))(*args)
      want = (apart[0] + args[2],) + tuple(apart[1:])
      for g, w in zip(fused, want):
        assert (g is None) == (w is None), tag
        if g is not None:
          np.testing.assert_array_equal(np.asarray(g).view(np.uint8),
                                        np.asarray(w).view(np.uint8), err_msg=f"{tag} {dy_add}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _GPU_SHAPES)
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_gpu_norm_backward_matches_reference(shape, dtype):
  """dx within BACKWARD_RTOL of max |dx|, plus one unit in the last place of a
  16-bit dx (a float32 value a few ulps off can round the other way);
  dgamma, dbeta within float32 summation-order error of the reference's."""
  m, h = shape
  mant = {jnp.dtype(BF16): 7, jnp.dtype(F16): 10}.get(jnp.dtype(dtype))
  for k, (norm_type, zc) in enumerate(NORMS):
    x, gamma, beta = _gpu_inputs(shape, dtype, norm_type, zc, seed=60 + k)
    dy = _rand(70 + k, shape, 1.0, 0.0, (BF16, dtype)[k % 2])
    mean, rstd = _on_cpu(lambda x: nrm.norm_stats_reference(
        x, norm_type=norm_type, epsilon=EPS), x)
    args = jax.device_put((dy, x, gamma, mean, rstd), jax.devices()[0])
    kw = dict(norm_type=norm_type, zero_centered_gamma=zc)
    got = jax.jit(lambda *a: nrm.norm_backward(*a, impl="cuda", **kw))(*args)
    want = _on_cpu(lambda *a: nrm.norm_backward_reference(*a, **kw), *args)
    tag = f"{shape} {jnp.dtype(dtype).name} {norm_type} zc={zc}"
    assert (got[2] is None) == (norm_type == "rmsnorm"), tag
    dx, dx_r = np.asarray(got[0], np.float64), np.asarray(want[0], np.float64)
    assert got[0].dtype == x.dtype, tag
    bound = nrm.BACKWARD_RTOL * np.max(np.abs(dx_r))
    if mant is not None:   # the spacing of the 16-bit values at |dx_r|
      bound = bound + 2.0 ** (np.floor(np.log2(np.maximum(np.abs(dx_r), 1e-30))) - mant)
    assert np.all(np.abs(dx - dx_r) <= bound), (tag, float(np.max(np.abs(dx - dx_r) - bound)))
    xhat = (np.asarray(x, np.float64) - (0 if mean is None else np.asarray(mean)[:, None])) \
        * np.asarray(rstd)[:, None]
    terms = {1: np.abs(np.asarray(dy, np.float64) * xhat).sum(0),
             2: np.abs(np.asarray(dy, np.float64)).sum(0)}
    for i in (1, 2):
      if want[i] is None:
        continue
      err = np.abs(np.asarray(got[i], np.float64) - np.asarray(want[i], np.float64))
      assert np.all(err <= 1e-5 * terms[i] + 1e-30), (tag, i, float(np.max(err)))


@pytest.mark.gpu
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_gpu_norm_dense_and_mlp_match_reference(rname):
  """The layers on the CUDA path vs the reference path on the CPU (bf16):
  same operands up to the statistics' ulps and the GEMMs' accumulation, < 1%
  (2% for gamma and beta: sums over the tokens of dy * xhat and dy, which
  cancel, so the one-step FP8 differences in dy weigh more; 1.02% measured
  on the H200 for gamma with current scaling)."""
  r = RECIPES[rname]()
  x = _rand(80, (256, 1024), 2.0, 0.3, BF16)
  gamma, beta = _params("layernorm", False, 1024, seed=81)
  kernel = _rand(82, (1024, 512), 0.03)
  wi, wo = _rand(83, (1024, 1024), 0.03), _rand(84, (512, 1024), 0.04)
  st = _state(r)
  cot = _rand(85, (256, 512), dtype=BF16)
  cot_mlp = _rand(86, (256, 1024), dtype=BF16)

  def dense_fn(impl):
    return lambda x, g, b, k, s: norm_dense.fp8_norm_dense(
        x, g, b, k, norm_type="layernorm", epsilon=EPS, zero_centered_gamma=False,
        recipe=r, fp8_state=s, impl=impl)

  def mlp_fn(impl):
    return lambda x, g, b, wi, wo, s: fused_mlp.fp8_mlp(
        x, wi, wo, activations=("silu", "linear"), recipe=r, wi_state=s, wo_state=s,
        impl=impl, norm=norm_dense.NormParams(g, b, "layernorm", EPS, False))

  for fn, args, c in ((dense_fn, (x, gamma, beta, kernel, st), cot),
                      (mlp_fn, (x, gamma, beta, wi, wo, st), cot_mlp)):
    y1, g1 = vjp_run(fn("cuda"), args, c)
    y0, g0 = jax.device_put(vjp_run(fn("reference"), jax.device_put(args, _CPU),
                                     jax.device_put(c, _CPU)), jax.devices()[0])
    assert rel(y1, y0) < 1e-2, rel(y1, y0)
    for i in range(len(args) - 1):
      tol = 2e-2 if i in (1, 2) else 1e-2
      assert rel(g1[i], g0[i]) < tol, (i, rel(g1[i], g0[i]))


@pytest.mark.gpu
@pytest.mark.parametrize("which", sorted(MODULES))
def test_gpu_modules_take_the_fused_norm(which, monkeypatch):
  """On the GPU (impl "auto" -> CUDA) the modules run the fused norm; their
  result is that of the same module on the CPU reference path, < 1%."""
  r = recipe.Float8CurrentScaling()
  m = MODULES[which](dtype=BF16)
  x = _rand(90, (2, 128, 1024), 2.0, 0.3, BF16)
  with te_jax.fp8_autocast(True, r):
    v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
  calls = _spy(monkeypatch)
  out_shape = (2, 128, 2, 128) if which == "dense" else (2, 128, 1024)
  cot = (_rand(91, out_shape),)
  l1, g1 = _module_grads(m, v, x, r, cot)
  assert calls and calls[0] in ("dense", "mlp"), calls
  l0, g0 = jax.device_put(_module_grads(m, jax.device_put(v, _CPU), jax.device_put(x, _CPU),
                                        r, jax.device_put(cot, _CPU)), jax.devices()[0])
  assert abs(float(l1) - float(l0)) <= 1e-2 * abs(float(l0)) + 1e-2
  for a, b in zip(jax.tree.leaves(g1[0]["params"]), jax.tree.leaves(g0[0]["params"])):
    assert rel(a, b) < 1e-2
  assert rel(g1[1], g0[1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(200, 4096), (72, 200), (130, 100)])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gpu_selected_copies_and_quantizing_again(shape, dtype):
  """On the CUDA path: one copy is that copy of both, and quantizing again
  from the kernel's statistics (and amax) gives its bytes, bit for bit;
  those equal the reference's given the same statistics."""
  for k, (norm_type, zc) in enumerate(NORMS):
    x, gamma, beta = _gpu_inputs(shape, dtype, norm_type, zc, seed=80 + k)
    for mode in nrm.MODES:
      kw = dict(norm_type=norm_type, zero_centered_gamma=zc, **_select_kw(mode))
      tag = f"{shape} {jnp.dtype(dtype).name} {norm_type} zc={zc} {mode}"
      both, mean, rstd = jax.jit(lambda x, g, b: nrm.norm_quantize(
          x, g, b, epsilon=EPS, impl="cuda", **kw))(x, gamma, beta)
      amax = both.amax if mode != "blockwise" else None
      for rowwise, columnwise in ((True, False), (False, True)):
        got, _, rstd2 = jax.jit(lambda x, g, b: nrm.norm_quantize(
            x, g, b, epsilon=EPS, impl="cuda", rowwise=rowwise, columnwise=columnwise,
            **kw))(x, gamma, beta)
        _check_copies(both, got, rowwise, columnwise, mode, f"{tag} {rowwise} {columnwise}")
        np.testing.assert_array_equal(np.asarray(rstd2), np.asarray(rstd), err_msg=tag)
        again = jax.jit(lambda x, g, b, mu, rs, a: nrm.norm_quantize_with_stats(
            x, g, b, mu, rs, amax=a, impl="cuda", rowwise=rowwise, columnwise=columnwise,
            **kw))(x, gamma, beta, mean, rstd, amax)
        _check_copies(both, again, rowwise, columnwise, mode, f"{tag} again")
        want = _on_cpu(lambda x, g, b, mu, rs, a: nrm.norm_quantize_with_stats(
            x, g, b, mu, rs, amax=a, impl="reference", rowwise=rowwise,
            columnwise=columnwise, **kw), x, gamma, beta, mean, rstd, amax)
        _assert_q_equal(again, want, f"{tag} reference")
