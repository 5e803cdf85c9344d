"""Every GEMM of a te_jax module, FP8 or not, sharded or not.

:func:`gemm` is ``x @ kernel (+ bias)`` for a module: it takes the GEMM's
FP8 state from the module's :class:`~te_jax.layers.state.GemmStates`, calls
the functional layer (``te_jax.dense``) with the recipe, mesh resource,
logical axis rules and implementation of the call's
:class:`~te_jax.layers.settings.Settings`, and keeps a state the call does
not use. :func:`mlp_core` does the same for the fused MLP core
(``te_jax.fused_mlp``), with the states two :func:`gemm` calls would use.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from te_jax import dense as dense_lib
from te_jax import explicit_axes as explicit_lib
from te_jax import fused_mlp
from te_jax import sharding as sharding_lib
from te_jax.layers.settings import Settings
from te_jax.layers.state import GemmStates

__all__ = ["FP8_META", "SplitOutput", "canonicalize_axes", "gemm", "gemm_kernel", "gemm_output",
           "split_gemm", "plain_split_gemm", "output_blocks", "block_size", "block_shape",
           "check_split_output", "mlp_core",
           "update_probe", "ON_UNSUPPORTED",
           "parse_dimension_numbers", "fp8_blocker", "check_dot_general_call",
           "dot_general_product", "log_fallback"]

# A split output: False, True (the first out dim unstacked) or block sizes.
SplitOutput = Union[bool, Tuple[int, ...]]

# The state name of a module's one GEMM (DenseGeneral, Linear, Fp8DotGeneral).
FP8_META = "fp8_meta"


def canonicalize_axes(axes, ndim: int) -> Tuple[int, ...]:
  """Normalizes an int or tuple of (possibly negative) axes of an ndim array."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  out = tuple(a % ndim if -ndim <= a < ndim else None for a in axes)
  if None in out:
    raise ValueError(f"axis {axes} out of range for an input of rank {ndim}.")
  if len(set(out)) != len(out):
    raise ValueError(f"axis {axes} repeats an axis.")
  return out


def gemm(states: GemmStates, settings: Settings, x: jax.Array, kernel: jax.Array,
         bias: Optional[jax.Array] = None, *, name: str = FP8_META, contract_ndim: int = 1,
         kernel_axes: Optional[Sequence[Optional[str]]] = None,
         split_output: SplitOutput = False, track: bool = True,
         residual: Optional[jax.Array] = None):
  """``x @ kernel (+ bias) (+ residual)`` over the last ``contract_ndim`` dims of ``x``.

  Calls :func:`te_jax.dense.dense_general`, which keeps the leading dims of
  ``x`` (a (batch, seq) layout sharded for sequence parallelism reaches the
  GEMM as it is) and, with ``kernel_axes`` and a mesh resource, runs the FP8
  GEMMs sharded.

  Args:
    states: the module's FP8 state (:class:`~te_jax.layers.state.GemmStates`).
    settings: what the module read from the autocast; ``settings.recipe``
      None means a plain dot in ``x.dtype``.
    x: (*lead, *in_dims) input in the compute dtype, contracting dims last.
    kernel: (*in_dims, *out_dims) kernel in its parameter dtype (see
      :func:`gemm_kernel`).
    bias: optional (*out_dims) bias in the compute dtype.
    name: the GEMM's state name (one per GEMM of the module).
    contract_ndim: number of contracting dims (``len(in_dims)``).
    kernel_axes: logical axis names of the kernel, one per dim.
    split_output: True returns the output unstacked along its first out dim,
      a tuple of ``out_dims[0]`` arrays (*lead, *out_dims[1:]); a tuple of
      sizes summing to ``out_dims[0]`` returns that dim split into blocks of
      those sizes, (*lead, size, *out_dims[1:]) each (grouped-query
      attention's query, key and value heads). In FP8 and unsharded, through
      ``te_jax.dense.fp8_dense_split`` (each part from its own GEMM, the
      parts' gradients quantized without being concatenated); with FP8 off
      one dot per part (:func:`plain_split_gemm`).
    track: report this GEMM to ``states.track_updates`` when it uses FP8
      state (one GEMM per module call does).
    residual: optional (*lead, *out_dims) array in x's dtype added to the
      output (``te_jax.dense.fp8_dense``'s: the GEMM's C input where it
      can be); not with ``split_output``.

  Returns:
    (*lead, *out_dims) array in ``x.dtype``, or the tuple (``split_output``).
  """
  param_kernel = kernel
  kernel = gemm_kernel(settings, kernel, x.dtype)
  kernel_axes = None if kernel_axes is None else tuple(kernel_axes)
  state = None if settings.mode is None else states.state(name, settings.mode)
  if state is not None and track:
    states.track_updates(update_probe(param_kernel))
  y = gemm_output(x, kernel, bias, settings, state, contract_ndim=contract_ndim,
                  kernel_axes=kernel_axes, split_output=split_output, residual=residual)
  return y if state is not None else states.keep_unused(y, (name,))


