"""What the MoE experts keep for their backward (te_jax.moe.experts.activate,
the unfused path: unsharded FP8 experts run te_jax.grouped_mlp instead, whose
spec tests/test_grouped_mlp.py checks).

The activation between the two grouped GEMMs is a custom VJP that keeps its
input h alone and recomputes the derivative behind a barrier with the
cotangent (else XLA merges the recompute with the forward and keeps a
(rows, F) mask from it). Checked here: the default's values and gradients
equal the plain activation differentiated by JAX, bit for bit, for every
recipe, routed and shared experts; the barrier is there; and
``store_act_input_in_fp8`` (the argument, and ``fp8_autocast``'s option
through ``te_jax.flax.MoE`` / ``te_jax.nnx.MoE``) keeps h in E4M3 1x128
tiles: output unchanged, gradients those of a backward handed h rounded by
the test through ``te_jax.quantize``, residual bytes down by exactly h's
difference, a NaN still surfaces (sharded: tests/test_moe_mesh.py).
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import flax as tfx
from te_jax import moe, recipe
from te_jax import nnx as tnx
from te_jax import quantize as q
from te_jax.layers import mlp as mlp_lib
from te_jax.moe import dispatch as dispatch_lib
from te_jax.moe import experts as experts_lib
from te_jax.ops.act_quantize import ACTIVATIONS

import model_memory  # pylint: disable=import-error  (benchmarks/ is on pytest's path)

RECIPES = {
    "none": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}
GATED, SINGLE = ("silu", "linear"), ("gelu",)
T, H, F, FS, E, K = 96, 128, 128, 192, 4, 2


def _plain(h, acts):
  """The activation as the experts computed it before the custom VJP, for
  JAX to differentiate: (M, n_act, F) -> (M, F), float32 inside."""
  hf = h.astype(jnp.float32)
  z = ACTIVATIONS[acts[0]].jax_fn(hf[:, 0])
  for i, name in enumerate(acts[1:], 1):
    z = z * ACTIVATIONS[name].jax_fn(hf[:, i])
  return z.astype(h.dtype)


def _plain_activate(h, activations, **_):
  return _plain(h, tuple(activations))


def _rounded(h):
  """h (M, n_act, F) through te_jax.quantize's public blockwise quantize and
  dequantize: E4M3, 1x128 tiles along n_act * F, power-of-two scales."""
  flat = h.reshape(h.shape[0], -1)
  data, scale_inv = q.quantize_blockwise(flat, (1, 128), jnp.float8_e4m3fn,
                                         power_2_scale=True, impl="reference")
  return q.dequantize_blockwise(data, scale_inv, (1, 128), dtype=h.dtype).reshape(h.shape)


def _rounded_h_activate(h, activations, **_):
  """The spec of store_act_input_in_fp8: the plain activation forward, and
  JAX's derivative of it taken at h rounded by :func:`_rounded`."""
  acts = tuple(activations)

  @jax.custom_vjp
  def f(h):
    return _plain(h, acts)

  def fwd(h):
    return _plain(h, acts), h

  def bwd(h, dz):
    return jax.vjp(lambda v: _plain(v, acts), _rounded(h))[1](dz)
  f.defvjp(fwd, bwd)
  return f(h)


def _inputs(acts, seed=0):
  config = moe.MoEConfig(num_experts=E, num_experts_per_token=K, activations=acts,
                         shared_intermediate_dim=FS)
  params = moe.init_params(jax.random.PRNGKey(seed), config, H, F, shared_intermediate=FS,
                           dtype=jnp.bfloat16)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  return config, params, x, g


def _step(rname, acts, **kw):
  """jit (x, params, g) -> (y, (dx, dparams, dstate)) of moe_block, the
  state's update coming back as its gradient (delayed scaling)."""
  config, params, x, g = _inputs(acts)
  r = RECIPES[rname]
  state = moe.init_fp8_state(r, config, shared=True) if r is not None else None

  @jax.jit
  def step(x, params, state):
    def f(x, p, st):
      return moe.moe_block(x, p, config=config, recipe=r, fp8_state=st, impl="reference",
                           **kw)[0]
    y, vjp = jax.vjp(f, x, params, state)
    return y, vjp(g)
  return lambda: step(x, params, state)


_DEFAULT_STEPS = {}


