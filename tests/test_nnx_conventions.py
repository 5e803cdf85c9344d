"""te_jax.nnx reads like flax.nnx: argument names, call-time masking, kernel
metadata, biases that cannot be dropped silently, and ``Fp8DotGeneral``, the
``dot_general`` that switches an unmodified ``nnx.Linear`` to FP8 (every
recipe, the delayed state an ``FP8State`` updated by ``apply_fp8_updates``).
"""

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import te_jax
from te_jax import recipe
from te_jax import nnx as tnx
from te_jax.fp8_state import FP8StateWarning
from te_jax.layers import gemm as gemm_lib

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}


def rand(seed, shape, scale=1.0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


# ----------------------------------------------------- MultiHeadAttention --

def _mha(**kw):
  return tnx.MultiHeadAttention(in_features=64, impl="reference", attention_impl="xla",
                                rngs=nnx.Rngs(0), **kw)


def test_mha_takes_nnx_argument_names():
  """num_heads / num_kv_heads (flax.nnx's names) build the same module as
  num_attention_heads / num_gqa_groups (the Linen module's); both spellings
  of one argument must agree."""
  x = rand(1, (2, 16, 64))
  a = _mha(num_heads=4, num_kv_heads=2)
  b = tnx.MultiHeadAttention(num_attention_heads=4, in_features=64, num_gqa_groups=2,
                             impl="reference", attention_impl="xla", rngs=nnx.Rngs(0))
  c = tnx.MultiHeadAttention(4, 64, num_gqa_groups=2, impl="reference",
                             attention_impl="xla", rngs=nnx.Rngs(0))
  assert a.num_heads == a.num_attention_heads == 4 and a.num_gqa_groups == 2
  for other in (b, c):
    np.testing.assert_array_equal(a(x), other(x))
  with pytest.raises(ValueError, match="num_heads=4 and num_attention_heads=2"):
    _mha(num_heads=4, num_attention_heads=2)
  with pytest.raises(TypeError, match="num_heads"):
    tnx.MultiHeadAttention(in_features=64, rngs=nnx.Rngs(0))


def test_mha_call_time_is_causal_and_mask():
  """``is_causal`` at the call overrides the module's attn_mask_type, as
  ``nnx.MultiHeadAttention``'s does; an explicit causal ``mask`` on a
  no_mask module equals is_causal=True."""
  x = rand(2, (2, 16, 64))
  causal, plain = _mha(num_heads=4), _mha(num_heads=4, attn_mask_type="no_mask")
  want_causal, want_plain = causal(x), plain(x)
  assert float(jnp.max(jnp.abs(want_causal - want_plain))) > 1e-3   # they differ
  np.testing.assert_array_equal(causal(x, is_causal=False), want_plain)
  np.testing.assert_array_equal(plain(x, is_causal=True), want_causal)
  np.testing.assert_array_equal(causal(x, is_causal=None), want_causal)
  mask = nnx.make_causal_mask(jnp.ones((2, 16)))
  np.testing.assert_allclose(plain(x, mask=mask), want_causal, rtol=1e-6, atol=1e-6)
  with pytest.raises(TypeError, match="is_causal"):
    plain(x, is_causal="yes")


def test_mha_kernel_metadata_names_the_axes():
  """kernel_metadata / out_kernel_metadata as nnx.MultiHeadAttention's: names
  for NNX's (in, heads, head_dim) kernels serve the fused (in, 3, heads,
  head_dim) kernel with the stacking dim unsharded; other entries are kept."""
  m = _mha(num_heads=4, kernel_metadata={"out_sharding": ("embed", "tp_heads", None),
                                         "note": "q/k/v"},
           out_kernel_metadata={"out_sharding": ("tp_heads", None, "embed")})
  assert m.qkv.kernel.get_metadata("out_sharding") == ("embed", "qkv", "tp_heads", None)
  assert m.qkv.kernel_axes == ("embed", "qkv", "tp_heads", None)
  assert m.qkv.kernel.get_metadata("note") == "q/k/v"
  assert m.out.kernel_axes == ("tp_heads", None, "embed")

  # Grouped-query: the joined (in, heads + 2 groups, head_dim) kernel keeps
  # its joined dim unsharded ("qkv_heads"), saying so when a name was given
  # for it; the other names are the user's.
  with pytest.warns(UserWarning, match="'tp_heads' given for it .* fuse_qkv=False"):
    g = _mha(num_heads=4, num_kv_heads=2,
             kernel_metadata={"out_sharding": ("embed", "tp_heads", None)})
  assert g.qkv.kernel.shape == (64, 4 + 2 * 2, 16)
  assert g.qkv.kernel_axes == ("embed", "qkv_heads", None)
  unfused = _mha(num_heads=4, num_kv_heads=2, fuse_qkv=False,
                 kernel_metadata={"out_sharding": ("embed", "tp_heads", None)})
  assert unfused.kv.kernel_axes == ("embed", "qkv", "tp_heads", None)


# ---------------------------------------------------------- Linear & co --

def test_linear_kernel_metadata_and_with_partitioning():
  """Like nnx.Linear: the kernel's logical names come from kernel_metadata's
  "out_sharding" or from a kernel_init wrapped in nnx.with_partitioning (the
  values are those of the bare initializer); names given twice must agree."""
  init = nnx.initializers.lecun_normal()
  bare = tnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
  boxed = tnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                     rngs=nnx.Rngs(0))
  meta = tnx.Linear(16, 32, kernel_metadata={"out_sharding": ("data", None)},
                    use_bias=True, bias_metadata={"out_sharding": (None,)}, rngs=nnx.Rngs(0))
  assert bare.kernel_axes == ("embed", "mlp")
  assert boxed.kernel_axes == (None, "model")
  assert boxed.kernel.get_metadata("out_sharding") == (None, "model")
  np.testing.assert_array_equal(boxed.kernel[...], bare.kernel[...])
  assert meta.kernel_axes == ("data", None) and meta.bias.get_metadata("out_sharding") == (None,)
  with pytest.raises(ValueError, match="disagree"):
    tnx.Linear(16, 32, kernel_axes=("embed", "mlp"),
               kernel_metadata={"out_sharding": ("embed", "heads")}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="kernel_metadata"):
    tnx.Linear(16, 32, kernel_metadata={"out_sharding": ("embed",)}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", ["linear", "norm_linear", "mlp"])
def test_bias_loaded_into_bias_free_module_raises(kind):
  """te_jax.nnx keeps te_jax.flax's use_bias=False default (the NNX module is
  the Linen one's twin, parameter for parameter: load_linen_variables maps
  default-built modules onto each other). A ported model whose weights come
  from flax.nnx layers (use_bias=True by default) with their biases would
  silently drop them; a bias loaded into a bias-free module now raises at
  the call, naming the fix. (On the old code the call ran, ignoring it.)"""
  x = rand(3, (2, 8, 64))
  if kind == "linear":
    model, names = tnx.Linear(64, 32, rngs=nnx.Rngs(0)), {"bias": (32,)}
    donor = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(donor))
  elif kind == "norm_linear":
    model, names = tnx.LayerNormLinear(64, 32, rngs=nnx.Rngs(0)), {"bias": (32,)}
    donor = tnx.LayerNormLinear(64, 32, use_bias=True, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(donor))
  else:
    model = tnx.LayerNormMLP(64, 128, rngs=nnx.Rngs(0))
    donor = tnx.LayerNormMLP(64, 128, use_bias=True, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(donor))
    names = {"wi_bias": (1, 128)}
  for name, shape in names.items():
    assert getattr(model, name)[...].shape == shape   # nnx.update added it silently
  with pytest.raises(ValueError, match="use_bias=True"):
    model(x)


