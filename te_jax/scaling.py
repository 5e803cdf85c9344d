"""The scaling protocol: everything recipe-specific about an FP8 GEMM, in one place.

Every recipe (``te_jax.recipe``) names one :class:`ScalingMode` through its
``scaling_mode()`` method. The FP8 layers -- the dense ``custom_vjp``
(``te_jax.dense``), the fused MLP (``te_jax.fused_mlp``), the split Q/K/V
projection and the sharded dense (``te_jax.sharded_dense``) -- only call this
protocol; none of them looks at the recipe's type. The way optax builds every
optimizer from ``GradientTransformation``, a recipe here is one dataclass plus
one ``ScalingMode``.

Vocabulary. A dense layer ``y = x @ kernel`` has three FP8 GEMMs, each taking
two operands contiguous along its contraction dim ("TN", what cuBLASLt wants
on Hopper):

=========  ==========================  =================================
GEMM       a (M-side, K-major)         b (N-side, K-major)
=========  ==========================  =================================
fprop      x (M, K)                    kernel.T (N, K)
dgrad      grad (M, N)                 kernel (K, N)
wgrad      x.T (K, M)                  grad.T (N, M)
=========  ==========================  =================================

so each tensor ("role": ``"x"``, ``"kernel"`` or ``"grad"``) is quantized
once, rowwise and columnwise, and each copy feeds one GEMM.

What a ``ScalingMode`` owns:

* ``dtype(role)``: the FP8 format of each role (``recipe.fwd_dtype`` for x and
  kernel, ``recipe.bwd_dtype`` for the gradient);
* ``quantize(x, role, state, ...)``: both copies of a tensor, and with
  ``amax_axes`` a scale shared by the devices of a mesh;
* ``quantize_stack(x, role, state, ...)``: the same for each entry of a
  stack (E, K, N) with per-entry state (the expert weights of a grouped
  dense), in one launch where the mode has a batched op;
* ``quantize_fused(op, role, state, ...)``: the same through an op that
  computes the tensor in its prologue (``act_quantize``, ``dact_quantize``,
  ``concat_quantize``), i.e. which ops ``mode`` the recipe maps to;
* ``init_state()`` / ``check_state(state)`` / ``update_state(state, amaxes)``:
  the per-GEMM state (only delayed scaling has one);
* ``fast_accum(gemm)``: the accumulation setting of each GEMM, which
  ``gemm(which, a, b, ...)`` applies;
* ``token_block``: the multiple the token dim (and K, N) is padded to.

Adding a recipe: write its frozen dataclass in ``recipe.py`` with a
``scaling_mode()`` that returns a new ``ScalingMode`` subclass here; if it
needs a new kernel, add a ``mode`` or a tile layout to the ops tiling table
(``te_jax/ops/tiling.py``) and map to it in ``quantize``/``quantize_fused``. Nothing in the
dense, MLP, attention or sharding code changes. ``docs/recipes.md`` walks
through it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
import warnings
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
from jax import lax
import numpy as np

from te_jax import fp8_state as state_lib
from te_jax.ops import gemm as gemm_op
from te_jax.ops import quantize as quantize_op
from te_jax.ops import quantize_stack as stack_op
from te_jax.ops import tiling
from te_jax.ops.fp8 import (QuantizedTensor, ScaledTensor, amax as amax_of,
                            nan_scale_inv_if_non_finite, pmax_amax)

__all__ = ["ROLES", "GEMMS", "check_split_sizes", "ScalingMode", "DelayedScalingMode",
           "CurrentScalingMode", "BlockScalingMode"]

ROLES = ("x", "kernel", "grad")
GEMMS = ("fprop", "dgrad", "wgrad")
# Float8BlockScaling's layout of each role, and the fused-prologue ops mode
# that writes the layout of x and grad (the only operands those ops make).
_ROLE_LAYOUTS = {"x": tiling.TILE_1X128, "grad": tiling.TILE_1X128,
                 "kernel": tiling.BLOCK_128X128}
_FUSED_MODE = "blockwise"


def _check_role(role):
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}.")


@functools.lru_cache(maxsize=None)
def _warn_stack_by_entry(mode_name: str):
  """Once per mode class: its stacks are quantized entry by entry."""
  warnings.warn(
      f"te_jax: {mode_name} has no batched quantize_stack; each entry of a stack (the "
      "expert weights of a grouped dense) is quantized on its own in a lax.map (one "
      "quantize launch per entry, in an XLA loop). Override quantize_stack with a "
      "te_jax.ops.quantize_stack op to quantize the stack in one launch.",
      UserWarning, stacklevel=3)


def check_split_sizes(split_sizes, n: int) -> Tuple[int, ...]:
  """``split_sizes`` as a tuple of ints >= 1 that sum to ``n`` (an output's
  columns); ValueError naming the argument otherwise."""
  sizes = tuple(split_sizes) if isinstance(split_sizes, (list, tuple)) else None
  if not sizes or not all(isinstance(f, (int, np.integer)) and not isinstance(f, bool)
                          and f >= 1 for f in sizes):
    raise ValueError(f"split_sizes must be a non-empty list or tuple of ints >= 1, "
                     f"got {split_sizes!r}.")
  if sum(sizes) != n:
    raise ValueError(f"split_sizes {sizes} must sum to the output's {n} columns.")
  return tuple(int(f) for f in sizes)


@dataclasses.dataclass(frozen=True)
class ScalingMode(abc.ABC):
  """How one recipe quantizes the operands of its FP8 GEMMs (see the module doc).

  Attributes:
    recipe: the recipe dataclass this mode serves (its fields are the options).
    token_block: class constant, the multiple FP8 GEMMs need along the token
      dim (and K, N); the layers zero-pad to it.
    uses_state: class constant, whether each GEMM carries state between steps.
    scales_from_whole_tensor: class constant, whether a tensor's scale comes
      from the tensor itself (its amax), so that a piece of it cannot be
      quantized before the whole is known.
  """

  recipe: Any
  token_block: ClassVar[int] = 16
  uses_state: ClassVar[bool] = False
  scales_from_whole_tensor: ClassVar[bool] = False

  def dtype(self, role: str):
    """FP8 dtype of ``role``: the gradient in ``bwd_dtype``, the rest ``fwd_dtype``."""
    _check_role(role)
    return self.recipe.bwd_dtype if role == "grad" else self.recipe.fwd_dtype

  def fast_accum(self, gemm: str) -> bool:
    """Whether ``gemm`` ("fprop", "dgrad", "wgrad") accumulates at the tensor
    cores' reduced precision (cuBLASLt fast accumulation)."""
    del gemm
    return False

  def gemm(self, which: str, a: ScaledTensor, b: ScaledTensor, *, out_dtype,
           bias: Optional[jax.Array] = None, impl: str = "auto",
           num_splits: int = 1, split_sizes: Optional[Sequence[int]] = None,
           residual: Optional[jax.Array] = None
           ) -> Union[jax.Array, Tuple[jax.Array, ...]]:
    """``a @ b.T`` (a (M, K), b (N, K)) as GEMM ``which`` ("fprop", "dgrad",
    "wgrad"), with this mode's accumulation setting for it; (M, N) ``out_dtype``.
    ``residual``: an (M, N) ``out_dtype`` array added before the output's one
    rounding (``ops.gemm``'s; one output only).

    With ``num_splits`` > 1 the output comes back as a tuple of that many
    column blocks (M, N / num_splits), one GEMM per row block of ``b``
    (``b.row_blocks``): each block is written where its user reads it.
    Splitting one (M, N) output afterwards would cost a copy of every block
    (the whole output read and written once more), while the narrower GEMMs
    take no longer than the one (BENCHMARKS.md has the figures for the
    fused Q/K/V projection). ``N / num_splits`` must be a whole number of
    ``b``'s scale tiles. ``split_sizes`` (instead of ``num_splits``): blocks
    of these widths (summing to N, each boundary on a scale tile), e.g. the
    query, key and value blocks of grouped-query attention.
    """
    if residual is not None and (split_sizes is not None or num_splits != 1):
      raise ValueError("a residual is added to one output: pass it without num_splits or "
                       "split_sizes.")
    if split_sizes is not None:
      sizes = check_split_sizes(split_sizes, b.shape[0])
      if num_splits != 1:
        raise ValueError("pass num_splits or split_sizes, not both.")
      starts = (0,) + tuple(itertools.accumulate(sizes))[:-1]
      parts = tuple(b.rows(s, s + f) for s, f in zip(starts, sizes))  # checks the tiles
    else:
      if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}.")
      if num_splits == 1:
        return gemm_op.gemm(a, b, out_dtype=out_dtype, bias=bias,
                            fast_accum=self.fast_accum(which), residual=residual, impl=impl)
      parts = b.row_blocks(num_splits)   # checks that the blocks keep whole tiles
    outs, start = [], 0
    for part in parts:
      stop = start + part.shape[0]
      outs.append(self.gemm(which, a, part, out_dtype=out_dtype, impl=impl,
                            bias=None if bias is None else bias[start:stop]))
      start = stop
    return tuple(outs)

  # -- state ------------------------------------------------------------------

  def init_state(self) -> Optional[Dict[str, Any]]:
    """Fresh state of one GEMM (a pytree), or None for stateless recipes."""
    return None

  def check_state(self, state) -> None:
    """Raises ValueError unless ``state`` is what this mode's GEMMs take."""
    if state is not None:
      raise ValueError(f"fp8_state must be None for {type(self.recipe).__name__}.")

  def update_state(self, state, amaxes: Mapping[str, jax.Array]):
    """The state after this step saw ``amaxes`` ({role: amax}); unchanged if stateless."""
    del amaxes
    return state

  # -- quantization -----------------------------------------------------------

  @abc.abstractmethod
  def quantize(self, x: jax.Array, role: str, state=None, *, impl: str = "auto",
               columnwise: bool = True, amax_axes: Sequence[str] = ()
               ) -> QuantizedTensor:
    """Quantizes 2-D ``x`` (M, K) as operand ``role``.

    Args:
      x: (M, K) float32/bfloat16/float16.
      role: "x", "kernel" or "grad".
      state: this GEMM's state (``init_state()``), or None for stateless modes.
      impl: "auto", "cuda" or "reference".
      columnwise: also write the (K, M) copy the other GEMM of ``role`` reads.
      amax_axes: mesh axes over which ``x`` is sharded (inside ``shard_map``):
        per-tensor scales and amaxes are max-reduced over them so every device
        uses one scale.

    Returns:
      A ``QuantizedTensor`` whose ``amax`` (per-tensor modes) is the reduced
      amax of this step.
    """

  @abc.abstractmethod
  def quantize_fused(self, op: Callable[..., QuantizedTensor], role: str, state=None, *,
                     impl: str = "auto", **operands) -> QuantizedTensor:
    """Runs a fused-prologue quantize ``op`` (``act_quantize``, ``dact_quantize``,
    ``concat_quantize``) on ``operands`` with this mode's options for ``role``."""

  def quantize_stack(self, x: jax.Array, role: str, state=None, *, impl: str = "auto",
                     columnwise: bool = True, amax_axes: Sequence[str] = ()
                     ) -> QuantizedTensor:
    """Quantizes each entry ``x[e]`` (K, N) of a stack ``x`` (E, K, N) as
    :meth:`quantize` quantizes it alone with entry e's state.

    Args:
      x: (E, K, N) float32/bfloat16/float16.
      role: "x", "kernel" or "grad".
      state: this GEMM's state whose ``state[role]`` leaves carry a leading E
        axis (one state per entry, ``te_jax.grouped_dense.init_grouped_state``),
        or None for stateless modes.
      impl, columnwise, amax_axes: as for :meth:`quantize`, per entry (each
        entry's amax is max-reduced over ``amax_axes`` on its own).

    Returns:
      A ``QuantizedTensor`` whose fields carry a leading E axis: data (E, K,
      N), scale_inv (E,) or (E, ceil(K/bm), ceil(N/bk)), data_t (E, N, K)
      and scale_inv_t with ``columnwise``, amax (E,) (per-tensor modes).

    This default runs :meth:`quantize` per entry in a ``lax.map`` (E
    launches in an XLA loop) and warns once per mode class; the built-in
    modes override it with one launch over the stack (``ops/quantize_stack``).
    """
    _warn_stack_by_entry(type(self).__name__)

    def one(args):
      w, st = args
      return self.quantize(w, role, None if st is None else {role: st}, impl=impl,
                           columnwise=columnwise, amax_axes=amax_axes)
    return lax.map(one, (x, None if state is None else state[role]))


