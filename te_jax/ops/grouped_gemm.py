"""Grouped GEMM: many experts' matrices in one call over rows grouped by expert.

Two products, both with the group sizes read from the device (no host sync,
static shapes, safe in CUDA graphs):

* :func:`grouped_gemm` -- ``lhs (m, k)``, ``rhs (g, k, n)``, ``group_sizes
  (g,)`` in ``jax.lax.ragged_dot``'s argument order: rows
  ``[start_e, start_e + group_sizes[e])`` of the output are
  ``lhs[those rows] @ rhs[e]``, with ``start_e`` the sum of the sizes before
  ``e``. Rows past ``sum(group_sizes)`` come out 0. The forward (fprop) and
  input-gradient (dgrad) GEMMs of an expert layer.
* :func:`grouped_wgrad` -- grouped over the contraction: ``lhs_t (k, m)``,
  ``rhs_t (n, m)`` (both contiguous along the grouped rows, the "TN" layout
  of the weight-gradient operands that the quantize ops write as their
  columnwise copy) give ``(g, k, n)``, one ``lhs_t[:, rows_e] @
  rhs_t[:, rows_e].T`` per group. The weight-gradient (wgrad) GEMM.
* :func:`grouped_wgrad_rows` -- the same product on float operands as they
  are stored: ``x (m, k)``, ``grad (m, n)`` give ``(g, k, n)``, one
  ``x[rows_e].T @ grad[rows_e]`` per group (``grouped_wgrad`` of ``x.T``
  and ``grad.T``, its reference). The FP8-off layers' wgrad: the bfloat16
  kernel reads the row-major operands directly, with any group sizes, where
  ``grouped_wgrad`` needs ``(k, m)`` and ``(n, m)`` arrays.

Operands are either both float arrays (the FP8-off path) or both FP8: the
``lhs`` a :class:`~te_jax.ops.fp8.ScaledTensor`, the ``rhs`` of
:func:`grouped_gemm` a :class:`GroupedScaledTensor` (one scale per group's
matrix, or per 128x128 block of it). Empty groups are allowed. The caller
pads every group to its recipe's token block (``ScalingMode.token_block``:
128 blockwise) so that no kernel tile and no 128-row scale tile of a
columnwise operand straddles two groups; the reference below computes what
the scales say for any sizes.

The CUDA path (``grouped_gemm_cuda``: te_jax's sm_90a kernels, built on
CUTLASS, in builds that found its headers) takes FP8 operands, or bfloat16
x bfloat16 operands (the FP8-off layers' GEMMs, fp32 accumulation), with a
bfloat16 output on Hopper, or a float32 one for FP8 wgrads (the gradient
of float32 weights, written once in its dtype); the dispatchers run the
reference for every other call (``impl="auto"`` warns why once). On bfloat16 operands the
kernel's result equals the reference's (exact products of the bfloat16
values, float32 sums) within the bfloat16 rounding of the output and the
order of the float32 sums. The reference (the spec)
dequantizes to float32 and, per group, multiplies row chunks of a static
size with a dynamic start: memory stays that of the operands and the
output (never a dense ``(g, m, ...)`` expansion, as ``jax.lax.ragged_dot``'s
default lowering builds), and the work is the dense product's plus at most
one chunk per group. Group sizes that cannot describe ``lhs`` (a negative
one, or a sum above ``m``) turn the whole output into NaN: they are device
data, so this is how a bad routing surfaces without a host sync.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops import _native
from te_jax.ops import grouped_gemm_cuda
from te_jax.ops.fp8 import (FP8_DTYPES, FP8Payload, ScaledTensor, dequantize_blockwise_reference,
                            fp8_payload)

__all__ = ["GroupedScaledTensor", "grouped_gemm_reference", "grouped_wgrad_reference",
           "grouped_gemm", "grouped_wgrad", "grouped_wgrad_rows", "chunk_rows", "varying_axes"]

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))
_FLOAT_DTYPES = _OUT_DTYPES
# (lhs block, rhs block) pairs, as the dense FP8 GEMM takes them.
_GEMM_BLOCKS = ((1, 128), (128, 128))
_WGRAD_BLOCKS = ((1, 128), (1, 128))
_HIGHEST = lax.Precision.HIGHEST
_log = logging.getLogger("te_jax")


@fp8_payload
class GroupedScaledTensor(FP8Payload):
  """A stack of FP8 matrices, one per group, with the scales that dequantize them.

  Attributes:
    data: float8 array (g, rows, cols).
    scale_inv: float32; (g,) for per-tensor scaling (one scale per group's
      matrix), or (g, ceil(rows / bm), ceil(cols / bk)) per tile.
    block_shape: None for per-tensor scaling, else (bm, bk).

  >>> t = GroupedScaledTensor(jnp.ones((2, 2, 3), jnp.float8_e4m3fn),
  ...                         jnp.array([0.5, 2.0], jnp.float32))
  >>> t.dequantize()[:, 0, 0].tolist()
  [0.5, 2.0]
  """

  data: jax.Array
  scale_inv: jax.Array
  block_shape: Optional[Tuple[int, int]] = None

  @property
  def T(self) -> "GroupedScaledTensor":  # pylint: disable=invalid-name
    """Each group's matrix transposed: (g, cols, rows); exact for per-tensor
    scales and square blocks (the dgrad GEMM reads the weight this way)."""
    self.check_transposable("quantize the transposed matrices instead.")
    s = self.scale_inv if self.block_shape is None else jnp.swapaxes(self.scale_inv, 1, 2)
    return GroupedScaledTensor(jnp.swapaxes(self.data, 1, 2), s, self.block_shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``data * scale_inv`` (broadcast per group, or per tile) in ``dtype``."""
    if self.block_shape is None:
      return (self.data.astype(jnp.float32) *
              self.scale_inv.astype(jnp.float32)[:, None, None]).astype(dtype)
    return jax.vmap(lambda d, s: dequantize_blockwise_reference(
        d, s, self.block_shape, dtype))(self.data, self.scale_inv)


