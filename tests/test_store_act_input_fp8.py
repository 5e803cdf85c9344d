"""``store_act_input_in_fp8``: the fused MLP keeps its activation's input h in
E4M3 (1x128 tiles) for the backward instead of in the compute dtype.

Checked on ``te_jax.fused_mlp.fp8_mlp`` (reference path): the output is the
default's bit for bit; the gradients are those of a backward handed h rounded
to E4M3 by the test itself (so they fail if h is not rounded, or rounded
another way), and close to the default's; the saved residuals shrink by about
half of h's bytes; a NaN still surfaces. Then the plumbing: the autocast's
option reaches the Linen and NNX LayerNormMLP, retraces a jitted step, names
itself when it is not a bool, and warns once where the block cannot apply it.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import dense as dense_lib
from te_jax import flax as tfx
from te_jax import fused_mlp, norm_dense
from te_jax import nnx as tnx
from te_jax import quantize as q
from te_jax.layers import mlp as mlp_lib
from te_jax.ops.act_quantize import ACTIVATIONS

from flax_cases import RECIPES, mlp_states, rand, rel

import model_memory  # pylint: disable=import-error  (benchmarks/ is on pytest's path)

M, K, F, N = 256, 128, 256, 128   # two 128-token blocks: backward_chunks=2 splits them
GATED, SINGLE = ("silu", "linear"), ("gelu",)


def _inputs(acts, bias):
  """(x, gamma, beta, wi, bi, wo, bo): bf16 activations and biases (the
  compute dtype, so fp8_mlp's bias casts are identities), float32 weights."""
  n_act = len(acts)
  bf16 = jnp.bfloat16
  return (rand(0, (M, K), dtype=bf16), rand(6, (K,), 0.1, 1.0), rand(7, (K,), 0.1),
          rand(1, (K, n_act * F), 0.09), rand(3, (n_act * F,), 0.1, dtype=bf16) if bias else None,
          rand(2, (F, N), 0.06), rand(4, (N,), 0.1, dtype=bf16) if bias else None)


def _norm(gamma, beta, norm):
  return norm_dense.NormParams(gamma, beta, "layernorm", 1e-6, False) if norm else None


def _fp8_mlp_vjp(r, acts, *, norm, chunks, store, states, cot, impl="reference"):
  """jit(x, gamma, beta, wi, bi, wo, bo) -> (y, grads of the seven and the states)."""
  def f(x, gamma, beta, wi, bi, wo, bo, si, so):
    return fused_mlp.fp8_mlp(x, wi, wo, bi, bo, activations=acts, recipe=r, wi_state=si,
                             wo_state=so, impl=impl, norm=_norm(gamma, beta, norm),
                             backward_chunks=chunks, store_act_input_in_fp8=store)

  def step(*a):
    y, vjp = jax.vjp(f, *a, *states)
    return y, vjp(cot)
  return jax.jit(step)


def _rounded_h_vjp(r, acts, *, norm, bias, chunks, states, cot):
  """The spec: the default backward (store_act_input_in_fp8=False) handed h
  rounded by the test through te_jax.quantize's public blockwise quantize
  and dequantize (E4M3, 1x128 tiles, power-of-two scales)."""
  spec = norm_dense.norm_spec("layernorm", 1e-6, False) if norm else None
  cfg = fused_mlp._MlpConfig(  # pylint: disable=protected-access
      mode=dense_lib.scaling_mode_of(r), impl="reference", activations=acts, has_bi=bias,
      has_bo=bias, dtype=jnp.dtype(jnp.bfloat16), norm=spec, backward_chunks=chunks)
  assert not cfg.store_act_input_in_fp8

  def step(x, gamma, beta, wi, bi, wo, bo):
    if not norm:
      gamma = beta = None
    y, res = fused_mlp._mlp_fwd(  # pylint: disable=protected-access
        x, gamma, beta, wi, bi, wo, bo, states, cfg)
    # the activation's input, (M, n_act * F) in the compute dtype, kept as
    # one piece of rows per backward chunk
    bounds = fused_mlp.chunk_bounds(M, chunks, cfg.mode.token_block)
    assert [p.shape[0] for p in res[2]] == [r1 - r0 for r0, r1 in bounds]
    h = jnp.concatenate(res[2])
    assert h.shape == (M, len(acts) * F) and h.dtype == jnp.bfloat16
    data, scale_inv = q.quantize_blockwise(h, (1, 128), jnp.float8_e4m3fn, power_2_scale=True,
                                           impl="reference")
    h_rounded = q.dequantize_blockwise(data, scale_inv, (1, 128), dtype=h.dtype)
    res = res[:2] + (tuple(h_rounded[r0:r1] for r0, r1 in bounds),) + res[3:]
    return y, fused_mlp._mlp_bwd(cfg, res, cot)  # pylint: disable=protected-access
  return jax.jit(step)


# (recipe, activations, norm, backward_chunks, biases): every recipe with
# both activations; the norm, chunks (delayed and blockwise only: current
# scaling refuses them) and biases (the has_bi branch reads h too) in turn.
CASES = [("delayed", GATED, True, 1, False), ("delayed", SINGLE, False, 2, True),
         ("current", GATED, False, 1, True), ("current", SINGLE, True, 1, False),
         ("block", GATED, True, 2, True), ("block", SINGLE, False, 1, False)]


@pytest.mark.parametrize("rname,acts,norm,chunks,bias", CASES)
def test_output_unchanged_gradients_those_of_h_rounded_to_e4m3(rname, acts, norm, chunks, bias):
  r = RECIPES[rname]()
  args = _inputs(acts, bias)
  states = mlp_states(r)
  cot = rand(5, (M, N), dtype=jnp.bfloat16)
  kw = dict(norm=norm, chunks=chunks, states=states, cot=cot)
  y0, g0 = _fp8_mlp_vjp(r, acts, store=False, **kw)(*args)
  y1, g1 = _fp8_mlp_vjp(r, acts, store=True, **kw)(*args)
  y2, g2 = _rounded_h_vjp(r, acts, bias=bias, **kw)(*args)
  # The forward reads h itself either way: the output is the default's.
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y0, np.float32))
  # The spec returns the gradients of _mlp's arguments (x, gamma, beta, wi,
  # bi, wo, bo, states); fp8_mlp's are those of (x, gamma, beta, wi, bi, wo,
  # bo, wi_state, wo_state): the same values, the two states apart.
  want = dict(zip(("x", "gamma", "beta", "wi", "bi", "wo", "bo"), g2[:7]))
  want["states"] = g2[7]
  got = dict(zip(("x", "gamma", "beta", "wi", "bi", "wo", "bo"), g1[:7]))
  got["states"] = tuple(g1[7:])
  default = dict(zip(("x", "gamma", "beta", "wi", "bi", "wo", "bo"), g0[:7]))
  for name in want:
    if want[name] is None or (name in ("gamma", "beta") and not norm):
      continue
    for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                    err_msg=name)
  # Against exact math: the option's gradients are the FP8 path's for an h
  # moved by its E4M3 rounding (at most 2**-4 of each element: 3 mantissa
  # bits, round to nearest; elements above E4M3's subnormals, 2**-15 of
  # their tile's max, here all), and their own FP8 rounding of dh is noise
  # of the same size as the default's (the same grids, other values). So
  # they are as far from the exact float32 gradients as the default's plus
  # the moved h's share, which act' and act (slopes of order 1 here) carry
  # over at that relative size: at most 2**-4 more. (Against the default
  # directly there is no such bound: a moved dh element that crosses a
  # rounding boundary of the gradient's FP8 grid, E5M2 under HYBRID, jumps
  # by a whole grid step, 2**-3 to 2**-2 of itself.)
  exact = _exact_grads(acts, norm, bias, cot, *args)
  for name in ("x", "wi", "wo") + (("gamma",) if norm else ()) + (("bi",) if bias else ()):
    e_default, e_store = rel(default[name], exact[name]), rel(got[name], exact[name])
    assert e_store < e_default + 2.0 ** -4, (name, e_store, e_default)
    assert rel(got[name], default[name]) > 0, name   # the option changed something