# ------------------------------------------------------- Fp8DotGeneral --

def _pair(rname, seed=0, features=(64, 96)):
  """An nnx.Linear with te_jax's dot_general and a te_jax.nnx.Linear with the
  same kernel, built under ``rname``'s autocast."""
  rec = RECIPES[rname]
  with te_jax.fp8_autocast(True, rec):
    flax_layer = nnx.Linear(*features, use_bias=False, rngs=nnx.Rngs(seed),
                            dot_general=tnx.Fp8DotGeneral(impl="reference"))
    te_layer = tnx.Linear(*features, impl="reference", rngs=nnx.Rngs(seed + 1))
  te_layer.kernel[...] = flax_layer.kernel[...]
  return flax_layer, te_layer


@nnx.jit
def train_step(model, optimizer, x, y):
  """The training step of docs/nnx.md (mean squared error), jitted; also
  tests/test_nnx_checkpoint.py's."""
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, tnx.WRT))(model)
  optimizer.update(model, grads)
  tnx.apply_fp8_updates(model, grads)
  return loss


def _step(model, x, cot):
  """One training step's gradients (parameters and FP8 state), written back."""
  def loss_fn(model):
    return jnp.sum(model(x) * cot)
  grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, tnx.WRT))(model)
  tnx.apply_fp8_updates(model, grads)
  return grads


