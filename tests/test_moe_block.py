"""te_jax.moe.moe_block on one device: the whole layer against a dense reference.

The reference runs every token through every expert and weights the outputs
by the router (float32): what the dispatch, grouped GEMMs and combine must
equal. Tolerances as test_flax_mlp.py (two chained FP8 GEMMs): forward
0.08, gradients 0.15; FP8 off 1e-5.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import moe, recipe
from te_jax.moe import router
from te_jax.ops.act_quantize import ACTIVATIONS

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}
FWD_TOL, GRAD_TOL = 0.08, 0.15
CFG = moe.MoEConfig(num_experts=4, num_experts_per_token=2)
H, F = 128, 128


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def dense_reference(x, params, config=CFG, bias=None, mask=None):
  """Every token through every expert, weighted by the router; (T, H)."""
  r = router.route(x, params["router"], num_experts_per_token=config.num_experts_per_token,
                   score_function=config.score_function,
                   normalize_weights=config.normalize_topk_weights,
                   scaling_factor=config.routed_scaling_factor, bias=bias, token_mask=mask)
  acts = [ACTIVATIONS[a].jax_fn for a in config.activations]
  hp = jax.lax.Precision.HIGHEST

  def mlp(wi, wo):
    h = jnp.einsum("th,haf->taf", x, wi, precision=hp)
    z = acts[0](h[:, 0])
    for i, act in enumerate(acts[1:], 1):
      z = z * act(h[:, i])
    return jnp.dot(z, wo, precision=hp)

  y = jnp.zeros_like(x)
  for e in range(config.num_experts):
    w = jnp.sum(jnp.where(r.expert_ids == e, r.weights, 0.0), axis=1)
    y = y + w[:, None] * mlp(params["wi"][e], params["wo"][e])
  if "shared_wi" in params:
    y = y + mlp(params["shared_wi"], params["shared_wo"])
  return y


def _setup(t=50, shared=True, seed=0, config=CFG):
  params = moe.init_params(jax.random.PRNGKey(seed), config, H, F,
                           shared_intermediate=128 if shared else None)
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((t, H)), jnp.float32)
  g = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((t, H)), jnp.float32)
  return x, params, g


def _value_and_grads(f, x, params, g):
  (y, aux), vjp = jax.vjp(f, x, params)
  return y, aux, vjp((g, jax.tree.map(jnp.zeros_like, aux)))


def _block(r, st, **kw):
  return lambda x, p: moe.moe_block(x, p, config=kw.pop("config", CFG), recipe=r,
                                    fp8_state=st, **kw)


def _compare(got, want, fwd_tol, grad_tol):
  y, _, (dx, dp) = got
  ry, (rdx, rdp) = want
  assert rel(y, ry) < fwd_tol
  assert rel(dx, rdx) < grad_tol
  for name in rdp:
    assert rel(dp[name], rdp[name]) < grad_tol, name


def _reference_grads(x, params, g, **kw):
  ry, vjp = jax.vjp(lambda x, p: dense_reference(x, p, **kw), x, params)
  return ry, vjp(g)


def test_fp8_off_equals_the_dense_reference():
  x, params, g = _setup()
  got = jax.jit(lambda x, p, g: _value_and_grads(_block(None, None), x, p, g))(x, params, g)
  _compare(got, _reference_grads(x, params, g), 1e-5, 1e-5)
  assert int(got[1].dropped) == 0


def _warm_state(r, x, params, g, shared=True):
  """A delayed-scaling state after one step on these inputs."""
  st = moe.init_fp8_state(r, CFG, shared=shared)
  if st is None:
    return None

  def step(st):
    (y, aux), vjp = jax.vjp(lambda s: moe.moe_block(x, params, config=CFG, recipe=r,
                                                    fp8_state=s), st)
    return vjp((g, jax.tree.map(jnp.zeros_like, aux)))[0]
  return jax.jit(step)(st)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_close_to_the_dense_reference(name):
  r = RECIPES[name]
  x, params, g = _setup()
  st = _warm_state(r, x, params, g)
  got = jax.jit(lambda x, p, g: _value_and_grads(_block(r, st), x, p, g))(x, params, g)
  _compare(got, _reference_grads(x, params, g), FWD_TOL, GRAD_TOL)


def test_delayed_state_of_the_experts_and_shared_experts():
  r = RECIPES["delayed"]
  x, params, g = _setup(seed=3)
  st = _warm_state(r, x, params, g)
  hist = st["wi"]["kernel"]["amax_history"]
  assert hist.shape == (4, 4)
  np.testing.assert_allclose(hist[:, 0], jnp.max(jnp.abs(params["wi"]), axis=(1, 2, 3)),
                             rtol=1e-6)
  np.testing.assert_allclose(st["wo"]["kernel"]["amax_history"][:, 0],
                             jnp.max(jnp.abs(params["wo"]), axis=(1, 2)), rtol=1e-6)
  np.testing.assert_allclose(st["shared_wo"]["kernel"]["amax_history"][0],
                             jnp.max(jnp.abs(params["shared_wo"])), rtol=1e-6)
  assert float(st["wo"]["grad"]["amax_history"][0]) > 0


@pytest.mark.parametrize("t, name", [(1, "blockwise"), (3, "off")])
def test_few_tokens(t, name):
  """One token (blockwise: one 128-row group padded from 1 row) and three."""
  x, params, g = _setup(t=t, shared=False, seed=5)
  rec = RECIPES.get(name)
  tols = (1e-5, 1e-5) if rec is None else (FWD_TOL, GRAD_TOL)
  got = jax.jit(lambda x, p, g: _value_and_grads(_block(rec, None), x, p, g))(x, params, g)
  _compare(got, _reference_grads(x, params, g), *tols)


def test_token_mask():
  x, params, g = _setup(t=8, seed=6)
  mask = jnp.asarray([True, False] * 4)
  y, aux = jax.jit(_block(None, None, token_mask=mask))(x, params)
  np.testing.assert_allclose(y, dense_reference(x, params, mask=mask), rtol=1e-5, atol=1e-5)
  shared_only = dense_reference(x, {k: v for k, v in params.items()
                                    if k.startswith("shared")} | {
      "router": params["router"], "wi": 0 * params["wi"], "wo": params["wo"]})
  np.testing.assert_allclose(y[1::2], shared_only[1::2], rtol=1e-5, atol=1e-5)
  assert float(jnp.sum(aux.tokens_per_expert)) == 4 * 2


def test_capacity_mode_counts_drops():
  config = moe.MoEConfig(num_experts=4, num_experts_per_token=1, capacity_factor=1.0)
  x, params, _ = _setup(t=16, shared=False, seed=7, config=config)
  bias = jnp.asarray([100.0, 0.0, 0.0, 0.0])   # every token to expert 0
  y, aux = jax.jit(_block(None, None, config=config, router_bias=bias))(x, params)
  # capacity 16 * 1 / 4 = 4 rows (FP8 off: block 1): 12 of 16 dropped
  assert int(aux.dropped) == 12
  want = dense_reference(x, params, config=config, bias=bias)
  np.testing.assert_allclose(y[:4], want[:4], rtol=1e-5, atol=1e-5)
  assert not np.asarray(y[4:]).any()
  np.testing.assert_array_equal(aux.tokens_per_expert, [16, 0, 0, 0])


def test_bias_balancing_loop_evens_the_load():
  """The training-loop side of bias-based balancing: no gradient, one update
  per step from the step's loads."""
  config = moe.MoEConfig(num_experts=4, num_experts_per_token=1, score_function="sigmoid")
  x, params, _ = _setup(t=64, shared=False, seed=8, config=config)
  x = x + 1.0   # a component every token shares, which the router ...
  params["router"] = params["router"].at[:, 0].add(0.05)   # ... sends to expert 0
  step = jax.jit(lambda b: _block(None, None, config=config, router_bias=b)(x, params)[1])
  bias = jnp.zeros(4)
  first = np.asarray(step(bias).tokens_per_expert)
  for _ in range(30):
    bias = moe.update_balance_bias(bias, step(bias).tokens_per_expert, 0.05)
  last = np.asarray(step(bias).tokens_per_expert)
  assert first.max() > 32 and last.max() < first.max() / 2, (first, last)


