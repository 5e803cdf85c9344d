"""FP8 norm + dense: ``norm(x) @ kernel (+ bias)`` with the norm fused into the quantization of x.

One ``custom_vjp`` that never writes the normalized input in 16 or 32 bits:

* forward: one pass over ``x`` normalizes it (LayerNorm or RMSNorm) and
  writes the result in FP8, rowwise for the fprop GEMM and columnwise for
  the wgrad GEMM, with the row statistics
  (``ops.normalization.norm_quantize`` through the recipe's
  ``ScalingMode.quantize_fused``);
* backward: the dgrad GEMM gives the gradient of the normalized input (in
  the compute dtype, as the unfused path's), then one kernel computes dx,
  dgamma and dbeta from it, x and the statistics
  (``ops.normalization.norm_backward``); wgrad reads the FP8 columnwise
  copy of norm(x), which the forward does not write: the backward
  quantizes norm(x) from x and the forward's statistics (and scale or
  amax), columnwise only, the same bytes bit for bit, without a statistics
  pass (``requantize_normalized``). That kernel does not join the norm
  backward's: that one owns whole rows, a transposed copy needs 128-row
  tiles.

Residuals: ``x`` itself (the norm's backward needs it, as it does unfused),
two float32 numbers per row, the amax of norm(x) and the kernel as given;
nothing in FP8 (the arguments ``save_original_input=False`` /
``save_original_kernel=False`` keep the FP8 copies of norm(x).T and of the
kernel instead, one byte per element each, and skip the backward's quantize
passes). Compared with XLA's
norm followed by ``te_jax.dense.fp8_dense``: one read of ``x`` and a write
and read of the normalized input less forward, and the norm's backward in one
kernel instead of XLA's reductions.

Numerics: the normalized input is computed in float32 exactly as
``te_jax.layers.norm.apply_norm`` computes it and quantized directly, so the
result equals the unfused path up to the FP8 rounding of a value that no
longer goes through the compute dtype first.

Shapes are not padded along the tokens or the normalized dim (a padded row
would normalize to beta and raise the amax; a padded column would change
every statistic): :func:`supported` says whether a problem can take this path
(tokens a multiple of the recipe's ``token_block``, hidden a multiple of 128
within the CUDA kernels' limit); the output dim is zero-padded as in
``te_jax.dense``. ``te_jax.flax.LayerNormDenseGeneral`` uses the unfused path
otherwise.

This module holds no recipe branches: it calls the scaling protocol only.

>>> import jax.numpy as jnp
>>> from te_jax import norm_dense, recipe
>>> x = jnp.ones((2, 128, 256), jnp.bfloat16); w = jnp.ones((256, 512), jnp.float32)
>>> norm_dense.fp8_norm_dense(x, jnp.ones(256), jnp.zeros(256), w, norm_type="layernorm",
...                           epsilon=1e-6, zero_centered_gamma=False,
...                           recipe=recipe.Float8BlockScaling()).shape
(2, 128, 512)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import recipe as recipe_lib
from te_jax import remat
from te_jax import scaling
from te_jax.ops import concat_quantize as concat_op
from te_jax.ops import normalization as norm_op

__all__ = ["NormParams", "NormSpec", "MAX_HIDDEN", "fp8_norm_dense", "supported",
           "norm_spec", "quantize_normalized", "requantize_normalized", "normalized",
           "norm_grads", "normalize", "optional_outputs", "split_optional_outputs"]

# The largest normalized dim the CUDA kernels take (the backward's limit).
MAX_HIDDEN = norm_op.MAX_CUDA_HIDDEN


class NormSpec(NamedTuple):
  """The static options of a norm (hashable: part of a custom_vjp config)."""

  norm_type: str
  epsilon: float
  zero_centered_gamma: bool


class NormParams(NamedTuple):
  """A norm applied to the input of a fused FP8 layer (``te_jax.fused_mlp``).

  Attributes:
    gamma: (H,) scale, stored as ``gamma - 1`` with ``zero_centered_gamma``.
    beta: (H,) shift or None (None for rmsnorm).
    norm_type: "layernorm" or "rmsnorm".
    epsilon: Python float added to the variance.
    zero_centered_gamma: Python bool.
  """

  gamma: jax.Array
  beta: Optional[jax.Array]
  norm_type: str
  epsilon: float
  zero_centered_gamma: bool


def norm_spec(norm_type: str, epsilon: float, zero_centered_gamma: bool) -> NormSpec:
  """The checked, hashable options (``float(epsilon)``, ``bool(...)``)."""
  if norm_type not in norm_op.NORM_TYPES:
    raise ValueError(f"norm_type must be one of {norm_op.NORM_TYPES}, got {norm_type!r}.")
  try:
    eps = float(epsilon)
  except (TypeError, ValueError):
    raise TypeError(f"epsilon must be a Python float, got {epsilon!r}.") from None
  return NormSpec(norm_type, eps, bool(zero_centered_gamma))


def supported(m: int, k: int, recipe: recipe_lib.Recipe) -> bool:
  """Whether ``fp8_norm_dense`` (and ``fp8_mlp`` with a norm) takes m tokens of
  hidden size k unpadded: m a multiple of the recipe's ``token_block``, k a
  multiple of 128, both within the CUDA kernels' limits
  (``ops.normalization.norm_supported``)."""
  return (m % recipe.scaling_mode().token_block == 0 and k % 128 == 0
          and norm_op.norm_supported(m, k))


def quantize_normalized(mode: scaling.ScalingMode, spec: NormSpec, x, gamma, beta, state,
                        impl: str, columnwise: bool = True):
  """``(qx, mean, rstd)``: norm(x) quantized as the GEMM operand "x" of
  ``mode`` (the rowwise copy, and the columnwise one unless ``columnwise``
  is False), with the statistics ``norm_grads`` takes."""
  return mode.quantize_fused(norm_op.norm_quantize, "x", state, impl=impl, x=x, gamma=gamma,
                             beta=beta, norm_type=spec.norm_type, epsilon=spec.epsilon,
                             zero_centered_gamma=spec.zero_centered_gamma,
                             columnwise=columnwise)


def requantize_normalized(mode: scaling.ScalingMode, spec: NormSpec, x, gamma, beta, mean,
                          rstd, amax, state, impl: str):
  """The columnwise copy (a ``ScaledTensor`` (K, M)) of norm(x) that
  ``quantize_normalized(mode, spec, x, gamma, beta, state, impl)`` writes,
  bit for bit, from the ``mean``, ``rstd`` and ``amax`` it returned (amax
  None blockwise): one quantize pass over x, no statistics pass."""
  return mode.quantize_fused(norm_op.norm_quantize_with_stats, "x", state, impl=impl, x=x,
                             gamma=gamma, beta=beta, mean=mean, rstd=rstd,
                             norm_type=spec.norm_type,
                             zero_centered_gamma=spec.zero_centered_gamma, amax=amax,
                             rowwise=False).columnwise()


def normalized(spec: NormSpec, x, gamma, beta, mean, rstd):
  """norm(x) in float32, elementwise from the statistics ``quantize_normalized``
  returned (the values it quantized; on the reference path, bit for bit
  ``te_jax.layers.norm.apply_norm``'s)."""
  return norm_op.norm_apply_reference(x, gamma, beta, mean, rstd,
                                      zero_centered_gamma=spec.zero_centered_gamma)


def norm_grads(spec: NormSpec, dy, x, gamma, beta, mean, rstd, impl: str, dy_add=None,
               dx_add=None):
  """(dx, dgamma, dbeta or None) of the norm from ``dy``, the gradient of its
  output (plus ``dy_add``, a second use's, in dy's dtype), in the dtypes of
  x, gamma and beta; ``dx_add`` (x's dtype: the cotangent of a residual
  connection around the norm's branch) is added to dx as it is written."""
  dx, dgamma, dbeta = norm_op.norm_backward(dy, x, gamma, mean, rstd,
                                            norm_type=spec.norm_type,
                                            zero_centered_gamma=spec.zero_centered_gamma,
                                            dy_add=dy_add, dx_add=dx_add, impl=impl)
  return dx, dgamma, (None if beta is None else dbeta.astype(beta.dtype))


class _Config(NamedTuple):
  mode: scaling.ScalingMode
  impl: str
  norm: NormSpec
  dtype: jnp.dtype          # output, dgrad and norm-output dtype
  has_bias: bool
  return_norm_output: bool
  splits: Tuple[int, ...] = ()   # the output as column blocks of these widths (a tuple)
  save_input: bool = True   # no FP8 copy of norm(x) kept: quantized again from x
  save_kernel: bool = True  # no FP8 copy of the kernel kept: quantized again
  return_input: bool = False  # x passed through: its cotangent joins dx in the norm's kernel


def optional_outputs(y, norm_output=None, passed_input=None):
  """The norm + GEMM functions' return convention (``return_norm_output``,
  ``return_input``): ``y`` alone, or the tuple of ``y`` and those of
  ``norm_output`` and ``passed_input`` that are given, in that order."""
  extra = tuple(a for a in (norm_output, passed_input) if a is not None)
  return (y,) + extra if extra else y


def split_optional_outputs(out, norm_output: bool, passed_input: bool):
  """``(y, norm_output, passed_input)`` of what :func:`optional_outputs`
  made, None for an output not requested."""
  if not (norm_output or passed_input):
    return out, None, None
  y, *rest = out
  return y, (rest.pop(0) if norm_output else None), (rest.pop(0) if passed_input else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _norm_dense(x, gamma, beta, kernel, bias, state, cfg):
  out, _ = _norm_dense_fwd(x, gamma, beta, kernel, bias, state, cfg)
  return out


def _norm_dense_fwd(x, gamma, beta, kernel, bias, state, cfg):
  mode, impl = cfg.mode, cfg.impl
  # norm(x).T is only needed by wgrad: with save_input the backward makes it.
  qx, mean, rstd = quantize_normalized(mode, cfg.norm, x, gamma, beta, state, impl,
                                       columnwise=not cfg.save_input)
  qk = mode.quantize(kernel, "kernel", state, impl=impl)
  # splits: a tuple of blocks, each from its own GEMM (no slice copies).
  y = mode.gemm("fprop", qx.rowwise(), qk.columnwise(), out_dtype=cfg.dtype, bias=bias,
                impl=impl, split_sizes=cfg.splits or None)
  new_state = mode.update_state(state, {"x": qx.amax, "kernel": qk.amax})
  out = y
  if cfg.return_norm_output:   # elementwise from the statistics: no second reduction
    out = (y, normalized(cfg.norm, x, gamma, beta, mean, rstd).astype(cfg.dtype))
  # x (and gamma, beta, the statistics) are kept for the norm's backward
  # anyway; the FP8 copies that wgrad and dgrad read are kept, or made again
  # from them and the kernel in the backward with the same scales (``state``,
  # this forward's, and the amax of norm(x)).
  x_t = qx.amax if cfg.save_input else qx.columnwise()
  res = (x_t, kernel if cfg.save_kernel else qk.rowwise(), x, gamma, beta, mean, rstd,
         state, new_state, jnp.zeros((0,), kernel.dtype))
  return ((out, x) if cfg.return_input else out), res


def _norm_dense_bwd(cfg, res, g):
  mode, impl = cfg.mode, cfg.impl
  x_t, qk, x, gamma, beta, mean, rstd, state, new_state, k_proto = res
  g_ln = g_x = None
  if cfg.return_input:   # the passed-through x's cotangent: added to dx by the norm kernel
    g, g_x = g
  if cfg.return_norm_output:
    g, g_ln = g
  if cfg.splits:   # the gradients of the output blocks, never concatenated
    qg = mode.quantize_fused(concat_op.concat_quantize, "grad", new_state, impl=impl,
                             parts=tuple(g))
  else:
    qg = mode.quantize(g, "grad", new_state, impl=impl)
  # What this pass computes again from the kept tensors reads them through
  # one barrier behind g (te_jax.dense.after_cotangent).
  qk, x, gamma, beta, mean, rstd = dense_lib.after_cotangent(g, qk, x, gamma, beta, mean, rstd)
  if cfg.save_kernel:
    qk = mode.quantize(qk, "kernel", state, impl=impl, columnwise=False).rowwise()
  dln = mode.gemm("dgrad", qg.rowwise(), qk, out_dtype=cfg.dtype, impl=impl)
  # Both uses of the normalized input, summed in its dtype by the norm's
  # backward as it reads them.
  dln_add = None if g_ln is None else g_ln.astype(cfg.dtype)
  if cfg.save_input:   # the forward's quantization again, columnwise: x_t is its amax
    qx_t = requantize_normalized(mode, cfg.norm, x, gamma, beta, mean, rstd, x_t, state, impl)
  else:
    qx_t = x_t
  dk = mode.gemm("wgrad", qx_t, qg.columnwise(), out_dtype=k_proto.dtype, impl=impl)
  dx, dgamma, dbeta = norm_grads(cfg.norm, dln, x, gamma, beta, mean, rstd, impl, dln_add,
                                 g_x)
  dbias = None
  if cfg.has_bias:
    parts = tuple(g) if cfg.splits else (g,)
    dbias = jnp.concatenate([jnp.sum(p.astype(jnp.float32), axis=0).astype(p.dtype)
                             for p in parts])
  return dx, dgamma, dbeta, dk, dbias, mode.update_state(new_state, {"grad": qg.amax})


_norm_dense.defvjp(_norm_dense_fwd, _norm_dense_bwd)


def fp8_norm_dense(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                   kernel: jax.Array, bias: Optional[jax.Array] = None, *, norm_type: str,
                   epsilon: float, zero_centered_gamma: bool, recipe: recipe_lib.Recipe,
                   fp8_state=None, impl: str = "auto", return_norm_output: bool = False,
                   dtype=None, num_splits: int = 1,
                   split_sizes: Optional[Sequence[int]] = None,
                   save_original_input: bool = True,
                   save_original_kernel: bool = True, return_input: bool = False):
  """``norm(x) @ kernel + bias`` with every GEMM in FP8 and the norm fused into
  the quantization of its output.

  With ``num_splits`` > 1 (or ``split_sizes``) the output comes back as
  that many equal column blocks (or blocks of those widths), as
  ``te_jax.dense.fp8_dense_split`` returns them (the fused Q/K/V projection
  of attention behind its pre-norm): each block from its own GEMM and the
  blocks' gradients quantized without being concatenated where every block
  width is a multiple of the recipe's ``token_block`` and there are at most
  4 blocks; otherwise the unsplit output is split (same values).

  Args:
    x: (..., K) float32/bfloat16/float16 input (before the norm).
    gamma: (K,) norm scale (``gamma - 1`` with ``zero_centered_gamma``).
    beta: (K,) norm shift, or None (None for rmsnorm).
    kernel: (K, N) weight, quantized from its own dtype (float32 parameters
      directly); its gradient comes back in that dtype.
    bias: optional (N,) bias.
    norm_type: "layernorm" or "rmsnorm".
    epsilon: Python float added to the variance (mean square).
    zero_centered_gamma: the scale is ``1 + gamma``.
    recipe: a ``te_jax.recipe`` recipe.
    fp8_state: ``DelayedScaling`` state (``fp8_state.init_dense_state``), its
      update returned as its gradient; None for the other recipes.
    impl: "auto", "cuda" or "reference".
    return_norm_output: also return the normalized input (..., K) in
      ``dtype`` (computed elementwise from the statistics; its gradient flows
      back through the same norm backward).
    dtype: output (and normalized-output) dtype; default ``x.dtype``.
    num_splits: number of output blocks (an int >= 1 dividing N).
    split_sizes: instead of ``num_splits``, the blocks' widths (ints >= 1
      summing to N), e.g. grouped-query attention's query, key and value.
    save_original_input: True (default): the forward writes only the
      rowwise FP8 norm(x), and the backward quantizes norm(x) again,
      columnwise only, from x and the statistics (kept for the norm's
      backward anyway) for the wgrad GEMM: one more quantize pass over x,
      the same FP8 values bit for bit, and no FP8 copy of norm(x) alive
      between the passes. False writes and keeps that copy (1 byte per
      element of x) and skips the pass.
    save_original_kernel: True (default): the backward quantizes the kernel
      again for the dgrad GEMM (same values) instead of keeping its FP8 copy:
      no memory when the kernel is a parameter (as the Flax modules pass
      it), what the FP8-off dot keeps when it is a cast copy. False keeps
      the FP8 copy (1 byte per element). Applies where the kernel needs no
      padding (N a multiple of the recipe's ``token_block``).
    return_input: also return ``x`` itself, passed through this op: used as
      the residual of a connection around the branch this projection starts
      (e.g. an output projection's ``residual``), its cotangent comes back
      here and the norm's backward kernel adds it to dx as it writes it (bit
      for bit XLA's add of x's two cotangents, without that pass).

  Returns:
    (..., N) in ``dtype`` (a tuple of arrays (..., width), one per block,
    when split), or ``(y, norm_output)`` with ``return_norm_output``; with
    ``return_input`` x follows as the last element.

  Raises:
    ValueError: shapes :func:`supported` rejects, or inconsistent ones.
  """
  mode = dense_lib.scaling_mode_of(recipe)
  spec = norm_spec(norm_type, epsilon, zero_centered_gamma)
  if x.ndim < 1 or kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x (..., K) and kernel (K, N) must agree on K; got x {x.shape}, "
                     f"kernel {kernel.shape}.")
  lead, k = x.shape[:-1], x.shape[-1]
  x2d = x.reshape(-1, k)
  m, n = x2d.shape[0], kernel.shape[1]
  if bias is not None and bias.shape != (n,):
    raise ValueError(f"bias must have shape ({n},), got {bias.shape}.")
  if not supported(m, k, recipe):
    raise ValueError(
        f"fp8_norm_dense takes tokens % {mode.token_block} == 0 and hidden % 128 == 0, "
        f"hidden <= {MAX_HIDDEN}; got {m} tokens, hidden {k}. The norm "
        "cannot be padded (a padded row or column changes the statistics or the amax): "
        "use te_jax.layers.norm.apply_norm and te_jax.dense.fp8_dense instead.")
  # Blocks the concat-quantize kernel cannot take: split the whole output.
  sizes, fused_split = dense_lib.split_plan(n, num_splits, split_sizes, mode)
  mode.check_state(fp8_state)
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  align = mode.token_block
  kp = dense_lib.pad_to(kernel, 1, align)   # fused_split: no column padding needed
  # A padded kernel is a new array: keeping it would cost what its FP8 copy saves.
  save_kernel = bool(save_original_kernel) and kp.shape == kernel.shape
  if save_original_kernel and not save_kernel:
    dense_lib.log_fp8_copies_kept(f"the kernel is padded to a multiple of {align}")
  cfg = _Config(mode, impl, spec, out_dtype, bias is not None, bool(return_norm_output),
                sizes if fused_split else (), bool(save_original_input), save_kernel,
                bool(return_input))
  bp = None if bias is None else dense_lib.pad_to(bias.astype(out_dtype), 0, align)
  out = _norm_dense(x2d, gamma, beta, kp, bp, fp8_state, cfg)
  out, x_passed = out if return_input else (out, None)
  y, ln = out if return_norm_output else (out, None)
  if fused_split:   # each block tagged for te_jax.remat's policies
    y = tuple(remat.tag_fp8_gemm(part.reshape(*lead, f)) for part, f in zip(y, sizes))
  else:
    y = remat.tag_fp8_gemm(y[:, :n].reshape(*lead, n))
    if len(sizes) > 1:
      y = dense_lib.split_columns(y, sizes)
  return optional_outputs(y, ln.reshape(x.shape) if return_norm_output else None,
                          x_passed.reshape(x.shape) if return_input else None)


# ------------------------------------------------ the norm without FP8 ---

class _NormConfig(NamedTuple):
  norm: NormSpec
  dtype: jnp.dtype     # output dtype
  impl: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _normalize(x, gamma, beta, cfg):
  return _normalize_fwd(x, gamma, beta, cfg)[0]


def _normalize_fwd(x, gamma, beta, cfg):
  mean, rstd = norm_op.norm_stats(x, norm_type=cfg.norm.norm_type, epsilon=cfg.norm.epsilon,
                                  impl=cfg.impl)
  y = normalized(cfg.norm, x, gamma, beta, mean, rstd).astype(cfg.dtype)
  return y, (x, gamma, beta, mean, rstd)


def _normalize_bwd(cfg, res, dy):
  x, gamma, beta, mean, rstd = res
  return norm_grads(cfg.norm, dy, x, gamma, beta, mean, rstd, cfg.impl)


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def normalize(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array] = None, *,
              norm_type: str, epsilon: float, zero_centered_gamma: bool = False,
              dtype=None, impl: str = "auto") -> jax.Array:
  """``norm(x)`` over the last axis, unquantized, with the norm kernels' backward.

  The same values as ``te_jax.layers.norm.apply_norm`` (float32 from the
  input, the statistics, then ``(x - mean) * rstd * gamma' + beta`` rounded
  once to ``dtype``), computed as: the statistics pass
  (``ops.normalization.norm_stats``), one elementwise XLA pass writing the
  output, and for the gradient one kernel for dx, dgamma and dbeta
  (``ops.normalization.norm_backward``) instead of XLA's reductions. The
  residuals are ``x`` and two float32 numbers per row. For the layers'
  norms when FP8 is off (or their fused norm + quantize path is not taken).

  The CUDA kernels have no sharding rule: call this where ``x`` is not
  sharded (``te_jax.flax`` modules use ``apply_norm`` when a mesh is active).

  Args:
    x: (..., H) float32/bfloat16/float16.
    gamma: (H,) scale (``gamma - 1`` with ``zero_centered_gamma``).
    beta: (H,) shift, or None (None for rmsnorm).
    norm_type: "layernorm" or "rmsnorm".
    epsilon: Python float >= 0 added to the variance (mean square).
    zero_centered_gamma: the scale is ``1 + gamma``.
    dtype: output dtype; default ``x.dtype``.
    impl: "auto", "cuda" or "reference"; the CUDA path takes
      ``ops.normalization.norm_supported(M, H)`` shapes (M = prod(...)).

  Returns:
    (..., H) in ``dtype``. Gradients: dx in x's dtype, dgamma and dbeta in
    gamma's and beta's.
  """
  spec = norm_spec(norm_type, epsilon, zero_centered_gamma)
  if not hasattr(x, "ndim") or x.ndim < 1:
    raise ValueError(f"x must be an array (..., H), got {getattr(x, 'shape', type(x))}.")
  x2d = x.reshape(-1, x.shape[-1])
  norm_op.check_norm_params(x2d, gamma, beta, norm_type)
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  return _normalize(x2d, gamma, beta, _NormConfig(spec, out_dtype, impl)).reshape(x.shape)
