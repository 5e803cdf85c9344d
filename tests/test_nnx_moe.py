"""te_jax.nnx.MoE and TransformerLayer(mlp_type="moe") in NNX.

The NNX module must give the Linen module's numbers from the same variables
(``load_linen_variables``), through a whole training step: output, parameter
gradients and the FP8 state written back by ``apply_fp8_updates``; its FP8
state must have one history per expert however it was made
(``init_fp8_state``); its aux values and router bias live in variables a
training loop reads and the module updates in training mode only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx

from te_jax import flax as tfx, moe, nnx as tnx, recipe
from te_jax.flax.moe import ROUTER_BIAS_COLLECTION

from test_flax_moe import E, F, FP8, FS, H, K, KW, RECIPES, autocast, inputs


def nnx_step(model, x, g):
  """One training step's pieces: (loss, grads) with the aux loss added."""
  def loss_fn(model):
    y = model(x)
    return jnp.sum(y * g) + moe.aux_totals(nnx.state(model, tnx.MoEMetrics))["aux_loss"]
  return nnx.value_and_grad(loss_fn, argnums=tnx.diff_state())(model)


@pytest.mark.parametrize("name", ["off", "delayed", "blockwise"])
def test_nnx_module_equals_the_linen_module_through_a_training_step(name):
  r = RECIPES[name]
  opts = dict(shared_intermediate_dim=FS, load_balancing_coef=0.01)
  x, g = inputs()
  linen = tfx.MoE(**opts, **KW)
  with autocast(r):
    variables = nn.meta.unbox(linen.init(jax.random.key(0), x))
    model = tnx.MoE(H, **opts, **KW, rngs=nnx.Rngs(1))
  tnx.load_linen_variables(model, variables)

  def linen_loss(v):
    y, st = linen.apply(v, x, mutable=["intermediates"])
    return jnp.sum(y * g) + moe.aux_totals(st)["aux_loss"]
  with autocast(r):
    loss, dv = jax.jit(jax.value_and_grad(linen_loss))(variables)
    nloss, grads = nnx.jit(nnx_step)(model, x, g)
  np.testing.assert_array_equal(nloss, loss)
  for k, v in dv["params"].items():
    np.testing.assert_array_equal(grads[k][...], v, err_msg=k)
  tnx.apply_fp8_updates(model, grads)
  if r is not None and r.scaling_mode().uses_state:
    for gemm, want in dv[FP8].items():
      jax.tree.map(np.testing.assert_array_equal, getattr(model, gemm).get_value(), want)
  else:
    assert not nnx.state(model, tnx.FP8State)


def test_init_fp8_state_gives_one_history_per_expert():
  """``te_jax.nnx.init_fp8_state`` on a model made without FP8: the expert
  GEMMs get per-expert kernel histories (E != history length, where a
  broadcast of the scale against the history would fail), no shared-expert
  state without shared experts; apply_fp8_updates then writes them back."""
  r = recipe.DelayedScaling(amax_history_len=3)
  model = tnx.MoE(H, **KW, rngs=nnx.Rngs(0))
  assert not nnx.state(model, tnx.FP8State)
  tnx.init_fp8_state(model, r)
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model, tnx.FP8State)))
  assert set(shapes) == {"wi_fp8_meta", "wo_fp8_meta"}
  assert shapes["wi_fp8_meta"]["kernel"] == {"amax_history": (E, 3), "scale": (E, 1)}
  assert shapes["wi_fp8_meta"]["x"] == {"amax_history": (3,), "scale": ()}
  x, g = inputs(seed=2)
  with autocast(r):
    _, grads = nnx.jit(nnx_step)(model, x, g)
  tnx.apply_fp8_updates(model, grads)
  hist = model.wi_fp8_meta.get_value()["kernel"]["amax_history"]
  want = jnp.max(jnp.abs(model.wi_kernel[...].reshape(E, -1)), axis=1)
  np.testing.assert_allclose(hist[:, 0], want, rtol=1e-6)
  assert not np.asarray(hist[:, 1:]).any()


