"""FP8 grouped dense: ``x[rows_e] @ kernel[e]`` for rows grouped by expert.

The expert layers of a mixture of experts: ``x`` (M, K) holds the tokens
sorted by expert (``te_jax.moe.dispatch``), ``kernel`` (E, K, N) one weight
per expert, ``group_sizes`` (E,) the rows of each expert, on the device. The
``custom_vjp`` reads as its three grouped GEMMs (``te_jax.ops.grouped_gemm``):

=========  ================================  ===============================
GEMM       operands                          grouped over
=========  ================================  ===============================
fprop      x (M, K), kernel (E, K, N)        rows: ``y[rows_e] = x @ k[e]``
dgrad      grad (M, N), kernel.T (E, N, K)   rows
wgrad      x.T (K, M), grad.T (N, M)         M: one (K, N) result per expert
=========  ================================  ===============================

Each operand is quantized by the recipe's ``te_jax.scaling.ScalingMode`` as
in ``te_jax.dense``: ``x`` and ``grad`` are one tensor each (one per-tensor
scale, or 1x128 tiles), each expert weight is quantized on its own: one
scale per expert weight (per tensor) or its own 128x128 blocks, all experts
in one launch (the mode's ``quantize_stack``). Under
``DelayedScaling`` the state is one GEMM state whose ``"kernel"`` entry holds
one amax history per expert (:func:`init_grouped_state`), so each expert
weight's scale follows its own amaxes, and each step pushes one entry into
every history (the rule of every te_jax GEMM: one entry per step, max over
the uses a microbatch merge sees, ``fp8_state.accumulate_gradients``).

With ``recipe=None`` the same three grouped GEMMs run on the unquantized
operands (the FP8-off path); its wgrad reads ``x`` and ``grad`` as stored
(``grouped_wgrad_rows``), where FP8's reads the quantize's columnwise copies.

Inside ``shard_map`` (expert parallelism, ``te_jax.moe.parallel``),
:class:`GroupedAxes` names the mesh axes: amaxes are max-reduced so every
device quantizes with the scales one device would use, an FSDP-sharded
kernel dim is quantized locally and all-gathered in FP8 (its gradient
reduce-scattered), as ``te_jax.sharded_dense`` does for dense layers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax import dense as dense_lib
from te_jax import remat
from te_jax import scaling
from te_jax.ops import grouped_gemm as grouped_op
from te_jax.ops import quantize as quantize_op
from te_jax.ops.grouped_gemm import GroupedScaledTensor

__all__ = ["GroupedAxes", "grouped_dense", "init_grouped_state"]


class GroupedAxes(NamedTuple):
  """Mesh axes of a grouped dense run per device inside ``shard_map``.

  All empty (the default): unsharded.

  Attributes:
    token_axes: axes over which the rows (tokens) differ; the per-tensor
      amaxes of ``x`` and ``grad`` are max-reduced over them (pass every
      mesh axis: devices holding the same rows agree anyway).
    kernel_axes: axes over which each local expert weight is split (FSDP and
      tensor parallelism); each expert's amax is max-reduced over them.
    k_gather_axes: FSDP axes of the kernel's K dim: the FP8 shard is
      all-gathered before the GEMMs, its gradient reduce-scattered.
    n_gather_axes: the same for the kernel's N dim.

  The other reductions follow from the operands' types: a gradient that
  varies over a mesh axis its input does not (the kernel gradient over data
  axes, the input gradient over the tensor-parallel axis when the rows are
  replicated there) is summed over it, as JAX's own transpose of the
  implicit broadcast would.
  """

  token_axes: Tuple[str, ...] = ()
  kernel_axes: Tuple[str, ...] = ()
  k_gather_axes: Tuple[str, ...] = ()
  n_gather_axes: Tuple[str, ...] = ()


class _Config(NamedTuple):
  mode: Optional[scaling.ScalingMode]   # None: FP8 off
  impl: str
  axes: GroupedAxes


def _axis_name(axes):
  return axes[0] if len(axes) == 1 else tuple(axes)


def _transpose(kernel):
  """Each expert's matrix transposed: (E, N, K)."""
  return kernel.T if isinstance(kernel, GroupedScaledTensor) else jnp.swapaxes(kernel, 1, 2)


def gather_kernel(kernel, axes: GroupedAxes, transposed: bool = False):
  """All-gathers the FSDP-sharded kernel dims (FP8 data and per-block scales)
  of ``kernel`` (E, K, N), or (E, N, K) when ``transposed``."""
  k_dim, n_dim = (2, 1) if transposed else (1, 2)
  for dim, ax in ((k_dim, axes.k_gather_axes), (n_dim, axes.n_gather_axes)):
    if not ax:
      continue
    gather = functools.partial(lax.all_gather, axis_name=_axis_name(ax), axis=dim,
                               tiled=True)
    if isinstance(kernel, GroupedScaledTensor):
      s = kernel.scale_inv if kernel.block_shape is None else gather(kernel.scale_inv)
      kernel = GroupedScaledTensor(gather(kernel.data), s, kernel.block_shape)
    else:
      kernel = gather(kernel)
  return kernel


