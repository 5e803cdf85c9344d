"""The norm without FP8 on te_jax's kernels: ``ops.normalization.norm_stats``,
``te_jax.norm_dense.normalize`` and the modules' choice of it
(``te_jax.layers.norm.module_norm``).

CPU (CI):
  * ``normalize`` on the reference path: the output equals
    ``te_jax.layers.norm.apply_norm`` bit for bit (every norm, input and output
    dtype); its gradients (the closed-form backward) equal ``jax.vjp`` of
    ``apply_norm`` to float32 accuracy; bad arguments;
  * LayerNormMLP, LayerNormDenseGeneral and their NNX twins with FP8 off take
    it (spied) from hidden ``MIN_KERNEL_HIDDEN`` on, with the same output and
    gradients as XLA's norm; narrower ones keep XLA's silently; an active
    mesh of more than one device sends them to XLA and says why, once.
GPU (``gpu`` marker): ``norm_stats`` against the reference evaluated on the
CPU backend (rows not a multiple of 128, hidden 4096, 8192 and odd sizes,
float32/bfloat16/float16); ``normalize`` with impl "cuda" against the
reference; a module on the GPU runs the statistics and backward kernels.
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import norm_dense
from te_jax import sharding as sharding_lib
from te_jax import flax as tfx
from te_jax.layers import norm as norm_lib
from te_jax.layers.norm import apply_norm
from te_jax.ops import normalization as nrm

from flax_cases import norm_params as _params, rand as _rand, rel, vjp_run

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
EPS = 1e-6
HID = norm_lib.MIN_KERNEL_HIDDEN   # the narrowest hidden size that takes the kernels
NORMS = [("layernorm", False), ("layernorm", True), ("rmsnorm", False), ("rmsnorm", True)]


# ------------------------------------------------------------ references ---

@pytest.mark.parametrize("norm_type,zc", NORMS)
@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (BF16, BF16), (F16, F32),
                                             (F32, BF16)])
def test_normalize_reference_is_apply_norm(norm_type, zc, dtype, out_dtype):
  """Output bit for bit; dx, dgamma, dbeta to float32 accuracy (the closed
  form against autodiff of the same forward), each in its input's dtype."""
  x = _rand(1, (3, 24, 200), 2.0, 0.5, dtype)   # 72 rows, hidden not a multiple of 8
  gamma, beta = _params(norm_type, zc, 200, seed=2, dtype=BF16 if zc else F32)
  kw = dict(norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc)
  cot = _rand(4, x.shape, dtype=out_dtype)

  def ours(x, g, b):
    return norm_dense.normalize(x, g, b, dtype=out_dtype, impl="reference", **kw)

  def xla(x, g, b):
    return apply_norm(x, g, b, dtype=out_dtype, **kw)

  args = (x, gamma, beta)
  y1, g1 = vjp_run(ours, args, cot)
  y0, g0 = vjp_run(xla, args, cot)
  assert y1.dtype == jnp.dtype(out_dtype) and y1.shape == x.shape
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  for name, a, b in zip(("dx", "dgamma", "dbeta"), g1, g0):
    if b is None:
      assert a is None, name
      continue
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    # float32 (or the dx of a 16-bit x, rounded once from float32 either way).
    tol = 1e-5 if a.dtype == jnp.float32 else 2 ** -7
    assert rel(a, b) < tol, (name, rel(a, b))


def test_norm_stats_reference():
  x = _rand(5, (40, 96), 3.0, 1.0)
  mean, rstd = nrm.norm_stats(x, norm_type="layernorm", epsilon=EPS, impl="reference")
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(mean), x64.mean(1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(x64.var(1) + EPS), rtol=1e-5)
  mean, rstd = nrm.norm_stats(x, norm_type="rmsnorm", epsilon=EPS, impl="reference")
  assert mean is None
  np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt((x64 ** 2).mean(1) + EPS),
                             rtol=1e-5)


def test_bad_arguments():
  x = _rand(6, (4, 64))
  g, b = jnp.ones(64), jnp.zeros(64)
  with pytest.raises(ValueError, match="norm_type must be one of"):
    norm_dense.normalize(x, g, b, norm_type="batchnorm", epsilon=EPS)
  with pytest.raises(ValueError, match=r"gamma must have shape \(64,\)"):
    norm_dense.normalize(x, jnp.ones(63), b, norm_type="layernorm", epsilon=EPS)
  with pytest.raises(ValueError, match=r"beta must have shape \(64,\)"):
    norm_dense.normalize(x, g, jnp.zeros(32), norm_type="layernorm", epsilon=EPS)
  with pytest.raises(ValueError, match="beta must be None for norm_type='rmsnorm'"):
    norm_dense.normalize(x, g, b, norm_type="rmsnorm", epsilon=EPS)
  with pytest.raises(TypeError, match="epsilon must be a finite Python float"):
    norm_dense.normalize(x, g, b, norm_type="layernorm", epsilon=-1.0)
  with pytest.raises(TypeError, match="x must be a float32, bfloat16 or float16"):
    norm_dense.normalize(x.astype(jnp.int32), g, b, norm_type="layernorm", epsilon=EPS)
  with pytest.raises(ValueError, match="x must be 2-D"):
    nrm.norm_stats(x[0], norm_type="layernorm", epsilon=EPS)


