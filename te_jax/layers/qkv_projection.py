"""The Q/K/V projections of ``MultiHeadAttention`` (Linen and NNX).

Self attention with ``fuse_qkv`` (the default) projects Q, K and V with one
fused kernel, split into three outputs, so that in FP8 their gradients are
quantized without a concatenation (with grouped-query attention the query
block is wider than the key and value blocks); otherwise (cross attention,
``fuse_qkv=False``) a query projection and a fused key/value one. A pre-norm
of the queries (``input_norm``) goes into the projection that reads them,
fused into its FP8 input quantization where it can be; unfused self
attention's query projection hands its normalized input on to the
key/value projection. ``te_jax.layers.attention`` re-exports these names.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple, Optional, Tuple, Union

from te_jax import sharding as sharding_lib
from te_jax.layers.settings import read_settings

__all__ = ["head_layout", "fuses_qkv", "QKVLayout", "fused_qkv_layout", "warn_if_heads_split",
           "project_qkv"]


def head_layout(width: int, heads: int, groups: Optional[int] = None,
                head_dim: Optional[int] = None) -> Tuple[int, int, int]:
  """(heads, key/value groups, head_dim) of an attention over inputs of
  ``width``: ``groups`` default ``heads``, ``head_dim`` default
  ``width // heads``; ValueError when ``groups`` does not divide ``heads`` or,
  without ``head_dim``, ``heads`` does not divide ``width``."""
  g = groups or heads
  if heads % g:
    raise ValueError(f"num_gqa_groups ({g}) must divide num_attention_heads ({heads}).")
  if not head_dim and width % heads:
    raise ValueError(f"width {width} is not divisible by {heads} heads; set head_dim.")
  return heads, g, head_dim or width // heads


def fuses_qkv(self_attn: bool, fuse_qkv: bool) -> bool:
  """Whether Q, K and V come from one fused projection (see the module docs;
  with any number of key/value heads: :func:`fused_qkv_layout`)."""
  return self_attn and fuse_qkv


class QKVLayout(NamedTuple):
  """The fused Q/K/V projection's kernel: (E, *features) with logical
  ``axes`` (E's first), its output split as ``split`` (a module's
  ``split_output``)."""
  features: Tuple[int, ...]
  axes: Tuple[str, ...]
  split: Union[bool, Tuple[int, ...]]


def fused_qkv_layout(heads: int, groups: int, head_dim: int) -> QKVLayout:
  """The fused projection's kernel for ``heads`` query heads and ``groups``
  key/value heads (see the module docs).

  Multi-head attention: (E, 3, heads, head_dim), the stacking dim unstacked.
  Grouped-query attention: (E, heads + 2 * groups, head_dim), the query
  heads, then the keys', then the values' along one dim, split in blocks
  (heads, groups, groups): each block a contiguous column block of the 2-D
  kernel, so each comes out of its own GEMM and the FP8 path quantizes the
  projection's input once (the unfused pair normalizes and quantizes it
  twice and keeps a 16-bit copy for the key/value backward). That joined
  dim ("qkv_heads") is replicated under the logical axis rules: a
  contiguous split of it over tensor-parallel devices would not give each
  its own heads, so tensor parallelism over heads takes ``fuse_qkv=False``.
  """
  if groups == heads:
    return QKVLayout((3, heads, head_dim), ("embed", "qkv", "heads", "kv"), True)
  return QKVLayout((heads + 2 * groups, head_dim), ("embed", "qkv_heads", "kv"),
                   (heads, groups, groups))


@functools.lru_cache(maxsize=None)
def _warn_joined_heads(tp_axes):
  warnings.warn(
      f"te_jax MultiHeadAttention: tensor parallelism over {tp_axes!r} splits heads, but the "
      "grouped-query Q/K/V projection fused in one kernel (fuse_qkv=True) keeps its joined "
      "head dim unsharded: every device computes every head's Q, K and V. Pass "
      "fuse_qkv=False to shard them (separate query and key/value kernels).",
      UserWarning, stacklevel=3)


def warn_if_heads_split(heads: int, groups: int) -> None:
  """Warns once when a grouped-query fused Q/K/V kernel (see
  :func:`fused_qkv_layout`) runs where the autocast's mesh resource has
  tensor-parallel axes of size > 1 in the active mesh."""
  if groups == heads:
    return
  mesh_resource, mesh = read_settings().mesh_resource, sharding_lib.get_mesh()
  tp = None if mesh_resource is None else mesh_resource.tp_resource
  if tp is not None and mesh is not None and sharding_lib.mesh_axis_size(mesh, tp) > 1:
    _warn_joined_heads(tp)


def project_qkv(inputs_q, inputs_kv, *, self_attn: bool, input_norm=None,
                qkv: Optional[Callable] = None, query: Optional[Callable] = None,
                kv: Optional[Callable] = None, return_input: bool = False):
  """``(q, k, v)`` from the module's projections (see the module docs).

  Args:
    inputs_q: (B, Sq, E) queries' input; ``inputs_kv`` (B, Skv, E_kv) the
      keys' and values' (``inputs_q`` for self attention).
    self_attn: keys and values come from ``inputs_q``.
    input_norm: a ``te_jax.norm_dense.NormParams`` pre-norm of ``inputs_q``,
      or None.
    qkv: the fused projection ``qkv(x, **norm) -> (q, k, v)``; or else
    query: ``query(x, **norm) -> q`` (``return_norm_output=True`` also
      returns the normalized x) and
    kv: ``kv(x) -> (k, v)``.
    return_input: also return the residual of a connection around the
      attention: ``inputs_q`` as passed through the projection's norm where
      there is an ``input_norm`` (the projection's ``return_input``: the
      norm's backward then adds its cotangent), else ``inputs_q`` itself.

  Returns:
    q (B, Sq, heads, head_dim) and k, v (B, Skv, groups, head_dim); with
    ``return_input`` also that residual (B, Sq, E).
  """
  norm_kw = {} if input_norm is None else {"input_norm": input_norm}
  through_norm = return_input and input_norm is not None
  if through_norm:
    norm_kw["return_input"] = True
  itself = (inputs_q,) if return_input and not through_norm else ()
  if qkv is not None:
    out = qkv(inputs_q, **norm_kw)
    return (*out[0], out[1]) if through_norm else (*out, *itself)
  passed = ()
  if input_norm is not None and self_attn:   # K and V read the query's norm output
    q, inputs_kv, *passed = query(inputs_q, return_norm_output=True, **norm_kw)
  else:
    out = query(inputs_q, **norm_kw)
    q, passed = (out[0], out[1:]) if through_norm else (out, ())
  k, v = kv(inputs_kv)
  return (q, k, v, *passed, *itself)
