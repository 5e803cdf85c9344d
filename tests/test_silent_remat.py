"""Issue 44 item 4 under rematerialization: a remat'd block called twice.

``nn.remat`` / ``nnx.remat`` (``jax.checkpoint``) hand each call the FP8
state as a new value, so the uses inside one call merge but two calls add
their updates in the caller's trace, where no te_jax code runs: the newest
amax entry became the sum of the calls' amaxes, silently. Now:

* Linen: a second ``nn.remat`` call on one state in a differentiated step
  raises at trace time, naming ``share_fp8_state``; wrapped in it
  (``share_fp8_state(nn.remat(Block))``) the calls merge into one update.
  One call per step is untouched.
* NNX: ``nnx.remat`` reuses its first call's trace for the next, so a
  second call cannot be seen: a float32 state read inside ``nnx.remat`` of
  a differentiated step gives an ``FP8StateWarning`` (once per module and
  state) naming ``shared_fp8_state``; one call per step stays correct, and
  inside ``shared_fp8_state`` one call or several merge.
* A ``jax.checkpoint`` around a Linen ``apply`` is warned about the same
  way (its later calls may reuse the trace); ``share_tree`` makes it merge.

(``nn.scan`` of ``nn.remat`` blocks, and ``nnx.scan`` of ``nnx.remat`` calls
shared inside the body: tests/test_silent_wiring.py.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax.layers import state as layer_state
from te_jax import flax as tfx
from te_jax import fp8_state
from te_jax import nnx as tnx
from te_jax import recipe
from te_jax.flax import share_fp8_state
from te_jax.fp8_state import FP8_COLLECTION
from te_jax.nnx import shared_fp8_state

HIST = 4
R = recipe.DelayedScaling(amax_history_len=HIST)
MODE = R.scaling_mode()
A, B = jnp.full((8, 32), 2.0), jnp.full((8, 32), -3.0)


def _expected(old, x_amax, kernel, grad_amax):
  amaxes = {"x": x_amax, "kernel": float(jnp.max(jnp.abs(kernel))), "grad": grad_amax}
  return MODE.update_state(old, {r: jnp.float32(a) for r, a in amaxes.items()})


def _assert_state(got, want):
  for role in ("x", "kernel", "grad"):
    for leaf in ("amax_history", "scale"):
      np.testing.assert_array_equal(np.asarray(got[role][leaf]), np.asarray(want[role][leaf]),
                                    err_msg=f"{role}/{leaf}")


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return tfx.DenseGeneral(16, use_bias=False, name="d")(x)


class Model(nn.Module):
  """``remat(Block)`` applied to A (and to B with ``twice``), possibly shared."""

  share: bool = False
  twice: bool = True

  @nn.compact
  def __call__(self, a, b):
    cls = nn.remat(Block)
    blk = (share_fp8_state(cls) if self.share else cls)(name="blk")
    return jnp.sum(blk(a)) + (2.0 * jnp.sum(blk(b)) if self.twice else 0.0)


def _linen(model, enabled=True):
  with te_jax.fp8_autocast(enabled, R):
    variables = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), A, B))
    grads = jax.jit(jax.grad(lambda v: model.apply(v, A, B)))(variables)
  kernel = variables["params"]["blk"]["d"]["kernel"]
  return (variables[FP8_COLLECTION]["blk"]["d"]["fp8_meta"],
          grads[FP8_COLLECTION]["blk"]["d"]["fp8_meta"], kernel)


def test_linen_remat_block_applied_twice_raises_naming_the_fix():
  with pytest.raises(ValueError, match=r"second call of the nn.remat.*share_fp8_state"):
    _linen(Model(twice=True))


def test_linen_shared_remat_block_applied_twice_merges():
  old, got, kernel = _linen(Model(share=True, twice=True))
  assert old["x"]["amax_history"].dtype == jnp.float32     # stored layout unchanged
  _assert_state(got, _expected(old, 3.0, kernel, 2.0))
  np.testing.assert_array_equal(got["x"]["amax_history"], [3.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
def test_linen_remat_block_applied_once_is_unchanged(share):
  old, got, kernel = _linen(Model(share=share, twice=False))
  _assert_state(got, _expected(old, 2.0, kernel, 1.0))


def test_linen_remat_block_applied_twice_with_fp8_off_keeps_the_state():
  # Each call keeps the state unused: shared, the two keeps give it back once;
  # as two float32 "gradients" they would double it, so unshared it raises.
  with te_jax.fp8_autocast(True, R):
    variables = nn.unbox(jax.jit(Model(share=True).init)(jax.random.PRNGKey(0), A, B))
  with te_jax.fp8_autocast(enabled=False):
    grads = jax.jit(jax.grad(lambda v: Model(share=True).apply(v, A, B)))(variables)
    with pytest.raises(ValueError, match="share_fp8_state"):
      jax.jit(jax.grad(lambda v: Model(share=False).apply(v, A, B)))(variables)
  _assert_state(grads[FP8_COLLECTION]["blk"]["d"]["fp8_meta"],
                variables[FP8_COLLECTION]["blk"]["d"]["fp8_meta"])


def test_jax_checkpoint_around_apply_warns_and_share_tree_merges(monkeypatch):
  """One call of a checkpoint around apply is right but its next call could
  reuse the trace unseen: warned once, naming share_tree, which merges."""
  monkeypatch.setattr(layer_state, "_WARNED_UNSEEN", set())
  layer = tfx.DenseGeneral(16, use_bias=False)
  with te_jax.fp8_autocast(True, R):
    variables = nn.unbox(layer.init(jax.random.PRNGKey(0), A))
  call = jax.checkpoint(lambda v, x: jnp.sum(layer.apply(v, x)))

  def loss(v, share):
    if share:
      v = {**v, FP8_COLLECTION: fp8_state.share_tree(v[FP8_COLLECTION], MODE)}
    return call(v, A) + 2.0 * call(v, B)
  with te_jax.fp8_autocast(True, R):
    with pytest.warns(fp8_state.FP8StateWarning, match="jax.checkpoint.*share_tree"):
      jax.jit(jax.grad(lambda v: loss(v, False)))(variables)
    got = jax.jit(jax.grad(lambda v: loss(v, True)))(variables)[FP8_COLLECTION]["fp8_meta"]
  _assert_state(got, _expected(variables[FP8_COLLECTION]["fp8_meta"], 3.0,
                               variables["params"]["kernel"], 2.0))


# ------------------------------------------------------------- NNX ------

def _nnx(share, twice):
  with te_jax.fp8_autocast(True, R):
    layer = tnx.Linear(32, 16, rngs=nnx.Rngs(0))
  block = nnx.remat(lambda m, x: m(x))

  def loss(m):
    def calls():
      return jnp.sum(block(m, A)) + (2.0 * jnp.sum(block(m, B)) if twice else 0.0)
    if not share:
      return calls()
    with shared_fp8_state(m):
      return calls()

  old = layer.fp8_meta.get_value()
  with te_jax.fp8_autocast(True, R):
    got = nnx.jit(lambda m: nnx.grad(loss, argnums=tnx.diff_state(0))(m))(layer)
  assert layer.fp8_meta.get_value()["x"]["amax_history"].dtype == jnp.float32
  return old, got["fp8_meta"].get_value(), layer.kernel[...]


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_nnx_remat_without_sharing_warns_naming_the_fix(twice, monkeypatch):
  """te_jax cannot see a second nnx.remat call (it reuses the first's trace):
  every unshared read there is warned about once, naming shared_fp8_state;
  one call per step stays correct."""
  monkeypatch.setattr(layer_state, "_WARNED_UNSEEN", set())
  with pytest.warns(fp8_state.FP8StateWarning, match="nnx.remat.*shared_fp8_state"):
    old, got, kernel = _nnx(share=False, twice=twice)
  if not twice:
    _assert_state(got, _expected(old, 2.0, kernel, 1.0))


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_nnx_shared_remat_calls_merge(twice):
  old, got, kernel = _nnx(share=True, twice=twice)
  _assert_state(got, _expected(old, 3.0 if twice else 2.0, kernel, 2.0 if twice else 1.0))


def test_the_fixes_the_messages_name_are_public():
  """The errors and warnings above name te_jax.flax.share_fp8_state and
  te_jax.nnx.shared_fp8_state: both resolve, and are in their __all__."""
  import te_jax.flax
  import te_jax.nnx
  import inspect
  from te_jax.flax import fp8_module
  from te_jax.nnx import state as nnx_state
  for module, name, source in ((te_jax.flax, "share_fp8_state", fp8_module),
                               (te_jax.nnx, "shared_fp8_state", nnx_state)):
    assert name in module.__all__ and callable(getattr(module, name))
    assert f"{module.__name__}.{name}" in inspect.getsource(source)
