"""Where packed-sequence attention used to live: now ``te_jax.layers.packed_attention``.

The names below are kept here for code outside the library that imports
them from this module; new code imports ``te_jax.layers.packed_attention``.
"""

from te_jax.layers.packed_attention import (banded_self_attention, packed_self_attention,
                                            segment_attention_mask)

__all__ = ["banded_self_attention", "packed_self_attention", "segment_attention_mask"]
