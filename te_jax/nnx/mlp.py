"""``LayerNormMLP`` as an NNX module: norm -> dense -> activation(s) -> dropout -> dense.

Same parameters, same paths (the fused core of ``te_jax.fused_mlp`` with the
norm fused in where it can run, else two FP8 dense layers around an XLA
activation) and the same numbers as ``te_jax.flax.LayerNormMLP``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import fused_mlp
from te_jax import norm_dense
from te_jax.flax import fp8_module
from te_jax.flax.mlp import (activate, check_activations, fused_core_blocker, fused_norm_mlp,
                             log_unfused)
from te_jax.flax.dense import default_kernel_init, kernel_fan_in_init
from te_jax.flax.fused_norm import fused_norm_states, module_norm
from te_jax.flax.norm import check_norm_type
from te_jax.nnx import state as st
from te_jax.nnx.linear import compute_dtype, fp8_gemm, ones, param, to_tuple, zeros

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

  FP8_GEMMS = ("wi_fp8_meta", "wo_fp8_meta")

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
    (self.intermediate_dim,) = to_tuple("intermediate_dim", intermediate_dim)
    self.activations = check_activations(activations)
    check_norm_type(layernorm_type)
    if not 0.0 <= intermediate_dropout_rate < 1.0:
      raise ValueError(f"intermediate_dropout_rate must be in [0, 1), got "
                       f"{intermediate_dropout_rate}.")
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

    def wi_init(key, shape, dtype=jnp.float32):
      keys = jax.random.split(key, shape[1])
      init = kernel_fan_in_init(kernel_init, 1, 1)
      return jnp.stack([init(k, (shape[0], shape[2]), dtype) for k in keys], axis=1)

    self.wi_kernel = param(rngs, wi_init, (e, n_act, f), param_dtype, self.kernel_axes_1)
    self.wo_kernel = param(rngs, kernel_init, (f, e), param_dtype, self.kernel_axes_2)
    if self.use_bias:
      self.wi_bias = param(rngs, bias_init, (n_act, f), param_dtype, self.kernel_axes_1[1:])
      self.wo_bias = param(rngs, bias_init, (e,), param_dtype, self.kernel_axes_2[1:])
    self.intermediate_dropout = (
        nnx.Dropout(self.intermediate_dropout_rate, broadcast_dims=(),
                    deterministic=deterministic, rngs=rngs)
        if self.intermediate_dropout_rate > 0.0 else None)
    st.add_fp8_state(self, mode)

  def __call__(self, x: jax.Array, deterministic: Optional[bool] = None):
    """Applies the block; ``deterministic`` (default the attribute) turns dropout off."""
    acts, e, f = self.activations, self.in_features, self.intermediate_dim
    if x.shape[-1] != e:
      raise ValueError(f"LayerNormMLP: the input's last dim ({x.shape[-1]}) must equal "
                       f"in_features ({e}).")
    deterministic = self.deterministic if deterministic is None else deterministic
    n_act = len(acts)
    compute = compute_dtype(self.dtype, x.dtype, self.param_dtype)
    settings = fp8_module.read_autocast(self.impl)
    fused_mlp.check_backward_chunks(self.backward_chunks, settings.recipe)
    scale = self.scale[...]
    ln_bias = self.ln_bias[...] if self.layernorm_type == "layernorm" else None
    wi, wo = self.wi_kernel[...], self.wo_kernel[...]
    bi = self.wi_bias[...].astype(compute) if self.use_bias else None
    bo = self.wo_bias[...].astype(compute) if self.use_bias else None
    lead = x.shape[:-1]
    m = math.prod(lead)
    dropout = self.intermediate_dropout_rate > 0.0 and not deterministic
    fused = False
    if self.fuse_activation_quantize and settings.recipe is not None:
      blocker = fused_core_blocker(m, e, f, settings, acts, dropout)
      fused = blocker is None
      if not fused:
        log_unfused("nnx.LayerNormMLP", blocker, self.backward_chunks)
    norm = norm_dense.NormParams(scale, ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    states = (fused_norm_states(self, settings, x, self.FP8_GEMMS, st.fused_states)
              if fused and self.fuse_norm_quantize else None)
    if states is not None:
      if states[0] is not None:
        st.track_updates(self, wi)
      return fused_norm_mlp(
          x, wi, wo, bi, bo, norm=norm,
          settings=settings, states=states, activations=acts, dtype=compute,
          return_norm_output=self.return_layernorm_output,
          backward_chunks=self.backward_chunks)

    ln_out = module_norm("nnx.LayerNormMLP", settings, x, norm, compute,
                         kernels=self.fuse_norm_quantize)
    if fused:   # both GEMMs in one custom VJP, the activation fused into quantization
      mode = settings.recipe.scaling_mode()
      si, so = (st.gemm_state(self, n, mode) for n in self.FP8_GEMMS)
      if si is not None:
        st.track_updates(self, wi)
      y = fused_mlp.fp8_mlp(ln_out.reshape(m, e), wi.reshape(e, n_act * f), wo,
                            None if bi is None else bi.reshape(-1), bo, activations=acts,
                            recipe=settings.recipe, wi_state=si, wo_state=so,
                            impl=settings.impl, backward_chunks=self.backward_chunks)
      y = y.reshape(*lead, e)
      return (y, ln_out) if self.return_layernorm_output else y

    h = fp8_gemm(self, settings, ln_out, wi, bi, name="wi_fp8_meta",
                 kernel_axes=self.kernel_axes_1)
    z = activate(h, acts).astype(compute)      # h: (..., n_act, mlp)
    if self.intermediate_dropout is not None:
      z = self.intermediate_dropout(z, deterministic=deterministic)
    y = fp8_gemm(self, settings, z, wo, bo, name="wo_fp8_meta",
                 kernel_axes=self.kernel_axes_2, track=False)
    return (y, ln_out) if self.return_layernorm_output else y
