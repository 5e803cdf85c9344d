"""te_jax.flax.LayerNormMLP against a hand-written Flax/jnp reference.

Tolerances as in test_flax_dense.py: FP8 forward relative Frobenius error
< 0.08 (E4M3: ~3.5 % expected for one GEMM; the MLP chains two GEMMs whose
errors add in quadrature, ~5 %), gradients < 0.15 (E5M2 output gradients,
~6-8 % after two GEMMs). fp32 with FP8 off: 1e-5.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx

from flax_cases import RECIPES, rel

FWD_TOL = 0.08
GRAD_TOL = 0.15
ACT = {"gelu": lambda x: nn.gelu(x, approximate=True), "relu": nn.relu,
       "silu": nn.silu, "linear": lambda x: x}
COLL = fp8_state.FP8_COLLECTION


def rand(key, shape):
  """Gaussian test data from numpy (jax.random would compile per shape)."""
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape), jnp.float32)


def reference_mlp(p, x, acts, norm="layernorm"):
  if norm == "layernorm":
    h = nn.LayerNorm(epsilon=1e-6).apply(
        {"params": {"scale": p["scale"], "bias": p["ln_bias"]}}, x)
  else:
    h = nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": p["scale"]}}, x)
  u = jnp.einsum("bse,eam->bsam", h, p["wi_kernel"])
  if "wi_bias" in p:
    u = u + p["wi_bias"]
  z = ACT[acts[0]](u[..., 0, :])
  for i in range(1, len(acts)):
    z = z * ACT[acts[i]](u[..., i, :])
  y = z @ p["wo_kernel"]
  if "wo_bias" in p:
    y = y + p["wo_bias"]
  return y


def _case(acts, use_bias=False, norm="layernorm", impl="auto"):
  x = rand(0, (2, 16, 64)) + 0.3
  m = tfx.LayerNormMLP(intermediate_dim=128, activations=acts, use_bias=use_bias,
                       layernorm_type=norm, impl=impl)
  v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
  v["params"]["scale"] = v["params"]["scale"] + 0.1 * rand(2, (64,))
  if use_bias:
    v["params"]["wi_bias"] = 0.1 * rand(3, v["params"]["wi_bias"].shape)
    v["params"]["wo_bias"] = 0.1 * rand(4, (64,))
  return m, v, x


def _run(m, v, x, cot):
  @jax.jit
  def f(v, x):
    y, vjp = jax.vjp(lambda v, x: m.apply(v, x), v, x)
    return y, vjp(cot)
  return f(v, x)


def _run_ref(p, x, cot, acts, norm):
  y, vjp = jax.vjp(lambda p, x: reference_mlp(p, x, acts, norm), p, x)
  return y, vjp(cot)


@pytest.mark.parametrize("acts,use_bias,norm", [
    (("gelu",), True, "layernorm"),
    (("relu",), False, "rmsnorm"),
    (("silu", "linear"), False, "layernorm"),   # SwiGLU
    (("gelu", "linear"), True, "rmsnorm"),      # GeGLU
])
def test_mlp_fp8_off_exact(acts, use_bias, norm):
  m, v, x = _case(acts, use_bias, norm)
  assert v["params"]["wi_kernel"].shape == (64, len(acts), 128)
  cot = rand(9, (2, 16, 64))
  y, (gv, gx) = _run(m, v, x, cot)
  ry, (rgp, rgx) = _run_ref(v["params"], x, cot, acts, norm)
  np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-5)
  for k in gv["params"]:
    np.testing.assert_allclose(gv["params"][k], rgp[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_mlp_fp8_close_to_reference(name, impl):
  acts = ("silu", "linear")
  m, v, x = _case(acts, use_bias=True, impl=impl)
  cot = rand(9, (2, 16, 64))
  ry, (rgp, rgx) = _run_ref(v["params"], x, cot, acts, "layernorm")
  with te_jax.fp8_autocast(True, RECIPES[name]()):
    init = jax.eval_shape(m.init, jax.random.key(1), x)
    if name == "delayed":
      assert set(init[COLL]) == {"wi_fp8_meta", "wo_fp8_meta"}
      v = dict(v, **{COLL: jax.tree.map(jnp.zeros_like, init[COLL])})
      _, (g, _) = _run(m, v, x, cot)        # one step: scales from real amaxes
      v = fp8_state.apply_fp8_updates(v, g)
    else:
      assert COLL not in init
    y, (gv, gx) = _run(m, v, x, cot)
  errs = {"y": rel(y, ry), "x": rel(gx, rgx)}
  errs.update({k: rel(gv["params"][k], rgp[k]) for k in ("wi_kernel", "wo_kernel", "scale")})
  assert errs["y"] < FWD_TOL and errs["y"] > 1e-4, errs
  assert all(e < GRAD_TOL for k, e in errs.items() if k != "y"), errs


def test_mlp_partition_names_and_dropout():
  x = rand(0, (2, 8, 32))
  m = tfx.LayerNormMLP(intermediate_dim=48, activations=("gelu", "linear"),
                       use_bias=True, intermediate_dropout_rate=0.5)
  v = jax.jit(m.init)(jax.random.key(0), x)
  specs = {k: tuple(s) for k, s in nn.get_partition_spec(v)["params"].items()}
  assert specs == {"scale": ("embed",), "ln_bias": ("embed",),
                   "wi_kernel": ("embed", "act", "mlp"), "wi_bias": ("act", "mlp"),
                   "wo_kernel": ("mlp", "embed"), "wo_bias": ("embed",)}
  y_det = jax.jit(m.apply)(v, x)
  np.testing.assert_allclose(jax.jit(lambda v, x: m.apply(v, x, deterministic=True))(v, x),
                             y_det, rtol=1e-6)
  drop = jax.jit(lambda v, x, k: m.apply(v, x, deterministic=False, rngs={"dropout": k}))
  y1 = drop(v, x, jax.random.key(1))
  y2 = drop(v, x, jax.random.key(2))
  assert rel(y1, y_det) > 0.1 and rel(y1, y2) > 0.1
  with pytest.raises(ValueError, match="activation"):
    tfx.LayerNormMLP(8, activations=("nope",)).init(jax.random.key(0), x)


def test_activation_table_is_the_ops_table():
  """LayerNormMLP's activations are the fused ops' table; the unfused path
  applies each entry's ``jax_fn``, which means what flax's function does."""
  from te_jax.layers import mlp as mlp_module  # pylint: disable=import-outside-toplevel
  from te_jax.ops import act_quantize as aq  # pylint: disable=import-outside-toplevel
  assert mlp_module.ACTIVATIONS is aq.ACTIVATIONS
  assert tuple(aq.ACTIVATIONS) == aq.ACTIVATION_NAMES
  x = rand(0, (4, 64)) * 3
  for name, fn in ACT.items():
    np.testing.assert_allclose(aq.ACTIVATIONS[name].jax_fn(x), fn(x), rtol=1e-6, atol=1e-7,
                               err_msg=name)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_mlp_impl_attribute_reaches_every_op(fused, name, monkeypatch):
  """LayerNormMLP's ``impl`` is what every FP8 op (quantize, act_quantize,
  dact_quantize, GEMM) is called with, on the fused and the unfused path."""
  from te_jax import fused_mlp  # pylint: disable=import-outside-toplevel
  from te_jax.ops import _native  # pylint: disable=import-outside-toplevel
  seen, fused_calls = [], []
  real, real_mlp = _native.dispatch, fused_mlp.fp8_mlp
  monkeypatch.setattr(_native, "dispatch",
                      lambda impl, *a, **k: seen.append(impl) or real(impl, *a, **k))
  monkeypatch.setattr(fused_mlp, "fp8_mlp",
                      lambda *a, **k: fused_calls.append(k["impl"]) or real_mlp(*a, **k))
  x = rand(0, (2, 128, 128))
  cot = rand(9, (2, 128, 128))
  for impl in ("auto", "reference"):
    kw = {} if impl == "auto" else {"impl": impl}
    m = tfx.LayerNormMLP(intermediate_dim=128, activations=("silu", "linear"),
                         fuse_activation_quantize=fused, **kw)
    with te_jax.fp8_autocast(True, RECIPES[name]()):
      v = nn.unbox(jax.jit(m.init)(jax.random.key(1), x))
      seen.clear()
      fused_calls.clear()
      _run(m, v, x, cot)
    assert fused_calls == ([impl] if fused else []), fused_calls
    # 2 x (quantize x, kernel, grad + 3 GEMMs) at least
    assert len(seen) >= 12 and set(seen) == {impl}, (impl, seen)


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")])
def test_unfused_activation_saves_only_its_input(acts):
  """FP8 off, the backward keeps h (the activation's input) and z (the wo
  GEMM's input), and nothing else of their size: the activation runs under
  jax.checkpoint (te_jax.layers.mlp.activate). Differentiated directly it kept
  six (tokens, mlp) arrays here, gelu's tanh among them, which XLA writes as
  a second full-size forward output. Linen and NNX; values and gradients
  equal to the plain activation."""
  from flax import nnx
  from te_jax import nnx as tnnx
  tokens, mlp_dim = 48, 64
  x = rand(0, (2, 24, 32)).astype(jnp.bfloat16)
  linen = tfx.LayerNormMLP(intermediate_dim=mlp_dim, activations=acts, dtype=jnp.bfloat16)
  v = nn.unbox(linen.init(jax.random.PRNGKey(1), x))
  module = tnnx.LayerNormMLP(32, mlp_dim, activations=acts, dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(module)
  for fn, params in ((lambda v, x: linen.apply(v, x), v),
                     (lambda s, x: nnx.merge(graphdef, s)(x), state)):
    _, f_vjp = jax.vjp(fn, params, x)
    big = [leaf.shape for leaf in jax.tree.leaves(f_vjp)   # (batch, seq, ...) activations
           if leaf.shape[:2] == (2, 24) and leaf.size >= tokens * mlp_dim]
    assert len(big) == 2, big

  def plain(p, x):   # the same block with the activation differentiated directly
    h = jnp.einsum("bse,eam->bsam", nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16).apply(
        {"params": {"scale": p["scale"], "bias": p["ln_bias"]}}, x), p["wi_kernel"].astype(
            jnp.bfloat16))
    z = ACT[acts[0]](h[..., 0, :])
    for i in range(1, len(acts)):
      z = z * ACT[acts[i]](h[..., i, :])
    return jnp.einsum("bsm,me->bse", z.astype(jnp.bfloat16), p["wo_kernel"].astype(jnp.bfloat16))

  loss = lambda f: lambda p, x: jnp.sum(f(p, x).astype(jnp.float32) ** 2)
  got = jax.grad(loss(lambda p, x: linen.apply({"params": p}, x)), argnums=(0, 1))(v["params"], x)
  want = jax.grad(loss(plain), argnums=(0, 1))(v["params"], x)
  # bf16 everywhere: x's gradient passes through the norm's backward, which
  # te_jax sums in its own order (3.5e-3 measured here); the parameters'
  # gradients agree to 1e-7 or exactly.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel(a, b) < 1e-2, rel(a, b)