def update_probe(kernel: jax.Array) -> jax.Array:
  """What :meth:`GemmStates.track_updates` is given of a GEMM's kernel: the
  kernel, or under an explicit-axes mesh its first element as a (1,) array
  (the one value the update check reads; taking it from a kernel whose
  type is sharded needs the auto axes of
  ``te_jax.explicit_axes.with_auto_axes``)."""
  if not explicit_lib.explicit_axes():
    return kernel
  return explicit_lib.with_auto_axes(lambda k: k.reshape(-1)[:1], (kernel,), P())


def gemm_output(x, kernel, bias, settings: Settings, state, *, contract_ndim: int,
                kernel_axes=None, split_output: SplitOutput = False, residual=None):
  """The GEMM of :func:`gemm` once the module has its kernel and state: a
  split output through :func:`split_gemm` (FP8, unsharded) or
  :func:`plain_split_gemm` (FP8 off), everything else through
  ``te_jax.dense.dense_general`` under the call's logical axis rules."""
  recipe = settings.recipe
  if residual is not None and split_output is not False:
    raise ValueError("a residual is added to one output, not to a split_output.")
  if split_output is not False and recipe is not None and settings.unsharded():
    return split_gemm(x, kernel, bias, settings, state, contract_ndim, split_output)
  if split_output is not False and recipe is None:
    return plain_split_gemm(x, kernel, bias, contract_ndim, kernel_axes=kernel_axes,
                            mesh_resource=settings.mesh_resource, mesh=settings.mesh,
                            split_output=split_output)
  with sharding_lib.use_axis_rules(settings.axis_rules):
    y = dense_lib.dense_general(x, kernel, bias, contract_ndim=contract_ndim, recipe=recipe,
                                fp8_state=state, impl=settings.impl, kernel_axes=kernel_axes,
                                mesh_resource=settings.mesh_resource, mesh=settings.mesh,
                                residual=residual)
  blocks = output_blocks(split_output, kernel.shape[contract_ndim:])
  if blocks:   # sharded FP8: the blocks are slices of the one output
    lead = (slice(None),) * (x.ndim - contract_ndim)
    y = tuple(y[lead + (b,)] for b in blocks)
  return y


def gemm_kernel(settings: Settings, kernel: jax.Array, compute_dtype) -> jax.Array:
  """The kernel as the module's GEMM takes it.

  Unsharded FP8 GEMMs quantize it straight from its parameter dtype: one pass
  over the float32 weights instead of a convert to the compute dtype and then
  a quantize of the copy, and one rounding (to FP8) instead of two; the
  weight gradient comes out of the GEMM in the parameter dtype. A plain dot,
  and the sharded path (whose weight gradients are reduce-scattered: half the
  bytes in bf16), take it in the compute dtype.
  """
  if settings.recipe is not None and settings.unsharded():
    return kernel
  return kernel.astype(compute_dtype)


