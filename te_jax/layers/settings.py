"""The autocast settings of one module call, read once.

:func:`read_settings` is the one place below ``te_jax.autocast`` that reads
the active ``fp8_autocast``: a module calls it once per call and hands the
:class:`Settings` down, so that every decision of that call sees one recipe
(already resolved to its ``te_jax.scaling.ScalingMode``), one mesh resource,
one mesh and one set of logical axis rules.

The logical axis rules come from the framework layer, which knows where its
users put them: the Linen modules read Flax's ``nn.logical_axis_rules``
context, the NNX modules the one ``nnx.logical_axis_rules`` sets. Without
any, the defaults of ``te_jax.sharding.logical_axis_rules(mesh_resource)``
apply.

>>> import te_jax
>>> from te_jax import recipe
>>> from te_jax.layers.settings import read_settings
>>> read_settings().recipe is None          # outside any autocast: FP8 off
True
>>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8BlockScaling()):
...   s = read_settings(impl="reference")
>>> type(s.mode).__name__, s.mode.token_block, s.impl
('BlockScalingMode', 128, 'reference')
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

from te_jax import explicit_axes as explicit_lib
from te_jax import recipe as recipe_lib
from te_jax import scaling
from te_jax import sharded_dense
from te_jax import sharding as sharding_lib
from te_jax.autocast import get_fp8_context, in_fp8_autocast
from te_jax.ops import check_impl

__all__ = ["Settings", "read_settings", "in_autocast"]


class Settings(NamedTuple):
  """What a module's call needs from the autocast, read once.

  Attributes:
    recipe: the active recipe, or None when FP8 is off.
    mode: ``recipe.scaling_mode()`` (None when FP8 is off): what every
      decision of the call asks (``token_block``, ``uses_state``, ...).
    mesh_resource: the autocast's ``te_jax.sharding.MeshResource`` or None.
    mesh: the active mesh (``te_jax.sharding.get_mesh()``) or None.
    axis_rules: the logical axis rules in effect, ``(name, mesh axes)`` pairs.
    impl: "auto", "cuda" or "reference" (the module's ``impl`` attribute).
    keep_fp8_copies: the autocast's ``keep_fp8_copies`` (False when FP8 is
      off): what the fused blocks keep for their backward.
    store_act_input_in_fp8: the autocast's ``store_act_input_in_fp8``
      (False when FP8 is off): whether the fused MLP core keeps its
      activation's input in FP8.
  """

  recipe: Optional[recipe_lib.Recipe]
  mode: Optional[scaling.ScalingMode]
  mesh_resource: Optional[sharding_lib.MeshResource]
  mesh: Any
  axis_rules: Tuple[Tuple[str, Any], ...]
  impl: str
  keep_fp8_copies: bool = False
  store_act_input_in_fp8: bool = False

  def residual_plan(self) -> dict:
    """The fused blocks' ``save_original_input`` / ``save_original_kernel``
    arguments (``te_jax.fused_mlp.fp8_mlp``, ``te_jax.norm_dense.fp8_norm_dense``)."""
    save = not self.keep_fp8_copies
    return dict(save_original_input=save, save_original_kernel=save)

  def mlp_residual_plan(self) -> dict:
    """:meth:`residual_plan` with the MLP core's own choice, its
    ``store_act_input_in_fp8`` (``te_jax.fused_mlp.fp8_mlp`` alone takes it)."""
    return dict(self.residual_plan(), store_act_input_in_fp8=self.store_act_input_in_fp8)

  def unsharded(self) -> bool:
    """Whether the fused FP8 paths (MLP core, norm + quantize, split Q/K/V),
    which have no sharding rule of their own, may be taken:
    ``te_jax.sharding.gemms_unsharded`` of this call's mesh resource and mesh
    (False under an explicit-axes mesh; else True when no mesh axis the mesh
    resource names has size > 1).

    A mesh resource without a mesh, or naming none of its axes, is warned
    about once here too (outside an explicit-axes mesh): the paths this
    answer selects never reach the sharded dense, which warns for the others.
    """
    mr = self.mesh_resource
    if mr is not None and not explicit_lib.explicit_axes():
      sharded_dense.warn_if_unsharded(mr, self.mesh)
    return sharding_lib.gemms_unsharded(mr, self.mesh)


def read_settings(impl: str = "auto", axis_rules: Sequence = ()) -> Settings:
  """The innermost ``fp8_autocast`` as :class:`Settings` (FP8 off outside any).

  Args:
    impl: the calling module's ``impl`` attribute ("auto", "cuda",
      "reference"); ``TE_JAX_IMPL`` still overrides "auto".
    axis_rules: the logical axis rules the framework layer found in effect
      (empty: the defaults for the autocast's mesh resource).
  """
  check_impl(impl)
  ctx = get_fp8_context()
  recipe = ctx.recipe if ctx.enabled else None
  rules = tuple(axis_rules) or sharding_lib.logical_axis_rules(ctx.mesh_resource)
  return Settings(recipe=recipe, mode=None if recipe is None else recipe.scaling_mode(),
                  mesh_resource=ctx.mesh_resource, mesh=sharding_lib.get_mesh(),
                  axis_rules=rules, impl=impl,
                  keep_fp8_copies=recipe is not None and ctx.keep_fp8_copies,
                  store_act_input_in_fp8=recipe is not None and ctx.store_act_input_in_fp8)


def in_autocast() -> bool:
  """Whether any ``fp8_autocast`` is active, enabled or not: FP8 off inside
  ``fp8_autocast(enabled=False)`` is the user's choice (to evaluate without
  FP8), FP8 off outside any autocast may not be (the module layer warns
  about it when a model holds FP8 state)."""
  return in_fp8_autocast()