@pytest.mark.parametrize("rname", list(RECIPES))
def test_fp8_dot_general_matches_te_linear(rname):
  """nnx.Linear(dot_general=te_jax.nnx.Fp8DotGeneral()) under each recipe runs
  the same FP8 GEMMs as te_jax.nnx.Linear: outputs and kernel gradients equal
  bit for bit over three training steps, the delayed state (an FP8State of
  the op) advanced by apply_fp8_updates exactly like the Linear's; and the
  product is FP8, not the plain dot."""
  flax_layer, te_layer = _pair(rname)
  x, cot = rand(4, (4, 32, 64)), rand(5, (4, 32, 96))
  with te_jax.fp8_autocast(True, RECIPES[rname]):
    for _ in range(3):
      y_f, y_t = flax_layer(x), te_layer(x)
      np.testing.assert_array_equal(y_f, y_t)
      g_f, g_t = _step(flax_layer, x, cot), _step(te_layer, x, cot)
      np.testing.assert_array_equal(g_f["kernel"][...], g_t["kernel"][...])
  plain = x @ flax_layer.kernel[...]
  err = float(jnp.max(jnp.abs(y_f - plain)) / jnp.max(jnp.abs(plain)))
  assert 1e-4 < err < 0.1, err
  if rname == "delayed":
    assert isinstance(flax_layer.dot_general.fp8_meta, tnx.FP8State)
    got = flax_layer.dot_general.fp8_meta.get_value()
    want = te_layer.fp8_meta.get_value()
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert float(got["grad"]["amax_history"][0]) > 0     # the backward's amax arrived
  else:
    assert not hasattr(flax_layer.dot_general, "fp8_meta")


def test_fp8_dot_general_off_is_lax_dot_general():
  """Outside an autocast the op is exactly lax.dot_general (out_sharding too)."""
  layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0), dot_general=tnx.Fp8DotGeneral())
  ref = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  x = rand(6, (3, 64))
  np.testing.assert_array_equal(layer(x), ref(x))