def test_aux_losses():
  config = moe.MoEConfig(num_experts=4, num_experts_per_token=2, load_balancing_coef=0.01,
                         z_loss_coef=0.001)
  x, params, _ = _setup(t=10, shared=False, seed=9, config=config)
  _, aux = jax.jit(_block(None, None, config=config))(x, params)
  r = router.route(x, params["router"], num_experts_per_token=2)
  np.testing.assert_allclose(aux.load_balancing_loss, router.load_balancing_loss(r),
                             rtol=1e-6)
  np.testing.assert_allclose(aux.router_z_loss, router.router_z_loss(r), rtol=1e-6)
  np.testing.assert_allclose(aux.loss, 0.01 * aux.load_balancing_loss +
                             0.001 * aux.router_z_loss, rtol=1e-6)
  # the loss trains the router
  g = jax.grad(lambda p: _block(None, None, config=config)(x, p)[1].loss)(params)
  assert np.asarray(g["router"]).any()


_HOST_JAXPR = re.compile(r"\b\w*(callback|outfeed|infeed)\w*\[")
_HOST_HLO = re.compile(r"\b(send|recv|outfeed|infeed)\(|custom_call_target=\"[^\"]*callback",
                       re.IGNORECASE)


def host_transfers(fn, *args):
  """Primitives of ``fn``'s jaxpr (nested ones included) and ops of its
  compiled HLO that talk to the host: callbacks, infeed/outfeed, send/recv."""
  found = _HOST_JAXPR.findall(str(jax.make_jaxpr(fn)(*args)))
  return found + _HOST_HLO.findall(jax.jit(fn).lower(*args).compile().as_text())


