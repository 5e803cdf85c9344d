"""FP8 recipes: which format each tensor uses and how its scale is chosen.

A recipe is a frozen, validated dataclass. Pass one to
:func:`te_jax.fp8_autocast`; the FP8 layers read it at trace time.

>>> from te_jax import recipe
>>> r = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16)
>>> r.fwd_dtype.__name__, r.bwd_dtype.__name__
('float8_e4m3fn', 'float8_e5m2')
>>> type(r.scaling_mode()).__name__, r.scaling_mode().token_block
('DelayedScalingMode', 16)
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional

import jax.numpy as jnp

from te_jax import scaling
from te_jax.ops.fp8 import fp8_max

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "fp8_max",
]

_E4M3 = jnp.float8_e4m3fn
_E5M2 = jnp.float8_e5m2


class Format(enum.Enum):
  """Which FP8 format forward tensors and gradients use.

  * ``E4M3``: every tensor in E4M3 (max 448, more mantissa).
  * ``HYBRID``: forward tensors (activations, weights) in E4M3, gradients in
    E5M2 (max 57344, more range).
  """

  E4M3 = "E4M3"
  HYBRID = "HYBRID"

  @property
  def fwd_dtype(self):
    return _E4M3

  @property
  def bwd_dtype(self):
    return _E5M2 if self is Format.HYBRID else _E4M3


def _check_format(value):
  if not isinstance(value, Format):
    raise TypeError(
        f"fp8_format must be a te_jax.recipe.Format (Format.E4M3 or "
        f"Format.HYBRID), got {value!r}.")


def _check_bool(name, value):
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Base class of the recipes; use one of the subclasses.

  A recipe is configuration only; what it means for the GEMMs lives in the
  ``te_jax.scaling.ScalingMode`` that :meth:`scaling_mode` returns.
  """

  @property
  def fwd_dtype(self):
    return self.fp8_format.fwd_dtype

  @property
  def bwd_dtype(self):
    return self.fp8_format.bwd_dtype

  def scaling_mode(self) -> scaling.ScalingMode:
    """The ``te_jax.scaling`` protocol object that runs this recipe's GEMMs."""
    raise NotImplementedError(
        f"{type(self).__name__} does not define scaling_mode(); a recipe needs one "
        "(see te_jax.scaling).")

  @property
  def token_block(self) -> int:
    """Multiple that FP8 GEMMs need along the token dimension."""
    return self.scaling_mode().token_block


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PerTensorGemmOptions:
  """Per-GEMM accumulation choice shared by the per-tensor recipes.

  ``fast_accum_*=True`` lets the Hopper tensor cores accumulate FP8 products
  at their native, reduced precision (cuBLASLt ``FAST_ACCUM``): faster, with a
  larger error on long contractions. ``False`` promotes partial sums to fp32
  (split accumulation). Defaults follow the common practice: fast for the
  forward GEMM, full fp32 for the two gradient GEMMs, whose contractions run
  over tokens or the wide hidden dimension.

  Split accumulation is an order of magnitude more accurate on long
  contractions; split dgrad and wgrad cost a few percent of a training step
  against fast accumulation everywhere (TE-JAX's default), mostly as power:
  the steps run at the GPU's power cap, and the split GEMMs run at a lower
  clock. BENCHMARKS.md has the figures.
  """

  fast_accum_fprop: bool = True
  fast_accum_dgrad: bool = False
  fast_accum_wgrad: bool = False

  def _check_accum(self):
    for name in ("fast_accum_fprop", "fast_accum_dgrad", "fast_accum_wgrad"):
      _check_bool(name, getattr(self, name))


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_PerTensorGemmOptions, Recipe):
  """Per-tensor scaling whose scale comes from the amax of earlier steps.

  At step t a tensor is cast with ``scale = fp8_max / reduce(history) /
  2**margin``, where ``history`` holds the amaxes of steps before t; the amax
  of step t is then pushed into the history.

  Attributes:
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
    margin: non-negative int; scales are divided by ``2**margin`` for headroom.
    amax_history_len: positive int, number of past amaxes kept (default 1024).
    amax_compute_algo: ``"max"`` (default, max over the history) or
      ``"most_recent"`` (the newest entry).
    outlier_factor: the outlier guard (default ``2.0**12``; None turns it
      off, which is Transformer Engine's rule). An amax more than this
      factor above every other amax the rule looks at (the history for
      "max", the two steps before for "most_recent"; at least two of them
      positive) is an outlier: it is kept
      in the history but does not set the scale, so one batch with a huge
      value saturates that value in its own step and costs nothing later.
      A second such amax makes it the new normal (a sudden lasting jump
      costs one saturated step). ``te_jax.fp8_state.ignored_outliers``
      counts the tensors whose scale ignores one now.
    fast_accum_fprop, fast_accum_dgrad, fast_accum_wgrad: see
      ``_PerTensorGemmOptions``.
  """

  fp8_format: Format = Format.HYBRID
  margin: int = 0
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  outlier_factor: Optional[float] = 2.0 ** 12

  def __post_init__(self):
    _check_format(self.fp8_format)
    if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
      raise ValueError(f"margin must be a non-negative int, got {self.margin!r}.")
    if (not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool)
        or self.amax_history_len < 1):
      raise ValueError(
          f"amax_history_len must be a positive int, got {self.amax_history_len!r}.")
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(
          f"amax_compute_algo must be 'max' or 'most_recent', got "
          f"{self.amax_compute_algo!r}.")
    f = self.outlier_factor
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                          or not math.isfinite(f) or f <= 1):
      raise ValueError(f"outlier_factor must be None (no guard) or a finite number > 1, "
                       f"got {f!r}.")
    self._check_accum()

  def scaling_mode(self) -> scaling.ScalingMode:
    return scaling.DelayedScalingMode(self)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_PerTensorGemmOptions, Recipe):
  """Per-tensor scaling from the amax of the tensor itself: ``fp8_max / amax(x)``.

  Attributes:
    fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
    fast_accum_fprop, fast_accum_dgrad, fast_accum_wgrad: see
      ``_PerTensorGemmOptions``.
  """

  fp8_format: Format = Format.HYBRID

  def __post_init__(self):
    _check_format(self.fp8_format)
    self._check_accum()

  def scaling_mode(self) -> scaling.ScalingMode:
    return scaling.CurrentScalingMode(self)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
  """DeepSeek-V3-style blockwise scaling.

  Activations and gradients get one scale per 1x128 tile along the
  contraction dimension (128x1 tiles for the operands of the weight-gradient
  GEMM, which contracts over tokens); weights one scale per 128x128 block.
  GEMMs always accumulate in fp32.

  Attributes:
    fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID``.
    power_2_scale: round every scale down to a power of two (default True),
      so scaling is exact in the exponent and never overflows. With False
      the fused activation backward's CUDA kernel computes each output's
      values twice (its 16-bit parking is exact only for power-of-two
      scales), which makes that kernel slower.
  """

  fp8_format: Format = Format.E4M3
  power_2_scale: bool = True

  def __post_init__(self):
    _check_format(self.fp8_format)
    _check_bool("power_2_scale", self.power_2_scale)

  def scaling_mode(self) -> scaling.ScalingMode:
    return scaling.BlockScalingMode(self)