def reduce_amax(q: QuantizedTensor, amax_axes) -> QuantizedTensor:
  """Delayed scaling on a mesh: the amax (scalar, or (E,) per entry) max-reduced
  over ``amax_axes``, so one amax everywhere, and a non-finite one poisons
  every shard's scale_inv. (The scale came from replicated state: it agrees.)
  ``q`` unchanged without axes or without an amax (blockwise)."""
  if not amax_axes or q.amax is None:
    return q
  return nan_scale_inv_if_non_finite(q.replace(amax=pmax_amax(q.amax, tuple(amax_axes))))


class _PerTensorMode(ScalingMode):
  """Shared by the per-tensor modes: one scale per tensor, per-GEMM accumulation."""

  def fast_accum(self, gemm: str) -> bool:
    if gemm not in GEMMS:
      raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}.")
    return getattr(self.recipe, f"fast_accum_{gemm}")


@dataclasses.dataclass(frozen=True)
class DelayedScalingMode(_PerTensorMode):
  """Per-tensor scale from the amax history of earlier steps (``DelayedScaling``).

  State per GEMM: ``fp8_state.init_dense_state(recipe.amax_history_len)``.
  Sharded: the amax of each quantized tensor is max-reduced over the mesh
  after the cast (the scale came from the replicated state, so it already
  agrees).
  """

  uses_state: ClassVar[bool] = True

  def init_state(self):
    return state_lib.init_dense_state(self.recipe.amax_history_len)

  def check_state(self, state) -> None:
    if state is None:
      raise ValueError(f"{type(self.recipe).__name__} needs fp8_state (see "
                       "te_jax.fp8_state.init_dense_state); the Flax modules create it "
                       "for you.")

  def update_state(self, state, amaxes):
    if state is None:
      return None
    new = dict(state)
    for role, amax in amaxes.items():
      new[role] = state_lib.update_tensor_state(state[role], amax, self.recipe,
                                                self.dtype(role))
    return new

  def _scale(self, state, role):
    return state_lib.scale_from_state(state[role])

  def quantize(self, x, role, state=None, *, impl="auto", columnwise=True, amax_axes=()):
    q = quantize_op.quantize_tensorwise(x, self._scale(state, role), self.dtype(role),
                                        columnwise=columnwise, impl=impl)
    return reduce_amax(q, amax_axes)

  def quantize_stack(self, x, role, state=None, *, impl="auto", columnwise=True,
                     amax_axes=()):
    # state[role]["scale"] is (E,) here: scale_from_state is elementwise.
    q = stack_op.quantize_stack_tensorwise(x, self._scale(state, role), self.dtype(role),
                                           columnwise=columnwise, impl=impl)
    return reduce_amax(q, amax_axes)

  def quantize_fused(self, op, role, state=None, *, impl="auto", **operands):
    return op(**operands, mode="tensorwise", dtype=self.dtype(role),
              scale=self._scale(state, role), impl=impl)


