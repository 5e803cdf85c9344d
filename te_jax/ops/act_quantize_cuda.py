"""CUDA custom-call path of ``ops/act_quantize.py`` (FFI handlers in
``custom_calls/ffi/act_quantize.cc``, kernels in ``custom_calls/kernels/``).

One call reads h (and dz) and writes the FP8 copies asked for of v = act(h)
or dact(dz, h) plus the scales (and, for dact with ``act_columnwise``, the
columnwise copy of act(h)): v itself never reaches memory. dact also takes h
as its E4M3 ``ScaledTensor`` (1x128 tiles): bytes and scales go to the kernel; act with
``h_copy`` also writes that copy of h, from the h values it loads. A copy not asked
for is a (0, 0) placeholder result that the handler leaves alone. The
blockwise scales come back in the LOGICAL layout of ``quantize_blockwise``
through the layout's ``from_native`` (``tiling.py``), which ``gemm_cuda.py``
undoes (XLA cancels the pair under ``jit``). ``fp8_outputs``,
``scale_grid_outputs`` and ``selected_result`` serve ``normalization_cuda.py``
too.

Argument checks live in ``act_quantize.py``; this module assumes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import quantize_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor, ScaledTensor, nan_scale_inv_if_non_finite

__all__ = ["act_quantize", "check_shape", "fp8_outputs", "scale_grid_outputs",
           "selected_result", "supported"]

_F32 = jnp.float32
_NONE_2D = (0, 0)


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def supported(m: int, f: int, n_act: int) -> bool:
  """Whether the CUDA path takes h (m, n_act*f) (and dz (m, f)).

  Any m up to ``tiling.CUDA_MAX_ROWS`` (65535*128) and any f for one
  activation; gated units (n_act=2) need f % 8 == 0 (a thread's 8 output
  columns must not straddle h0 and h1).
  This checks shapes only, not whether a GPU or the native module is present
  (``impl="auto"`` falls back to the reference there by itself).
  """
  ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
             for v in (m, f, n_act))
  return (ints and n_act in (1, 2) and 1 <= m <= tiling.CUDA_MAX_ROWS and f >= 1 and
          (n_act == 1 or f % 8 == 0))


def check_shape(m: int, f: int, n_act: int, *, h_copy: bool = False, rowwise: bool = True):
  """ValueError unless ``supported(m, f, n_act)`` and, with ``h_copy`` (h's
  E4M3 copy from the forward kernel), F % 128 == 0 and ``rowwise``."""
  if not supported(m, f, n_act):
    raise ValueError(
        f"the CUDA act_quantize kernels do not take M={m}, F={f}, n_act={n_act}: they "
        f"need M <= {tiling.CUDA_MAX_ROWS} and, for a gated unit, F % 8 == 0. Check "
        f"act_quantize_supported(m, f, n_act) first, or pass impl='reference'.")
  if h_copy and (f % 128 or not rowwise):
    # The 16 lanes of a kernel's row group hold one whole 1x128 tile of h0
    # (and of h1); the forward kernels that write h's copy also write z rowwise.
    raise ValueError(
        f"h_copy=True on the CUDA path needs F % 128 == 0 and rowwise=True, got F={f}, "
        f"rowwise={rowwise}: quantize h with quantize_blockwise instead, or pass "
        f"impl='reference'.")


def fp8_outputs(m: int, k: int, dtype, rowwise: bool, columnwise: bool):
  """Result shapes of the two FP8 copies of an (m, k) tensor; (0, 0) for one not asked for."""
  return (_sds((m, k) if rowwise else _NONE_2D, dtype),
          _sds((k, m) if columnwise else _NONE_2D, dtype))


def scale_grid_outputs(m: int, k: int, layout: tiling.TileLayout, rowwise: bool,
                       columnwise: bool):
  """The native scale grids of a blockwise quantization of an (m, k) tensor,
  (0, 0) for a copy not asked for."""
  s, st = quantize_cuda.native_scale_shapes(m, k, layout)
  return (_sds(s if rowwise else _NONE_2D, layout.scale_dtype),
          _sds(st if columnwise else _NONE_2D, layout.scale_dtype))


def selected_result(mode: str, m: int, k: int, data, scale_inv, data_t, scale_inv_t, amax,
                    rowwise: bool, columnwise: bool) -> QuantizedTensor:
  """The ``QuantizedTensor`` of a kernel's results, as the reference returns it
  (``quantize_copies.quantize_selected_reference``): a copy not asked for is
  None with its scales, except the per-tensor scale_inv (one for both);
  blockwise scales from the native grids; per-tensor ones NaN where ``amax``
  is not finite (a given scale saturates an Inf)."""
  if mode == "blockwise":
    layout = tiling.mode_layout(mode)
    return QuantizedTensor(data if rowwise else None,
                           layout.from_native(scale_inv, m, k) if rowwise else None,
                           data_t if columnwise else None,
                           layout.from_native(scale_inv_t, k, m) if columnwise else None,
                           None, layout.block_shape)
  q = QuantizedTensor(data if rowwise else None, scale_inv, data_t if columnwise else None,
                      scale_inv if columnwise else None, amax)
  return nan_scale_inv_if_non_finite(q) if mode == "tensorwise" else q


def _h_copy_outputs(m: int, width: int, h_copy: bool):
  """h's E4M3 copy (m, width) and its 1x128 scale_inv (m, width / 128) in the
  logical layout, or (0, 0) placeholders. The data placeholder is uint8, not
  FP8: it is no FP8 copy of anything (and the FP8 results of a call are the
  copies of z it may write)."""
  if not h_copy:
    return _sds(_NONE_2D, jnp.uint8), _sds(_NONE_2D, _F32)
  return _sds((m, width), jnp.float8_e4m3fn), _sds((m, width // 128), _F32)


def _with_extra(q, z_t, h_fp8, h_sinv):
  """q alone, or with the extra result asked for: act(h)'s columnwise copy
  ``z_t`` (dact), or h's E4M3 copy from ``h_fp8`` and its tile scales (act)."""
  if z_t is not None:
    return q, z_t
  if h_fp8 is not None:
    return q, ScaledTensor(h_fp8, h_sinv, (1, 128))
  return q


