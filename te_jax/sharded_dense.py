"""The sharded FP8 dense: FSDP, tensor and sequence parallelism as one ``shard_map``.

:func:`sharded_fp8_dense` computes the same ``x @ kernel + bias`` as
``te_jax.dense.fp8_dense``, with the same ``custom_vjp`` and delayed-scaling
state semantics, when the operands are sharded over a mesh. Custom calls have
no sharding rule, so the quantize and GEMM ops run per device inside
``shard_map`` and every collective is explicit:

* **FSDP** (kernel dims sharded over non-tensor-parallel axes, normally
  ``embed`` over ``fsdp``): each device quantizes its own weight shard, then
  the FP8 shard (1 byte/element, plus per-block scales) is all-gathered; the
  per-tensor scale is global because the amax is ``pmax``-ed first (current
  scaling) or comes from the replicated state (delayed scaling). Each local
  weight shard is padded to whole 128x128 (blockwise) or 16-aligned
  (per-tensor) blocks, so no block straddles a shard boundary. The backward
  gathers the FP8 shard again (nothing gathered is kept alive between the
  passes) and reduce-scatters the weight gradient.
* **TP**: a kernel whose output dim is on the tp axis is column parallel
  (output stays tp-sharded; dgrad is a partial sum, ``psum``-ed over tp), one
  whose contraction dim is on tp is row parallel (output ``psum``-ed).
* **SP** (``MeshResource.sequence_parallel``): activations between blocks
  are sequence-sharded over tp. The column-parallel GEMM all-gathers its
  input *in FP8* (quantized per device; 1x128 tiles and, for wgrad, 128x1
  tiles are exact because each device's token count is a multiple of 128) and
  its dgrad is reduce-scattered; the row-parallel GEMM reduce-scatters its
  output and all-gathers its FP8 output gradient.
* Every amax is ``pmax``-ed over all mesh axes, so all devices compute the
  same scales and the same new delayed-scaling state (state is replicated).

Within the shard_map, the tokens of an SP-gathered GEMM are in "chunk order"
(the tp ranks' token chunks one after the other); results are permuted back
to the natural (batch, seq) order locally.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax import scaling
from te_jax import sharding as sharding_lib
from te_jax.ops.fp8 import ScaledTensor

__all__ = ["sharded_fp8_dense", "shard_map", "warn_if_unsharded", "warn_unmatched_mesh_resource"]


def shard_map(f, *, mesh, in_specs, out_specs):
  """``jax.shard_map`` without replication checks (the bodies psum by hand)."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


class _Plan(NamedTuple):
  """Everything static about one sharded dense: specs, collectives, local shapes."""
  scaling_mode: scaling.ScalingMode
  impl: str
  mesh: object
  tp_mode: str                   # "col" (output on tp), "row" (contraction on tp), "none"
  tp_axis: Optional[str]
  sp_ranks: int                  # tp ranks whose token chunks one GEMM gathers (SP)
  k_gather_axes: Tuple[str, ...]  # kernel dim-0 axes all-gathered (FSDP)
  n_gather_axes: Tuple[str, ...]  # kernel dim-1 axes all-gathered (FSDP)
  gemm_tok_axes: Tuple[str, ...]  # axes over which the GEMM's tokens differ
  out_tok_axes: Tuple[str, ...]   # axes over which the output's tokens differ
  x_spec: P
  k_spec: P
  b_spec: P
  y_spec: P
  x_local_shape: Tuple[int, ...]
  y_local_shape: Tuple[int, ...]
  kernel_local_shape: Tuple[int, int]
  local_k: int                   # K as seen by x locally (K, or K/tp for row)
  local_n: int                   # N of y locally (N, or N/tp for col)
  seq_axis: int                  # dim of x's lead dims that SP shards
  chunk_tokens: int              # tokens per chunk (per device, per SP rank)
  token_block: int               # multiple every local token chunk is padded to
  has_bias: bool
  x_dtype: object
  k_dtype: object


# ---------------------------------------------------------------- helpers --

