"""Normalization layers: ``LayerNorm`` and ``RMSNorm`` (and ``NormParameters``).

Both compute in float32 (``te_jax.layers.norm.apply_norm``) and return the
module ``dtype``. With ``zero_centered_gamma=True`` the scale is stored as
``gamma - 1`` (initialized to zeros), which keeps weight decay from pulling
gamma towards 0.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import norm_dense
from te_jax.layers.checks import check_input_rank
from te_jax.layers.norm import apply_norm, check_norm_type

__all__ = ["LayerNorm", "RMSNorm", "NormParameters", "norm_params"]

Dtype = Any
Initializer = Callable[..., jax.Array]


def norm_params(module: nn.Module, features: int, *, norm_type: str,
                zero_centered_gamma: bool, scale_init: Optional[Initializer],
                bias_init: Initializer, axes: Tuple[str, ...], param_dtype,
                bias_axes: Optional[Tuple[str, ...]] = None,
                scale_name: str = "scale", bias_name: str = "ln_bias"):
  """Declares the scale (and, for LayerNorm, bias) of a norm on ``module``."""
  check_norm_type(norm_type)
  if scale_init is None:
    scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
  scale = module.param(scale_name, nn.with_logical_partitioning(scale_init, axes),
                       (features,), param_dtype)
  bias = None
  if norm_type == "layernorm":
    bias_axes = axes if bias_axes is None else bias_axes
    bias = module.param(bias_name, nn.with_logical_partitioning(bias_init, tuple(bias_axes)),
                        (features,), param_dtype)
  return scale, bias


class _Norm(nn.Module):
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  scale_init: Optional[Initializer] = None
  bias_init: Initializer = nn.initializers.zeros
  scale_axes: Tuple[str, ...] = ("embed",)
  bias_axes: Tuple[str, ...] = ("embed",)
  _norm_type = "layernorm"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    check_input_rank("x", x)
    scale, bias = _declare(self, x.shape[-1], self._norm_type)
    dtype = self.dtype if self.dtype is not None else x.dtype
    return apply_norm(x, scale, bias, norm_type=self._norm_type, epsilon=self.epsilon,
                      zero_centered_gamma=self.zero_centered_gamma, dtype=dtype)


def _declare(module, features: int, norm_type: str):
  """The (scale, bias or None) of a ``LayerNorm``/``RMSNorm``-shaped module
  (its attributes name the initializers and axes)."""
  return norm_params(module, features, norm_type=norm_type,
                     zero_centered_gamma=module.zero_centered_gamma,
                     scale_init=module.scale_init, bias_init=module.bias_init,
                     axes=tuple(module.scale_axes), param_dtype=module.param_dtype,
                     bias_axes=tuple(module.bias_axes), bias_name="bias")


class LayerNorm(_Norm):
  """Layer normalization over the last axis: ``(x - mean) / sqrt(var + eps) * gamma + beta``.

  Statistics and the affine transform are computed in float32; the output is
  cast to ``dtype``.

  Shapes: ``x`` (..., features) -> (..., features).

  Parameters (logical axis names):
    ``scale`` (features,) ``scale_axes`` = ("embed",): gamma, or gamma - 1 when
      ``zero_centered_gamma``.
    ``bias`` (features,) ``bias_axes`` = ("embed",): beta.

  Attributes:
    epsilon: added to the variance (default 1e-6).
    zero_centered_gamma: store gamma - 1 (initialized to 0) instead of gamma.
    dtype: output dtype; None (default) keeps the input's dtype.
    param_dtype: dtype of the parameters (default float32).
    scale_init: initializer of ``scale``; default ones (zeros when zero-centered).
    bias_init: initializer of ``bias`` (default zeros).
    scale_axes, bias_axes: logical axis names of the parameters.
  """

  _norm_type = "layernorm"


class RMSNorm(_Norm):
  """RMS normalization over the last axis: ``x / sqrt(mean(x**2) + eps) * gamma``.

  Computed in float32; output cast to ``dtype``. No bias.

  Shapes: ``x`` (..., features) -> (..., features).

  Parameters (logical axis names):
    ``scale`` (features,) ``scale_axes`` = ("embed",): gamma, or gamma - 1 when
      ``zero_centered_gamma``.

  Attributes:
    epsilon: added to the mean square (default 1e-6).
    zero_centered_gamma: store gamma - 1 (initialized to 0) instead of gamma.
    dtype: output dtype; None (default) keeps the input's dtype.
    param_dtype: dtype of the parameters (default float32).
    scale_init: initializer of ``scale``; default ones (zeros when zero-centered).
    scale_axes: logical axis names of ``scale``.
    bias_init, bias_axes: unused (kept for a uniform signature).
  """

  _norm_type = "rmsnorm"


class NormParameters(nn.Module):
  """A ``LayerNorm``'s or ``RMSNorm``'s parameters, declared as that module
  declares them, returned instead of applied.

  For a layer that fuses the norm into the FP8 quantization of the next
  GEMM's input (``TransformerLayer``'s attention pre-norm, through
  ``MultiHeadAttention(...)(x, input_norm=...)``): under the same name it
  holds the same variables (``scale``, and ``bias`` for layernorm, same
  initializers and logical axes), so a model switches between the fused and
  the plain norm without touching its checkpoint.

  Shapes: ``features`` (an int) -> a ``te_jax.norm_dense.NormParams`` with
  gamma (features,) and beta (features,) or None.

  Attributes:
    norm_type: "layernorm" (default) or "rmsnorm".
    epsilon, zero_centered_gamma, param_dtype, scale_init, bias_init,
      scale_axes, bias_axes: as in ``LayerNorm``.
  """

  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  param_dtype: Dtype = jnp.float32
  scale_init: Optional[Initializer] = None
  bias_init: Initializer = nn.initializers.zeros
  scale_axes: Tuple[str, ...] = ("embed",)
  bias_axes: Tuple[str, ...] = ("embed",)

  @nn.compact
  def __call__(self, features: int):
    """Declares (at init) and returns the parameters for inputs (..., features)."""
    scale, bias = _declare(self, features, self.norm_type)
    return norm_dense.NormParams(scale, bias, self.norm_type, self.epsilon,
                                 self.zero_centered_gamma)
