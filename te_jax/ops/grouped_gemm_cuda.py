"""CUDA custom-call path of ``ops/grouped_gemm.py``: te_jax's sm_90a grouped GEMMs (FP8 and bf16).

FFI handler ``custom_calls/ffi/grouped_gemm.cc`` (target
``te_jax_grouped_gemm``), kernels ``custom_calls/kernels/grouped_gemm_sm90*``
(built on CUTLASS; in the native module only when its build found the
CUTLASS headers, which the build note records: :func:`build_reason`).

The kernel computes, with a bfloat16 output (or float32 for FP8 wgrads),
on FP8 operands with their scales or on bfloat16 operands without (the FP8-off layers' GEMMs;
``scaling`` attribute ``NONE``), with both operands contiguous along the
contraction ("TN", as Hopper's FP8 tensor cores read them):

* ``axis=0`` (rows): ``a (m, k)``, ``b (g, n, k)`` -> ``(m, n)``,
  ``out[rows_e] = a[rows_e] @ b[e].T``;
* ``axis=1`` (contraction): ``a (m, k)``, ``b (n, k)`` -> ``(g, m, n)``,
  ``out[e] = a[:, cols_e] @ b[:, cols_e].T``;

and, bfloat16 only, on row-major operands read contiguous along their
columns (wgmma takes 16-bit operands in either order):

* ``axis=2`` (contraction over row-major operands): ``a (m, k)``, ``b (m,
  n)`` -> ``(g, k, n)``, ``out[e] = a[rows_e].T @ b[rows_e]``: the FP8-off
  wgrad on the activations and gradients as stored (:func:`grouped_wgrad_rows`).

Layout conversions from te_jax's operands (XLA ops here; per call):

* :func:`grouped_gemm`: ``rhs.data (g, k, n)`` is transposed to ``(g, n, k)``:
  one pass over the FP8 expert weights (``g*k*n`` bytes read and written),
  except for the dgrad operand ``kernel.T``, whose transpose this one
  cancels under ``jit``. The 1x128 scales of ``lhs`` are re-laid per group
  (:func:`rows_scales_compact`: a scatter of ``m * ceil(k/128)`` floats whose
  destinations come from a scan of ``group_sizes`` on the device); the
  128x128 scales of ``rhs`` are transposed per expert
  (``g * ceil(k/128) * ceil(n/128)`` floats).
* :func:`grouped_wgrad`: ``lhs_t (k, m)`` and ``rhs_t (n, m)`` are already
  contiguous along the grouped ``m``; their scales go to the compact
  transposed grid (the quantize's native layout without its row padding).
  A float32 result (the wgrad of float32 weights) comes from the kernels
  with a float32 epilogue: E4M3 ``lhs_t`` with E4M3 or, per tensor, E5M2
  ``rhs_t`` (HYBRID's ``x.T`` and ``grad.T``) in their own order, no pass
  after the GEMM. A bfloat16 one: the per-tensor bfloat16 kernels take E5M2
  only as their first operand, so E4M3 ``lhs_t`` with E5M2 ``rhs_t`` is
  computed as ``out[e].T = rhs_t @ lhs_t.T`` and the ``(g, n, k)`` result
  transposed: one pass over the output. Other pairs asked for float32
  (E5M2 ``lhs_t``) are computed in bfloat16 and widened.

bfloat16 operands: no scales (the handler takes 1-element float32 dummies,
:func:`_no_scales`, and reads nothing from them). The rows GEMM transposes
``rhs`` as FP8 does. The wgrad runs on ``axis=2``, which takes any group
sizes: each group's rows of ``a`` and ``b`` start at ``start * k`` and
``start * n`` elements, 16-byte aligned whenever ``k`` and ``n`` are
multiples of 8 (``axis=1`` needs every group's slice of a ``(k, m)`` row to
start 16-byte aligned, which FP8-off layers, padding no groups, do not
give). :func:`grouped_wgrad` on bfloat16 ``(k, m)`` and ``(n, m)`` operands
passes their transposes (free under ``jit`` when they are transposes
themselves). The kernel's result equals ``grouped_*_reference`` on the
same bf16 values (the spec: exact products, float32 sums) within the
bfloat16 rounding of the output and the order of the float32 sums.

Why compact scales: CUTLASS's grouped blockwise mainloop
(``sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp``,
``load_init``) does not read the per-group scale layouts it is given; it
builds each group's from the group's problem shape
(``Sm90BlockwiseScaleConfig::tile_atom_to_shape_SFA/SFB``): 1x128 scales
(row i, k-block j) at ``i + j * rows`` of the group (k-block stride exactly
its row count), 128x128 scales (row block r, k-block j) at
``r * ceil(k/128) + j``. So each group's scales must be stored that way
from its scale pointer. The handler (``custom_calls/ffi/grouped_gemm.cc``)
checks the scale operands' shapes against the native layouts'
(``tiling.TileLayout.native_scale_shape``), which are never smaller than
the compact buffers: the compact floats come first, zeros fill the rest
(:func:`_in_native_shape`).

:func:`unsupported_reason` says which calls the kernel does not take (the
dispatcher then runs the reference, logged); every argument it checks is
checked here again with a ValueError, as the handler checks them once more
for direct ``ffi_call`` users.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import _native
from te_jax.ops import tiling

__all__ = ["TARGET", "ROWS", "CONTRACTION", "CONTRACTION_ROW_MAJOR", "PER_TENSOR", "BLOCKWISE",
           "NONE", "MAX_GROUPS", "KernelOperands", "workspace_bytes", "build_reason",
           "device_reason", "unsupported_reason", "auto_reference_reason", "group_bounds",
           "sizes_fit", "rows_scales_compact", "rows_operands", "contraction_operands",
           "row_major_wgrad_operands", "grouped_gemm", "grouped_wgrad", "grouped_wgrad_rows"]

TARGET = "te_jax_grouped_gemm"
ROWS, CONTRACTION, CONTRACTION_ROW_MAJOR = 0, 1, 2   # the handler's ``axis`` attribute
PER_TENSOR, BLOCKWISE, NONE = 0, 1, 2   # its ``scaling`` attribute (NONE: bf16 operands)
MAX_GROUPS = 6144                  # the setup kernel keeps the sizes in 48 KiB of shared memory
_INT32_MAX = 2 ** 31 - 1
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
_BF16 = jnp.dtype(jnp.bfloat16)
_TMA_BYTES = 16                    # a TMA row (and each group's slice of one) starts 16-byte aligned
_BUILT = "sm90 GEMMs: built"
_LEFT_OUT = "sm90 GEMMs: left out ("


def workspace_bytes(groups: int) -> int:
  """Scratch bytes of one call with ``groups`` groups, from static things only.

  The kernel's per-group arrays (problem shape, pointers, strides, scale
  layouts, alpha: under 200 bytes a group) and CUTLASS's TMA descriptors
  (about 512 bytes per SM) fit 1 KiB per group plus 1 MiB with room to
  spare; +256 lets the handler align the start. The handler checks the
  exact need (``GroupedGemmWorkspace``) and names both numbers if short.
  """
  return (1 << 20) + 1024 * groups + 256


@functools.lru_cache(maxsize=None)
def _build_note() -> str:
  """``_native.build_note()``, read once per process (it comes with the module)."""
  return _native.build_note()


def build_reason(note: str = None) -> str:
  """"" when the native module was built with the sm90 GEMMs, else why not
  (read from the build note, or ``note`` when given)."""
  note = _build_note() if note is None else note
  if _BUILT in note:
    return ""
  if _LEFT_OUT in note:
    why = note.split(_LEFT_OUT, 1)[1].rsplit(")", 1)[0]
    return f"the native module was built without the sm90 GEMMs ({why})"
  return ("the native module's build note does not list the sm90 GEMMs (built without "
          "CUTLASS headers, or by an older build)")


def device_reason(device=None) -> str:
  """"" when ``device`` (default: the default backend's first) is a Hopper
  GPU (compute capability 9.0, what the sm_90a kernels run on) or does not
  say, else why not."""
  cc = getattr(jax.devices()[0] if device is None else device, "compute_capability", None)
  if cc is None or str(cc) == "9.0":
    return ""
  return f"the GPU has compute capability {cc}; the sm90 grouped GEMM runs on 9.0 (Hopper) only"


def _is_fp8(t) -> bool:
  return hasattr(t, "scale_inv")


def _operand_kind(a, b) -> str:
  """"" when the operand pair is one the kernel is compiled for (FP8 and
  FP8, or bfloat16 and bfloat16), else why not."""
  if _is_fp8(a) and _is_fp8(b):
    return ""
  ta, tb = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
  if (ta, tb) == (_BF16, _BF16):
    return ""
  return (f"{ta.name} x {tb.name} float operands: the FP8-off grouped kernel takes bfloat16 x "
          "bfloat16 only (cast both operands to bfloat16 to use it)")


def unsupported_reason(a, b, out_dtype, axis: int, groups: int) -> str:
  """"" when the kernel takes this call, else why not (one short clause).

  Args:
    a, b: the op's operands: ``lhs`` / ``rhs`` (``axis`` 0), ``lhs_t`` /
      ``rhs_t`` (``axis`` 1) or ``x`` / ``grad`` (``axis`` 2), already
      checked by ``grouped_gemm.py``: both FP8 scaled tensors, or both float
      arrays (``axis`` 2: float arrays).
    out_dtype: the requested output dtype.
    axis: 0 rows (``grouped_gemm``), 1 contraction (``grouped_wgrad``), 2
      contraction over row-major operands (``grouped_wgrad_rows``).
    groups: ``group_sizes.shape[0]`` (at most :data:`MAX_GROUPS`).
  """
  why = _operand_kind(a, b)
  if why:
    return why
  ta, tb = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
  bf16 = ta == _BF16
  if jnp.dtype(out_dtype) == jnp.dtype(jnp.float32):
    if axis != CONTRACTION or bf16:
      return ("out_dtype=float32: the sm90 grouped kernels write float32 for FP8 wgrads "
              "(grouped_wgrad) only, bfloat16 elsewhere")
  elif jnp.dtype(out_dtype) != _BF16:
    return (f"out_dtype={jnp.dtype(out_dtype).name}: the sm90 grouped kernels write bfloat16 "
            "(and float32 for FP8 wgrads) only")
  if axis == CONTRACTION_ROW_MAJOR and not bf16:
    return ("FP8 operands: the row-major wgrad kernel takes bfloat16 only (FP8 wgrads read "
            "the (k, m) and (n, m) columnwise copies: grouped_wgrad)")
  if not bf16 and a.block_shape is not None and (ta, tb) != (_E4M3, _E4M3):
    return f"blockwise {ta.name} x {tb.name}: the blockwise kernels are compiled for E4M3 only"
  if axis == ROWS and (ta, tb) == (_E4M3, _E5M2):
    return "e4m3 lhs x e5m2 rhs: the per-tensor kernels take E5M2 as lhs only"
  unit = _TMA_BYTES // ta.itemsize          # elements in 16 bytes: 16 FP8, 8 bf16
  # row: the length of a's rows as the kernel reads them, 16-byte TMA rows
  if axis == ROWS:
    (m, k), n = a.shape, b.shape[2]
    row, what = k, "k (lhs.shape[1])"
  elif axis == CONTRACTION_ROW_MAJOR:   # any group sizes; k and n are the 16-byte rows
    (m, k), n = a.shape, b.shape[1]
    row, what = k, "k (x.shape[1])"
  elif bf16:   # run on axis 2 with the transposes
    (k, m), n = a.shape, b.shape[0]
    row, what = k, "k (lhs_t.shape[0])"
  else:
    (k, m), n = a.shape, b.shape[0]
    row, what = m, "the grouped m (lhs_t.shape[1])"
    if _contraction_swapped(ta, tb, out_dtype):   # computed transposed: the kernel's n is k
      n = k
  if row % unit:
    return (f"{what}={row} is not a multiple of {unit} (16-byte {ta.name} rows for "
            "TMA)")
  if n % 8:
    return f"the output's last dim {n} is not a multiple of 8 (16-byte rows)"
  if max(m, n, k) > _INT32_MAX:
    return "a dimension exceeds int32"
  if groups > MAX_GROUPS:
    return f"{groups} groups: the kernel takes at most {MAX_GROUPS}"
  return ""


def auto_reference_reason() -> str:
  """Why ``impl="auto"`` runs the reference for this process's FP8 grouped
  GEMMs with a bfloat16 output ("" when it runs the kernel): no GPU backend,
  the build, or the GPU. For banners and benchmark notes; the dispatcher
  decides per call."""
  if jax.default_backend() != "gpu":
    return "no GPU"
  return build_reason() or device_reason()


class KernelOperands(NamedTuple):
  """What the handler reads: ``a``, ``b`` (FP8 or bfloat16), their float32
  scales and the ``scaling`` attribute (``PER_TENSOR``, ``BLOCKWISE``, or
  ``NONE`` for bfloat16 operands, whose scales are (1,) dummies). Blockwise
  scales are laid out as the grouped kernel reads them (compact per group:
  see the module doc), inside arrays of the native layouts' shapes, which
  the handler checks."""
  a: jax.Array
  b: jax.Array
  a_sinv: jax.Array
  b_sinv: jax.Array
  scaling: int


def _no_scales():
  """The (1,) float32 dummy the handler takes for each scale of bfloat16
  operands (it checks the shape and reads nothing)."""
  return jnp.ones((1,), jnp.float32)


def _in_native_shape(compact: jax.Array, shape) -> jax.Array:
  """``compact`` flattened into an array of ``shape`` (the native layout's,
  never smaller), its floats first and zeros after them."""
  flat = jnp.ravel(compact)
  return jnp.pad(flat, (0, int(np.prod(shape)) - flat.size)).reshape(shape)


def group_bounds(group_sizes: jax.Array, extent: int) -> jax.Array:
  """(g + 1,) int32: group e's slice of a grouped axis of ``extent`` is
  ``[bounds[e], bounds[e + 1])``, as the setup kernel computes it: each
  start is the previous one plus that group's size (a negative size counts
  as 0), clamped to ``extent``. A saturating scan, so that no sum of int32
  sizes overflows."""
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, extent)
  # min(a + b, extent) for a, b in [0, extent], written so that it stays
  # within int32; associative on that range, so a parallel scan may use it.
  ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, extent - b) + b, sizes)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def sizes_fit(group_sizes: jax.Array, extent: int) -> jax.Array:
  """Whether ``group_sizes`` can describe ``extent`` rows: none negative,
  their sum at most ``extent`` (a bool scalar on the device). The sum runs
  over sizes clipped to ``extent + 1`` in uint32: no prefix sum overflows
  before the first one past ``extent``, which decides, so an int32 sum that
  would wrap to a small number is caught; one cumulative sum, so the program
  does not grow with the group count."""
  clipped = jnp.clip(group_sizes, 0, extent + 1).astype(jnp.uint32)
  return jnp.all(group_sizes >= 0) & jnp.all(jnp.cumsum(clipped) <= extent)


def rows_scales_compact(scale_inv: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """The 1x128 scales of the rows-grouped ``a (m, k)`` as the grouped kernel
  reads them: a flat ``(m * kb,)`` float32 buffer (``kb = ceil(k/128)``) in
  which every group's rows, and the tail rows past the last group, form one
  compact block: the block of ``r`` rows starting at row ``s`` holds
  (row ``s + i``, k-block ``j``) at ``s * kb + j * r + i``. The blocks tile
  the buffer, so the re-layout is a permutation whatever the sizes.

  Args:
    scale_inv: (m, kb) float32, the logical grid of ``a``'s scales.
    group_sizes: (g,) int32 on the device (no host synchronization).
  """
  m, kb = scale_inv.shape
  bounds = group_bounds(group_sizes, m)
  starts, ends = bounds, jnp.append(bounds[1:], m)       # g groups and the tail
  rows = jnp.arange(m, dtype=jnp.int32)
  block = jnp.searchsorted(ends, rows, side="right")     # the first block ending past the row
  start, height = starts[block], ends[block] - starts[block]
  dest = start[None, :] * kb + jnp.arange(kb, dtype=jnp.int32)[:, None] * height[None, :] \
      + (rows - start)[None, :]                          # (kb, m), as the native grid
  # scale_inv.T is the quantize's native grid (rows contiguous): XLA cancels
  # this transpose against the one that made scale_inv.
  return jnp.zeros((m * kb,), jnp.float32).at[dest.ravel()].set(
      jnp.ravel(scale_inv.T).astype(jnp.float32), unique_indices=True)


def rows_operands(lhs, rhs, group_sizes) -> KernelOperands:
  """Kernel operands of :func:`grouped_gemm`: ``a = lhs.data (m, k)``,
  ``b = rhs.data`` per group transposed to ``(g, n, k)``; scales (1,) and
  (g,) per tensor; blockwise, with ``kb = ceil(k/128)``, ``nb = ceil(n/128)``:
  ``a``'s 1x128 scales re-laid per group by :func:`rows_scales_compact`
  (group g's at ``start_g * kb``), in a ``(kb, roundup(m, 4))`` array, and
  ``b``'s 128x128 scales compact ``(g, nb, kb)`` (group g's at
  ``g * nb * kb``; (row block r, k-block j) at ``r * kb + j``), in a
  ``(g, nb, roundup(kb, 4))`` array. bfloat16 arrays: ``a = lhs``, ``b =
  rhs`` transposed, no scales."""
  if not _is_fp8(lhs):
    return KernelOperands(lhs, jnp.swapaxes(rhs, 1, 2), _no_scales(), _no_scales(), NONE)
  b = jnp.swapaxes(rhs.data, 1, 2)
  if lhs.block_shape is None:
    return KernelOperands(lhs.data, b, jnp.reshape(lhs.scale_inv, (1,)), rhs.scale_inv,
                          PER_TENSOR)
  (m, k), (g, n) = lhs.shape, b.shape[:2]
  a_sinv = _in_native_shape(rows_scales_compact(lhs.scale_inv, group_sizes),
                            tiling.TILE_1X128.native_scale_shape(m, k))
  b_sinv = _in_native_shape(jnp.swapaxes(rhs.scale_inv, 1, 2),
                            (g,) + tiling.BLOCK_128X128.native_scale_shape(n, k))
  return KernelOperands(lhs.data, b, a_sinv, b_sinv, BLOCKWISE)


def _contraction_scales_compact(t) -> jax.Array:
  """A 1x128-along-m operand ``t (rows, m)``'s scales as the grouped kernel
  reads them: ``(ceil(m/128), rows)``, (row i, k-block j) at ``j * rows + i``
  (group g's at ``(start_g / 128) * rows``), in a ``(ceil(m/128),
  roundup(rows, 4))`` array."""
  rows, m = t.shape
  # t.scale_inv.T: the quantize's native grid without its row padding.
  return _in_native_shape(t.scale_inv.T, tiling.TILE_1X128.native_scale_shape(rows, m))


def _f32_kernel(ta, tb) -> bool:
  """Whether a float32-output wgrad kernel takes FP8 ``lhs_t`` / ``rhs_t`` of
  these dtypes in their order (E4M3 x E4M3, E4M3 x E5M2; blockwise operands
  are E4M3 both, :func:`unsupported_reason`)."""
  return ta == _E4M3 and tb in (_E4M3, _E5M2)


def _contraction_swapped(ta, tb, out_dtype) -> bool:
  """Whether :func:`grouped_wgrad` runs its operands swapped: E4M3 ``lhs_t``
  with E5M2 ``rhs_t`` for a bfloat16 result (the bfloat16 kernels take E5M2
  as ``a`` only)."""
  f32 = jnp.dtype(out_dtype) == jnp.dtype(jnp.float32)
  return (ta, tb) == (_E4M3, _E5M2) and not f32


def contraction_operands(lhs_t, rhs_t, out_dtype=jnp.bfloat16):
  """Kernel operands of :func:`grouped_wgrad` and whether they are swapped
  (``a = rhs_t``: an E4M3 ``lhs_t`` with an E5M2 ``rhs_t`` for a bfloat16
  result, which is then ``(g, n, k)``). Scales: (1,) each per tensor, else
  1x128 along the grouped m, compact (:func:`_contraction_scales_compact`)."""
  swapped = _contraction_swapped(jnp.dtype(lhs_t.dtype), jnp.dtype(rhs_t.dtype), out_dtype)
  a, b = (rhs_t, lhs_t) if swapped else (lhs_t, rhs_t)
  if a.block_shape is None:
    ops = KernelOperands(a.data, b.data, jnp.reshape(a.scale_inv, (1,)),
                         jnp.reshape(b.scale_inv, (1,)), PER_TENSOR)
  else:
    ops = KernelOperands(a.data, b.data, _contraction_scales_compact(a),
                         _contraction_scales_compact(b), BLOCKWISE)
  return ops, swapped


def row_major_wgrad_operands(x, grad) -> KernelOperands:
  """Kernel operands of :func:`grouped_wgrad_rows` (``axis=2``): ``a = x (m,
  k)``, ``b = grad (m, n)`` as they are, bfloat16, no scales."""
  return KernelOperands(x, grad, _no_scales(), _no_scales(), NONE)


def _check(a, b, out_dtype, axis, groups):
  why = unsupported_reason(a, b, out_dtype, axis, groups)
  if why:
    raise ValueError(f"te_jax grouped GEMM (CUDA): {why}; use impl='auto' or "
                     "impl='reference' for the pure-JAX reference.")


def _call(ops: KernelOperands, group_sizes, out_shape, axis: int, fast_accum: bool,
          out_dtype=jnp.bfloat16):
  groups = group_sizes.shape[0]
  out, _ = jax.ffi.ffi_call(
      TARGET,
      (jax.ShapeDtypeStruct(out_shape, out_dtype),
       jax.ShapeDtypeStruct((workspace_bytes(groups),), jnp.uint8)))(
           ops.a, ops.b, ops.a_sinv, ops.b_sinv, group_sizes,
           axis=np.int64(axis), scaling=np.int64(ops.scaling),
           fast_accum=np.int64(bool(fast_accum)))
  return out


def grouped_gemm(lhs, rhs, group_sizes, fast_accum: bool = False) -> jax.Array:
  """``out[rows_e] = lhs[rows_e] @ rhs[e]`` on the kernel.

  Args:
    lhs: (m, k) ``ScaledTensor`` (per tensor or 1x128), or bfloat16 array.
    rhs: (g, k, n) ``GroupedScaledTensor`` (one scale per group, or
      128x128), or bfloat16 array (with a bfloat16 ``lhs``).
    group_sizes: (g,) int32 on the device.
    fast_accum: per-tensor E4M3 x E4M3 only: the tensor cores' accumulation
      (bfloat16 operands always accumulate in float32).

  Returns:
    (m, n) bfloat16; rows past ``sum(group_sizes)`` are 0; all NaN when the
    sizes cannot describe m rows (a negative one, or a sum above m).
  """
  _check(lhs, rhs, jnp.bfloat16, ROWS, group_sizes.shape[0])
  return _call(rows_operands(lhs, rhs, group_sizes), group_sizes,
               (lhs.shape[0], rhs.shape[2]), ROWS, fast_accum and _is_fp8(lhs))


def grouped_wgrad(lhs_t, rhs_t, group_sizes, fast_accum: bool = False,
                  out_dtype=jnp.bfloat16) -> jax.Array:
  """``out[e] = lhs_t[:, rows_e] @ rhs_t[:, rows_e].T`` on the kernel.

  Args:
    lhs_t: (k, m) ``ScaledTensor`` (per tensor or 1x128 along m), or
      bfloat16 array.
    rhs_t: (n, m) ``ScaledTensor``, the same scaling, or bfloat16 array.
    group_sizes: (g,) int32 on the device. FP8: each group (and so each
      start) a multiple of 16 (per tensor) or 128 (blockwise), as the
      recipe's token block pads them. bfloat16: any sizes (computed by
      :func:`grouped_wgrad_rows` on ``lhs_t.T`` and ``rhs_t.T``).
    fast_accum: as :func:`grouped_gemm`; the float32-output kernels
      promote every 128 of the contraction (split accumulation) whatever it
      says, as the kernels without a fast variant do.
    out_dtype: bfloat16, or float32 for FP8 operands: written by the
      kernel's float32 epilogue for E4M3 ``lhs_t`` (see the module doc),
      computed in bfloat16 and widened for E5M2 ``lhs_t``.

  Returns:
    (g, k, n) of ``out_dtype``; an empty group's matrix is 0; all NaN when
    a size is negative, overruns m or (FP8) breaks the multiple above.
  """
  _check(lhs_t, rhs_t, out_dtype, CONTRACTION, group_sizes.shape[0])
  if not _is_fp8(lhs_t):
    return grouped_wgrad_rows(lhs_t.T, rhs_t.T, group_sizes)
  f32 = jnp.dtype(out_dtype) == jnp.dtype(jnp.float32)
  if f32 and not _f32_kernel(jnp.dtype(lhs_t.dtype), jnp.dtype(rhs_t.dtype)):
    return grouped_wgrad(lhs_t, rhs_t, group_sizes, fast_accum).astype(jnp.float32)
  k, n, g = lhs_t.shape[0], rhs_t.shape[0], group_sizes.shape[0]
  ops, swapped = contraction_operands(lhs_t, rhs_t, out_dtype)
  out = _call(ops, group_sizes, (g, n, k) if swapped else (g, k, n), CONTRACTION, fast_accum,
              out_dtype)
  return jnp.swapaxes(out, 1, 2) if swapped else out


def grouped_wgrad_rows(x, grad, group_sizes) -> jax.Array:
  """``out[e] = x[rows_e].T @ grad[rows_e]`` on the kernel (``axis=2``).

  Args:
    x: (m, k) bfloat16, rows sorted by group (the activations as stored).
    grad: (m, n) bfloat16 (the output gradient as stored).
    group_sizes: (g,) int32 on the device; any sizes.

  Returns:
    (g, k, n) bfloat16; an empty group's matrix is 0; all NaN when a size
    is negative or the sizes overrun m.
  """
  _check(x, grad, jnp.bfloat16, CONTRACTION_ROW_MAJOR, group_sizes.shape[0])
  g = group_sizes.shape[0]
  return _call(row_major_wgrad_operands(x, grad), group_sizes, (g, x.shape[1], grad.shape[1]),
               CONTRACTION_ROW_MAJOR, False)
