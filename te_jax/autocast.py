"""The FP8 autocast context: the one piece of global state in te_jax.

Layers read the active context at trace time. The context is also part of
JAX's tracing and compilation cache key (``jax.make_user_context``): a
``jax.jit`` function traced under one autocast and called under another
(another recipe, FP8 switched on or off, another mesh resource) is traced
again for it instead of silently running the first one; calls under an equal
autocast (recipes compare by value) reuse the compiled program.

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

import jax

from te_jax import recipe as recipe_lib
from te_jax import sharding as sharding_lib

__all__ = ["FP8Context", "fp8_autocast", "get_fp8_context", "in_fp8_autocast"]


@dataclasses.dataclass(frozen=True)
class FP8Context:
  """What ``fp8_autocast`` makes visible to the layers.

  Attributes:
    enabled: whether GEMMs run in FP8.
    recipe: the active recipe (``DelayedScaling()`` when none was given).
    mesh_resource: a ``te_jax.sharding.MeshResource`` or None.
    keep_fp8_copies: whether the fused norm and MLP blocks keep the FP8
      copies their backward GEMMs read (see ``fp8_autocast``).
    store_act_input_in_fp8: whether the fused MLP blocks keep their
      activation's input in FP8 for the backward (see ``fp8_autocast``).
  """

  enabled: bool = False
  recipe: recipe_lib.Recipe = dataclasses.field(
      default_factory=recipe_lib.DelayedScaling)
  mesh_resource: Optional[sharding_lib.MeshResource] = None
  keep_fp8_copies: bool = False
  store_act_input_in_fp8: bool = False


# What holds outside any fp8_autocast: FP8 off, by default rather than by choice.
_OUTSIDE = FP8Context()
_CONTEXT = contextvars.ContextVar("te_jax_fp8_context", default=_OUTSIDE)

# What of the context the layers read (read_autocast: the recipe only when
# enabled, and the mesh resource), held in a JAX user context so that it is
# part of the jit cache key. None is the state outside any autocast.
_JIT_KEY = jax.make_user_context(default_value=None)


def _jit_key(ctx: FP8Context):
  """The part of ``ctx`` that changes what a traced function computes; None
  where that is what no autocast gives (an autocast that changes nothing
  does not retrace)."""
  if not ctx.enabled and ctx.mesh_resource is None:
    return None
  return (ctx.enabled, ctx.recipe if ctx.enabled else None, ctx.mesh_resource,
          ctx.enabled and ctx.keep_fp8_copies, ctx.enabled and ctx.store_act_input_in_fp8)


def _check_mesh_resource(mesh_resource):
  """Raises a TypeError naming the fix unless ``mesh_resource`` is a MeshResource or None.

  Checked on entry because the layers read it only when they trace, where a
  string or a dict fails with an AttributeError that names neither.
  """
  if mesh_resource is None or isinstance(mesh_resource, sharding_lib.MeshResource):
    return
  got = repr(mesh_resource)
  if len(got) > 120:
    got = got[:117] + "..."
  msg = (f"fp8_autocast(mesh_resource=...) must be a te_jax.sharding.MeshResource or None, "
         f"got {type(mesh_resource).__name__} {got}. Name the role of each mesh axis, e.g. "
         f'mesh_resource=te_jax.sharding.MeshResource(fsdp_resource="fsdp") (and '
         f"dp_resource=, tp_resource= for data and tensor parallelism).")
  fields = {f.name for f in dataclasses.fields(sharding_lib.MeshResource)}
  if isinstance(mesh_resource, dict) and mesh_resource and set(mesh_resource) <= fields:
    msg += " For this dict: te_jax.sharding.MeshResource(**mesh_resource)."
  if isinstance(mesh_resource, jax.sharding.Mesh):
    msg += (" The mesh itself goes to jax.set_mesh(mesh); mesh_resource says which of "
            "its axes serve which kind of parallelism.")
  raise TypeError(msg)


def get_fp8_context() -> FP8Context:
  """Returns the innermost active ``FP8Context`` (FP8 off outside any autocast)."""
  return _CONTEXT.get()


def in_fp8_autocast() -> bool:
  """Whether the code runs inside an ``fp8_autocast``, enabled or not.

  Outside any, FP8 is off by default; ``fp8_autocast(enabled=False)`` turns
  it off on purpose (the documented way to evaluate an FP8-trained model
  without FP8). The module layer tells the two apart to warn about the
  first when a model holds delayed-scaling state
  (``te_jax.layers.state.warn_unused_state``).
  """
  return _CONTEXT.get() is not _OUTSIDE


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True,
                 fp8_recipe: Optional[recipe_lib.Recipe] = None,
                 mesh_resource=None, keep_fp8_copies: bool = False,
                 store_act_input_in_fp8: bool = False) -> Iterator[FP8Context]:
  """Runs the te_jax layers traced inside in FP8 with ``fp8_recipe``.

  Args:
    enabled: True to run GEMMs in FP8; False to run them in the module dtype.
    fp8_recipe: a ``te_jax.recipe`` recipe; defaults to ``DelayedScaling()``.
    mesh_resource: None, or a ``te_jax.sharding.MeshResource`` naming the
      mesh axes used for data, FSDP and tensor parallelism, e.g.
      ``MeshResource(fsdp_resource="fsdp")``; anything else (an axis name, a
      dict) raises a TypeError on entry.
    keep_fp8_copies: what the fused norm + GEMM and norm + MLP blocks of the
      modules keep for their backward. False (the default, the memory plan):
      the original x and kernels, from which the backward quantizes norm(x)
      and each kernel again, so an FP8 step holds no more than the FP8-off
      step. True: the FP8 copies the forward wrote (norm(x) transposed, each
      kernel in its dgrad layout), as ``te_jax.dense`` always keeps them: the
      backward skips those passes over the kernels and norm(x) (faster where
      the kernels are large against the tokens of a step), and holds one byte
      per kernel element and per norm(x) element until then. Same values
      either way (the copies are quantized with the same scales).
    store_act_input_in_fp8: False (the default): the fused MLP blocks
      (``LayerNormMLP``, also inside ``TransformerLayer``) keep their
      activation's input h = norm(x) @ wi (tokens x n_act * mlp) in the
      compute dtype for the backward. True: they keep it in E4M3 with one
      float32 scale per 1x128 tile (DeepSeek-V3's low-precision storage;
      ``te_jax.fused_mlp.fp8_mlp``'s ``store_act_input_in_fp8``): about
      half of that residual's bytes; the forward's activation kernel writes
      the E4M3 copy from the h it reads anyway, and the backward's reads the
      FP8 bytes, 1 byte an element instead of 2. The MoE experts keep
      theirs the same way (``te_jax.moe``; shared experts of a sharded
      block keep theirs in the compute dtype and warn once). The output is
      unchanged, the gradients differ by the rounding of h to E4M3. A
      block that does not run on the fused MLP path under FP8 cannot apply
      it and warns once why. Ignored while FP8 is off.

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
  _check_mesh_resource(mesh_resource)
  if not isinstance(keep_fp8_copies, bool):
    raise TypeError(f"keep_fp8_copies must be a bool, got {keep_fp8_copies!r}.")
  if not isinstance(store_act_input_in_fp8, bool):
    raise TypeError(f"store_act_input_in_fp8 must be a bool (True or False), got "
                    f"{store_act_input_in_fp8!r}.")
  ctx = FP8Context(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource,
                   keep_fp8_copies=keep_fp8_copies,
                   store_act_input_in_fp8=store_act_input_in_fp8)
  token = _CONTEXT.set(ctx)
  try:
    with _JIT_KEY(_jit_key(ctx)):
      yield ctx
  finally:
    _CONTEXT.reset(token)
