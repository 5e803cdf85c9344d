"""Fused activation + FP8 quantize for the FP8 MLP.

Forward: ``z = act(h)`` is quantized in the pass that reads ``h``; backward:
``dh = dz * act'(h)`` is quantized in the pass that reads ``dz`` and ``h``.
On the CUDA path neither ``z`` nor ``dh`` is ever written in 16 or 32 bits
(``custom_calls/ffi/act_quantize.cc``, ``act_quantize_cuda.py``).

Layout: ``h`` is (M, n_act*F), the fused up-projection (M, n_act, F)
flattened, with ``h0 = h[:, :F]`` and ``h1 = h[:, F:]``; ``activations`` holds
one name (``z = act0(h0)``) or two, a gated unit (``z = act0(h0) * act1(h1)``,
e.g. ("silu", "linear") = SwiGLU, ("gelu", "linear") = GeGLU).

The pure-JAX functions below are the spec. Activations and their derivatives
are written out in float32 (not ``jax.grad``) so that the CUDA kernels
(``custom_calls/kernels/activation.h``) can mirror them operation for
operation; the two paths then differ only where ``tanh``/``exp``/``erfc``
differ by float32 ulps (the kernels' exp(-|x|) is within 2.5 ulps of the
exact value and returns 0 below 2^-126), which moves an FP8 value by at
most one step on rare elements. Quantization is exactly
``ops/quantize.py``'s, applied to the float32 result (no bf16 rounding in
between).

Outputs: both FP8 copies by default; ``rowwise=False`` / ``columnwise=False``
leaves one out (the FP8 MLP's forward writes only the rowwise ``z``).
``dact_quantize(..., act_columnwise=...)`` also writes the columnwise copy
of ``z = act(h)`` for the second layer's wgrad, quantized as the forward
quantized ``z`` (:class:`ActColumnwise`), from the activation values its
pass over ``h`` computes anyway: the forward keeps no such copy, and no
second pass over ``h`` makes it. ``act_quantize(..., h_copy=True)`` also
writes the E4M3 copy of ``h`` that ``dact_quantize`` reads, from the ``h``
it loads: no quantize pass of its own.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.ops import _native
from te_jax.ops import act_quantize_cuda
from te_jax.ops import quantize as quantize_op
from te_jax.ops import quantize_copies as copies
from te_jax.ops.fp8 import QuantizedTensor, ScaledTensor

__all__ = ["ACTIVATIONS", "H_COPY_BLOCK", "H_COPY_DTYPE", "H_COPY_POWER_2_SCALE",
           "ACTIVATION_NAMES", "Activation", "MODES", "activation_forward", "activation_backward",
           "ActColumnwise", "act_columnwise_like", "join_columnwise", "act_quantize_reference",
           "dact_quantize_reference", "act_quantize", "dact_quantize", "act_quantize_supported"]

MODES = quantize_op.MODES

# h's copy (h_copy=True), the FP8 h dact_quantize reads, whatever z's mode.
H_COPY_BLOCK = (1, 128)
H_COPY_DTYPE = jnp.float8_e4m3fn
H_COPY_POWER_2_SCALE = True

_F32 = jnp.float32
_ONE, _HALF = np.float32(1.0), np.float32(0.5)
_TWO, _FOUR = np.float32(2.0), np.float32(4.0)
# float32 roundings of the constants; activation.h spells the same values.
_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))  # as in jax.nn.gelu
_GELU_C = np.float32(0.044715)
_GELU_C3 = np.float32(0.134145)  # 3 * 0.044715, rounded once
_SQRT_HALF = np.float32(np.sqrt(0.5))
_INV_SQRT_2PI = np.float32(1.0 / np.sqrt(2.0 * np.pi))
_QUICK = np.float32(1.702)


# ------------------------------------------------------------ activations ---

def _sigmoid_pair(x):
  """``(sigmoid(x), 1 - sigmoid(x))``, both to a few float32 ulps: from
  ``e = exp(-|x|)`` (never overflows), ``1 / (1 + e)`` and ``e / (1 + e)``.
  ``1 - s`` by subtraction would lose all relative accuracy where ``s`` is
  near 1, and the derivatives below are products with that complement."""
  e = jnp.exp(-jnp.abs(x))
  r = _ONE / (_ONE + e)
  er = e * r
  pos = x >= 0
  return jnp.where(pos, r, er), jnp.where(pos, er, r)


def _linear(x):
  return x, jnp.ones_like(x)


def _gelu(x):
  """tanh approximation; 0.5 (1 + tanh u) = sigmoid(2u), and
  0.5 (1 - tanh(u)^2) = 2 sigmoid(2u) (1 - sigmoid(2u))."""
  x2 = x * x
  u = _SQRT_2_OVER_PI * (x + _GELU_C * (x2 * x))
  cdf, cdf_c = _sigmoid_pair(_TWO * u)
  du = _SQRT_2_OVER_PI * (_ONE + _GELU_C3 * x2)
  return x * cdf, cdf + (x * (_TWO * (cdf * cdf_c))) * du


def _gelu_exact(x):
  """erfc form (as jax.nn.gelu): accurate for x << 0."""
  cdf = _HALF * lax.erfc(-x * _SQRT_HALF)
  pdf = jnp.exp((x * x) * np.float32(-0.5)) * _INV_SQRT_2PI
  return x * cdf, cdf + x * pdf


def _relu(x):
  """NaN stays NaN; relu'(0) = 0 as jax.nn.relu."""
  return (jnp.where(x < 0, np.float32(0), x), jnp.where(x > 0, _ONE, np.float32(0)))


