"""te_jax: FP8 training for JAX/Flax on NVIDIA GPUs."""

from te_jax import dense
from te_jax import fp8_state
from te_jax import packing
from te_jax import quantize
from te_jax import recipe
from te_jax.autocast import FP8Context, fp8_autocast, get_fp8_context
from te_jax.fp8_state import FP8_COLLECTION, accumulate_gradients, apply_fp8_updates
from te_jax.scaled_tensor import ScaledTensor

__all__ = [
    "dense",
    "fp8_state",
    "packing",
    "quantize",
    "recipe",
    "FP8_COLLECTION",
    "accumulate_gradients",
    "apply_fp8_updates",
    "fp8_autocast",
    "get_fp8_context",
    "FP8Context",
    "ScaledTensor",
]

__version__ = "0.1.0"
