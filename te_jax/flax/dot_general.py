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

import functools
import logging
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax import lax

from te_jax.flax import fp8_module
from te_jax.layers.gemm import FP8_META, gemm_kernel, gemm_output

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "ON_UNSUPPORTED", "parse_dimension_numbers", "fp8_blocker",
           "log_fallback"]

ON_UNSUPPORTED = ("warn", "raise")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=None)
def log_fallback(reason: str):
  """Warns once per reason (``te_jax`` logger) that a product left FP8."""
  logging.getLogger("te_jax").warning(
      "te_jax.flax.Fp8DotGeneral: runs a plain lax.dot_general (not FP8) because %s. "
      "Pass on_unsupported='raise' to make this an error.", reason)


def _dims(value, what: str, ndim: int) -> Tuple[int, ...]:
  """One entry of ``dimension_numbers`` as a tuple of in-range axes."""
  if isinstance(value, int) and not isinstance(value, bool):
    value = (value,)
  try:
    dims = tuple(int(d) for d in value)
  except (TypeError, ValueError):
    raise ValueError(f"dimension_numbers: {what} must be a sequence of ints, got "
                     f"{value!r}.") from None
  if any(not -ndim <= d < ndim for d in dims):
    raise ValueError(f"dimension_numbers: {what} {dims} out of range for an operand of "
                     f"rank {ndim}.")
  dims = tuple(d % ndim for d in dims)
  if len(set(dims)) != len(dims):
    raise ValueError(f"dimension_numbers: {what} {dims} repeats an axis.")
  return dims


def parse_dimension_numbers(lhs, rhs, dimension_numbers):
  """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` checked against
  the operands' shapes; a ValueError naming the bad part otherwise."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
  except (TypeError, ValueError):
    raise ValueError(
        "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
        f"rhs_batch)) as for lax.dot_general, got {dimension_numbers!r}.") from None
  lc, lb = _dims(lc, "lhs contracting dims", lhs.ndim), _dims(lb, "lhs batch dims", lhs.ndim)
  rc, rb = _dims(rc, "rhs contracting dims", rhs.ndim), _dims(rb, "rhs batch dims", rhs.ndim)
  for name, a, b in (("contracting", lc, rc), ("batch", lb, rb)):
    la, lb_ = [lhs.shape[d] for d in a], [rhs.shape[d] for d in b]
    if la != lb_:
      raise ValueError(f"dimension_numbers: the {name} dims of lhs {a} (sizes {la}) and "
                       f"rhs {b} (sizes {lb_}) must match; lhs {lhs.shape}, rhs "
                       f"{rhs.shape}.")
  if set(lc) & set(lb) or set(rc) & set(rb):
    raise ValueError(f"dimension_numbers {dimension_numbers!r}: an axis is both "
                     "contracting and batch.")
  return (lc, rc), (lb, rb)


def fp8_blocker(lhs, rhs, dims, preferred_element_type, kwargs) -> Optional[str]:
  """Why ``lax.dot_general(lhs, rhs, dims, ...)`` cannot run as an FP8 dense
  (None when it can); ``dims`` as :func:`parse_dimension_numbers` returns."""
  (lc, _), (lb, rb) = dims
  if lb or rb:
    return (f"the contraction has batch dims (lhs {lb}, rhs {rb}); te_jax's FP8 dense "
            "has none")
  if not lc:
    return "the contraction has no contracting dims (an outer product)"
  for name, a in (("lhs", lhs), ("rhs", rhs)):
    if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
      return f"{name} is {jnp.dtype(a.dtype)}, not float32, bfloat16 or float16"
    if a.size == 0:
      return f"{name} is empty (shape {a.shape})"
  if preferred_element_type is not None and not jnp.issubdtype(
      preferred_element_type, jnp.floating):
    return f"preferred_element_type is {jnp.dtype(preferred_element_type)}, not a float"
  if kwargs.get("out_sharding") is not None:
    return "an out_sharding was given"
  return None


def _check_call(op_name: str, kwargs, on_unsupported: str):
  unknown = sorted(set(kwargs) - {"out_sharding"})
  if unknown:
    raise TypeError(f"{op_name} got unexpected keyword arguments {unknown}; it takes "
                    "lax.dot_general's (lhs, rhs, dimension_numbers, precision, "
                    "preferred_element_type, out_sharding).")
  if on_unsupported not in ON_UNSUPPORTED:
    raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got "
                     f"{on_unsupported!r}.")


def _product(op_name, settings, state, on_unsupported, lhs, rhs, dimension_numbers,
             precision=None, preferred_element_type=None, **kwargs):
  """(lhs . rhs as ``lax.dot_general`` defines it, whether it ran in FP8).

  ``settings.recipe`` must not be None; ``state`` is the GEMM's FP8 state
  (None for stateless recipes), unused when the product falls back.
  """
  _check_call(op_name, kwargs, on_unsupported)
  dims = parse_dimension_numbers(lhs, rhs, dimension_numbers)
  reason = fp8_blocker(lhs, rhs, dims, preferred_element_type, kwargs)
  if reason is not None:
    if on_unsupported == "raise":
      raise ValueError(
          f"{op_name} cannot run lhs {lhs.shape} {lhs.dtype} x rhs {rhs.shape} "
          f"{rhs.dtype} with dimension_numbers {dimension_numbers!r} in FP8: {reason}. "
          "Use on_unsupported='warn' to run it as a plain lax.dot_general, or a layer "
          "without the FP8 op for this product.")
    log_fallback(reason)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type, **kwargs), False
  (lc, rc), _ = dims
  lhs_free = tuple(d for d in range(lhs.ndim) if d not in lc)
  rhs_free = tuple(d for d in range(rhs.ndim) if d not in rc)
  compute = jnp.result_type(lhs.dtype, rhs.dtype)
  # x (*lhs_free, *contract) and kernel (*contract, *rhs_free): the te_jax
  # dense layout; transposes that are identities cost nothing.
  x = jnp.transpose(lhs, lhs_free + lc).astype(compute)
  kernel = gemm_kernel(settings, jnp.transpose(rhs, rc + rhs_free), compute)
  y = gemm_output(x, kernel, None, settings, state, contract_ndim=len(lc))
  return y.astype(compute if preferred_element_type is None else preferred_element_type), True


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
    _check_call("Fp8DotGeneral", kwargs, self.on_unsupported)
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
      y, _ = _product("Fp8DotGeneral", settings, state, self.on_unsupported, *args,
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
    _check_call("Fp8Einsum", {}, self.on_unsupported)
    settings = fp8_module.read_autocast(self.impl)
    states = fp8_module.LinenStates(self)
    kw = dict(precision=precision, preferred_element_type=preferred_element_type)
    if settings.recipe is None:
      return states.keep_unused(jnp.einsum(eqn, lhs, rhs, **kw), (FP8_META,))
    state = states.state(FP8_META, settings.mode)
    ran_fp8 = []

    def dot_general(a, b, dimension_numbers, precision=None, preferred_element_type=None,
                    **kwargs):
      y, fp8 = _product("Fp8Einsum", settings, state, self.on_unsupported, a, b,
                        dimension_numbers, precision, preferred_element_type, **kwargs)
      ran_fp8.append(fp8)
      return y

    # A fresh function per call: einsum's jit cache (keyed on it) never
    # returns a trace made under another recipe or with another state.
    y = jnp.einsum(eqn, lhs, rhs, _dot_general=dot_general, **kw)
    if state is not None and ran_fp8 == [True]:
      return y
    return states.keep_unused(y, (FP8_META,))