def _silu(x):
  s, s_c = _sigmoid_pair(x)
  return x * s, s * (_ONE + x * s_c)


def _sigmoid(x):
  s, s_c = _sigmoid_pair(x)
  return s, s * s_c


def _tanh(x):
  """tanh x = (1 - e) / (1 + e), e = exp(-2|x|); 1 - e by expm1."""
  a = _TWO * jnp.abs(x)
  e = jnp.exp(-a)
  r = _ONE / (_ONE + e)
  t = -jnp.expm1(-a) * r
  return jnp.where(x < 0, -t, t), _FOUR * (e * (r * r))


def _quick_gelu(x):
  a = _QUICK * x
  s, s_c = _sigmoid_pair(a)
  return x * s, s * (_ONE + a * s_c)


class Activation(NamedTuple):
  """One activation, everywhere te_jax uses it.

  Attributes:
    kernel_id: its ``ActId`` in ``custom_calls/kernels/quantize.h``.
    fwd_bwd: float32 ``x -> (act(x), act'(x))``, the spec the fused kernels
      mirror operation for operation (``kernels/activation.h``), through
      ``exp``/``expm1`` only, never ``1 - tanh`` or ``1 - sigmoid``: CUDA's
      and XLA's tanh differ by ulps near +-1, which ``1 - t^2`` turns into
      relative errors of 100% and more (many FP8 steps of a gelu backward);
      the ``exp`` forms differ by one FP8 step on rare elements at most.
    jax_fn: the function the unfused MLP path applies in the compute dtype.
  """

  kernel_id: int
  fwd_bwd: Callable[[jax.Array], Tuple[jax.Array, jax.Array]]
  jax_fn: Callable[[jax.Array], jax.Array]


ACTIVATIONS = {
    "linear": Activation(0, _linear, lambda x: x),
    "gelu": Activation(1, _gelu, lambda x: jax.nn.gelu(x, approximate=True)),
    "gelu_exact": Activation(2, _gelu_exact, lambda x: jax.nn.gelu(x, approximate=False)),
    "relu": Activation(3, _relu, jax.nn.relu),
    "silu": Activation(4, _silu, jax.nn.silu),
    "swish": Activation(4, _silu, jax.nn.silu),
    "sigmoid": Activation(5, _sigmoid, jax.nn.sigmoid),
    "tanh": Activation(6, _tanh, jnp.tanh),
    "quick_gelu": Activation(7, _quick_gelu, lambda x: x * jax.nn.sigmoid(1.702 * x)),
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)


# ----------------------------------------------------------------- checks ---

def _check_activations(activations) -> Tuple[str, ...]:
  if isinstance(activations, str) or not isinstance(activations, (tuple, list)):
    raise TypeError(f"activations must be a tuple of one or two names such as "
                    f"('gelu',) or ('silu', 'linear'), got {activations!r}.")
  acts = tuple(activations)
  if len(acts) not in (1, 2):
    raise ValueError(f"activations must hold one or two names, got {acts!r}.")
  for a in acts:
    if a not in ACTIVATION_NAMES:
      raise ValueError(f"unknown activation {a!r} in activations; known: "
                       f"{ACTIVATION_NAMES}.")
  return acts