Operand = Union[jax.Array, ScaledTensor, GroupedScaledTensor]


# ----------------------------------------------------------------- checks ---

def _is_fp8(t) -> bool:
  return isinstance(t, (ScaledTensor, GroupedScaledTensor))


def _check_operand(t, name, ndim, scaled_type):
  if _is_fp8(t):
    if not isinstance(t, scaled_type):
      raise TypeError(f"{name} must be a {scaled_type.__name__} (or a float array), got "
                      f"{type(t).__name__}.")
    if jnp.dtype(t.dtype) not in FP8_DTYPES:
      raise TypeError(f"{name}.data must be float8_e4m3fn or float8_e5m2, got {t.dtype}.")
    if jnp.dtype(t.scale_inv.dtype) != jnp.float32:
      raise TypeError(f"{name}.scale_inv must be float32, got {t.scale_inv.dtype}.")
  elif not hasattr(t, "dtype") or jnp.dtype(t.dtype) not in _FLOAT_DTYPES:
    raise TypeError(f"{name} must be a float32/bfloat16/float16 array or an FP8 "
                    f"{scaled_type.__name__}, got {getattr(t, 'dtype', type(t).__name__)}.")
  if len(t.shape) != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")
  if 0 in t.shape:
    raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}.")


def _check_scales(lhs, rhs, blocks, names):
  """FP8 operands: formats and scale layouts that a kernel takes."""
  a, b = names
  if lhs.dtype == jnp.float8_e5m2 and rhs.dtype == jnp.float8_e5m2:
    raise TypeError(f"E5M2 x E5M2 ({a} x {b}) is not a supported FP8 GEMM; quantize "
                    "one operand as E4M3.")
  if (lhs.block_shape is None) != (rhs.block_shape is None):
    raise ValueError(f"{a} and {b} must both be per-tensor or both blockwise scaled, got "
                     f"block shapes {lhs.block_shape} and {rhs.block_shape}.")
  if lhs.block_shape is None:
    if lhs.scale_inv.shape != ():
      raise ValueError(f"{a}.scale_inv must be a scalar (per tensor), got shape "
                       f"{lhs.scale_inv.shape}.")
    want = (rhs.shape[0],) if isinstance(rhs, GroupedScaledTensor) else ()
    if rhs.scale_inv.shape != want:
      raise ValueError(f"{b}.scale_inv must have shape {want} (per tensor"
                       f"{', one per group' if want else ''}), got {rhs.scale_inv.shape}.")
  elif (lhs.block_shape, rhs.block_shape) != blocks:
    raise ValueError(f"unsupported block-shape pair {lhs.block_shape} x {rhs.block_shape} "
                     f"for this grouped GEMM; supported: {blocks}.")