def check_split_output(split_output, out_dims: Sequence[int], arg: str = "split_output"):
  """Checks a module's ``split_output`` (False, True, or block sizes along the
  first of ``out_dims``) at construction or trace time."""
  if isinstance(split_output, bool):
    if split_output and len(out_dims) < 2:
      raise ValueError(f"{arg}=True unstacks the first of several output dims; the "
                       f"output dims {tuple(out_dims)} are {len(out_dims)}. Use (n, ...) "
                       f"output dims, or {arg}=(sizes...) to split the first one.")
    return
  sizes = tuple(split_output) if isinstance(split_output, (list, tuple)) else ()
  if (not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                           for s in sizes) or sum(sizes) != out_dims[0]):
    raise ValueError(f"{arg} must be a bool or a tuple of ints >= 1 summing to the first "
                     f"output dim ({out_dims[0]} of {tuple(out_dims)}); got {split_output!r}.")


def output_blocks(split_output, out_dims: Sequence[int]) -> Tuple[object, ...]:
  """The index along the first out dim of each block of a split output: ints
  (``split_output=True``: that dim unstacked) or slices (block sizes); ()
  when the output is not split."""
  check_split_output(split_output, out_dims)
  if split_output is True:
    return tuple(range(out_dims[0]))
  if split_output is False:
    return ()
  starts = [sum(split_output[:i]) for i in range(len(split_output))]
  return tuple(slice(s, s + n) for s, n in zip(starts, split_output))


def block_size(block) -> int:
  """How many entries of the first out dim a block of ``output_blocks`` holds."""
  return 1 if isinstance(block, int) else block.stop - block.start


def block_shape(block, out_dims: Sequence[int]) -> Tuple[int, ...]:
  """A block's shape after the leading dims: the first out dim dropped
  (unstacked) or cut to the block's size."""
  return (() if isinstance(block, int) else (block_size(block),)) + tuple(out_dims[1:])


def split_gemm(x, kernel, bias, settings: Settings, state, contract_ndim: int,
               split_output: SplitOutput = True):
  """``gemm(..., split_output=...)`` in FP8, unsharded, through
  ``te_jax.dense.fp8_dense_split``: a tuple of the blocks."""
  lead = x.shape[:x.ndim - contract_ndim]
  in_dims, out_dims = kernel.shape[:contract_ndim], kernel.shape[contract_ndim:]
  k, rest = math.prod(in_dims), math.prod(out_dims[1:])
  blocks = output_blocks(split_output, out_dims)
  parts = dense_lib.fp8_dense_split(
      x.reshape(lead + (k,)), kernel.reshape(k, -1),
      None if bias is None else bias.reshape(-1),
      split_sizes=tuple(block_size(b) * rest for b in blocks),
      recipe=settings.recipe, fp8_state=state, impl=settings.impl)
  return tuple(p.reshape(lead + block_shape(b, out_dims)) for p, b in zip(parts, blocks))


def plain_split_gemm(x, kernel, bias, contract_ndim: int, *, kernel_axes=None,
                     mesh_resource=None, mesh=None, split_output: SplitOutput = True):
  """``gemm(..., split_output=...)`` with FP8 off: one dot per block of the
  kernel's first output dim, a tuple of the blocks (*lead, *out_dims[1:])
  (unstacked) or (*lead, size, *out_dims[1:]) (block sizes).
  ``kernel_axes`` (the whole kernel's), ``mesh_resource`` and ``mesh`` only
  set the blocks' types under an explicit-axes mesh (as
  ``te_jax.dense.dense_general``'s).

  Each block is written where its user reads it: one dot over the whole
  kernel and a split of its output would copy every block, and its backward
  would assemble the blocks' gradients into one array for the data-gradient
  dot. Each block's operands pass through their own
  ``optimization_barrier``: XLA's GPU pipeline otherwise merges dots that
  share ``x`` back into one dot over a concatenated kernel and slices its
  output.
  """
  lead = (slice(None),) * contract_ndim
  parts = []
  for b in output_blocks(split_output, kernel.shape[contract_ndim:]):
    part_axes = None if kernel_axes is None else (
        tuple(kernel_axes[:contract_ndim])
        + tuple(kernel_axes[contract_ndim + isinstance(b, int):]))
    xi, ki = jax.lax.optimization_barrier((x, kernel[lead + (b,)]))
    parts.append(dense_lib.dense_general(xi, ki, None if bias is None else bias[b],
                                         contract_ndim=contract_ndim, kernel_axes=part_axes,
                                         mesh_resource=mesh_resource, mesh=mesh))
  return tuple(parts)


