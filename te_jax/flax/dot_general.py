"""``Fp8DotGeneral``: a drop-in FP8 ``dot_general`` for existing Linen models.

Flax's ``nn.Dense`` and ``nn.DenseGeneral`` take ``dot_general_cls``: a Linen
module class they instantiate inside their own ``__call__`` and call the way
they would call ``lax.dot_general``::

    from te_jax import flax as tfx
    nn.Dense(features, dot_general_cls=tfx.Fp8DotGeneral)

(the way Flax's ``Fp8DirectDotGeneralOp`` and TE-JAX's ``make_dot_general_cls``
are used). Under ``te_jax.fp8_autocast(enabled=True, fp8_recipe=r)`` the
product and both of its gradients then run as te_jax FP8 GEMMs with recipe
``r`` (any of the three) through :func:`te_jax.dense.dense_general`, with the
implementation and mesh resource of the autocast; under ``DelayedScaling``
the GEMM's amax histories and scales are the variable ``fp8_meta`` of the
collection ``"_overwrite_with_gradient"`` in the op's own scope (e.g.
``Dense_0/Fp8DotGeneral_0``), which ``TrainState.apply_gradients`` updates by
itself. Outside an autocast (or with ``enabled=False``) the call is exactly
``lax.dot_general`` with the arguments given.

Which contractions run in FP8: every ``dimension_numbers`` without batch
dims, on float32/bfloat16/float16 operands. The op transposes the operands
itself, so the contracting dims may sit anywhere: ``lhs`` becomes
(*lhs_free, *contract) and ``rhs`` (*contract, *rhs_free), which is the
te_jax dense ``x (M, K) @ kernel (K, N)`` once flattened; the output order,
(*lhs_free, *rhs_free), is the one ``lax.dot_general`` gives. ``lhs`` takes
the activation's role ("x") and ``rhs`` the weight's ("kernel"), as in Flax's
layers. Anything else -- batch dims (``DenseGeneral(batch_dims=...)``, an
attention einsum), no contracting dim, integer or FP8 operands, an
``out_sharding`` -- runs as the plain ``lax.dot_general`` and the ``te_jax``
logger warns once per reason (``on_unsupported="warn"``, the default: a model
keeps working while its other products run in FP8), or raises a ValueError
(``on_unsupported="raise"``). Malformed ``dimension_numbers`` always raise.

Einsum: ``nn.Einsum`` of the installed Flax (0.12) takes no
``dot_general_cls``; an einsum in your own module calls :class:`Fp8Einsum`
(``Fp8Einsum()(eqn, x, kernel)``, as Flax's own ``fp8_ops.Fp8Einsum``), whose
contraction takes the same path. ``precision`` is ignored in FP8 (the recipe fixes the numerics).
The op knows no logical axis names, so under a mesh its GEMMs take the
unsharded functional path (XLA partitions around them); te_jax's own
``DenseGeneral`` with ``kernel_axes`` runs the sharded FP8 GEMMs.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> import te_jax
>>> from te_jax import flax as tfx, recipe
>>> layer = nn.Dense(64, dot_general_cls=tfx.Fp8DotGeneral)
>>> x = jax.random.normal(jax.random.key(0), (4, 32))
>>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
...   variables = layer.init(jax.random.key(1), x)
...   y = layer.apply(variables, x)
>>> y.shape, sorted(variables[te_jax.FP8_COLLECTION]["Fp8DotGeneral_0"])
((4, 64), ['fp8_meta'])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax import lax

from te_jax.flax import fp8_module
from te_jax.layers.gemm import (FP8_META, ON_UNSUPPORTED, check_dot_general_call,
                                dot_general_product, fp8_blocker, log_fallback,
                                parse_dimension_numbers)

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "ON_UNSUPPORTED", "parse_dimension_numbers", "fp8_blocker",
           "log_fallback"]
# (The product itself, shared with te_jax.nnx.Fp8DotGeneral, is the core's:
# te_jax.layers.gemm.dot_general_product.)


class Fp8DotGeneral(nn.Module):
  """``lax.dot_general`` as an FP8 GEMM under ``fp8_autocast``, for ``dot_general_cls``.

  Called like ``lax.dot_general(lhs, rhs, dimension_numbers, precision=None,
  preferred_element_type=None)``: ``lhs`` the activation (*lhs_dims),
  ``rhs`` the weight (*rhs_dims); returns (*lhs_free, *rhs_free) in
  ``preferred_element_type`` (default the operands' promoted dtype). See the
  module docstring for which contractions run in FP8.

  FP8 state (``DelayedScaling`` only): ``fp8_meta`` in collection
  ``"_overwrite_with_gradient"``, as in ``te_jax.flax.DenseGeneral``.

  Attributes:
    impl: "auto" (default), "cuda" or "reference": which implementation the
      FP8 ops use (``TE_JAX_IMPL`` overrides "auto"). Set it with
      ``functools.partial(Fp8DotGeneral, impl=...)`` as the ``dot_general_cls``.
    on_unsupported: what a contraction that cannot run in FP8 does under an
      enabled autocast: "warn" (default; plain ``lax.dot_general``, a warning
      on the ``te_jax`` logger once per reason) or "raise" (ValueError).

  >>> import jax.numpy as jnp
  >>> import te_jax
  >>> from te_jax import flax as tfx, recipe
  >>> op = tfx.Fp8DotGeneral()
  >>> x, w = jnp.ones((2, 8, 32)), jnp.ones((16, 32))   # contract x's dim 2 with w's dim 1
  >>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
  ...   y = op.apply({}, x, w, (((2,), (1,)), ((), ())))
  >>> y.shape, float(y[0, 0, 0])
  ((2, 8, 16), 32.0)
  """

  impl: str = "auto"
  on_unsupported: str = "warn"

  @nn.compact
  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers,
               precision: Any = None, preferred_element_type: Any = None,
               **kwargs) -> jax.Array:
    """Computes the product; see the class docstring."""
    check_dot_general_call("Fp8DotGeneral", kwargs, self.on_unsupported)
    settings = fp8_module.read_autocast(self.impl)
    states = fp8_module.LinenStates(self)
    args = (lhs, rhs, dimension_numbers, precision, preferred_element_type)
    fp8 = state = None
    if settings.recipe is not None:
      dims = parse_dimension_numbers(lhs, rhs, dimension_numbers)
      fp8 = fp8_blocker(lhs, rhs, dims, preferred_element_type, kwargs) is None
      if fp8:   # a fallback declares no state
        state = states.state(FP8_META, settings.mode)
    if settings.recipe is None:
      y = lax.dot_general(*args, **kwargs)
    else:
      y, _ = dot_general_product("Fp8DotGeneral", settings, state, self.on_unsupported, *args,
                      **kwargs)
    if fp8 and state is not None:
      return y
    return states.keep_unused(y, (FP8_META,))


class Fp8Einsum(nn.Module):
  """``jnp.einsum`` of two operands whose contraction runs as an FP8 GEMM under
  ``fp8_autocast`` (the te_jax counterpart of Flax's ``fp8_ops.Fp8Einsum``).

  Called like ``jnp.einsum(eqn, lhs, rhs, precision=None,
  preferred_element_type=None)`` with ``lhs`` the activation and ``rhs`` the
  weight; the one ``dot_general`` that ``jnp.einsum`` makes of it goes
  through the same path as :class:`Fp8DotGeneral` (same fallbacks; note that
  einsum may pass the operands to it swapped, for an output that lists the
  weight's dims first, which only renames their FP8 roles). Outside an
  autocast it is exactly ``jnp.einsum``. (A bound Linen module cannot be
  ``jnp.einsum``'s ``_dot_general``: einsum hashes it.)

  FP8 state (``DelayedScaling`` only): ``fp8_meta``, declared for every call
  under that recipe (kept unchanged when the contraction falls back).

  Attributes:
    impl, on_unsupported: as in :class:`Fp8DotGeneral`.

  >>> import jax.numpy as jnp
  >>> import te_jax
  >>> from te_jax import flax as tfx, recipe
  >>> x, w = jnp.ones((2, 8, 32)), jnp.ones((32, 4, 16))
  >>> with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8BlockScaling()):
  ...   y = tfx.Fp8Einsum().apply({}, "btd,dhk->bthk", x, w)
  >>> y.shape, float(y[0, 0, 0, 0])
  ((2, 8, 4, 16), 32.0)
  """

  impl: str = "auto"
  on_unsupported: str = "warn"

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
               preferred_element_type: Any = None) -> jax.Array:
    """Computes the einsum; see the class docstring."""
    check_dot_general_call("Fp8Einsum", {}, self.on_unsupported)
    settings = fp8_module.read_autocast(self.impl)
    states = fp8_module.LinenStates(self)
    kw = dict(precision=precision, preferred_element_type=preferred_element_type)
    if settings.recipe is None:
      return states.keep_unused(jnp.einsum(eqn, lhs, rhs, **kw), (FP8_META,))
    state = states.state(FP8_META, settings.mode)
    ran_fp8 = []

    def dot_general(a, b, dimension_numbers, precision=None, preferred_element_type=None,
                    **kwargs):
      y, fp8 = dot_general_product("Fp8Einsum", settings, state, self.on_unsupported, a, b,
                        dimension_numbers, precision, preferred_element_type, **kwargs)
      ran_fp8.append(fp8)
      return y

    # A fresh function per call: einsum's jit cache (keyed on it) never
    # returns a trace made under another recipe or with another state.
    y = jnp.einsum(eqn, lhs, rhs, _dot_general=dot_general, **kw)
    if state is not None and ran_fp8 == [True]:
      return y
    return states.keep_unused(y, (FP8_META,))
