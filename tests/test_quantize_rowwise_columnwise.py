"""The public one-pass quantize, ``te_jax.quantize.quantize_rowwise_columnwise``, CPU.

Its reference (what ``impl="reference"`` and ``TE_JAX_IMPL=reference`` run)
must equal two separate quantizations, of ``x`` and of ``x.T``, bit for bit,
in every recipe's layout; its CUDA path must be one custom call writing both
copies. The CUDA values against the reference: tests/test_cuda_ops.py (gpu).
"""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax import quantize as q
from te_jax.ops import quantize as qop
from cuda_lowering import cuda_text, gpu_host  # pylint: disable=unused-import  (a fixture)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
SHAPES = [(256, 384), (130, 300), (1, 7), (300, 129)]
# (mode, options): the layout of each recipe and role.
LAYOUTS = [
    ("tensorwise", dict(scale=3.0)),                                  # delayed
    ("current", {}),                                                  # current
    ("blockwise", {}),                                                # block x/grad, default tiles
    ("blockwise", dict(block_shape=(1, 128), power_2_scale=True)),    # block x/grad
    ("blockwise", dict(block_shape=(128, 128), power_2_scale=True)),  # block kernel
    ("blockwise", dict(block_shape=(32, 64))),                        # reference-only tiles
]


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _input(shape, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, size=(shape[0], 1))
  return jnp.asarray(x, jnp.bfloat16)


def _separately(x, mode, dtype, scale=None, block_shape=(1, 128), power_2_scale=False):
  """(data, scale_inv, amax) of x and of x.T, each quantized on its own
  through the public single-copy functions."""
  out = []
  for v in (x, x.T):
    if mode == "tensorwise":
      data, amax = q.quantize_tensorwise(v, scale, dtype, impl="reference")
      out.append((data, np.float32(1) / np.float32(scale), amax))
    elif mode == "current":
      r = qop.quantize_current(v, dtype, impl="reference")
      out.append((r.data, r.scale_inv, r.amax))
    else:
      data, s = q.quantize_blockwise(v, block_shape, dtype, power_2_scale, impl="reference")
      out.append((data, s, None))
  return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode, options", LAYOUTS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_reference_is_two_separate_quantizations(shape, mode, options, dtype):
  x = _input(shape)
  qt = q.quantize_rowwise_columnwise(x, mode, dtype, impl="reference", **options)
  assert isinstance(qt, q.QuantizedTensor)
  (data, s, amax), (data_t, s_t, amax_t) = _separately(x, mode, dtype, **options)
  np.testing.assert_array_equal(_bits(qt.data), _bits(data))
  np.testing.assert_array_equal(_bits(qt.data_t), _bits(data_t))
  np.testing.assert_array_equal(_bits(qt.scale_inv), _bits(jnp.asarray(s, jnp.float32)))
  np.testing.assert_array_equal(_bits(qt.scale_inv_t), _bits(jnp.asarray(s_t, jnp.float32)))
  if mode == "blockwise":
    assert qt.amax is None and qt.block_shape == options.get("block_shape", (1, 128))
  else:
    assert float(qt.amax) == float(amax) == float(amax_t) and qt.block_shape is None


