"""The GPT of the examples (Linen), its presets, and its FLOP accounting.

``GPT``: token embedding, ``te_jax.flax.TransformerLayer`` blocks (GPT or
Llama style, dense or with a mixture of experts in place of each MLP:
``moe_config``), final norm, LM head. ``PRESETS`` / ``LLAMA_PRESETS``: model
sizes and training defaults by name (defined in ``gpt_presets.py``, which
imports no jax). ``model_flops_per_token`` and
``peak_flops``: what the model FLOP utilisation printed by ``train_gpt.py``
is computed from.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax import flax as tfx
from te_jax import moe as moe_lib

# The presets live in a jax-free module (train_gpt.py --help reads them
# before jax loads); their names are re-exported here.
from gpt_presets import (ALL_PRESETS, ARCHS, GPU_PRESETS,  # pylint: disable=unused-import
                         LLAMA_PRESETS, MOE_PRESETS, PRESETS, RECIPES)

# The balancing of the MoE presets (DeepSeek-V3's): the router bias moves by
# this rate after each step towards even expert loads, and a small
# load-balancing loss joins the training loss.
ROUTER_BIAS_RATE = 1e-3
LOAD_BALANCING_COEF = 1e-3


def moe_config(cfg) -> Optional[moe_lib.MoEConfig]:
  """The ``te_jax.moe.MoEConfig`` of a resolved train_gpt ``Config`` (None
  for a dense model, ``cfg.experts`` 0): sigmoid scores, normalized top-k
  weights, bias-based balancing and a small load-balancing loss, dropless
  unless ``cfg.capacity_factor``."""
  if not cfg.experts:
    return None
  return moe_lib.MoEConfig(
      num_experts=cfg.experts, num_experts_per_token=cfg.experts_per_token,
      score_function="sigmoid", normalize_topk_weights=True,
      capacity_factor=cfg.capacity_factor, load_balancing_coef=LOAD_BALANCING_COEF,
      shared_intermediate_dim=cfg.shared_mlp or None,
      router_bias_update_rate=ROUTER_BIAS_RATE)


class GPT(nn.Module):
  """Decoder-only transformer: embedding, TransformerLayers, norm, LM head.

  The GEMMs of the transformer layers run in FP8 under ``fp8_autocast``; the
  embedding and the (small) LM head stay in higher precision, as is usual.
  """

  vocab_size: int
  hidden: int
  layers: int
  heads: int
  mlp: int
  dtype: Any = jnp.bfloat16
  remat: bool = False
  # "gpt": LayerNorm, GELU MLP. "llama": RMSNorm, SwiGLU MLP (silu(x W1) * x W2)
  # and no LM-head bias. Both: rotary positions, no biases in the layers.
  arch: str = "gpt"
  kv_groups: Optional[int] = None      # key/value heads; None: one per head (MHA)
  # One Q/K/V kernel per layer (TransformerLayer's fuse_qkv); False: query and
  # key/value kernels, which tensor parallelism over heads needs with kv_groups.
  fuse_qkv: bool = True
  # KV-cache decoding (gpt_sampling.py): segment_ids and positions must be None.
  decode: bool = False
  # The longest document of the packed rows, or None: self attention then
  # computes only a causal band that wide (TransformerLayer's
  # max_document_length; exact, with a device-side fallback). Not used when
  # decoding (no segments).
  max_document_length: Optional[int] = None
  # A mixture of experts in place of each MLP (``moe_config``), each expert
  # ``mlp`` wide; None: dense MLPs.
  moe: Optional[moe_lib.MoEConfig] = None

  @nn.compact
  def __call__(self, tokens, segment_ids, positions):
    if self.arch not in ARCHS:
      raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}.")
    llama = self.arch == "llama"
    # The (tiny) embedding table is replicated: sharding it ("vocab", "embed")
    # would make XLA re-shard the gathered activations to the batch layout.
    embed_cls = OneHotEmbed if self.vocab_size <= ONE_HOT_VOCAB_MAX else nn.Embed
    x = embed_cls(self.vocab_size, self.hidden, dtype=self.dtype,
                  embedding_init=nn.initializers.normal(1.0), name="embed")(tokens)
    block = nn.remat(tfx.TransformerLayer) if self.remat else tfx.TransformerLayer
    arch_kw = dict(layernorm_type="rmsnorm", activations=("silu", "linear")) if llama else {}
    if self.decode:
      arch_kw["decode"] = True
    if self.moe is not None:
      arch_kw.update(mlp_type="moe", moe=self.moe)
    for i in range(self.layers):
      x = block(hidden_size=self.hidden, mlp_hidden_size=self.mlp,
                num_attention_heads=self.heads, num_gqa_groups=self.kv_groups,
                fuse_qkv=self.fuse_qkv, layer_type="decoder", enable_rotary_pos_emb=True, use_bias=False,
                max_document_length=None if self.decode else self.max_document_length,
                dtype=self.dtype, name=f"layer_{i}", **arch_kw)(
                    x, segment_ids=segment_ids, segment_positions=positions)
    norm = tfx.RMSNorm if llama else tfx.LayerNorm
    x = norm(dtype=self.dtype, name="final_norm")(x)
    logits = nn.DenseGeneral(
        self.vocab_size, dtype=jnp.float32, name="lm_head", use_bias=not llama,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.02), ("embed", "vocab")))(x.astype(jnp.float32))
    return logits


# Vocabularies up to this size are embedded by a one-hot product (OneHotEmbed).
ONE_HOT_VOCAB_MAX = 1024


class OneHotEmbed(nn.Module):
  """Token embedding as a one-hot matrix product, for small vocabularies.

  Same variable as ``nn.Embed`` ("embedding", (num_embeddings, features),
  ``param_dtype``) and the same forward values (one nonzero term per output).
  Why: ``nn.Embed``'s gradient is a scatter-add of every token's row into the
  table, and with the examples' 64-character vocabulary 65k rows land on 64
  rows and serialize on atomics: 20 ms of a 595 ms bf16 step and 45 ms of a
  531 ms blockwise step of the llama preset (H200, 2026-12-03). As a product
  the gradient is one GEMM that accumulates in float32; forward and backward
  cost 2 * tokens * num_embeddings * features FLOPs each, cheap below
  ``ONE_HOT_VOCAB_MAX``.

  tokens: (...,) integers in [0, num_embeddings) -> (..., features) ``dtype``.
  """

  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  embedding_init: Any = nn.initializers.normal(1.0)

  @nn.compact
  def __call__(self, tokens):
    if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
      raise TypeError(f"tokens must be integers, got {jnp.asarray(tokens).dtype}.")
    table = self.param("embedding", self.embedding_init,
                       (self.num_embeddings, self.features), self.param_dtype)
    one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
    return jnp.einsum("...v,vf->...f", one_hot, table.astype(self.dtype),
                      preferred_element_type=jnp.float32).astype(self.dtype)


def param_count(state) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(state.params["params"])))


def active_params(cfg, params) -> int:
  """The parameters a token uses: all but the embedding table (a gather, not a
  product) and, in a mixture of experts, only ``experts_per_token`` of the
  ``experts`` routed experts' kernels."""
  n = 0
  for path, p in jax.tree_util.tree_leaves_with_path(params):
    keys = [getattr(k, "key", None) for k in path]
    size = int(np.prod(p.shape))
    if keys[:1] == ["embed"]:
      continue
    if "moe" in keys and keys[-1] in ("wi_kernel", "wo_kernel"):
      size = size * cfg.experts_per_token // cfg.experts
    n += size
  return n


