"""Scales that never go wrong silently (issue 23, items 1, 2 and 4), CPU.

* Delayed scaling keeps the previous scale when the reduced amax is 0 or the
  amax is not finite; a tiny amax gives ``fp8_max / amax`` clamped to the
  float32 max; the stored scale is the one that quantizes (no
  ``1 / (1 / scale)`` round trip).
* A NaN or Inf in a GEMM operand makes that GEMM's output non-finite under
  every recipe, as the unquantized product would be, while the delayed state
  keeps a finite scale.
* Microbatch states merge to the one-big-batch state; old checkpoints migrate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import dense, fp8_state, fused_mlp, recipe
from te_jax.ops import act_quantize as aq
from te_jax.ops import quantize as qop

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32_MAX = float(np.finfo(np.float32).max)
# The same checks on the CUDA path under the gpu marker (skipped without a GPU).
IMPLS = ["reference", pytest.param("cuda", marks=pytest.mark.gpu)]
RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}


def _update(st, amax, r=None, dtype=E4M3):
  r = r or recipe.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
  return fp8_state.update_tensor_state(st, jnp.float32(amax), r, dtype)


# ------------------------------------------------------------ state rules --

@pytest.mark.parametrize("algo,hist", [("most_recent", 4), ("max", 1)])
def test_zero_amax_keeps_the_previous_scale(algo, hist):
  r = recipe.DelayedScaling(amax_history_len=hist, amax_compute_algo=algo)
  st = _update(fp8_state.init_tensor_state(hist), 2.0, r)
  assert float(st["scale"]) == 224.0
  st0 = _update(st, 0.0, r)
  assert float(st0["scale"]) == 224.0        # TE: "no action is possible"
  st1 = _update(st0, 4.0, r)                 # the next real amax sets it again
  assert float(st1["scale"]) == 112.0


def test_non_finite_amax_keeps_the_scale_and_is_recorded_as_zero():
  st = _update(fp8_state.init_tensor_state(1), 8.0)
  for bad in (np.inf, -np.inf, np.nan):
    st2 = _update(st, bad)
    assert float(st2["scale"]) == 56.0 and float(st2["amax_history"][0]) == 0.0


@pytest.mark.parametrize("amax", [1e-37, 3e-39, 1e-45])   # normal, subnormal, smallest
def test_tiny_amax_gives_a_finite_clamped_scale(amax):
  # TE's rule: fp8_max / amax, clamped to FLT_MAX -- also for subnormal
  # amaxes, which XLA:CPU would otherwise flush to 0 (then: scale 1).
  st = _update(fp8_state.init_tensor_state(1), amax)
  assert float(st["scale"]) == F32_MAX
  s = float(qop.compute_scale(jnp.float32(amax), E4M3))
  assert s == F32_MAX


def test_the_stored_scale_is_the_one_that_quantizes():
  # 1 / (1 / s) != s for many float32 s: the state stores s itself.
  amaxes = np.float32(np.random.default_rng(0).uniform(0.01, 100.0, 200))
  roundtrip_differs = 0
  r = recipe.DelayedScaling(amax_history_len=1)
  mode = r.scaling_mode()
  for a in amaxes:
    st = _update(fp8_state.init_tensor_state(1), a, r)
    s = np.float32(448.0) / a
    assert np.float32(st["scale"]) == s
    roundtrip_differs += np.float32(1) / (np.float32(1) / s) != s
    x = jnp.full((16, 16), a, jnp.float32)
    q = mode.quantize(x, "x", {"x": st}, impl="reference", columnwise=False)
    want = qop.saturating_cast(x * s, E4M3)
    np.testing.assert_array_equal(np.asarray(q.data, np.float32), np.asarray(want, np.float32))
  assert roundtrip_differs > 0   # the old representation would have moved these scales


def test_unused_state_reads_as_scale_one():
  zero = jax.tree.map(jnp.zeros_like, fp8_state.init_tensor_state(4))
  assert float(fp8_state.scale_from_state(zero)) == 1.0


# ------------------------------------------------------- non-finite values --

def _operands(bad=None, where="x"):
  x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (128, 256), jnp.float32) * 0.05
  if bad is not None:
    if where == "x":
      x = x.at[5, 7].set(bad)
    else:
      w = w.at[3, 9].set(bad)
  return x, w


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["x", "kernel"])
@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_operand_makes_the_gemm_non_finite(name, bad, where, impl):
  r = RECIPES[name]()
  x, w = _operands(bad, where)
  st = r.scaling_mode().init_state()

  def loss(x, w, st):
    return jnp.sum(dense.fp8_dense(x, w, recipe=r, fp8_state=st, impl=impl) ** 2)

  y = dense.fp8_dense(x, w, recipe=r, fp8_state=st, impl=impl)
  assert not np.all(np.isfinite(np.asarray(y)))                 # forward
  plain = x @ w
  assert not np.all(np.isfinite(np.asarray(plain)))              # as unquantized
  val, (dx, dw, dst) = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, st)
  assert not np.isfinite(float(val))
  assert not np.all(np.isfinite(np.asarray(dw)))
  if dst is not None:   # the delayed state keeps a finite scale
    for t in ("x", "kernel", "grad"):
      assert np.isfinite(float(dst[t]["scale"])), t
      assert np.all(np.isfinite(np.asarray(dst[t]["amax_history"]))), t


@pytest.mark.parametrize("mode", ["tensorwise", "current", "blockwise"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_prologue_ops_do_not_saturate_an_inf(mode, impl):
  h = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32).at[1, 1].set(jnp.inf)
  kw = {"scale": jnp.float32(2.0)} if mode == "tensorwise" else {}
  q = aq.act_quantize(h, ("relu",), mode=mode, dtype=E4M3, impl=impl, **kw)
  assert not np.all(np.isfinite(np.asarray(q.scale_inv)))
  assert not np.all(np.isfinite(np.asarray(q.scale_inv_t)))
  # finite inputs are untouched by the rule
  q2 = aq.act_quantize(jnp.where(jnp.isinf(h), 0.0, h), ("relu",), mode=mode, dtype=E4M3,
                       impl=impl, **kw)
  assert np.all(np.isfinite(np.asarray(q2.scale_inv)))


def test_fused_mlp_surfaces_an_inf_in_every_recipe():
  x = jax.random.normal(jax.random.key(3), (128, 128), jnp.float32).at[0, 0].set(jnp.inf)
  wi = jax.random.normal(jax.random.key(4), (128, 256), jnp.float32) * 0.05
  wo = jax.random.normal(jax.random.key(5), (256, 128), jnp.float32) * 0.05
  for name, make in RECIPES.items():
    r = make()
    mode = r.scaling_mode()
    y = fused_mlp.fp8_mlp(x, wi, wo, activations=("gelu",), recipe=r,
                          wi_state=mode.init_state(), wo_state=mode.init_state())
    assert not np.all(np.isfinite(np.asarray(y))), name


def test_finite_outlier_still_saturates():
  # Saturation is for finite values: 1e30 with a delayed scale of 1 is 448.
  x = jnp.array([[1e30, 1.0]], jnp.float32)
  q = qop.quantize_tensorwise(x, jnp.float32(1.0), E4M3)
  assert np.asarray(q.data, np.float32).tolist() == [[448.0, 1.0]]
  assert np.isfinite(float(q.scale_inv))


# ------------------------------------------------- merging and migration --

def test_microbatch_states_merge_to_the_big_batch_state():
  r = recipe.DelayedScaling(amax_history_len=4)
  x, w = _operands()
  xs = (x[:32] * 3.0, x[32:])
  st = fp8_state.init_dense_state(4)
  loss = lambda x, s: jnp.sum(dense.fp8_dense(x, w, recipe=r, fp8_state=s) ** 2)
  g = [jax.grad(loss, argnums=1)(xm, st) for xm in xs]
  merged = fp8_state.accumulate_gradients({fp8_state.FP8_COLLECTION: g[0]},
                                          {fp8_state.FP8_COLLECTION: g[1]})
  big = jax.grad(loss, argnums=1)(jnp.concatenate(xs), st)
  jax.tree.map(np.testing.assert_array_equal, merged[fp8_state.FP8_COLLECTION], big)


def test_merge_ignores_a_microbatch_whose_state_did_not_run():
  a = _update(fp8_state.init_tensor_state(1), 2.0)
  zero = jax.tree.map(jnp.zeros_like, a)
  for pair in ((a, zero), (zero, a)):
    m = fp8_state.accumulate_gradients({fp8_state.FP8_COLLECTION: pair[0]},
                                       {fp8_state.FP8_COLLECTION: pair[1]})
    assert float(m[fp8_state.FP8_COLLECTION]["scale"]) == 224.0


def test_migrate_scale_inv_converts_old_checkpoints():
  old = {"params": {"w": jnp.ones(2)},
         fp8_state.FP8_COLLECTION: {"layer": {"fp8_meta": {
             "x": {"amax_history": jnp.ones(3), "scale_inv": jnp.float32(0.5)},
             "grad": {"amax_history": jnp.zeros(3), "scale_inv": jnp.float32(0.0)}}}}}
  new = fp8_state.migrate_scale_inv(old)
  meta = new[fp8_state.FP8_COLLECTION]["layer"]["fp8_meta"]
  assert float(meta["x"]["scale"]) == 2.0 and float(meta["grad"]["scale"]) == 1.0
  assert set(meta["x"]) == {"amax_history", "scale"}
  assert new["params"] is old["params"] or np.all(new["params"]["w"] == 1)