def _exact_grads(acts, norm, bias, cot, x, gamma, beta, wi, bi, wo, bo):
  """The block's gradients in float32 without FP8: {name: gradient}."""
  def f(x, gamma, beta, wi, bi, wo, bo):
    if norm:   # layernorm, as _norm
      mean = jnp.mean(x, axis=-1, keepdims=True)
      var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
      x = (x - mean) * jax.lax.rsqrt(var + 1e-6) * gamma + beta
    h = x @ wi + (0.0 if bi is None else bi)
    z = 1.0
    for i, a in enumerate(acts):
      z = z * ACTIVATIONS[a].jax_fn(h[:, i * F:(i + 1) * F])
    return z @ wo + (0.0 if bo is None else bo)
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  names = ("x", "gamma", "beta", "wi", "bi", "wo", "bo")
  primals = [f32(a) for a in (x, gamma, beta, wi, bi, wo, bo)]
  _, vjp = jax.vjp(f, *primals)
  return dict(zip(names, vjp(cot.astype(jnp.float32))))


@pytest.mark.gpu
@pytest.mark.parametrize("rname,acts,norm,chunks,bias", CASES[::2])
def test_cuda_matches_reference(rname, acts, norm, chunks, bias):
  """The CUDA path (h quantized by the blockwise quantize kernel) against the
  reference on the CPU (XLA:GPU's f32 division is not correctly rounded)."""
  r = RECIPES[rname]()
  cot = rand(5, (M, N), dtype=jnp.bfloat16)
  kw = dict(norm=norm, chunks=chunks, store=True, cot=cot)
  run = {}
  for impl, device in (("cuda", jax.devices("gpu")[0]), ("reference", jax.devices("cpu")[0])):
    args, states = jax.device_put((_inputs(acts, bias), mlp_states(r)), device)
    run[impl] = _fp8_mlp_vjp(r, acts, states=states, impl=impl, **kw)(*args)
  # As tests/test_fused_mlp.py's CUDA check: CUDA and XLA evaluate the
  # activations' tanh/exp with different float32 ulps, so a few FP8 roundings
  # differ by one step, < 1% in norm; h's E4M3 copy is the same bit for bit
  # (the quantize kernel's contract), and its power-of-two dequantization exact.
  (y1, g1), (y0, g0) = run["cuda"], run["reference"]
  assert rel(y1, y0) < 1e-2
  for i in (0, 3, 5):   # dx, dwi, dwo
    assert rel(g1[i], g0[i]) < 1e-2, i


