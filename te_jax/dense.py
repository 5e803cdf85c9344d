"""FP8 dense: ``x @ kernel (+ bias)`` with FP8 GEMMs forward and backward.

Each of the three GEMMs (fprop, dgrad, wgrad) reads FP8 operands that the
recipe's ``te_jax.scaling.ScalingMode`` produces (format, tiles, scales,
state, accumulation); this module holds the ``custom_vjp`` and the shapes and
calls the protocol, with no knowledge of any particular recipe.

Token counts (and K, N) that are not a multiple of the GEMM alignment (128 for
blockwise, 16 per-tensor) are zero-padded here and the result sliced: zero rows
add nothing to any product or amax.

Under a mesh with ``Explicit`` axes (sharding in types) each public dense here
runs with those axes switched to ``Auto`` (``te_jax.explicit_axes.with_auto_axes``):
the computation is the one an auto-axes mesh gets, and the output's type is the
layout the sharded GEMM produces (``te_jax.sharded_dense.make_plan``'s
``y_spec``, FP8 on or off) or, without ``kernel_axes`` and a mesh resource, x's
sharding on the leading dims and the kernel's on the output dims.

>>> import jax.numpy as jnp
>>> from te_jax import dense, recipe
>>> x = jnp.ones((4, 100, 256), jnp.bfloat16); w = jnp.ones((256, 512), jnp.bfloat16)
>>> dense.fp8_dense(x, w, recipe=recipe.Float8BlockScaling()).shape
(4, 100, 512)
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax import explicit_axes as explicit_lib
from te_jax import recipe as recipe_lib
from te_jax import remat
from te_jax import scaling
from te_jax import sharded_dense
from te_jax import sharding as sharding_lib
from te_jax.ops import concat_quantize as concat_op
from te_jax.ops import quantize as quantize_op

__all__ = ["fp8_dense", "fp8_dense_split", "split_plan", "split_columns", "dense", "dense_general",
           "scaling_mode_of", "pad_to", "after_cotangent", "log_fp8_copies_kept"]


class _Config(NamedTuple):
  mode: scaling.ScalingMode
  impl: str
  has_bias: bool = False  # static: a Python bool residual may become a tracer
  splits: Tuple[int, ...] = ()   # the output as column blocks of these widths (a tuple)
  save_input: bool = False   # keep x, quantize its wgrad copy again in the backward
  save_kernel: bool = False  # keep the kernel, quantize its dgrad copy again there
  has_residual: bool = False  # the fprop GEMM's C input


def after_cotangent(g, *arrays):
  """``arrays`` passed through one optimization barrier with the cotangent ``g``.

  For a backward that quantizes again what its forward quantized (an FP8 copy
  not kept): XLA then cannot merge the two into one result kept alive from the
  forward (CSE would undo the saving), and the dependence on ``g`` keeps the
  second in the backward. Returns the tuple of ``arrays``, same values.
  """
  return lax.optimization_barrier((g, arrays))[1]


# -------------------------------------------------------------- custom vjp --

@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _dense_2d(x, kernel, bias, residual, state, cfg):
  y, _ = _dense_2d_fwd(x, kernel, bias, residual, state, cfg)
  return y


def _dense_2d_fwd(x, kernel, bias, residual, state, cfg):
  mode, impl = cfg.mode, cfg.impl
  # x.T is only needed by wgrad: with save_input the backward quantizes it.
  qx = mode.quantize(x, "x", state, impl=impl, columnwise=not cfg.save_input)
  qk = mode.quantize(kernel, "kernel", state, impl=impl)
  # splits: a tuple of blocks, each from its own GEMM (no slice copies);
  # residual: the GEMM's C input (its cotangent is g).
  y = mode.gemm("fprop", qx.rowwise(), qk.columnwise(), out_dtype=x.dtype, bias=bias,
                impl=impl, split_sizes=cfg.splits or None, residual=residual)
  new_state = mode.update_state(state, {"x": qx.amax, "kernel": qk.amax})
  # The backward GEMMs read x.T (wgrad) and the kernel (dgrad) in FP8: kept
  # as those FP8 copies (1 byte per element), or as the tensors themselves
  # when the caller keeps them anyway (then quantized again with the same
  # scales: ``state`` is the one this forward quantized with).
  res = (x if cfg.save_input else qx.columnwise(),
         kernel if cfg.save_kernel else qk.rowwise(), state, new_state,
         jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))
  return y, res


def _dense_2d_bwd(cfg, res, g):
  mode, impl = cfg.mode, cfg.impl
  x_t, k, state, new_state, x_proto, k_proto = res
  if cfg.splits:   # the gradients of the output blocks, never concatenated
    qg = mode.quantize_fused(concat_op.concat_quantize, "grad", new_state, impl=impl,
                             parts=tuple(g))
  else:
    qg = mode.quantize(g, "grad", new_state, impl=impl)
  if cfg.save_input or cfg.save_kernel:   # see after_cotangent
    x_t, k = after_cotangent(g, x_t, k)
  if cfg.save_kernel:
    k = mode.quantize(k, "kernel", state, impl=impl, columnwise=False).rowwise()
  dx = mode.gemm("dgrad", qg.rowwise(), k, out_dtype=x_proto.dtype, impl=impl)
  if cfg.save_input:
    x_t = mode.quantize(x_t, "x", state, impl=impl).columnwise()
  dk = mode.gemm("wgrad", x_t, qg.columnwise(), out_dtype=k_proto.dtype, impl=impl)
  dbias = None
  if cfg.has_bias:
    parts = tuple(g) if cfg.splits else (g,)
    dbias = jnp.concatenate([jnp.sum(p.astype(jnp.float32), axis=0).astype(p.dtype)
                             for p in parts])
  dresidual = g if cfg.has_residual else None
  return dx, dk, dbias, dresidual, mode.update_state(new_state, {"grad": qg.amax})


_dense_2d.defvjp(_dense_2d_fwd, _dense_2d_bwd)


# -------------------------------------------------------- explicit axes --

def _sharded_order(kernel_axes, n_in: int, mesh_resource, mesh):
  """(in_perm, out_perm, 2-D kernel axes): each group of kernel dims reordered
  so that those mapped to mesh axes come first (see ``dense_general``)."""
  n_out = len(kernel_axes) - n_in
  mapped = sharding_lib.logical_to_mesh_axes(
      [(n,) for n in kernel_axes], mesh_resource=mesh_resource, mesh=mesh)
  is_sh = [bool(a) for a in mapped]
  in_perm = tuple(sorted(range(n_in), key=lambda i: not is_sh[i]))
  out_perm = tuple(sorted(range(n_out), key=lambda i: not is_sh[n_in + i]))
  return in_perm, out_perm, (tuple(kernel_axes[i] for i in in_perm),
                             tuple(kernel_axes[n_in + i] for i in out_perm))


def _explicit_output_spec(x, kernel, n_in: int, kernel_axes, mesh_resource, mesh):
  """The PartitionSpec of ``dense_general(x, kernel, ...)``'s output under an
  explicit-axes mesh (see the module docstring)."""
  lead = tuple(x.shape[:x.ndim - n_in])
  n_out = kernel.ndim - n_in
  m = sharding_lib.get_mesh(mesh)
  if (kernel_axes is not None and len(kernel_axes) == kernel.ndim and
      mesh_resource is not None and m is not None and lead):
    _, out_perm, axes2d = _sharded_order(kernel_axes, n_in, mesh_resource, m)
    k2d = (math.prod(kernel.shape[:n_in]), math.prod(kernel.shape[n_in:]))
    plan = sharded_dense.make_plan(lead + k2d[:1], k2d, x_dtype=x.dtype, k_dtype=kernel.dtype,
                                   has_bias=False, recipe=None, impl="auto",
                                   kernel_axes=axes2d, mesh_resource=mesh_resource, mesh=m)
    if plan is not None:   # the flattened N's axes belong to its leading out dim
      outs = [None] * n_out
      outs[out_perm[0]] = plan.y_spec[-1]
      return P(*plan.y_spec[:-1], *outs)
  xs, ks = explicit_lib.spec_of(x), explicit_lib.spec_of(kernel)
  used = {a for e in xs[:len(lead)] for a in ((e,) if isinstance(e, str) else e or ())}
  outs = []
  for e in ks[n_in:]:
    kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in used)
    used.update(kept)
    outs.append(kept or None)
  return P(*xs[:len(lead)], *outs)


def _explicit_axes_boundary(fn):
  """``fn`` (a dense of this module) run with the context mesh's Explicit
  axes switched to Auto when there are any (see the module docstring)."""
  @functools.wraps(fn)
  def wrapped(x, kernel, bias=None, *, fp8_state=None, **kw):
    if not explicit_lib.explicit_axes():
      return fn(x, kernel, bias, fp8_state=fp8_state, **kw)
    if kw.get("residual") is not None:   # added to the output outside the Auto region
      residual, kw = kw["residual"], {**kw, "residual": None}
      return wrapped(x, kernel, bias, fp8_state=fp8_state, **kw) + residual
    spec = _explicit_output_spec(x, kernel, kw.get("contract_ndim", 1), kw.get("kernel_axes"),
                                 kw.get("mesh_resource"), kw.get("mesh"))
    if kw.get("split_sizes") is not None or kw.get("num_splits") is not None:
      # fp8_dense_split: column blocks (checked again inside)
      n = len(kw["split_sizes"]) if kw.get("split_sizes") is not None else kw["num_splits"]
      spec = (P(*spec[:-1], None),) * n
    return explicit_lib.with_auto_axes(
        lambda x, kernel, bias, state: fn(x, kernel, bias, fp8_state=state, **kw),
        (x, kernel, bias, fp8_state), spec)
  return wrapped


# ------------------------------------------------------------------ public --

def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """Zero-pads dim ``axis`` of ``x`` up to a multiple of ``multiple``."""
  size = x.shape[axis]
  extra = -size % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


@_explicit_axes_boundary
def fp8_dense(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None, *,
              recipe: recipe_lib.Recipe, fp8_state=None, impl: str = "auto",
              kernel_axes=None, mesh_resource=None, mesh=None,
              save_original_input: bool = False,
              save_original_kernel: bool = False,
              residual: Optional[jax.Array] = None) -> jax.Array:
  """``x @ kernel + bias (+ residual)`` with every GEMM (fprop, dgrad, wgrad) in FP8.

  Args:
    x: (..., K) float32/bfloat16/float16 input.
    kernel: (K, N) weight.
    bias: optional (N,) bias.
    recipe: a ``te_jax.recipe`` recipe.
    fp8_state: for ``DelayedScaling``, the dict from
      ``fp8_state.init_dense_state`` (its update comes back as its gradient);
      must be None for the other recipes.
    impl: "auto", "cuda" or "reference" for the quantize and GEMM ops.
    kernel_axes: optional logical axis names of the kernel's two dims (each a
      name, None, or a tuple of names of a flattened dim). With them and a
      ``mesh_resource`` the GEMMs run sharded over the mesh
      (``te_jax.sharded_dense``): x is (batch, seq, ..., K) or (tokens, K)
      with its batch on (dp, fsdp).
    mesh_resource: a ``te_jax.sharding.MeshResource``, or None (unsharded).
      The Flax modules pass the one of the active ``fp8_autocast``.
    mesh: the mesh; default the active one (``jax.set_mesh``/``with mesh:``).
    save_original_input: what the backward keeps of x for the wgrad GEMM.
      False (default): its FP8 columnwise copy, 1 byte per element. True: x
      itself, quantized again in the backward (one more pass over it, same
      values bit for bit): no memory at all when x is kept for the backward
      anyway (the attention output that the attention's own backward reads),
      twice the bytes of the FP8 copy otherwise.
    save_original_kernel: the same for the kernel (dgrad GEMM): True keeps
      the kernel as given and quantizes it again in the backward, which costs
      no memory when it is a parameter (alive for the whole step) and is what
      the FP8-off dot keeps when it is a cast copy.
    The two apply to the unsharded GEMMs whose operands need no padding (a
    padded copy would be a new array to keep); elsewhere the FP8 copies are
    kept and the ``te_jax`` logger says so once (INFO).
    residual: optional (..., N) array of x's dtype added to the output: the
      fprop GEMM's C input (added before the output's one rounding) where
      unsharded and unpadded, elsewhere an add after the dense.

  Returns:
    (..., N) array in ``x.dtype``.
  """
  mode = _check_dense_args(x, kernel, bias, recipe, fp8_state)
  out_shape = x.shape[:-1] + kernel.shape[1:]
  if residual is not None and (residual.shape != out_shape or residual.dtype != x.dtype):
    raise ValueError(f"residual must have the output's shape {out_shape} and x's dtype "
                     f"{x.dtype}; got {residual.shape} {residual.dtype}.")
  keep = (bool(save_original_input), bool(save_original_kernel))
  if kernel_axes is not None and mesh_resource is not None:
    y = sharded_dense.sharded_fp8_dense(
        x, kernel, bias, recipe=recipe, fp8_state=fp8_state, impl=impl,
        kernel_axes=kernel_axes, mesh_resource=mesh_resource, mesh=mesh)
    if y is not None:
      if any(keep):
        log_fp8_copies_kept("its GEMMs are sharded (te_jax.sharded_dense keeps FP8 shards)")
      y = remat.tag_fp8_gemm(y)
      return y if residual is None else y + residual
  return _unsharded_fp8_dense(x, kernel, bias, mode, fp8_state, impl, (), keep, residual)[0]


@functools.lru_cache(maxsize=None)
def log_fp8_copies_kept(reason: str):
  """Says once per reason that a GEMM keeps its FP8 operand copies although
  ``save_original_input``/``save_original_kernel`` asked for the originals
  (shared by the dense, norm + dense and MLP layers)."""
  logging.getLogger("te_jax").info(
      "te_jax: an FP8 dense keeps its FP8 operand copies for the backward although "
      "save_original_input/save_original_kernel asked for the originals: %s", reason)


def _check_dense_args(x, kernel, bias, recipe, fp8_state):
  mode = scaling_mode_of(recipe)
  quantize_op.check_input(x, "x")
  quantize_op.check_input(kernel, "kernel", 2)
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x's last dim ({x.shape[-1]}) must equal kernel's first dim "
                     f"({kernel.shape[0]}); got x {x.shape}, kernel {kernel.shape}.")
  n = kernel.shape[1]
  if bias is not None and bias.shape != (n,):
    raise ValueError(f"bias must have shape ({n},), got {bias.shape}.")
  mode.check_state(fp8_state)
  return mode


def scaling_mode_of(recipe) -> scaling.ScalingMode:
  """``recipe.scaling_mode()``, with a TypeError naming ``recipe`` when it is
  not a ``te_jax.recipe`` recipe."""
  if not isinstance(recipe, recipe_lib.Recipe):
    raise TypeError(f"recipe must be a te_jax.recipe recipe, got {recipe!r}.")
  return recipe.scaling_mode()


def _unsharded_fp8_dense(x, kernel, bias, mode, fp8_state, impl, splits=(),
                         keep=(False, False), residual=None):
  """The padded 2-D custom-VJP dense; a tuple of outputs (one, or the column
  blocks of widths ``splits``), named for ``te_jax.remat``'s policies.
  ``keep``: (save_original_input, save_original_kernel), each applied where
  its operand needs no padding; ``residual`` (one output) the GEMM's C where
  the output needs none, else added after."""
  lead, k = x.shape[:-1], x.shape[-1]
  x2d = x.reshape(-1, k)
  m, n = x2d.shape[0], kernel.shape[1]
  align = mode.token_block
  xp = pad_to(pad_to(x2d, 0, align), 1, align)
  kp = pad_to(pad_to(kernel, 0, align), 1, align)
  bp = None if bias is None else pad_to(bias.astype(x.dtype), 0, align)
  save_input = keep[0] and xp.shape == x2d.shape
  save_kernel = keep[1] and kp.shape == kernel.shape
  if (keep[0] and not save_input) or (keep[1] and not save_kernel):
    log_fp8_copies_kept(f"an operand is padded to multiples of {align}")
  in_gemm = residual is not None and (xp.shape[0], kp.shape[1]) == (m, n)
  cfg = _Config(mode, impl, bias is not None, tuple(splits), save_input, save_kernel, in_gemm)
  y = _dense_2d(xp, kp, bp, residual.reshape(m, n) if in_gemm else None, fp8_state, cfg)
  if not splits:
    y = remat.tag_fp8_gemm(y[:m, :n].reshape(*lead, n))
    return (y if residual is None or in_gemm else y + residual,)
  # No column padding here: split_plan checked that every block is aligned.
  return tuple(remat.tag_fp8_gemm(part[:m].reshape(*lead, f)) for part, f in zip(y, splits))


def split_plan(n: int, num_splits, split_sizes, mode: scaling.ScalingMode
               ) -> Tuple[Tuple[int, ...], bool]:
  """Checks ``num_splits`` (equal blocks) or ``split_sizes`` (block widths)
  for an output of ``n`` columns; returns the block widths and whether the
  blocks can come out of their own GEMMs and their gradients be quantized
  apart (``ops/concat_quantize.py``: 2 to ``MAX_PARTS`` blocks, each a
  multiple of the mode's ``token_block``). Shared by ``fp8_dense_split`` and
  ``te_jax.norm_dense.fp8_norm_dense``."""
  if split_sizes is not None:
    if num_splits is not None and num_splits != 1:
      raise ValueError(f"pass num_splits ({num_splits!r}) or split_sizes "
                       f"({split_sizes!r}), not both.")
    sizes = scaling.check_split_sizes(split_sizes, n)
  else:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
      raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}.")
    if n % num_splits:
      raise ValueError(f"kernel's output dim ({n}) must be a multiple of num_splits "
                       f"({num_splits}).")
    sizes = (n // num_splits,) * num_splits
  fused = (1 < len(sizes) <= concat_op.MAX_PARTS
           and all(f % mode.token_block == 0 for f in sizes))
  return sizes, fused


def split_columns(y: jax.Array, sizes: Sequence[int]) -> Tuple[jax.Array, ...]:
  """``y`` (..., sum(sizes)) as column blocks of widths ``sizes`` (copies)."""
  return tuple(jnp.split(y, list(itertools.accumulate(sizes))[:-1], axis=-1))


@_explicit_axes_boundary
def fp8_dense_split(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None, *,
                    num_splits: Optional[int] = None,
                    split_sizes: Optional[Sequence[int]] = None, recipe: recipe_lib.Recipe,
                    fp8_state=None, impl: str = "auto", save_original_input: bool = False,
                    save_original_kernel: bool = False) -> Tuple[jax.Array, ...]:
  """``fp8_dense`` whose output comes back as column blocks: ``num_splits``
  equal ones, or blocks of widths ``split_sizes``.

  The values are those of splitting ``fp8_dense(x, kernel, bias, ...)`` along
  its last dim, for a fused projection whose outputs are used apart (Q, K and
  V of attention; with grouped-query attention the query block is wider than
  the key and value blocks), but no array of the whole output is written.
  Forward, each block comes out of its own GEMM on a row block of the FP8
  kernel (``ScalingMode.gemm(split_sizes=)``) instead of being copied out of
  one product; backward, the blocks' gradients are quantized for the dgrad
  and wgrad GEMMs straight from the separate arrays
  (``ops/concat_quantize.py``) instead of XLA first concatenating them (a
  16384 x 12288 bf16 Q/K/V gradient: 768 MiB of memory traffic less per
  step). Where that path does not apply (a block width not a multiple of the
  recipe's alignment, 16 per-tensor and 128 blockwise, or more than 4
  blocks), the output of ``fp8_dense`` is split instead: same values, with
  the copies and the concatenation. Unsharded only (no ``kernel_axes``): the
  sharded GEMMs of ``te_jax.sharded_dense`` keep the plain dense.

  Args:
    x: (..., K) float32/bfloat16/float16 input.
    kernel: (K, N) weight.
    bias: optional (N,) bias.
    num_splits: number of equal output blocks (an int >= 1 dividing N).
    split_sizes: instead, the blocks' widths (ints >= 1 summing to N).
    recipe, fp8_state, impl, save_original_input, save_original_kernel: as
      ``fp8_dense``.

  Returns:
    A tuple of arrays (..., width) in ``x.dtype``, one per block.

  >>> import jax.numpy as jnp
  >>> from te_jax import dense, recipe
  >>> x = jnp.ones((2, 128, 256), jnp.bfloat16); w = jnp.ones((256, 3 * 256), jnp.bfloat16)
  >>> q, k, v = dense.fp8_dense_split(x, w, num_splits=3,
  ...                                 recipe=recipe.Float8CurrentScaling())
  >>> q.shape, k.shape, v.shape
  ((2, 128, 256), (2, 128, 256), (2, 128, 256))
  >>> q, k, v = dense.fp8_dense_split(x, w, split_sizes=(512, 128, 128),
  ...                                 recipe=recipe.Float8CurrentScaling())
  >>> q.shape, k.shape, v.shape
  ((2, 128, 512), (2, 128, 128), (2, 128, 128))
  """
  mode = _check_dense_args(x, kernel, bias, recipe, fp8_state)
  if num_splits is None and split_sizes is None:
    raise ValueError("fp8_dense_split needs num_splits (equal blocks) or split_sizes "
                     "(the blocks' widths).")
  sizes, fused = split_plan(kernel.shape[1], num_splits, split_sizes, mode)
  keep = (bool(save_original_input), bool(save_original_kernel))
  if not fused:
    y = _unsharded_fp8_dense(x, kernel, bias, mode, fp8_state, impl, (), keep)[0]
    return split_columns(y, sizes)
  return _unsharded_fp8_dense(x, kernel, bias, mode, fp8_state, impl, sizes, keep)


@_explicit_axes_boundary
def dense(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None, *,
          recipe: Optional[recipe_lib.Recipe] = None, fp8_state=None,
          impl: str = "auto", kernel_axes=None, mesh_resource=None,
          mesh=None, save_original_input: bool = False,
          save_original_kernel: bool = False,
          residual: Optional[jax.Array] = None) -> jax.Array:
  """``fp8_dense`` when ``recipe`` is given, else a plain dot in ``x.dtype``.

  ``kernel_axes``/``mesh_resource``/``mesh``, ``save_original_input`` /
  ``save_original_kernel``, ``residual``: see ``fp8_dense`` (they only
  matter in FP8; the plain dot is partitioned by XLA and keeps its operands
  for its backward, and XLA fuses the residual's add).
  """
  if recipe is not None:
    return fp8_dense(x, kernel, bias, recipe=recipe, fp8_state=fp8_state, impl=impl,
                     kernel_axes=kernel_axes, mesh_resource=mesh_resource, mesh=mesh,
                     save_original_input=save_original_input,
                     save_original_kernel=save_original_kernel, residual=residual)
  y = lax.dot_general(x, kernel.astype(x.dtype),
                      (((x.ndim - 1,), (0,)), ((), ())))
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return y if residual is None else y + residual


@_explicit_axes_boundary
def dense_general(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None, *,
                  contract_ndim: int = 1, recipe: Optional[recipe_lib.Recipe] = None,
                  fp8_state=None, impl: str = "auto", kernel_axes=None,
                  mesh_resource=None, mesh=None, save_original_input: bool = False,
                  save_original_kernel: bool = False,
                  residual: Optional[jax.Array] = None) -> jax.Array:
  """``dense`` over the last ``contract_ndim`` dims of ``x`` with an N-D kernel.

  ``x`` is (*lead, *in_dims) (contracting dims last), ``kernel`` is
  (*in_dims, *out_dims), ``bias`` (*out_dims); the result is (*lead, *out_dims).
  The leading dims of ``x`` are kept (not flattened), so a (batch, seq) layout
  sharded for sequence parallelism reaches the sharded GEMM as it is.

  With ``kernel_axes`` (the kernel's logical names, one per dim) and an active
  mesh resource (FP8 on), the dims of each group are reordered so that those
  mapped to mesh axes come first before the 2-D view is taken (a flattened
  dim is then sharded exactly as its major dims are: no resharding); the
  output is permuted back. Without sharding this is a plain reshape.
  ``save_original_input`` / ``save_original_kernel``, ``residual`` (*lead,
  *out_dims): as ``fp8_dense``'s.
  """
  n_in = contract_ndim
  in_dims, out_dims = kernel.shape[:n_in], kernel.shape[n_in:]
  if tuple(x.shape[x.ndim - n_in:]) != tuple(in_dims):
    raise ValueError(f"x's last {n_in} dims {x.shape[x.ndim - n_in:]} must equal the "
                     f"kernel's first {n_in} dims {in_dims}.")
  lead = x.shape[:x.ndim - n_in]
  in_perm, out_perm = tuple(range(n_in)), tuple(range(len(out_dims)))
  axes2d = None
  if kernel_axes is not None and recipe is not None:
    if len(kernel_axes) != kernel.ndim:
      raise ValueError(f"kernel_axes {kernel_axes} must name each of the {kernel.ndim} "
                       f"kernel dims {kernel.shape}.")
    m = sharding_lib.get_mesh(mesh)
    if mesh_resource is not None and m is not None:
      in_perm, out_perm, axes2d = _sharded_order(kernel_axes, n_in, mesh_resource, m)
  k = jnp.transpose(kernel, in_perm + tuple(n_in + i for i in out_perm))
  k2d = k.reshape(math.prod(in_dims), math.prod(out_dims))
  nl = len(lead)
  xp = jnp.transpose(x, tuple(range(nl)) + tuple(nl + i for i in in_perm))
  xnd = xp.reshape(lead + (math.prod(in_dims),)) if lead else xp.reshape(1, -1)
  b = None if bias is None else jnp.transpose(bias, out_perm).reshape(-1)
  inside = residual is not None and out_perm == tuple(range(len(out_dims))) and bool(lead)
  y = dense(xnd, k2d, b, recipe=recipe, fp8_state=fp8_state, impl=impl,
            kernel_axes=axes2d, mesh_resource=mesh_resource, mesh=mesh,
            save_original_input=save_original_input,
            save_original_kernel=save_original_kernel,
            residual=residual.reshape(lead + (k2d.shape[1],)) if inside else None)
  y = y.reshape(lead + tuple(out_dims[i] for i in out_perm))
  inv = tuple(out_perm.index(i) for i in range(len(out_dims)))
  y = jnp.transpose(y, tuple(range(nl)) + tuple(nl + i for i in inv))
  return y if residual is None or inside else y + residual
