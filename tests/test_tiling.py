"""The ops tiling table (``te_jax/ops/tiling.py``), CPU.

* The table agrees with the C++ that reads its values: the GEMM mode ids
  and cuBLASLt scale modes of ``custom_calls/ffi/gemm.cc``, the kernels'
  ``ScaleMode`` enum and tile size. Each check is a function over source
  text, also run on made-up text that breaks it.
* The native scale layouts are where the kernels write each tile's scale.
* The ops, the dispatch and the recipes read the table: a layout added as
  one row reaches the GEMM's checks and its custom call without other edits.
"""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax import recipe
from te_jax.ops import act_quantize, concat_quantize, gemm, gemm_cuda, normalization
from te_jax.ops import quantize as qop
from te_jax.ops import tiling
from te_jax.ops.fp8 import ScaledTensor
from cuda_lowering import cuda_text, gpu_host  # pylint: disable=unused-import  (a fixture)

ROOT = __file__.rsplit("/tests/", 1)[0]
E4M3 = jnp.float8_e4m3fn


def _read(rel):
  with open(f"{ROOT}/{rel}", encoding="utf-8") as f:
    return f.read()


# ------------------------------------------------------- table vs the C++ --

def gemm_cc_modes(source):
  """{mode id: cuBLASLt scale mode name} of gemm.cc's ``ScaleMode(mode)``
  (the chain of ``mode == i ? CUBLASLT_..._<NAME>`` with a default)."""
  body = re.search(r"cublasLtMatmulMatrixScale_t ScaleMode\(int64_t mode\) \{(.*?)\}",
                   source, re.S).group(1)
  ids = {int(i): n for i, n in
         re.findall(r"mode == (\d+) \? CUBLASLT_MATMUL_MATRIX_SCALE_(\w+)", body)}
  default = re.search(r":\s*CUBLASLT_MATMUL_MATRIX_SCALE_(\w+);", body).group(1)
  ids.setdefault(0, default)
  return ids


def kernel_scale_modes(source):
  """{value} of the kernels' ``enum class ScaleMode`` (quantize.h)."""
  body = re.search(r"enum class ScaleMode : int \{(.*?)\};", source, re.S).group(1)
  return {int(v) for v in re.findall(r"=\s*(\d+)", body)}


def table_mismatches(gemm_cc, quantize_h, tile_cuh, layouts=tiling.LAYOUTS,
                     kernel_tile=tiling.KERNEL_TILE):
  bad = []
  cc = gemm_cc_modes(gemm_cc)
  for layout in layouts:
    if cc.get(layout.gemm_mode) != layout.cublas_scale_mode:
      bad.append(f"{layout.name}: gemm.cc maps mode {layout.gemm_mode} to "
                 f"{cc.get(layout.gemm_mode)}, the table to {layout.cublas_scale_mode}")
  if set(cc) != {l.gemm_mode for l in layouts}:
    bad.append(f"gemm.cc modes {sorted(cc)} are not the table's")
  if kernel_scale_modes(quantize_h) != {l.gemm_mode for l in layouts}:
    bad.append("kernels/quantize.h ScaleMode values are not the table's mode ids")
  tile = int(re.search(r"constexpr int kTile = (\d+);", tile_cuh).group(1))
  if tile != kernel_tile:
    bad.append(f"tile.cuh kTile {tile} != KERNEL_TILE {kernel_tile}")
  return bad


def test_table_agrees_with_the_cpp():
  assert table_mismatches(_read("custom_calls/ffi/gemm.cc"),
                          _read("custom_calls/kernels/quantize.h"),
                          _read("custom_calls/kernels/tile.cuh")) == []


def test_table_check_catches_a_mismatch():
  gemm_cc = _read("custom_calls/ffi/gemm.cc")
  swapped = gemm_cc.replace("mode == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F",
                            "mode == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F")
  assert swapped != gemm_cc
  quantize_h = _read("custom_calls/kernels/quantize.h")
  tile_cuh = _read("custom_calls/kernels/tile.cuh")
  assert any("1x128" in b for b in table_mismatches(swapped, quantize_h, tile_cuh))
  extra = quantize_h.replace("kBlock128 = 2,", "kBlock128 = 2,\n  kMx32 = 3,")
  assert any("quantize.h" in b for b in table_mismatches(gemm_cc, extra, tile_cuh))
  assert any("kTile" in b for b in table_mismatches(
      gemm_cc, quantize_h, tile_cuh.replace("kTile = 128;", "kTile = 64;")))


# --------------------------------------------------------- native layouts --

