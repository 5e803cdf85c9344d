"""The FP8 expert weights reach each grouped GEMM in the layout its kernel
reads, with no transpose of them in between.

The grouped kernel reads every expert's matrix contiguous along the
contraction: (E, N, K) for the fprop, (E, K, N) for the dgrad. Traced with
the CUDA branch taken (as on a GPU, without one), the weights' operand of
each ``te_jax_grouped_gemm`` call is followed back through the transposes
between it and the op that wrote it: their permutations must compose to the
identity (XLA then removes them), so no pass over the FP8 weights runs
between the quantize and the GEMM.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import grouped_dense as gd
from te_jax import recipe
from te_jax.ops import _native
from te_jax.ops import grouped_gemm as gg
from te_jax.ops import grouped_gemm_cuda as ggc

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "blockwise": recipe.Float8BlockScaling}
E, K, N, SIZES = 4, 256, 384, [128, 0, 256, 128]


@pytest.fixture
def cuda_branch(monkeypatch):
  """The dispatchers stage their CUDA calls, as on a GPU whose build has the
  sm90 GEMMs (nothing is compiled or run)."""
  monkeypatch.delenv("TE_JAX_IMPL", raising=False)
  monkeypatch.setattr(_native, "resolve_impl",
                      lambda impl: _native.check_impl(impl) if impl == "reference" else "cuda")
  monkeypatch.setattr(_native, "dispatch", lambda impl, cuda_fn, reference_fn: cuda_fn())
  monkeypatch.setattr(ggc, "_build_note",
                      lambda: "sm90 GEMMs: built with the CUTLASS 4.2.0 headers in /x/include")
  gg._log_reference.cache_clear()   # pylint: disable=protected-access


def _net_permutation(var, producers):
  """The permutation of the transposes from the op that wrote ``var``'s data
  to ``var`` (identity: none, or ones that cancel)."""
  perm = tuple(range(len(var.aval.shape)))
  while var in producers and producers[var].primitive.name == "transpose":
    eqn = producers[var]
    perm = tuple(eqn.params["permutation"][p] for p in perm)
    var = eqn.invars[0]
  return perm


def _case(name):
  """(x, w, dy, layer): bfloat16 rows and output gradient, float32 expert
  weights, and ``grouped_dense`` under the recipe ``name`` with its state."""
  r = RECIPES[name]()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((sum(SIZES), K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((E, K, N)) * 0.05, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((sum(SIZES), N)), jnp.bfloat16)
  gs = jnp.asarray(SIZES, jnp.int32)
  state = gd.init_grouped_state(r, E) if isinstance(r, recipe.DelayedScaling) else None
  return x, w, dy, lambda x, w: gd.grouped_dense(x, w, gs, recipe=r, fp8_state=state)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_no_transpose_of_the_fp8_weights_before_a_grouped_gemm(cuda_branch, name):
  del cuda_branch
  x, w, dy, layer = _case(name)

  def step(x, w, dy):
    y, vjp = jax.vjp(layer, x, w)
    return y, vjp(dy)
  jaxpr = jax.make_jaxpr(step)(x, w, dy).jaxpr
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  calls = [e for e in jaxpr.eqns if e.primitive.name == "ffi_call"
           and e.params["target_name"] == ggc.TARGET and e.params["attributes"]]
  rows_calls = [e for e in calls if dict(e.params["attributes"])["axis"] == ggc.ROWS]
  assert len(rows_calls) == 2, [dict(e.params["attributes"]) for e in calls]   # fprop, dgrad
  for call, want in zip(rows_calls, ((E, N, K), (E, K, N))):
    b = call.invars[1]
    assert b.aval.shape == want and "float8" in str(b.aval.dtype)
    perm = _net_permutation(b, producers)
    assert perm == tuple(range(3)), f"the weights are transposed {perm} before the GEMM"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_float32_weight_gradient_comes_from_the_wgrad_gemm_as_is(cuda_branch, name):
  """float32 expert weights: the wgrad kernel writes their gradient in
  float32 and (E, K, N) order, and that output is the gradient: no
  transpose and no widening pass over every expert's weight after it."""
  del cuda_branch
  x, w, dy, layer = _case(name)

  def weight_grad(x, w, dy):
    _, vjp = jax.vjp(lambda w: layer(x, w), w)
    return vjp(dy)[0]
  jaxpr = jax.make_jaxpr(weight_grad)(x, w, dy).jaxpr
  (wgrad,) = [e for e in jaxpr.eqns if e.primitive.name == "ffi_call"
              and e.params["target_name"] == ggc.TARGET
              and dict(e.params["attributes"])["axis"] == ggc.CONTRACTION]
  out = wgrad.outvars[0]
  assert (out.aval.shape, out.aval.dtype) == ((E, K, N), jnp.float32)
  assert jaxpr.outvars[0] is out
