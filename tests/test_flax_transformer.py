"""te_jax.flax.TransformerLayer: structure, packing passthrough, training per recipe."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
from te_jax import fp8_state, recipe
from te_jax import flax as tfx

E, H, MLP = 32, 4, 64
COLL = fp8_state.FP8_COLLECTION


def rand(key, shape):
  """Gaussian test data from numpy (jax.random would compile per shape)."""
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape), jnp.float32)


def test_encoder_layer_is_pre_ln_composition():
  x = rand(0, (2, 8, E))
  layer = tfx.TransformerLayer(E, MLP, H, layernorm_type="rmsnorm",
                               activations=("silu", "linear"))
  v = jax.jit(layer.init)(jax.random.key(1), x)
  p = nn.unbox(v)["params"]
  assert set(p) == {"pre_attention_norm", "self_attention", "mlp"}
  def composed(p, x):
    h = tfx.RMSNorm().apply({"params": p["pre_attention_norm"]}, x)
    h = tfx.MultiHeadAttention(H, attn_mask_type="no_mask").apply(
        {"params": p["self_attention"]}, h)
    x1 = x + h
    return x1 + tfx.LayerNormMLP(MLP, activations=("silu", "linear"),
                                 layernorm_type="rmsnorm").apply({"params": p["mlp"]}, x1)
  ref = jax.jit(composed)(p, x)
  np.testing.assert_allclose(jax.jit(layer.apply)(v, x), ref, rtol=1e-5, atol=1e-5)


def test_every_param_has_logical_names_and_decoder_cross_attention():
  x = rand(0, (2, 8, E)); enc = rand(1, (2, 6, 24))
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", num_gqa_groups=2,
                               use_bias=True)
  boxed = jax.jit(layer.init)(jax.random.key(0), x, enc)["params"]
  assert {"cross_attention", "pre_cross_attention_norm"} <= set(boxed)
  leaves = jax.tree.leaves(boxed, is_leaf=lambda l: isinstance(l, nn.Partitioned))
  assert len(leaves) > 15
  for leaf in leaves:
    assert isinstance(leaf, nn.LogicallyPartitioned), leaf
    assert len(leaf.names) == leaf.value.ndim and None not in leaf.names
  # decoder self attention is causal: the future does not leak
  v = boxed and {"params": boxed}
  f = jax.jit(layer.apply)
  y1 = f(v, x, enc)
  y2 = f(v, x.at[:, 5:].set(3.0), enc)
  np.testing.assert_allclose(y1[:, :5], y2[:, :5], rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(f(v, x, enc * 2.0) - y1).max()) > 1e-3   # encoder output used
  with pytest.raises(ValueError, match="decoder"):
    tfx.TransformerLayer(E, MLP, H).init(jax.random.key(0), x, enc)


def test_packed_rows_equal_separate_documents():
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", num_gqa_groups=2,
                               enable_rotary_pos_emb=True)
  a, b = rand(1, (1, 6, E)), rand(2, (1, 7, E))
  pad = rand(3, (1, 3, E)) * 10
  x = jnp.concatenate([a, b, pad], axis=1)
  seg = jnp.array([[1] * 6 + [2] * 7 + [0] * 3], jnp.int32)
  pos = jnp.array([list(range(6)) + list(range(7)) + [0] * 3], jnp.int32)
  v = jax.jit(layer.init)(jax.random.key(0), x)
  packed = jax.jit(lambda v, x, s, p: layer.apply(v, x, segment_ids=s,
                                                  segment_positions=p))(v, x, seg, pos)
  f = jax.jit(layer.apply)
  np.testing.assert_allclose(packed[:, :6], f(v, a), rtol=3e-5, atol=3e-5)
  np.testing.assert_allclose(packed[:, 6:13], f(v, b), rtol=3e-5, atol=3e-5)
  assert bool(jnp.all(jnp.isfinite(packed)))


def test_hidden_dropout_deterministic_flag():
  x = rand(0, (2, 8, E))
  layer = tfx.TransformerLayer(E, MLP, H, hidden_dropout=0.5, attention_dropout=0.2,
                               intermediate_dropout=0.2)
  v = jax.jit(layer.init)(jax.random.key(0), x)
  det = jax.jit(layer.apply)(v, x)
  np.testing.assert_allclose(det, jax.jit(tfx.TransformerLayer(E, MLP, H).apply)(v, x),
                             rtol=1e-5, atol=1e-5)
  drop = jax.jit(lambda v, x, k: layer.apply(v, x, deterministic=False,
                                             rngs={"dropout": k}))(v, x, jax.random.key(4))
  assert float(jnp.abs(drop - det).max()) > 1e-2


class TwoLayerModel(nn.Module):
  """Two decoder layers and a linear head (all te_jax modules)."""

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", num_gqa_groups=2,
                               enable_rotary_pos_emb=True,
                               activations=("silu", "linear"), name=f"layer_{i}")(x)
    x = tfx.LayerNorm(name="final_norm")(x)
    return tfx.DenseGeneral(8, kernel_axes=("embed", "vocab"), name="head")(x)


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_two_layer_model_trains(name):
  r = {"delayed": recipe.DelayedScaling(amax_history_len=4),
       "current": recipe.Float8CurrentScaling(), "block": recipe.Float8BlockScaling()}[name]
  x = rand(0, (4, 16, E))
  # a learnable target: a fixed causal function of the inputs
  target = jnp.cumsum(x[..., :8], axis=1) / jnp.sqrt(jnp.arange(1, 17))[None, :, None]
  model = TwoLayerModel()
  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), x))
    assert (COLL in variables) == (name == "delayed")
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.adam(3e-3))

    @jax.jit
    def step(state):
      def loss_fn(p):
        return jnp.mean((state.apply_fn(p, x) - target) ** 2)
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(12):
      state, loss = step(state)
      losses.append(float(loss))
  assert all(np.isfinite(losses)), losses
  assert losses[-1] < 0.7 * losses[0], losses
  if name == "delayed":
    hist = state.params[COLL]["layer_1"]["mlp"]["wo_fp8_meta"]["grad"]["amax_history"]
    assert float(hist[0]) > 0 and float(hist[3]) > 0   # 12 steps filled the history