# ---------------------------------------------------------------- modules ---

def _spy(monkeypatch):
  calls = []
  real = norm_dense.normalize
  monkeypatch.setattr(norm_dense, "normalize",
                      lambda *a, **k: calls.append(k["impl"]) or real(*a, **k))
  return calls


LINEN = {
    "dense": lambda **kw: tfx.LayerNormDenseGeneral(features=96, use_bias=True, **kw),
    "mlp": lambda **kw: tfx.LayerNormMLP(intermediate_dim=128, activations=("gelu",),
                                         **kw),
    "input_norm": lambda **kw: _InputNorm(**kw),
}


class _InputNorm(nn.Module):
  """DenseGeneral with the norm handed in (TransformerLayer's attention pre-norm)."""
  layernorm_type: str = "layernorm"

  @nn.compact
  def __call__(self, x):
    norm = tfx.NormParameters(norm_type=self.layernorm_type, name="norm")(x.shape[-1])
    return tfx.DenseGeneral(features=96, name="proj")(x, input_norm=norm)


def _grads(m, v, x, cot):
  def loss(v, x):
    return jnp.sum(m.apply(v, x).astype(F32) * cot)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v, x)


# Each module once, both norm types among them (CI time).
@pytest.mark.parametrize("which,norm_type", [("dense", "rmsnorm"), ("mlp", "layernorm"),
                                             ("input_norm", "layernorm"), ("mlp", "rmsnorm")])
def test_linen_modules_take_the_norm_kernels_with_fp8_off(which, norm_type, monkeypatch):
  m = LINEN[which](layernorm_type=norm_type)
  x = _rand(10, (2, 9, HID), 2.0, 0.3)
  v = nn.unbox(jax.jit(m.init)(jax.random.key(0), x))
  v = jax.tree.map(lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), v)
  cot = _rand(11, jax.eval_shape(m.apply, v, x).shape)
  calls = _spy(monkeypatch)
  l1, g1 = _grads(m, v, x, cot)
  assert calls == ["auto"], calls
  # XLA's norm instead: the same loss, gradients to float32 accuracy.
  calls.clear()
  monkeypatch.setattr(norm_lib, "norm_kernel_blocker", lambda *a: "forced")
  l0, g0 = _grads(m, v, x, cot)
  assert not calls
  assert float(l1) == float(l0)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
    assert rel(a, b) < 1e-5, (path, rel(a, b))


def test_narrow_norms_stay_in_xla_silently(monkeypatch, caplog):
  norm_lib.log_xla_norm.cache_clear()
  caplog.set_level(logging.INFO, logger="te_jax")
  calls = _spy(monkeypatch)
  for which in sorted(LINEN):
    m = LINEN[which]()
    x = _rand(14, (2, 9, HID - 128))
    m.apply(nn.unbox(m.init(jax.random.key(0), x)), x)
  assert not calls and "te_jax's norm kernels" not in caplog.text, (calls, caplog.text)


def test_nnx_modules_take_the_norm_kernels_with_fp8_off(monkeypatch):
  from flax import nnx   # pylint: disable=import-outside-toplevel
  from te_jax import nnx as tnx   # pylint: disable=import-outside-toplevel
  rngs = nnx.Rngs(0)
  x = _rand(12, (2, 9, HID), 2.0, 0.3)
  mods = [tnx.LayerNormLinear(HID, 96, rngs=rngs),
          tnx.LayerNormMLP(HID, 128, activations=("gelu",), rngs=rngs)]
  calls = _spy(monkeypatch)
  for mod in mods:
    y = mod(x)
    assert calls == ["auto"], (type(mod).__name__, calls)
    calls.clear()
    monkeypatch.setattr(norm_lib, "norm_kernel_blocker", lambda *a: "forced")
    np.testing.assert_array_equal(np.asarray(mod(x)), np.asarray(y))
    assert not calls
    monkeypatch.undo()
    calls = _spy(monkeypatch)


class _Mesh:
  size = 2


