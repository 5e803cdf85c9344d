"""te_jax.flax norms and DenseGeneral / LayerNormDenseGeneral against plain Flax.

FP8 tolerances (relative Frobenius error ||y - ref|| / ||ref||): E4M3 keeps 3
mantissa bits, so a round-to-nearest cast has a relative error of at most
2**-4 and an RMS of about 2.5 % on Gaussian data; a GEMM of two such operands
has an output error of about sqrt(2) * 2.5 % ~ 3.5 % (independent errors
average within the sum, they do not grow). We allow FWD_TOL = 0.08 (about
2x). Gradients under HYBRID use E5M2 (2 mantissa bits, RMS ~ 5 %) for the
output gradient, so dgrad/wgrad carry ~ 6 %: GRAD_TOL = 0.15. A wrong scale,
a missing transpose or an unscaled GEMM gives errors of order 1 and fails.
"""

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

from flax_cases import RECIPES, rel

FWD_TOL = 0.08
GRAD_TOL = 0.15
COLL = fp8_state.FP8_COLLECTION


def rand(key, shape, scale=1.0):
  """Gaussian test data from numpy (jax.random would compile per shape)."""
  return jnp.asarray(scale * np.random.default_rng(key).standard_normal(shape), jnp.float32)


def fwd_and_grads(module, variables, x, cot):
  """Output and gradients (params, input) of sum(module(x) * cot), jitted.

  A fresh function is jitted at every call: the FP8 recipe is read at trace
  time, so a trace cached under another autocast must never be reused.
  """
  def f(v, x):
    y, vjp = jax.vjp(module.apply, v, x)
    return y, vjp(cot)
  return jax.jit(f)(variables, x)


def jit_init(module, *args):
  return jax.jit(module.init)(jax.random.key(1), *args)


# ------------------------------------------------------------------ norms --

@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_matches_flax(zero_centered):
  x = rand(0, (3, 5, 32)) * 2 + 1
  m = tfx.LayerNorm(epsilon=1e-5, zero_centered_gamma=zero_centered)
  v = nn.unbox(m.init(jax.random.key(0), x))
  gamma = rand(1, (32,)) * 0.1 + (0.0 if zero_centered else 1.0)
  beta = rand(2, (32,)) * 0.1
  v = {"params": {"scale": gamma, "bias": beta}}
  ref_gamma = gamma + 1 if zero_centered else gamma
  ref = nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": ref_gamma, "bias": beta}}, x)
  np.testing.assert_allclose(m.apply(v, x), ref, rtol=1e-5, atol=1e-5)
  if zero_centered:
    init = nn.unbox(m.init(jax.random.key(0), x))
    assert float(jnp.abs(init["params"]["scale"]).max()) == 0.0


def test_rmsnorm_matches_flax_and_dtype():
  x = rand(0, (4, 16)) * 3
  gamma = rand(1, (16,)) * 0.1 + 1
  ref = nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": gamma}}, x)
  m = tfx.RMSNorm(epsilon=1e-6)
  np.testing.assert_allclose(m.apply({"params": {"scale": gamma}}, x), ref,
                             rtol=1e-5, atol=1e-5)
  v = m.init(jax.random.key(0), x)
  assert set(v["params"]) == {"scale"}
  yb = tfx.RMSNorm(dtype=jnp.bfloat16).apply({"params": {"scale": gamma}}, x)
  assert yb.dtype == jnp.bfloat16


def test_norm_partition_names():
  x = rand(0, (2, 8))
  for m in (tfx.LayerNorm(), tfx.RMSNorm()):
    specs = nn.get_partition_spec(jax.eval_shape(m.init, jax.random.key(0), x))["params"]
    assert specs and all(tuple(s) == ("embed",) for s in specs.values()), specs


# ------------------------------------------------------------ DenseGeneral --

def _dense_case(use_bias=True, impl="auto"):
  x = rand(0, (2, 24, 64))
  m = tfx.DenseGeneral(96, use_bias=use_bias, impl=impl)
  v = nn.unbox(jit_init(m, x))
  if use_bias:
    v["params"]["bias"] = rand(3, (96,)) * 0.1
  ref_m = nn.Dense(96, use_bias=use_bias)
  return m, v, ref_m, x


