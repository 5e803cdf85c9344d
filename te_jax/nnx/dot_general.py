"""``Fp8DotGeneral``: a drop-in FP8 ``dot_general`` for existing NNX models.

Flax's ``nnx.Linear`` takes ``dot_general``, a callable it calls the way it
would call ``lax.dot_general`` (``nnx.LinearGeneral`` and
``nnx.MultiHeadAttention`` take it too, and ``dot_general_cls``, a class they
instantiate inside every call). An instance of :class:`Fp8DotGeneral` is such
a callable, and an NNX module::

    from te_jax import nnx as tnx
    layer = nnx.Linear(din, dout, dot_general=tnx.Fp8DotGeneral(), rngs=rngs)

Under ``te_jax.fp8_autocast(enabled=True, fp8_recipe=r)`` the product and
both of its gradients then run as te_jax FP8 GEMMs with recipe ``r`` (any of
the three), through the same core as ``te_jax.flax.Fp8DotGeneral`` (Linen's
``dot_general_cls``): ``te_jax.layers.gemm.dot_general_product``, with its
rules for which contractions run in FP8 and its fallbacks. Outside an
autocast the call is exactly ``lax.dot_general``.

Under ``DelayedScaling`` (active while the op is constructed, as for every
te_jax.nnx module) the GEMM's amax histories and scales are the op's
``FP8State`` variable ``fp8_meta``: being an attribute of the layer, the op
is part of the model (``layer.dot_general.fp8_meta``), differentiated with
``nnx.DiffState(0, te_jax.nnx.WRT)`` and written back by
``te_jax.nnx.apply_fp8_updates`` like a ``te_jax.nnx.Linear``'s. An
instance shared by several layers (``nnx.MultiHeadAttention``'s
``qkv_dot_general``) gives their GEMMs one state, updated once per step with
the largest amax of its uses (``te_jax.fp8_state.merge_uses``), so one scale
serves them all; give each layer its own instance for scales of its own. A
class given as ``dot_general_cls`` makes a new instance, with a new state,
in every call, whose scales would never advance: a ValueError under
``DelayedScaling``. The stateless recipes take either.

``out_sharding`` (which ``nnx.Linear`` passes, None unless its caller gives
one) is honoured: the FP8 output is resharded to it (a sharding constraint
under an auto-axes mesh). The op knows no logical axis names, so under a
``MeshResource`` its GEMMs take the unsharded functional path (XLA
partitions around them); ``te_jax.nnx.Linear`` with ``kernel_axes`` runs the
sharded FP8 GEMMs.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> import te_jax
>>> from te_jax import nnx as tnx, recipe
>>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
...   layer = nnx.Linear(32, 64, dot_general=tnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
...   y = layer(jnp.ones((4, 32)))
>>> y.shape, type(layer.dot_general.fp8_meta).__name__
((4, 64), 'FP8State')
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from flax import nnx
from jax import lax

from te_jax import explicit_axes as explicit_lib
from te_jax.layers.gemm import (FP8_META, check_dot_general_call, dot_general_product,
                                fp8_blocker, parse_dimension_numbers, update_probe)
from te_jax.nnx import state as st

__all__ = ["Fp8DotGeneral"]

_NAME = "te_jax.nnx.Fp8DotGeneral"


def _made_in_a_layer_call(op) -> bool:
  """Whether ``op`` is being constructed by an NNX module's ``__call__``
  (``dot_general = self.dot_general_cls()`` in Flax's layers): the first
  frame that is not ``op``'s construction (this file, NNX's metaclass calls
  on ``op`` or its class) is such a call."""
  frame = sys._getframe(1)   # pylint: disable=protected-access
  while frame is not None:
    local = frame.f_locals
    if (frame.f_code.co_filename == __file__ or local.get("self") is op
        or local.get("cls") is type(op)):
      frame = frame.f_back
      continue
    return frame.f_code.co_name == "__call__" and isinstance(local.get("self"), nnx.Module)
  return False


class Fp8DotGeneral(nnx.Module):
  """``lax.dot_general`` as an FP8 GEMM under ``fp8_autocast``, for NNX layers'
  ``dot_general``.

  Called like ``lax.dot_general(lhs, rhs, dimension_numbers, precision=None,
  preferred_element_type=None, out_sharding=None)``: ``lhs`` the activation
  (*lhs_dims), ``rhs`` the weight (*rhs_dims); returns (*lhs_free,
  *rhs_free) in ``preferred_element_type`` (default the operands' promoted
  dtype). Contractions without batch dims on float operands run in FP8; the
  others as the plain ``lax.dot_general``, with a warning once per reason
  (``on_unsupported="warn"``) or a ValueError (``"raise"``).

  State (``DelayedScaling`` active at construction only): ``fp8_meta``, an
  ``te_jax.nnx.FP8State``, and the update check's ``fp8_counters``.

  Args:
    impl: "auto" (default), "cuda" or "reference": the FP8 ops'
      implementation (``TE_JAX_IMPL`` overrides "auto").
    on_unsupported: "warn" (default) or "raise", see above.
  """

  FP8_GEMMS = (FP8_META,)

  def __init__(self, *, impl: str = "auto", on_unsupported: str = "warn"):
    check_dot_general_call(_NAME, {}, on_unsupported)
    mode = st.construction_mode(impl)
    if mode is not None and mode.uses_state and _made_in_a_layer_call(self):
      raise ValueError(
          f"{_NAME} is being created inside a layer's call (dot_general_cls), so under "
          f"{type(mode.recipe).__name__} its FP8 state would be new on every call and its "
          "scales would never advance. Pass an instance instead, one per layer: "
          "dot_general=te_jax.nnx.Fp8DotGeneral() (or use a stateless recipe, "
          "Float8CurrentScaling / Float8BlockScaling, with dot_general_cls).")
    self.impl, self.on_unsupported = impl, on_unsupported
    st.add_fp8_state(self, mode)

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None,
               **kwargs) -> jax.Array:
    """Computes the product; see the class docstring."""
    check_dot_general_call(_NAME, kwargs, self.on_unsupported)
    settings = st.read_autocast(self.impl)
    args = (lhs, rhs, dimension_numbers, precision, preferred_element_type)
    if settings.recipe is None:
      return lax.dot_general(*args, out_sharding=out_sharding)
    dims = parse_dimension_numbers(lhs, rhs, dimension_numbers)
    if fp8_blocker(lhs, rhs, dims, preferred_element_type, {}) is not None:
      y, _ = dot_general_product(_NAME, settings, None, self.on_unsupported, *args,
                                 out_sharding=out_sharding)
      return y
    states = st.NnxStates(self)
    state = states.state(FP8_META, settings.mode)
    if state is not None:
      states.track_updates(update_probe(rhs))
    y, _ = dot_general_product(_NAME, settings, state, self.on_unsupported, *args)
    if out_sharding is None:
      return y
    if explicit_lib.explicit_axes():
      return jax.sharding.reshard(y, out_sharding)
    return lax.with_sharding_constraint(y, out_sharding)