@dataclasses.dataclass(frozen=True)
class CurrentScalingMode(_PerTensorMode):
  """Per-tensor scale from the tensor's own amax (``Float8CurrentScaling``).

  Sharded: the amax is max-reduced over the mesh first and the scale derived
  from it where the unsharded kernel derives it (``quantize_from_amax``), so
  one device and many agree bit for bit.
  """

  scales_from_whole_tensor: ClassVar[bool] = True

  def quantize(self, x, role, state=None, *, impl="auto", columnwise=True, amax_axes=()):
    dtype = self.dtype(role)
    if not amax_axes:
      return quantize_op.quantize_current(x, dtype, columnwise=columnwise, impl=impl)
    amax = pmax_amax(amax_of(x), tuple(amax_axes))
    return quantize_op.quantize_from_amax(x, amax, dtype, columnwise=columnwise, impl=impl)

  def quantize_stack(self, x, role, state=None, *, impl="auto", columnwise=True,
                     amax_axes=()):
    dtype = self.dtype(role)
    if not amax_axes:
      return stack_op.quantize_stack_current(x, dtype, columnwise=columnwise, impl=impl)
    amax = pmax_amax(amax_of(x, axis=(1, 2)), tuple(amax_axes))   # (E,), as quantize per entry
    return stack_op.quantize_stack_from_amax(x, amax, dtype, columnwise=columnwise, impl=impl)

  def quantize_fused(self, op, role, state=None, *, impl="auto", **operands):
    return op(**operands, mode="current", dtype=self.dtype(role), impl=impl)


