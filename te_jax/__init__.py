"""te_jax: FP8 training for JAX/Flax on NVIDIA GPUs."""

from te_jax import dense
from te_jax import distributed
from te_jax import fp8_state
from te_jax import moe
from te_jax import packing
from te_jax import quantize
from te_jax import recipe
from te_jax import remat
from te_jax import scaling
from te_jax import sharded_dense
from te_jax import sharding
from te_jax.autocast import FP8Context, fp8_autocast, get_fp8_context
from te_jax.dense import dense_general
from te_jax.fp8_state import FP8_COLLECTION, accumulate_gradients, apply_fp8_updates
from te_jax.scaled_tensor import ScaledTensor
from te_jax.sharding import MeshResource

__all__ = [
    "dense",
    "dense_general",
    "distributed",
    "fp8_state",
    "moe",
    "packing",
    "quantize",
    "recipe",
    "remat",
    "scaling",
    "sharded_dense",
    "sharding",
    "MeshResource",
    "FP8_COLLECTION",
    "accumulate_gradients",
    "apply_fp8_updates",
    "fp8_autocast",
    "get_fp8_context",
    "FP8Context",
    "ScaledTensor",
]

__version__ = "0.1.0"


def __getattr__(name):
  """``te_jax.nnx`` (the Flax NNX modules) is imported on first use."""
  if name == "nnx":
    import importlib
    return importlib.import_module("te_jax.nnx")
  raise AttributeError(f"module 'te_jax' has no attribute {name!r}")