@pytest.mark.parametrize("mode, options", LAYOUTS)
def test_shapes_and_gemm_operands(mode, options):
  m, k = 130, 300
  x = _input((m, k), 1)
  if mode == "tensorwise":   # a scale that fits: no saturation
    options = dict(scale=448.0 / float(jnp.max(jnp.abs(x.astype(jnp.float32)))))
  qt = q.quantize_rowwise_columnwise(x, mode, **options)
  assert qt.data.shape == (m, k) and qt.data_t.shape == (k, m)
  assert qt.data.dtype == qt.data_t.dtype == jnp.float8_e4m3fn
  bm, bk = options.get("block_shape", (1, 128)) if mode == "blockwise" else (None, None)
  if bm is None:
    assert qt.scale_inv.shape == qt.scale_inv_t.shape == ()
  else:
    assert qt.scale_inv.shape == (-(-m // bm), -(-k // bk))
    assert qt.scale_inv_t.shape == (-(-k // bm), -(-m // bk))
  x32 = np.asarray(x, np.float32)
  tol = 0.07 * np.max(np.abs(x32), axis=1, keepdims=True)   # E4M3: half an ulp is 1/16
  if mode == "tensorwise":
    tol = 0.07 * np.max(np.abs(x32))
  assert np.all(np.abs(np.asarray(qt.rowwise().dequantize()) - x32) <= tol)
  assert np.all(np.abs(np.asarray(qt.columnwise().dequantize()).T - x32) <= tol)


def test_reference_is_what_the_dispatcher_runs(monkeypatch):
  x = _input((256, 384), 2)
  want = qop.quantize_by_mode_reference(x, "blockwise", jnp.dtype(E4M3), None, True,
                                        (128, 128))
  monkeypatch.setenv("TE_JAX_IMPL", "reference")
  got = q.quantize_rowwise_columnwise(x, "blockwise", block_shape=(128, 128),
                                      power_2_scale=True)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("mode, options, target", [
    ("tensorwise", dict(scale=3.0), "te_jax_quantize_tensorwise"),
    ("current", {}, "te_jax_quantize_current"),
    ("blockwise", {}, "te_jax_quantize_blockwise"),
    ("blockwise", dict(block_shape=(128, 128)), "te_jax_quantize_blockwise"),
])
def test_cuda_path_is_one_kernel_writing_both_copies(gpu_host, mode, options, target):  # pylint: disable=unused-argument
  x = _input((256, 384), 3)
  text = cuda_text(lambda x: q.quantize_rowwise_columnwise(x, mode, **options), x)
  calls = re.findall(r"custom_call @(\w+)\(.*", text)
  assert calls == [target], calls
  assert "columnwise = 1" in text and "tensor<384x256xf8E4M3FN>" in text


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(x=jnp.ones((4,)), mode="current"), ValueError, "x must be 2-D"),
    (dict(x=jnp.ones((2, 4, 8)), mode="current"), ValueError, "x must be 2-D"),
    (dict(x=jnp.ones((4, 8), jnp.int32), mode="current"), TypeError, "x must be a float32"),
    (dict(x=jnp.ones((0, 8)), mode="current"), ValueError, "x must not be empty"),
    (dict(x=jnp.ones((4, 8)), mode="mxfp8"), ValueError, "mode must be one of"),
    (dict(x=jnp.ones((4, 8)), mode="tensorwise"), ValueError, "needs scale"),
    (dict(x=jnp.ones((4, 8)), mode="current", scale=2.0), ValueError, "scale must be None"),
    (dict(x=jnp.ones((4, 8)), mode="current", block_shape=(1, 128)), ValueError,
     "block_shape applies to mode='blockwise' only"),
    (dict(x=jnp.ones((4, 8)), mode="tensorwise", scale=2.0, power_2_scale=True), ValueError,
     "power_2_scale applies to mode='blockwise' only"),
    (dict(x=jnp.ones((4, 8)), mode="blockwise", block_shape=(0, 128)), ValueError,
     "block_shape must be a pair of positive ints"),
    (dict(x=jnp.ones((4, 8)), mode="blockwise", dtype=jnp.int8), TypeError,
     "dtype must be jnp.float8"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    q.quantize_rowwise_columnwise(**kwargs)


def test_cuda_path_refuses_tiles_without_a_kernel(gpu_host):  # pylint: disable=unused-argument
  with pytest.raises(ValueError, match=r"block_shape must be \(1, 128\) or \(128, 128\)"):
    cuda_text(lambda x: q.quantize_rowwise_columnwise(x, "blockwise", block_shape=(32, 64)),
              jnp.ones((64, 128)))
