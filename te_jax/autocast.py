"""The FP8 autocast context: the one piece of global state in te_jax.

Layers read the active context at trace time, so it must be entered around
the *tracing* of a function (the first call of a ``jax.jit`` function, or the
``init``/``apply`` call), not merely around a cached call.

Example::

  import te_jax
  from te_jax import recipe
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
    y = model.apply(variables, x)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

from te_jax import recipe as recipe_lib

__all__ = ["FP8Context", "fp8_autocast", "get_fp8_context"]


@dataclasses.dataclass(frozen=True)
class FP8Context:
  """What ``fp8_autocast`` makes visible to the layers.

  Attributes:
    enabled: whether GEMMs run in FP8.
    recipe: the active recipe (``DelayedScaling()`` when none was given).
    mesh_resource: a ``te_jax.sharding.MeshResource`` or None.
  """

  enabled: bool = False
  recipe: recipe_lib.Recipe = dataclasses.field(
      default_factory=recipe_lib.DelayedScaling)
  mesh_resource: Optional[object] = None


_CONTEXT = contextvars.ContextVar("te_jax_fp8_context", default=FP8Context())


def get_fp8_context() -> FP8Context:
  """Returns the innermost active ``FP8Context`` (FP8 off outside any autocast)."""
  return _CONTEXT.get()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True,
                 fp8_recipe: Optional[recipe_lib.Recipe] = None,
                 mesh_resource=None) -> Iterator[FP8Context]:
  """Runs the te_jax layers traced inside in FP8 with ``fp8_recipe``.

  Args:
    enabled: True to run GEMMs in FP8; False to run them in the module dtype.
    fp8_recipe: a ``te_jax.recipe`` recipe; defaults to ``DelayedScaling()``.
    mesh_resource: optional ``te_jax.sharding.MeshResource`` naming the mesh
      axes used for data, FSDP and tensor parallelism.

  Yields:
    The active ``FP8Context``.
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled must be a bool, got {enabled!r}.")
  if fp8_recipe is None:
    fp8_recipe = recipe_lib.DelayedScaling()
  if not isinstance(fp8_recipe, recipe_lib.Recipe):
    raise TypeError(
        "fp8_recipe must be a te_jax.recipe recipe (DelayedScaling, "
        f"Float8CurrentScaling or Float8BlockScaling), got {fp8_recipe!r}.")
  ctx = FP8Context(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource)
  token = _CONTEXT.set(ctx)
  try:
    yield ctx
  finally:
    _CONTEXT.reset(token)
