"""``fp8_autocast(keep_fp8_copies=True)``: the modules' fused norm and MLP
blocks keep the FP8 copies their backward reads instead of quantizing again.

Checked through the modules (Linen and NNX): the choice reaches the fused
blocks (FP8 residuals with it, none without), changes no bit of the output
or the gradients, is part of the jit cache key, and a bad value names the
argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import flax as tfx
from te_jax import nnx as tnx
from te_jax import recipe

import model_memory  # pylint: disable=import-error  (benchmarks/ is on pytest's path)

# Multiples of 128 everywhere: every block on its fused path, every recipe.
E, F = 256, 512
X = jax.random.normal(jax.random.key(0), (2, 128, E), jnp.bfloat16)
RECIPES = {"delayed": recipe.DelayedScaling, "blockwise": recipe.Float8BlockScaling}


def _linen(kind):
  if kind == "mlp":
    return tfx.LayerNormMLP(intermediate_dim=F, activations=("silu", "linear"),
                            layernorm_type="rmsnorm", dtype=jnp.bfloat16)
  return tfx.LayerNormDenseGeneral(F, layernorm_type="rmsnorm", dtype=jnp.bfloat16)


def _linen_loss(kind, r):
  """(loss(params, x), params): the module's mean output under ``r``, its
  FP8 state fixed (part of the closure)."""
  module = _linen(kind)
  with te_jax.fp8_autocast(True, r):
    variables = jax.jit(module.init)(jax.random.key(1), X)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def loss(p, x):
    y = module.apply({"params": p, **rest}, x, mutable=list(rest))[0]
    return jnp.mean(y.astype(jnp.float32) ** 2)
  return loss, params


def _nnx_loss(r):
  with te_jax.fp8_autocast(True, r):
    module = tnx.LayerNormMLP(E, F, activations=("silu", "linear"), layernorm_type="rmsnorm",
                              dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(p, x):
    # The FP8 state is a constant here, taken apart from its Variables: the
    # module updates it, and a Variable of the outer trace can't be updated.
    y = nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest))(x)
    return jnp.mean(y.astype(jnp.float32) ** 2)
  return loss, params


def _cases(r):
  yield "linen LayerNormMLP", _linen_loss("mlp", r)
  yield "linen LayerNormDenseGeneral", _linen_loss("dense", r)
  yield "nnx LayerNormMLP", _nnx_loss(r)


def _under(keep, r, fn, *args):
  with te_jax.fp8_autocast(True, r, keep_fp8_copies=keep):
    return fn(*args)


def _fp8_residual_bytes(loss, params, keep, r):
  rows = _under(keep, r, model_memory.saved_residuals, loss, params, X)
  return sum(row.nbytes for row in rows if row.dtype.startswith("float8") and not row.argument)


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_modules_keep_their_fp8_copies_on_request_and_compute_the_same(rname):
  r = RECIPES[rname]()
  for name, (loss, params) in _cases(r):
    step = jax.jit(jax.value_and_grad(loss))
    want = _under(False, r, step, params, X)
    got = _under(True, r, step, params, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                    err_msg=name)
    # Without the choice no FP8 copy is kept; with it at least the kernels'
    # (one byte per element: wi and wo, or the one kernel).
    kernels = E * F * (3 if "MLP" in name else 1)
    assert _fp8_residual_bytes(loss, params, False, r) == 0, name
    assert _fp8_residual_bytes(loss, params, True, r) >= kernels, name


def test_the_choice_is_part_of_the_jit_cache_key():
  r = recipe.Float8CurrentScaling()
  loss, params = _linen_loss("mlp", r)
  traces = []

  @jax.jit
  def step(p, x):
    traces.append(1)
    return jax.grad(loss)(p, x)
  _under(False, r, step, params, X)
  _under(True, r, step, params, X)
  assert len(traces) == 2
  _under(True, r, step, params, X)
  assert len(traces) == 2
  with te_jax.fp8_autocast(False, keep_fp8_copies=True):   # FP8 off: nothing to keep
    step(params, X)
  step(params, X)
  assert len(traces) == 3


def test_a_non_bool_names_the_argument():
  with pytest.raises(TypeError, match="keep_fp8_copies must be a bool"):
    with te_jax.fp8_autocast(True, keep_fp8_copies="yes"):
      pass