@pytest.mark.parametrize("m, k", [(256, 384), (130, 300), (1, 1), (16, 129), (512, 128)])
def test_native_layouts_are_where_the_kernels_write(m, k):
  # kernels/quantize.cu: 1x128 writes the scale of row r, K-tile j at
  # sinv[j * ld + r]; 128x128 the scale of block (i, j) at sinv[i * ld + j];
  # ld a multiple of 4 (custom_calls/README.md).
  for layout, want_shape in [
      (tiling.TILE_1X128, (-(-k // 128), -(-m // 4) * 4)),
      (tiling.BLOCK_128X128, (-(-m // 128), -(-(-(-k // 128)) // 4) * 4))]:
    logical = layout.scale_shape(m, k)
    assert layout.native_scale_shape(m, k) == want_shape
    s = jnp.arange(np.prod(logical), dtype=jnp.float32).reshape(logical) + 1
    native = np.asarray(layout.to_native(s))
    assert native.shape == want_shape
    for i, j in [(0, 0), (logical[0] - 1, logical[1] - 1), (logical[0] // 2, 0)]:
      where = (j, i) if layout.scales_transposed else (i, j)
      assert native[where] == s[i, j]
    assert np.count_nonzero(native) == s.size        # the padding is zeros
    np.testing.assert_array_equal(layout.from_native(jnp.asarray(native), m, k), s)
  assert tiling.PER_TENSOR.scale_shape(m, k) == tiling.PER_TENSOR.native_scale_shape(m, k) == ()


# ------------------------------------------------- everything reads the table --

def test_ops_modes_and_recipes_read_the_table():
  assert qop.MODES == act_quantize.MODES == concat_quantize.MODES == normalization.MODES \
      == tuple(tiling.QUANTIZE_MODES)
  for a, b in tiling.GEMM_PAIRS:
    assert a in tiling.LAYOUTS and b in tiling.LAYOUTS
  assert set(tiling.QUANTIZE_MODES.values()) <= set(tiling.LAYOUTS)
  # Float8BlockScaling quantizes x and grad through the fused ops' "blockwise"
  # mode: that mode must write their layout.
  mode = recipe.Float8BlockScaling().scaling_mode()
  assert mode.layout("x") is mode.layout("grad") is tiling.QUANTIZE_MODES["blockwise"]
  assert mode.layout("kernel") is tiling.BLOCK_128X128
  for a, b in [("x", "kernel"), ("grad", "kernel"), ("x", "grad")]:  # fprop, dgrad, wgrad
    assert (mode.layout(a), mode.layout(b)) in tiling.GEMM_PAIRS
  assert tiling.mode_layout("blockwise").block_shape == qop.quantize_by_mode_reference(
      jnp.ones((4, 256)), "blockwise", E4M3).block_shape
  with pytest.raises(ValueError, match="mode must be one of"):
    tiling.mode_layout("mxfp8")


def test_layout_of():
  assert tiling.layout_of(None) is tiling.PER_TENSOR
  assert tiling.layout_of([1, 128]) is tiling.TILE_1X128
  assert tiling.layout_of((128, 128)) is tiling.BLOCK_128X128
  assert tiling.layout_of((32, 64)) is None


def _scaled(rows, k, block):
  q = qop.quantize_blockwise_reference(
      jax.random.normal(jax.random.key(rows), (rows, k)), block, E4M3)
  return ScaledTensor(q.data, q.scale_inv, block)


def _gemm_custom_call(a, b):
  text = cuda_text(lambda a, b: gemm.gemm(a, b, out_dtype=jnp.float32), a, b)
  return re.search(r"custom_call @te_jax_gemm\((.*)", text).group(1)


def test_a_new_layout_is_one_row(monkeypatch, gpu_host):  # pylint: disable=unused-argument
  # A made-up 1x32 layout (mode 3, scales rows-contiguous as VEC128): before
  # its row exists the GEMM refuses it; with the row (and a pair) added to
  # the table, the reference GEMM takes it and the custom call gets its mode
  # id and native scale layout (the C++ would then need its kernels).
  a, b = _scaled(32, 256, (1, 32)), _scaled(48, 256, (1, 32))
  with pytest.raises(ValueError, match="unsupported block-shape pair"):
    gemm.gemm(a, b, impl="reference")
  row = tiling.TileLayout("1x32", (1, 32), jnp.dtype(jnp.float32), gemm_mode=3,
                          cublas_scale_mode="VEC32_32F", scales_transposed=True,
                          scale_ld_multiple=4)
  monkeypatch.setattr(tiling, "LAYOUTS", tiling.LAYOUTS + (row,))
  monkeypatch.setattr(tiling, "GEMM_PAIRS", tiling.GEMM_PAIRS + ((row, row),))
  want = a.dequantize() @ b.dequantize().T
  got = gemm.gemm(a, b, out_dtype=jnp.float32, impl="reference")
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
  call = _gemm_custom_call(a, b)
  assert "a_mode = 3" in call and "b_mode = 3" in call
  assert "tensor<8x32xf32>, tensor<8x48xf32>" in call    # (K/32, rows) scale grids


def test_gemm_custom_call_mode_ids(gpu_host):  # pylint: disable=unused-argument
  # The a_mode / b_mode attributes of each GEMM pair are the table's ids.
  for la, lb in tiling.GEMM_PAIRS:
    if la.per_tensor:
      one = jnp.float32(1.0)
      a = ScaledTensor(jnp.ones((32, 256), E4M3), one)
      b = ScaledTensor(jnp.ones((48, 256), E4M3), one)
    else:
      a, b = _scaled(32, 256, la.block_shape), _scaled(48, 256, lb.block_shape)
    call = _gemm_custom_call(a, b)
    assert f"a_mode = {la.gemm_mode}" in call and f"b_mode = {lb.gemm_mode}" in call


def test_gemm_cuda_names_the_table_when_refusing_a_block_shape():
  a = _scaled(32, 256, (32, 64))
  with pytest.raises(ValueError, match=r"a\.block_shape must be one of None, \(1, 128\)"):
    gemm_cuda.native_scale(a, "a")