def test_dense_fp8_off_exact():
  m, v, ref_m, x = _dense_case()
  cot = rand(7, (2, 24, 96))
  y, (gv, gx) = fwd_and_grads(m, v, x, cot)
  ry, (rgv, rgx) = fwd_and_grads(ref_m, v, x, cot)
  np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(gx, rgx, rtol=1e-5, atol=1e-5)
  for k in ("kernel", "bias"):
    np.testing.assert_allclose(gv["params"][k], rgv["params"][k], rtol=1e-5, atol=1e-5)
  # An explicitly disabled autocast is the same as none.
  with te_jax.fp8_autocast(enabled=False, fp8_recipe=recipe.Float8CurrentScaling()):
    np.testing.assert_allclose(jax.jit(m.apply)(v, x), ry, rtol=1e-6, atol=1e-6)
    assert COLL not in jax.eval_shape(m.init, jax.random.key(1), x)


def test_dense_general_multi_axis_matches_einsum():
  x = rand(0, (2, 6, 4, 8))  # (batch, seq, heads, kv)
  m = tfx.DenseGeneral(features=(3, 5), axis=(-2, -1), use_bias=True)
  v = jit_init(m, x)
  p = nn.unbox(v)["params"]
  assert p["kernel"].shape == (4, 8, 3, 5) and p["bias"].shape == (3, 5)
  ref = jnp.einsum("bshd,hdef->bsef", x, p["kernel"]) + p["bias"]
  np.testing.assert_allclose(jax.jit(m.apply)(v, x), ref, rtol=1e-5, atol=1e-5)
  # contracting a non-trailing axis keeps the others in order
  m2 = tfx.DenseGeneral(features=7, axis=1)
  v2 = jit_init(m2, x)
  k2 = nn.unbox(v2)["params"]["kernel"]
  np.testing.assert_allclose(jax.jit(m2.apply)(v2, x), jnp.einsum("bshd,sf->bhdf", x, k2),
                             rtol=1e-5, atol=1e-5)
  specs = nn.get_partition_spec(v)["params"]
  assert tuple(specs["kernel"]) == ("heads", "kv", "dense_out_0", "dense_out_1")
  assert tuple(specs["bias"]) == ("dense_out_0", "dense_out_1")


def test_dense_partition_names_custom():
  x = rand(0, (2, 16))
  m = tfx.DenseGeneral((4, 8), use_bias=True, kernel_axes=("embed", "heads", "kv"))
  specs = nn.get_partition_spec(jax.eval_shape(m.init, jax.random.key(0), x))["params"]
  assert tuple(specs["kernel"]) == ("embed", "heads", "kv")
  assert tuple(specs["bias"]) == ("heads", "kv")
  with pytest.raises(ValueError, match="kernel_axes"):
    tfx.DenseGeneral(4, kernel_axes=("embed",)).init(jax.random.key(0), x)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dense_fp8_close_to_reference(name, impl):
  m, v, ref_m, x = _dense_case(impl=impl)
  cot = rand(7, (2, 24, 96))
  ry, (rgv, rgx) = fwd_and_grads(ref_m, v, x, cot)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    init = jit_init(m, x)
    if name == "delayed":
      v = dict(v, **{COLL: init[COLL]})
      # one step so that the scales come from real amaxes, not the initial 1.0
      _, (g, _) = fwd_and_grads(m, v, x, cot)
      v = fp8_state.apply_fp8_updates(v, g)
    else:
      assert COLL not in init
    y, (gv, gx) = fwd_and_grads(m, v, x, cot)
  e_y, e_x = rel(y, ry), rel(gx, rgx)
  e_k, e_b = rel(gv["params"]["kernel"], rgv["params"]["kernel"]), rel(
      gv["params"]["bias"], rgv["params"]["bias"])
  assert e_y < FWD_TOL and e_x < GRAD_TOL and e_k < GRAD_TOL, (e_y, e_x, e_k)
  assert e_b < 1e-5   # the bias gradient is a plain sum of the fp32 gradient
  assert e_y > 1e-4   # FP8 really ran (not silently the fp32 path)


def test_delayed_state_only_under_delayed():
  x = rand(0, (4, 32))
  m = tfx.DenseGeneral(16)
  with te_jax.fp8_autocast(True, recipe.DelayedScaling(amax_history_len=8)):
    v = jit_init(m, x)
  st = v[COLL]["fp8_meta"]
  assert set(st) == {"x", "kernel", "grad"}
  assert st["x"]["amax_history"].shape == (8,)
  for r in (recipe.Float8CurrentScaling(), recipe.Float8BlockScaling()):
    with te_jax.fp8_autocast(True, r):
      assert COLL not in jit_init(m, x)
  # applying under DelayedScaling without the state is an error with a hint
  with te_jax.fp8_autocast(True, recipe.DelayedScaling()):
    with pytest.raises(Exception, match="fp8_autocast"):
      m.apply({"params": v["params"]}, x)


