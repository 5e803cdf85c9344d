"""te_jax.flax.Fp8DotGeneral as Flax's ``dot_general_cls``.

With FP8 on, ``nn.Dense`` / ``nn.DenseGeneral`` with the op run the same
functional layer as ``te_jax.flax.DenseGeneral`` and must agree with it (to
float32 rounding: the bias is added after the GEMM instead of in it) and with
the float32 product within FP8 tolerance (FWD_TOL / GRAD_TOL as in
test_flax_dense.py). With FP8 off they must equal the plain Flax module
bit for bit.
"""

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax import lax

import te_jax
from te_jax import fp8_state, recipe
from te_jax import flax as tfx
from te_jax.flax import dot_general as dg

from flax_cases import RECIPES, rel

FWD_TOL = 0.08
GRAD_TOL = 0.15
COLL = fp8_state.FP8_COLLECTION
OP = "Fp8DotGeneral_0"


def rand(key, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(key).standard_normal(shape), jnp.float32)


def fwd_and_grads(module, variables, x, cot):
  """Output and gradients (variables, input) of sum(module(x) * cot), jitted afresh
  (the recipe is read at trace time)."""
  def f(v, x):
    y, vjp = jax.vjp(module.apply, v, x)
    return y, vjp(cot)
  return jax.jit(f)(variables, x)


def op_cls(impl="auto", **kw):
  return functools.partial(tfx.Fp8DotGeneral, impl=impl, **kw)


def _warm_delayed(module, v, x, cot):
  """One step so that the delayed scales come from real amaxes."""
  _, (g, _) = fwd_and_grads(module, v, x, cot)
  return fp8_state.apply_fp8_updates(v, g)


# ------------------------------------------------- nn.Dense / DenseGeneral --

@pytest.mark.parametrize("name", sorted(RECIPES))
def test_nn_dense_matches_te_dense_general(name, impl):
  x, cot = rand(0, (2, 24, 64)), rand(1, (2, 24, 96))
  flax_m = nn.Dense(96, use_bias=True, dot_general_cls=op_cls(impl))
  te_m = tfx.DenseGeneral(96, use_bias=True, impl=impl)
  plain = nn.Dense(96, use_bias=True)
  v = plain.init(jax.random.key(0), x)
  v = {"params": dict(v["params"], bias=rand(2, (96,), 0.1))}
  ry, (rgv, rgx) = fwd_and_grads(plain, v, x, cot)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    init = jax.jit(flax_m.init)(jax.random.key(0), x)
    assert set(init["params"]) == {"kernel", "bias"}   # the op adds no parameter
    vf, vt = v, v
    if name == "delayed":
      assert set(init[COLL]) == {OP} and set(init[COLL][OP]) == {"fp8_meta"}
      vf = dict(v, **{COLL: init[COLL]})
      vt = dict(v, **{COLL: init[COLL][OP]})
      vf, vt = _warm_delayed(flax_m, vf, x, cot), _warm_delayed(te_m, vt, x, cot)
    else:
      assert COLL not in init
    y, (gv, gx) = fwd_and_grads(flax_m, vf, x, cot)
    ty, (tgv, tgx) = fwd_and_grads(te_m, vt, x, cot)
  assert rel(y, ty) < 1e-6 and rel(gx, tgx) < 1e-6
  for k in ("kernel", "bias"):
    assert rel(gv["params"][k], tgv["params"][k]) < 1e-6, k
  if name == "delayed":   # the same state update
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 gv[COLL][OP], tgv[COLL])
  e_y, e_x, e_k = rel(y, ry), rel(gx, rgx), rel(gv["params"]["kernel"],
                                                 rgv["params"]["kernel"])
  assert e_y < FWD_TOL and e_x < GRAD_TOL and e_k < GRAD_TOL, (e_y, e_x, e_k)
  assert e_y > 1e-4    # FP8 really ran


