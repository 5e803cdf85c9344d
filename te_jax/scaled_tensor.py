"""``ScaledTensor`` and ``QuantizedTensor``: FP8 data with the scales that dequantize it.

Defined in the ops layer (``te_jax.ops.fp8``), which everything else in
te_jax builds on; this module is their public name. ``ScaledTensor`` is one
FP8 GEMM operand (``te_jax.ScaledTensor``); ``QuantizedTensor`` is what every
quantize op returns, the rowwise copy and the columnwise copy with their
scales (``te_jax.quantize.quantize_rowwise_columnwise``).
"""

from te_jax.ops.fp8 import QuantizedTensor, ScaledTensor

__all__ = ["ScaledTensor", "QuantizedTensor"]
