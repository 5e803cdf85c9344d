"""te_jax.fused_mlp (activation fused into quantization) and LayerNormMLP's use of it.

The fused core must compute what two ``fp8_dense`` calls around the same
float32 activation compute: the forward exactly (same quantized operands,
same GEMMs), the gradients up to how ``act'`` is evaluated (hand-written
formula in the fused op, autodiff in the emulation: float32 differences of a
few ulps that can move an FP8 rounding by one step, hence a tolerance).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import te_jax
from te_jax import dense, fp8_state, fused_mlp, recipe
from te_jax import flax as tfx
from te_jax.ops import act_quantize as act_op

from flax_cases import RECIPES, mlp_states, rel

M, K, F, N = 256, 128, 256, 128


def _rand(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _args(acts, bias):
  n_act = len(acts)
  x = _rand(0, (M, K))
  wi = _rand(1, (K, n_act * F), 0.09)
  wo = _rand(2, (F, N), 0.06)
  bi = _rand(3, (n_act * F,), 0.1) if bias else None
  bo = _rand(4, (N,), 0.1) if bias else None
  return x, wi, wo, bi, bo


def _fused(x, wi, wo, bi, bo, si, so, r, acts):
  return fused_mlp.fp8_mlp(x, wi, wo, bi, bo, activations=acts, recipe=r, wi_state=si,
                           wo_state=so, impl="reference")


def _emulated(x, wi, wo, bi, bo, si, so, r, acts):
  h = dense.fp8_dense(x, wi, bi, recipe=r, fp8_state=si, impl="reference")
  z = act_op.activation_forward(h, acts)
  return dense.fp8_dense(z, wo, bo, recipe=r, fp8_state=so, impl="reference")


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("acts,bias", [(("gelu",), True), (("silu", "linear"), False),
                                       (("relu",), False), (("gelu", "linear"), True)])
def test_fused_matches_two_dense_layers(rname, acts, bias):
  r = RECIPES[rname]()
  x, wi, wo, bi, bo = _args(acts, bias)
  si, so = mlp_states(r)
  cot = _rand(5, (M, N))
  argn = (0, 1, 2) + ((3, 4) if bias else ())

  def run(fn):
    def f(*a):
      y, vjp = jax.vjp(lambda *p: fn(*p, r, acts), *a)
      return y, vjp(cot)
    return jax.jit(f)(x, wi, wo, bi, bo, si, so)

  y1, g1 = run(_fused)
  y0, g0 = run(_emulated)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
  for i in argn:
    # Gradients: act' by formula vs by autodiff (see the module docstring);
    # a few one-step FP8 differences move a gradient by < 1% in norm.
    assert rel(g1[i], g0[i]) < 1e-2, (i, rel(g1[i], g0[i]))
  if si is not None:
    for new1, new0 in ((g1[5], g0[5]), (g1[6], g0[6])):
      for role in ("x", "kernel"):   # forward amaxes: exact
        np.testing.assert_array_equal(new1[role]["amax_history"], new0[role]["amax_history"])
      np.testing.assert_allclose(new1["grad"]["amax_history"], new0["grad"]["amax_history"],
                                 rtol=1e-5)


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_layernorm_mlp_takes_the_fused_path(rname, monkeypatch):
  x = _rand(6, (2, 128, K)) + 0.3
  m = tfx.LayerNormMLP(intermediate_dim=F, activations=("silu", "linear"),
                       fuse_activation_quantize=True)
  r = RECIPES[rname]()
  with te_jax.fp8_autocast(True, r):
    v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))

  calls = []
  real = fused_mlp.fp8_mlp
  monkeypatch.setattr(fused_mlp, "fp8_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))

  def grads(v, x):
    with te_jax.fp8_autocast(True, r):
      return jax.jit(jax.value_and_grad(
          lambda v, x: jnp.sum(m.apply(v, x) * _rand(7, (2, 128, K))), argnums=(0, 1)))(v, x)

  (l1, g1) = grads(v, x)
  assert calls, "LayerNormMLP did not use the fused core for aligned shapes"
  calls.clear()
  monkeypatch.setattr(fused_mlp, "why_not_supported", lambda *a, **k: "forced unfused")
  (l0, g0) = grads(v, x)
  assert not calls
  # Fused vs unfused module: same math; the activation is evaluated by
  # different float32 formulas (flax's gelu/silu vs the fused op's), so a few
  # FP8 roundings differ: < 1% in norm.
  assert abs(float(l1) - float(l0)) <= 1e-2 * abs(float(l0)) + 1e-3
  for a, b in zip(jax.tree.leaves(g1[0]["params"]), jax.tree.leaves(g0[0]["params"])):
    assert rel(a, b) < 1e-2
  assert rel(g1[1], g0[1]) < 1e-2
  if isinstance(r, recipe.DelayedScaling):   # both paths update the same state
    st1 = g1[0][fp8_state.FP8_COLLECTION]
    st0 = g0[0][fp8_state.FP8_COLLECTION]
    assert jax.tree.structure(st1) == jax.tree.structure(st0)
    np.testing.assert_allclose(st1["wi_fp8_meta"]["x"]["amax_history"],
                               st0["wi_fp8_meta"]["x"]["amax_history"], rtol=1e-6)


def test_fused_path_is_the_default_and_can_be_turned_off(monkeypatch):
  calls = []
  real = fused_mlp.fp8_mlp
  monkeypatch.setattr(fused_mlp, "fp8_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
  x = _rand(10, (2, 128, K))
  for fuse, want in ((None, True), (True, True), (False, False)):
    kw = {} if fuse is None else {"fuse_activation_quantize": fuse}
    m = tfx.LayerNormMLP(intermediate_dim=F, **kw)
    calls.clear()
    with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
      m.apply(nn.unbox(m.init(jax.random.key(0), x)), x)
    assert bool(calls) == want, f"fuse_activation_quantize={fuse}"
  # FP8 off: never the fused core.
  calls.clear()
  m = tfx.LayerNormMLP(intermediate_dim=F)
  m.apply(nn.unbox(m.init(jax.random.key(0), x)), x)
  assert not calls


def test_unaligned_or_dropout_use_the_unfused_path(monkeypatch, caplog):
  from te_jax.layers import mlp as mlp_module  # pylint: disable=import-outside-toplevel
  mlp_module.log_unfused.cache_clear()
  caplog.set_level(logging.INFO, logger="te_jax")
  calls = []
  real = fused_mlp.fp8_mlp
  monkeypatch.setattr(fused_mlp, "fp8_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
  r = recipe.Float8CurrentScaling()
  x = _rand(8, (2, 100, K))          # 200 tokens: not a multiple of 16
  m = tfx.LayerNormMLP(intermediate_dim=F, fuse_activation_quantize=True)
  with te_jax.fp8_autocast(True, r):
    v = nn.unbox(m.init(jax.random.key(0), x))
    y = m.apply(v, x)
  assert y.shape == x.shape and not calls
  assert "200 tokens" in caplog.text and "tokens % 16 == 0" in caplog.text, caplog.text
  m2 = tfx.LayerNormMLP(intermediate_dim=F, intermediate_dropout_rate=0.1,
                        fuse_activation_quantize=True)
  x2 = _rand(9, (2, 128, K))
  with te_jax.fp8_autocast(True, r):
    v2 = nn.unbox(m2.init(jax.random.key(0), x2))
    calls.clear()
    m2.apply(v2, x2, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not calls
    assert "dropout is active" in caplog.text, caplog.text
    m2.apply(v2, x2, deterministic=True)
  assert calls


def test_fp8_mlp_bad_arguments():
  r = recipe.Float8CurrentScaling()
  x, wi, wo, _, _ = _args(("gelu",), False)
  with pytest.raises(ValueError, match=r"wi must have shape"):
    fused_mlp.fp8_mlp(x, wi[:, :128], wo, activations=("gelu",), recipe=r)
  with pytest.raises(ValueError, match=r"M % 16"):
    fused_mlp.fp8_mlp(x[:100], wi, wo, activations=("gelu",), recipe=r)
  # The state checks: both or neither (fused_mlp), then the scaling mode's
  # own check (ScalingMode.check_state), naming the arguments.
  with pytest.raises(ValueError, match=r"wi_state and wo_state: DelayedScaling needs "
                                       r"fp8_state"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=recipe.DelayedScaling())
  st = fp8_state.init_dense_state(4)
  with pytest.raises(ValueError, match=r"wi_state and wo_state must both be given or both "
                                       r"be None"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",),
                      recipe=recipe.DelayedScaling(amax_history_len=4), wi_state=st)
  with pytest.raises(ValueError, match=r"wi_state and wo_state must both be given or both "
                                       r"be None"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r, wo_state=st)
  with pytest.raises(ValueError, match=r"wi_state and wo_state: fp8_state must be None for "
                                       r"Float8CurrentScaling"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r, wi_state=st, wo_state=st)
  with pytest.raises(ValueError, match=r"bo must have shape"):
    fused_mlp.fp8_mlp(x, wi, wo, None, jnp.zeros((3,)), activations=("gelu",), recipe=r)
  with pytest.raises(TypeError, match="recipe"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe="delayed")
  assert not fused_mlp.supported(M, K, F, N, r, ("gelu", "nope"))
  assert "'nope'" in fused_mlp.why_not_supported(M, K, F, N, r, ("gelu", "nope"))
  assert fused_mlp.why_not_supported(M, K, F, N, r, ("gelu",)) == ""
  assert "widths 130" in fused_mlp.why_not_supported(M, 130, F, N, r, ("gelu",))


@pytest.mark.gpu
@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")])
def test_fused_cuda_matches_reference(rname, acts):
  r = RECIPES[rname]()
  x, wi, wo, bi, bo = (None if a is None else a.astype(jnp.bfloat16)
                       for a in _args(acts, True))
  si, so = mlp_states(r)
  cot = _rand(5, (M, N)).astype(jnp.bfloat16)

  def run(impl, device):
    def f(x, wi, wo, bi, bo, si, so, cot):
      y, vjp = jax.vjp(lambda *p: fused_mlp.fp8_mlp(
          p[0], p[1], p[2], p[3], p[4], activations=acts, recipe=r, wi_state=p[5],
          wo_state=p[6], impl=impl), x, wi, wo, bi, bo, si, so)
      return y, vjp(cot)
    args = jax.device_put((x, wi, wo, bi, bo, si, so, cot), device)
    return jax.jit(f)(*args)

  y1, g1 = run("cuda", jax.devices("gpu")[0])
  # The reference runs on the CPU: XLA:GPU's f32 division is not correctly rounded.
  y0, g0 = run("reference", jax.devices("cpu")[0])
  # CUDA and XLA evaluate tanh/exp in float32 with different ulps: a few FP8
  # roundings differ by one step (see tests/test_act_quantize.py), < 1% in norm.
  assert rel(y1, y0) < 1e-2
  for a, b in zip(g1[:5], g0[:5]):
    assert rel(a, b) < 1e-2