def test_training_step_has_no_host_callback():
  r = RECIPES["delayed"]
  x, params, g = _setup(t=20, seed=10)
  st = moe.init_fp8_state(r, CFG, shared=True)

  def step(x, p, st):
    def loss(p, st):
      y, aux = moe.moe_block(x, p, config=CFG, recipe=r, fp8_state=st)
      return jnp.sum(y * g) + aux.loss
    return jax.grad(loss, (0, 1))(p, st)

  assert host_transfers(step, x, params, st) == []

  def step_with_callback(x, p, st):
    jax.debug.callback(lambda v: None, x[0, 0])   # the check must see this one
    return step(x, p, st)
  assert host_transfers(step_with_callback, x, params, st)


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(num_experts=0, num_experts_per_token=1), ValueError, "num_experts must be"),
    (dict(num_experts=2, num_experts_per_token=3), ValueError, "at most num_experts"),
    (dict(num_experts=2, num_experts_per_token=1, score_function="tanh"), ValueError,
     "score_function"),
    (dict(num_experts=2, num_experts_per_token=1, activations="silu"), TypeError,
     "tuple of one or two"),
    (dict(num_experts=2, num_experts_per_token=1, activations=("swiglu",)), ValueError,
     "one or two names"),
    (dict(num_experts=2, num_experts_per_token=1, capacity_factor=0.0), ValueError,
     "capacity_factor"),
    (dict(num_experts=2, num_experts_per_token=1, z_loss_coef=float("nan")), ValueError,
     "z_loss_coef"),
])
def test_config_checks(kw, exc, msg):
  with pytest.raises(exc, match=msg):
    moe.MoEConfig(**kw)


def test_block_argument_checks():
  x, params, _ = _setup(t=4, shared=False)
  with pytest.raises(ValueError, match="params\\['wi'\\] must be"):
    moe.moe_block(x, dict(params, wi=params["wi"][:3]), config=CFG)
  with pytest.raises(ValueError, match="must hold 'router'"):
    moe.moe_block(x, {k: v for k, v in params.items() if k != "router"}, config=CFG)
  with pytest.raises(ValueError, match="token_mask must have shape"):
    moe.moe_block(x, params, config=CFG, token_mask=jnp.ones(5, bool))
  with pytest.raises(ValueError, match="needs fp8_state"):
    moe.moe_block(x, params, config=CFG, recipe=RECIPES["delayed"])
  with pytest.raises(ValueError, match="init_fp8_state"):
    moe.moe_block(x, params, config=CFG, recipe=RECIPES["delayed"],
                  fp8_state=moe.experts.init_expert_states(RECIPES["delayed"], 4)["wi"])
  with pytest.raises(TypeError, match="MoEConfig"):
    moe.moe_block(x, params, config={"num_experts": 4})
  with pytest.raises(ValueError, match="needs a mesh"):
    moe.moe_block(x, params, config=CFG, ep_axis="ep")
