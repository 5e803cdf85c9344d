"""``LayerNormMLP`` as an NNX module: norm -> dense -> activation(s) -> dropout -> dense.

Same parameters, the same call into the core (``te_jax.layers.mlp``, which
picks the path: the fused core of ``te_jax.fused_mlp`` with the norm fused
in where it can run, else two FP8 dense layers around an XLA activation)
and the same numbers as ``te_jax.flax.LayerNormMLP``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import fused_mlp
from te_jax import norm_dense
from te_jax.layers import mlp as mlp_lib
from te_jax.layers.checks import check_input_rank, compute_dtype, mlp_options, to_tuple
from te_jax.layers.init import default_kernel_init, gated_kernel_init
from te_jax.layers.norm import check_norm_type
from te_jax.nnx import state as st
from te_jax.nnx.linear import check_biases_used, ones, param, unboxed, zeros

__all__ = ["LayerNormMLP"]

Dtype = Any
Initializer = Callable[..., jax.Array]


class LayerNormMLP(nnx.Module):
  """Pre-norm transformer MLP block whose two GEMMs run in FP8 under ``fp8_autocast``.

  ``y = act(norm(x) @ wi + bi) @ wo + bo``; two activations give the gated
  product ``act0(h0) * act1(h1)``. Shapes: ``x`` (..., in_features) ->
  (..., in_features); with ``return_layernorm_output``, ``(y, ln_out)``.

  Parameters (as ``te_jax.flax.LayerNormMLP``): ``scale``, ``ln_bias``
  (layernorm) (in_features,); ``wi_kernel`` (in_features, n_act,
  intermediate_dim); ``wo_kernel`` (intermediate_dim, in_features);
  ``wi_bias``, ``wo_bias`` with ``use_bias``. FP8 state under
  ``DelayedScaling``: ``wi_fp8_meta`` and ``wo_fp8_meta``.

  Args:
    in_features: model width (the input's last dim, and the output's).
    intermediate_dim: width of the hidden layer.
    activations: one name or two (gated), e.g. ("gelu",), ("silu", "linear").
    intermediate_dropout_rate: dropout on the activation output (uses the
      "dropout" stream of ``rngs``); off in ``model.eval()`` mode or with
      ``deterministic=True``.
    layernorm_type, epsilon, zero_centered_gamma, return_layernorm_output,
    fuse_activation_quantize, backward_chunks, fuse_norm_quantize, use_bias, dtype,
    param_dtype, kernel_init,
    bias_init, scale_init, ln_bias_init, kernel_axes_1, kernel_axes_2,
    ln_scale_axes, ln_bias_axes, impl: as the Linen module.
    deterministic: default of the call argument (``model.train()`` /
      ``model.eval()`` set it).
    rngs: ``nnx.Rngs``.
  """

  FP8_GEMMS = mlp_lib.FP8_GEMMS

  def __init__(self, in_features: int, intermediate_dim: int = 2048, *,
               activations: Sequence[str] = ("gelu",),
               intermediate_dropout_rate: float = 0.0, layernorm_type: str = "layernorm",
               epsilon: float = 1e-6, zero_centered_gamma: bool = False,
               return_layernorm_output: bool = False,
               fuse_activation_quantize: bool = True, backward_chunks: int = 1,
               fuse_norm_quantize: bool = True, use_bias: bool = False,
               dtype: Optional[Dtype] = None, param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = zeros,
               scale_init: Optional[Initializer] = None, ln_bias_init: Initializer = zeros,
               kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
               ln_scale_axes=("embed",), ln_bias_axes=("embed",),
               deterministic: bool = False, impl: str = "auto", rngs: nnx.Rngs):
    (self.in_features,) = to_tuple("in_features", in_features)
    self.intermediate_dim, intermediate_dropout_rate = mlp_options(intermediate_dim,
                                                                  intermediate_dropout_rate)
    self.activations = mlp_lib.check_activations(activations)
    check_norm_type(layernorm_type)
    self.layernorm_type, self.epsilon = layernorm_type, float(epsilon)
    self.zero_centered_gamma = bool(zero_centered_gamma)
    self.return_layernorm_output = bool(return_layernorm_output)
    self.fuse_activation_quantize, self.use_bias = bool(fuse_activation_quantize), bool(use_bias)
    self.fuse_norm_quantize = bool(fuse_norm_quantize)
    fused_mlp.check_backward_chunks(backward_chunks)   # the recipe is checked per call
    self.backward_chunks = int(backward_chunks)
    self.dtype, self.param_dtype, self.impl = dtype, param_dtype, impl
    self.kernel_axes_1, self.kernel_axes_2 = tuple(kernel_axes_1), tuple(kernel_axes_2)
    self.intermediate_dropout_rate = float(intermediate_dropout_rate)
    self.deterministic = deterministic
    mode = st.construction_mode(impl)
    e, f, n_act = self.in_features, self.intermediate_dim, len(self.activations)
    if scale_init is None:
      scale_init = zeros if zero_centered_gamma else ones
    self.scale = param(rngs, scale_init, (e,), param_dtype, ln_scale_axes)
    if layernorm_type == "layernorm":
      self.ln_bias = param(rngs, ln_bias_init, (e,), param_dtype, ln_bias_axes)
    self.wi_kernel = param(rngs, gated_kernel_init(kernel_init, unboxed), (e, n_act, f),
                           param_dtype, self.kernel_axes_1)
    self.wo_kernel = param(rngs, kernel_init, (f, e), param_dtype, self.kernel_axes_2)
    if self.use_bias:
      self.wi_bias = param(rngs, bias_init, (n_act, f), param_dtype, self.kernel_axes_1[1:])
      self.wo_bias = param(rngs, bias_init, (e,), param_dtype, self.kernel_axes_2[1:])
    self.intermediate_dropout = (
        nnx.Dropout(self.intermediate_dropout_rate, broadcast_dims=(),
                    deterministic=deterministic, rngs=rngs)
        if self.intermediate_dropout_rate > 0.0 else None)
    st.add_fp8_state(self, mode)

  def __call__(self, x: jax.Array, deterministic: Optional[bool] = None, *,
               add_residual: bool = False):
    """Applies the block; ``deterministic`` (default the attribute) turns dropout off;
    ``add_residual=True`` returns ``x + y`` (see ``te_jax.flax.LayerNormMLP``)."""
    check_input_rank("x", x)
    check_biases_used(self, ("wi_bias", "wo_bias"))
    if x.shape[-1] != self.in_features:
      raise ValueError(f"LayerNormMLP: the input's last dim ({x.shape[-1]}) must equal "
                       f"in_features ({self.in_features}).")
    deterministic = self.deterministic if deterministic is None else deterministic
    ln_bias = self.ln_bias[...] if self.layernorm_type == "layernorm" else None
    norm = norm_dense.NormParams(self.scale[...], ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    dropout = None
    if self.intermediate_dropout is not None:
      dropout = functools.partial(self.intermediate_dropout, deterministic=deterministic)
    return mlp_lib.layernorm_mlp(
        st.NnxStates(self), st.read_autocast(self.impl), x, norm=norm,
        wi=self.wi_kernel[...], wo=self.wo_kernel[...],
        bi=self.wi_bias[...] if self.use_bias else None,
        bo=self.wo_bias[...] if self.use_bias else None, activations=self.activations,
        dtype=compute_dtype(self.dtype, x.dtype, self.param_dtype), owner="nnx.LayerNormMLP",
        kernel_axes=(self.kernel_axes_1, self.kernel_axes_2),
        fuse_activation_quantize=self.fuse_activation_quantize,
        fuse_norm_quantize=self.fuse_norm_quantize, backward_chunks=self.backward_chunks,
        dropout=dropout, dropout_active=dropout is not None and not deterministic,
        return_norm_output=self.return_layernorm_output, add_residual=add_residual)
