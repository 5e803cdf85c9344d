"""The options and inputs of ``TransformerLayer`` (Linen and NNX), checked once.

>>> self_attn_mask_type("decoder", None), self_attn_mask_type("encoder", None)
('causal', 'no_mask')
"""

from __future__ import annotations

from typing import Optional

from te_jax.layers.attention import check_input_3d, check_segment_arg

__all__ = ["LAYER_TYPES", "MLP_TYPES", "folds_residuals", "check_layer_type", "check_mlp_type",
           "self_attn_mask_type", "check_layer_inputs", "token_mask"]

LAYER_TYPES = ("encoder", "decoder")
# "dense": the LayerNormMLP sublayer; "moe": a norm, then a mixture of experts
# (te_jax.flax.MoE / te_jax.nnx.MoE) in its place.
MLP_TYPES = ("dense", "moe")


def folds_residuals(hidden_dropout: float, deterministic: bool) -> bool:
  """Whether a TransformerLayer's sublayers add their residuals themselves
  (``add_residual=True``: in FP8 inside their output GEMMs and norm
  backward kernels): when no hidden dropout stands between a sublayer's
  output and its residual add in this call."""
  return hidden_dropout == 0.0 or bool(deterministic)


def check_layer_type(layer_type: str) -> None:
  """ValueError unless ``layer_type`` is "encoder" or "decoder"."""
  if layer_type not in LAYER_TYPES:
    raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}.")


def check_mlp_type(mlp_type: str, moe, *, use_bias: bool, intermediate_dropout: float) -> None:
  """ValueError unless the MLP sublayer's options fit together: ``mlp_type``
  "dense" without ``moe``, or "moe" with a ``te_jax.moe.MoEConfig`` and
  neither biases nor intermediate dropout (the experts have neither)."""
  from te_jax.moe import MoEConfig  # pylint: disable=import-outside-toplevel
  if mlp_type not in MLP_TYPES:
    raise ValueError(f"mlp_type must be one of {MLP_TYPES}, got {mlp_type!r}.")
  if mlp_type == "dense":
    if moe is not None:
      raise ValueError("moe=MoEConfig(...) is given but mlp_type='dense': set "
                       "mlp_type='moe' to put the mixture of experts in place of the MLP.")
    return
  if not isinstance(moe, MoEConfig):
    raise TypeError(f"mlp_type='moe' needs moe=te_jax.moe.MoEConfig(num_experts=..., "
                    f"num_experts_per_token=...), got {moe!r}.")
  if use_bias:
    raise ValueError("use_bias=True with mlp_type='moe': the experts have no biases (a "
                     "padding row of the expert buffer must stay 0); set use_bias=False.")
  if intermediate_dropout:
    raise ValueError(f"intermediate_dropout={intermediate_dropout} with mlp_type='moe': the "
                     "experts have no intermediate dropout; set it to 0.")


def token_mask(segment_ids):
  """The MoE's token mask of a packed batch: segment id 0 (padding) routes
  nowhere; None without segment ids."""
  return None if segment_ids is None else segment_ids != 0


def self_attn_mask_type(layer_type: str, given: Optional[str]) -> str:
  """The self attention's mask type: ``given``, else causal for a decoder and
  none for an encoder."""
  return given or ("causal" if layer_type == "decoder" else "no_mask")


def check_layer_inputs(inputs, hidden_size: int, *, segment_ids=None, segment_positions=None,
                       encoded=None, encoder_segment_ids=None) -> None:
  """Checks the arguments of a ``TransformerLayer`` call: ``inputs`` (B, S,
  hidden_size), ``segment_ids`` / ``segment_positions`` (B, S) integers,
  ``encoded`` (B, S_enc, E_enc) with ``encoder_segment_ids`` (B, S_enc).
  Raises ValueError/TypeError naming the argument."""
  check_input_3d("inputs", inputs)
  check_segment_arg("segment_ids", segment_ids, "inputs", inputs)
  check_segment_arg("segment_positions", segment_positions, "inputs", inputs)
  if encoded is not None:
    check_input_3d("encoded", encoded)
    check_segment_arg("encoder_segment_ids", encoder_segment_ids, "encoded", encoded)
  if inputs.shape[-1] != hidden_size:
    raise ValueError(f"inputs' last dim ({inputs.shape[-1]}) must equal "
                     f"hidden_size ({hidden_size}).")
