"""``LayerNormMLP``: norm -> dense -> activation(s) -> dropout -> dense, in FP8.

Both GEMMs (and their gradients) run in FP8 under ``fp8_autocast``. The
module declares the parameters; which path the block takes -- by default
(``fuse_activation_quantize=True``) the fused core of ``te_jax.fused_mlp``
where the GEMMs are unsharded, dropout is off and the shapes allow it, with
the norm fused in too where it can be; otherwise two FP8 dense layers around
an XLA activation -- is ``te_jax.layers.mlp.layernorm_mlp``'s, whose
module docs give the rules. The fused core holds less memory (figures:
BENCHMARKS.md); the two paths use the same variables, and the ``te_jax``
logger says (INFO, once per reason) why a fused path asked for was not
taken. Gated activations (two entries such as ``("silu", "linear")`` =
SwiGLU or ``("gelu", "linear")`` = GeGLU) use one fused up-projection of
shape (embed, n_act, mlp) computed as a single GEMM; the result is
``act0(h[..., 0, :]) * act1(h[..., 1, :])``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import norm_dense
from te_jax.flax import fp8_module
from te_jax.flax.dense import kernel_fan_in_init, logical_partitioning_of, unboxed
from te_jax.flax.norm import norm_params
from te_jax.layers import mlp as mlp_lib
from te_jax.layers import checks
from te_jax.layers.checks import compute_dtype
from te_jax.layers.init import default_kernel_init, gated_kernel_init

__all__ = ["LayerNormMLP"]

Dtype = Any
Initializer = Callable[..., jax.Array]


def _kernel_init_partitioning(init, shape, dtype, axes_1, axes_2):
  """The ``mesh``/``rules`` of a ``kernel_init`` wrapped in
  ``nn.with_logical_partitioning`` ({} for a plain one), once its names are
  checked: one initializer serves both kernels, whose names are
  ``kernel_axes_1`` / ``kernel_axes_2``, so the wrapper's names must be those
  of one of them (or wi's 2-D (embed, mlp) view, which the initializer is
  called on); they cannot replace both."""
  box = logical_partitioning_of(init, shape, dtype)
  if box is None:
    return {}
  names, a1, a2 = tuple(box.names), tuple(axes_1), tuple(axes_2)
  if names not in (a1, a2, (a1[0], a1[-1])):
    raise ValueError(
        f"LayerNormMLP: kernel_init is wrapped in nn.with_logical_partitioning with "
        f"names {names}, which are not those of its kernels (wi_kernel "
        f"kernel_axes_1={a1}, wo_kernel kernel_axes_2={a2}). One initializer serves "
        "both kernels, so their names come from kernel_axes_1 / kernel_axes_2: set "
        "those and pass the initializer unwrapped.")
  return {"mesh": box.mesh, "rules": box.rules}


class LayerNormMLP(nn.Module):
  """Pre-norm transformer MLP block whose two GEMMs run in FP8 under ``fp8_autocast``.

  ``y = act(norm(x) @ wi + bi) @ wo + bo`` where ``act`` is one activation or,
  for two entries, the gated product ``act0(h0) * act1(h1)``.

  Shapes: ``inputs`` (..., embed) -> (..., embed); with
  ``return_layernorm_output=True`` returns ``(y, ln_out)``.

  Parameters (logical axis names):
    ``scale`` (embed,) ("embed",); ``ln_bias`` (embed,) ("embed",) for layernorm.
    ``wi_kernel`` (embed, n_act, mlp) ``kernel_axes_1`` = ("embed", "act", "mlp").
    ``wo_kernel`` (mlp, embed) ``kernel_axes_2`` = ("mlp", "embed").
    ``wi_bias`` (n_act, mlp) ("act", "mlp") and ``wo_bias`` (embed,) ("embed",)
      with ``use_bias``.

  FP8 state (``DelayedScaling`` only, collection ``"_overwrite_with_gradient"``):
  ``wi_fp8_meta`` and ``wo_fp8_meta``.

  Attributes:
    intermediate_dim: width of the hidden layer ("mlp").
    activations: one name, or two for a gated unit; names "gelu" (tanh
      approximation), "gelu_exact", "relu", "silu"/"swish", "sigmoid", "tanh",
      "quick_gelu", "linear". Default ("gelu",).
    intermediate_dropout_rate: dropout on the activation output (default 0.0);
      uses the "dropout" RNG when ``deterministic=False``.
    layernorm_type: "layernorm" (default) or "rmsnorm".
    epsilon: norm epsilon (default 1e-6).
    zero_centered_gamma: store gamma - 1, initialized to zeros.
    return_layernorm_output: also return the normalized input.
    fuse_activation_quantize: run the block as one fused FP8 core where it
      can (see above). Default True; False always takes the unfused path.
    backward_chunks: with the fused core, run the backward's dgrad half on
      this many token chunks, trading step time for peak memory (default 1;
      ``te_jax.fused_mlp`` says more, BENCHMARKS.md has the figures). Delayed
      and blockwise scaling only: above 1 under current scaling is a
      ValueError.
    fuse_norm_quantize: with the fused core, also normalize and quantize in
      one pass where the shapes allow it; otherwise (FP8 off included) the
      norm runs unquantized on te_jax's statistics and backward kernels
      (``te_jax.norm_dense.normalize``) where embed >= 4096 and no mesh of
      several devices is active (default True). False keeps XLA's norm (to compare).
    use_bias: biases on both projections (default False).
    dtype: compute/output dtype; None promotes input and param dtype.
    param_dtype: parameter dtype (default float32).
    kernel_init, bias_init: initializers (kernels initialized on their 2-D view,
      per activation branch for wi). ``kernel_init`` may be wrapped in
      ``nn.with_logical_partitioning(init, names)`` when ``names`` are those
      of one of the kernels (``kernel_axes_1``, ``kernel_axes_2`` or wi's
      (embed, mlp) view); the kernels keep ``kernel_axes_1`` /
      ``kernel_axes_2`` (one initializer cannot name two kernels), and other
      names raise a ValueError.
    scale_init, ln_bias_init: norm initializers.
    kernel_axes_1, kernel_axes_2, ln_scale_axes, ln_bias_axes: logical names.
    impl: "auto" (default), "cuda" or "reference": which implementation the
      FP8 ops use (``TE_JAX_IMPL`` overrides "auto").
  """

  intermediate_dim: int = 2048
  activations: Sequence[str] = ("gelu",)
  intermediate_dropout_rate: float = 0.0
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  return_layernorm_output: bool = False
  fuse_activation_quantize: bool = True
  backward_chunks: int = 1
  fuse_norm_quantize: bool = True
  use_bias: bool = False
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  scale_init: Optional[Initializer] = None
  ln_bias_init: Initializer = nn.initializers.zeros
  kernel_axes_1: Tuple[Optional[str], ...] = ("embed", "act", "mlp")
  kernel_axes_2: Tuple[Optional[str], ...] = ("mlp", "embed")
  ln_scale_axes: Tuple[Optional[str], ...] = ("embed",)
  ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
  impl: str = "auto"

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: bool = True, *,
               add_residual: bool = False):
    """Applies the block; ``deterministic=False`` enables dropout.

    ``add_residual=True`` returns ``inputs + y`` (a residual connection;
    ``inputs`` in the compute dtype): in FP8 on the fused core with its norm
    the add is part of the down projection's GEMM and its backward part of
    the norm's kernel, two passes over (..., embed) fewer than an add after
    the block (``te_jax.layers.mlp.layernorm_mlp``)."""
    acts = mlp_lib.check_activations(self.activations)
    checks.mlp_options(self.intermediate_dim, self.intermediate_dropout_rate)
    checks.check_input_rank("inputs", inputs)
    settings = fp8_module.read_autocast(self.impl)
    norm, wi, wo, bi, bo = self._declare(inputs.shape[-1], len(acts))
    dropout = None
    if self.intermediate_dropout_rate > 0.0:
      dropout = functools.partial(self._dropout, deterministic=deterministic)
    return mlp_lib.layernorm_mlp(
        fp8_module.LinenStates(self), settings, inputs, norm=norm, wi=wi, wo=wo, bi=bi,
        bo=bo, activations=acts, dtype=compute_dtype(self.dtype, inputs.dtype,
                                                     self.param_dtype),
        owner="LayerNormMLP", kernel_axes=(self.kernel_axes_1, self.kernel_axes_2),
        fuse_activation_quantize=self.fuse_activation_quantize,
        fuse_norm_quantize=self.fuse_norm_quantize, backward_chunks=self.backward_chunks,
        dropout=dropout, dropout_active=dropout is not None and not deterministic,
        return_norm_output=self.return_layernorm_output, add_residual=add_residual)

  def _declare(self, embed: int, n_act: int):
    """Declares the parameters for inputs (..., embed): (norm, wi, wo, bi, bo)."""
    scale, ln_bias = norm_params(
        self, embed, norm_type=self.layernorm_type,
        zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
        bias_init=self.ln_bias_init, axes=tuple(self.ln_scale_axes),
        bias_axes=tuple(self.ln_bias_axes), param_dtype=self.param_dtype)
    norm = norm_dense.NormParams(scale, ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    f = self.intermediate_dim
    box_kw = _kernel_init_partitioning(self.kernel_init, (embed, f), self.param_dtype,
                                       self.kernel_axes_1, self.kernel_axes_2)
    wi = self.param("wi_kernel", nn.with_logical_partitioning(
        gated_kernel_init(self.kernel_init, unboxed), tuple(self.kernel_axes_1), **box_kw),
                    (embed, n_act, f), self.param_dtype)
    wo = self.param("wo_kernel", nn.with_logical_partitioning(
        kernel_fan_in_init(self.kernel_init, 1, 1), tuple(self.kernel_axes_2), **box_kw),
                    (f, embed), self.param_dtype)
    bi = bo = None
    if self.use_bias:
      bi = self.param("wi_bias", nn.with_logical_partitioning(
          self.bias_init, tuple(self.kernel_axes_1[1:])), (n_act, f), self.param_dtype)
      bo = self.param("wo_bias", nn.with_logical_partitioning(
          self.bias_init, tuple(self.kernel_axes_2[1:])), (embed,), self.param_dtype)
    return norm, wi, wo, bi, bo

  def _dropout(self, z, deterministic: bool):
    return nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(),
                      name="intermediate_dropout")(z, deterministic=deterministic)
