"""dact_quantize with h given as its FP8 copy (``store_act_input_in_fp8``).

h as an E4M3 ``ScaledTensor`` in 1x128 tiles with power-of-two scales must
give the bytes and scales of h dequantized to dz's dtype, bit for bit: on
the reference path (the spec), and on the GPU, where the kernel reads the
E4M3 bytes and tile scales itself (``gpu`` marker, skipped elsewhere).
Bad FP8 operands fail at trace time with an error naming h.
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

E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
ACTS = [("silu", "linear"), ("gelu",)]


def _inputs(acts, m=256, f=384, seed=0):
  """dz (M, F) bf16 and h's FP8 copy (M, n_act*F): 1x128 E4M3 tiles, power-of-two
  scales, tiles of very different magnitudes so that the scales matter."""
  rng = np.random.default_rng(zlib.crc32(repr((acts, m, f, seed)).encode()))
  w = len(acts) * f
  tile_mag = 2.0 ** rng.integers(-6, 7, size=(m, -(-w // 128)))
  h = rng.standard_normal((m, w)) * np.repeat(tile_mag, 128, axis=1)[:, :w]
  h_fp8 = quantize_op.quantize_blockwise(jnp.asarray(h, BF16), (1, 128), E4M3,
                                         power_2_scale=True, impl="reference").rowwise()
  dz = jnp.asarray(rng.standard_normal((m, f)), BF16)
  return dz, h_fp8


def _mode_kw(mode):
  if mode == "tensorwise":
    return dict(mode=mode, dtype=E5M2, scale=jnp.float32(2000.0))
  return dict(mode=mode, dtype=E5M2, power_2_scale=mode == "blockwise")


def _act_spec(mode):
  if mode == "blockwise":
    return aq.ActColumnwise(mode, E4M3, power_2_scale=True)
  if mode == "tensorwise":
    return aq.ActColumnwise(mode, E4M3, scale=jnp.float32(30.0), amax=jnp.float32(5.0))
  return aq.ActColumnwise(mode, E4M3, amax=jnp.float32(7.0))


def _leaves_equal(got, want, tag):
  g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  assert len(g) == len(w), tag
  for i, (a, b) in enumerate(zip(g, w)):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{tag} leaf {i}"
    np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                  np.asarray(b).reshape(-1).view(np.uint8),
                                  err_msg=f"{tag} leaf {i}")


def _fp8_vs_dequantized(acts, mode, with_act, impl):
  dz, h = _inputs(acts)
  kw = dict(_mode_kw(mode), impl=impl)
  if with_act:
    kw["act_columnwise"] = _act_spec(mode)
  run = jax.jit(lambda dz, h: aq.dact_quantize(dz, h, acts, **kw))
  return run(dz, h), run(dz, h.dequantize(BF16))


@pytest.mark.parametrize("with_act", [False, True])
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("acts", ACTS, ids="-".join)
def test_fp8_h_equals_dequantized_h(acts, mode, with_act):
  got, want = _fp8_vs_dequantized(acts, mode, with_act, "reference")
  _leaves_equal(got, want, f"{acts} {mode} act_columnwise={with_act}")


def test_the_scales_are_read():
  """Mutation check: h with its scales replaced by ones (what a path that
  ignored them would compute) gives other bytes."""
  acts = ("silu", "linear")
  dz, h = _inputs(acts)
  ones = ScaledTensor(h.data, jnp.ones_like(h.scale_inv), h.block_shape)
  kw = _mode_kw("blockwise")
  got = aq.dact_quantize(dz, h, acts, impl="reference", **kw)
  wrong = aq.dact_quantize(dz, ones, acts, impl="reference", **kw)
  assert not np.array_equal(np.asarray(got.data).view(np.uint8),
                            np.asarray(wrong.data).view(np.uint8))
  assert not np.array_equal(np.asarray(got.scale_inv), np.asarray(wrong.scale_inv))


def _bad_h_cases():
  _, h = _inputs(("gelu",), m=128, f=256)
  blocks = ScaledTensor(h.data, h.scale_inv, (128, 128))
  e5m2 = ScaledTensor(h.data.astype(E5M2), h.scale_inv, h.block_shape)
  short = ScaledTensor(h.data, h.scale_inv[:, :1], h.block_shape)
  f16_scales = ScaledTensor(h.data, h.scale_inv.astype(jnp.float16), h.block_shape)
  per_tensor = ScaledTensor(h.data, jnp.float32(1.0))
  return [("block_shape", blocks, ValueError, "block_shape"),
          ("e5m2", e5m2, TypeError, "float8_e4m3fn"),
          ("scale shape", short, ValueError, r"float32 scale_inv of shape \(128, 2\)"),
          ("scale dtype", f16_scales, ValueError, "float32 scale_inv of shape"),
          ("per tensor", per_tensor, ValueError, "block_shape")]


@pytest.mark.parametrize("impl", ["reference", "cuda"])
@pytest.mark.parametrize("case", _bad_h_cases(), ids=lambda c: c[0])
def test_bad_fp8_h_is_refused(case, impl):
  _, bad, err, msg = case
  dz = jnp.zeros((128, 256), BF16)
  for fn in (aq.dact_quantize, aq.dact_quantize_reference):
    kw = dict(impl=impl) if fn is aq.dact_quantize else {}
    with pytest.raises(err, match=msg):
      jax.eval_shape(lambda dz, fn=fn, kw=kw: fn(dz, bad, ("gelu",), **_mode_kw("current"),
                                                 **kw), dz)


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("with_act", [False, True])
@pytest.mark.parametrize("mode", aq.MODES)
@pytest.mark.parametrize("acts", ACTS + [("relu",), ("gelu", "linear")], ids="-".join)
def test_cuda_fp8_h_equals_cuda_dequantized_h(acts, mode, with_act):
  """The kernel reading E4M3 h + tile scales writes the bytes and scales of
  the same kernels on h dequantized to bf16, bit for bit (the dequantized
  values are exact in bf16; the bf16 path is compared with the reference in
  tests/test_act_quantize.py)."""
  got, want = _fp8_vs_dequantized(acts, mode, with_act, "cuda")
  _leaves_equal(got, want, f"cuda {acts} {mode} act_columnwise={with_act}")


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
def test_cuda_fp8_h_edge_tiles_and_nonfinite():
  """Edge tiles (M, F not multiples of 128; a 1x128 tile of h straddling h0
  and h1) and a tile with an Inf (NaN scale): still the dequantized path's bytes."""
  acts = ("silu", "linear")
  rng = np.random.default_rng(7)
  h = rng.standard_normal((200, 2 * 136)) * 3
  h[77, 5] = np.inf
  h_fp8 = quantize_op.quantize_blockwise(jnp.asarray(h, BF16), (1, 128), E4M3,
                                         power_2_scale=True, impl="reference").rowwise()
  dz = jnp.asarray(rng.standard_normal((200, 136)), BF16)
  for mode in aq.MODES:
    kw = dict(_mode_kw(mode), impl="cuda")
    run = jax.jit(lambda dz, h, kw=kw: aq.dact_quantize(dz, h, acts, **kw))
    _leaves_equal(run(dz, h_fp8), run(dz, h_fp8.dequantize(BF16)), f"edge {mode}")


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
def test_cuda_writes_no_16_bit_copy_of_h():
  """The compiled CUDA path hands the E4M3 bytes to the custom call: no XLA
  op produces h (256, 768) in bf16 (the dequantize this path replaces)."""
  acts = ("silu", "linear")
  dz, h = _inputs(acts)
  f = jax.jit(lambda dz, h: aq.dact_quantize(dz, h, acts, mode="blockwise", dtype=E5M2,
                                             impl="cuda"))
  hlo = f.lower(dz, h).compile().as_text()
  assert "te_jax_act_quantize_blockwise" in hlo
  assert "= bf16[256,768]" not in hlo, "h dequantized to bf16 in the compiled HLO"


@pytest.mark.gpu
@pytest.mark.skipif(not _native.cuda_available(),
                    reason="needs a GPU and the te_jax CUDA custom calls")
@pytest.mark.parametrize("dz_dtype", [jnp.float16, jnp.float32])
def test_cuda_fp8_h_with_other_dz_dtypes(dz_dtype):
  """h is read in dz's element type: float16 and float32 dz (the kernels'
  generic loop) give the bytes of h dequantized to that type."""
  acts = ("silu", "linear")
  dz, h = _inputs(acts)
  dz = dz.astype(dz_dtype)
  for mode in aq.MODES:
    kw = dict(_mode_kw(mode), impl="cuda")
    run = jax.jit(lambda dz, h, kw=kw: aq.dact_quantize(dz, h, acts, **kw))
    _leaves_equal(run(dz, h), run(dz, h.dequantize(dz_dtype)), f"{dz_dtype} {mode}")