def model_flops_per_token(cfg, state) -> float:
  """Training FLOPs per token of the model: ``6 N + 12 layers seq_len hidden``.

  ``6 N``: every matrix product's forward (2 N) and backward (4 N), N the
  parameters a token uses (:func:`active_params`: without the embedding
  table, and with k of the E routed experts of a mixture of experts).
  ``12 L S h``: the attention core, Q K^T and P V (2 S h FLOPs each per token
  and layer forward, x3 with the backward), over the whole row of S tokens,
  as PaLM's MFU counts it. Causal masking and packed documents mean far
  fewer attention FLOPs are really needed, so this is the conventional
  model-FLOPs figure MFU is quoted in, not the hardware's work.
  """
  n = active_params(cfg, state.params["params"])
  return 6.0 * n + 12.0 * cfg.layers * cfg.seq_len * cfg.hidden


# Dense (no sparsity) bf16 tensor-core peak per device, TFLOP/s, by device
# kind; the first name found in ``device_kind`` wins, so the specific
# variants come first. MFU divides by the bf16 peak for every recipe, FP8
# ones included (their GEMMs may run at up to twice it: 1979 TFLOP/s on an
# H100/H200), so recipes compare on one scale; an FP8 MFU above 50% of this
# is possible in principle.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0),
                    ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


def peak_flops(device, peak_tflops: Optional[float] = None) -> Optional[float]:
  """The dense bf16 peak FLOP/s of ``device`` (``peak_tflops`` overrides); None if unknown."""
  if peak_tflops:
    return float(peak_tflops) * 1e12
  if device.platform != "gpu":
    return None
  kind = device.device_kind
  return next((t * 1e12 for name, t in PEAK_BF16_TFLOPS if name in kind), None)