@dataclasses.dataclass(frozen=True)
class BlockScalingMode(ScalingMode):
  """One scale per tile (``Float8BlockScaling``, DeepSeek-V3 style).

  x and grad: 1x128 tiles along the contraction dim (their columnwise copy,
  for wgrad, is 1x128 along tokens); kernel: 128x128 blocks (the rows of
  ``te_jax.ops.tiling``). No state, no cross-device reduction (a tile never
  spans devices: shards are padded to ``token_block``), fp32 accumulation
  everywhere.
  """

  # The columnwise copies of x and grad are tiled along tokens, so the token
  # dim is padded to whole tiles.
  token_block: ClassVar[int] = _ROLE_LAYOUTS["x"].block_shape[1]

  def layout(self, role: str) -> tiling.TileLayout:
    """The tiling-table row ``role`` is quantized in."""
    _check_role(role)
    return _ROLE_LAYOUTS[role]

  def block_shape(self, role: str) -> Tuple[int, int]:
    return self.layout(role).block_shape

  def quantize(self, x, role, state=None, *, impl="auto", columnwise=True, amax_axes=()):
    return quantize_op.quantize_blockwise(x, self.block_shape(role), self.dtype(role),
                                          self.recipe.power_2_scale,
                                          columnwise=columnwise, impl=impl)

  def quantize_stack(self, x, role, state=None, *, impl="auto", columnwise=True,
                     amax_axes=()):
    return stack_op.quantize_stack_blockwise(x, self.block_shape(role), self.dtype(role),
                                             self.recipe.power_2_scale,
                                             columnwise=columnwise, impl=impl)

  def quantize_fused(self, op, role, state=None, *, impl="auto", **operands):
    return op(**operands, mode=_FUSED_MODE, dtype=self.dtype(role),
              power_2_scale=self.recipe.power_2_scale, impl=impl)
