"""``act_quantize(..., h_copy=True)``: the forward's activation pass also
writes h's E4M3 copy (1x128 tiles, power-of-two scales), the h that
``dact_quantize`` reads under ``store_act_input_in_fp8``, instead of a
``quantize_blockwise`` pass of its own over h.

CPU: the reference returns ``quantize_blockwise(h, (1, 128), E4M3,
power_2_scale=True).rowwise()`` beside the unchanged z, whose scales the test
also derives itself; bad arguments name ``h_copy``; the CUDA program (lowered
without a GPU) makes the copy in the activation call, and ``fused_mlp`` with
``store_act_input_in_fp8`` reads the 16-bit h in that one custom call (no
separate ``te_jax_quantize_blockwise`` of h). GPU (``gpu`` marker, skipped
elsewhere): the kernels' copy is the blockwise quantize kernel's bit for bit
and the reference's (NaN for NaN), z is the call's without the copy, and
the fused MLP keeps the bytes it kept before.
"""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_jax import dense as dense_lib
from te_jax import fused_mlp
from te_jax.ops import _native
from te_jax.ops import act_quantize as aq
from te_jax.ops import quantize as quantize_op
from te_jax.ops.fp8 import ScaledTensor

from cuda_lowering import cuda_text, custom_calls, gpu_host  # pylint: disable=unused-import
from flax_cases import RECIPES, mlp_states, rand

E4M3, E5M2, BF16, F16, F32 = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16,
                              jnp.float32)
GATED = ("silu", "linear")
_CPU = jax.devices("cpu")[0]
# The tile of _h whose scale_inv, 2**-127, is a float32 subnormal: the
# kernels (built with -ftz=false) write it, XLA:CPU's reference flushes it
# to 0; its bytes agree.
_TINY = (7, slice(0, 128))


