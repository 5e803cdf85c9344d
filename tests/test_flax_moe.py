"""te_jax.flax.MoE and TransformerLayer(mlp_type="moe") on one device.

The module must be the functional block ``te_jax.moe.moe_block`` with its
parameters and FP8 state (bit for bit: the same computation), keep one
amax-history entry per step per expert weight under ``DelayedScaling``,
sow its aux values, update its router bias only where a training loop lets
it, and the TransformerLayer option must wire norm -> MoE -> residual.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import te_jax
from te_jax import flax as tfx, fp8_state, moe, recipe
from te_jax.flax.moe import AUX_NAME, ROUTER_BIAS_COLLECTION
from te_jax.layers import moe as moe_core

RECIPES = {
    "off": None,
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}
FP8 = te_jax.fp8_state.FP8_COLLECTION
E, K, H, F, FS = 4, 2, 128, 128, 128
KW = dict(num_experts=E, num_experts_per_token=K, intermediate_dim=F, impl="reference")


def autocast(r):
  return te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r)


def inputs(shape=(2, 24, H), seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
          jnp.asarray(rng.standard_normal(shape), jnp.float32))


def block_params(p):
  """The module's parameters under the functional block's names."""
  names = {"router_kernel": "router", "wi_kernel": "wi", "wo_kernel": "wo",
           "shared_wi_kernel": "shared_wi", "shared_wo_kernel": "shared_wo"}
  return {names[k]: v for k, v in p.items()}


def block_state(variables):
  """The module's FP8 state in the block's layout (kernel scale (E,))."""
  if FP8 not in variables:
    return None
  s = variables[FP8]
  out = {k[:-len("_fp8_meta")]: v for k, v in s.items()}
  for name in ("wi", "wo"):
    out[name] = moe_core._block_layout(out[name])   # pylint: disable=protected-access
  return out


@pytest.mark.parametrize("name", list(RECIPES))
def test_module_is_the_functional_block(name):
  """Output, input and parameter gradients, and the new FP8 state equal
  ``moe_block`` called with the module's parameters and state."""
  r = RECIPES[name]
  module = tfx.MoE(shared_intermediate_dim=FS, load_balancing_coef=0.01, **KW)
  x, g = inputs()
  with autocast(r):
    variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x))

    def module_step(v, x):
      y, vjp = jax.vjp(lambda v, x: module.apply(v, x), v, x)
      return y, vjp(g)
    y, (dv, dx) = jax.jit(module_step)(variables, x)
  config = module.config()
  st = block_state(variables)
  params = block_params(variables["params"])

  def block_step(p, st, x):
    f = lambda p, st, x: moe.moe_block(x, p, config=config, recipe=r, fp8_state=st,
                                       impl="reference")
    (ry, aux), vjp = jax.vjp(f, p, st, x)
    return ry, vjp((g, jax.tree.map(jnp.zeros_like, aux)))
  ry, (rdp, rst, rdx) = jax.jit(block_step)(params, st, x)
  np.testing.assert_array_equal(y, ry)
  np.testing.assert_array_equal(dx, rdx)
  for k, v in block_params(dv["params"]).items():
    np.testing.assert_array_equal(v, rdp[k], err_msg=k)
  if st is None:
    assert FP8 not in variables
  else:
    jax.tree.map(np.testing.assert_array_equal, block_state(dv), rst)


def _train_steps(module, variables, xs, g):
  """Training steps with the FP8 state carried as TrainState.apply_gradients
  carries it (its "gradient" is the next state); returns the states."""
  @jax.jit
  def grads(v, x):
    return jax.grad(lambda v: jnp.sum(module.apply(v, x) * g))(v)
  states = []
  for x in xs:
    dv = grads(variables, x)
    variables = dict(variables, **{FP8: dv[FP8]})
    states.append(variables[FP8])
  return states


def test_delayed_state_takes_one_entry_per_step_and_expert():
  r = RECIPES["delayed"]
  module = tfx.MoE(shared_intermediate_dim=FS, **KW)
  (x1, g), (x2, _) = inputs(seed=2), inputs(seed=3)
  x2 = 3.0 * x2
  with autocast(r):
    variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x1))
    s1, s2 = _train_steps(module, variables, [x1, x2], g)
  wi, wo = variables["params"]["wi_kernel"], variables["params"]["wo_kernel"]
  for s, n in ((s1, 1), (s2, 2)):
    for gemm in ("wi_fp8_meta", "wo_fp8_meta", "shared_wi_fp8_meta", "shared_wo_fp8_meta"):
      for tensor, state in s[gemm].items():
        hist = np.asarray(state["amax_history"])
        assert (hist[..., :n] > 0).all() and not hist[..., n:].any(), (gemm, tensor, n)
  # each expert's kernel history is that expert's weight amax, twice (unchanged weights)
  for state, w in ((s2["wi_fp8_meta"], wi), (s2["wo_fp8_meta"], wo)):
    want = jnp.max(jnp.abs(w.reshape(E, -1)), axis=1)
    np.testing.assert_allclose(state["kernel"]["amax_history"][:, :2],
                               jnp.stack([want, want], 1), rtol=1e-6)
    assert state["kernel"]["scale"].shape == (E, 1)
  # the newest input entry is the second step's (3x larger) input amax
  h1 = s1["wi_fp8_meta"]["x"]["amax_history"]
  h2 = s2["wi_fp8_meta"]["x"]["amax_history"]
  assert float(h2[1]) == float(h1[0]) and float(h2[0]) > 2 * float(h1[0])