@pytest.mark.parametrize("enabled", [None, False])
def test_fp8_off_is_the_plain_flax_module_exactly(enabled):
  x, cot = rand(0, (3, 10, 40)), rand(1, (3, 10, 24))
  flax_m = nn.Dense(24, use_bias=True, dot_general_cls=tfx.Fp8DotGeneral)
  plain = nn.Dense(24, use_bias=True)
  v = plain.init(jax.random.key(0), x)
  ry, (rgv, rgx) = fwd_and_grads(plain, v, x, cot)
  ctx = (te_jax.fp8_autocast(enabled=False, fp8_recipe=recipe.DelayedScaling())
         if enabled is False else te_jax.fp8_autocast(enabled=False))
  with ctx:
    init = flax_m.init(jax.random.key(0), x)
    y, (gv, gx) = fwd_and_grads(flax_m, v, x, cot)
  assert jax.tree.structure(init) == jax.tree.structure(v)
  np.testing.assert_array_equal(y, ry)
  np.testing.assert_array_equal(gx, rgx)
  jax.tree.map(np.testing.assert_array_equal, gv, rgv)


@pytest.mark.parametrize("name", ["delayed", "block"])
def test_nn_dense_general_multi_axis(name):
  x, cot = rand(0, (2, 16, 4, 32)), rand(1, (2, 16, 3, 128))
  kw = dict(features=(3, 128), axis=(-2, -1))
  flax_m = nn.DenseGeneral(**kw, dot_general_cls=tfx.Fp8DotGeneral)
  te_m = tfx.DenseGeneral(**kw)
  v = nn.DenseGeneral(**kw).init(jax.random.key(0), x)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    init = flax_m.init(jax.random.key(0), x)
    vf, vt = v, v
    if name == "delayed":
      vf, vt = dict(v, **{COLL: init[COLL]}), dict(v, **{COLL: init[COLL][OP]})
    y, (gv, gx) = fwd_and_grads(flax_m, vf, x, cot)
    ty, (tgv, tgx) = fwd_and_grads(te_m, vt, x, cot)
  assert y.shape == (2, 16, 3, 128)
  assert rel(y, ty) < 1e-6 and rel(gx, tgx) < 1e-6
  assert rel(gv["params"]["kernel"], tgv["params"]["kernel"]) < 1e-6
  ref = jnp.einsum("bshd,hdef->bsef", x, v["params"]["kernel"])
  assert 1e-4 < rel(y, ref) < FWD_TOL


def test_nn_dense_general_middle_axis_is_transposed_by_the_op():
  """Contracting axis 1 of a 3-D input: lax.dot_general's output order
  (free lhs dims, then features), FP8 close to the float32 product."""
  x, cot = rand(0, (4, 64, 8)), rand(1, (4, 8, 32))
  flax_m = nn.DenseGeneral(32, axis=1, dot_general_cls=tfx.Fp8DotGeneral)
  plain = nn.DenseGeneral(32, axis=1)
  v = plain.init(jax.random.key(0), x)
  ry, (_, rgx) = fwd_and_grads(plain, v, x, cot)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
    y, (_, gx) = fwd_and_grads(flax_m, v, x, cot)
  assert y.shape == ry.shape == (4, 8, 32)
  assert 1e-4 < rel(y, ry) < FWD_TOL and rel(gx, rgx) < GRAD_TOL


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_arbitrary_contracting_dims(name):
  """Contracting dims in any position of either operand, any order."""
  lhs, rhs = rand(0, (5, 48, 6)), rand(1, (6, 7, 48))
  dn = (((1, 2), (2, 0)), ((), ()))
  ref = lax.dot_general(lhs, rhs, dn)
  cot = rand(2, ref.shape)
  op = tfx.Fp8DotGeneral()

  def f(v, a, b):
    y, vjp = jax.vjp(lambda v, a, b: op.apply(v, a, b, dn), v, a, b)
    return y, vjp(cot)

  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    v = op.init(jax.random.key(0), lhs, rhs, dn)
    y, (_, ga, gb) = jax.jit(f)(v, lhs, rhs)
  ra, rb = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs)[1](cot)
  assert y.shape == (5, 7) and y.dtype == jnp.float32
  assert 1e-4 < rel(y, ref) < FWD_TOL
  assert rel(ga, ra) < GRAD_TOL and rel(gb, rb) < GRAD_TOL


