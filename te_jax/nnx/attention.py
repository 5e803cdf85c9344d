"""``MultiHeadAttention`` as an NNX module: FP8 projections around the attention core.

The projections are :class:`te_jax.nnx.Linear` modules; which projections,
rotary embeddings, masks and the choice of attention implementation are
``te_jax.layers.attention``'s, the calls the Linen module makes, so the two
give the same numbers from the same parameters.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax import norm_dense
from te_jax.layers import attention as attn
from te_jax.layers import kv_cache
from te_jax.layers.checks import attention_options, check_add_residual, compute_dtype, to_tuple
from te_jax.layers.init import default_kernel_init
from te_jax.nnx.linear import Linear, zeros

__all__ = ["MultiHeadAttention"]

Dtype = Any
Initializer = Callable[..., jax.Array]
_ATTENTION_TYPES = ("self", "cross")

# NNX modules keep no key/value cache; the Linen twin decodes.
_NO_DECODE = ("decode with te_jax.flax.MultiHeadAttention(..., decode=True), same parameters "
              "and numbers, on the variables te_jax.nnx.linen_variables(model) gives "
              "(docs/nnx.md).")


def _one_of(name, value, alias, alias_value, required=True):
  """``value`` or ``alias_value`` (the same argument under its other name)."""
  if value is not None and alias_value is not None and value != alias_value:
    raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} name the same "
                     f"argument; give one.")
  value = value if value is not None else alias_value
  if value is None and required:
    raise TypeError(f"MultiHeadAttention needs {name} (or {alias}).")
  return value


def _names(metadata) -> bool:
  return bool(metadata) and any(metadata.get(k) is not None
                                for k in ("out_sharding", "sharding", "sharding_names"))


def _stacked(metadata, axes):
  """``metadata`` for a fused kernel of logical ``axes`` (``attn.QKVLayout``):
  names given for NNX's (in, heads, head_dim) kernels get "qkv" (unsharded)
  for the stacking dim of an (in, n, heads, head_dim) kernel, and
  grouped-query attention's joined (in, heads + 2 groups, head_dim) kernel
  keeps its joined dim unsharded ("qkv_heads")."""
  if not _names(metadata):
    return metadata
  out = dict(metadata)
  for key in ("out_sharding", "sharding", "sharding_names"):
    names = out.get(key)
    if names is not None and len(names) == len(axes) - 1:
      out[key] = (names[0], "qkv") + tuple(names[1:])
    elif names is not None and "qkv_heads" in axes and len(names) == len(axes):
      if names[1] is not None:
        warnings.warn(
            f"te_jax.nnx.MultiHeadAttention: the grouped-query Q/K/V kernel joins the query, "
            f"key and value heads in one dim, which is not sharded; the name {names[1]!r} "
            f"given for it in kernel_metadata is not used. Pass fuse_qkv=False to shard "
            f"heads (separate query and key/value kernels).", UserWarning, stacklevel=4)
      out[key] = (names[0], "qkv_heads") + tuple(names[2:])
  return out


def _mask_type(attn_mask_type: str, is_causal: Optional[bool]) -> str:
  """The mask type of one call: the module's, or what ``is_causal`` says."""
  if is_causal is None:
    return attn_mask_type
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be None, True or False, got {is_causal!r}.")
  return "causal" if is_causal else "no_mask"