def test_a_mesh_sends_the_norm_to_xla_and_says_why(monkeypatch, caplog):
  norm_lib.log_xla_norm.cache_clear()
  caplog.set_level(logging.INFO, logger="te_jax")
  m = LINEN["mlp"]()
  x = _rand(13, (2, 9, HID))
  v = nn.unbox(jax.jit(m.init)(jax.random.key(0), x))
  calls = _spy(monkeypatch)
  monkeypatch.setattr(sharding_lib, "get_mesh", lambda mesh=None: _Mesh())
  y = m.apply(v, x)
  m.apply(v, x)
  assert not calls
  assert caplog.text.count("LayerNormMLP normalizes in XLA (not te_jax's norm kernels): "
                           "a mesh of 2 devices is active") == 1, caplog.text
  monkeypatch.undo()
  # Without the mesh: the kernels' path, the same output (bit for bit here).
  calls = _spy(monkeypatch)
  np.testing.assert_array_equal(np.asarray(m.apply(v, x)), np.asarray(y))
  assert calls == ["auto"]


# -------------------------------------------------------------- GPU vs ref ---

_CPU = jax.devices("cpu")[0]
_GPU_SHAPES = [(200, 4096), (1000, 8192), (72, 200), (130, 100), (256, 1024)]


def _on_cpu(fn, *args):
  return jax.jit(fn)(*jax.device_put(args, _CPU))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", _GPU_SHAPES)
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_gpu_norm_stats_matches_reference(shape, dtype):
  """rstd within STATS_RTOL, the mean within STATS_RTOL of the row's rms."""
  for norm_type in ("layernorm", "rmsnorm"):
    x = _rand(20, shape, 2.0, 0.5, dtype)
    mean, rstd = jax.jit(lambda x: nrm.norm_stats(
        x, norm_type=norm_type, epsilon=EPS, impl="cuda"))(x)
    mean_r, rstd_r = _on_cpu(lambda x: nrm.norm_stats_reference(
        x, norm_type=norm_type, epsilon=EPS), x)
    tag = f"{shape} {jnp.dtype(dtype).name} {norm_type}"
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(rstd_r), rtol=nrm.STATS_RTOL,
                               atol=0, err_msg=tag)
    if norm_type == "rmsnorm":
      assert mean is None and mean_r is None, tag
    else:
      rms = np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, axis=1))
      assert np.all(np.abs(np.asarray(mean, np.float64) - np.asarray(mean_r)) <=
                    nrm.STATS_RTOL * rms), tag


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type,zc", NORMS)
def test_gpu_normalize_matches_reference(norm_type, zc):
  """bf16 in and out, (1000, 4096): the output within one bf16 step of the
  reference's (the statistics differ by a few float32 ulps, which can move a
  rounding), plus 1e-4 absolute where ``xhat * gamma + beta`` cancels to
  near 0 (there those ulps of its O(1) terms are not small relative to y);
  dx within 1% of the reference's, dgamma and dbeta within 1e-4 (float32
  sums over the rows in another order)."""
  x = _rand(21, (4, 250, 4096), 2.0, 0.5, BF16)
  gamma, beta = _params(norm_type, zc, 4096, seed=22)
  cot = _rand(23, x.shape, dtype=BF16)
  kw = dict(norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zc, dtype=BF16)

  def fn(impl):
    return lambda x, g, b: norm_dense.normalize(x, g, b, impl=impl, **kw)

  y1, g1 = vjp_run(fn("cuda"), (x, gamma, beta), cot)
  y0, g0 = vjp_run(fn("reference"), jax.device_put((x, gamma, beta), _CPU),
                   jax.device_put(cot, _CPU))
  a, b = np.asarray(y1, np.float32), np.asarray(y0, np.float32)
  excess = np.abs(a - b) - (2 ** -7 * np.maximum(np.abs(a), np.abs(b)) + 1e-4)
  assert np.all(excess <= 0), float(excess.max())
  assert rel(g1[0], g0[0]) < 1e-2, rel(g1[0], g0[0])
  for a, b in zip(g1[1:], g0[1:]):
    assert (a is None) == (b is None)
    if b is not None:
      assert rel(a, b) < 1e-4, rel(a, b)


@pytest.mark.gpu
def test_gpu_module_runs_the_norm_kernels_with_fp8_off():
  """LayerNormMLP with FP8 off on the GPU: the compiled step calls the
  statistics and backward kernels, and XLA has no norm reduction left."""
  m = tfx.LayerNormMLP(intermediate_dim=1024, activations=("gelu",), dtype=BF16)
  x = _rand(24, (2, 128, HID), 2.0, 0.3, BF16)
  v = nn.unbox(jax.jit(m.init)(jax.random.key(0), x))
  cot = _rand(25, x.shape, dtype=BF16)
  step = jax.jit(jax.grad(lambda v, x: jnp.sum(m.apply(v, x).astype(F32) * cot),
                          argnums=(0, 1)))
  hlo = step.lower(v, x).compile().as_text()
  assert "te_jax_norm_stats" in hlo and "te_jax_norm_backward" in hlo
  g = step(v, x)
  assert all(np.all(np.isfinite(np.asarray(a, np.float32))) for a in jax.tree.leaves(g))