def scatter_wgrad(dk, axes: GroupedAxes):
  """Reduce-scatters the gradient of the FSDP-gathered kernel dims."""
  for dim, ax in ((1, axes.k_gather_axes), (2, axes.n_gather_axes)):
    if ax:
      dk = lax.psum_scatter(dk, _axis_name(ax), scatter_dimension=dim, tiled=True)
  return dk


def sum_to_type_of(ct, primal):
  """``ct`` summed over the mesh axes it varies over and ``primal`` does not
  (inside ``shard_map``): a gradient's partial sums, one per device."""
  extra = grouped_op.varying_axes(ct) - grouped_op.varying_axes(primal)
  return lax.psum(ct, tuple(sorted(extra))) if extra else ct


def quantize_experts(mode, kernel, state, impl, amax_axes, transposed: bool = False):
  """Each expert's (K, N) weight quantized on its own: ``(rows, cols, amax)``,
  ``rows`` a ``GroupedScaledTensor`` (E, K, N), ``cols`` with ``transposed``
  the (E, N, K) copy written by the same pass (else None), ``amax`` the
  per-expert amaxes (E,) (None where the mode has none).

  ``cols`` is the layout the fprop's grouped GEMM reads (each expert's
  matrix contiguous along K): from the quantize it costs one more byte per
  weight written, where transposing ``rows`` before the GEMM would read and
  write one each. The protocol's ``quantize_stack`` quantizes every expert
  as its 2-D ``quantize`` would, with that expert's state and each expert's
  amax max-reduced over ``amax_axes``, in one launch over the stack (a
  ``lax.map`` of E small launches left the GPU mostly idle: issue 47)."""
  q = mode.quantize_stack(kernel, "kernel", state, impl=impl, columnwise=transposed,
                          amax_axes=amax_axes)
  rows = GroupedScaledTensor(q.data, q.scale_inv, q.block_shape)
  cols = GroupedScaledTensor(q.data_t, q.scale_inv_t, q.block_shape) if transposed else None
  return rows, cols, q.amax


def update_grouped_state(mode, state, amaxes, kernel_amax=None):
  """The state after this step: ``amaxes`` ({role: amax}) for x / grad, and
  one amax per expert for the kernel histories."""
  if state is None:
    return None
  new = mode.update_state(state, {r: a for r, a in amaxes.items() if a is not None})
  if kernel_amax is not None:
    one = lambda st, a: mode.update_state({"kernel": st}, {"kernel": a})["kernel"]
    new = dict(new, kernel=jax.vmap(one)(state["kernel"], kernel_amax))
  return new


def wgrad_dtype(mode, k_proto):
  """The dtype the wgrad GEMM writes: the kernel's dtype where te_jax's
  grouped kernels write it (FP8: bfloat16 or float32; FP8 off: bfloat16),
  else the nearest they write, which the caller casts.

  The FP8 wgrad of float32 weights (an unsharded layer quantizes its
  float32 weights directly, ``te_jax.layers.gemm.gemm_kernel``) comes out of
  the kernel's float32 epilogue: no bfloat16 rounding and no pass that reads
  a bfloat16 gradient of every expert weight to write it again widened.
  Other dtypes (float16) are written in bfloat16 and cast: asked for them,
  the dispatcher would run the reference instead, a float32 GEMM in a loop
  whose trip count, read from the group sizes, the GPU sends to the host
  every iteration. The FP8-off path keeps the kernel's dtype (its layers
  cast float32 weights to bfloat16 before the GEMMs)."""
  if mode is None:
    return k_proto.dtype
  return jnp.dtype(jnp.float32) if k_proto.dtype == jnp.float32 else jnp.dtype(jnp.bfloat16)


# -------------------------------------------------------------- custom vjp --

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped(x, kernel, group_sizes, state, cfg):
  y, _ = _grouped_fwd(x, kernel, group_sizes, state, cfg)
  return y