def test_microbatches_merge_by_max_of_their_uses():
  """Two microbatches' gradients accumulated (te_jax.fp8_state.accumulate_gradients):
  one history entry, the max of the two microbatches' amaxes."""
  r = RECIPES["delayed"]
  module = tfx.MoE(**KW)
  (x1, g), (x2, _) = inputs(seed=4), inputs(seed=5)
  with autocast(r):
    variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x1))
    grads = jax.jit(lambda v, x: jax.grad(lambda v: jnp.sum(module.apply(v, x) * g))(v))
    d1, d2 = grads(variables, x1), grads(variables, 4.0 * x2)
  merged = fp8_state.accumulate_gradients(d1, d2)[FP8]
  for gemm in ("wi_fp8_meta", "wo_fp8_meta"):
    for tensor in ("x", "kernel", "grad"):
      a1 = d1[FP8][gemm][tensor]["amax_history"][..., 0]
      a2 = d2[FP8][gemm][tensor]["amax_history"][..., 0]
      np.testing.assert_array_equal(merged[gemm][tensor]["amax_history"][..., 0],
                                    jnp.maximum(a1, a2))
      assert not np.asarray(merged[gemm][tensor]["amax_history"][..., 1:]).any()


def test_fp8_state_is_kept_by_a_step_that_does_not_use_it():
  """Made under DelayedScaling, run with FP8 off (an evaluation, a bf16
  phase): the state's "gradient" is the state itself, so
  TrainState.apply_gradients leaves it, shared experts' state included."""
  module = tfx.MoE(shared_intermediate_dim=FS, **KW)
  x, g = inputs(seed=10)
  with autocast(RECIPES["delayed"]):
    variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x))
    variables = dict(variables, **{FP8: _train_steps(module, variables, [x], g)[0]})
  dv = jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x) * g)))(variables)
  jax.tree.map(np.testing.assert_array_equal, dv[FP8], variables[FP8])
  assert float(variables[FP8]["wi_fp8_meta"]["x"]["amax_history"][0]) > 0


def test_aux_values_are_sown_and_the_aux_loss_trains_the_router():
  coefs = dict(load_balancing_coef=0.01, z_loss_coef=0.001)
  module = tfx.MoE(**coefs, **KW)
  x, _ = inputs(seed=6)
  variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x))
  _, state = module.apply(variables, x, mutable=["intermediates"])
  (aux,) = state["intermediates"][AUX_NAME]
  assert isinstance(aux, moe.MoEAux)
  np.testing.assert_allclose(aux.loss, 0.01 * aux.load_balancing_loss +
                             0.001 * aux.router_z_loss, rtol=1e-6)
  assert float(jnp.sum(aux.tokens_per_expert)) == x.shape[0] * x.shape[1] * K
  totals = moe.aux_totals(state)
  assert totals["layers"] == 1 and float(totals["aux_loss"]) == float(aux.loss)

  def loss(params):
    _, st = module.apply({"params": params}, x, mutable=["intermediates"])
    return moe.aux_totals(st)["aux_loss"]
  g = jax.grad(loss)(variables["params"])
  assert np.asarray(g["router_kernel"]).any()
  assert not np.asarray(g["wi_kernel"]).any()   # the aux loss reaches the router only
  _, y_aux = tfx.MoE(return_aux=True, **coefs, **KW).apply(variables, x)
  np.testing.assert_array_equal(y_aux.loss, aux.loss)


def test_capacity_drops_are_counted_in_the_sown_aux():
  module = tfx.MoE(capacity_factor=0.25, **KW)
  x, _ = inputs(seed=7)
  variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x))
  _, state = module.apply(variables, x, mutable=["intermediates"])
  # 48 tokens x 2 = 96 assignments, capacity 0.25 * 96 / 4 = 6 rows per expert
  assert int(moe.aux_totals(state)["dropped"]) >= 96 - 4 * 6


