"""The options and inputs of ``TransformerLayer`` (Linen and NNX), checked once.

>>> self_attn_mask_type("decoder", None), self_attn_mask_type("encoder", None)
('causal', 'no_mask')
"""

from __future__ import annotations

from typing import Optional

from te_jax.layers.attention import check_input_3d, check_segment_arg

__all__ = ["LAYER_TYPES", "check_layer_type", "self_attn_mask_type", "check_layer_inputs"]

LAYER_TYPES = ("encoder", "decoder")


def check_layer_type(layer_type: str) -> None:
  """ValueError unless ``layer_type`` is "encoder" or "decoder"."""
  if layer_type not in LAYER_TYPES:
    raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}.")


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
