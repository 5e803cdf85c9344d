"""One op per module: pure-JAX reference, CUDA custom call, and dispatcher.

This layer imports nothing from te_jax outside ``te_jax.ops``.
"""

from te_jax.ops._native import IMPLS, check_impl, cuda_available

__all__ = ["IMPLS", "check_impl", "cuda_available"]