def mlp_core(states: GemmStates, settings: Settings, x2d, wi2d, bi, wo, bo, *,
             activations, names: Sequence[str] = ("wi_fp8_meta", "wo_fp8_meta"),
             backward_chunks: int = 1):
  """``te_jax.fused_mlp.fp8_mlp`` with the module's FP8 state.

  Uses (and updates) the same states as two :func:`gemm` calls named
  ``names`` would, so a model can switch between the fused and the unfused
  path without touching its variables. FP8 must be on; the weights in their
  parameter dtype (the fused core runs unsharded, as :func:`gemm_kernel`
  gives them there). Shapes: ``x2d`` (M, E), ``wi2d`` (E, n_act * F),
  ``bi`` (n_act * F,) or None, ``wo`` (F, E), ``bo`` (E,) or None -> (M, E).
  """
  si, so = (states.state(n, settings.mode) for n in names)
  if si is not None:
    states.track_updates(update_probe(wi2d))
  y = fused_mlp.fp8_mlp(x2d, wi2d, wo, bi, bo, activations=activations,
                        recipe=settings.recipe, wi_state=si, wo_state=so,
                        impl=settings.impl, backward_chunks=backward_chunks,
                        **settings.mlp_residual_plan())
  return y if si is not None else states.keep_unused(y, names)


# ------------------------------------------------- dot_general in FP8 --
# The drop-in FP8 ``dot_general`` of each framework (``te_jax.flax.Fp8DotGeneral``
# and ``Fp8Einsum`` for Linen, ``te_jax.nnx.Fp8DotGeneral`` for NNX) calls
# :func:`dot_general_product`: which contractions run as an FP8 GEMM, and
# the plain ``lax.dot_general`` (with a warning once per reason) for the rest.

ON_UNSUPPORTED = ("warn", "raise")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=None)
def log_fallback(op_name: str, reason: str):
  """Warns once per (op, reason) (``te_jax`` logger) that a product left FP8."""
  logging.getLogger("te_jax").warning(
      "te_jax: %s runs a plain lax.dot_general (not FP8) because %s. "
      "Pass on_unsupported='raise' to make this an error.", op_name, reason)


def _dims(value, what: str, ndim: int) -> Tuple[int, ...]:
  """One entry of ``dimension_numbers`` as a tuple of in-range axes."""
  if isinstance(value, int) and not isinstance(value, bool):
    value = (value,)
  try:
    dims = tuple(int(d) for d in value)
  except (TypeError, ValueError):
    raise ValueError(f"dimension_numbers: {what} must be a sequence of ints, got "
                     f"{value!r}.") from None
  if any(not -ndim <= d < ndim for d in dims):
    raise ValueError(f"dimension_numbers: {what} {dims} out of range for an operand of "
                     f"rank {ndim}.")
  dims = tuple(d % ndim for d in dims)
  if len(set(dims)) != len(dims):
    raise ValueError(f"dimension_numbers: {what} {dims} repeats an axis.")
  return dims


