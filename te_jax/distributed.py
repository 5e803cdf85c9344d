"""Former name of :mod:`te_jax.sharded_dense`, kept so that ``te_jax.distributed``
(a public name) still resolves. New code imports ``te_jax.sharded_dense``."""

from te_jax.sharded_dense import make_plan, shard_map, sharded_fp8_dense

__all__ = ["sharded_fp8_dense", "make_plan", "shard_map"]