def _check_common(lhs, rhs, group_sizes, out_dtype, g):
  if _is_fp8(lhs) != _is_fp8(rhs):
    raise TypeError(f"lhs and rhs must both be FP8 (scaled tensors) or both float arrays, "
                    f"got {type(lhs).__name__} and {type(rhs).__name__}.")
  if not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.int32:
    raise TypeError(f"group_sizes must be an int32 array (on the device), got "
                    f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}.")
  if group_sizes.shape != (g,):
    raise ValueError(f"group_sizes must have shape ({g},) (one size per group), got "
                     f"{group_sizes.shape}.")
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}.")


def _check_gemm(lhs, rhs, group_sizes, out_dtype):
  _check_operand(lhs, "lhs", 2, ScaledTensor)
  _check_operand(rhs, "rhs", 3, GroupedScaledTensor)
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs (m, k) and rhs (g, k, n) must share k, got lhs "
                     f"{tuple(lhs.shape)} and rhs {tuple(rhs.shape)}.")
  _check_common(lhs, rhs, group_sizes, out_dtype, rhs.shape[0])
  if _is_fp8(lhs):
    _check_scales(lhs, rhs, _GEMM_BLOCKS, ("lhs", "rhs"))


def _check_wgrad_pair(a, b, names, layouts, grouped_dim, group_sizes, out_dtype):
  """Two 2-D wgrad operands called ``names``, of ``layouts`` (e.g. "(k, m)"),
  sharing the grouped dim m at ``grouped_dim``; and the group sizes."""
  _check_operand(a, names[0], 2, ScaledTensor)
  _check_operand(b, names[1], 2, ScaledTensor)
  if a.shape[grouped_dim] != b.shape[grouped_dim]:
    raise ValueError(f"{names[0]} {layouts[0]} and {names[1]} {layouts[1]} must share the "
                     f"grouped dim m, got {names[0]} {tuple(a.shape)} and {names[1]} "
                     f"{tuple(b.shape)}.")
  if getattr(group_sizes, "ndim", None) != 1:
    raise ValueError(f"group_sizes must be 1-D (g,), got shape "
                     f"{getattr(group_sizes, 'shape', None)}.")
  _check_common(a, b, group_sizes, out_dtype, group_sizes.shape[0])


def _check_wgrad(lhs_t, rhs_t, group_sizes, out_dtype):
  _check_wgrad_pair(lhs_t, rhs_t, ("lhs_t", "rhs_t"), ("(k, m)", "(n, m)"), 1, group_sizes,
                    out_dtype)
  if _is_fp8(lhs_t):
    _check_scales(lhs_t, rhs_t, _WGRAD_BLOCKS, ("lhs_t", "rhs_t"))


def _check_wgrad_rows(x, grad, group_sizes, out_dtype):
  for t, name in ((x, "x"), (grad, "grad")):
    if _is_fp8(t):
      raise TypeError(f"grouped_wgrad_rows takes float arrays, got an FP8 {type(t).__name__} "
                      f"{name}: FP8 tensor cores read the wgrad's operands contiguous along "
                      "the grouped m; pass the quantize's columnwise (k, m) and (n, m) copies "
                      "to grouped_wgrad.")
  _check_wgrad_pair(x, grad, ("x", "grad"), ("(m, k)", "(m, n)"), 0, group_sizes, out_dtype)


# ------------------------------------------------------------- reference ---

