"""A NaN or Inf anywhere in a tensor or tile reaches its amax (issue 44, item 14), CPU.

XLA:CPU's float reduce-max drops a NaN for some shapes and positions (and can
return -inf): ``jnp.max(jnp.abs(jnp.ones((128, 128)).at[0, 5].set(jnp.nan)))``
is 1.0, and ``lax.pmax`` over devices drops one too. Every amax the
references and the scaling modes take goes through ``te_jax.ops.fp8.amax`` /
``pmax_amax``, which reduce the bits of |x| and propagate NaN on every
backend. Each test below fails with a float ``jnp.max`` / ``lax.pmax`` in
their place.
"""

import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from te_jax import recipe
from te_jax.ops import act_quantize as aq
from te_jax.ops import fp8
from te_jax.ops import quantize as qop

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Shapes and positions where XLA:CPU's reduce-max lost the NaN (jax 0.10.2);
# small shapes, where it did not, check that nothing else changed.
SHAPES = [(128, 128), (256, 256), (130, 300), (1, 4096), (64, 64), (8, 8)]


def _positions(shape):
  """Corners, middles and the last element of ``shape``."""
  return sorted(set(itertools.product(*[{i for i in (0, 1, s // 2, s - 1) if i < s}
                                        for s in shape])))


def _np_amax(x):
  """NaN-propagating max|x| in numpy float32."""
  return np.float32(np.max(np.abs(np.asarray(x, np.float32))))


def _cases(bad_values=(np.nan,)):
  for shape in SHAPES:
    for pos in _positions(shape):
      for bad in bad_values:
        yield shape, pos, bad


def test_amax_propagates_nan_and_inf_at_every_position():
  for shape, pos, bad in _cases((np.nan, np.inf, -np.inf)):
    x = jax.random.normal(jax.random.key(0), shape).at[pos].set(bad)
    got = np.asarray(fp8.amax(x))
    want = _np_amax(x)
    if np.isnan(want):
      assert np.isnan(got), (shape, pos, bad, got)
    else:
      assert got == want, (shape, pos, bad, got)


def test_amax_of_finite_values_is_exact_and_keeps_subnormals():
  x = jax.random.normal(jax.random.key(1), (130, 300), jnp.bfloat16)
  assert np.asarray(fp8.amax(x)) == _np_amax(x)
  sub = np.float32(3e-39)                  # subnormal: not flushed to 0
  assert np.asarray(fp8.amax(jnp.array([0.0, -sub, 0.0], jnp.float32))) == sub
  assert np.asarray(fp8.amax(jnp.array([-0.0, -0.0]))) == 0.0
  t = jax.random.normal(jax.random.key(2), (4, 8, 3, 16))
  np.testing.assert_array_equal(fp8.amax(t, axis=(1, 3)),
                                np.max(np.abs(np.asarray(t)), axis=(1, 3)))


@pytest.mark.parametrize("shape", SHAPES)
def test_current_scaling_nan_gives_nan_amax_scale_and_data(shape):
  for pos in _positions(shape):
    x = jnp.ones(shape, jnp.float32).at[pos].set(jnp.nan)
    q = qop.quantize_current(x, E4M3, impl="reference")
    assert np.isnan(q.amax) and np.isnan(q.scale_inv), (pos, q.amax)
    assert np.all(np.isnan(np.asarray(q.data, np.float32))), pos


@pytest.mark.parametrize("shape", SHAPES)
def test_current_scaling_inf_gives_inf_amax_and_nan_scale(shape):
  for pos in _positions(shape):
    for bad in (np.inf, -np.inf):
      x = jnp.ones(shape, jnp.float32).at[pos].set(bad)
      q = qop.quantize_current(x, E5M2, impl="reference")
      assert np.asarray(q.amax) == np.inf and np.isnan(q.scale_inv), (pos, bad)


@pytest.mark.parametrize("shape", SHAPES)
def test_delayed_scaling_nan_gives_nan_amax_and_scale_inv(shape):
  # The scale is given (from the state): the data saturates, but the amax
  # the state update sees is NaN and the scale_inv the GEMM reads is NaN.
  for pos in _positions(shape):
    x = jnp.ones(shape, jnp.float32).at[pos].set(jnp.nan)
    q = qop.quantize_tensorwise(x, jnp.float32(2.0), E4M3, impl="reference")
    assert np.isnan(q.amax) and np.isnan(q.scale_inv), (pos, q.amax)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_blockwise_tile_amax_sees_every_position(block, bad):
  for shape in [(128, 128), (256, 256), (130, 300)]:
    for pos in _positions(shape):
      x = jnp.ones(shape, jnp.float32).at[pos].set(bad)
      q = qop.quantize_blockwise(x, block, E4M3, impl="reference", columnwise=True)
      tile = (pos[0] // block[0], pos[1] // block[1])
      s = np.asarray(q.scale_inv)
      assert np.isnan(s[tile]), (shape, pos, block, s[tile])
      others = np.ones(s.shape, bool)
      others[tile] = False
      assert np.all(np.isfinite(s[others])), (shape, pos, block)
      # the columnwise copy tiles x.T: the tile of (pos[1], pos[0]) there
      st = np.asarray(q.scale_inv_t)
      assert np.isnan(st[pos[1] // block[0], pos[0] // block[1]]), (shape, pos, block)


@pytest.mark.parametrize("mode", ["current", "blockwise"])
def test_fused_prologue_reference_sees_a_nan(mode):
  h = jnp.ones((128, 256), jnp.float32).at[127, 255].set(jnp.nan)   # in the last element
  q = aq.act_quantize_reference(h, ("linear",), mode=mode, dtype=E4M3)
  assert np.isnan(np.asarray(q.scale_inv)).any()
  if mode == "current":
    assert np.isnan(q.amax)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_sharded_amax_propagates_a_nan_from_any_device(name):
  # amax_axes: the per-tensor amax is max-reduced over the mesh; a NaN on
  # one device must reach every device's amax and scale_inv.
  devices = np.array(jax.devices())
  if devices.size < 2:
    pytest.skip("needs several devices: run with "
                "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  n = devices.size
  mesh = Mesh(devices, ("d",))
  r = recipe.DelayedScaling() if name == "delayed" else recipe.Float8CurrentScaling()
  mode = r.scaling_mode()
  state = mode.init_state()

  def quantize(x):
    q = mode.quantize(x, "x", state, impl="reference", amax_axes=("d",))
    return q.amax[None], jnp.reshape(q.scale_inv, (1,))

  f = jax.jit(jax.shard_map(quantize, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  rows = 16 * n
  for row in (0, 16, rows - 1):                # on the first, second and last device
    x = jnp.ones((rows, 64), jnp.float32).at[row, 3].set(jnp.nan)
    amax, scale_inv = f(x)
    assert np.all(np.isnan(amax)) and np.all(np.isnan(scale_inv)), (row, amax)
  x = jnp.ones((rows, 64), jnp.float32).at[rows - 1, 3].set(5.0)
  amax, _ = f(x)
  np.testing.assert_array_equal(amax, np.full(n, 5.0, np.float32))
