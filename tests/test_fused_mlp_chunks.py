"""``fused_mlp.fp8_mlp(backward_chunks=n)``: the backward's dgrad half on token chunks.

Delayed scaling quantizes each chunk with the state's scale and blockwise
scaling per tile of 128 tokens, so every FP8 value, and so every GEMM input,
is that of the unchunked backward: in the reference (the spec) the results
are equal bit for bit, except float32 sums over the tokens (the wi bias
gradient, summed per chunk; the norm's dgamma and dbeta, whose reduction
XLA may fuse with the concatenation of the chunks). On the GPU the chunks' smaller GEMMs may
take other cuBLASLt algorithms: close, not equal.
"""

import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import fused_mlp, norm_dense, recipe
from te_jax import flax as tfx
from te_jax import nnx as tnx

from flax_cases import RECIPES, mlp_states, rel

M, K, F, N = 384, 128, 256, 128   # 3 blocks of 128 tokens: uneven chunks for blockwise
CHUNKABLE = ("delayed", "block")


def _rand(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _grads(r, acts, chunks, *, bias=False, norm=False, impl="reference", g_scale=1.0):
  n_act = len(acts)
  x = _rand(0, (M, K))
  wi, wo = _rand(1, (K, n_act * F), 0.09), _rand(2, (F, N), 0.06)
  bi = _rand(3, (n_act * F,), 0.1) if bias else None
  bo = _rand(4, (N,), 0.1) if bias else None
  gamma, beta = _rand(6, (K,), 0.1) + 1.0, _rand(7, (K,), 0.1)
  si, so = mlp_states(r)
  cot = _rand(5, (M, N)) * g_scale

  def f(x, wi, wo, bi, bo, gamma, beta, si, so):
    nrm = norm_dense.NormParams(gamma, beta, "layernorm", 1e-6, False) if norm else None
    return fused_mlp.fp8_mlp(x, wi, wo, bi, bo, activations=acts, recipe=r, wi_state=si,
                             wo_state=so, impl=impl, norm=nrm, backward_chunks=chunks)

  def step(*a):
    y, vjp = jax.vjp(f, *a)
    return y, vjp(cot)
  return jax.jit(step)(x, wi, wo, bi, bo, gamma, beta, si, so)


def test_chunk_bounds_are_whole_blocks_covering_every_row():
  assert fused_mlp.chunk_bounds(384, 2, 128) == ((0, 128), (128, 384))
  assert fused_mlp.chunk_bounds(512, 4, 128) == ((0, 128), (128, 256), (256, 384), (384, 512))
  assert fused_mlp.chunk_bounds(256, 8, 128) == ((0, 128), (128, 256))   # fewer blocks
  assert fused_mlp.chunk_bounds(96, 5, 16) == ((0, 16), (16, 32), (32, 48), (48, 64), (64, 96))
  assert fused_mlp.chunk_bounds(384, 1, 16) == ((0, 384),)


@pytest.mark.parametrize("rname", CHUNKABLE)
@pytest.mark.parametrize("acts,norm,chunks", [(("gelu",), False, 2), (("gelu",), True, 3),
                                              (("silu", "linear"), True, 5)])
def test_chunked_backward_equals_unchunked_in_the_reference(rname, acts, norm, chunks):
  r = RECIPES[rname]()
  y1, g1 = _grads(r, acts, 1, norm=norm)
  yn, gn = _grads(r, acts, chunks, norm=norm)
  np.testing.assert_array_equal(np.asarray(yn), np.asarray(y1))
  # dx, dwi, dwo and the new states: equal. dgamma and dbeta are float32 sums
  # over the tokens of the norm backward, which here reads the chunks'
  # concatenated dgrads: XLA may fuse the concatenation into the reduction
  # and sum in another order (seen on the CPU: 2.5e-6 relative).
  for i in (0, 1, 2, 7, 8):
    for a, b in zip(jax.tree.leaves(gn[i]), jax.tree.leaves(g1[i])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for i in (5, 6):
    np.testing.assert_allclose(np.asarray(gn[i]), np.asarray(g1[i]), rtol=2e-5, atol=1e-6)
    assert norm == bool(float(jnp.max(jnp.abs(g1[i]))) > 0)   # zero without a norm


def _barrier_operand_shapes(jaxpr):
  """The operand shapes of every optimization barrier in ``jaxpr``, nested
  jaxprs (the custom VJP's backward under jit) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      found.append(tuple(tuple(v.aval.shape) for v in eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _barrier_operand_shapes(sub)
  return found


@pytest.mark.parametrize("rname", CHUNKABLE)
def test_chunks_run_in_order_each_with_its_own_piece_of_h(rname):
  # Only one chunk's rowwise dh is to be alive: a chunk's g @ wo.T reads its
  # rows of g through a barrier with the previous chunk's dgrad (M_c, K).
  # Without it XLA's GPU scheduler ran every dgrad after the last activation
  # pass: the MLP step held 32 MiB more on an H100, the layer 128 more with jax 0.12.
  # And h is kept as one piece per chunk, made behind a barrier in the forward
  # (else XLA slices the whole h in the backward and keeps it to the last chunk).
  r = RECIPES[rname]()
  chunks = 3
  x = _rand(0, (M, K))
  wi, wo = _rand(1, (K, F), 0.09), _rand(2, (F, N), 0.06)
  si, so = mlp_states(r)
  f = lambda x: jnp.sum(fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r,
                                          wi_state=si, wo_state=so, impl="reference",
                                          backward_chunks=chunks))
  shapes = _barrier_operand_shapes(jax.make_jaxpr(jax.grad(f))(x).jaxpr)
  bounds = fused_mlp.chunk_bounds(M, chunks, r.scaling_mode().token_block)
  # (previous dx, this chunk's g rows and their scales)
  ties = [s for s in shapes if len(s) == 3 and s[0][1:] == (K,) and s[1][1:] == (N,)]
  assert [t[0] for t in ties] == [(r1 - r0, K) for r0, r1 in bounds[:-1]]
  assert [t[1] for t in ties] == [(r1 - r0, N) for r0, r1 in bounds[1:]]
  assert [(r1 - r0, F) for r0, r1 in bounds] in [list(s) for s in shapes]


@pytest.mark.parametrize("rname", CHUNKABLE)
def test_chunked_bias_gradient_is_summed_per_chunk(rname):
  r = RECIPES[rname]()
  _, g1 = _grads(r, ("gelu",), 1, bias=True)
  _, g3 = _grads(r, ("gelu",), 3, bias=True)
  for i in (0, 1, 2, 4):   # dx, dwi, dwo, dbo: unchanged
    np.testing.assert_array_equal(np.asarray(g3[i]), np.asarray(g1[i]))
  # dbi: float32 partial sums rounded to the compute dtype, in another order.
  np.testing.assert_allclose(np.asarray(g3[3]), np.asarray(g1[3]), rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(g1[3]))) > 0


def test_an_inf_in_the_gradient_surfaces_through_every_chunk():
  r = RECIPES["delayed"]()
  n_act = 1
  x = _rand(0, (M, K))
  wi, wo = _rand(1, (K, n_act * F), 0.09), _rand(2, (F, N), 0.06)
  si, so = mlp_states(r)
  # A row of the first of 3 chunks. The gradient is quantized whole (its
  # scale inverse becomes NaN), so every chunk's GEMMs read the NaN.
  cot = _rand(5, (M, N)).at[3, 0].set(jnp.inf)

  def step(x, wi, wo, si, so):
    y, vjp = jax.vjp(lambda *a: fused_mlp.fp8_mlp(
        a[0], a[1], a[2], activations=("gelu",), recipe=r, wi_state=a[3], wo_state=a[4],
        impl="reference", backward_chunks=3), x, wi, wo, si, so)
    return vjp(cot)
  dx, dwi, _, new_si, _ = jax.jit(step)(x, wi, wo, si, so)
  assert not np.isfinite(np.asarray(dwi)).any()
  # fp8_state records a non-finite amax as 0 (and keeps the scale).
  assert float(new_si["grad"]["amax_history"][0]) == 0.0
  assert not np.isfinite(np.asarray(dx[256:])).any()   # the last chunk too


def test_backward_chunks_bad_values():
  x = _rand(0, (M, K))
  wi, wo = _rand(1, (K, F), 0.09), _rand(2, (F, N), 0.06)
  call = lambda r, c: fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r,
                                        backward_chunks=c)
  block = recipe.Float8BlockScaling()
  with pytest.raises(ValueError, match=r"backward_chunks must be >= 1"):
    call(block, 0)
  with pytest.raises(TypeError, match=r"backward_chunks must be an int"):
    call(block, 2.0)
  with pytest.raises(TypeError, match=r"backward_chunks must be an int"):
    call(block, True)
  with pytest.raises(ValueError, match=r"backward_chunks=2 .*Float8CurrentScaling .*"
                                       r"Use backward_chunks=1"):
    call(recipe.Float8CurrentScaling(), 2)
  call(recipe.Float8CurrentScaling(), np.int64(1))   # numpy ints are ints


def _linen_grads(rname, chunks, x):
  model = tfx.LayerNormMLP(intermediate_dim=F, backward_chunks=chunks, impl="reference")
  with te_jax.fp8_autocast(fp8_recipe=RECIPES[rname]()):
    variables = model.init(jax.random.PRNGKey(0), x)
    return jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2),
                            argnums=(0, 1)))(variables, x)


@pytest.mark.parametrize("rname", CHUNKABLE)
def test_linen_layernorm_mlp_backward_chunks(rname):
  x = _rand(8, (3, M // 3, K))
  g1, g2 = _linen_grads(rname, 1, x), _linen_grads(rname, 2, x)
  _assert_same_grads(g2, g1)


def _assert_same_grads(got, want):
  """Equal, but for the norm's scale and bias: float32 sums over the tokens
  (see test_chunked_backward_equals_unchunked_in_the_reference)."""
  got, want = (jax.tree_util.tree_leaves_with_path(t) for t in (got, want))
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    if any(getattr(k, "key", getattr(k, "name", None)) in ("scale", "ln_bias") for k in path):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_linen_layernorm_mlp_backward_chunks_under_current_scaling_is_an_error():
  with pytest.raises(ValueError, match=r"backward_chunks=4 .*Float8CurrentScaling"):
    _linen_grads("current", 4, _rand(8, (M, K)))


def test_backward_chunks_on_the_unfused_path_warn(caplog):
  # 100 tokens: not a multiple of the blockwise token block, so two FP8 dense layers.
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    _linen_grads("block", 2, _rand(8, (100, K)))
  assert any("backward_chunks=2 has no effect" in r.getMessage() for r in caplog.records)


def test_nnx_layernorm_mlp_backward_chunks():
  x = _rand(8, (M, K))

  def grads(chunks):
    model = tnx.LayerNormMLP(K, F, backward_chunks=chunks, impl="reference",
                             rngs=nnx.Rngs(0))
    with te_jax.fp8_autocast(fp8_recipe=RECIPES["block"]()):
      return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  _assert_same_grads(grads(2), grads(1))
  with pytest.raises(ValueError, match=r"backward_chunks must be >= 1"):
    tnx.LayerNormMLP(K, F, backward_chunks=0, rngs=nnx.Rngs(0))


def test_transformer_layer_passes_mlp_backward_chunks():
  layer = tfx.TransformerLayer(hidden_size=K, mlp_hidden_size=F, num_attention_heads=2,
                               mlp_backward_chunks=4)
  x = _rand(9, (2, 128, K))
  with te_jax.fp8_autocast(fp8_recipe=RECIPES["current"]()):
    with pytest.raises(ValueError, match=r"backward_chunks=4"):
      layer.init(jax.random.PRNGKey(0), x)


@pytest.mark.gpu
@pytest.mark.parametrize("rname", CHUNKABLE)
def test_chunked_cuda_matches_the_reference(rname):
  r = RECIPES[rname]()
  with jax.default_device(jax.devices("gpu")[0]):
    yc, gc = _grads(r, ("gelu",), 3, norm=True, impl="cuda")
  with jax.default_device(jax.devices("cpu")[0]):
    y0, g0 = _grads(r, ("gelu",), 1, norm=True)
  # As test_fused_mlp.test_fused_cuda_matches_reference: CUDA and XLA evaluate
  # tanh in float32 with different ulps, a few FP8 roundings move by one step.
  assert rel(yc, y0) < 1e-2
  for a, b in zip(gc[:7], g0[:7]):
    if b is not None:
      assert rel(a, b) < 1e-2
