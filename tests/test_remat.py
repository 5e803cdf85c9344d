"""te_jax.remat: checkpoint policies that save the FP8 GEMM outputs.

On CPU the FP8 GEMMs run on the reference path, where each GEMM is one XLA
``dot_general``; the number of dots in the jaxpr of the gradient counts the
GEMMs run forward, backward and recomputed. Without a checkpoint an FP8
dense has three (fprop, dgrad, wgrad); under ``jax.checkpoint`` with nothing
saved the fprop runs again in the backward pass; with
``checkpoint_fp8_gemms`` it must not. (On the GPU the GEMMs are custom calls,
which ``checkpoint_dots`` does not see: that is why the outputs are named.)
Gradients, FP8 state updates included, must not change.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import te_jax
from te_jax import dense, fused_mlp, norm_dense, recipe, remat
from te_jax import flax as tfx

from flax_cases import RECIPES

NOTHING = jax.checkpoint_policies.nothing_saveable


def rand(key, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(key).standard_normal(shape), jnp.float32)


def n_dots(f, *args, argnums=0):
  """dot_general count of the jaxpr of grad(f) (forward, backward, recomputed)."""
  return str(jax.make_jaxpr(jax.grad(f, argnums=argnums))(*args)).count("dot_general")


def named_residuals(f, *args, capsys):
  """How many of the residuals jax.checkpoint(f) saves carry the FP8 GEMM name."""
  capsys.readouterr()
  print_saved_residuals(f, *args)
  return capsys.readouterr().out.count(f"named '{remat.FP8_GEMM_NAME}'")


def assert_trees_close(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6), a, b)


def _two_dense(r):
  mode = r.scaling_mode()

  def f(params, x):
    w1, w2, s1, s2 = params
    h = jax.nn.gelu(dense.fp8_dense(x, w1, recipe=r, fp8_state=s1))
    return jnp.sum(jnp.sin(dense.fp8_dense(h, w2, recipe=r, fp8_state=s2)))

  params = (rand(1, (64, 128), 0.1), rand(2, (128, 64), 0.1), mode.init_state(),
            mode.init_state())
  return f, params


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_dense_gemms_saved_not_recomputed(name, capsys):
  f, params = _two_dense(RECIPES[name]())
  x = rand(0, (32, 64))
  base = n_dots(f, params, x)
  assert base == 6                       # 2 layers x (fprop, dgrad, wgrad)
  saved = jax.checkpoint(f, policy=remat.checkpoint_fp8_gemms)
  assert n_dots(saved, params, x) == base
  assert n_dots(jax.checkpoint(f, policy=NOTHING), params, x) == base + 2
  assert n_dots(jax.checkpoint(f), params, x) == base + 2   # the default saves nothing
  assert named_residuals(saved, params, x, capsys=capsys) == 2
  g0 = jax.jit(jax.grad(f))(params, x)
  assert_trees_close(jax.jit(jax.grad(saved))(params, x), g0)   # incl. the FP8 states
  assert_trees_close(jax.jit(jax.grad(jax.checkpoint(f, policy=NOTHING)))(params, x), g0)


def test_union_with_checkpoint_dots_saves_plain_dots_too():
  r = recipe.Float8CurrentScaling()
  wp = rand(3, (64, 64), 0.1)

  def f(w, x):
    h = jnp.tanh(x @ wp)                                  # a plain XLA dot
    return jnp.sum(jnp.sin(dense.fp8_dense(h, w, recipe=r)))

  w, x = rand(1, (64, 32), 0.1), rand(0, (16, 64))
  base = n_dots(f, w, x)
  only_fp8 = n_dots(jax.checkpoint(f, policy=remat.checkpoint_fp8_gemms), w, x)
  union = n_dots(jax.checkpoint(f, policy=remat.checkpoint_dots_and_fp8_gemms), w, x)
  nobatch = n_dots(jax.checkpoint(
      f, policy=remat.checkpoint_dots_with_no_batch_dims_and_fp8_gemms), w, x)
  assert only_fp8 == base + 1      # the plain dot runs again
  assert union == nobatch == base
  g0 = jax.grad(f)(w, x)
  for pol in (remat.checkpoint_fp8_gemms, remat.checkpoint_dots_and_fp8_gemms):
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f, policy=pol))(w, x), g0,
                               rtol=1e-6, atol=1e-6)


def test_split_output_parts_are_named(capsys):
  r = recipe.Float8CurrentScaling()
  w = rand(1, (64, 3 * 128), 0.1)

  def f(w, x):
    q, k, v = dense.fp8_dense_split(x, w, num_splits=3, recipe=r)
    return jnp.sum(jnp.sin(q) * k * jnp.cos(v))   # each part a residual

  x = rand(0, (32, 64))
  saved = jax.checkpoint(f, policy=remat.checkpoint_fp8_gemms)
  assert named_residuals(saved, w, x, capsys=capsys) == 3
  assert n_dots(saved, w, x) == n_dots(f, w, x)
  np.testing.assert_allclose(jax.grad(saved)(w, x), jax.grad(f)(w, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["delayed", "block"])
def test_norm_dense_and_fused_mlp(name, capsys):
  r = RECIPES[name]()
  mode = r.scaling_mode()
  x = rand(0, (128, 128))
  wi, wo, w = rand(1, (128, 256), 0.1), rand(2, (256, 128), 0.1), rand(3, (128, 128), 0.1)
  norm = lambda g, b: norm_dense.NormParams(g, b, "layernorm", 1e-6, False)

  def f(params, x):
    g, b, wi, wo, w, si, so, s = params
    h = fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r, wi_state=si,
                          wo_state=so, norm=norm(g, b))
    y = norm_dense.fp8_norm_dense(jnp.tanh(h), g, b, w, norm_type="layernorm",
                                  epsilon=1e-6, zero_centered_gamma=False, recipe=r,
                                  fp8_state=s)
    return jnp.sum(jnp.sin(y))

  params = (jnp.ones(128), jnp.zeros(128), wi, wo, w, mode.init_state(),
            mode.init_state(), mode.init_state())
  base = n_dots(f, params, x)
  assert base == 9
  saved = jax.checkpoint(f, policy=remat.checkpoint_fp8_gemms)
  # The fused MLP's hidden activation (a residual of its backward) comes back
  # with its first GEMM; its output GEMM and the norm-dense GEMM are saved.
  assert n_dots(saved, params, x) == base + 1
  assert n_dots(jax.checkpoint(f, policy=NOTHING), params, x) == base + 3
  assert named_residuals(saved, params, x, capsys=capsys) == 2
  assert_trees_close(jax.jit(jax.grad(saved))(params, x), jax.jit(jax.grad(f))(params, x))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = tfx.LayerNormDenseGeneral(128, name="ln_dense")(x)
    h = nn.Dense(128, dot_general_cls=tfx.Fp8DotGeneral, name="dense")(jax.nn.gelu(h))
    return x + tfx.LayerNormMLP(256, name="mlp")(h)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_flax_nn_remat_with_the_policy(name):
  x = rand(0, (2, 64, 128))
  plain = _Block()
  with te_jax.fp8_autocast(True, RECIPES[name]()):
    v = jax.jit(plain.init)(jax.random.key(0), x)

    def loss(module):
      return lambda v, x: jnp.sum(jnp.sin(module.apply(v, x)))

    base = n_dots(loss(plain), v, x)
    saved = nn.remat(_Block, policy=remat.checkpoint_fp8_gemms)()
    nothing = nn.remat(_Block, policy=NOTHING)()
    n_saved, n_nothing = n_dots(loss(saved), v, x), n_dots(loss(nothing), v, x)
    g0 = jax.jit(jax.grad(loss(plain)))(v, x)
    g1 = jax.jit(jax.grad(loss(saved)))(v, x)
  # Nothing saved: the fprops of ln_dense, dense and the MLP's first GEMM run
  # again (the block's output itself is kept by the caller). With the policy
  # only the MLP's first GEMM does (its output is a residual of the fused
  # backward, not a saved name).
  assert n_saved == base + 1 and n_nothing == base + 3, (base, n_saved, n_nothing)
  assert_trees_close(g1, g0)
  if name == "delayed":     # the state updates arrive unchanged
    assert te_jax.FP8_COLLECTION in g1


def test_exported():
  assert te_jax.remat is remat and "remat" in te_jax.__all__
  assert remat.FP8_GEMM_NAME == "te_jax_fp8_gemm"