class MultiHeadAttention(nnx.Module):
  """Multi-head (optionally grouped-query) self or cross attention with FP8 projections.

  ``te_jax.flax.MultiHeadAttention`` as an NNX module. Shapes: ``inputs_q``
  (B, Sq, in_features); ``inputs_kv`` (B, Skv, kv_features) for cross
  attention (None for self attention); output (B, Sq, out_features).

  Submodules (``te_jax.nnx.Linear``, parameters ``kernel``/``bias``/FP8 state
  ``fp8_meta`` as in the Linen module): self attention with ``fuse_qkv``:
  ``qkv`` (in_features, 3, heads, head_dim), or with grouped-query attention
  (in_features, heads + 2 * groups, head_dim) (the Linen module's layout);
  otherwise ``query`` (in_features, heads, head_dim) and ``kv``
  (kv_features, 2, groups, head_dim); ``out`` (heads, head_dim,
  out_features).

  Args:
    num_heads: number of query heads (``flax.nnx.MultiHeadAttention``'s name;
      ``num_attention_heads``, the Linen module's, is accepted too).
    in_features: width E of ``inputs_q``.
    attention_type: "self" (default) or "cross" (keys/values from ``inputs_kv``).
    kv_features: width of ``inputs_kv`` (cross attention; default in_features).
    head_dim: default ``in_features // num_heads``.
    num_gqa_groups: key/value heads (divides the query heads; default all);
      ``num_kv_heads`` (NNX's name) is accepted too.
    attn_mask_type: "causal" (default) or "no_mask": the masking when the
      call does not say (its ``is_causal``). Note that ``nnx.MultiHeadAttention``
      masks nothing unless told: a port of a non-causal model passes
      ``attn_mask_type="no_mask"``.
    attention_dropout: dropout on the probabilities (the "dropout" stream of
      ``rngs``; off in ``model.eval()`` mode or with ``deterministic=True``).
    enable_rotary_pos_emb, rotary_base, fuse_qkv, use_bias, attention_impl,
    max_segments_per_seq, max_document_length, dtype, param_dtype,
      kernel_init, bias_init, impl: as the Linen module (``use_bias``
      defaults to False there and here, to True in ``nnx.MultiHeadAttention``).
    kernel_metadata, out_kernel_metadata: metadata of the query/key/value
      kernels and of the output kernel, as ``nnx.MultiHeadAttention``'s; names
      given for NNX's (in_features, heads, head_dim) kernels (``"out_sharding"``)
      serve the fused (in_features, 3, heads, head_dim) ones with the stacking
      dim unsharded.
    out_features: output width (default in_features).
    deterministic: default of the call argument.
    decode: must be False (also in the call): NNX modules keep no key/value
      cache; True raises a ValueError naming the Linen module, which decodes.
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, num_heads: Optional[int] = None, in_features: Optional[int] = None, *,
               num_attention_heads: Optional[int] = None,
               attention_type: str = "self", kv_features: Optional[int] = None,
               head_dim: Optional[int] = None, num_gqa_groups: Optional[int] = None,
               num_kv_heads: Optional[int] = None,
               attn_mask_type: str = "causal", attention_dropout: float = 0.0,
               enable_rotary_pos_emb: bool = False, rotary_base: float = 10000.0,
               fuse_qkv: bool = True, use_bias: bool = False,
               out_features: Optional[int] = None, attention_impl: str = "auto",
               max_segments_per_seq: int = 8, max_document_length: Optional[int] = None,
               dtype: Optional[Dtype] = None, param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = zeros,
               deterministic: bool = False, impl: str = "auto", decode: bool = False,
               kernel_metadata: Mapping[str, Any] = None,
               out_kernel_metadata: Mapping[str, Any] = None, rngs: nnx.Rngs):
    kv_cache.refuse_decode(decode, "te_jax.nnx.MultiHeadAttention", _NO_DECODE)
    num_heads = _one_of("num_heads", num_heads, "num_attention_heads", num_attention_heads)
    num_gqa_groups = _one_of("num_gqa_groups", num_gqa_groups, "num_kv_heads", num_kv_heads,
                             required=False)
    if in_features is None:
      raise TypeError("MultiHeadAttention needs in_features (the width of inputs_q).")
    h, groups, head_dim, out_features, attention_dropout = attention_options(
        num_heads, num_gqa_groups, head_dim, out_features, attention_dropout)
    (e,) = to_tuple("in_features", in_features)
    if attention_type not in _ATTENTION_TYPES:
      raise ValueError(f"attention_type must be one of {_ATTENTION_TYPES}, got "
                       f"{attention_type!r}.")
    if kv_features is not None and attention_type == "self":
      raise ValueError("kv_features is for attention_type='cross'; self attention takes "
                       "its keys and values from inputs_q.")
    attn.check_attention_options(attn_mask_type, attention_impl, max_segments_per_seq,
                                 max_document_length)
    h, g, d = attn.head_layout(e, h, groups, head_dim)
    ekv = e if kv_features is None else to_tuple("kv_features", kv_features)[0]
    self.num_heads = self.num_attention_heads = h
    self.num_gqa_groups, self.head_dim = g, d
    self.in_features, self.kv_features, self.attention_type = e, ekv, attention_type
    self.out_features = e if out_features is None else out_features
    self.attn_mask_type, self.attention_impl = attn_mask_type, attention_impl
    self.max_segments_per_seq = int(max_segments_per_seq)
    self.max_document_length = max_document_length
    self.attention_dropout = float(attention_dropout)
    self.enable_rotary_pos_emb, self.rotary_base = bool(enable_rotary_pos_emb), rotary_base
    self.dtype, self.param_dtype, self.impl = dtype, param_dtype, impl
    self.deterministic = deterministic

    def dense(i, o, axes, axis=-1, split=False, metadata=None):
      return Linear(i, o, axis=axis, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=kernel_init, bias_init=bias_init,
                    kernel_axes=() if _names(metadata) else axes,
                    kernel_metadata=_stacked(metadata, axes) if split else metadata,
                    split_output=split, impl=impl, rngs=rngs)

    self.fused_qkv = attn.fuses_qkv(attention_type == "self", bool(fuse_qkv))
    if self.fused_qkv:
      layout = attn.fused_qkv_layout(h, g, d)
      self.qkv = dense(e, layout.features, layout.axes, split=layout.split,
                       metadata=kernel_metadata)
    else:
      self.query = dense(e, (h, d), ("embed", "heads", "kv"), metadata=kernel_metadata)
      self.kv = dense(ekv, (2, g, d), ("embed", "qkv", "heads", "kv"), split=True,
                      metadata=kernel_metadata)
    self.out = dense((h, d), self.out_features, ("heads", "kv", "embed"), axis=(-2, -1),
                     metadata=out_kernel_metadata)
    self.rngs = rngs["dropout"].fork() if self.attention_dropout > 0.0 else None

  def __call__(self, inputs_q: jax.Array, inputs_kv: Optional[jax.Array] = None, *,
               segment_ids: Optional[jax.Array] = None,
               kv_segment_ids: Optional[jax.Array] = None,
               segment_positions: Optional[jax.Array] = None,
               kv_segment_positions: Optional[jax.Array] = None,
               mask: Optional[jax.Array] = None,
               deterministic: Optional[bool] = None,
               input_norm: Optional[norm_dense.NormParams] = None,
               is_causal: Optional[bool] = None,
               decode: Optional[bool] = None, add_residual: bool = False) -> jax.Array:
    """Attends from ``inputs_q`` to ``inputs_kv`` (cross) or to itself (self).

    Arguments as ``te_jax.flax.MultiHeadAttention.__call__`` (``input_norm``:
    a pre-norm of ``inputs_q`` fused into the projections' FP8 input
    quantization, e.g. ``LayerNorm.norm_params()``); ``deterministic``
    defaults to the module attribute. ``mask`` (True = attend, broadcastable
    to (B, heads, Sq, Skv)) and ``is_causal`` as in
    ``nnx.MultiHeadAttention``: ``is_causal`` overrides the module's
    ``attn_mask_type`` for this call (None: the module's); ``add_residual``
    returns ``inputs_q + attention`` (as the Linen module's). Returns (B, Sq,
    out_features) in the compute dtype.
    """
    kv_cache.refuse_decode(decode, "te_jax.nnx.MultiHeadAttention", _NO_DECODE)
    self_attn = self.attention_type == "self"
    attn.check_input_3d("inputs_q", inputs_q)
    if self_attn and inputs_kv is not None:
      raise ValueError("inputs_kv given to a self-attention module: construct it with "
                       "attention_type='cross' (and kv_features=...).")
    if not self_attn:
      if inputs_kv is None:
        raise ValueError("cross attention needs inputs_kv (B, Skv, kv_features).")
      attn.check_input_3d("inputs_kv", inputs_kv)
      if inputs_kv.shape[-1] != self.kv_features:
        raise ValueError(f"inputs_kv's last dim ({inputs_kv.shape[-1]}) must equal "
                         f"kv_features ({self.kv_features}).")
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"inputs_q's last dim ({inputs_q.shape[-1]}) must equal "
                       f"in_features ({self.in_features}).")
    inputs_kv, kv_segment_ids, kv_segment_positions = attn.resolve_segments(
        inputs_q, inputs_kv, segment_ids, segment_positions,
        kv_segment_ids, kv_segment_positions)
    compute = compute_dtype(self.dtype, inputs_q.dtype, self.param_dtype)
    if add_residual:
      check_add_residual("nnx.MultiHeadAttention", inputs_q, compute, self.out_features)
    if self.fused_qkv:
      attn.warn_if_heads_split(self.num_heads, self.num_gqa_groups)
      proj = dict(qkv=self.qkv)
    else:   # the Linen module's kv projection computes in its dtype=compute
      proj = dict(query=self.query, kv=lambda x: self.kv(x.astype(compute)))
    q, k, v, *residual = attn.project_qkv(   # (the Linen module's note on the residual)
        inputs_q, inputs_kv, self_attn=self_attn, input_norm=input_norm,
        return_input=add_residual, **proj)
    deterministic = self.deterministic if deterministic is None else deterministic
    dropout = self.attention_dropout > 0.0 and not deterministic
    out = attn.attention(
        q, k, v, mask=mask, attention_impl=self.attention_impl,
        dropout_rate=self.attention_dropout if dropout else 0.0,
        dropout_rng=self.rngs() if dropout else None, self_attn=self_attn,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        segment_positions=segment_positions, kv_segment_positions=kv_segment_positions,
        attn_mask_type=_mask_type(self.attn_mask_type, is_causal),
        enable_rotary_pos_emb=self.enable_rotary_pos_emb,
        rotary_base=self.rotary_base, max_segments_per_seq=self.max_segments_per_seq,
        max_document_length=self.max_document_length)
    return self.out(out.astype(compute), residual=residual[0] if residual else None)
