"""``LayerNormMLP``: norm -> dense -> activation(s) -> dropout -> dense, in FP8.

Both GEMMs (and their gradients) run in FP8 under ``fp8_autocast``. By
default (``fuse_activation_quantize=True``) -- when the GEMMs are not
sharded, dropout is off and the shapes allow it (tokens a multiple of the
recipe's ``token_block``, embed and mlp multiples of 128) -- the block runs
as one fused core (``te_jax.fused_mlp``): the activation and the
quantization of its output are one pass over memory, forward and backward,
and no bf16 activation gradient is materialized, which lowers the block's
peak memory (measured figures: BENCHMARKS.md).
Otherwise (or with ``fuse_activation_quantize=False``) the block is two FP8
dense layers around an XLA activation; the two paths use the same
variables. When the fused core was asked for but cannot run, the ``te_jax``
logger says why (INFO, once per reason). The fused core also takes the norm
(``te_jax.norm_dense``: normalized and quantized in one pass, the norm's
backward in one kernel) when embed is at most ``te_jax.norm_dense.MAX_HIDDEN``
and the input is float32/bfloat16/float16; otherwise the norm runs in XLA in
front of it (also logged). Gated activations (two entries
such as ``("silu", "linear")`` = SwiGLU or ``("gelu", "linear")`` = GeGLU)
use one fused up-projection of shape
(embed, n_act, mlp) computed as a single GEMM; the result is
``act0(h[..., 0, :]) * act1(h[..., 1, :])``.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from te_jax import fused_mlp
from te_jax import norm_dense
from te_jax.flax import fp8_module
from te_jax.flax.dense import default_kernel_init, kernel_fan_in_init, logical_partitioning_of
from te_jax.flax.fused_norm import fused_norm_states, module_norm
from te_jax.flax.norm import norm_params
from te_jax.ops.act_quantize import ACTIVATIONS

__all__ = ["LayerNormMLP", "ACTIVATIONS", "activate", "check_activations", "fused_core_blocker",
           "log_unfused", "fused_norm_mlp"]

Dtype = Any
Initializer = Callable[..., jax.Array]


@functools.lru_cache(maxsize=None)
def log_unfused(owner: str, reason: str, backward_chunks: int = 1):
  """Says once per reason why ``owner`` (a LayerNormMLP, Linen or NNX) took
  the unfused FP8 path; warns too where its ``backward_chunks`` (a memory
  saving the user asked for) has no effect there."""
  logging.getLogger("te_jax").info(
      "te_jax: %s runs as two FP8 dense layers (not the fused "
      "activation-quantize core, which holds less memory): %s", owner, reason)
  if backward_chunks > 1:
    logging.getLogger("te_jax").warning(
        "te_jax: %s backward_chunks=%d has no effect: the block runs as two FP8 dense "
        "layers because %s", owner, backward_chunks, reason)


def fused_core_blocker(m, embed, f, settings, acts, dropout) -> Optional[str]:
  """Why the fused MLP core cannot run (None when it can); shared by the Linen
  and NNX LayerNormMLP."""
  recipe = settings.recipe
  if dropout:
    return "intermediate dropout is active"
  if not settings.unsharded():
    return "its GEMMs are sharded (the fused core has no sharding rule)"
  if not fused_mlp.supported(m, embed, f, embed, recipe, acts):
    return (f"{m} tokens, embed {embed}, mlp {f}: it needs tokens % "
            f"{recipe.token_block} == 0 and embed, mlp % 128 == 0")
  return None


def fused_norm_mlp(x, wi, wo, bi, bo, *, norm: norm_dense.NormParams, settings, states,
                   activations, dtype, return_norm_output: bool, backward_chunks: int = 1):
  """The whole LayerNormMLP block as one custom VJP (``te_jax.fused_mlp.fp8_mlp``
  with its norm): the norm and the activation each computed and quantized in
  one pass, forward and backward. Shared by the Linen and the NNX module.

  Shapes: ``x`` (..., E) -> (..., E), with ``return_norm_output`` also the
  norm output (..., E); ``wi`` (E, n_act, F), ``wo`` (F, E), ``bi`` (n_act,
  F) and ``bo`` (E,) or None, in the compute dtype. ``states``: the (wi, wo)
  delayed-scaling states (None for the other recipes). ``backward_chunks``:
  as ``te_jax.fused_mlp.fp8_mlp``'s.
  """
  lead, e = x.shape[:-1], x.shape[-1]
  out = fused_mlp.fp8_mlp(
      x.reshape(math.prod(lead), e), wi.reshape(e, -1), wo,
      None if bi is None else bi.reshape(-1), bo, activations=activations,
      recipe=settings.recipe, wi_state=states[0], wo_state=states[1],
      impl=settings.impl, dtype=dtype, norm=norm, return_norm_output=return_norm_output,
      backward_chunks=backward_chunks)
  if return_norm_output:
    return out[0].reshape(*lead, e), out[1].reshape(x.shape)
  return out.reshape(*lead, e)


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


def activate(h: jax.Array, acts: Sequence[str]) -> jax.Array:
  """The unfused MLP's activation, ``act0(h[..., 0, :]) * act1(h[..., 1, :])``
  ...: h (..., len(acts), mlp) -> (..., mlp) in h's dtype.

  Under ``jax.checkpoint``, so that the backward keeps only ``h`` and
  recomputes the activation's derivative from it inside its own fusion.
  Differentiated directly, XLA's forward writes an intermediate (gelu's
  tanh) as a second full-size output and the backward reads it back: for
  the 16384 x 16384 bf16 hidden of the benchmarks' MLP block, 512 MiB more
  memory and 1 GiB more traffic per step.
  """
  def fn(h):
    z = ACTIVATIONS[acts[0]].jax_fn(h[..., 0, :])
    for i in range(1, len(acts)):
      z = z * ACTIVATIONS[acts[i]].jax_fn(h[..., i, :])
    return z
  return jax.checkpoint(fn)(h)


def check_activations(acts) -> tuple:
  """The activation names as a tuple; ValueError unless one or two known ones."""
  acts = (acts,) if isinstance(acts, str) else tuple(acts)
  if not acts or len(acts) > 2:
    raise ValueError(f"activations must hold one or two names, got {acts!r}.")
  for a in acts:
    if a not in ACTIVATIONS:
      raise ValueError(f"unknown activation {a!r}; known: {sorted(ACTIVATIONS)}.")
  return acts


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
      on an H200, 16384 tokens and mlp 16384 under delayed scaling, 2 and 4
      took 320 and 384 of the block's 1600 MiB for 1.7% and 3.2-3.7% of
      its step time; ``te_jax.fused_mlp`` says more). Delayed and blockwise
      scaling only: above 1 under current scaling is a ValueError.
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
  def __call__(self, inputs: jax.Array, deterministic: bool = True):
    """Applies the block; ``deterministic=False`` enables dropout."""
    acts = check_activations(self.activations)
    n_act = len(acts)
    embed = inputs.shape[-1]
    compute = self.dtype if self.dtype is not None else jnp.result_type(
        inputs.dtype, self.param_dtype)
    settings = fp8_module.read_autocast(self.impl)
    fused_mlp.check_backward_chunks(self.backward_chunks, settings.recipe)

    scale, ln_bias = norm_params(
        self, embed, norm_type=self.layernorm_type,
        zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
        bias_init=self.ln_bias_init, axes=tuple(self.ln_scale_axes),
        bias_axes=tuple(self.ln_bias_axes), param_dtype=self.param_dtype)

    def wi_init(key, shape, dtype=jnp.float32):
      keys = jax.random.split(key, shape[1])
      init = kernel_fan_in_init(self.kernel_init, 1, 1)
      return jnp.stack([init(k, (shape[0], shape[2]), dtype) for k in keys], axis=1)

    box_kw = _kernel_init_partitioning(self.kernel_init, (embed, self.intermediate_dim),
                                       self.param_dtype, self.kernel_axes_1,
                                       self.kernel_axes_2)
    wi = self.param("wi_kernel",
                    nn.with_logical_partitioning(wi_init, tuple(self.kernel_axes_1), **box_kw),
                    (embed, n_act, self.intermediate_dim), self.param_dtype)
    wo = self.param("wo_kernel",
                    nn.with_logical_partitioning(kernel_fan_in_init(self.kernel_init, 1, 1),
                                                 tuple(self.kernel_axes_2), **box_kw),
                    (self.intermediate_dim, embed), self.param_dtype)
    bi = bo = None
    if self.use_bias:
      bi = self.param("wi_bias", nn.with_logical_partitioning(
          self.bias_init, tuple(self.kernel_axes_1[1:])), (n_act, self.intermediate_dim),
                      self.param_dtype)
      bo = self.param("wo_bias", nn.with_logical_partitioning(
          self.bias_init, tuple(self.kernel_axes_2[1:])), (embed,), self.param_dtype)

    lead, f = inputs.shape[:-1], self.intermediate_dim
    m = math.prod(lead)
    dropout = self.intermediate_dropout_rate > 0.0 and not deterministic
    fused = False
    if self.fuse_activation_quantize and settings.recipe is not None:
      blocker = fused_core_blocker(m, embed, f, settings, acts, dropout)
      fused = blocker is None
      if not fused:
        log_unfused("LayerNormMLP", blocker, self.backward_chunks)
    names = ("wi_fp8_meta", "wo_fp8_meta")
    norm = norm_dense.NormParams(scale, ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    states = (fused_norm_states(self, settings, inputs, names)
              if fused and self.fuse_norm_quantize else None)
    if states is not None:
      return fused_norm_mlp(
          inputs, wi, wo, None if bi is None else bi.astype(compute),
          None if bo is None else bo.astype(compute), norm=norm,
          settings=settings, states=states, activations=acts, dtype=compute,
          return_norm_output=self.return_layernorm_output,
          backward_chunks=self.backward_chunks)

    ln_out = module_norm("LayerNormMLP", settings, inputs, norm, compute,
                         kernels=self.fuse_norm_quantize)
    if fused:
      # One custom VJP for both GEMMs: the activation is computed and
      # quantized in one pass, forward and backward (te_jax.fused_mlp).
      y = fp8_module.fp8_mlp_core(
          self, settings, ln_out.reshape(m, embed),
          wi.reshape(embed, n_act * f),
          None if bi is None else bi.astype(compute).reshape(-1), wo,
          None if bo is None else bo.astype(compute), activations=acts,
          backward_chunks=self.backward_chunks)
      y = y.reshape(*lead, embed)
      return (y, ln_out) if self.return_layernorm_output else y

    h = fp8_module.fp8_gemm(self, settings, ln_out, wi,
                            None if bi is None else bi.astype(compute),
                            name="wi_fp8_meta", kernel_axes=self.kernel_axes_1)
    z = activate(h, acts).astype(compute)      # h: (..., n_act, mlp)
    if self.intermediate_dropout_rate > 0.0:
      z = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(),
                     name="intermediate_dropout")(z, deterministic=deterministic)
    y = fp8_module.fp8_gemm(self, settings, z, wo,
                            None if bo is None else bo.astype(compute),
                            name="wo_fp8_meta", kernel_axes=self.kernel_axes_2)
    if self.return_layernorm_output:
      return y, ln_out
    return y