def test_router_bias_moves_only_in_calls_that_may_change_it():
  rate = 0.01
  module = tfx.MoE(router_bias_update_rate=rate, score_function="sigmoid", **KW)
  x, _ = inputs(seed=8)
  variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x))
  bias0 = variables[ROUTER_BIAS_COLLECTION]["bias"]
  assert bias0.shape == (E,) and not np.asarray(bias0).any()
  _, state = module.apply(variables, x, mutable=["intermediates", ROUTER_BIAS_COLLECTION])
  (aux,) = state["intermediates"][AUX_NAME]
  load = aux.tokens_per_expert
  np.testing.assert_allclose(state[ROUTER_BIAS_COLLECTION]["bias"],
                             rate * jnp.sign(jnp.mean(load) - load))
  assert np.asarray(state[ROUTER_BIAS_COLLECTION]["bias"]).any()
  # evaluation (the collection not mutable) reads the bias and leaves it
  y_eval = module.apply(variables, x)
  np.testing.assert_array_equal(y_eval, module.apply(variables, x))
  # the bias picks the experts: a large bias on expert 0 sends every token there
  biased = dict(variables, **{ROUTER_BIAS_COLLECTION: {"bias": jnp.array([9.0, 0, 0, 0])}})
  _, st = module.apply(biased, x, mutable=["intermediates"])
  assert float(st["intermediates"][AUX_NAME][0].tokens_per_expert[0]) == x.shape[0] * x.shape[1]


def test_module_checks():
  x, _ = inputs()
  with pytest.raises(ValueError, match="at most num_experts"):
    tfx.MoE(num_experts=2, num_experts_per_token=3, intermediate_dim=8).init(
        jax.random.key(0), x)
  boxed = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  with pytest.raises(ValueError, match="wi_axes, wo_axes"):
    tfx.MoE(kernel_init=boxed, **KW).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="router_bias_update_rate"):
    tfx.MoE(router_bias_update_rate=-1.0, **KW).init(jax.random.key(0), x)


# ------------------------------------------------------------ TransformerLayer --

LAYER = dict(hidden_size=H, mlp_hidden_size=F, num_attention_heads=2, layer_type="decoder",
             impl="reference")
CFG = moe.MoEConfig(num_experts=E, num_experts_per_token=K, shared_intermediate_dim=FS,
                    router_bias_update_rate=0.001)


@pytest.mark.parametrize("name", ["off", "delayed"])
def test_transformer_layer_puts_the_moe_in_place_of_the_mlp(name):
  """y = x1 + MoE(norm(x1)) with x1 = x + attention: checked from the
  captured outputs of the submodules; padding tokens go to no expert."""
  r = RECIPES[name]
  layer = tfx.TransformerLayer(mlp_type="moe", moe=CFG, **LAYER)
  x, _ = inputs(seed=9)
  seg = jnp.ones(x.shape[:2], jnp.int32).at[:, -5:].set(0)
  with autocast(r):
    variables = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x, segment_ids=seg))
    y, state = layer.apply(variables, x, segment_ids=seg, capture_intermediates=True,
                           mutable=["intermediates"])
  params = variables["params"]
  assert "mlp" not in params and {"pre_mlp_norm", "moe"} <= set(params)
  assert set(variables[ROUTER_BIAS_COLLECTION]) == {"moe"}
  inter = state["intermediates"]
  x1 = inter["self_attention"]["__call__"][0]   # the attention adds its residual x itself
  normed = inter["pre_mlp_norm"]["__call__"][0]
  moe_out = inter["moe"]["__call__"][0]
  (aux,) = inter["moe"][AUX_NAME]
  np.testing.assert_allclose(normed, tfx.LayerNorm().apply(
      {"params": params["pre_mlp_norm"]}, x1), rtol=1e-6, atol=1e-6)
  sub = {"params": params["moe"], ROUTER_BIAS_COLLECTION: variables[ROUTER_BIAS_COLLECTION]["moe"]}
  if FP8 in variables:
    sub[FP8] = variables[FP8]["moe"]
  with autocast(r):
    want = tfx.MoE(intermediate_dim=F, impl="reference", **{
        f: getattr(CFG, f) for f in moe_core.CONFIG_FIELDS}).apply(sub, normed,
                                                                     token_mask=seg != 0)
  np.testing.assert_array_equal(moe_out, want)
  np.testing.assert_allclose(y, x1 + moe_out, rtol=1e-6, atol=1e-6)
  assert float(jnp.sum(aux.tokens_per_expert)) == int(jnp.sum(seg != 0)) * K


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(mlp_type="moe"), TypeError, "needs moe=te_jax.moe.MoEConfig"),
    (dict(mlp_type="sparse"), ValueError, "mlp_type must be one of"),
    (dict(moe=CFG), ValueError, "mlp_type='dense'"),
    (dict(mlp_type="moe", moe=CFG, use_bias=True), ValueError, "no biases"),
    (dict(mlp_type="moe", moe=CFG, intermediate_dropout=0.1), ValueError,
     "intermediate dropout"),
])
def test_transformer_layer_moe_options_are_checked(kw, exc, msg):
  x, _ = inputs()
  with pytest.raises(exc, match=msg):
    tfx.TransformerLayer(**LAYER, **kw).init(jax.random.key(0), x)
