"""FP8 MLP core ``act(x @ wi + bi) @ wo + bo`` with the activation fused into quantization.

Two FP8 dense layers with an activation between them, as one custom VJP, so
that the activation output ``z`` is never written in bf16:

* forward: ``h = x @ wi`` (FP8 GEMM, bf16 out); one pass over ``h`` computes
  ``z = act(h)`` and writes ``z`` quantized, rowwise for the second GEMM and
  columnwise for its weight gradient (``ops.act_quantize.act_quantize``);
* backward: ``dz = g @ wo.T`` (FP8 GEMM, bf16 out); one pass over ``dz`` and
  ``h`` computes ``dh = dz * act'(h)`` and writes it quantized both ways for
  the dgrad and wgrad GEMMs of ``wi`` (``dact_quantize``).

Compared with two ``fp8_dense`` calls and an XLA activation this saves a
write and a read of ``z`` (forward) and of ``dh`` (backward) -- each
``tokens x mlp`` bf16 -- and the backward's peak memory holds no bf16 ``dh``.
Residuals: ``x.T`` and ``z.T`` in FP8, ``h`` in bf16 (the activation's
backward needs it, as it does unfused) and the FP8 kernels.

Numerics: ``z`` and ``dh`` are computed in float32 from the bf16 ``h`` and
quantized directly (the unfused path rounds them to bf16 first), so results
differ from the unfused path by that rounding only.

Shapes are not padded here: :func:`supported` says whether a problem can take
this path (token count a multiple of the recipe's ``token_block``, the other
dims multiples of 128); ``te_jax.flax.LayerNormMLP`` uses the unfused path
otherwise.

Example::

  import jax, jax.numpy as jnp
  from te_jax import fused_mlp, recipe
  x = jnp.ones((256, 512), jnp.bfloat16)
  wi = jnp.ones((512, 2 * 1024), jnp.bfloat16) * 0.01   # gated: 2 x mlp 1024
  wo = jnp.ones((1024, 512), jnp.bfloat16) * 0.01
  y = fused_mlp.fp8_mlp(x, wi, wo, activations=("silu", "linear"),
                        recipe=recipe.Float8CurrentScaling())   # (256, 512)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import recipe as recipe_lib
from te_jax.ops import act_quantize as act_op

__all__ = ["fp8_mlp", "supported"]


class _MlpConfig(NamedTuple):
  recipe: recipe_lib.Recipe
  impl: str
  activations: Tuple[str, ...]
  has_bi: bool
  has_bo: bool

  @property
  def dense(self):
    return dense_lib._Config(self.recipe, self.impl)  # pylint: disable=protected-access


def supported(m: int, k: int, f: int, n: int, recipe: recipe_lib.Recipe,
              activations: Sequence[str]) -> bool:
  """Whether ``fp8_mlp`` takes x (m, k), wi (k, n_act*f), wo (f, n) unpadded."""
  acts = tuple(activations)
  if not 1 <= len(acts) <= 2 or any(a not in act_op.ACTIVATION_NAMES for a in acts):
    return False
  return (m % recipe.token_block == 0 and k % 128 == 0 and f % 128 == 0
          and n % 128 == 0)


# The recipe -> fused-prologue quantize mapping, shared with dense.py's
# split-output backward.
_prologue_mode = dense_lib._prologue_mode  # pylint: disable=protected-access
_scale_kw = dense_lib._scale_kw  # pylint: disable=protected-access
_scaled_pair = dense_lib._scaled_pair  # pylint: disable=protected-access


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _mlp(x, wi, bi, wo, bo, states, cfg):
  y, _ = _mlp_fwd(x, wi, bi, wo, bo, states, cfg)
  return y


def _mlp_fwd(x, wi, bi, wo, bo, states, cfg):
  r, dcfg = cfg.recipe, cfg.dense
  si, so = states if states is not None else (None, None)
  qx, qx_t, amax_x = dense_lib._quantize(x, "x", dcfg, si)  # pylint: disable=protected-access
  qwi, qwi_t, amax_wi = dense_lib._quantize(wi, "kernel", dcfg, si)  # pylint: disable=protected-access
  h = dense_lib._gemm(qx, qwi_t, x.dtype, dcfg, "fprop", bi)  # pylint: disable=protected-access
  qz, qz_t, amax_z = _scaled_pair(act_op.act_quantize(
      h, cfg.activations, mode=_prologue_mode(r), dtype=r.fwd_dtype,
      power_2_scale=r.is_blockwise and r.power_2_scale, impl=cfg.impl,
      **_scale_kw(cfg, so, "x")), r)
  qwo, qwo_t, amax_wo = dense_lib._quantize(wo, "kernel", dcfg, so)  # pylint: disable=protected-access
  y = dense_lib._gemm(qz, qwo_t, x.dtype, dcfg, "fprop", bo)  # pylint: disable=protected-access
  new = None
  if states is not None:
    new = (dense_lib._new_state(si, {"x": amax_x, "kernel": amax_wi}, dcfg),  # pylint: disable=protected-access
           dense_lib._new_state(so, {"x": amax_z, "kernel": amax_wo}, dcfg))  # pylint: disable=protected-access
  protos = tuple(jnp.zeros((0,), a.dtype) for a in (x, wi, wo))
  return y, (qx_t, qwi, h, qz_t, qwo, new, protos)


def _mlp_bwd(cfg, res, g):
  r, dcfg = cfg.recipe, cfg.dense
  qx_t, qwi, h, qz_t, qwo, new, (x_p, wi_p, wo_p) = res
  si, so = new if new is not None else (None, None)
  qg, qg_t, amax_g = dense_lib._quantize(g, "grad", dcfg, so)  # pylint: disable=protected-access
  dz = dense_lib._gemm(qg, qwo, h.dtype, dcfg, "dgrad")  # pylint: disable=protected-access
  dwo = dense_lib._gemm(qz_t, qg_t, wo_p.dtype, dcfg, "wgrad")  # pylint: disable=protected-access
  qdh, qdh_t, amax_dh = _scaled_pair(act_op.dact_quantize(
      dz, h, cfg.activations, mode=_prologue_mode(r), dtype=r.bwd_dtype,
      power_2_scale=r.is_blockwise and r.power_2_scale, impl=cfg.impl,
      **_scale_kw(cfg, si, "grad")), r)
  dx = dense_lib._gemm(qdh, qwi, x_p.dtype, dcfg, "dgrad")  # pylint: disable=protected-access
  dwi = dense_lib._gemm(qx_t, qdh_t, wi_p.dtype, dcfg, "wgrad")  # pylint: disable=protected-access
  dbi = dbo = None
  if cfg.has_bi:   # one more pass over dz and h, only when wi has a bias
    dh = act_op.activation_backward(dz, h, cfg.activations)
    dbi = jnp.sum(dh, axis=0).astype(h.dtype)
  if cfg.has_bo:
    dbo = jnp.sum(g.astype(jnp.float32), axis=0).astype(g.dtype)
  new_states = None
  if new is not None:
    new_states = (dense_lib._new_state(si, {"grad": amax_dh}, dcfg),  # pylint: disable=protected-access
                  dense_lib._new_state(so, {"grad": amax_g}, dcfg))  # pylint: disable=protected-access
  return dx, dwi, dbi, dwo, dbo, new_states


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fp8_mlp(x: jax.Array, wi: jax.Array, wo: jax.Array, bi: Optional[jax.Array] = None,
            bo: Optional[jax.Array] = None, *, activations: Sequence[str],
            recipe: recipe_lib.Recipe, wi_state=None, wo_state=None,
            impl: str = "auto") -> jax.Array:
  """``act(x @ wi + bi) @ wo + bo`` with FP8 GEMMs and fused activation-quantize.

  Args:
    x: (M, K) input (bf16/fp16/fp32).
    wi: (K, n_act * F) up-projection; for two activations the first F columns
      feed ``activations[0]`` and the next F ``activations[1]`` (the gated
      product ``act0(h0) * act1(h1)``).
    wo: (F, N) down-projection.
    bi: optional (n_act * F,) bias of the up-projection.
    bo: optional (N,) bias of the down-projection.
    activations: one or two names of ``te_jax.ops.act_quantize.ACTIVATION_NAMES``.
    recipe: a te_jax recipe.
    wi_state, wo_state: ``DelayedScaling`` states of the two GEMMs
      (``fp8_state.init_dense_state``); their updates come back as their
      gradients. None for the other recipes.
    impl: "auto", "cuda" or "reference".

  Returns:
    (M, N) in ``x.dtype``.

  Raises:
    ValueError: shapes that :func:`supported` rejects, or inconsistent ones.
  """
  acts = tuple(activations)
  if not isinstance(recipe, recipe_lib.Recipe):
    raise TypeError(f"recipe must be a te_jax.recipe recipe, got {recipe!r}.")
  if x.ndim != 2 or wi.ndim != 2 or wo.ndim != 2:
    raise ValueError(f"x, wi, wo must be 2-D, got {x.shape}, {wi.shape}, {wo.shape}.")
  (m, k), (f, n) = x.shape, wo.shape
  if wi.shape != (k, len(acts) * f):
    raise ValueError(f"wi must have shape (K, n_act * F) = ({k}, {len(acts) * f}) for "
                     f"x {x.shape}, wo {wo.shape} and {len(acts)} activation(s); got "
                     f"{wi.shape}.")
  if bi is not None and bi.shape != (len(acts) * f,):
    raise ValueError(f"bi must have shape ({len(acts) * f},), got {bi.shape}.")
  if bo is not None and bo.shape != (n,):
    raise ValueError(f"bo must have shape ({n},), got {bo.shape}.")
  if not supported(m, k, f, n, recipe, acts):
    raise ValueError(
        f"fp8_mlp takes M % {recipe.token_block} == 0 and K, F, N % 128 == 0 with "
        f"activations from {sorted(act_op.ACTIVATION_NAMES)}; got M={m}, K={k}, F={f}, "
        f"N={n}, activations={acts}. Use two te_jax.dense.fp8_dense calls instead.")
  delayed = isinstance(recipe, recipe_lib.DelayedScaling)
  if delayed != (wi_state is not None) or (wi_state is None) != (wo_state is None):
    raise ValueError("wi_state and wo_state must both be given for DelayedScaling and "
                     "both be None otherwise.")
  cfg = _MlpConfig(recipe, impl, acts, bi is not None, bo is not None)
  cast = lambda b: None if b is None else b.astype(x.dtype)
  states = (wi_state, wo_state) if delayed else None
  return _mlp(x, wi.astype(x.dtype), cast(bi), wo.astype(x.dtype), cast(bo), states, cfg)