def test_preferred_element_type_and_mixed_dtypes():
  lhs, rhs = rand(0, (16, 64)).astype(jnp.bfloat16), rand(1, (64, 32)).astype(jnp.bfloat16)
  dn = (((1,), (0,)), ((), ()))
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
    y = tfx.Fp8DotGeneral().apply({}, lhs, rhs, dn, preferred_element_type=jnp.float32)
    y16 = tfx.Fp8DotGeneral().apply({}, lhs, rhs, dn)
  assert y.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
  assert rel(y, lax.dot_general(lhs, rhs, dn, preferred_element_type=jnp.float32)) < FWD_TOL


# ---------------------------------------------------------------- einsum --

class _EinsumProj(nn.Module):
  """An einsum layer of one's own, with the FP8 einsum op."""
  eq: str
  shape: tuple

  @nn.compact
  def __call__(self, x):
    k = self.param("kernel", nn.initializers.lecun_normal(), self.shape)
    return tfx.Fp8Einsum()(self.eq, x, k)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_einsum_matches_te_dense_general(name):
  x, cot = rand(0, (2, 32, 64)), rand(1, (2, 32, 4, 32))
  m = _EinsumProj("btd,dhk->bthk", (64, 4, 32))
  te_m = tfx.DenseGeneral((4, 32))
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    v = m.init(jax.random.key(0), x)
    vt = {"params": v["params"]}
    if name == "delayed":
      vt[COLL] = v[COLL]["Fp8Einsum_0"]
      v, vt = _warm_delayed(m, v, x, cot), _warm_delayed(te_m, vt, x, cot)
      assert float(v[COLL]["Fp8Einsum_0"]["fp8_meta"]["grad"]["amax_history"][0]) > 0
    else:
      assert COLL not in v
    y, (gv, gx) = fwd_and_grads(m, v, x, cot)
    ty, (tgv, tgx) = fwd_and_grads(te_m, vt, x, cot)
  assert rel(y, ty) < 1e-6 and rel(gx, tgx) < 1e-6
  assert rel(gv["params"]["kernel"], tgv["params"]["kernel"]) < 1e-6
  if name == "delayed":
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 gv[COLL]["Fp8Einsum_0"], tgv[COLL])
  assert 1e-4 < rel(y, jnp.einsum("btd,dhk->bthk", x, v["params"]["kernel"])) < FWD_TOL


def test_fp8_einsum_off_exact_and_fallback(caplog):
  dg.log_fallback.cache_clear()
  q, k = rand(0, (2, 4, 8, 16)), rand(1, (2, 4, 8, 16))
  eq = "bhqd,bhkd->bhqk"     # attention scores: batch dims, not an FP8 dense
  ref = jnp.einsum(eq, q, k)
  np.testing.assert_array_equal(tfx.Fp8Einsum().apply({}, eq, q, k), ref)
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    with te_jax.fp8_autocast(True, recipe.DelayedScaling()):
      v = tfx.Fp8Einsum().init(jax.random.key(0), eq, q, k)
      y = tfx.Fp8Einsum().apply(v, eq, q, k)
      gv = jax.grad(lambda v: jnp.sum(tfx.Fp8Einsum().apply(v, eq, q, k)))(v)
  np.testing.assert_allclose(y, ref, rtol=1e-6)
  # the declared state was not used: its "gradient" is itself
  jax.tree.map(np.testing.assert_array_equal, gv[COLL], v[COLL])
  assert any("batch dims" in r.getMessage() for r in _warnings(caplog))
  with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
    with pytest.raises(ValueError, match="Fp8Einsum cannot run"):
      tfx.Fp8Einsum(on_unsupported="raise").apply({}, eq, q, k)