def fprop_gemm(mode, a, kernel, state, group_sizes, axes: GroupedAxes, out_dtype, impl):
  """``a[rows_e] @ kernel[e]``: ``a`` the rows as the GEMM reads them (FP8
  rowwise under ``mode``, as stored with ``mode`` None), ``kernel`` (E, K, N)
  this device's shard. Under FP8 each expert weight is quantized on its own
  (:func:`quantize_experts`) and its FSDP-sharded dims all-gathered in FP8.
  Returns ``(y, k_local, k_amax)``: ``k_local`` what the backward's dgrad
  gathers again (the FP8 rows, or the kernel itself), ``k_amax`` the
  per-expert amaxes (None where the mode has none, or FP8 off)."""
  if mode is None:
    k_local, k_amax, accum = kernel, None, False
    k_fprop = gather_kernel(kernel, axes)
  else:
    k_local, k_cols, k_amax = quantize_experts(mode, kernel, state, impl, axes.kernel_axes,
                                               transposed=True)
    accum = mode.fast_accum("fprop")
    # The (E, N, K) copy seen as (E, K, N): the GEMM's own transpose to
    # (E, N, K) cancels this one under jit.
    k_fprop = gather_kernel(k_cols, axes, transposed=True).T
  y = grouped_op.grouped_gemm(a, k_fprop, group_sizes, out_dtype=out_dtype, fast_accum=accum,
                              impl=impl)
  return y, k_local, k_amax


def backward_gemms(mode, g, a_t, k_local, group_sizes, axes: GroupedAxes, x_proto, k_proto,
                   impl):
  """The dgrad and wgrad of :func:`fprop_gemm` from its output's gradient
  ``g`` (a ``QuantizedTensor`` under ``mode``, as stored with ``mode``
  None), its rows' columnwise operand ``a_t`` (``a`` itself with FP8 off:
  the wgrad reads it and ``g`` as stored) and ``k_local``. Returns ``(dx,
  dk)`` in the dtypes of ``x_proto`` / ``k_proto`` (empty slices of the
  primals), the kernel gradient reduce-scattered over the FSDP axes and each
  summed over the mesh axes it varies over and its primal does not."""
  if mode is None:
    g_rows, dgrad_accum = g, False
    wgrad = functools.partial(grouped_op.grouped_wgrad_rows, a_t, g)
  else:
    g_rows, dgrad_accum = g.rowwise(), mode.fast_accum("dgrad")
    wgrad = functools.partial(grouped_op.grouped_wgrad, a_t, g.columnwise(),
                              fast_accum=mode.fast_accum("wgrad"))
  kernel = gather_kernel(k_local, axes)
  dx = grouped_op.grouped_gemm(g_rows, _transpose(kernel), group_sizes,
                               out_dtype=x_proto.dtype, fast_accum=dgrad_accum, impl=impl)
  dk = wgrad(group_sizes, out_dtype=wgrad_dtype(mode, k_proto), impl=impl)
  dk = scatter_wgrad(dk.astype(k_proto.dtype), axes)
  return sum_to_type_of(dx, x_proto), sum_to_type_of(dk, k_proto)


def _grouped_fwd(x, kernel, group_sizes, state, cfg):
  mode, impl, axes = cfg.mode, cfg.impl, cfg.axes
  if mode is None:
    a, a_t = x, x
  else:
    qx = mode.quantize(x, "x", state, impl=impl, amax_axes=axes.token_axes)
    a, a_t = qx.rowwise(), qx.columnwise()
  y, k_local, k_amax = fprop_gemm(mode, a, kernel, state, group_sizes, axes, x.dtype, impl)
  new_state = state if mode is None else update_grouped_state(mode, state, {"x": qx.amax},
                                                              k_amax)
  # Kept for the backward: x.T (FP8 unless FP8 is off) and the local kernel
  # shard (gathered again there, as te_jax.sharded_dense does); empty slices
  # of x and kernel carry their dtypes and their mesh-axis types.
  protos = (x[:0, 0], kernel[:0, 0, 0])
  return y, (a_t, k_local, group_sizes, new_state, protos)


def _grouped_bwd(cfg, res, g):
  mode, impl, axes = cfg.mode, cfg.impl, cfg.axes
  a_t, k_local, group_sizes, new_state, (x_proto, k_proto) = res
  if mode is not None:
    g = mode.quantize(g, "grad", new_state, impl=impl, amax_axes=axes.token_axes)
    new_state = update_grouped_state(mode, new_state, {"grad": g.amax})
  dx, dk = backward_gemms(mode, g, a_t, k_local, group_sizes, axes, x_proto, k_proto, impl)
  return dx, dk, None, new_state


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# ------------------------------------------------------------------ public --

def init_grouped_state(recipe, num_experts: int):
  """Fresh state of one grouped dense under ``recipe`` (None if stateless).

  ``DelayedScaling``: ``{"x": s, "kernel": {"amax_history": (E, L), "scale":
  (E,)}, "grad": s}``, with ``s`` one tensor's state
  (``fp8_state.init_tensor_state``). The ``"kernel"`` leaves shard over the
  expert axis as the expert weights do.
  """
  if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}.")
  state = dense_lib.scaling_mode_of(recipe).init_state()
  if state is None:
    return None
  stack = lambda a: jnp.broadcast_to(a, (num_experts,) + a.shape)
  return dict(state, kernel=jax.tree.map(stack, state["kernel"]))


