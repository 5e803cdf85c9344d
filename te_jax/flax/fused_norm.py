"""Where the norm path decisions of the modules used to live: now ``te_jax.layers.norm``.

The names below are kept here for code outside the library that imports
them from this module; new code imports ``te_jax.layers.norm``.
"""

from te_jax.layers.norm import (MIN_KERNEL_HIDDEN, log_unfused_norm, log_xla_norm, module_norm,
                                norm_kernel_blocker)

__all__ = ["MIN_KERNEL_HIDDEN", "log_unfused_norm", "log_xla_norm", "module_norm",
           "norm_kernel_blocker"]