def _default_step(rname, acts):
  """``_step(rname, acts)()``, the default unfused step, computed once for
  the two tests that compare with it (each has applied :func:`_unfused`)."""
  if (rname, acts) not in _DEFAULT_STEPS:
    _DEFAULT_STEPS[rname, acts] = _step(rname, acts)()
  return _DEFAULT_STEPS[rname, acts]


def _unfused(monkeypatch):
  """FP8 experts through ``activate`` between two grouped dense calls (the
  path expert_mlp takes under shard_map), not te_jax.grouped_mlp's fused
  one (its own spec: tests/test_grouped_mlp.py)."""
  monkeypatch.setattr(experts_lib, "_why_not_fused", lambda *_: "the test asks for it")


def _assert_trees_equal(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("acts", [GATED, SINGLE])
def test_default_equals_the_plain_activation_bit_for_bit(rname, acts, monkeypatch):
  _unfused(monkeypatch)
  got = _default_step(rname, acts)
  monkeypatch.setattr(experts_lib, "activate", _plain_activate)
  want = _step(rname, acts)()
  _assert_trees_equal(got, want)


def test_the_backward_recomputes_behind_a_barrier_with_the_cotangent():
  """The recompute reads h through an optimization barrier that also takes
  dz, so XLA can neither merge it with the forward's values (and keep
  those alive) nor schedule it before dz exists."""
  h = jnp.ones((256, 2, F), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(
      lambda h: jnp.sum(experts_lib.activate(h, GATED).astype(jnp.float32))))(h).jaxpr
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  shapes = [sorted(tuple(v.aval.shape) for v in e.invars) for e in barriers]
  assert [(256, 2, F), (256, F)] in shapes, shapes


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("acts", [GATED, SINGLE])
def test_fp8_act_input_gradients_those_of_h_rounded_to_e4m3(rname, acts, monkeypatch):
  _unfused(monkeypatch)
  default = _default_step(rname, acts)
  got = _step(rname, acts, store_act_input_in_fp8=True)()
  monkeypatch.setattr(experts_lib, "activate", _rounded_h_activate)
  want = _step(rname, acts)()
  # the forward reads h itself: the output is the default's
  np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                np.asarray(default[0], np.float32))
  _assert_trees_equal(got, want)
  # and the rounding moved the gradients (so the spec is not the default)
  dx, dx0 = (np.asarray(v[1][0], np.float32) for v in (got, default))
  assert not np.array_equal(dx, dx0)
  assert np.linalg.norm(dx - dx0) < 0.1 * np.linalg.norm(dx0)


def test_a_nan_in_x_gives_nan_gradients_with_fp8_act_input():
  config, params, x, g = _inputs(GATED)
  x = x.at[3, 5].set(jnp.nan)

  def loss(x, p):
    y = moe.moe_block(x, p, config=config, recipe=RECIPES["blockwise"], impl="reference",
                      store_act_input_in_fp8=True)[0]
    return jnp.sum(y.astype(jnp.float32) * g)
  dx, dp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, params)
  assert np.isnan(np.asarray(dx[3], np.float32)).any()
  for name in ("wi", "wo", "shared_wi", "shared_wo"):
    assert not np.all(np.isfinite(np.asarray(dp[name], np.float32))), name


def test_activate_checks_its_arguments():
  h = jnp.ones((8, 2, 16), jnp.bfloat16)
  with pytest.raises(TypeError, match="store_act_input_in_fp8 must be a bool"):
    experts_lib.activate(h, GATED, store_act_input_in_fp8=1)
  with pytest.raises(ValueError, match="n_act = 2"):
    experts_lib.activate(h, SINGLE)
  with pytest.raises(ValueError, match=r"\(M, n_act, F\)"):
    experts_lib.activate(h.reshape(8, 32), GATED)
  config, params, x, _ = _inputs(GATED)
  with pytest.raises(TypeError, match="store_act_input_in_fp8 must be a bool"):
    moe.moe_block(x, params, config=config, store_act_input_in_fp8="yes")


# --------------------------------------------------------- residual bytes --