def _train_two_steps(model, x, target, r):
  with te_jax.fp8_autocast(True, r):
    variables = jax.jit(model.init)(jax.random.key(0), x)
    params = nn.unbox(variables)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.sgd(0.1))

    @jax.jit
    def step(state):
      def loss_fn(p):
        return jnp.mean((state.apply_fn(p, x) - target) ** 2)
      grads = jax.grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads)

    states = [state]
    for _ in range(2):
      states.append(step(states[-1]))
  return states


def test_delayed_state_updates_with_train_state():
  x = rand(0, (8, 32)) * 3.0
  target = rand(1, (8, 16))
  r = recipe.DelayedScaling(amax_history_len=4)
  s0, s1, s2 = _train_two_steps(tfx.DenseGeneral(16), x, target, r)
  h = [s.params[COLL]["fp8_meta"]["x"]["amax_history"] for s in (s0, s1, s2)]
  amax_x = float(jnp.abs(x).max())
  np.testing.assert_allclose(h[0], 0.0)
  np.testing.assert_allclose(h[1], [amax_x, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(h[2], [amax_x, amax_x, 0, 0], rtol=1e-6)  # shifted
  for t in ("x", "kernel", "grad"):
    sc = [float(s.params[COLL]["fp8_meta"][t]["scale"]) for s in (s0, s1, s2)]
    assert sc[0] == 1.0 and sc[1] != 1.0, (t, sc)
    hist = s2.params[COLL]["fp8_meta"][t]["amax_history"]
    assert float(hist[0]) > 0 and float(hist[1]) > 0
  # scale = fp8_max / amax (HYBRID: E4M3 for x)
  np.testing.assert_allclose(float(s1.params[COLL]["fp8_meta"]["x"]["scale"]),
                             448.0 / amax_x, rtol=1e-6)
  # params moved too (the state did not swallow the parameter update)
  assert float(jnp.abs(s2.params["params"]["kernel"] - s0.params["params"]["kernel"]).max()) > 0


@pytest.mark.parametrize("other", [None, "current"])
def test_delayed_state_untouched_when_recipe_unused(other):
  """State made under DelayedScaling survives steps run with FP8 off / another recipe."""
  x = rand(0, (8, 32)) * 3.0; target = rand(1, (8, 16))
  m = tfx.DenseGeneral(16)
  r = recipe.DelayedScaling(amax_history_len=4)
  s0, s1, _ = _train_two_steps(m, x, target, r)       # state with real amaxes
  with te_jax.fp8_autocast(enabled=other is not None,
                           fp8_recipe=RECIPES[other]() if other else None):
    @jax.jit
    def step(state):
      grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - target) ** 2))(state.params)
      return state.apply_gradients(grads=grads)
    s2 = step(s1)
  before, after = s1.params[COLL], s2.params[COLL]
  jax.tree.map(np.testing.assert_array_equal, after, before)
  assert float(before["fp8_meta"]["x"]["amax_history"][0]) > 0   # not a trivial state
  assert float(jnp.abs(s2.params["params"]["kernel"] - s1.params["params"]["kernel"]).max()) > 0


@pytest.mark.parametrize("name", ["current", "block"])
def test_no_state_other_recipes_train_state(name):
  x = rand(0, (8, 32)); target = rand(1, (8, 16))
  s0, _, s2 = _train_two_steps(tfx.DenseGeneral(16), x, target, RECIPES[name]())
  assert COLL not in s2.params and set(s2.params) == {"params"}
  assert float(jnp.abs(s2.params["params"]["kernel"] - s0.params["params"]["kernel"]).max()) > 0


# ---------------------------------------------------- LayerNormDenseGeneral --

class _RefLnDense(nn.Module):
  features: int
  norm: str = "layernorm"

  @nn.compact
  def __call__(self, x):
    if self.norm == "layernorm":
      h = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
    else:
      h = nn.RMSNorm(epsilon=1e-6, name="ln")(x)
    return nn.Dense(self.features, use_bias=True, name="dense")(h)