def _check_h(h, n_act: int) -> int:
  """Checks h (M, n_act*F); returns F."""
  quantize_op.check_input(h, "h", 2)
  if h.shape[1] % n_act:
    raise ValueError(f"h.shape[1] ({h.shape[1]}) must be n_act * F with n_act = "
                     f"len(activations) = {n_act}; h has shape {h.shape}.")
  return h.shape[1] // n_act


def _check_fp8_h(h) -> bool:
  """Whether ``h`` is an FP8 ``ScaledTensor`` (store_act_input_in_fp8's copy),
  checked: E4M3 (M, W) in 1x128 tiles, float32 scales (M, ceil(W/128))."""
  if not isinstance(h, ScaledTensor):
    return False
  want = (h.data.shape[0], -(-h.data.shape[-1] // 128))
  for bad, error, need in (
      (h.block_shape != (1, 128), ValueError, f"block_shape (1, 128), got {h.block_shape}"),
      (h.data.ndim != 2 or h.data.dtype != jnp.float8_e4m3fn, TypeError,
       f"2-D float8_e4m3fn data, got {h.data.dtype} {h.data.shape}"),
      (h.scale_inv.dtype != _F32 or tuple(h.scale_inv.shape) != want, ValueError,
       f"float32 scale_inv of shape {want}, got {h.scale_inv.dtype} {h.scale_inv.shape}")):
    if bad:
      raise error(f"h as a ScaledTensor needs {need}: pass quantize_blockwise(h, (1, 128), "
                  "jnp.float8_e4m3fn).rowwise(), or h as a float array.")
  return True


def _check_h_copy(h_copy) -> bool:
  if not isinstance(h_copy, (bool, np.bool_)):
    raise TypeError(f"h_copy must be a Python bool (it is static), got {h_copy!r}.")
  return bool(h_copy)


def _check_dz(dz, h, n_act: int):
  quantize_op.check_input(dz, "dz", 2)
  if h.shape[0] != dz.shape[0] or h.shape[1] != n_act * dz.shape[1]:
    raise ValueError(f"h.shape ({h.shape}) must be (dz.shape[0], n_act * dz.shape[1]) "
                     f"with dz.shape = {dz.shape} and n_act = len(activations) = {n_act}.")


class ActColumnwise(NamedTuple):
  """The columnwise FP8 copy of ``z = act(h)`` that ``dact_quantize`` can also
  write, for the wgrad GEMM of the layer after the activation: quantized
  exactly as the forward's ``act_quantize`` call quantized ``z`` (the same
  bytes), so that the forward need not keep it. Build it with
  :func:`act_columnwise_like`, which checks it.

  Attributes:
    mode: that call's mode; the same as the ``dact_quantize`` call's (one
      kernel, one tile layout).
    dtype: its FP8 dtype.
    scale: its float32 scale ("tensorwise"), else None.
    amax: the amax it returned, a float32 scalar (per-tensor modes:
      "current" derives the scale from it as that call did, "tensorwise"
      gives a NaN scale_inv where it is not finite); None for "blockwise",
      whose 128x1 tile scales come from the same values again.
    power_2_scale: its power_2_scale ("blockwise").
  """

  mode: str
  dtype: Any
  scale: Optional[jax.Array] = None
  amax: Optional[jax.Array] = None
  power_2_scale: bool = False


def act_columnwise_like(*, amax, mode: str, dtype, scale=None, power_2_scale: bool = False,
                        impl: str = "auto") -> ActColumnwise:
  """The :class:`ActColumnwise` of an ``act_quantize`` call with these options
  that returned ``amax`` (its ``QuantizedTensor.amax``). It takes the options
  as ``act_quantize`` does, so that ``ScalingMode.quantize_fused(
  act_columnwise_like, "x", state, amax=...)`` names the quantization a
  recipe gave the forward's ``z``; ``impl`` comes with that call and is not
  used (this says how ``z`` is quantized, not where)."""
  del impl
  return _check_act_columnwise(ActColumnwise(mode, dtype, scale, amax, power_2_scale), mode)


def _check_act_columnwise(spec, mode: str) -> ActColumnwise:
  if not isinstance(spec, ActColumnwise):
    raise TypeError(f"act_columnwise must be an ActColumnwise (act_columnwise_like), got "
                    f"{type(spec).__name__}.")
  if spec.mode != mode:
    raise ValueError(f"act_columnwise.mode ({spec.mode!r}) must be the dact_quantize call's "
                     f"mode ({mode!r}).")
  try:
    dtype, scale = quantize_op.check_mode_args(spec.mode, spec.dtype, spec.scale,
                                               spec.power_2_scale)
    if spec.amax is None and mode != "blockwise":
      raise ValueError(f"amax (the forward's max|act(h)|) is needed for mode={mode!r}.")
    amax = copies.check_given_amax(mode, spec.amax)
  except (TypeError, ValueError) as e:
    raise type(e)(f"act_columnwise: {e}") from None
  return ActColumnwise(mode, dtype, scale, amax, bool(spec.power_2_scale))


# ------------------------------------------------------------- references ---

def activation_forward(h: jax.Array, activations: Sequence[str]) -> jax.Array:
  """``act0(h0)`` or ``act0(h0) * act1(h1)`` in float32.

  Args:
    h: (M, n_act*F) float32/bfloat16/float16; h0 = h[:, :F], h1 = h[:, F:].
    activations: tuple of one or two names from ``ACTIVATION_NAMES``.

  Returns:
    (M, F) float32.
  """
  acts = _check_activations(activations)
  f = _check_h(h, len(acts))
  hf = h.astype(_F32)
  f0, _ = ACTIVATIONS[acts[0]].fwd_bwd(hf[:, :f])
  if len(acts) == 1:
    return f0
  f1, _ = ACTIVATIONS[acts[1]].fwd_bwd(hf[:, f:])
  return f0 * f1


def activation_backward(dz: jax.Array, h: jax.Array,
                        activations: Sequence[str]) -> jax.Array:
  """Gradient of ``activation_forward`` w.r.t. h, in float32.

  Args:
    dz: (M, F) gradient of the activation output.
    h: (M, n_act*F) the activation input.
    activations: tuple of one or two names from ``ACTIVATION_NAMES``.

  Returns:
    (M, n_act*F) float32: ``dz * act0'(h0)`` (one activation) or
    ``[(dz * act0'(h0)) * act1(h1), (dz * act0(h0)) * act1'(h1)]``
    concatenated on the last dim (gated; this association is the spec).
  """
  acts = _check_activations(activations)
  _check_dz(dz, h, len(acts))
  f = dz.shape[1]
  hf, dzf = h.astype(_F32), dz.astype(_F32)
  f0, d0 = ACTIVATIONS[acts[0]].fwd_bwd(hf[:, :f])
  if len(acts) == 1:
    return dzf * d0
  f1, d1 = ACTIVATIONS[acts[1]].fwd_bwd(hf[:, f:])
  return jnp.concatenate([(dzf * d0) * f1, (dzf * f0) * d1], axis=1)


def act_quantize_reference(h: jax.Array, activations: Sequence[str], *, mode: str,
                           dtype, scale=None, power_2_scale: bool = False,
                           rowwise: bool = True, columnwise: bool = True, h_copy: bool = False
                           ) -> Union[QuantizedTensor, Tuple[QuantizedTensor, ScaledTensor]]:
  """Pure-JAX ``act_quantize``: quantizes ``activation_forward(h, activations)``
  (and with ``h_copy`` h itself, in the H_COPY_* format)."""
  acts = _check_activations(activations)
  _check_h(h, len(acts))
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  copies.check_outputs(rowwise, columnwise)
  q = copies.quantize_selected_reference(activation_forward(h, acts), mode, dtype, scale,
                                         power_2_scale, rowwise=rowwise, columnwise=columnwise)
  if not _check_h_copy(h_copy):
    return q
  return q, quantize_op.quantize_blockwise_reference(h, H_COPY_BLOCK, H_COPY_DTYPE,
                                                     H_COPY_POWER_2_SCALE).rowwise()


def dact_quantize_reference(dz: jax.Array, h: jax.Array, activations: Sequence[str], *,
                            mode: str, dtype, scale=None, power_2_scale: bool = False,
                            act_columnwise: Optional[ActColumnwise] = None
                            ) -> Union[QuantizedTensor, Tuple[QuantizedTensor, ScaledTensor]]:
  """Pure-JAX ``dact_quantize``: quantizes ``activation_backward(dz, h,
  activations)``, and with ``act_columnwise`` ``activation_forward(h,
  activations)`` as it says, columnwise; an FP8 ``h`` dequantized to dz's dtype."""
  acts = _check_activations(activations)
  fp8_h = _check_fp8_h(h)
  _check_dz(dz, h, len(acts))
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  h = h.dequantize(dz.dtype) if fp8_h else h
  q = quantize_op.quantize_by_mode_reference(
      activation_backward(dz, h, acts), mode, dtype, scale, power_2_scale)
  if act_columnwise is None:
    return q
  spec = _check_act_columnwise(act_columnwise, mode)
  return q, copies.quantize_selected_reference(
      activation_forward(h, acts), spec.mode, spec.dtype, spec.scale, spec.power_2_scale,
      amax=spec.amax, rowwise=False).columnwise()


# ------------------------------------------------------------ dispatchers ---

def join_columnwise(parts: Sequence[ScaledTensor], impl: str = "auto") -> ScaledTensor:
  """One columnwise operand (F, M) from those of row chunks (F, rows_i) of a
  tensor quantized chunk by chunk (``dact_quantize(..., act_columnwise=...)``
  on row chunks): the same values as the whole tensor's.

  Args:
    parts: ``ScaledTensor``s (F, rows_i) in row order, quantized with one
      per-tensor scale (their scale_inv, all equal: the first is taken), or
      blockwise in tiles of 128 rows (rows_i multiples of 128 but the last;
      their scale grids are joined).
    impl: "auto", "cuda" or "reference".

  Returns:
    A ``ScaledTensor`` (F, sum rows_i). CUDA concatenates the kernels'
    buffers; the reference joins the chunks as rows (M, F) and transposes,
    the form of the whole tensor's ``data.T``, so that XLA:CPU lays out the
    wgrad operand and sums as for the whole tensor: the same bits.
  """
  first = parts[0]
  if len(parts) == 1:
    return first
  scale = (first.scale_inv if first.block_shape is None
           else jnp.concatenate([p.scale_inv for p in parts], axis=1))

  def cuda():
    return jnp.concatenate([p.data for p in parts], axis=1)

  def reference():
    return jnp.concatenate([p.data.T for p in parts], axis=0).T
  return ScaledTensor(_native.dispatch(impl, cuda, reference), scale, first.block_shape)


act_quantize_supported = act_quantize_cuda.supported   # the CUDA kernels' shapes


def _kernel_ids(acts):
  return tuple(ACTIVATIONS[a].kernel_id for a in acts)


def act_quantize(h: jax.Array, activations: Sequence[str], *, mode: str, dtype,
                 scale=None, power_2_scale: bool = False, impl: str = "auto",
                 rowwise: bool = True, columnwise: bool = True, h_copy: bool = False
                 ) -> Union[QuantizedTensor, Tuple[QuantizedTensor, ScaledTensor]]:
  """FP8 quantization of ``z = activation_forward(h, activations)`` in one pass.

  Args:
    h: (M, n_act*F) float32/bfloat16/float16, the (fused) up-projection output.
    activations: tuple of one or two names from ``ACTIVATION_NAMES``.
    mode: "tensorwise" (given ``scale``, delayed scaling), "current" (scale
      from max|z|) or "blockwise" (1x128 tiles, plus 128x1 tiles for the
      columnwise copy, as ``quantize_blockwise(z, (1, 128), columnwise=True)``).
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    scale: float32 scalar for "tensorwise"; None otherwise.
    power_2_scale: round the tile scales down to powers of two ("blockwise" only).
    impl: "auto", "cuda" or "reference" (see ``ops/_native.py``).
    rowwise, columnwise: which FP8 copies to write (at least one; a copy
      not asked for is never computed).
    h_copy: also write h's E4M3 copy (``store_act_input_in_fp8``) from the
      h this pass loads, instead of a ``quantize_blockwise`` pass over h.
      The CUDA path needs F % 128 == 0 and ``rowwise`` for it.

  Returns:
    A ``QuantizedTensor``: data (M, F) FP8 and data_t (F, M) the
    quantization of z.T. Per-tensor modes: scale_inv =
    scale_inv_t = 1/scale (float32 scalar), amax = max|z| (float32 scalar).
    "blockwise": scale_inv (M, ceil(F/128)), scale_inv_t (F, ceil(M/128))
    (the logical layout of ``quantize_blockwise``), amax None. A copy not
    asked for is None, with its scales (the per-tensor scale_inv stays).
    With ``h_copy`` the pair ``(that, quantize_blockwise(h, (1, 128),
    float8_e4m3fn, power_2_scale=True).rowwise())``: (M, n_act*F) E4M3.

  Raises:
    ValueError/TypeError for bad arguments; ValueError when the CUDA path is
    chosen and ``act_quantize_supported(M, F, n_act)`` is False.
  """
  acts = _check_activations(activations)
  f = _check_h(h, len(acts))
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  copies.check_outputs(rowwise, columnwise)
  h_copy = _check_h_copy(h_copy)

  def cuda():
    act_quantize_cuda.check_shape(h.shape[0], f, len(acts), h_copy=h_copy, rowwise=rowwise)
    return act_quantize_cuda.act_quantize(h, None, _kernel_ids(acts), mode, dtype, scale,
                                          power_2_scale, rowwise=rowwise, columnwise=columnwise,
                                          h_copy=h_copy)
  return _native.dispatch(impl, cuda, lambda: act_quantize_reference(
      h, acts, mode=mode, dtype=dtype, scale=scale, power_2_scale=power_2_scale,
      rowwise=rowwise, columnwise=columnwise, h_copy=h_copy))


def dact_quantize(dz: jax.Array, h: jax.Array, activations: Sequence[str], *, mode: str,
                  dtype, scale=None, power_2_scale: bool = False, impl: str = "auto",
                  act_columnwise: Optional[ActColumnwise] = None
                  ) -> Union[QuantizedTensor, Tuple[QuantizedTensor, ScaledTensor]]:
  """FP8 quantization of ``dh = activation_backward(dz, h, activations)`` in one pass.

  Args:
    dz: (M, F) float32/bfloat16/float16 gradient of the activation output.
    h: (M, n_act*F) the activation input saved from the forward pass: a
      float array, or its E4M3 copy: a ``ScaledTensor``, data (M, n_act*F),
      1x128 tiles, scale_inv float32 (M, ceil(n_act*F/128)), read as
      ``h.dequantize(dz.dtype)`` (the CUDA kernel reads the bytes and scales).
    activations, mode, dtype, scale, power_2_scale, impl: as ``act_quantize``.
    act_columnwise: None, or an :class:`ActColumnwise` (same ``mode``): the
      pass also writes the columnwise copy of ``z = activation_forward(h,
      activations)`` quantized as it says (the forward's ``act_quantize``
      call; the same bytes), from the activation values it computes anyway.

  Returns:
    As ``act_quantize`` with W = n_act*F columns: data (M, W), data_t (W,
    M); blockwise scale_inv (M, ceil(W/128)), scale_inv_t (W, ceil(M/128)).
    With ``act_columnwise`` the pair ``(that, z_t)``, ``z_t`` a
    ``ScaledTensor`` (F, M) (blockwise: scales (F, ceil(M/128)), the 128x1
    tiles of z), the operand ``act_quantize(h, ...).columnwise()`` was.
  """
  acts = _check_activations(activations)
  _check_fp8_h(h)
  _check_dz(dz, h, len(acts))
  dtype, scale = quantize_op.check_mode_args(mode, dtype, scale, power_2_scale)
  spec = None if act_columnwise is None else _check_act_columnwise(act_columnwise, mode)

  def cuda():
    act_quantize_cuda.check_shape(dz.shape[0], dz.shape[1], len(acts))
    return act_quantize_cuda.act_quantize(h, dz, _kernel_ids(acts), mode, dtype, scale,
                                          power_2_scale, act_columnwise=spec)
  return _native.dispatch(impl, cuda, lambda: dact_quantize_reference(
      dz, h, acts, mode=mode, dtype=dtype, scale=scale, power_2_scale=power_2_scale,
      act_columnwise=spec))