def _roundup(n, m):
  return -(-n // m) * m


def _pad_chunks(a, axis, n, align):
  """Splits dim ``axis`` into ``n`` chunks and zero-pads each to ``align``."""
  size = a.shape[axis]
  c = size // n
  cp = _roundup(c, align)
  if cp == c:
    return a
  shp = a.shape[:axis] + (n, c) + a.shape[axis + 1:]
  a = a.reshape(shp)
  pad = [(0, 0)] * a.ndim
  pad[axis + 1] = (0, cp - c)
  a = jnp.pad(a, pad)
  return a.reshape(a.shape[:axis] + (n * cp,) + a.shape[axis + 2:])


def _unpad_chunks(a, axis, n, c):
  """Inverse of ``_pad_chunks``: keeps the first ``c`` entries of each chunk."""
  cp = a.shape[axis] // n
  if cp == c:
    return a
  a = a.reshape(a.shape[:axis] + (n, cp) + a.shape[axis + 1:])
  a = lax.slice_in_dim(a, 0, c, axis=axis + 1)
  return a.reshape(a.shape[:axis] + (n * c,) + a.shape[axis + 2:])


def _to_chunks(a, sa, nt):
  """(lead..., C) natural order -> (nt * Mc, C) chunk order (seq dim ``sa``)."""
  lead, c = a.shape[:-1], a.shape[-1]
  if nt == 1 or sa == 0 or math.prod(lead[:sa]) == 1:
    return a.reshape(-1, c)
  a = a.reshape(lead[:sa] + (nt, lead[sa] // nt) + lead[sa + 1:] + (c,))
  a = jnp.moveaxis(a, sa, 0)
  return a.reshape(-1, c)


def _from_chunks(a2, lead, sa, nt):
  """Inverse of ``_to_chunks``: (nt * Mc, C) -> lead + (C,)."""
  c = a2.shape[-1]
  if nt == 1 or sa == 0 or math.prod(lead[:sa]) == 1:
    return a2.reshape(lead + (c,))
  a = a2.reshape((nt,) + lead[:sa] + (lead[sa] // nt,) + lead[sa + 1:] + (c,))
  a = jnp.moveaxis(a, 0, sa)
  return a.reshape(lead + (c,))


def _gather(t: ScaledTensor, axes, axis) -> ScaledTensor:
  """All-gathers FP8 data (and per-tile scales) over mesh ``axes`` along ``axis``."""
  if not axes:
    return t
  name = axes[0] if len(axes) == 1 else tuple(axes)
  # The barrier keeps XLA from sinking a later transpose into a second
  # all-gather of the transposed operand (twice the bytes on the wire).
  data = lax.optimization_barrier(lax.all_gather(t.data, name, axis=axis, tiled=True))
  s = t.scale_inv
  if t.block_shape is not None:
    s = lax.all_gather(s, name, axis=axis, tiled=True)
  return ScaledTensor(data, s, t.block_shape)


def _all_axes(plan):
  return tuple(plan.mesh.axis_names)


def _quantize(x, role, plan, state, columnwise):
  """Quantizes a local 2-D block with a scale shared by all devices (per-tensor
  amaxes max-reduced over every mesh axis)."""
  return plan.scaling_mode.quantize(x, role, state, impl=plan.impl, columnwise=columnwise,
                               amax_axes=_all_axes(plan))


@functools.lru_cache(maxsize=None)
def _warn_no_mesh():
  logging.getLogger("te_jax").warning(
      "te_jax: a mesh_resource is set but no mesh is active (jax.set_mesh or "
      "`with mesh:`); FP8 GEMMs run unsharded.")


@functools.lru_cache(maxsize=None)
def warn_unmatched_mesh_resource(mesh_resource, mesh_axes: Tuple[str, ...]):
  """Warns once per (mesh resource, mesh axis names) that the resource names
  none of the mesh's axes (a typo, or one written for another mesh)."""
  logging.getLogger("te_jax").warning(
      "te_jax: the mesh_resource %s names mesh axes %s, none of which the active "
      "mesh has (its axes: %s); every FP8 GEMM runs replicated. Name the mesh's "
      "axes in the MeshResource, or build the mesh with those names.",
      mesh_resource, mesh_resource.axes, tuple(mesh_axes))


def warn_if_unsharded(mesh_resource, mesh) -> bool:
  """True, with a warning once, when ``mesh_resource`` cannot shard anything:
  no mesh is active (None), or it names axes but none of the mesh's (one
  naming no axes asks for nothing sharded: no warning)."""
  named, axes = mesh_resource.axes, tuple(getattr(mesh, "axis_names", ()))
  if mesh is None:
    _warn_no_mesh()
  elif named and not set(named) & set(axes):
    warn_unmatched_mesh_resource(mesh_resource, axes)
  else:
    return False
  return True


def _kernel_sizes(plan):
  """(gk, gn): how many shards the gathered kernel dims are made of."""
  return (sharding_lib.mesh_axis_size(plan.mesh, plan.k_gather_axes),
          sharding_lib.mesh_axis_size(plan.mesh, plan.n_gather_axes))


# -------------------------------------------------------------- fwd / bwd --

def _fwd_body(plan, x, kernel, bias, state):
  a = plan.token_block
  gk, gn = _kernel_sizes(plan)
  sa, nt = plan.seq_axis, plan.sp_ranks
  # Tokens of this device's GEMM, chunk order, each chunk padded to `align`.
  if plan.tp_mode == "row":
    x2 = _to_chunks(x, sa, nt)
    x2 = _pad_chunks(x2, 0, nt, a)
  else:
    x2 = _pad_chunks(x.reshape(-1, x.shape[-1]), 0, 1, a)
  x2 = _pad_chunks(x2, 1, gk, a)
  qx_all = _quantize(x2, "x", plan, state, columnwise=True)
  qx, qx_t = qx_all.rowwise(), qx_all.columnwise()
  if plan.tp_mode == "col" and nt > 1:   # SP: all-gather the FP8 input over tp
    qx = _gather(qx, (plan.tp_axis,), 0)
  k2 = _pad_chunks(_pad_chunks(kernel, 0, 1, a), 1, 1, a)
  qk_all = _quantize(k2, "kernel", plan, state, columnwise=False)
  qk = qk_all.rowwise()
  qk_full = _gather(_gather(qk, plan.k_gather_axes, 0), plan.n_gather_axes, 1)
  bp = None
  if plan.has_bias and plan.tp_mode != "row":
    bp = _pad_chunks(bias.astype(plan.x_dtype)[:, None], 0, gn, a)[:, 0]
  y = plan.scaling_mode.gemm("fprop", qx, qk_full.T, out_dtype=plan.x_dtype, bias=bp,
                        impl=plan.impl)
  y = _unpad_chunks(y, 1, gn, plan.local_n // gn)
  if plan.tp_mode == "row":
    if nt > 1:
      y = lax.psum_scatter(y, plan.tp_axis, scatter_dimension=0, tiled=True)
    elif plan.tp_axis is not None:
      y = lax.psum(y, plan.tp_axis)
    if plan.has_bias:
      y = y + bias.astype(y.dtype)
    y = _unpad_chunks(y, 0, 1, plan.chunk_tokens)
    y = y.reshape(plan.y_local_shape)
  else:
    y = _unpad_chunks(y, 0, nt, plan.chunk_tokens)
    y = _from_chunks(y, plan.y_local_shape[:-1], sa, nt)
  new_state = plan.scaling_mode.update_state(state, {"x": qx_all.amax, "kernel": qk_all.amax})
  # Residuals stay local and FP8: this device's columnwise x chunk and its
  # kernel shard; the backward gathers them again.
  res = jax.tree.map(lambda r: r[None], (qx_t, qk))
  return y, res, new_state


def _bwd_body(plan, res, g, new_state):
  a = plan.token_block
  gk, gn = _kernel_sizes(plan)
  sa, nt = plan.seq_axis, plan.sp_ranks
  qx_t, qk = jax.tree.map(lambda r: r[0], res)
  if plan.tp_mode == "row":
    g2 = _pad_chunks(g.reshape(-1, g.shape[-1]), 0, 1, a)
  else:
    g2 = _pad_chunks(_to_chunks(g, sa, nt), 0, nt, a)
  g2 = _pad_chunks(g2, 1, gn, a)
  qg_all = _quantize(g2, "grad", plan, new_state, columnwise=True)
  qg, qg_t = qg_all.rowwise(), qg_all.columnwise()
  if plan.tp_mode == "row" and nt > 1:   # SP: all-gather the FP8 gradient over tp
    qg = _gather(qg, (plan.tp_axis,), 0)
    # Per-tensor: the transpose of the gathered copy; 128x1 tiles: their own.
    qg_t = qg.T if qg.block_shape is None else _gather(qg_t, (plan.tp_axis,), 1)
  if plan.tp_mode == "col" and nt > 1:
    qx_t = _gather(qx_t, (plan.tp_axis,), 1)
  qk_full = _gather(_gather(qk, plan.k_gather_axes, 0), plan.n_gather_axes, 1)

  # dgrad
  dx = plan.scaling_mode.gemm("dgrad", qg, qk_full, out_dtype=plan.x_dtype, impl=plan.impl)
  dx = _unpad_chunks(dx, 1, gk, plan.local_k // gk)
  if plan.tp_mode == "col":
    if nt > 1:
      dx = lax.psum_scatter(dx, plan.tp_axis, scatter_dimension=0, tiled=True)
    else:
      dx = lax.psum(dx, plan.tp_axis)
    dx = _unpad_chunks(dx, 0, 1, plan.chunk_tokens)
    dx = dx.reshape(plan.x_local_shape)
  else:
    dx = _unpad_chunks(dx, 0, nt, plan.chunk_tokens)
    dx = _from_chunks(dx, plan.x_local_shape[:-1], sa, nt)

  # wgrad: sum over the GEMM's token axes; FSDP dims reduce-scatter.
  dk = plan.scaling_mode.gemm("wgrad", qx_t, qg_t, out_dtype=plan.k_dtype, impl=plan.impl)
  gathered = set(plan.k_gather_axes) | set(plan.n_gather_axes)
  rest = tuple(ax for ax in plan.gemm_tok_axes if ax not in gathered)
  for dim, axes in ((0, plan.k_gather_axes), (1, plan.n_gather_axes)):
    if not axes:
      continue
    if all(ax in plan.gemm_tok_axes for ax in axes):
      dk = lax.psum_scatter(dk, _spec_entry(axes), scatter_dimension=dim, tiled=True)
    else:  # sharded on an axis the tokens are not: no sum, keep own block
      summed = tuple(ax for ax in axes if ax in plan.gemm_tok_axes)
      if summed:
        dk = lax.psum(dk, _spec_entry(summed))
      n = sharding_lib.mesh_axis_size(plan.mesh, axes)
      idx = lax.axis_index(_spec_entry(axes))
      size = dk.shape[dim] // n
      dk = lax.dynamic_slice_in_dim(dk, idx * size, size, axis=dim)
  if rest:   # e.g. dp: the weight is replicated there; sum the (smaller) shard
    dk = lax.psum(dk, _spec_entry(rest))
  dk = _unpad_chunks(_unpad_chunks(dk, 0, 1, plan.kernel_local_shape[0]), 1, 1, plan.kernel_local_shape[1])

  dbias = None
  if plan.has_bias:
    db = jnp.sum(g.reshape(-1, g.shape[-1]).astype(jnp.float32), axis=0)
    if plan.out_tok_axes:
      db = lax.psum(db, _spec_entry(plan.out_tok_axes))
    dbias = db
  return dx, dk, dbias, plan.scaling_mode.update_state(new_state, {"grad": qg_all.amax})


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sharded_dense(x, kernel, bias, state, plan):
  y, _ = _sharded_dense_fwd(x, kernel, bias, state, plan)
  return y


# The shard_map of each pass is jitted once per plan. An eager call (no
# enclosing jit) would otherwise run the body one primitive at a time, each
# compiled on its own, on every call; inside a jitted step the inner jit is
# inlined and changes nothing.
@functools.lru_cache(maxsize=None)
def _fwd_fn(plan):
  return jax.jit(shard_map(functools.partial(_fwd_body, plan), mesh=plan.mesh,
                           in_specs=(plan.x_spec, plan.k_spec, plan.b_spec, P()),
                           out_specs=(plan.y_spec, P(_all_axes(plan)), P())))


@functools.lru_cache(maxsize=None)
def _bwd_fn(plan):
  return jax.jit(shard_map(functools.partial(_bwd_body, plan), mesh=plan.mesh,
                           in_specs=(P(_all_axes(plan)), plan.y_spec, P()),
                           out_specs=(plan.x_spec, plan.k_spec, plan.b_spec, P())))


def _sharded_dense_fwd(x, kernel, bias, state, plan):
  y, res, new_state = _fwd_fn(plan)(x, kernel, bias, state)
  return y, (res, new_state, bias)


def _sharded_dense_bwd(plan, saved, g):
  res, new_state, bias = saved
  dx, dk, db, new_state = _bwd_fn(plan)(res, g, new_state)
  if db is not None:
    db = db.astype(bias.dtype)
  return dx, dk, db, new_state


_sharded_dense.defvjp(_sharded_dense_fwd, _sharded_dense_bwd)


# ------------------------------------------------------------------ plan ----

def _spec_entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _local_shape(shape, spec, mesh):
  out = []
  for d, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    out.append(d // sharding_lib.mesh_axis_size(mesh, entry))
  return tuple(out)


def _check_div(what, shape, spec, mesh):
  for i, (d, entry) in enumerate(zip(shape, tuple(spec))):
    n = sharding_lib.mesh_axis_size(mesh, entry)
    if d % n:
      raise ValueError(
          f"te_jax sharded FP8 dense: dim {i} of {what} (shape {shape}) has size {d}, "
          f"not divisible by the {n} devices of mesh axes {entry!r} it is sharded "
          "over; pad it (te_jax.packing.pad_batch for the batch/sequence dims).")


def make_plan(x_shape, k_shape, *, x_dtype, k_dtype, has_bias, recipe, impl,
              kernel_axes, mesh_resource, mesh) -> Optional[_Plan]:
  """Works out specs and collectives; None when nothing is sharded. With
  ``recipe`` None, the specs only (no scaling mode or token alignment): the
  output type under an explicit-axes mesh of a GEMM with FP8 off."""
  mr = mesh_resource
  kax, nax = sharding_lib.logical_to_mesh_axes(kernel_axes, mesh_resource=mr, mesh=mesh)
  tp = sharding_lib.tp_axis(mr, mesh)
  batch = sharding_lib.batch_axes(mr, mesh)
  for name, axes in (("contraction", kax), ("output", nax)):
    if tp in axes and len(axes) > 1:
      raise ValueError(
          f"te_jax sharded FP8 dense: the kernel's {name} dim maps to mesh axes "
          f"{axes}; a dim may be on the tensor-parallel axis {tp!r} or on FSDP axes, "
          "not both. Check the logical axis rules.")
  k_tp, n_tp = tp is not None and tp in kax, tp is not None and tp in nax
  mode = "col" if n_tp else "row" if k_tp else "none"
  sp = mr.sequence_parallel and tp is not None
  k_gather = () if k_tp else kax
  n_gather = () if n_tp else nax
  if not (batch or tp or k_gather or n_gather):
    return None
  ndim = len(x_shape)
  lead = x_shape[:-1]
  sa = 1 if len(lead) >= 2 else 0
  # Which axes shard the input's tokens, and which the output's.
  x_sp = sp and mode in ("col", "none")
  y_sp = sp and mode in ("row", "none")

  def tok_spec(seq_sharded, last):
    if ndim == 2:
      tok = batch + ((tp,) if seq_sharded else ())
      return P(_spec_entry(tok), last)
    dims = [_spec_entry(batch), tp if seq_sharded else None] + [None] * (ndim - 3)
    return P(*dims, last)

  x_spec = tok_spec(x_sp, tp if k_tp else None)
  y_spec = tok_spec(y_sp, tp if n_tp else None)
  k_spec = P(_spec_entry(kax), _spec_entry(nax))
  b_spec = P(tp if n_tp else None)
  n_out = k_shape[1]
  y_shape = x_shape[:-1] + (n_out,)
  _check_div("x", x_shape, x_spec, mesh)
  _check_div("kernel", k_shape, k_spec, mesh)
  nt = sharding_lib.mesh_axis_size(mesh, tp) if (sp and mode != "none") else 1
  gemm_tok = batch + ((tp,) if (sp and mode == "none") else ())
  out_tok = batch + ((tp,) if y_sp else ())
  x_local = _local_shape(x_shape, x_spec, mesh)
  y_local = _local_shape(y_shape, y_spec, mesh)
  k_local = _local_shape(k_shape, k_spec, mesh)
  ntok = math.prod(lead)
  shards = sharding_lib.mesh_axis_size(mesh, batch) * (
      sharding_lib.mesh_axis_size(mesh, tp) if sp else 1)
  if ndim > 2 and sp and lead[sa] % sharding_lib.mesh_axis_size(mesh, tp):
    raise ValueError(
        f"te_jax sharded FP8 dense: sequence parallelism splits dim {sa} of x "
        f"(shape {tuple(x_shape)}) over tp, but it is not divisible by the tp size.")
  mc = ntok // shards
  mode_obj = None if recipe is None else recipe.scaling_mode()
  align = 1 if recipe is None else mode_obj.token_block
  if mc % align and not mr.pad_tokens:
    raise ValueError(
        f"te_jax sharded FP8 dense ({type(recipe).__name__}): each device's token "
        f"count must be a multiple of {align}, but x of shape {tuple(x_shape)} splits "
        f"{ntok} tokens over {shards} shards into {mc} per shard. Pad the batch "
        f"(te_jax.packing.pad_batch(..., block={align}, num_shards={shards}) or "
        "packing.padded_token_count), or pass MeshResource(pad_tokens=True) to pad "
        "inside every GEMM.")
  return _Plan(scaling_mode=mode_obj, impl=impl, mesh=mesh, tp_mode=mode, tp_axis=tp,
               sp_ranks=nt, k_gather_axes=k_gather, n_gather_axes=n_gather,
               gemm_tok_axes=gemm_tok, out_tok_axes=out_tok, x_spec=x_spec,
               k_spec=k_spec, b_spec=b_spec, y_spec=y_spec, x_local_shape=x_local,
               y_local_shape=y_local, kernel_local_shape=k_local, local_k=x_local[-1],
               local_n=y_local[-1], seq_axis=sa, chunk_tokens=mc, token_block=align,
               has_bias=has_bias, x_dtype=jnp.dtype(x_dtype), k_dtype=jnp.dtype(k_dtype))


def sharded_fp8_dense(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None,
                      *, recipe, fp8_state=None, impl: str = "auto",
                      kernel_axes, mesh_resource: sharding_lib.MeshResource,
                      mesh=None) -> Optional[jax.Array]:
  """``x @ kernel + bias`` in FP8 on operands sharded over ``mesh``.

  Args:
    x: (batch, seq, ..., K) or (tokens, K) activation; batch (tokens) sharded
      over (dp, fsdp), seq over tp when sequence parallel and this GEMM is not
      row parallel, K over tp when it is.
    kernel: (K, N) weight, sharded as ``kernel_axes`` map through the rules.
    bias: optional (N,).
    recipe, fp8_state, impl: as in ``te_jax.dense.fp8_dense`` (a
      ``te_jax.recipe`` recipe; its ``scaling_mode()`` quantizes).
    kernel_axes: logical names of the kernel's two dims; each entry a name,
      None, or a tuple of names for a flattened dim (e.g. ("heads", "kv")).
    mesh_resource: a ``sharding.MeshResource``.
    mesh: the mesh; default the active one (``jax.set_mesh`` / ``with mesh``).

  Returns:
    The (..., N) result, or None when neither the mesh nor the kernel is
    sharded (the caller then runs the unsharded path).

  Raises:
    ValueError at trace time when a device's token count is not a multiple of
    ``recipe.token_block`` (and ``mesh_resource.pad_tokens`` is False), or a
    dim does not divide over its mesh axes.
  """
  if len(kernel_axes) != 2:
    raise ValueError(f"kernel_axes must name the 2 dims of the 2-D kernel "
                     f"{tuple(kernel.shape)} (each a name, None or a tuple of names), "
                     f"got {kernel_axes!r}.")
  mesh = sharding_lib.get_mesh(mesh)
  if warn_if_unsharded(mesh_resource, mesh):
    return None
  plan = make_plan(tuple(x.shape), tuple(kernel.shape), x_dtype=x.dtype,
                   k_dtype=kernel.dtype, has_bias=bias is not None, recipe=recipe,
                   impl=impl, kernel_axes=tuple(kernel_axes),
                   mesh_resource=mesh_resource, mesh=mesh)
  if plan is None:
    return None
  return _sharded_dense(x, kernel, bias, fp8_state, plan)