def _to_ref(p, norm):
  ln = {"scale": p["scale"]}
  if norm == "layernorm":
    ln["bias"] = p["ln_bias"]
  return {"params": {"ln": ln, "dense": {"kernel": p["kernel"], "bias": p["bias"]}}}


@pytest.mark.parametrize("norm,name", [("layernorm", None), ("rmsnorm", None),
                                       ("rmsnorm", "current"), ("layernorm", "block")])
def test_layernorm_dense(norm, name):
  x = rand(0, (2, 16, 64)) + 0.5
  m = tfx.LayerNormDenseGeneral(48, layernorm_type=norm, use_bias=True,
                                return_layernorm_output=True)
  v = nn.unbox(jit_init(m, x))
  v["params"]["scale"] = v["params"]["scale"] + rand(2, (64,)) * 0.1
  v["params"]["bias"] = rand(3, (48,)) * 0.1
  ref_m, rv = _RefLnDense(48, norm), _to_ref(v["params"], norm)
  cot = rand(4, (2, 16, 48))
  ry, (rgv, rgx) = fwd_and_grads(ref_m, rv, x, cot)
  with te_jax.fp8_autocast(enabled=name is not None,
                           fp8_recipe=RECIPES[name]() if name else None):
    def f(v, x):
      (y, ln_out), vjp = jax.vjp(m.apply, v, x)
      return y, ln_out, vjp((cot, jnp.zeros_like(ln_out)))
    y, ln_out, (gv, gx) = jax.jit(f)(v, x)
  ref_ln = (nn.LayerNorm(epsilon=1e-6) if norm == "layernorm" else nn.RMSNorm(epsilon=1e-6)
            ).apply({"params": rv["params"]["ln"]}, x)
  np.testing.assert_allclose(ln_out, ref_ln, rtol=1e-5, atol=1e-5)
  gk, rgk = gv["params"]["kernel"], rgv["params"]["dense"]["kernel"]
  gs, rgs = gv["params"]["scale"], rgv["params"]["ln"]["scale"]
  if name is None:
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gk, rgk, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gs, rgs, rtol=1e-4, atol=1e-4)
  else:
    assert rel(y, ry) < FWD_TOL and rel(y, ry) > 1e-4
    assert rel(gx, rgx) < GRAD_TOL and rel(gk, rgk) < GRAD_TOL and rel(gs, rgs) < GRAD_TOL
  specs = nn.get_partition_spec(jax.eval_shape(m.init, jax.random.key(1), x))["params"]
  assert tuple(specs["kernel"]) == ("embed", "mlp") and tuple(specs["scale"]) == ("embed",)
  assert all(len(tuple(s)) > 0 for s in specs.values())


# -------------------------------------------------------------- impl ---------

@pytest.mark.parametrize("cls", ["DenseGeneral", "LayerNormDenseGeneral"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_impl_attribute_reaches_every_op(cls, name, monkeypatch):
  """The modules' ``impl`` is what every FP8 op (quantize, GEMM) is called
  with, forward and backward; the default is "auto"; a bad value is an error."""
  from te_jax.ops import _native  # pylint: disable=import-outside-toplevel
  seen = []
  real = _native.dispatch
  monkeypatch.setattr(_native, "dispatch",
                      lambda impl, *a, **k: seen.append(impl) or real(impl, *a, **k))
  x = rand(0, (2, 16, 64))
  cot = rand(7, (2, 16, 32))
  results = {}
  for impl in ("auto", "reference"):
    kw = {} if impl == "auto" else {"impl": impl}
    m = getattr(tfx, cls)(32, **kw)
    assert m.impl == impl
    with te_jax.fp8_autocast(True, RECIPES[name]()):
      v = nn.unbox(jit_init(m, x))
      seen.clear()
      results[impl] = fwd_and_grads(m, v, x, cot)
    # fprop/dgrad/wgrad GEMMs and the quantizes of x, kernel and grad at least
    assert len(seen) >= 6 and set(seen) == {impl}, (impl, seen)
  # On the CPU "auto" is the reference: the same numbers.
  if not _native.cuda_available():
    for a, b in zip(jax.tree.leaves(results["auto"]), jax.tree.leaves(results["reference"])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with te_jax.fp8_autocast(True, RECIPES[name]()):
    with pytest.raises(ValueError, match="impl must be one of"):
      jit_init(getattr(tfx, cls)(32, impl="triton"), x)
