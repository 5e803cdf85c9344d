"""The projection blocks: a dense over any input axes, and a norm then a dense.

:func:`project` is ``DenseGeneral`` / ``nnx.Linear``: the contracting axes
moved last, one :func:`~te_jax.layers.gemm.gemm`. :func:`norm_dense` is
``LayerNormDenseGeneral`` / ``nnx.LayerNormLinear`` and a projection's
``input_norm``: in FP8, unsharded, with tokens a multiple of the recipe's
``token_block`` and embed a multiple of 128 (up to
``te_jax.norm_dense.MAX_HIDDEN``), the norm is fused into the quantization
of the GEMM's input and its backward is one kernel
(``te_jax.norm_dense.fp8_norm_dense``); otherwise the norm runs on its own
(:func:`te_jax.layers.norm.module_norm`) and its output is projected. A
split output (Q/K/V) takes the same two paths.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import norm_dense as norm_dense_lib
from te_jax.layers.gemm import (FP8_META, SplitOutput, block_shape, block_size, gemm,
                                gemm_kernel, output_blocks)
from te_jax.layers.norm import fused_norm_states, module_norm
from te_jax.layers.settings import Settings
from te_jax.layers.state import GemmStates

__all__ = ["project", "norm_dense", "norm_project", "check_call_options"]


def check_call_options(input_norm, split_output, *, residual=None,
                       return_norm_output: bool = False, return_input: bool = False) -> None:
  """A projection call's options (DenseGeneral, nnx.Linear): the outputs of
  an ``input_norm`` (``return_norm_output``, ``return_input``) need one, and
  a ``residual`` is an array not combined with an ``input_norm`` or a
  ``split_output`` (ValueError / TypeError naming the argument)."""
  if input_norm is None:
    for name, flag in (("return_norm_output", return_norm_output),
                       ("return_input", return_input)):
      if flag:
        raise ValueError(f"{name}=True returns what the input_norm gives: it needs an "
                         "input_norm.")
  if residual is None:
    return
  if input_norm is not None or split_output is not False:
    raise ValueError("residual is added to one projected output: it cannot be combined "
                     f"with {'input_norm' if input_norm is not None else 'split_output'}. "
                     "Add it after the call instead.")
  if not isinstance(residual, jax.Array):
    raise TypeError(f"residual must be a jax.Array, got {type(residual).__name__}.")


def project(states: GemmStates, settings: Settings, x: jax.Array, kernel: jax.Array,
            bias: Optional[jax.Array], *, axis: Tuple[int, ...], dtype,
            kernel_axes: Optional[Sequence[Optional[str]]] = None,
            split_output: SplitOutput = False, name: str = FP8_META,
            residual: Optional[jax.Array] = None):
  """``x`` contracted over its ``axis`` dims with ``kernel`` (*in_dims,
  *out_dims), plus ``bias`` (*out_dims): (..., *out_dims) in ``dtype``, the
  non-contracted axes in their order in front (a tuple of blocks with
  ``split_output``, as :func:`~te_jax.layers.gemm.gemm` splits it).

  ``axis``: canonical (non-negative) axes, in the order of the kernel's
  in_dims; ``kernel`` in its parameter dtype, ``bias`` in any; ``residual``
  (..., *out_dims) added to the output (the GEMM's C input in FP8 where it
  can be: :func:`~te_jax.layers.gemm.gemm`).
  """
  batch_axes = tuple(a for a in range(x.ndim) if a not in axis)
  if batch_axes + axis != tuple(range(x.ndim)):
    x = jnp.transpose(x, batch_axes + axis)
  return gemm(states, settings, x.astype(dtype), kernel,
              None if bias is None else bias.astype(dtype), name=name,
              contract_ndim=len(axis), kernel_axes=kernel_axes, split_output=split_output,
              residual=None if residual is None else residual.astype(dtype))


def norm_dense(states: GemmStates, settings: Settings, x: jax.Array,
               norm: norm_dense_lib.NormParams, kernel: jax.Array, bias: Optional[jax.Array],
               *, dtype, owner: str, kernel_axes: Optional[Sequence[Optional[str]]] = None,
               fuse_norm_quantize: bool = True, return_norm_output: bool = False,
               split_output: SplitOutput = False, return_input: bool = False):
  """``norm(x) @ kernel + bias``: the norm over the last axis, fused into the
  FP8 quantization of the GEMM input where it can be (see the module docs).

  Args:
    states, settings: the module's FP8 state and autocast settings.
    x: (..., embed) input.
    norm: the norm's parameters and options.
    kernel: (embed, *features) in its parameter dtype; ``bias`` (*features,)
      or None.
    dtype: the compute dtype (output, and the norm output).
    owner: the module as the log lines name it (e.g. "nnx.LayerNormLinear").
    kernel_axes: the kernel's logical axis names.
    fuse_norm_quantize: False keeps the norm in XLA, unfused (to compare).
    return_norm_output: also return the normalized x (..., embed) in ``dtype``.
    split_output: a tuple of blocks of the first feature dim: True unstacks
      it ((..., *features[1:]) each), block sizes split it ((..., size,
      *features[1:]) each).
    return_input: also return x, passed through the fused norm's op where
      it is taken (``te_jax.norm_dense.fp8_norm_dense``'s ``return_input``:
      the norm's backward then adds the cotangent of that x), else x itself.

  Returns:
    (..., *features) (or the tuple), and with ``return_norm_output`` the pair
    (output, normalized x); with ``return_input`` x follows last.
  """
  bias = None if bias is None else bias.astype(dtype)
  found = fused_norm_states(states, settings, x, (FP8_META,)) if fuse_norm_quantize else None
  if found is not None:
    if found[0] is not None:
      states.track_updates(kernel)
    return norm_project(x, norm, kernel, bias, settings, dtype, found[0],
                        features=kernel.shape[1:], return_norm_output=return_norm_output,
                        split_output=split_output, return_input=return_input)
  ln_out = module_norm(owner, settings, x, norm, dtype, kernels=fuse_norm_quantize)
  y = gemm(states, settings, ln_out, kernel, bias, kernel_axes=kernel_axes,
           split_output=split_output)
  return norm_dense_lib.optional_outputs(y, ln_out if return_norm_output else None,
                                         x if return_input else None)


def norm_project(x, norm: norm_dense_lib.NormParams, kernel, bias, settings: Settings, dtype,
                 state, *, features, return_norm_output: bool,
                 split_output: SplitOutput = False, return_input: bool = False):
  """``te_jax.norm_dense.fp8_norm_dense`` on the 2-D views of a module's input
  x (..., embed), kernel (embed, *features) in its parameter dtype and bias
  (*features,) or None, in the module's shapes: (..., *features), or the
  blocks of ``split_output`` (as :func:`~te_jax.layers.gemm.gemm` splits),
  and with ``return_norm_output`` also the normalized x in ``dtype``, with
  ``return_input`` x passed through last."""
  embed, lead = x.shape[-1], x.shape[:-1]
  blocks = output_blocks(split_output, tuple(features))
  rest = math.prod(features[1:])
  sizes = tuple(block_size(b) * rest for b in blocks)
  out = norm_dense_lib.fp8_norm_dense(
      x.reshape(-1, embed), norm.gamma, norm.beta,
      gemm_kernel(settings, kernel, dtype).reshape(embed, -1),
      None if bias is None else bias.astype(dtype).reshape(-1),
      norm_type=norm.norm_type, epsilon=norm.epsilon,
      zero_centered_gamma=norm.zero_centered_gamma, recipe=settings.recipe,
      fp8_state=state, impl=settings.impl, return_norm_output=return_norm_output,
      dtype=dtype, split_sizes=sizes if len(sizes) > 1 else None,
      return_input=return_input, **settings.residual_plan())
  y, ln_out, passed = norm_dense_lib.split_optional_outputs(out, return_norm_output,
                                                            return_input)
  if len(sizes) > 1:
    y = tuple(p.reshape(lead + block_shape(b, features)) for p, b in zip(y, blocks))
  elif blocks:   # one block: the output as it is, in a tuple
    y = (y.reshape(lead + block_shape(blocks[0], features)),)
  else:
    y = y.reshape(lead + tuple(features))
  return norm_dense_lib.optional_outputs(
      y, ln_out.reshape(x.shape) if return_norm_output else None, passed)
