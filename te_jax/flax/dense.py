"""``DenseGeneral`` and ``LayerNormDenseGeneral``: FP8-capable projections.

Under ``te_jax.fp8_autocast(enabled=True, fp8_recipe=r)`` (active when the
module is *traced*: ``init``/``apply`` or the first call of a jitted function)
the GEMM and both of its gradients run in FP8 with recipe ``r`` through
:func:`te_jax.dense.dense_general`. Otherwise the projection is a plain dot in the
compute dtype.

Under ``DelayedScaling`` each module keeps its amax histories and scales in
the variable ``fp8_meta`` of collection ``"_overwrite_with_gradient"``
(``te_jax.fp8_state.FP8_COLLECTION``); ``TrainState.apply_gradients`` replaces
it by its "gradient", the updated state. The other recipes keep no state.

``LayerNormDenseGeneral`` in FP8 normalizes and quantizes its input in one
pass (``te_jax.norm_dense``) when the GEMM is unsharded and the shapes allow
it (tokens a multiple of the recipe's ``token_block``, embed a multiple of
128 up to ``te_jax.norm_dense.MAX_HIDDEN``); otherwise the norm runs in XLA
and its output is quantized separately, and the ``te_jax`` logger says why
(INFO, once per reason). Both paths use the same variables.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.core import meta

from te_jax import norm_dense
from te_jax.flax import fp8_module
from te_jax.flax.norm import norm_params
from te_jax.layers import dense as dense_core
from te_jax.layers.dense import check_call_options
from te_jax.layers import init as init_lib
from te_jax.layers.checks import check_input_rank, compute_dtype, to_tuple
from te_jax.layers.gemm import canonicalize_axes, check_split_output
from te_jax.layers.init import default_kernel_init
from te_jax.layers.norm import check_input_norm

__all__ = ["DenseGeneral", "LayerNormDenseGeneral", "declare_dense", "kernel_fan_in_init",
           "logical_partitioning_of", "unboxed", "resolve_param_axes"]

Dtype = Any
Initializer = Callable[..., jax.Array]


def kernel_fan_in_init(init, n_in, n_out):
  """``te_jax.layers.init.kernel_fan_in_init`` for a Linen initializer: one
  wrapped in ``nn.with_logical_partitioning`` is unboxed (the caller boxes the
  result with the resolved names, :func:`resolve_param_axes`)."""
  return init_lib.kernel_fan_in_init(init, n_in, n_out, unboxed)


# ------------------------------------- initializers with logical names ---
# Flax's idiom nn.with_logical_partitioning(init, names) is accepted as an
# initializer: the names become the parameter's logical axes when the module
# was not given its own; an explicit, different set of names is an error.

def unboxed(value):
  """``value`` without a Flax metadata box (no sharding constraint applied)."""
  if isinstance(value, meta.Partitioned):
    return value.unbox(apply_constraint=False)
  if isinstance(value, meta.AxisMetadata):
    return value.unbox()
  return value


def logical_partitioning_of(init, shape, dtype, *, arg: str = "kernel_init"):
  """The ``nn.LogicallyPartitioned`` box ``init(key, shape, dtype)`` returns
  (``nn.with_logical_partitioning(fn, names)``), or None for a plain
  initializer. Traced with ``jax.eval_shape``: nothing is computed.

  Raises:
    TypeError: ``init`` returns another metadata box (``nn.with_partitioning``
      names mesh axes, which te_jax's logical axis rules cannot take).

  >>> import flax.linen as nn, jax.numpy as jnp
  >>> init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  >>> logical_partitioning_of(init, (4, 8), jnp.float32).names
  ('embed', 'mlp')
  """
  out = jax.eval_shape(lambda: init(jax.random.key(0), shape, dtype))
  if isinstance(out, nn.LogicallyPartitioned):
    return out
  if isinstance(out, meta.AxisMetadata):
    raise TypeError(
        f"{arg} returns a {type(out).__name__} box; te_jax modules take logical axis "
        f"names: wrap the initializer in nn.with_logical_partitioning(init, names), or "
        f"pass it unwrapped and set the module's axis names.")
  return None


def resolve_param_axes(init, init_shape, dtype, param_shape, axes, default_axes, *,
                       arg: str, axes_arg: str, param: str):
  """(logical names, extra ``nn.with_logical_partitioning`` kwargs) of a parameter.

  Args:
    init: the initializer, possibly wrapped in ``nn.with_logical_partitioning``.
    init_shape: the shape the module calls ``init`` with (e.g. the 2-D view).
    dtype: the parameter dtype.
    param_shape: the parameter's shape (one name per dim).
    axes: the module's names attribute (empty or None: not given).
    default_axes: the names used when neither ``axes`` nor the wrapper gives any.
    arg, axes_arg, param: the attribute and parameter names for errors.

  The wrapper's names win over ``default_axes``; an ``axes`` that differs
  from them raises a ValueError (the module cannot tell which one is meant).
  """
  box = logical_partitioning_of(init, init_shape, dtype, arg=arg)
  given = tuple(axes) if axes else None
  if box is None:
    return (given if given is not None else tuple(default_axes)), {}
  names = tuple(box.names)
  if len(names) != len(param_shape):
    raise ValueError(
        f"{arg} is wrapped in nn.with_logical_partitioning with names {names}, but the "
        f"parameter '{param}' has shape {tuple(param_shape)}: give one name per dim.")
  if given is not None and given != names:
    raise ValueError(
        f"{arg} is wrapped in nn.with_logical_partitioning with names {names}, but "
        f"{axes_arg}={given} names the parameter '{param}' differently. Keep one of "
        f"them: drop {axes_arg}, or pass the initializer unwrapped.")
  return names, {"mesh": box.mesh, "rules": box.rules}


def declare_dense(module: nn.Module, in_shape: Tuple[int, ...], *, features, use_bias: bool,
                  param_dtype, kernel_init, bias_init, kernel_axes, bias_axes,
                  kernel_name: str = "kernel", bias_name: str = "bias"):
  """Declares the kernel (*in_shape, *features) and bias of a projection on
  ``module``; returns (kernel, bias or None, kernel_axes), the kernel and bias
  in their parameter dtype."""
  features = to_tuple("features", features)
  n_in, n_out = len(in_shape), len(features)
  kernel_shape = tuple(in_shape) + features
  flat = (math.prod(in_shape), math.prod(features))
  kernel_axes, box_kw = resolve_param_axes(
      kernel_init, flat, param_dtype, kernel_shape, kernel_axes,
      init_lib.default_kernel_axes(n_in, n_out), arg="kernel_init", axes_arg="kernel_axes",
      param=kernel_name)
  if len(kernel_axes) != len(kernel_shape):
    raise ValueError(f"kernel_axes {kernel_axes} must name each of the "
                     f"{len(kernel_shape)} kernel dims {kernel_shape}.")
  kernel = module.param(
      kernel_name,
      nn.with_logical_partitioning(kernel_fan_in_init(kernel_init, n_in, n_out),
                                   kernel_axes, **box_kw),
      kernel_shape, param_dtype)
  bias = None
  if use_bias:
    bias_axes, box_kw = resolve_param_axes(
        bias_init, features, param_dtype, features, bias_axes, kernel_axes[n_in:],
        arg="bias_init", axes_arg="bias_axes", param=bias_name)
    if len(bias_axes) != n_out:
      raise ValueError(f"bias_axes {bias_axes} must name each of the {n_out} "
                       f"feature dims {features}.")
    bias = module.param(bias_name, nn.with_logical_partitioning(
        lambda *a: unboxed(bias_init(*a)), bias_axes, **box_kw), features, param_dtype)
  return kernel, bias, kernel_axes


class DenseGeneral(nn.Module):
  """A linear map over one or more axes whose GEMMs run in FP8 under ``fp8_autocast``.

  Shapes: ``inputs`` (..., *in_dims) with ``in_dims`` the ``axis`` dims ->
  (..., *features) (the non-contracted axes keep their order, in front); with
  ``split_output=True``, a tuple of ``features[0]`` arrays (..., *features[1:]);
  with block sizes, a tuple of (..., size, *features[1:]) arrays.

  Parameters (logical axis names):
    ``kernel`` (*in_dims, *features): ``kernel_axes``; default from
      ``te_jax.layers.init.default_kernel_axes``, e.g. ("embed", "mlp") for a 2-D kernel,
      ("embed", "heads", "kv") for features=(heads, kv), ("heads", "kv",
      "embed") for axis=(-2, -1) and one feature dim.
    ``bias`` (*features,), only with ``use_bias``: ``bias_axes``; default the
      names of the feature dims of ``kernel_axes``.

  FP8 state (``DelayedScaling`` only): ``fp8_meta`` in collection
  ``"_overwrite_with_gradient"``, ``{"x"|"kernel"|"grad": {"amax_history",
  "scale"}}`` (``te_jax.fp8_state.init_dense_state``).

  Attributes:
    features: int or tuple of ints, the output dims.
    axis: int or tuple of ints, the input axes to contract (default -1).
    use_bias: add a bias (default False).
    dtype: compute/output dtype; None (default) promotes input and param dtype.
    param_dtype: dtype of the parameters (default float32).
    kernel_init: initializer of the kernel, applied to its 2-D (in, out) view
      (default variance scaling 1.0, fan-in, truncated normal). It may be
      wrapped in ``nn.with_logical_partitioning(init, names)`` (Flax's idiom,
      one name per kernel dim): the names then replace the default
      ``kernel_axes``; a ``kernel_axes`` given as well must equal them
      (ValueError otherwise). Same for ``bias_init`` and ``bias_axes``.
    bias_init: initializer of the bias (default zeros).
    kernel_axes: logical axis names of the kernel (default: see above).
    bias_axes: logical axis names of the bias (default: see above).
    split_output: return the output unstacked along its first feature dim
      (True; default False), e.g. q, k, v of a features=(3, heads, head_dim)
      projection, or that dim in blocks of the sizes given (a tuple summing
      to ``features[0]``: (..., size, *features[1:]) each), e.g. the query,
      key and value heads of a features=(heads + 2 * groups, head_dim)
      projection. Same values as indexing the output; in FP8 (unsharded) the
      gradients of the parts are quantized in one pass without being
      concatenated (``te_jax.dense.fp8_dense_split``).
    impl: "auto" (default), "cuda" or "reference": which implementation the
      FP8 ops use (the environment variable ``TE_JAX_IMPL`` overrides "auto").
  """

  features: Union[int, Sequence[int]]
  axis: Union[int, Sequence[int]] = -1
  use_bias: bool = False
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  kernel_axes: Tuple[Optional[str], ...] = ()
  bias_axes: Tuple[Optional[str], ...] = ()
  split_output: Union[bool, Tuple[int, ...]] = False
  impl: str = "auto"

  @nn.compact
  def __call__(self, inputs: jax.Array, *,
               input_norm: Optional[norm_dense.NormParams] = None,
               return_norm_output: bool = False, residual: Optional[jax.Array] = None,
               return_input: bool = False):
    """Applies the projection; see the class docstring for shapes.

    Args:
      inputs: (..., *in_dims).
      input_norm: optional ``te_jax.norm_dense.NormParams`` (parameters owned
        by the caller, e.g. ``te_jax.flax.NormParameters``): the projection
        is applied to ``norm(inputs)`` over the last axis (``axis`` must be
        -1). In FP8, unsharded, with tokens a multiple of the recipe's
        ``token_block`` and in_dim a multiple of 128, the norm is fused into
        the quantization of the GEMM's input (``te_jax.norm_dense``; INFO log
        once per reason when it is not); otherwise it runs on te_jax's
        unquantized norm kernels (``te_jax.norm_dense.normalize``) for
        in_dim >= 4096, or in XLA (narrower, or a mesh of several devices).
      return_norm_output: with ``input_norm``, also return the normalized
        input (..., in_dim) in the compute dtype: ``(y, norm_output)``.
      residual: optional array of the output's shape added to it (a residual
        connection; not with ``input_norm`` or ``split_output``). In FP8,
        unsharded, it is the GEMM's C input, added before the output's one
        rounding, with no pass of its own.
      return_input: with ``input_norm``, also return ``inputs`` (last), as
        passed through the fused norm's op where it is taken: given as the
        ``residual`` of a connection around this projection's branch, its
        cotangent is added to the input's gradient by the norm's backward
        kernel (no add of its own).
    """
    check_input_rank("inputs", inputs)
    check_call_options(input_norm, self.split_output, residual=residual,
                       return_norm_output=return_norm_output, return_input=return_input)
    settings = fp8_module.read_autocast(self.impl)
    states = fp8_module.LinenStates(self)
    compute = compute_dtype(self.dtype, inputs.dtype, self.param_dtype)
    if input_norm is None:
      axis = canonicalize_axes(self.axis, inputs.ndim)
      kernel, bias, kernel_axes = self._declare(tuple(inputs.shape[a] for a in axis))
      return dense_core.project(states, settings, inputs, kernel, bias, axis=axis,
                                dtype=compute, kernel_axes=kernel_axes,
                                split_output=self.split_output, residual=residual)
    check_input_norm(input_norm, self.axis, inputs.ndim)
    kernel, bias, kernel_axes = self._declare(inputs.shape[-1:])
    return dense_core.norm_dense(states, settings, inputs, input_norm, kernel, bias,
                                 dtype=compute, owner=type(self).__name__,
                                 kernel_axes=kernel_axes,
                                 return_norm_output=return_norm_output,
                                 split_output=self.split_output, return_input=return_input)

  def _declare(self, in_shape):
    """(kernel, bias or None, kernel_axes) for inputs whose contracted dims are ``in_shape``."""
    features = to_tuple("features", self.features)
    check_split_output(self.split_output, features)
    return declare_dense(self, tuple(in_shape), features=features, use_bias=self.use_bias,
                         param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                         bias_init=self.bias_init, kernel_axes=self.kernel_axes,
                         bias_axes=self.bias_axes)


class LayerNormDenseGeneral(nn.Module):
  """LayerNorm (or RMSNorm) over the last axis followed by a ``DenseGeneral`` over it.

  Shapes: ``inputs`` (..., embed) -> (..., *features); with
  ``return_layernorm_output=True`` returns ``(y, ln_out)`` with ``ln_out``
  (..., embed) in the compute dtype.

  In FP8, unsharded and with tokens a multiple of the recipe's
  ``token_block`` and embed a multiple of 128 (up to
  ``te_jax.norm_dense.MAX_HIDDEN``), the norm is fused into the quantization
  of its output and its backward is one kernel (``te_jax.norm_dense``); the
  normalized input is quantized from float32 rather than from the compute
  dtype. Otherwise (INFO log once per reason), and with FP8 off, the norm
  runs on te_jax's statistics and backward kernels unquantized
  (``te_jax.norm_dense.normalize``) for embed >= 4096 unless a mesh of
  several devices is active (else in XLA;
  ``te_jax.layers.norm.MIN_KERNEL_HIDDEN`` is the threshold).
  With ``fuse_norm_quantize=False`` it always runs in XLA. Same variables
  either way.

  Parameters (logical axis names):
    ``scale`` (embed,) ``ln_scale_axes`` = ("embed",).
    ``ln_bias`` (embed,) ``ln_bias_axes`` = ("embed",) (layernorm only).
    ``kernel`` (embed, *features) ``kernel_axes`` (default ("embed", "mlp") or
      ("embed", "heads", "kv"), ...; see ``DenseGeneral``).
    ``bias`` (*features,) with ``use_bias``.

  FP8 state (``DelayedScaling`` only): ``fp8_meta`` as in ``DenseGeneral``.

  Attributes:
    features: int or tuple of ints, the output dims.
    layernorm_type: "layernorm" (default) or "rmsnorm".
    epsilon: norm epsilon (default 1e-6).
    zero_centered_gamma: store gamma - 1, initialized to zeros.
    return_layernorm_output: also return the normalized input.
    fuse_norm_quantize: in FP8, normalize and quantize in one pass where the
      shapes allow it, else (and with FP8 off) normalize on te_jax's kernels
      (default True); False keeps XLA's norm (to compare).
    use_bias: add a bias after the projection (default False).
    dtype: compute/output dtype; None promotes input and param dtype.
    param_dtype: parameter dtype (default float32).
    kernel_init, bias_init: initializers of the projection (wrapped in
      ``nn.with_logical_partitioning`` or not, as in ``DenseGeneral``).
    scale_init, ln_bias_init: initializers of the norm (default ones/zeros,
      zeros for the scale when zero-centered).
    kernel_axes, bias_axes, ln_scale_axes, ln_bias_axes: logical axis names.
    impl: "auto" (default), "cuda" or "reference", as in ``DenseGeneral``.
  """

  features: Union[int, Sequence[int]]
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  return_layernorm_output: bool = False
  fuse_norm_quantize: bool = True
  use_bias: bool = False
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  scale_init: Optional[Initializer] = None
  ln_bias_init: Initializer = nn.initializers.zeros
  kernel_axes: Tuple[Optional[str], ...] = ()
  bias_axes: Tuple[Optional[str], ...] = ()
  ln_scale_axes: Tuple[Optional[str], ...] = ("embed",)
  ln_bias_axes: Tuple[Optional[str], ...] = ("embed",)
  impl: str = "auto"

  @nn.compact
  def __call__(self, inputs: jax.Array):
    """Normalizes, then projects; see the class docstring for shapes."""
    check_input_rank("inputs", inputs)
    compute = compute_dtype(self.dtype, inputs.dtype, self.param_dtype)
    settings = fp8_module.read_autocast(self.impl)
    scale, ln_bias = norm_params(
        self, inputs.shape[-1], norm_type=self.layernorm_type,
        zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
        bias_init=self.ln_bias_init, axes=tuple(self.ln_scale_axes),
        param_dtype=self.param_dtype, bias_axes=tuple(self.ln_bias_axes))
    norm = norm_dense.NormParams(scale, ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    kernel, bias, kernel_axes = declare_dense(
        self, inputs.shape[-1:], features=self.features, use_bias=self.use_bias,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
        kernel_axes=self.kernel_axes, bias_axes=self.bias_axes)
    return dense_core.norm_dense(fp8_module.LinenStates(self), settings, inputs, norm, kernel,
                                 bias, dtype=compute, owner="LayerNormDenseGeneral",
                                 kernel_axes=kernel_axes,
                                 fuse_norm_quantize=self.fuse_norm_quantize,
                                 return_norm_output=self.return_layernorm_output)