def chunk_rows(m: int, g: int) -> int:
  """Rows per step of the reference loop: the mean group size, rounded up to
  16 and at most ``m``. Balanced groups then take one product each, and the
  rows computed beyond the groups' own are at most one chunk per group."""
  mean = -(-m // max(g, 1))
  return min(m, -(-mean // 16) * 16)


def _as_float(t, dtype=None):
  """A float array of ``t`` (FP8 operands dequantized to float32)."""
  if _is_fp8(t):
    return t.dequantize(jnp.float32)
  return t if dtype is None else t.astype(dtype)


def _group_bounds(group_sizes):
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  return ends - sizes, ends


def varying_axes(*arrays) -> frozenset:
  """The mesh axes over which any of ``arrays`` may differ (inside
  ``shard_map`` with its type checks on; empty outside)."""
  axes = set()
  for t in arrays:
    ty = jax.typeof(t)
    mat = getattr(ty, "manual_axis_type", None)   # jax >= 0.10; older: ty.vma
    axes |= set(mat.varying if mat is not None else getattr(ty, "vma", ()))
  return frozenset(axes)


def _varying_like(init, *operands):
  """``init`` typed as varying over the mesh axes any operand varies over: a
  loop's carry must have the type of what the loop body makes of them."""
  axes = varying_axes(*operands)
  return lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


def _poison_if_invalid(out, group_sizes, m):
  """NaN everywhere when ``group_sizes`` cannot describe ``m`` rows
  (``grouped_gemm_cuda.sizes_fit``: also when their int32 sum would wrap)."""
  ok = grouped_gemm_cuda.sizes_fit(group_sizes, m)
  return jnp.where(ok, out, jnp.asarray(jnp.nan, out.dtype))


def _chunks(group_size, size, m):
  """Chunks of ``size`` rows that cover a group: its size clamped to m (a
  larger one is invalid and poisons the output anyway; unclamped, a size
  near 2**31 would loop 2**31 / size times)."""
  return -(-jnp.clip(group_size, 0, m) // size)


def _chunk_window(start, end, j, size, m):
  """Row window [r0c, r0c + size) of chunk ``j`` of group rows [start, end),
  clamped into [0, m), and the mask of its rows that belong to the chunk."""
  r0 = start + j * size
  r0c = jnp.minimum(r0, m - size)
  rows = r0c + jnp.arange(size, dtype=jnp.int32)
  return r0c, (rows >= r0) & (rows < jnp.minimum(end, r0 + size))


def grouped_gemm_reference(lhs: Operand, rhs: Operand, group_sizes: jax.Array,
                           out_dtype=jnp.bfloat16) -> jax.Array:
  """Per group ``e``: ``out[rows_e] = lhs[rows_e] @ rhs[e]`` in float32.

  Args:
    lhs: (m, k) float array or ``ScaledTensor`` (dequantized to float32).
    rhs: (g, k, n) float array or ``GroupedScaledTensor``.
    group_sizes: (g,) int32.
    out_dtype: output dtype.

  Returns:
    (m, n) ``out_dtype``; rows past ``sum(group_sizes)`` are 0.
  """
  a, b = _as_float(lhs), _as_float(rhs)
  (m, k), (g, _, n) = a.shape, b.shape
  size = chunk_rows(m, g)
  starts, ends = _group_bounds(group_sizes)

  def group(e, out):
    w = lax.dynamic_index_in_dim(b, e, keepdims=False)

    def chunk(j, out):
      r0c, mask = _chunk_window(starts[e], ends[e], j, size, m)
      part = lax.dot_general(lax.dynamic_slice_in_dim(a, r0c, size), w,
                             (((1,), (0,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
      old = lax.dynamic_slice_in_dim(out, r0c, size)
      new = jnp.where(mask[:, None], part.astype(out.dtype), old)
      return lax.dynamic_update_slice_in_dim(out, new, r0c, 0)

    return lax.fori_loop(0, _chunks(group_sizes[e], size, m), chunk, out)

  out = lax.fori_loop(0, g, group,
                      _varying_like(jnp.zeros((m, n), out_dtype), a, b, group_sizes))
  return _poison_if_invalid(out, group_sizes, m)


def grouped_wgrad_reference(lhs_t: Operand, rhs_t: Operand, group_sizes: jax.Array,
                            out_dtype=jnp.float32) -> jax.Array:
  """Per group ``e``: ``out[e] = lhs_t[:, rows_e] @ rhs_t[:, rows_e].T`` in float32.

  Args:
    lhs_t: (k, m) float array or ``ScaledTensor``.
    rhs_t: (n, m) float array or ``ScaledTensor``.
    group_sizes: (g,) int32.
    out_dtype: output dtype.

  Returns:
    (g, k, n) ``out_dtype``; an empty group's matrix is 0.
  """
  a, b = _as_float(lhs_t), _as_float(rhs_t)
  (k, m), n, g = a.shape, b.shape[0], group_sizes.shape[0]
  size = chunk_rows(m, g)
  starts, ends = _group_bounds(group_sizes)

  def group(e, out):
    def chunk(j, acc):
      r0c, mask = _chunk_window(starts[e], ends[e], j, size, m)
      cols = jnp.where(mask[None, :], lax.dynamic_slice_in_dim(a, r0c, size, axis=1), 0.0)
      return acc + lax.dot_general(cols, lax.dynamic_slice_in_dim(b, r0c, size, axis=1),
                                   (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                   preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, _chunks(group_sizes[e], size, m), chunk,
                        _varying_like(jnp.zeros((k, n), jnp.float32), a, b, group_sizes))
    return lax.dynamic_update_index_in_dim(out, acc.astype(out_dtype), e, 0)

  out = lax.fori_loop(0, g, group,
                      _varying_like(jnp.zeros((g, k, n), out_dtype), a, b, group_sizes))
  return _poison_if_invalid(out, group_sizes, m)


# ------------------------------------------------------------ dispatchers ---

@functools.lru_cache(maxsize=None)
def _log_reference(op: str, reason: str):
  # A warning, not INFO: on a GPU the reference is a loop of float32 GEMMs
  # on the CUDA cores, an order of magnitude slower than the kernel.
  _log.warning("te_jax: %s runs its pure-JAX reference on the GPU (impl='auto'), far "
               "slower than the kernel: %s. impl='cuda' makes this an error.", op, reason)


def _kernel_reason(a, b, out_dtype, axis, groups) -> str:
  """Why the CUDA kernel does not take this call ("" when it does)."""
  return (grouped_gemm_cuda.build_reason() or grouped_gemm_cuda.device_reason()
          or grouped_gemm_cuda.unsupported_reason(a, b, out_dtype, axis, groups))


def _run(op: str, impl: str, a, b, groups, out_dtype, axis, cuda_fn, reference_fn):
  """The reference or the CUDA kernel, as ``impl`` and the call allow.

  "reference", and "auto" where ``_native`` resolves to the reference (no
  GPU; or no native module, which ``_native`` warns about): the reference.
  Where the native module and a GPU exist but the kernel does not take the
  call (a build without the sm90 GEMMs, not a Hopper GPU, float operands
  other than bfloat16 x bfloat16, an output other than bfloat16, ...):
  "auto" warns why once and runs
  the reference; "cuda" raises a ValueError saying why. Otherwise
  ``_native.dispatch`` (the kernel on the GPU).
  """
  if _native.resolve_impl(impl) == "reference":
    return reference_fn()
  reason = _kernel_reason(a, b, out_dtype, axis, groups)
  if reason:
    if impl == "cuda":
      raise ValueError(f"impl='cuda': te_jax's grouped-GEMM CUDA kernel cannot run {op} here: "
                       f"{reason}. Pass impl='auto' or impl='reference' (the pure-JAX "
                       "reference).")
    _log_reference(op, reason)
    return reference_fn()
  return _native.dispatch(impl, cuda_fn, reference_fn)


def grouped_gemm(lhs: Operand, rhs: Operand, group_sizes: jax.Array, *,
                 out_dtype=jnp.bfloat16, fast_accum: bool = False,
                 impl: str = "auto") -> jax.Array:
  """Grouped GEMM over rows: ``out[rows_e] = lhs[rows_e] @ rhs[e]``.

  Args:
    lhs: (m, k) rows sorted by group: a float array, or a ``ScaledTensor``
      (per tensor, or 1x128 tiles along k).
    rhs: (g, k, n): a float array, or a ``GroupedScaledTensor`` (one scale
      per group's matrix, or 128x128 blocks).
    group_sizes: (g,) int32 on the device; groups may be empty; rows past
      their sum come out 0.
    out_dtype: bfloat16, float16 or float32.
    fast_accum: per-tensor FP8 only: reduced-precision accumulation for the
      kernel (the reference, and the kernel on bfloat16 operands, always
      accumulate in float32).
    impl: "auto", "cuda" or "reference". The CUDA kernel
      (``grouped_gemm_cuda``) takes FP8 operands, or bfloat16 x bfloat16,
      with a bfloat16 output on a Hopper GPU, in builds with the sm90 GEMMs;
      "auto" runs the reference elsewhere (a warning once per reason), "cuda"
      raises there.

  Returns:
    (m, n) array of ``out_dtype``.
  """
  _check_gemm(lhs, rhs, group_sizes, out_dtype)
  return _run("grouped_gemm", impl, lhs, rhs, group_sizes.shape[0], out_dtype,
              grouped_gemm_cuda.ROWS,
              lambda: grouped_gemm_cuda.grouped_gemm(lhs, rhs, group_sizes, fast_accum),
              lambda: grouped_gemm_reference(lhs, rhs, group_sizes, out_dtype))


def grouped_wgrad(lhs_t: Operand, rhs_t: Operand, group_sizes: jax.Array, *,
                  out_dtype=jnp.float32, fast_accum: bool = False,
                  impl: str = "auto") -> jax.Array:
  """Grouped GEMM over the contraction: ``out[e] = lhs_t[:, rows_e] @ rhs_t[:, rows_e].T``.

  Args:
    lhs_t: (k, m), rows of the grouped dim m sorted by group: a float array,
      or a ``ScaledTensor`` (per tensor, or 1x128 tiles along m).
    rhs_t: (n, m), the same layout and scaling.
    group_sizes: (g,) int32 on the device; groups may be empty. On FP8
      operands the CUDA kernel needs every group to be a multiple of 16
      (per tensor) or 128 (blockwise) -- the recipe's token block, to which
      the caller pads them; other sizes give an all-NaN result there
      (device data cannot raise). bfloat16 operands take any sizes (the
      kernel of :func:`grouped_wgrad_rows` on the transposes).
    out_dtype: bfloat16, float16 or float32 (the CUDA kernel writes
      bfloat16, and float32 for FP8 operands; float16 runs the reference).
    fast_accum, impl: as :func:`grouped_gemm` (a float32 output on the
      kernel accumulates split whatever ``fast_accum`` says).

  Returns:
    (g, k, n) array of ``out_dtype``.
  """
  _check_wgrad(lhs_t, rhs_t, group_sizes, out_dtype)
  return _run("grouped_wgrad", impl, lhs_t, rhs_t, group_sizes.shape[0], out_dtype,
              grouped_gemm_cuda.CONTRACTION,
              lambda: grouped_gemm_cuda.grouped_wgrad(lhs_t, rhs_t, group_sizes, fast_accum,
                                                      out_dtype),
              lambda: grouped_wgrad_reference(lhs_t, rhs_t, group_sizes, out_dtype))


def grouped_wgrad_rows(x: jax.Array, grad: jax.Array, group_sizes: jax.Array, *,
                       out_dtype=jnp.float32, impl: str = "auto") -> jax.Array:
  """Grouped wgrad on row-major operands: ``out[e] = x[rows_e].T @ grad[rows_e]``.

  ``grouped_wgrad(x.T, grad.T, ...)`` for operands as they are stored (its
  reference, ``grouped_wgrad_reference`` on the transposes, is this op's):
  the CUDA kernel reads ``x`` and ``grad`` in place, no transposes, any
  group sizes.

  Args:
    x: (m, k) float array, rows sorted by group (the layer's input).
    grad: (m, n) float array (the output gradient), the same rows.
    group_sizes: (g,) int32 on the device; groups may be empty.
    out_dtype: bfloat16, float16 or float32.
    impl: "auto", "cuda" or "reference". The CUDA kernel takes bfloat16 x
      bfloat16 with a bfloat16 output, k and n multiples of 8 (16-byte
      rows), on a Hopper GPU in builds with the sm90 GEMMs; "auto" runs the
      reference elsewhere (a warning once per reason), "cuda" raises there.

  Returns:
    (g, k, n) array of ``out_dtype``; an empty group's matrix is 0; all NaN
    when the sizes cannot describe m rows (a negative one, or a sum above m).

  Raises:
    TypeError for FP8 operands (they take :func:`grouped_wgrad` on their
    columnwise copies), ValueError/TypeError for bad shapes and dtypes.
  """
  _check_wgrad_rows(x, grad, group_sizes, out_dtype)
  return _run("grouped_wgrad_rows", impl, x, grad, group_sizes.shape[0], out_dtype,
              grouped_gemm_cuda.CONTRACTION_ROW_MAJOR,
              lambda: grouped_gemm_cuda.grouped_wgrad_rows(x, grad, group_sizes),
              lambda: grouped_wgrad_reference(x.T, grad.T, group_sizes, out_dtype))
