"""CUDA custom-call path of ``ops/gemm.py``: cuBLASLt FP8 GEMM ``a @ b.T``
(FFI handler in ``custom_calls/ffi/gemm.cc``).

Operands are ``ScaledTensor``s with the logical scale layout; the blockwise
scales are put back into cuBLASLt's layout by ``TileLayout.to_native``
(``tiling.py``), the inverse of the transpose/slice that ``quantize_cuda.py``
applied, which XLA cancels under ``jit``. The ``a_mode`` / ``b_mode``
attributes are the layouts' ``gemm_mode``. Everything the handler validates
is checked here first, at trace time, with an error naming the argument: FP8
operand dtypes (not E5M2 x E5M2), 2-D operands sharing K, M, N and K
multiples of 16 (FP8 tensor core GEMMs need 16-byte aligned leading
dimensions), the output dtype, scale dtypes and layouts, the scaling pair,
the bias and the residual. The handler repeats these checks for
direct ``ffi_call`` users; pointer alignment is the handler's alone (it tells
cuBLASLt the real alignment).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import tiling
from te_jax.ops.fp8 import ScaledTensor

__all__ = ["WORKSPACE", "gemm", "native_scale"]

_BIAS_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_OUT_DTYPES = _BIAS_DTYPES
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# cuBLASLt's scratch, a second (discarded) result so that XLA allocates it as
# a temporary: the handler then allocates nothing itself and can be recorded
# in XLA's command buffers (CUDA graphs). 32 MiB is what cuBLASLt's Hopper
# kernels may use; +256 bytes let the handler align it to 256.
WORKSPACE = jax.ShapeDtypeStruct(((32 << 20) + 256,), jnp.uint8)


def _layout(t: ScaledTensor, name: str) -> tiling.TileLayout:
  """The tiling-table row of operand ``t``; ValueError where the GEMM has none."""
  layout = tiling.layout_of(t.block_shape)
  if layout is None:
    known = ", ".join(str(l.block_shape) for l in tiling.LAYOUTS)
    raise ValueError(f"{name}.block_shape must be one of {known}, got {t.block_shape}.")
  return layout


def native_scale(t: ScaledTensor, name: str):
  """(layout, scale_inv in cuBLASLt's layout) for operand ``t`` (rows, K)."""
  rows, k = t.shape
  layout = _layout(t, name)
  s = jnp.asarray(t.scale_inv)
  if s.dtype != layout.scale_dtype:
    raise TypeError(f"{name}.scale_inv must be {layout.scale_dtype}, got {s.dtype}.")
  want = layout.scale_shape(rows, k)
  if s.shape != want:
    if layout.per_tensor:
      raise ValueError(f"{name}.scale_inv must be a scalar for per-tensor scaling, got {s.shape}.")
    raise ValueError(f"{name}.scale_inv must have shape {want} for block_shape "
                     f"{layout.block_shape}, got {s.shape}.")
  return layout, layout.to_native(s)


def gemm(a: ScaledTensor, b: ScaledTensor, out_dtype, bias: Optional[jax.Array] = None,
         fast_accum: bool = False, residual: Optional[jax.Array] = None) -> jax.Array:
  """``a @ b.T (+ bias) (+ residual)`` with a (M, K), b (N, K) FP8
  ScaledTensors, residual (M, N) of ``out_dtype``; returns (M, N)."""
  for name, t in (("a", a), ("b", b)):
    if len(t.shape) != 2:
      raise ValueError(f"{name}.data must be 2-D, got shape {t.shape}.")
    if jnp.dtype(t.dtype) not in (_E4M3, _E5M2):
      raise TypeError(f"{name}.data must be float8_e4m3fn or float8_e5m2, got {t.dtype}.")
  if jnp.dtype(a.dtype) == _E5M2 and jnp.dtype(b.dtype) == _E5M2:
    raise TypeError("E5M2 x E5M2 is not a supported FP8 GEMM; quantize one operand as E4M3.")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a (M, K) and b (N, K) must share K, got a {a.shape} and b {b.shape}.")
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}.")
  (m, k), (n, _) = a.shape, b.shape
  for name, val in (("a", m), ("b", n)):
    if val % 16:
      raise ValueError(f"{name}.shape[0] must be a multiple of 16 for the cuBLASLt FP8 GEMM, "
                       f"got {val} (pad the token dimension).")
  if k % 16:
    raise ValueError(f"a.shape[1] and b.shape[1] (K) must be multiples of 16 for the cuBLASLt "
                     f"FP8 GEMM, got {k}.")
  a_layout, a_s = native_scale(a, "a")
  b_layout, b_s = native_scale(b, "b")
  if (a_layout, b_layout) not in tiling.GEMM_PAIRS:
    raise ValueError(f"unsupported scaling pair a.block_shape={a.block_shape}, "
                     f"b.block_shape={b.block_shape}.")
  if bias is None:
    bias_arg = jnp.zeros((0,), jnp.bfloat16)
  else:
    if jnp.dtype(bias.dtype) not in _BIAS_DTYPES:
      raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}.")
    if bias.shape != (n,):
      raise ValueError(f"bias must have shape ({n},), got {bias.shape}.")
    bias_arg = bias
  if residual is None:
    residual_arg = jnp.zeros((0, 0), out_dtype)
  else:
    if jnp.dtype(residual.dtype) != jnp.dtype(out_dtype):
      raise TypeError(f"residual must have out_dtype ({jnp.dtype(out_dtype).name}), got "
                      f"{residual.dtype}.")
    if residual.shape != (m, n):
      raise ValueError(f"residual must have the output's shape {(m, n)}, got {residual.shape}.")
    residual_arg = residual
  out, _ = jax.ffi.ffi_call(
      "te_jax_gemm",
      (jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)), WORKSPACE))(
          a.data, b.data, a_s, b_s, bias_arg, residual_arg,
          a_mode=np.int64(a_layout.gemm_mode), b_mode=np.int64(b_layout.gemm_mode),
          fast_accum=np.int64(bool(fast_accum)), has_bias=np.int64(bias is not None),
          has_residual=np.int64(residual is not None))
  return out