def gathered_size(size, axes):
  """A kernel dim's size after the all-gather over ``axes`` (inside shard_map)."""
  for a in axes:
    size *= lax.axis_size(a)
  return size


def _check_args(x, kernel, group_sizes, recipe, fp8_state, axes):
  quantize_op.check_input(x, "x", 2)
  quantize_op.check_input(kernel, "kernel", 3)
  if not isinstance(axes, GroupedAxes):
    raise TypeError(f"axes must be a te_jax.grouped_dense.GroupedAxes, got {axes!r}.")
  if x.shape[1] != gathered_size(kernel.shape[1], axes.k_gather_axes):
    raise ValueError(f"x (M, K) and kernel (E, K, N) must share K (the kernel's local K "
                     f"times its all-gather over {axes.k_gather_axes}), got x {x.shape} "
                     f"and kernel {kernel.shape}.")
  e = kernel.shape[0]
  if (not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.int32
      or group_sizes.shape != (e,)):
    raise TypeError(f"group_sizes must be an int32 array of shape ({e},) (one size per "
                    f"expert), got {getattr(group_sizes, 'dtype', type(group_sizes))} "
                    f"{getattr(group_sizes, 'shape', '')}.")
  if recipe is None:
    if fp8_state is not None:
      raise ValueError("fp8_state must be None when recipe is None (FP8 off).")
    return None
  mode = dense_lib.scaling_mode_of(recipe)
  mode.check_state(fp8_state)
  if fp8_state is not None:
    lead = {leaf.shape[:1] for leaf in jax.tree.leaves(fp8_state["kernel"])}
    if lead != {(e,)}:
      raise ValueError(f"fp8_state['kernel'] must hold one state per expert (leading dim "
                       f"{e}, see init_grouped_state), got leading dims {sorted(lead)}.")
  return mode


def grouped_dense(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *,
                  recipe=None, fp8_state=None, impl: str = "auto",
                  axes: GroupedAxes = GroupedAxes()) -> jax.Array:
  """``y[rows_e] = x[rows_e] @ kernel[e]`` with every GEMM in FP8 under ``recipe``.

  Args:
    x: (M, K) float32/bfloat16/float16, rows sorted by expert; each group's
      rows padded to the recipe's ``token_block`` (128 blockwise) by the
      caller (``te_jax.moe.dispatch`` does) so no scale tile spans two experts.
    kernel: (E, K, N) expert weights (any float dtype; their gradient comes
      back in it: written in float32 (float32 weights) or bfloat16 (cast to
      other dtypes) by the FP8 wgrad GEMM).
    group_sizes: (E,) int32 on the device; sum at most M (rows past it give 0).
    recipe: a ``te_jax.recipe`` recipe, or None for the unquantized GEMMs.
    fp8_state: ``DelayedScaling`` only: :func:`init_grouped_state`; its update
      comes back as its gradient (as ``te_jax.dense.fp8_dense``'s state).
    impl: "auto" or "reference" for the quantize and grouped GEMM ops.
    axes: mesh axes when called per device inside ``shard_map``
      (:class:`GroupedAxes`); the default is unsharded.

  Returns:
    (M, N) in ``x.dtype``.

  Raises:
    ValueError/TypeError at trace time for inconsistent shapes, dtypes or
    state; with FSDP gather axes, a local gathered dim that is not a multiple
    of the recipe's ``token_block``.
  """
  mode = _check_args(x, kernel, group_sizes, recipe, fp8_state, axes)
  cfg = _Config(mode, impl, axes)
  if mode is None:
    return _grouped(x, kernel, group_sizes, fp8_state, cfg)
  align = mode.token_block
  gathered = ((1, axes.k_gather_axes), (2, axes.n_gather_axes))
  for dim, ax in gathered:
    if ax and kernel.shape[dim] % align:
      raise ValueError(
          f"kernel dim {dim} (local size {kernel.shape[dim]}) is all-gathered over "
          f"{ax} and must be a multiple of {align} ({type(recipe).__name__}) on each "
          "device, so no scale block spans two shards; choose sizes that divide.")
  (m, _), n = x.shape, gathered_size(kernel.shape[2], axes.n_gather_axes)
  # Zero rows and columns add nothing to a product or an amax (te_jax.dense).
  xp = dense_lib.pad_to(dense_lib.pad_to(x, 0, align), 1, align)
  kp = dense_lib.pad_to(dense_lib.pad_to(kernel, 1, align), 2, align)
  y = _grouped(xp, kp, group_sizes, fp8_state, cfg)
  return remat.tag_fp8_gemm(y[:m, :n])
