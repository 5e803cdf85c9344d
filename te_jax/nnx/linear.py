"""``Linear``, ``LayerNormLinear`` and the norms, as NNX modules.

Same parameters (names, shapes, logical axis names), same calls into the
core (``te_jax.layers.dense``) and hence the same numbers as
``te_jax.flax.DenseGeneral`` / ``LayerNormDenseGeneral`` / ``LayerNorm`` /
``RMSNorm``; the FP8 state is the module's ``FP8State`` variables
(``te_jax.nnx.state.NnxStates``) instead of a Linen collection.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from te_jax import norm_dense
from te_jax.layers import dense as dense_core
from te_jax.layers.dense import check_call_options
from te_jax.layers import init as init_lib
from te_jax.layers.checks import check_input_rank, compute_dtype, to_tuple
from te_jax.layers.gemm import FP8_META, canonicalize_axes, check_split_output
from te_jax.layers.init import default_kernel_init
from te_jax.layers.norm import apply_norm, check_input_norm, check_norm_type
from te_jax.nnx import state as st

__all__ = ["Linear", "LayerNormLinear", "LayerNorm", "RMSNorm", "param", "unboxed",
           "kernel_fan_in_init", "check_biases_used"]

Dtype = Any
Initializer = Callable[..., jax.Array]
zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


# Where Flax's NNX variables carry their logical axis names: "out_sharding",
# and its older spellings.
_NAME_KEYS = ("out_sharding", "sharding", "sharding_names")


def _pop_names(meta: Dict[str, Any]) -> Optional[Tuple]:
  """The logical axis names ``meta`` gives (taken out of it), or None."""
  names = [tuple(n) for n in (meta.pop(k, None) for k in _NAME_KEYS) if n is not None]
  if len(set(names)) > 1:
    raise ValueError(f"the metadata names the axes twice, differently: {names}.")
  return names[0] if names else None


def param(rngs: nnx.Rngs, init, shape, dtype, axes, metadata: Mapping[str, Any] = None, *,
          axes_given: bool = True, what: str = "kernel") -> nnx.Param:
  """An ``nnx.Param`` initialized by ``init``, whose ``out_sharding`` metadata
  is its logical axis names (not applied eagerly: map them to the mesh with
  your logical axis rules, or ``te_jax.nnx.get_named_sharding``).

  The names are ``axes``, or, as for ``nnx.Linear``, those that ``init``
  carries (``nnx.with_partitioning(init, names)``) or ``metadata`` gives
  (``kernel_metadata={"out_sharding": names, ...}``); names given in more
  than one of these places (``axes`` only when ``axes_given``) must agree.
  The other entries of ``metadata`` are set on the Param.

  Raises:
    ValueError: the names disagree, or do not name each of the ``len(shape)``
      dims.
  """
  value = init(rngs.params(), tuple(shape), dtype)
  extra = dict(metadata or {})
  sources = [(f"{what}_metadata", _pop_names(extra))]
  if isinstance(value, nnx.VariableMetadata):   # hooks and other entries kept
    box = dict(value.metadata)
    sources.append((f"the metadata of {what}_init (nnx.with_partitioning)", _pop_names(box)))
    value = dataclasses.replace(value, metadata=box)
  if axes_given:
    sources.append((f"{what}_axes", tuple(axes)))
  named = [(where, n) for where, n in sources if n is not None]
  if len({n for _, n in named}) > 1:
    raise ValueError(f"the logical axis names of the {what} disagree: "
                     + ", ".join(f"{where} {n}" for where, n in named) + ".")
  where, axes = named[0] if named else (f"{what}_axes", tuple(axes))
  if len(axes) != len(shape):
    raise ValueError(f"{where} {axes} must name each of the {what}'s {len(shape)} dims "
                     f"{tuple(shape)}.")
  return nnx.Param(value, out_sharding=axes, eager_sharding=False, **extra)


def unboxed(value):
  """``value`` without a metadata box: a Linen initializer wrapped in
  ``nn.with_logical_partitioning`` serves the NNX modules too (its names are
  not used: they take ``kernel_axes``); an NNX box without names
  (``nnx.with_metadata``) is taken off. Raises for an NNX box with names,
  where the module cannot keep them (a kernel made of several inits)."""
  if isinstance(value, nnx.VariableMetadata):
    if _pop_names(dict(value.metadata)) is not None:
      raise ValueError("this kernel's initializer carries logical axis names "
                       "(nnx.with_partitioning), which this module takes from its "
                       "kernel_axes arguments instead: pass the names there.")
    return value.raw_value
  if isinstance(value, meta.Partitioned):
    return value.unbox(apply_constraint=False)
  return value.unbox() if isinstance(value, meta.AxisMetadata) else value


def kernel_fan_in_init(init: Initializer, n_in: int, n_out: int) -> Initializer:
  """``te_jax.layers.init.kernel_fan_in_init`` for the NNX modules: a Linen
  metadata box around what ``init`` returns is taken off; an NNX one
  (``nnx.with_partitioning``) is kept around the reshaped kernel, for
  :func:`param` to read its names."""
  def keep_box(key, shape, dtype=jnp.float32):
    boxes = []

    def unbox(value):
      if isinstance(value, nnx.VariableMetadata):
        boxes.append(value)
        return value.raw_value
      return unboxed(value)
    kernel = init_lib.kernel_fan_in_init(init, n_in, n_out, unbox)(key, shape, dtype)
    return dataclasses.replace(boxes[0], raw_value=kernel) if boxes else kernel
  return keep_box


def check_biases_used(module: nnx.Module, names=("bias",)) -> None:
  """Raises when ``module`` (built with ``use_bias=False``) holds a bias
  parameter anyway: one loaded into it (``nnx.update`` / ``nnx.merge`` with
  the state of a model that had biases, e.g. ``flax.nnx.Linear``, whose
  ``use_bias`` defaults to True) would otherwise be silently ignored."""
  if module.use_bias:
    return
  held = [n for n in names if isinstance(getattr(module, n, None), nnx.Variable)]
  if held:
    raise ValueError(
        f"{type(module).__name__} was built with use_bias=False (te_jax's default, as in "
        f"te_jax.flax) but holds {held}, loaded from a model that has them (flax.nnx's "
        "layers default to use_bias=True): its biases would be ignored. Build it with "
        "use_bias=True.")


class _Norm(nnx.Module):
  _norm_type = "layernorm"

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, scale_init: Optional[Initializer] = None,
               bias_init: Initializer = zeros, scale_axes=("embed",), bias_axes=("embed",),
               rngs: nnx.Rngs):
    (num_features,) = to_tuple("num_features", num_features)
    check_norm_type(self._norm_type)
    self.num_features, self.epsilon = num_features, float(epsilon)
    self.zero_centered_gamma, self.dtype = bool(zero_centered_gamma), dtype
    if scale_init is None:
      scale_init = zeros if zero_centered_gamma else ones
    self.scale = param(rngs, scale_init, (num_features,), param_dtype, scale_axes)
    if self._norm_type == "layernorm":
      self.bias = param(rngs, bias_init, (num_features,), param_dtype, bias_axes)

  def __call__(self, x: jax.Array) -> jax.Array:
    check_input_rank("x", x)
    if x.shape[-1] != self.num_features:
      raise ValueError(f"{type(self).__name__}: the input's last dim ({x.shape[-1]}) must "
                       f"equal num_features ({self.num_features}).")
    bias = self.bias[...] if self._norm_type == "layernorm" else None
    return apply_norm(x, self.scale[...], bias, norm_type=self._norm_type,
                      epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                      dtype=self.dtype if self.dtype is not None else x.dtype)

  def norm_params(self) -> norm_dense.NormParams:
    """The norm as a ``te_jax.norm_dense.NormParams``, for a layer that fuses
    it into its own input quantization (``Linear(...)(x, input_norm=...)``)."""
    bias = self.bias[...] if self._norm_type == "layernorm" else None
    return norm_dense.NormParams(self.scale[...], bias, self._norm_type, self.epsilon,
                                 self.zero_centered_gamma)


class LayerNorm(_Norm):
  """``te_jax.flax.LayerNorm`` as an NNX module: ``LayerNorm(num_features, *,
  epsilon=1e-6, zero_centered_gamma=False, dtype=None, param_dtype=float32,
  scale_init, bias_init, scale_axes, bias_axes, rngs)``; parameters ``scale``
  and ``bias`` (num_features,), computed in float32."""

  _norm_type = "layernorm"


class RMSNorm(_Norm):
  """``te_jax.flax.RMSNorm`` as an NNX module (parameter ``scale`` only);
  arguments as :class:`LayerNorm`."""

  _norm_type = "rmsnorm"


class Linear(nnx.Module):
  """A linear map over one or more input axes whose GEMMs run in FP8 under ``fp8_autocast``.

  ``te_jax.flax.DenseGeneral`` as an NNX module: same parameters, same
  numbers. Shapes: ``x`` (..., *in_features) (the ``axis`` dims) ->
  (..., *out_features); with ``split_output=True``, a tuple of
  ``out_features[0]`` arrays (..., *out_features[1:]); with block sizes, a
  tuple of (..., size, *out_features[1:]) arrays.

  Parameters: ``kernel`` (*in_features, *out_features), logical axes
  ``kernel_axes`` (default as ``te_jax.layers.init.default_kernel_axes``);
  ``bias`` (*out_features,) with ``use_bias``. Under ``DelayedScaling`` (active
  while the module is constructed): ``fp8_meta``, an ``te_jax.nnx.FP8State``.

  Args:
    in_features: int or tuple of ints, the sizes of the contracted ``axis`` dims.
    out_features: int or tuple of ints, the output dims.
    axis: int or tuple of ints (one per in_features), default -1.
    use_bias: add a bias (default False, as ``te_jax.flax.DenseGeneral``;
      ``nnx.Linear``'s is True: pass ``use_bias=True`` when porting one. A
      bias loaded into a module built without one raises at the call).
    dtype: compute/output dtype; None promotes input and parameter dtypes.
    param_dtype: parameter dtype (default float32).
    kernel_init: initializer applied to the kernel's 2-D (in, out) view; one
      wrapped in ``nnx.with_partitioning(init, names)`` names the kernel's
      axes, as for ``nnx.Linear``.
    bias_init: bias initializer (default zeros).
    kernel_axes, bias_axes: logical axis names (``out_sharding`` metadata; the
      FP8 GEMMs also shard by them under ``fp8_autocast(mesh_resource=...)``).
    kernel_metadata, bias_metadata: metadata set on the parameters, as for
      ``nnx.Linear``; an ``"out_sharding"`` entry names the axes (names given
      in several of these places must agree).
    split_output: True returns the output unstacked along its first output
      dim (q, k, v of a fused projection); a tuple of sizes summing to
      ``out_features[0]`` returns that dim in blocks of those sizes (..., size,
      *out_features[1:]) (grouped-query attention's query, key and value
      heads). In FP8 the parts' gradients are quantized without a
      concatenation.
    impl: "auto", "cuda" or "reference": the FP8 ops' implementation.
    rngs: ``nnx.Rngs`` for the initializers.
  """

  FP8_GEMMS = (FP8_META,)

  def __init__(self, in_features: Union[int, Sequence[int]],
               out_features: Union[int, Sequence[int]], *, axis=-1, use_bias: bool = False,
               dtype: Optional[Dtype] = None, param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = zeros,
               kernel_axes: Sequence[Optional[str]] = (),
               bias_axes: Sequence[Optional[str]] = (),
               split_output: Union[bool, Sequence[int]] = False,
               impl: str = "auto", kernel_metadata: Mapping[str, Any] = None,
               bias_metadata: Mapping[str, Any] = None, rngs: nnx.Rngs):
    self.in_features = to_tuple("in_features", in_features)
    self.out_features = to_tuple("out_features", out_features)
    n_in, n_out = len(self.in_features), len(self.out_features)
    self.axis = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(self.axis) != n_in:
      raise ValueError(f"axis {axis} must give one input axis per in_features "
                       f"{self.in_features}.")
    check_split_output(split_output, self.out_features)
    self.use_bias, self.dtype, self.param_dtype = bool(use_bias), dtype, param_dtype
    self.split_output = split_output if isinstance(split_output, bool) else tuple(split_output)
    self.impl = impl
    mode = st.construction_mode(impl)
    self.kernel = param(rngs, kernel_fan_in_init(kernel_init, n_in, n_out),
                        self.in_features + self.out_features, param_dtype,
                        tuple(kernel_axes) or init_lib.default_kernel_axes(n_in, n_out),
                        kernel_metadata, axes_given=bool(tuple(kernel_axes)))
    self.kernel_axes = self.kernel.get_metadata("out_sharding")
    if self.use_bias:
      self.bias = param(rngs, bias_init, self.out_features, param_dtype,
                        tuple(bias_axes) or self.kernel_axes[n_in:], bias_metadata,
                        axes_given=bool(tuple(bias_axes)), what="bias")
    st.add_fp8_state(self, mode)

  def __call__(self, x: jax.Array, *, input_norm: Optional[norm_dense.NormParams] = None,
               return_norm_output: bool = False, residual: Optional[jax.Array] = None,
               return_input: bool = False):
    """Applies the projection; see the class docstring for shapes.

    ``input_norm``, ``return_norm_output``, ``residual`` and ``return_input``: as
    ``te_jax.flax.DenseGeneral.__call__`` (the projection of ``norm(x)``, the
    norm fused into the FP8 quantization of the GEMM input where it can be;
    an array added to the output, the GEMM's C input where it can be).
    """
    check_call_options(input_norm, self.split_output, residual=residual,
                       return_norm_output=return_norm_output, return_input=return_input)
    if input_norm is not None:
      return self._normed(x, input_norm, return_norm_output, return_input)
    check_biases_used(self)
    settings = st.read_autocast(self.impl)
    axis = self._contracted(x)
    bias = self.bias[...] if self.use_bias else None
    return dense_core.project(st.NnxStates(self), settings, x, self.kernel[...], bias,
                              axis=axis, dtype=compute_dtype(self.dtype, x.dtype,
                                                             self.param_dtype),
                              kernel_axes=self.kernel_axes, split_output=self.split_output,
                              residual=residual)

  def _contracted(self, x):
    """The canonical ``axis`` of ``x``, whose dims must be ``in_features``."""
    axis = canonicalize_axes(self.axis, x.ndim)
    got = tuple(x.shape[a] for a in axis)
    if got != self.in_features:
      raise ValueError(f"Linear: the input's dims {got} on axis {self.axis} must equal "
                       f"in_features {self.in_features}; got an input of shape {x.shape}.")
    return axis

  def _normed(self, x, norm, return_norm_output, return_input=False):
    check_biases_used(self)
    check_input_norm(norm, self.axis, x.ndim)
    self._contracted(x)
    bias = self.bias[...] if self.use_bias else None
    return dense_core.norm_dense(
        st.NnxStates(self), st.read_autocast(self.impl), x, norm, self.kernel[...], bias,
        dtype=compute_dtype(self.dtype, x.dtype, self.param_dtype), owner="nnx.Linear",
        kernel_axes=self.kernel_axes, return_norm_output=return_norm_output,
        split_output=self.split_output, return_input=return_input)


class LayerNormLinear(nnx.Module):
  """LayerNorm (or RMSNorm) over the last axis, then a :class:`Linear` over it.

  ``te_jax.flax.LayerNormDenseGeneral`` as an NNX module (same parameters,
  same numbers, the same fused norm + quantize path in FP8 where the shapes
  allow it). Shapes: ``x`` (..., in_features) -> (..., *out_features); with
  ``return_layernorm_output`` ``(y, ln_out)``.

  Parameters: ``scale`` and (layernorm) ``ln_bias`` (in_features,);
  ``kernel`` (in_features, *out_features); ``bias`` with ``use_bias``; FP8
  state ``fp8_meta`` under ``DelayedScaling``.

  Args:
    in_features: the normalized width (int).
    out_features: int or tuple of ints.
    layernorm_type: "layernorm" (default) or "rmsnorm".
    epsilon, zero_centered_gamma, return_layernorm_output, fuse_norm_quantize, use_bias, dtype,
    param_dtype, kernel_init, bias_init, scale_init, ln_bias_init,
    kernel_axes, bias_axes, ln_scale_axes, ln_bias_axes, impl: as the Linen module.
    kernel_metadata, bias_metadata: as :class:`Linear`'s.
    rngs: ``nnx.Rngs``.
  """

  FP8_GEMMS = (FP8_META,)

  def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], *,
               layernorm_type: str = "layernorm", epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
               fuse_norm_quantize: bool = True,
               use_bias: bool = False, dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = zeros,
               scale_init: Optional[Initializer] = None, ln_bias_init: Initializer = zeros,
               kernel_axes: Sequence[Optional[str]] = (),
               bias_axes: Sequence[Optional[str]] = (), ln_scale_axes=("embed",),
               ln_bias_axes=("embed",), impl: str = "auto",
               kernel_metadata: Mapping[str, Any] = None,
               bias_metadata: Mapping[str, Any] = None, rngs: nnx.Rngs):
    (self.in_features,) = to_tuple("in_features", in_features)
    self.out_features = to_tuple("out_features", out_features)
    check_norm_type(layernorm_type)
    n_out = len(self.out_features)
    self.layernorm_type, self.epsilon = layernorm_type, float(epsilon)
    self.zero_centered_gamma = bool(zero_centered_gamma)
    self.return_layernorm_output = bool(return_layernorm_output)
    self.fuse_norm_quantize = bool(fuse_norm_quantize)
    self.use_bias, self.dtype, self.param_dtype, self.impl = (
        bool(use_bias), dtype, param_dtype, impl)
    mode = st.construction_mode(impl)
    if scale_init is None:
      scale_init = zeros if zero_centered_gamma else ones
    e = self.in_features
    self.scale = param(rngs, scale_init, (e,), param_dtype, ln_scale_axes)
    if layernorm_type == "layernorm":
      self.ln_bias = param(rngs, ln_bias_init, (e,), param_dtype, ln_bias_axes)
    self.kernel = param(rngs, kernel_fan_in_init(kernel_init, 1, n_out),
                        (e,) + self.out_features, param_dtype,
                        tuple(kernel_axes) or init_lib.default_kernel_axes(1, n_out),
                        kernel_metadata, axes_given=bool(tuple(kernel_axes)))
    self.kernel_axes = self.kernel.get_metadata("out_sharding")
    if self.use_bias:
      self.bias = param(rngs, bias_init, self.out_features, param_dtype,
                        tuple(bias_axes) or self.kernel_axes[1:], bias_metadata,
                        axes_given=bool(tuple(bias_axes)), what="bias")
    st.add_fp8_state(self, mode)

  def __call__(self, x: jax.Array):
    """Normalizes, then projects; see the class docstring for shapes."""
    check_input_rank("x", x)
    check_biases_used(self)
    if x.shape[-1] != self.in_features:
      raise ValueError(f"LayerNormLinear: the input's last dim ({x.shape[-1]}) must equal "
                       f"in_features ({self.in_features}).")
    ln_bias = self.ln_bias[...] if self.layernorm_type == "layernorm" else None
    norm = norm_dense.NormParams(self.scale[...], ln_bias, self.layernorm_type, self.epsilon,
                                 self.zero_centered_gamma)
    return dense_core.norm_dense(
        st.NnxStates(self), st.read_autocast(self.impl), x, norm, self.kernel[...],
        self.bias[...] if self.use_bias else None,
        dtype=compute_dtype(self.dtype, x.dtype, self.param_dtype),
        owner="nnx.LayerNormLinear", kernel_axes=self.kernel_axes,
        fuse_norm_quantize=self.fuse_norm_quantize,
        return_norm_output=self.return_layernorm_output)