def _h_saving(rows):
  """Bytes saved by keeping h (rows, 2 * F') in E4M3 with a float32 scale
  per 128 elements instead of in bfloat16."""
  return rows * 2 - (rows + rows // 128 * 4)


def _residual_bytes(loss, *args):
  return sum(r.nbytes for r in model_memory.saved_residuals(loss, *args) if not r.argument)


def _module_losses(r, config):
  """{name: (loss(variables, x), variables)} of the Linen and NNX MoE made
  under ``r`` (every collection an argument: only what the layer makes is
  a residual). The Linen variables are shapes (jax.eval_shape): the tests
  trace these losses, and only shapes matter to what they check."""
  kw = dict(num_experts=config.num_experts, num_experts_per_token=config.num_experts_per_token,
            activations=config.activations, shared_intermediate_dim=FS)
  x = jnp.ones((2, T // 2, H), jnp.bfloat16)
  linen = tfx.MoE(intermediate_dim=F, dtype=jnp.bfloat16, **kw)
  with te_jax.fp8_autocast(True, r):
    variables = jax.eval_shape(linen.init, jax.random.key(1), x)
    module = tnx.MoE(H, intermediate_dim=F, dtype=jnp.bfloat16, rngs=nnx.Rngs(1), **kw)
  graphdef, state = nnx.split(module)
  mean_sq = lambda y: jnp.mean(y.astype(jnp.float32) ** 2)
  return x, {"linen": (lambda v, x: mean_sq(linen.apply(v, x, mutable=True)[0]),
                       variables),
             "nnx": (lambda s, x: mean_sq(nnx.merge(graphdef, s)(x)), state)}


@pytest.mark.parametrize("rname", ["delayed", "blockwise"])
def test_the_autocast_option_keeps_h_in_fp8_in_the_modules(rname):
  """fp8_autocast(store_act_input_in_fp8=True) reaches the MoE's routed and
  shared experts: the residuals shrink by exactly the difference between h
  in bfloat16 and in E4M3 with its tile scales, for both."""
  r = RECIPES[rname]
  config = moe.MoEConfig(num_experts=E, num_experts_per_token=K, activations=GATED)
  block = experts_lib.token_block(r)
  rows = dispatch_lib.segment_rows(T * K, E, block, None)   # the routed buffer
  saved = _h_saving(rows * 2 * F) + _h_saving(T * 2 * FS)
  x, losses = _module_losses(r, config)
  for name, (loss, variables) in losses.items():
    sizes = []
    for store in (False, True):
      with te_jax.fp8_autocast(True, r, store_act_input_in_fp8=store):
        sizes.append(_residual_bytes(loss, variables, x))
    assert sizes[0] - sizes[1] == saved, (name, sizes, saved)


def test_expert_mlp_residuals_drop_by_h():
  """The grouped expert MLP alone, FP8 off too (the option is a storage
  format, not a GEMM operand)."""
  m = 512
  x = jnp.ones((m, H), jnp.bfloat16)
  sizes = jnp.array([128, 256, 0, 128], jnp.int32)
  wi = jnp.ones((E, H, 2, F), jnp.bfloat16)
  wo = jnp.ones((E, F, H), jnp.bfloat16)
  for r in (None, RECIPES["blockwise"]):
    got = []
    for store in (False, True):
      loss = functools.partial(experts_lib.expert_mlp, group_sizes=sizes, activations=GATED,
                               recipe=r, impl="reference", store_act_input_in_fp8=store)
      got.append(_residual_bytes(lambda x, wi, wo, f=loss: jnp.sum(f(x, wi=wi, wo=wo)),
                                 x, wi, wo))
    assert got[0] - got[1] == _h_saving(m * 2 * F), (r, got)


def test_the_unsharded_module_does_not_warn_about_the_option(caplog):
  """It applies the option (test above), so it no longer warns that it
  cannot (te_jax.layers.mlp's warning, once per reason: its cache cleared)."""
  mlp_lib.warn_act_input_not_in_fp8.cache_clear()
  caplog.set_level(logging.WARNING, logger="te_jax")
  config = moe.MoEConfig(num_experts=E, num_experts_per_token=K, activations=GATED)
  r = RECIPES["blockwise"]
  x, losses = _module_losses(r, config)
  loss, variables = losses["linen"]
  with te_jax.fp8_autocast(True, r, store_act_input_in_fp8=True):
    # traced and lowered (where the warning would be logged), not compiled
    jax.jit(jax.grad(loss)).lower(variables, x)
  assert not [m for m in caplog.messages if "store_act_input_in_fp8" in m], caplog.messages