def test_router_bias_and_metrics_in_train_and_eval_mode():
  rate = 0.01
  model = tnx.MoE(H, router_bias_update_rate=rate, capacity_factor=0.5, **KW,
                  rngs=nnx.Rngs(0))
  assert isinstance(model.router_bias, tnx.RouterBias)
  assert not np.asarray(model.router_bias[...]).any()
  x, _ = inputs(seed=3)
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, x):
    def loss_fn(model):
      y = model(x)
      totals = moe.aux_totals(nnx.state(model, tnx.MoEMetrics))
      return jnp.mean(y ** 2), totals["dropped"]
    (loss, dropped), grads = nnx.value_and_grad(loss_fn, argnums=tnx.diff_state(),
                                                has_aux=True)(model)
    opt.update(model, grads)
    return dropped

  dropped = train_step(model, opt, x)
  aux = model.aux.get_value()
  assert isinstance(aux, moe.MoEAux) and int(dropped) == int(aux.dropped) > 0
  load = aux.tokens_per_expert
  np.testing.assert_allclose(model.router_bias[...], rate * jnp.sign(jnp.mean(load) - load))
  bias = model.router_bias[...]
  model.eval()
  model(x)
  np.testing.assert_array_equal(model.router_bias[...], bias)   # eval: read, not moved
  model.train()
  model(x)
  assert not np.array_equal(model.router_bias[...], bias)


CFG = moe.MoEConfig(num_experts=E, num_experts_per_token=K, shared_intermediate_dim=FS,
                    router_bias_update_rate=0.001, load_balancing_coef=0.01)
LAYER = dict(hidden_size=H, mlp_hidden_size=F, num_attention_heads=2, layer_type="decoder",
             impl="reference")


def test_nnx_transformer_layer_with_moe_equals_linen():
  r = RECIPES["delayed"]
  x, _ = inputs(seed=4)
  seg = jnp.ones(x.shape[:2], jnp.int32).at[:, -3:].set(0)
  linen = tfx.TransformerLayer(mlp_type="moe", moe=CFG, **LAYER)
  with autocast(r):
    variables = nn.meta.unbox(linen.init(jax.random.key(0), x, segment_ids=seg))
    layer = tnx.TransformerLayer(mlp_type="moe", moe=CFG, **LAYER, rngs=nnx.Rngs(1))
    tnx.load_linen_variables(layer, variables)
    y, st = linen.apply(variables, x, segment_ids=seg,
                        mutable=["intermediates", ROUTER_BIAS_COLLECTION])
    ny = layer(x, segment_ids=seg)
  assert not hasattr(layer, "mlp") and isinstance(layer.moe, tnx.MoE)
  np.testing.assert_array_equal(ny, y)
  np.testing.assert_array_equal(layer.moe.router_bias[...],
                                st[ROUTER_BIAS_COLLECTION]["moe"]["bias"])
  np.testing.assert_array_equal(layer.moe.aux.get_value().loss,
                                st["intermediates"]["moe"]["moe_aux"][0].loss)


def test_nnx_module_checks():
  with pytest.raises(ValueError, match="in_features must be an int"):
    tnx.MoE(0, **KW, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="score_function"):
    tnx.MoE(H, score_function="relu", **KW, rngs=nnx.Rngs(0))
  model = tnx.MoE(H, **KW, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="must equal in_features"):
    model(jnp.ones((4, H + 1)))
  with pytest.raises(TypeError, match="needs moe="):
    tnx.TransformerLayer(mlp_type="moe", **LAYER, rngs=nnx.Rngs(0))


def test_router_bias_moves_between_linen_and_nnx():
  """The router bias (Linen: collection "router_bias", NNX: attribute
  router_bias) travels with load_linen_variables / linen_variables: a
  loaded model routes as the Linen one, and a variables dict without it is
  refused, not silently left at zero."""
  r = RECIPES["delayed"]
  x, _ = inputs(seed=5)
  linen = tfx.TransformerLayer(mlp_type="moe", moe=CFG, **LAYER)
  with autocast(r):
    variables = nn.meta.unbox(linen.init(jax.random.key(0), x))
    bias = jax.random.normal(jax.random.key(9), (E,), jnp.float32)
    variables = {**variables, ROUTER_BIAS_COLLECTION: {"moe": {"bias": bias}}}
    layer = tnx.TransformerLayer(mlp_type="moe", moe=CFG, **LAYER, rngs=nnx.Rngs(1))
    tnx.load_linen_variables(layer, variables)
    np.testing.assert_array_equal(layer.moe.router_bias[...], bias)
    np.testing.assert_array_equal(
        tnx.linen_variables(layer)[ROUTER_BIAS_COLLECTION]["moe"]["bias"], bias)
    y = linen.apply(variables, x, deterministic=True)
    np.testing.assert_array_equal(layer(x, deterministic=True), y)
    no_bias = {k: v for k, v in variables.items() if k != ROUTER_BIAS_COLLECTION}
    with pytest.raises(ValueError, match="router_bias/moe/bias"):
      tnx.load_linen_variables(layer, no_bias)