def test_fp8_dot_general_in_jit_and_optimizer_loop():
  """A model of plain nnx layers, switched to FP8 by its dot_generals alone,
  trains under nnx.jit with nnx.Optimizer; the delayed state advances and the
  update check is satisfied."""
  import optax  # pylint: disable=import-outside-toplevel

  class Mlp(nnx.Module):
    def __init__(self, dot_general, rngs):
      self.up = nnx.Linear(64, 128, dot_general=dot_general(), rngs=rngs)
      self.down = nnx.Linear(128, 64, dot_general=dot_general(), rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.gelu(self.up(x)))

  rec = RECIPES["delayed"]
  x, y = rand(7, (8, 16, 64)), rand(8, (8, 16, 64))
  with te_jax.fp8_autocast(True, rec):
    model = Mlp(tnx.Fp8DotGeneral, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    losses = [float(train_step(model, opt, x, y)) for _ in range(4)]
  assert losses[-1] < losses[0]
  hist = model.up.dot_general.fp8_meta.get_value()["x"]["amax_history"]
  assert int(jnp.sum(hist > 0)) == 4     # one amax per step in the history
  tnx.check_fp8_updates(model)            # no FP8StateWarning: the state advanced


def test_fp8_dot_general_cls_stateless_works_delayed_raises():
  """nnx.LinearGeneral(dot_general_cls=Fp8DotGeneral) instantiates the op in
  every call: fine for the stateless recipes, a ValueError under
  DelayedScaling (its state would be new every call, its scales frozen)."""
  x = rand(9, (4, 64))
  layer = nnx.LinearGeneral(64, 32, dot_general_cls=tnx.Fp8DotGeneral, rngs=nnx.Rngs(0))
  with te_jax.fp8_autocast(True, RECIPES["current"]):
    y = layer(x)
  assert y.shape == (4, 32)
  with te_jax.fp8_autocast(True, RECIPES["delayed"]):
    with pytest.raises(ValueError, match="dot_general_cls"):
      layer(x)
    tnx.Fp8DotGeneral()    # built outside a layer's call: fine


def test_fp8_dot_general_shared_by_two_layers_merges():
  """One op instance shared by two layers: one state, updated once per step
  with the largest amax of its two uses (not their sum)."""
  with te_jax.fp8_autocast(True, RECIPES["delayed"]):
    op = tnx.Fp8DotGeneral()
    a = nnx.Linear(64, 64, dot_general=op, rngs=nnx.Rngs(0))
    b = nnx.Linear(64, 64, dot_general=op, rngs=nnx.Rngs(1))
  x = rand(10, (4, 64))
  pair = nnx.List([a, b])
  with te_jax.fp8_autocast(True, RECIPES["delayed"]), warnings.catch_warnings():
    # Evaluating the unchanged pair is not a frozen-state sign, though the
    # shared op sees two kernels per step.
    warnings.simplefilter("error", FP8StateWarning)
    grads = nnx.jit(lambda p: nnx.grad(lambda p: jnp.sum(p[1](p[0](x))),
                                       argnums=nnx.DiffState(0, tnx.WRT))(p))(pair)
    for _ in range(4):
      hidden = nnx.jit(lambda p: p[0](x))(pair)   # b's input, in FP8 as in the step
      nnx.jit(lambda p: p[1](p[0](x)))(pair)
  new = grads[0]["dot_general"]["fp8_meta"].get_value()
  kernel_amax = max(float(jnp.max(jnp.abs(m.kernel[...]))) for m in (a, b))
  x_amax = max(float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(hidden))))
  np.testing.assert_allclose(new["kernel"]["amax_history"][0], kernel_amax, rtol=1e-6)
  np.testing.assert_allclose(new["x"]["amax_history"][0], x_amax, rtol=1e-6)


def test_fp8_dot_general_fallback_warns_once(caplog):
  """A contraction with batch dims runs as the plain lax.dot_general, with one
  warning per reason; on_unsupported='raise' makes it an error."""
  gemm_lib.log_fallback.cache_clear()
  lhs, rhs = rand(11, (3, 8, 16)), rand(12, (3, 16, 4))
  dn = (((2,), (1,)), ((0,), (0,)))
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    with te_jax.fp8_autocast(True, RECIPES["current"]):
      op = tnx.Fp8DotGeneral()
      y = op(lhs, rhs, dn)
      op(lhs, rhs, dn)
      with pytest.raises(ValueError, match="batch dims"):
        tnx.Fp8DotGeneral(on_unsupported="raise")(lhs, rhs, dn)
  np.testing.assert_array_equal(y, lax.dot_general(lhs, rhs, dn))
  msgs = [r.getMessage() for r in caplog.records if r.name == "te_jax"]
  assert len(msgs) == 1 and "batch dims" in msgs[0] and "Fp8DotGeneral" in msgs[0], msgs
  with pytest.raises(ValueError, match="on_unsupported"):
    tnx.Fp8DotGeneral(on_unsupported="ignore")