def parse_dimension_numbers(lhs, rhs, dimension_numbers):
  """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` checked against
  the operands' shapes; a ValueError naming the bad part otherwise."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
  except (TypeError, ValueError):
    raise ValueError(
        "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
        f"rhs_batch)) as for lax.dot_general, got {dimension_numbers!r}.") from None
  lc, lb = _dims(lc, "lhs contracting dims", lhs.ndim), _dims(lb, "lhs batch dims", lhs.ndim)
  rc, rb = _dims(rc, "rhs contracting dims", rhs.ndim), _dims(rb, "rhs batch dims", rhs.ndim)
  for name, a, b in (("contracting", lc, rc), ("batch", lb, rb)):
    la, lb_ = [lhs.shape[d] for d in a], [rhs.shape[d] for d in b]
    if la != lb_:
      raise ValueError(f"dimension_numbers: the {name} dims of lhs {a} (sizes {la}) and "
                       f"rhs {b} (sizes {lb_}) must match; lhs {lhs.shape}, rhs "
                       f"{rhs.shape}.")
  if set(lc) & set(lb) or set(rc) & set(rb):
    raise ValueError(f"dimension_numbers {dimension_numbers!r}: an axis is both "
                     "contracting and batch.")
  return (lc, rc), (lb, rb)


def fp8_blocker(lhs, rhs, dims, preferred_element_type, kwargs) -> Optional[str]:
  """Why ``lax.dot_general(lhs, rhs, dims, ...)`` cannot run as an FP8 dense
  (None when it can); ``dims`` as :func:`parse_dimension_numbers` returns."""
  (lc, _), (lb, rb) = dims
  if lb or rb:
    return (f"the contraction has batch dims (lhs {lb}, rhs {rb}); te_jax's FP8 dense "
            "has none")
  if not lc:
    return "the contraction has no contracting dims (an outer product)"
  for name, a in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
      return f"{name} is {jnp.dtype(a.dtype)}, not float32, bfloat16 or float16"
    if a.size == 0:
      return f"{name} is empty (shape {a.shape})"
  if preferred_element_type is not None and not jnp.issubdtype(
      preferred_element_type, jnp.floating):
    return f"preferred_element_type is {jnp.dtype(preferred_element_type)}, not a float"
  if kwargs.get("out_sharding") is not None:
    return "an out_sharding was given"
  return None


def check_dot_general_call(op_name: str, kwargs, on_unsupported: str):
  """Checks a dot_general op's extra keyword arguments and ``on_unsupported``."""
  unknown = sorted(set(kwargs) - {"out_sharding"})
  if unknown:
    raise TypeError(f"{op_name} got unexpected keyword arguments {unknown}; it takes "
                    "lax.dot_general's (lhs, rhs, dimension_numbers, precision, "
                    "preferred_element_type, out_sharding).")
  if on_unsupported not in ON_UNSUPPORTED:
    raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got "
                     f"{on_unsupported!r}.")


def dot_general_product(op_name, settings, state, on_unsupported, lhs, rhs, dimension_numbers,
                        precision=None, preferred_element_type=None, **kwargs):
  """(lhs . rhs as ``lax.dot_general`` defines it, whether it ran in FP8).

  ``settings.recipe`` must not be None; ``state`` is the GEMM's FP8 state
  (None for stateless recipes), unused when the product falls back.
  """
  check_dot_general_call(op_name, kwargs, on_unsupported)
  dims = parse_dimension_numbers(lhs, rhs, dimension_numbers)
  reason = fp8_blocker(lhs, rhs, dims, preferred_element_type, kwargs)
  if reason is not None:
    if on_unsupported == "raise":
      raise ValueError(
          f"{op_name} cannot run lhs {lhs.shape} {lhs.dtype} x rhs {rhs.shape} "
          f"{rhs.dtype} with dimension_numbers {dimension_numbers!r} in FP8: {reason}. "
          "Use on_unsupported='warn' to run it as a plain lax.dot_general, or a layer "
          "without the FP8 op for this product.")
    log_fallback(op_name, reason)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **kwargs), False
  (lc, rc), _ = dims
  lhs_free = tuple(d for d in range(lhs.ndim) if d not in lc)
  rhs_free = tuple(d for d in range(rhs.ndim) if d not in rc)
  compute = jnp.result_type(lhs.dtype, rhs.dtype)
  # x (*lhs_free, *contract) and kernel (*contract, *rhs_free): the te_jax
  # dense layout; transposes that are identities cost nothing.
  x = jnp.transpose(lhs, lhs_free + lc).astype(compute)
  kernel = gemm_kernel(settings, jnp.transpose(rhs, rc + rhs_free), compute)
  y = gemm_output(x, kernel, None, settings, state, contract_ndim=len(lc))
  return y.astype(compute if preferred_element_type is None else preferred_element_type), True
