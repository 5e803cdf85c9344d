"""The 1x128 activation backward bit for bit, where the activations' values
are exact float32 products.

On a GPU, ``dact_quantize(mode="blockwise")`` runs DActQuantizeVec128Kernel
(custom_calls/kernels/act_quantize_blockwise_bwd.cu). It parks every value
of dh (and of act(h)) rounded to odd to 16 bits until the 128x1 column
scales are known and casts the columnwise copies from those, which gives
the bytes of the float32 values when the column scale is a power of two no
larger than 2^100; otherwise (pow2 off, a column amax below about 2^-85, a
non-finite column) it evaluates the values again (its exact path). Against
the reference, the gelu and SwiGLU backward may differ by an FP8 step where
CUDA's and XLA's activations differ by a float32 ulp
(tests/test_act_quantize.py checks within that). With ("relu", "linear"),
("linear", "relu") and one relu or linear, every value is a product of the
inputs rounded once, the same float32 on both paths: the kernel's bytes and
scales must be exactly those of the reference's ``activation_backward``
(and ``activation_forward`` for act(h)'s copy) quantized by
``quantize_blockwise``'s CUDA kernel, which keeps float32 values until its
scales are known and propagates NaN as the backward does (XLA:CPU's max
drops it). The reference's values are computed on the device under test:
JAX's CPU backend flushes subnormal inputs and results to zero (DAZ and
FTZ: a subnormal h compares as 0, a subnormal product becomes 0), while
XLA:GPU and the kernels (built with -ftz=false) keep them, so values on the
CPU are not the GPU's wherever a product or an input is subnormal (run AR:
every byte mismatch of the spread variant on the H100, 1,794 of 102,400 for
("relu", "linear") in bf16, was such a flushed value).

Covered: the paired kernel (F % 128 == 0), one block per tile of dh
(F = 136: tiles straddle h0 and h1), the non-gated relu loop, 16- and
32-bit and E4M3 h, pow2 on and off for dh and for act(h) separately,
exponents down to float32's subnormals, a tiny dz (column scales above
2^100: the exact path with pow2 on), and Inf and NaN inputs.

The ``gpu`` tests need the CUDA custom calls; on a CPU one test runs the
same comparisons on the reference path (the test's own plumbing).
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import _native
from te_jax.ops import act_quantize as aq
from te_jax.ops import quantize as quantize_op
from te_jax.ops.fp8 import ScaledTensor

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

GATED = [("relu", "linear"), ("linear", "relu")]
# h's kinds: (h dtype, dz dtype); "e4m3": h as its E4M3 copy (1x128 tiles,
# power-of-two scales: store_act_input_in_fp8), read in dz's dtype.
KINDS = {"bf16": (BF16, BF16), "f16": (F16, F16), "f32": (F32, F32),
         "e4m3_bf16": ("e4m3", BF16), "e4m3_f16": ("e4m3", F16), "e4m3_f32": ("e4m3", F32)}
# (dh pow2, act(h) pow2, exponent spread, dz scale, non-finite inputs)
VARIANTS = [
    (True, True, 0, 1.0, False),     # the parked values' path
    (False, True, 0, 1.0, False),    # dh's columns on the exact path
    (True, False, 0, 1.0, False),    # act(h)'s columns on the exact path
    (True, True, 140, 1.0, False),   # values down to float32 subnormals, parked
    (True, True, 0, 2.0 ** -100, False),  # dh's column scales above 2^100
    (True, True, 0, 1.0, True),      # Inf and NaN: NaN scales
]


def _inputs(acts, shape, kind, spread, dz_scale, nonfinite):
  """dz (M, F) and h (M, n_act*F) of `kind`: 3 x normal values (each times
  2^-k, k uniform in [0, spread), with a spread), dz times dz_scale; with
  nonfinite an Inf in h0, a -Inf in h's last column and a NaN in dz."""
  m, f = shape
  h_dtype, dz_dtype = KINDS[kind]
  rng = np.random.default_rng(zlib.crc32(repr((acts, shape, kind, spread, dz_scale,
                                                nonfinite)).encode()))
  w = len(acts) * f
  h = rng.standard_normal((m, w)) * 3
  dz = rng.standard_normal((m, f)) * dz_scale
  if spread:
    h *= 2.0 ** -rng.integers(0, spread, size=h.shape)
    dz *= 2.0 ** -rng.integers(0, spread, size=dz.shape)
  if nonfinite:
    h[m // 2, min(3, f - 1)] = np.inf
    h[m // 4, w - 1] = -np.inf
    dz[m // 3, min(5, f - 1)] = np.nan
  dz = jnp.asarray(dz, dz_dtype)
  if h_dtype != "e4m3":
    return dz, jnp.asarray(h, h_dtype)
  return dz, quantize_op.quantize_blockwise(jnp.asarray(h, BF16), (1, 128), E4M3,
                                            power_2_scale=True, impl="reference").rowwise()


def _expected(dz, h, acts, pow2, act_pow2, impl):
  """quantize_blockwise (both copies) of the reference's dh, and the
  columnwise copy of its act(h); the float32 values and their quantization
  (by `impl`) on the default device, the one under test (not the CPU: its
  subnormals are flushed, see the top)."""
  def values(dz, h):
    if isinstance(h, ScaledTensor):
      h = h.dequantize(dz.dtype)
    return aq.activation_backward(dz, h, acts), aq.activation_forward(h, acts)
  dh, z = jax.jit(values)(dz, h)
  q = quantize_op.quantize_blockwise(dh, (1, 128), E5M2, pow2, columnwise=True, impl=impl)
  z_t = quantize_op.quantize_blockwise(z, (1, 128), E4M3, act_pow2, columnwise=True,
                                       impl=impl).columnwise()
  return q, z_t


def _same(got, want, what):
  """Equal bytes, except that any NaN equals any NaN (FP8 and float32)."""
  g, w = np.asarray(got), np.asarray(want)
  assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
  g, w = g.reshape(-1), w.reshape(-1)
  nan = np.isnan(g.astype(np.float32))
  np.testing.assert_array_equal(nan, np.isnan(w.astype(np.float32)),
                                err_msg=f"{what}: NaN positions")
  np.testing.assert_array_equal(g[~nan].view(np.uint8), w[~nan].view(np.uint8), err_msg=what)


def _check(acts, shape, kind, impl):
  """Every variant, with and without act(h)'s copy, against _expected."""
  for pow2, act_pow2, spread, dz_scale, nonfinite in VARIANTS:
    dz, h = _inputs(acts, shape, kind, spread, dz_scale, nonfinite)
    tag = f"{acts} {shape} {kind} pow2={pow2}/{act_pow2} spread={spread} dz*{dz_scale} " \
          f"nonfinite={nonfinite}"
    want, want_z = _expected(dz, h, acts, pow2, act_pow2, impl)
    spec = aq.ActColumnwise("blockwise", E4M3, power_2_scale=act_pow2)
    kw = dict(mode="blockwise", dtype=E5M2, power_2_scale=pow2, impl=impl)
    plain = jax.jit(lambda dz, h, kw=kw: aq.dact_quantize(dz, h, acts, **kw))(dz, h)
    got, got_z = jax.jit(lambda dz, h, kw=kw, spec=spec: aq.dact_quantize(
        dz, h, acts, act_columnwise=spec, **kw))(dz, h)
    for q, which in ((plain, "without act(h)"), (got, "with act(h)")):
      for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        _same(getattr(q, name), getattr(want, name), f"dh {name} {which}: {tag}")
    assert got_z.block_shape == want_z.block_shape, tag
    _same(got_z.data, want_z.data, f"act(h).T: {tag}")
    _same(got_z.scale_inv, want_z.scale_inv, f"act(h).T scale_inv: {tag}")


def test_reference_path_runs_the_comparisons():
  """The comparisons themselves, on the reference path (both sides XLA)."""
  _check(("relu", "linear"), (130, 136), "bf16", "reference")
  _check(("relu",), (130, 100), "e4m3_bf16", "reference")


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", [(200, 256), (200, 136), (1, 384)],
                         ids=["paired", "straddling", "one_row"])
@pytest.mark.parametrize("acts", GATED, ids="-".join)
def test_cuda_gated_backward_bits(acts, shape, kind):
  _check(acts, shape, kind, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", [(130, 100), (256, 384)])
@pytest.mark.parametrize("acts", [("relu",), ("linear",)], ids="-".join)
def test_cuda_backward_bits(acts, shape, kind):
  _check(acts, shape, kind, "cuda")
