"""The named scopes of the MoE block's parts.

``te_jax.moe.block`` and ``te_jax.moe.parallel`` run each part of the layer
under ``jax.named_scope(SCOPES[part])``; the compiled program's op names
carry the scope, so a profile can sort kernel time by part
(``benchmarks/bench_moe.py``). On a mesh, the all-to-alls belong to
dispatch (tokens to their experts) and combine (back).
"""

SCOPES = {"router": "moe_router", "dispatch": "moe_dispatch", "experts": "moe_experts",
          "combine": "moe_combine", "shared": "moe_shared"}

__all__ = ["SCOPES"]