def _residual_bytes(loss, *args):
  rows = model_memory.saved_residuals(loss, *args)
  return sum(row.nbytes for row in rows if not row.argument)


@pytest.mark.parametrize("rname", ["delayed", "block"])
def test_saved_residuals_shrink_by_about_half_of_h(rname):
  r = RECIPES[rname]()
  x, gamma, beta, wi, _, wo, _ = _inputs(GATED, False)
  states = mlp_states(r)

  def loss(store):
    def f(x, gamma, beta, wi, wo):
      y = fused_mlp.fp8_mlp(x, wi, wo, activations=GATED, recipe=r, wi_state=states[0],
                            wo_state=states[1], impl="reference",
                            norm=_norm(gamma, beta, True), store_act_input_in_fp8=store)
      return jnp.sum(y.astype(jnp.float32))
    return f
  base = _residual_bytes(loss(False), x, gamma, beta, wi, wo)
  fp8 = _residual_bytes(loss(True), x, gamma, beta, wi, wo)
  h_elems = M * 2 * F
  # h in bf16 (2 bytes an element) becomes E4M3 (1 byte) plus a float32
  # scale per 128 elements: the residuals drop by exactly that difference.
  assert base - fp8 == h_elems * 2 - (h_elems + h_elems // 128 * 4), (base, fp8)


def test_a_nan_in_x_gives_nan_gradients():
  r = RECIPES["block"]()
  x, gamma, beta, wi, _, wo, _ = _inputs(GATED, False)
  x = x.at[3, 5].set(jnp.nan)
  cot = rand(5, (M, N), dtype=jnp.bfloat16)
  _, g = _fp8_mlp_vjp(r, GATED, norm=False, chunks=1, store=True, states=(None, None),
                      cot=cot)(x, gamma, beta, wi, None, wo, None)
  for name, i in (("x", 0), ("wi", 3), ("wo", 5)):
    assert not np.all(np.isfinite(np.asarray(g[i], np.float32))), name
  # The row of h holding the NaN: its tiles dequantize to NaN, so the
  # activation's backward makes that row of dx NaN (not saturated away).
  assert np.isnan(np.asarray(g[0][3], np.float32)).any()


def test_fp8_mlp_refuses_a_non_bool():
  x, _, _, wi, _, wo, _ = _inputs(GATED, False)
  with pytest.raises(TypeError, match="store_act_input_in_fp8 must be a bool"):
    fused_mlp.fp8_mlp(x, wi, wo, activations=GATED, recipe=RECIPES["block"](),
                      impl="reference", store_act_input_in_fp8=1)


# ----------------------------------------------------------- the autocast --

E, H = 128, 256
X = rand(8, (2, 128, E), dtype=jnp.bfloat16)


def _mean_square(y):
  return jnp.mean(y.astype(jnp.float32) ** 2)


def _linen_loss(r, x=X, **kw):
  """(loss(variables, x), variables) of a Linen LayerNormMLP made under ``r``:
  every collection is an argument (the FP8 state too: its updates are
  dropped), so only what the block makes counts as a residual."""
  module = tfx.LayerNormMLP(intermediate_dim=H, activations=GATED, layernorm_type="rmsnorm",
                            dtype=jnp.bfloat16, **kw)
  with te_jax.fp8_autocast(True, r):
    variables = jax.jit(module.init)(jax.random.key(1), x)
  return lambda v, x: _mean_square(module.apply(v, x, mutable=True)[0]), variables


def _nnx_loss(r):
  """As :func:`_linen_loss` for the NNX LayerNormMLP: its whole state an argument."""
  with te_jax.fp8_autocast(True, r):
    module = tnx.LayerNormMLP(E, H, activations=GATED, layernorm_type="rmsnorm",
                              dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(module)
  return lambda s, x: _mean_square(nnx.merge(graphdef, s)(x)), state


def _under(store, r, fn, *args):
  with te_jax.fp8_autocast(True, r, store_act_input_in_fp8=store):
    return fn(*args)


@pytest.mark.parametrize("rname", ["delayed", "block"])
def test_modules_keep_h_in_fp8_under_the_autocast(rname):
  r = RECIPES[rname]()
  h_elems = X.shape[0] * X.shape[1] * 2 * H
  saved = h_elems * 2 - (h_elems + h_elems // 128 * 4)
  # fuse_norm_quantize=False: the norm in front, the core without it
  # (te_jax.layers.gemm.mlp_core) takes the option as well.
  for name, (loss, params) in (("linen", _linen_loss(r)), ("nnx", _nnx_loss(r)),
                               ("linen, norm in front", _linen_loss(r, fuse_norm_quantize=False))):
    base = _under(False, r, _residual_bytes, loss, params, X)
    fp8 = _under(True, r, _residual_bytes, loss, params, X)
    assert base - fp8 == saved, (name, base, fp8)
    step = jax.jit(jax.value_and_grad(loss, allow_int=True))   # the state's step counter
    (l0, _), (l1, g1) = _under(False, r, step, params, X), _under(True, r, step, params, X)
    assert float(l0) == float(l1), name   # the forward is unchanged
    floats = [a for a in jax.tree.leaves(g1) if jnp.issubdtype(a.dtype, jnp.inexact)]
    assert floats and all(np.all(np.isfinite(np.asarray(a, np.float32))) for a in floats)


def test_the_choice_is_part_of_the_jit_cache_key():
  r = RECIPES["block"]()
  loss, params = _linen_loss(r)
  traces = []

  @jax.jit
  def step(p, x):
    traces.append(1)
    return jax.grad(loss)(p, x)
  # (FP8 on, the option) in turn, and the traces made so far: the option
  # retraces, the same choice again does not; with FP8 off it changes
  # nothing, so on or off there it is one trace.
  for fp8_on, store, want in ((True, False, 1), (True, True, 2), (True, True, 2),
                              (False, True, 3), (False, False, 3)):
    with te_jax.fp8_autocast(fp8_on, r, store_act_input_in_fp8=store):
      step(params, X)
    assert len(traces) == want, (fp8_on, store)


def test_the_autocast_refuses_a_non_bool():
  with pytest.raises(TypeError, match="store_act_input_in_fp8 must be a bool"):
    with te_jax.fp8_autocast(True, store_act_input_in_fp8="yes"):
      pass


def _lower_grad(loss):
  """jax.grad(loss) traced and lowered afresh at each call (where the
  warning is logged), not compiled or run."""
  return lambda *args: jax.jit(jax.grad(loss)).lower(*args)


def test_warns_once_where_the_block_cannot_apply_it(caplog):
  mlp_lib.warn_act_input_not_in_fp8.cache_clear()
  caplog.set_level(logging.WARNING, logger="te_jax")
  r = RECIPES["current"]()
  x = rand(9, (2, 100, E), dtype=jnp.bfloat16)       # 200 tokens: not a multiple of 16
  loss, params = _linen_loss(r, x)
  for _ in range(2):
    _under(True, r, _lower_grad(loss), params, x)
  hits = [m for m in caplog.messages if "store_act_input_in_fp8" in m]
  assert len(hits) == 1 and "two FP8 dense layers" in hits[0] and "200 tokens" in hits[0], hits
  caplog.clear()   # off, or on a block that takes it: no warning
  _under(False, r, _lower_grad(loss), params, x)
  loss, params = _linen_loss(r)
  _under(True, r, _lower_grad(loss), params, X)
  assert not [m for m in caplog.messages if "store_act_input_in_fp8" in m], caplog.messages
  loss, params = _linen_loss(r, fuse_activation_quantize=False)
  _under(True, r, _lower_grad(loss), params, X)
  hits = [m for m in caplog.messages if "store_act_input_in_fp8" in m]
  assert len(hits) == 1 and "fuse_activation_quantize=False" in hits[0], hits


def test_train_gpt_config_field_reaches_the_autocast():
  """``Config.store_act_input_in_fp8`` (``--set store_act_input_in_fp8=true``
  in bench_model / model_memory) is what the trainer's autocast carries; off
  by default outside the llama preset. The trainer is not built: its
  autocast reads only its config (resolved, as the trainer's), recipe and
  mesh resource."""
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel  (examples/ on the path)
  for fields, want in (({}, False), ({"store_act_input_in_fp8": True}, True)):
    trainer = train_gpt.Trainer.__new__(train_gpt.Trainer)
    trainer.cfg = train_gpt.Config(preset="tiny", **fields).resolved()
    trainer.recipe, trainer.mesh_resource = train_gpt.make_recipe("blockwise"), None
    with trainer.autocast() as ctx:
      assert ctx.enabled and ctx.store_act_input_in_fp8 is want
