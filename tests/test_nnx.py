"""te_jax.nnx: parity with the Linen modules, the NNX training loop, the FP8 state check.

Parity: the Linen module is initialized, its variables copied into the NNX
module (``load_linen_variables``), and outputs, input gradients, parameter
gradients and FP8 state "gradients" must be equal bit for bit: the same
functional layer runs on the same numbers (FP8 off and every recipe).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import te_jax
from te_jax import fp8_state, recipe
from te_jax import flax as tfx
from te_jax import nnx as tnx

from flax_cases import RECIPES

COLL = fp8_state.FP8_COLLECTION
RECIPE_CASES = ["off"] + list(RECIPES)


def rand(key, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape), dtype)


def _recipe(name):
  return None if name == "off" else RECIPES[name]()


def _loss(y):
  return sum(jnp.sum(jnp.sin(a.astype(jnp.float32))) for a in jax.tree.leaves(y))


def _equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def assert_parity(linen, make_nnx, args, recipe_name, **kw):
  """Linen ``linen`` and the NNX module ``make_nnx()`` with the same variables
  give equal outputs and gradients under ``recipe_name``."""
  r = _recipe(recipe_name)
  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    v = nn.meta.unbox(jax.jit(linen.init)(jax.random.key(0), *args, **kw))
    model = make_nnx()
    tnx.load_linen_variables(model, v)
    assert (COLL in v) == (recipe_name == "delayed")

    def lf(v, args):
      y = linen.apply(v, *args, **kw)
      return _loss(y), y

    def nf(m, args):
      y = m(*args, **kw)
      return _loss(y), y

    (_, yl), (gvl, gxl) = jax.value_and_grad(lf, argnums=(0, 1), has_aux=True)(v, args)
    (_, yn), (gm, gxn) = nnx.value_and_grad(
        nf, argnums=(tnx.diff_state(0), 1), has_aux=True)(model, args)
  _equal(yl, yn)
  _equal(gxl, gxn)
  gvn = tnx.linen_variables(gm)
  _equal(gvl["params"], gvn["params"])
  if COLL in v:
    _equal(gvl[COLL], gvn[COLL])
  return model


X_SHAPE = (2, 64, 128)     # 128 tokens: the fused norm / MLP paths run in FP8


@pytest.mark.parametrize("r", RECIPE_CASES)
def test_linear_parity(r, impl):
  x = rand(0, X_SHAPE, jnp.bfloat16)
  assert_parity(tfx.DenseGeneral((3, 2, 64), use_bias=True, split_output=True, impl=impl),
                lambda: tnx.Linear(128, (3, 2, 64), use_bias=True, split_output=True,
                                   impl=impl, rngs=nnx.Rngs(0)), (x,), r)


@pytest.mark.parametrize("r", RECIPE_CASES)
def test_layernorm_linear_parity(r, impl):
  x = rand(1, X_SHAPE, jnp.bfloat16)
  assert_parity(tfx.LayerNormDenseGeneral(256, use_bias=True, impl=impl),
                lambda: tnx.LayerNormLinear(128, 256, use_bias=True, impl=impl,
                                            rngs=nnx.Rngs(0)), (x,), r)


def test_layernorm_linear_unfused_parity(impl):
  x = rand(2, (2, 10, 128))   # 20 tokens: the norm runs in XLA
  assert_parity(tfx.LayerNormDenseGeneral(64, layernorm_type="rmsnorm",
                                          return_layernorm_output=True, impl=impl),
                lambda: tnx.LayerNormLinear(128, 64, layernorm_type="rmsnorm",
                                            return_layernorm_output=True, impl=impl,
                                            rngs=nnx.Rngs(0)), (x,), "delayed")


@pytest.mark.parametrize("r", RECIPE_CASES)
def test_layernorm_mlp_parity(r, impl):
  x = rand(3, X_SHAPE, jnp.bfloat16)
  assert_parity(tfx.LayerNormMLP(256, activations=("silu", "linear"), use_bias=True,
                                 impl=impl),
                lambda: tnx.LayerNormMLP(128, 256, activations=("silu", "linear"),
                                         use_bias=True, impl=impl, rngs=nnx.Rngs(0)),
                (x,), r)


def test_layernorm_mlp_unfused_parity(impl):
  x = rand(4, (2, 10, 128))
  assert_parity(tfx.LayerNormMLP(64, fuse_activation_quantize=False, impl=impl),
                lambda: tnx.LayerNormMLP(128, 64, fuse_activation_quantize=False,
                                         impl=impl, rngs=nnx.Rngs(0)), (x,), "delayed")


def test_fuse_norm_quantize_false_parity(impl):
  x = rand(4, X_SHAPE, jnp.bfloat16)   # 128 tokens: the fused norm could run
  assert_parity(tfx.LayerNormMLP(64, fuse_norm_quantize=False, impl=impl),
                lambda: tnx.LayerNormMLP(128, 64, fuse_norm_quantize=False,
                                         impl=impl, rngs=nnx.Rngs(0)), (x,), "current")
  assert_parity(tfx.LayerNormDenseGeneral(64, fuse_norm_quantize=False, impl=impl),
                lambda: tnx.LayerNormLinear(128, 64, fuse_norm_quantize=False,
                                            impl=impl, rngs=nnx.Rngs(0)), (x,), "current")


@pytest.mark.parametrize("r", RECIPE_CASES)
def test_attention_parity(r, impl):
  x = rand(5, X_SHAPE, jnp.bfloat16)
  ids = jnp.asarray(np.repeat([[1] * 40 + [2] * 20 + [0] * 4], 2, axis=0), jnp.int32)
  pos = jnp.asarray(np.repeat([list(range(40)) + list(range(20)) + [0] * 4], 2, axis=0))
  assert_parity(tfx.MultiHeadAttention(4, num_gqa_groups=2, enable_rotary_pos_emb=True,
                                       use_bias=True, impl=impl),
                lambda: tnx.MultiHeadAttention(4, 128, num_gqa_groups=2,
                                               enable_rotary_pos_emb=True, use_bias=True,
                                               impl=impl, rngs=nnx.Rngs(0)),
                (x,), r, segment_ids=ids, segment_positions=pos)


@pytest.mark.parametrize("r", RECIPE_CASES)
def test_transformer_layer_parity(r, impl):
  x = rand(8, X_SHAPE, jnp.bfloat16)
  kw = dict(num_gqa_groups=2, enable_rotary_pos_emb=True, layernorm_type="rmsnorm",
            activations=("gelu", "linear"), impl=impl)
  assert_parity(tfx.TransformerLayer(128, 256, 4, **kw),
                lambda: tnx.TransformerLayer(128, 256, 4, rngs=nnx.Rngs(0), **kw), (x,), r)


def test_transformer_layer_fused_pre_norm_parity(impl):
  """Multi-head (Q/K/V in one fused norm + projection) and with every norm in
  XLA (fuse_norm_quantize=False): the NNX layer's numbers are the Linen one's."""
  x = rand(11, X_SHAPE, jnp.bfloat16)
  for kw in (dict(impl=impl, use_bias=True), dict(fuse_norm_quantize=False, impl=impl)):
    assert_parity(tfx.TransformerLayer(128, 256, 4, **kw),
                  lambda kw=kw: tnx.TransformerLayer(128, 256, 4, rngs=nnx.Rngs(0), **kw),
                  (x,), "current")


def test_decoder_layer_with_cross_attention_parity(impl):
  x, enc = rand(9, X_SHAPE, jnp.bfloat16), rand(10, X_SHAPE, jnp.bfloat16)
  kw = dict(num_gqa_groups=2, enable_rotary_pos_emb=True, layernorm_type="rmsnorm",
            activations=("gelu", "linear"), layer_type="decoder", impl=impl)
  assert_parity(tfx.TransformerLayer(128, 256, 4, **kw),
                lambda: tnx.TransformerLayer(128, 256, 4, encoder_hidden_size=128,
                                             rngs=nnx.Rngs(0), **kw),
                (x, enc), "delayed")


def test_structure_matches_linen_and_state_only_under_delayed():
  x = jax.ShapeDtypeStruct((2, 8, 32), jnp.float32)
  kw = dict(layer_type="decoder", num_gqa_groups=2, use_bias=True)
  for name in RECIPE_CASES:
    r = _recipe(name)
    with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
      model = nnx.eval_shape(lambda: tnx.TransformerLayer(32, 64, 4, encoder_hidden_size=24,
                                                          rngs=nnx.Rngs(0), **kw))
      v = jax.eval_shape(tfx.TransformerLayer(32, 64, 4, **kw).init, jax.random.key(0), x,
                         jax.ShapeDtypeStruct((2, 6, 24), jnp.float32))
    shapes = lambda t: jax.tree.map(lambda a: tuple(a.shape), t)
    assert shapes(tnx.linen_variables(model)) == shapes(nn.meta.unbox(v))
    n_state = len(nnx.to_flat_state(nnx.state(model, tnx.FP8State)))
    # self attention's fused qkv (grouped-query too) and out; the cross
    # attention's query, kv and out; wi, wo
    assert n_state == (7 if name == "delayed" else 0)
  assert model.mlp.wi_kernel.get_metadata()["out_sharding"] == ("embed", "act", "mlp")
  assert model.cross_attention.kv.kernel.get_metadata()["out_sharding"] == (
      "embed", "qkv", "heads", "kv")


# ------------------------------------------------------------ training ---

E, MLP_DIM = 32, 64


def _mlp_model():
  return tnx.LayerNormMLP(E, MLP_DIM, rngs=nnx.Rngs(0))


def _make_step(apply=True, argnums=None):
  argnums = tnx.diff_state(0) if argnums is None else argnums

  @nnx.jit
  def step(model, optimizer, x):
    def loss_fn(model):
      return jnp.mean(jnp.square(model(x).astype(jnp.float32) - 1.0))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=argnums)(model)
    optimizer.update(model, grads)
    if apply:
      tnx.apply_fp8_updates(model, grads)
    return loss
  return step


def _history(model):
  return np.asarray(model.wi_fp8_meta.get_value()["x"]["amax_history"])


def _run(step, steps=3, model=None, r=None):
  r = r or recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = model or _mlp_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    hist = []
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for i in range(steps):
        step(model, optimizer, rand(10 + i, (4, 8, E)))
        # The update check reads a count only once the device has finished
        # it (at the next write): wait here, or on a loaded machine the
        # third step can come before the second's count is ready and the
        # warning waits for a fourth (seen once in a full CPU run).
        jax.block_until_ready(nnx.state(model))
        jax.effects_barrier()
        hist.append(_history(model))
  return model, hist, [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]


def test_training_loop_advances_state_and_matches_linen():
  model, hist, warned = _run(_make_step(), steps=3)
  assert not warned
  for i, h in enumerate(hist):     # one new amax per step, newest first
    assert np.count_nonzero(h) == i + 1
  assert float(model.wi_fp8_meta.get_value()["grad"]["scale"]) != 1.0

  # The same three steps with the Linen module and TrainState.
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    layer = tfx.LayerNormMLP(MLP_DIM)
    v = tnx.linen_variables(_mlp_model())     # the NNX model's initial values
    state = train_state.TrainState.create(apply_fn=layer.apply, params=v,
                                          tx=optax.sgd(0.1))

    @jax.jit
    def lstep(state, x):
      def loss_fn(p):
        return jnp.mean(jnp.square(layer.apply(p, x).astype(jnp.float32) - 1.0))
      return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    for i in range(3):
      state = lstep(state, rand(10 + i, (4, 8, E)))
  _equal(state.params, tnx.linen_variables(model))


def test_forgetting_apply_warns_once():
  _, hist, warned = _run(_make_step(apply=False), steps=3)
  assert np.count_nonzero(hist[-1]) == 0           # the state is frozen ...
  assert len(warned) == 1                          # ... and said so, once
  assert "apply_fp8_updates" in str(warned[0].message)


def test_remove_update_check_takes_the_counters_out():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = _mlp_model()
    assert tnx.remove_update_check(model) is model
    assert not any(isinstance(v, tnx.FP8Counters) for _, v in nnx.iter_graph(model))
    checked = _mlp_model()
  # Without the check a forgotten apply_fp8_updates goes unreported ...
  _, hist, warned = _run(_make_step(apply=False), steps=3, model=model, r=r)
  assert np.count_nonzero(hist[-1]) == 0 and warned == []
  # ... and a loop that applies the updates advances the state as before.
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    unchecked = tnx.remove_update_check(_mlp_model())
  _, hist_a, _ = _run(_make_step(), steps=3, model=checked, r=r)
  _, hist_b, warned_b = _run(_make_step(), steps=3, model=unchecked, r=r)
  assert warned_b == [] and np.count_nonzero(hist_b[-1]) > 0
  np.testing.assert_array_equal(hist_a[-1], hist_b[-1])
  # init_fp8_state puts the check back.
  tnx.init_fp8_state(unchecked, r)
  assert any(isinstance(v, tnx.FP8Counters) for _, v in nnx.iter_graph(unchecked))


def _compiled_step_text(apply=True):
  r = recipe.DelayedScaling(amax_history_len=4)
  x = rand(3, (4, 8, E))
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    graphdef, st = nnx.split(_mlp_model())

    def step(st, x):
      model = nnx.merge(graphdef, st)
      loss, grads = nnx.value_and_grad(
          lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))),
          argnums=tnx.diff_state(0))(model)
      if apply:
        tnx.apply_fp8_updates(model, grads)
      return loss, nnx.state(model), grads

    return jax.jit(step).lower(st, x).compile().as_text()


def test_update_check_puts_no_host_wait_in_the_step():
  # A host callback, or a conditional whose predicate the host reads, in the
  # step made the GPU wait for the host every step.
  text = _compiled_step_text(apply=False)    # (with the reset, pending is a constant)
  assert "fp8_counters" in text                     # the counts are in the step ...
  assert " conditional(" not in text                # ... but nothing reads them there
  assert "callback" not in text


def test_loop_over_split_states_is_checked_by_check_fp8_updates():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    graphdef, st = nnx.split(_mlp_model())
    params = nnx.filter_state(st, nnx.Param)

    @jax.jit
    def step(st, x):       # SGD on the parameters, FP8 state never written back
      model = nnx.merge(graphdef, st)
      grads = nnx.grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))),
                       argnums=tnx.diff_state(0))(model)
      new = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                         nnx.filter_state(grads, nnx.Param))
      nnx.update(model, new)
      return nnx.state(model)

    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for i in range(3):
        st = step(st, rand(10 + i, (4, 8, E)))
      assert not [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]
      tnx.check_fp8_updates(st)
  assert params is not None
  warned = [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]
  assert len(warned) == 1 and "LayerNormMLP" in str(warned[0].message)


def test_nnx_update_of_a_frozen_state_warns():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = _mlp_model()
    graphdef, _ = nnx.split(model)

    @jax.jit
    def step(st, x):
      m = nnx.merge(graphdef, st)
      grads = nnx.grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32))))(m)
      nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
      return nnx.state(m)

    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for i in range(4):
        nnx.update(model, jax.block_until_ready(step(nnx.state(model), rand(i, (4, 8, E)))))
  warned = [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]
  assert len(warned) == 1


def test_not_differentiating_the_state_warns():
  # The count of step 2 is read once it is ready: at the latest when step 3
  # is written back.
  _, _, warned = _run(_make_step(apply=False, argnums=0), steps=3)
  assert len(warned) == 1


def test_apply_without_state_grads_raises():
  with pytest.raises(ValueError, match="DiffState"):
    _run(_make_step(apply=True, argnums=0), steps=1)


def test_eval_and_accumulation_do_not_warn():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = _mlp_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def grads_of(model, x):
      f = lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32)))
      return nnx.grad(f, argnums=tnx.diff_state(0))(model)

    @nnx.jit
    def update(model, optimizer, grads):
      optimizer.update(model, grads)
      tnx.apply_fp8_updates(model, grads)

    evaluate = nnx.jit(lambda m, x: m(x))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for i in range(3):
        g = grads_of(model, rand(20 + i, (4, 8, E)))
        g = tnx.accumulate_gradients(g, grads_of(model, rand(30 + i, (4, 8, E))))
        update(model, optimizer, g)
        evaluate(model, rand(40 + i, (4, 8, E)))
        evaluate(model, rand(50 + i, (4, 8, E)))
      jax.effects_barrier()
  assert not [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]
  assert np.count_nonzero(_history(model)) == 3


def test_accumulate_gradients_merges_state_like_linen():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = _mlp_model()
    g = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x)), argnums=tnx.diff_state(0))(m))
    g1, g2 = g(model, rand(1, (4, 8, E))), g(model, rand(2, (4, 8, E)) * 3)
  acc = tnx.linen_variables(tnx.accumulate_gradients(g1, g2))
  ref = fp8_state.accumulate_gradients(tnx.linen_variables(g1), tnx.linen_variables(g2))
  _equal(acc, ref)


def test_state_kept_when_fp8_is_off_for_a_step():
  r = recipe.DelayedScaling(amax_history_len=4)
  step = _make_step()
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    model = _mlp_model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step(model, optimizer, rand(0, (4, 8, E)))
  before = jax.tree.map(np.asarray, nnx.state(model, tnx.FP8State))
  with te_jax.fp8_autocast(enabled=False):
    step2 = _make_step()
    step2(model, optimizer, rand(1, (4, 8, E)))
  _equal(before, jax.tree.map(np.asarray, nnx.state(model, tnx.FP8State)))


def test_init_fp8_state_after_construction():
  model = _mlp_model()                     # FP8 off: no state
  assert not nnx.to_flat_state(nnx.state(model, tnx.FP8State))
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    with pytest.raises(ValueError, match="init_fp8_state"):
      model(rand(0, (2, 8, E)))
    tnx.init_fp8_state(model, r)
    _, hist, warned = _run(_make_step(), steps=2, model=model, r=r)
  assert not warned and np.count_nonzero(hist[-1]) == 2


# ------------------------------------------------------------- errors ---

def test_bad_arguments_raise():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="in_features"):
    tnx.Linear(0, 4, rngs=rngs)
  with pytest.raises(ValueError, match="axis"):
    tnx.Linear((4, 4), 8, axis=-1, rngs=rngs)
  with pytest.raises(ValueError, match="split_output"):
    tnx.Linear(4, 8, split_output=True, rngs=rngs)
  with pytest.raises(ValueError, match="impl"):
    tnx.Linear(4, 8, impl="gpu", rngs=rngs)
  with pytest.raises(ValueError, match="kernel_axes"):
    tnx.Linear(4, 8, kernel_axes=("embed",), rngs=rngs)
  with pytest.raises(ValueError, match="layernorm_type"):
    tnx.LayerNormLinear(4, 8, layernorm_type="batchnorm", rngs=rngs)
  with pytest.raises(ValueError, match="activation"):
    tnx.LayerNormMLP(4, 8, activations=("gelu", "relu", "silu"), rngs=rngs)
  with pytest.raises(ValueError, match="unknown activation"):
    tnx.LayerNormMLP(4, 8, activations=("swoosh",), rngs=rngs)
  with pytest.raises(ValueError, match="num_gqa_groups"):
    tnx.MultiHeadAttention(4, 32, num_gqa_groups=3, rngs=rngs)
  with pytest.raises(ValueError, match="divisible"):
    tnx.MultiHeadAttention(3, 32, rngs=rngs)
  with pytest.raises(ValueError, match="attn_mask_type"):
    tnx.MultiHeadAttention(4, 32, attn_mask_type="sliding", rngs=rngs)
  with pytest.raises(ValueError, match="attention_type"):
    tnx.MultiHeadAttention(4, 32, attention_type="global", rngs=rngs)
  with pytest.raises(ValueError, match="layer_type"):
    tnx.TransformerLayer(32, 64, 4, layer_type="both", rngs=rngs)
  with pytest.raises(ValueError, match="decoder"):
    tnx.TransformerLayer(32, 64, 4, encoder_hidden_size=16, rngs=rngs)
  lin = tnx.Linear(4, 8, rngs=rngs)
  with pytest.raises(ValueError, match="in_features"):
    lin(jnp.ones((2, 5)))
  mha = tnx.MultiHeadAttention(4, 32, rngs=rngs)
  with pytest.raises(ValueError, match="attention_type='cross'"):
    mha(jnp.ones((1, 4, 32)), jnp.ones((1, 4, 32)))
  with pytest.raises(ValueError, match="batch, seq"):
    mha(jnp.ones((4, 32)))
  layer = tnx.TransformerLayer(32, 64, 4, rngs=rngs)
  with pytest.raises(ValueError, match="encoder_hidden_size"):
    layer(jnp.ones((1, 4, 32)), jnp.ones((1, 3, 16)))


def test_state_of_another_history_length_raises():
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
    model = tnx.Linear(32, 32, rngs=nnx.Rngs(0))
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=8)):
    with pytest.raises(ValueError, match="amax_history_len"):
      model(jnp.ones((2, 16, 32)))


def test_apply_with_grads_of_another_model_raises():
  r = recipe.DelayedScaling(amax_history_len=4)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    a, b = _mlp_model(), tnx.Linear(E, E, rngs=nnx.Rngs(1))
    g = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 16, E)))), argnums=tnx.diff_state(0))(b)
  with pytest.raises(ValueError, match="disagree"):
    tnx.apply_fp8_updates(a, g)


def test_load_linen_variables_checks_shapes():
  v = tfx.DenseGeneral(16).init(jax.random.key(0), jnp.ones((2, 8)))
  with pytest.raises(ValueError, match="shape"):
    tnx.load_linen_variables(tnx.Linear(8, 32, rngs=nnx.Rngs(0)), v)
  with pytest.raises(ValueError, match="does not have"):
    tnx.load_linen_variables(tnx.Linear(8, 16, rngs=nnx.Rngs(0)),
                             {"params": dict(nn.meta.unbox(v)["params"], extra=jnp.ones(2))})


# ------------------------------------------------------- the GPT example ---

def test_gpt_nnx_example_trains_and_matches_linen_gpt():
  import train_gpt  # pylint: disable=import-error
  import train_gpt_nnx  # pylint: disable=import-error
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = train_gpt_nnx.train("tiny", "delayed", steps=3, verbose=False)
    jax.effects_barrier()
  assert not [w for w in caught if issubclass(w.category, tnx.FP8StateWarning)]
  assert out["losses"][-1] < out["losses"][0]
  assert np.count_nonzero(out["amax_history"]) == 3

  # The Linen GPT's variables load into the NNX GPT: same loss.
  p = train_gpt.PRESETS["tiny"]
  docs = train_gpt.make_corpus(50)
  batch = tuple(jnp.asarray(a) for a in train_gpt.make_batch(docs, 0, 2, p["seq_len"]))
  r = recipe.DelayedScaling(amax_history_len=16)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
    linen = train_gpt.GPT(train_gpt.VOCAB_SIZE, 64, 2, 2, 128, dtype=jnp.float32)
    v = nn.meta.unbox(linen.init(jax.random.key(0), *batch))
    model = train_gpt_nnx.GPT(train_gpt.VOCAB_SIZE, 64, 2, 2, 128, dtype=jnp.float32,
                              rngs=nnx.Rngs(0))
    tnx.load_linen_variables(model, v)
    ref = train_gpt.loss_fn(linen, v, batch)[0]
    np.testing.assert_array_equal(train_gpt_nnx.loss_fn(model, batch), ref)
