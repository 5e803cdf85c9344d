"""CUDA custom-call path of ``ops/gemm.py``: cuBLASLt FP8 GEMM ``a @ b.T``
(FFI handler in ``custom_calls/ffi/gemm.cc``).

Operands are ``ScaledTensor``s with the logical scale layout; the blockwise
scales are put back into cuBLASLt's layout with the inverse of the
transpose/slice that ``quantize_cuda.py`` applied, which XLA cancels under
``jit``. Everything the handler validates is checked here first, at trace
time, with an error naming the argument: FP8 operand dtypes (not E5M2 x E5M2),
2-D operands sharing K, M, N and K multiples of 16 (FP8 tensor core GEMMs need
16-byte aligned leading dimensions), the output dtype, scale dtypes and
layouts, the scaling pair and the bias. The handler repeats these checks for
direct ``ffi_call`` users; pointer alignment is the handler's alone (it tells
cuBLASLt the real alignment).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops.fp8 import ScaledTensor

__all__ = ["WORKSPACE", "gemm", "native_scale"]

_MODES = {None: 0, (1, 128): 1, (128, 128): 2}
_BIAS_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_OUT_DTYPES = _BIAS_DTYPES
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# cuBLASLt's scratch, a second (discarded) result so that XLA allocates it as
# a temporary: the handler then allocates nothing itself and can be recorded
# in XLA's command buffers (CUDA graphs). 32 MiB is what cuBLASLt's Hopper
# kernels may use; +256 bytes let the handler align it to 256.
WORKSPACE = jax.ShapeDtypeStruct(((32 << 20) + 256,), jnp.uint8)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def native_scale(t: ScaledTensor, name: str):
  """(mode, scale_inv in cuBLASLt's layout) for operand ``t`` (rows, K)."""
  rows, k = t.shape
  bs = None if t.block_shape is None else tuple(t.block_shape)
  if bs not in _MODES:
    raise ValueError(f"{name}.block_shape must be None, (1, 128) or (128, 128), got {bs}.")
  s = jnp.asarray(t.scale_inv)
  if s.dtype != jnp.float32:
    raise TypeError(f"{name}.scale_inv must be float32, got {s.dtype}.")
  if bs is None:
    if s.shape != ():
      raise ValueError(f"{name}.scale_inv must be a scalar for per-tensor scaling, got {s.shape}.")
    return 0, s
  want = (_cdiv(rows, bs[0]), _cdiv(k, bs[1]))
  if s.shape != want:
    raise ValueError(f"{name}.scale_inv must have shape {want} for block_shape {bs}, "
                     f"got {s.shape}.")
  if bs == (1, 128):
    return 1, s.T  # (ceil(K/128), rows), rows contiguous; rows % 16 == 0 so no padding
  kb = want[1]
  pad = -kb % 4  # leading dimension of the BLK128x128 grid is a multiple of 4
  return 2, (jnp.pad(s, ((0, 0), (0, pad))) if pad else s)


def gemm(a: ScaledTensor, b: ScaledTensor, out_dtype, bias: Optional[jax.Array] = None,
         fast_accum: bool = False) -> jax.Array:
  """``a @ b.T`` with a (M, K), b (N, K) FP8 ScaledTensors; returns (M, N)."""
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
  a_mode, a_s = native_scale(a, "a")
  b_mode, b_s = native_scale(b, "b")
  if (a_mode == 0) != (b_mode == 0) or (a_mode == 2 and b_mode == 2):
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
  out, _ = jax.ffi.ffi_call(
      "te_jax_gemm",
      (jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)), WORKSPACE))(
          a.data, b.data, a_s, b_s, bias_arg,
          a_mode=np.int64(a_mode), b_mode=np.int64(b_mode),
          fast_accum=np.int64(bool(fast_accum)), has_bias=np.int64(bias is not None))
  return out