def _h(m, w, dtype=BF16, nonfinite=False):
  """h (m, w): 1x128 tiles of magnitudes 2**-8 .. 2**8, an all-zero tile
  (scale 1), one of magnitude 2**-100 (scale near 2**108), one of 2**-121
  (448 / amax overflows: the scale is the float32 max rounded down to
  2**127, its inverse a float32 subnormal: see _TINY); with ``nonfinite`` a
  NaN, an Inf and a -Inf in three tiles (NaN scales: the whole tile NaN)."""
  rng = np.random.default_rng(zlib.crc32(repr((m, w, nonfinite)).encode()))
  mag = 2.0 ** rng.integers(-8, 9, size=(m, -(-w // 128)))
  h = rng.standard_normal((m, w)) * np.repeat(mag, 128, axis=1)[:, :w]
  h[3, :128] = 0.0
  h[6, 128:256] = rng.standard_normal(128) * 2.0 ** -100
  # Normal floats (XLA:CPU would flush subnormal inputs to 0): 2**-121 .. 2**-120.
  h[_TINY] = rng.choice([-1.0, 1.0], 128) * (1.0 + rng.random(128)) * 2.0 ** -121
  if nonfinite:
    h[5, 130], h[m - 1, 7], h[m // 2, w - 1] = np.nan, np.inf, -np.inf
  return jnp.asarray(h, dtype)


def _mode_kw(mode):
  kw = dict(mode=mode, dtype=E4M3, power_2_scale=mode == "blockwise")
  if mode == "tensorwise":
    kw["scale"] = jnp.float32(40.0)
  return kw


def _bits(a):
  return np.asarray(a).reshape(-1).view(np.uint8)


def _same(got, want, what, nan_equal=False):
  """Equal bit for bit; with ``nan_equal`` a NaN (any payload or sign) equals a NaN."""
  assert (got is None) == (want is None), what
  if got is None:
    return
  g, w = np.asarray(got), np.asarray(want)
  assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, g.dtype, w.shape, w.dtype)
  g, w = g.reshape(-1), w.reshape(-1)
  if nan_equal:
    nan_g = np.isnan(g.astype(np.float32))
    np.testing.assert_array_equal(nan_g, np.isnan(w.astype(np.float32)), err_msg=what)
    g, w = g[~nan_g], w[~nan_g]
  np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=what)


def _same_quantized(got, want, what, nan_equal=False):
  for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax"):
    _same(getattr(got, name), getattr(want, name), f"{what} {name}", nan_equal)


# ------------------------------------------------------------- reference ---

@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("acts", [GATED, ("gelu",)], ids="-".join)
def test_reference_h_copy_is_quantize_blockwise_of_h(acts, mode):
  m, f = 200, 256
  h = _h(m, len(acts) * f, nonfinite=True)
  kw = _mode_kw(mode)
  q, h_fp8 = jax.jit(lambda h: aq.act_quantize(h, acts, impl="reference", h_copy=True, **kw))(h)
  plain = jax.jit(lambda h: aq.act_quantize(h, acts, impl="reference", **kw))(h)
  _same_quantized(q, plain, f"z {acts} {mode}")
  assert isinstance(h_fp8, ScaledTensor) and h_fp8.block_shape == (1, 128)
  want = quantize_op.quantize_blockwise(h, (1, 128), E4M3, power_2_scale=True,
                                        impl="reference")
  _same(h_fp8.data, want.data, "h data")
  _same(h_fp8.scale_inv, want.scale_inv, "h scale_inv")
  # The reference function itself, run eagerly, gives the same pair (the
  # sign of a NaN of z may differ from the jitted run's).
  q2, h2 = aq.act_quantize_reference(h, acts, h_copy=True, **kw)
  _same_quantized(q2, plain, "act_quantize_reference z", nan_equal=True)
  _same(h2.data, want.data, "act_quantize_reference h data", nan_equal=True)


def test_reference_h_copy_scales_derived_by_hand():
  """The copy's tile scales from numpy: scale = 448 / max|tile| rounded down
  to a power of two (the float32 max first when that overflows), 1 for an
  all-zero tile, NaN for a tile holding a NaN or an Inf (and all its bytes NaN)."""
  m, w = 130, 256
  h = _h(m, w, nonfinite=True)
  _, h_fp8 = aq.act_quantize(h, GATED, mode="current", dtype=E4M3, impl="reference",
                             h_copy=True)
  tiles = np.asarray(h, np.float32).reshape(m, w // 128, 128)
  amax = np.abs(tiles).max(axis=2)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    scale = np.minimum(np.float32(448.0) / amax, np.finfo(np.float32).max)
    scale = np.where(amax == 0, 1.0, 2.0 ** np.floor(np.log2(scale.astype(np.float64))))
  scale = np.where(np.isfinite(amax), scale, np.nan).astype(np.float32)
  got = np.asarray(h_fp8.scale_inv).copy()
  assert scale[_TINY[0], 0] == 2.0 ** 127 and got[_TINY[0], 0] in (2.0 ** -127, 0.0)
  got[_TINY[0], 0] = 2.0 ** -127   # its inverse flushed to 0 or not (see _TINY)
  np.testing.assert_array_equal(got, np.float32(1.0) / scale)
  data = np.asarray(h_fp8.data).astype(np.float32).reshape(m, w // 128, 128)
  want = np.clip(tiles * scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(data, want.astype(np.float32))   # NaN tiles NaN everywhere
  assert np.isnan(data[5, 1]).all() and np.isnan(data[m - 1, 0]).all()


# ---------------------------------------------------------------- errors ---

def test_h_copy_must_be_a_bool():
  h = jnp.zeros((128, 256), BF16)
  for fn in (aq.act_quantize, aq.act_quantize_reference):
    with pytest.raises(TypeError, match="h_copy must be a Python bool"):
      fn(h, GATED, mode="current", dtype=E4M3, h_copy=1)


def test_cuda_path_refuses_what_its_kernels_do_not_write(gpu_host):  # pylint: disable=unused-argument
  """F % 128 != 0 (a tile of h would straddle h0 and h1) and rowwise=False
  (no kernel writes the columnwise z alone beside h's copy): a ValueError
  naming h_copy when the CUDA path is traced; the reference computes both."""
  for h, rowwise in ((jnp.zeros((128, 2 * 136), BF16), True),
                     (jnp.zeros((128, 256), BF16), False)):
    kw = dict(mode="current", dtype=E4M3, rowwise=rowwise, h_copy=True)
    with pytest.raises(ValueError, match=r"h_copy=True on the CUDA path needs F % 128 == 0 "
                                         r"and rowwise=True"):
      jax.eval_shape(lambda h, kw=kw: aq.act_quantize(h, GATED, **kw), h)
    _, h_fp8 = aq.act_quantize(h, GATED, impl="reference", **kw)
    assert h_fp8.data.shape == h.shape


# ---------------------------------------------- the CUDA program, lowered ---

@pytest.mark.parametrize("mode", aq.MODES)
def test_cuda_call_returns_the_copy_as_its_last_two_results(gpu_host, mode):  # pylint: disable=unused-argument
  m, f = 256, 384
  h = jnp.zeros((m, 2 * f), BF16)
  for h_copy, columnwise in ((True, False), (True, True), (False, False)):
    text = cuda_text(lambda h, h_copy=h_copy, columnwise=columnwise: aq.act_quantize(
        h, GATED, columnwise=columnwise, h_copy=h_copy, **_mode_kw(mode)), h)
    ((target, operands, results),) = custom_calls(text, "te_jax_act_quantize")
    assert operands[0] == f"{m}x{2 * f}xbf16", (target, operands)
    want = ([f"{m}x{2 * f}xf8E4M3FN", f"{m}x{2 * f // 128}xf32"] if h_copy
            else ["0x0xui8", "0x0xf32"])
    assert results[-2:] == want, (target, results)


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_fused_mlp_reads_the_16_bit_h_once(gpu_host, rname):  # pylint: disable=unused-argument
  """The CUDA program of a training step with store_act_input_in_fp8: one
  custom call reads h (M, 2F) in bf16, the forward's activation call, which
  returns h's E4M3 copy; the backward's activation call reads that copy. (It
  was read by a te_jax_quantize_blockwise call as well.)"""
  r = RECIPES[rname]()
  m, k, f, n = 256, 128, 256, 128
  x, wi, wo = rand(0, (m, k), dtype=BF16), rand(1, (k, 2 * f), 0.09), rand(2, (f, n), 0.06)
  si, so = mlp_states(r)

  def step(x, wi, wo):
    return jax.value_and_grad(lambda *a: jnp.sum(fused_mlp.fp8_mlp(
        *a, activations=GATED, recipe=r, wi_state=si, wo_state=so,
        store_act_input_in_fp8=True).astype(jnp.float32)), argnums=(0, 1, 2))(x, wi, wo)
  calls = custom_calls(cuda_text(step, x, wi, wo), "te_jax_")
  h16, h8, h_scales = f"{m}x{2 * f}xbf16", f"{m}x{2 * f}xf8E4M3FN", f"{m}x{2 * f // 128}xf32"
  readers = [(t, res) for t, ops, res in calls if h16 in ops]
  assert [t for t, _ in readers] == [f"te_jax_act_quantize_{_call_mode(rname)}"], readers
  assert readers[0][1][-2:] == [h8, h_scales], readers
  backward = [t for t, ops, _ in calls if t.startswith("te_jax_act_quantize") and ops[0] == h8]
  assert backward == [f"te_jax_act_quantize_{_call_mode(rname)}"], calls


def _call_mode(rname):
  return {"delayed": "tensorwise", "current": "current", "block": "blockwise"}[rname]


# ---------------------------------------------------- the kept h, as before ---

def _kept_h_and_output(rname, save_input, impl, device):
  """(y, kept h) of fused_mlp's forward with store_act_input_in_fp8 and the
  bf16 h (and y) of the same forward without it, on ``device``."""
  r = RECIPES[rname]()
  m, k, f, n = 256, 128, 256, 128
  args = jax.device_put((rand(0, (m, k), dtype=BF16), rand(1, (k, 2 * f), 0.09),
                         rand(2, (f, n), 0.06), mlp_states(r)), device)

  def fwd(store):
    cfg = fused_mlp._MlpConfig(  # pylint: disable=protected-access
        mode=dense_lib.scaling_mode_of(r), impl=impl, activations=GATED, has_bi=False,
        has_bo=False, dtype=jnp.dtype(BF16), norm=None, save_input=save_input,
        store_act_input_in_fp8=store)
    run = lambda x, wi, wo, states: fused_mlp._mlp_fwd(  # pylint: disable=protected-access
        x, None, None, wi, None, wo, None, states, cfg)
    y, res = jax.jit(run)(*args)
    (kept,) = res[2]   # res[2]: what the forward keeps of h, a piece per backward chunk
    return y, kept
  return fwd(True), fwd(False)


def _check_kept_h(rname, save_input, impl, device):
  (y1, kept), (y0, h) = _kept_h_and_output(rname, save_input, impl, device)
  _same(y1, y0, "output")
  assert isinstance(kept, ScaledTensor) and h.dtype == BF16
  want = jax.jit(lambda h: quantize_op.quantize_blockwise(
      h, (1, 128), E4M3, power_2_scale=True, impl=impl).rowwise())(h)
  _same(kept.data, want.data, f"{rname} kept h data")
  _same(kept.scale_inv, want.scale_inv, f"{rname} kept h scale_inv")


@pytest.mark.parametrize("save_input", [True, False])
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_reference_fused_mlp_keeps_quantize_blockwise_of_h(rname, save_input):
  _check_kept_h(rname, save_input, "reference", _CPU)


# ------------------------------------------------------------------- GPU ---

_needs_gpu = pytest.mark.skipif(not _native.cuda_available(),
                                reason="needs a GPU and the te_jax CUDA custom calls")


def _cuda_case(acts, mode, columnwise, m, f, dtype=BF16, nonfinite=False):
  """The CUDA call with h_copy against (1) itself without h_copy (z, bit for
  bit), (2) the blockwise quantize kernel on h (bit for bit, NaN bytes
  too), (3) the reference on the CPU (bit for bit, NaN for NaN)."""
  h = _h(m, len(acts) * f, dtype, nonfinite)
  kw = dict(_mode_kw(mode), columnwise=columnwise)
  tag = f"{acts} {mode} columnwise={columnwise} {m}x{f} {jnp.dtype(dtype).name}"
  run = lambda impl, h_copy: jax.jit(lambda h: aq.act_quantize(h, acts, impl=impl,
                                                               h_copy=h_copy, **kw))
  q, h_fp8 = run("cuda", True)(h)
  _same_quantized(q, run("cuda", False)(h), f"z {tag}", nan_equal=True)
  kernel = jax.jit(lambda h: quantize_op.quantize_blockwise(
      h, (1, 128), E4M3, power_2_scale=True, impl="cuda").rowwise())(h)
  assert h_fp8.block_shape == (1, 128), tag
  _same(h_fp8.data, kernel.data, f"h data vs the quantize kernel {tag}")
  _same(h_fp8.scale_inv, kernel.scale_inv, f"h scale_inv vs the quantize kernel {tag}",
        nan_equal=True)
  _, want = run("reference", True)(jax.device_put(h, _CPU))
  _same(h_fp8.data, want.data, f"h data vs the reference {tag}", nan_equal=True)
  want_s = np.asarray(want.scale_inv).copy()
  if np.any(np.asarray(h[_TINY], np.float32) != 0):
    assert np.asarray(h_fp8.scale_inv)[_TINY[0], 0] == 2.0 ** -127, tag
    want_s[_TINY[0], 0] = 2.0 ** -127   # flushed to 0 or not on the CPU (see _TINY)
  else:   # float16 has no 2**-121: the tile is all zero, scale 1
    assert np.asarray(h_fp8.scale_inv)[_TINY[0], 0] == 1.0, tag
  _same(h_fp8.scale_inv, want_s, f"h scale_inv vs the reference {tag}", nan_equal=True)
  if nonfinite:
    assert np.isnan(np.asarray(h_fp8.scale_inv)).sum() == 3, tag


@pytest.mark.gpu
@_needs_gpu
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("acts", [GATED, ("gelu",), ("relu",), ("quick_gelu", "tanh")],
                         ids="-".join)
def test_cuda_h_copy_bits(acts, mode, columnwise):
  """Specialized loops (SwiGLU, gelu, relu) and the generic one; M = 200: a
  row tile past the last row; with and without NaN/Inf in h."""
  for m, f in ((256, 384), (200, 256)):
    for nonfinite in (False, True):
      _cuda_case(acts, mode, columnwise, m, f, nonfinite=nonfinite)


@pytest.mark.gpu
@_needs_gpu
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: jnp.dtype(d).name)
def test_cuda_h_copy_other_dtypes(dtype, mode):
  _cuda_case(GATED, mode, False, 130, 128, dtype, nonfinite=True)
  _cuda_case(("gelu",), mode, True, 256, 256, dtype)


@pytest.mark.gpu
@_needs_gpu
@pytest.mark.parametrize("save_input", [True, False])
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_cuda_fused_mlp_keeps_quantize_blockwise_of_h(rname, save_input):
  """The fused MLP's forward on the GPU keeps the bytes the blockwise quantize
  kernel writes for its h (what it kept before h_copy), and its output is
  unchanged; save_input=False writes both copies of z beside h's."""
  _check_kept_h(rname, save_input, "cuda", jax.devices("gpu")[0])