@pytest.mark.skipif("dot_general_cls" not in nn.Einsum.__dataclass_fields__,
                    reason="this Flax's nn.Einsum takes no dot_general_cls")
def test_nn_einsum_dot_general_cls():
  x = rand(0, (2, 32, 64))
  m = nn.Einsum((64, 4, 32), "btd,dhk->bthk", dot_general_cls=tfx.Fp8DotGeneral)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
    v = m.init(jax.random.key(0), x)
    y = m.apply(v, x)
  assert 1e-4 < rel(y, jnp.einsum("btd,dhk->bthk", x, v["params"]["kernel"])) < FWD_TOL


# --------------------------------------------------------- delayed state --

class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, dot_general_cls=tfx.Fp8DotGeneral, name="up")(x)
    return nn.Dense(16, dot_general_cls=tfx.Fp8DotGeneral, name="down")(jax.nn.gelu(h))


def _step_fn(x, target):
  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - target) ** 2))(state.params)
    return state.apply_gradients(grads=grads)
  return step


def test_delayed_state_advances_through_train_state():
  x, target = rand(0, (8, 32), 3.0), rand(1, (8, 16))
  model = _Net()
  with te_jax.fp8_autocast(True, recipe.DelayedScaling(amax_history_len=4)):
    s0 = train_state.TrainState.create(
        apply_fn=model.apply, params=jax.jit(model.init)(jax.random.key(0), x),
        tx=optax.sgd(0.1))
    step = _step_fn(x, target)
    s1 = step(s0)
    s2 = step(s1)
  meta = [s.params[COLL]["up"][OP]["fp8_meta"] for s in (s0, s1, s2)]
  amax_x = float(jnp.abs(x).max())
  np.testing.assert_allclose(meta[0]["x"]["amax_history"], 0.0)
  np.testing.assert_allclose(meta[1]["x"]["amax_history"], [amax_x, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(meta[2]["x"]["amax_history"], [amax_x, amax_x, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(float(meta[1]["x"]["scale"]), 448.0 / amax_x, rtol=1e-6)
  for t in ("kernel", "grad"):
    assert float(meta[2][t]["amax_history"][1]) > 0 and float(meta[2][t]["scale"]) != 1.0
  assert float(s2.params[COLL]["down"][OP]["fp8_meta"]["grad"]["amax_history"][0]) > 0
  assert float(jnp.abs(s2.params["params"]["up"]["kernel"]
                       - s0.params["params"]["up"]["kernel"]).max()) > 0

  # A step with FP8 off (or another recipe) leaves the state as it is.
  for ctx in (te_jax.fp8_autocast(enabled=False),
              te_jax.fp8_autocast(True, recipe.Float8CurrentScaling())):
    with ctx:
      s3 = _step_fn(x, target)(s2)
    jax.tree.map(np.testing.assert_array_equal, s3.params[COLL], s2.params[COLL])


def test_missing_delayed_state_is_an_error_with_a_hint():
  x = rand(0, (4, 32))
  m = nn.Dense(16, dot_general_cls=tfx.Fp8DotGeneral)
  v = m.init(jax.random.key(0), x)
  with te_jax.fp8_autocast(True, recipe.DelayedScaling()):
    with pytest.raises(ValueError, match="fp8_autocast"):
      m.apply(v, x)


# ------------------------------------------------- fallback and errors --

def _warnings(caplog):
  return [r for r in caplog.records if r.name == "te_jax" and r.levelno == logging.WARNING]


def test_batch_dims_fall_back_with_one_warning(caplog):
  dg.log_fallback.cache_clear()
  x = rand(0, (3, 8, 16))
  kw = dict(features=12, axis=-1, batch_dims=(0,))
  flax_m = nn.DenseGeneral(**kw, dot_general_cls=tfx.Fp8DotGeneral)
  plain = nn.DenseGeneral(**kw)
  v = plain.init(jax.random.key(0), x)
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    with te_jax.fp8_autocast(True, recipe.DelayedScaling()):
      y = flax_m.apply(v, x)
      flax_m.apply(v, x)     # the same reason: no second warning
  np.testing.assert_array_equal(y, plain.apply(v, x))
  msgs = [r.getMessage() for r in _warnings(caplog)]
  assert len(msgs) == 1 and "batch dims" in msgs[0] and "on_unsupported" in msgs[0], msgs


@pytest.mark.parametrize("lhs,rhs,dn,reason", [
    (jnp.ones((4, 8), jnp.int32), jnp.ones((8, 3), jnp.int32), (((1,), (0,)), ((), ())),
     "int32"),
    (jnp.ones((4,)), jnp.ones((3,)), (((), ()), ((), ())), "no contracting dims"),
    (jnp.ones((4, 8)), jnp.ones((8, 3)), (((1,), (0,)), ((), ())), "preferred_element_type"),
], ids=["int", "outer", "int-output"])
def test_other_fallbacks_warn(caplog, lhs, rhs, dn, reason):
  dg.log_fallback.cache_clear()
  pet = jnp.int32 if reason == "preferred_element_type" else None
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
      y = tfx.Fp8DotGeneral().apply({}, lhs, rhs, dn, preferred_element_type=pet)
  np.testing.assert_array_equal(y, lax.dot_general(lhs, rhs, dn, preferred_element_type=pet))
  msgs = [r.getMessage() for r in _warnings(caplog)]
  assert len(msgs) == 1 and reason in msgs[0], msgs


def test_on_unsupported_raise():
  x = rand(0, (3, 8, 16))
  m = nn.DenseGeneral(12, batch_dims=(0,), dot_general_cls=op_cls(on_unsupported="raise"))
  v = nn.DenseGeneral(12, batch_dims=(0,)).init(jax.random.key(0), x)
  with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
    with pytest.raises(ValueError, match="batch dims.*on_unsupported='warn'"):
      m.apply(v, x)
  m.apply(v, x)   # FP8 off: a plain dot_general, nothing to refuse


@pytest.mark.parametrize("dn,match", [
    ((((1,), (0,)),), "dimension_numbers must be"),
    ((((1,), (1,)), ((), ())), "contracting dims of lhs"),
    ((((2,), (0,)), ((), ())), "out of range"),
    ((((1, 1), (0, 0)), ((), ())), "repeats an axis"),
    (((("a",), (0,)), ((), ())), "sequence of ints"),
], ids=["structure", "sizes", "range", "repeat", "type"])
def test_malformed_dimension_numbers_raise(dn, match):
  lhs, rhs = jnp.ones((4, 8)), jnp.ones((8, 3))
  with te_jax.fp8_autocast(True, recipe.Float8CurrentScaling()):
    with pytest.raises(ValueError, match=match):
      tfx.Fp8DotGeneral().apply({}, lhs, rhs, dn)


def test_bad_arguments_raise():
  lhs, rhs, dn = jnp.ones((4, 8)), jnp.ones((8, 3)), (((1,), (0,)), ((), ()))
  with pytest.raises(TypeError, match="unexpected keyword arguments \\['algorithm'\\]"):
    tfx.Fp8DotGeneral().apply({}, lhs, rhs, dn, algorithm=None)
  with pytest.raises(ValueError, match="on_unsupported must be one of"):
    tfx.Fp8DotGeneral(on_unsupported="ignore").apply({}, lhs, rhs, dn)
  with pytest.raises(ValueError, match="impl"):
    tfx.Fp8DotGeneral(impl="triton").apply({}, lhs, rhs, dn)


def test_exported():
  assert {"Fp8DotGeneral", "Fp8Einsum"} <= set(tfx.__all__)
  assert tfx.Fp8DotGeneral is dg.Fp8DotGeneral and tfx.Fp8Einsum is dg.Fp8Einsum
