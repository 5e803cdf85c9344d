"""te_jax: FP8 training for JAX/Flax on NVIDIA GPUs."""

from te_jax import recipe
from te_jax.autocast import FP8Context, fp8_autocast, get_fp8_context
from te_jax.scaled_tensor import ScaledTensor

__all__ = [
    "recipe",
    "fp8_autocast",
    "get_fp8_context",
    "FP8Context",
    "ScaledTensor",
]

__version__ = "0.1.0"
