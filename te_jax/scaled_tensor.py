"""``ScaledTensor``: FP8 data together with the scales that dequantize it.

Defined in the ops layer (``te_jax.ops.fp8``), which everything else in
te_jax builds on; this module is its public name (``te_jax.ScaledTensor``).
"""

from te_jax.ops.fp8 import ScaledTensor

__all__ = ["ScaledTensor"]