def act_quantize(h, dz, kernel_ids, mode: str, dtype, scale, power_2_scale: bool, *,
                 rowwise: bool = True, columnwise: bool = True, act_columnwise=None,
                 h_copy: bool = False):
  """The ``QuantizedTensor`` of act(h) (``dz`` None) or of dact(dz, h), and
  with ``act_columnwise`` (dact only) also act(h)'s columnwise ``ScaledTensor``,
  with ``h_copy`` (act only) h's E4M3 ``ScaledTensor`` in 1x128 tiles.

  ``kernel_ids``: one or two ``ActId``s (``Activation.kernel_id``); see
  ``act_quantize.act_quantize`` / ``dact_quantize`` for the shapes.
  """
  backward = dz is not None
  n_act = len(kernel_ids)
  m = h.shape[0]
  f = h.shape[1] // n_act
  w = n_act * f if backward else f
  # An FP8 h (dact only, checked by act_quantize.py): its E4M3 bytes and
  # 1x128 tile scales go to the kernel, which dequantizes as it reads, in
  # dz's element type. Otherwise h_scale is a (0, 0) placeholder.
  h_scale = jnp.zeros(_NONE_2D, _F32)
  if isinstance(h, ScaledTensor):
    h, h_scale = h.data, h.scale_inv
  elif backward and dz.dtype != h.dtype:
    # The kernels read both inputs with one element type. Widening to the
    # common type is exact, so the float32 values (and the result) are those
    # of the reference; it costs one XLA convert pass.
    common = jnp.promote_types(dz.dtype, h.dtype)
    h, dz = h.astype(common), dz.astype(common)
  # The forward has no dz: a 0-element placeholder keeps one handler per mode.
  dz_arg = dz if backward else jnp.zeros(_NONE_2D, h.dtype)
  attrs = dict(backward=np.int64(backward), act0=np.int64(kernel_ids[0]),
               act1=np.int64(kernel_ids[1] if n_act == 2 else -1))
  spec = act_columnwise
  fp8 = fp8_outputs(m, w, dtype, rowwise, columnwise)
  # act(h)'s copy: (F, M) FP8 and its scales, or placeholders; per tensor
  # also its scale ("tensorwise") or the forward's amax ("current").
  act_operand = jnp.zeros((0,), _F32)
  if spec is None:
    act_outs = (_sds(_NONE_2D, dtype),
                _sds(_NONE_2D if mode == "blockwise" else (0,), _F32))
  elif mode == "blockwise":
    act_outs = (_sds((f, m), spec.dtype),
                scale_grid_outputs(m, f, tiling.mode_layout(mode), False, True)[1])
  else:
    act_outs = (_sds((f, m), spec.dtype), _sds((), _F32))
    act_operand = jnp.asarray(spec.scale if mode == "tensorwise" else spec.amax, _F32)
  act_outs = act_outs + _h_copy_outputs(m, n_act * f, h_copy)

  if mode == "blockwise":
    grids = scale_grid_outputs(m, w, tiling.mode_layout(mode), rowwise, columnwise)
    data, s, data_t, st, act_t, act_st, h_fp8, h_sinv = jax.ffi.ffi_call(
        "te_jax_act_quantize_blockwise", (fp8[0], grids[0], fp8[1], grids[1]) + act_outs)(
            h, dz_arg, h_scale, power_2_scale=np.int64(bool(power_2_scale)),
            act_power_2_scale=np.int64(spec is not None and spec.power_2_scale), **attrs)
    q = selected_result(mode, m, w, data, s, data_t, st, None, rowwise, columnwise)
    layout = tiling.mode_layout(mode)
    z_t = None if spec is None else ScaledTensor(act_t, layout.from_native(act_st, f, m),
                                                 layout.block_shape)
    return _with_extra(q, z_t, h_fp8 if h_copy else None, h_sinv)

  scalars = (_sds((), _F32), _sds((), _F32))   # scale_inv, amax
  if mode == "tensorwise":
    data, data_t, scale_inv, amax, act_t, act_s, h_fp8, h_sinv = jax.ffi.ffi_call(
        "te_jax_act_quantize_tensorwise", fp8 + scalars + act_outs)(
            h, dz_arg, h_scale, jnp.asarray(scale, _F32), act_operand, **attrs)
  else:   # current
    data, data_t, scale_inv, amax, act_t, act_s, h_fp8, h_sinv = jax.ffi.ffi_call(
        "te_jax_act_quantize_current", fp8 + scalars + act_outs)(
            h, dz_arg, h_scale, act_operand, power_2_scale=np.int64(bool(power_2_scale)),
            **attrs)
  q = selected_result(mode, m, w, data, scale_inv, data_t, scale_inv, amax, rowwise, columnwise)
  # The act(h) copy's scale_inv, NaN where the forward's amax is not finite
  # (for "current" the kernel's NaN scale already made it NaN).
  z_t = None if spec is None else ScaledTensor(
      act_t, jnp.where(jnp.isfinite(spec.amax), act_s, jnp.float32(jnp.nan)))
  return _with_extra(q, z_t, h_fp8 if h_copy else None, h_sinv)
