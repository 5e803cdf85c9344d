"""The MoE's shared experts as one fused FP8 MLP (``te_jax.fused_mlp.fp8_mlp``).

Under FP8 with nothing sharded and whole blocks (tokens a multiple of the
recipe's token block, hidden and shared width multiples of 128) the shared
experts run as one custom VJP with the activation fused into quantization,
as the routed experts do (``te_jax.grouped_mlp``); elsewhere two FP8 dense
layers around an XLA activation, logged once with the reason. Both paths
compute the same function: checked against the float32 dense reference
(test_moe_block.py's tolerances) and against each other (bit for bit on the
reference path).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import fused_mlp, moe, recipe
from te_jax.moe import block as block_lib

from test_moe_block import dense_reference  # pylint: disable=import-error  (tests/ is on the path)

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}
# test_moe_block.py's: two chained FP8 GEMMs against float32.
FWD_TOL, GRAD_TOL = 0.08, 0.15
CFG = moe.MoEConfig(num_experts=4, num_experts_per_token=2, shared_intermediate_dim=128)
T, H, F = 128, 128, 128   # whole 128-blocks: the fused path under every recipe


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _setup(seed=0, t=T):
  kx, kp, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = moe.init_params(kp, CFG, H, F, shared_intermediate=CFG.shared_intermediate_dim)
  x = jax.random.normal(kx, (t, H), jnp.float32)
  g = jax.random.normal(kg, (t, H), jnp.float32)
  return x, params, g


def _reference(x, params):
  """Every token through every expert and the shared MLP, float32."""
  return dense_reference(x, params, config=CFG)


def _step(r, x, params, g, state, keep=False, impl="auto"):
  """y, the gradients of x and the parameters, and the new delayed state."""
  def f(x, p, s):
    return moe.moe_block(x, p, config=CFG, recipe=r, fp8_state=s, keep_fp8_copies=keep,
                         impl=impl)[0]
  y, vjp = jax.vjp(f, x, params, state)
  dx, dp, new_state = vjp(g)
  return y, dx, dp, new_state


@pytest.fixture
def fused_calls(monkeypatch):
  """The keyword arguments of every fused_mlp.fp8_mlp call (at trace time)."""
  calls, real = [], fused_mlp.fp8_mlp

  def spy(*args, **kw):
    calls.append(kw)
    return real(*args, **kw)
  monkeypatch.setattr(fused_mlp, "fp8_mlp", spy)
  return calls


@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_shared_experts_close_to_the_dense_reference(name, fused_calls):
  r = RECIPES[name]
  x, params, g = _setup()
  state = moe.init_fp8_state(r, CFG, shared=True)
  if state is not None:   # a warm delayed state: scales from this input's amaxes
    state = jax.jit(lambda s: _step(r, x, params, g, s)[3])(state)
  y, dx, dp, _ = jax.jit(lambda s: _step(r, x, params, g, s))(state)
  # one trace of the step, and one of the warm-up when there is a state
  assert len(fused_calls) == (2 if state is not None else 1)
  ref, ref_vjp = jax.vjp(_reference, x, params)
  ref_dx, ref_dp = ref_vjp(g)
  assert rel(y, ref) < FWD_TOL
  assert rel(dx, ref_dx) < GRAD_TOL
  for k in ("shared_wi", "shared_wo", "wi", "wo"):
    assert rel(dp[k], ref_dp[k]) < GRAD_TOL, k


@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_and_unfused_shared_experts_agree(name, fused_calls, monkeypatch):
  """The same GEMM operands (x and the kernels quantized with the same
  scales), act(h) from the same float32 h: on the reference path the two
  paths give the same output, gradients and delayed state bit for bit."""
  r = RECIPES[name]
  x, params, g = _setup(seed=1)
  state = moe.init_fp8_state(r, CFG, shared=True)
  run = lambda: jax.jit(lambda s: _step(r, x, params, g, s, impl="reference"))(state)
  fused = run()
  assert len(fused_calls) == 1
  monkeypatch.setattr(block_lib, "shared_unfused_reason", lambda *a, **k: "forced (test)")
  unfused = run()
  assert len(fused_calls) == 1   # the forced run took the two dense layers
  jax.tree.map(np.testing.assert_array_equal, fused, unfused)


def test_keep_fp8_copies_reaches_the_fused_shared_experts(fused_calls):
  r = RECIPES["current"]
  x, params, g = _setup(seed=2)
  for keep in (False, True):
    fused_calls.clear()
    jax.jit(lambda: _step(r, x, params, g, None, keep))()
    (kw,) = fused_calls
    assert kw["save_original_input"] is (not keep) and kw["save_original_kernel"] is (not keep)
  with pytest.raises(TypeError, match="keep_fp8_copies must be a bool"):
    moe.moe_block(x, params, config=CFG, recipe=r, keep_fp8_copies=1)


def test_unfused_shared_experts_say_why_once(fused_calls, caplog):
  block_lib._log_shared_unfused.cache_clear()  # pylint: disable=protected-access
  r = RECIPES["blockwise"]
  x, params, g = _setup(seed=3, t=96)   # not a whole 128-token block
  with caplog.at_level(logging.INFO, logger="te_jax"):
    for _ in range(2):
      y = jax.jit(lambda: _step(r, x, params, g, None)[0])()
  assert fused_calls == []
  said = [m for m in caplog.messages if "shared experts run as two FP8 dense layers" in m]
  assert len(said) == 1 and "96 tokens" in said[0] and "% 128" in said[0]
  ref = _reference(x, params)
  assert rel(y, ref) < FWD_TOL


def test_shared_unfused_reason():
  _, params, _ = _setup()
  for name, r in RECIPES.items():
    tb = r.scaling_mode().token_block
    reason = lambda shape, ep=False, r=r: block_lib.shared_unfused_reason(
        shape, params, CFG, r, None, None, ep)
    assert reason((2, tb, H)) is None, name
    assert "sharded" in reason((2, tb, H), ep=True), name
    assert f"{tb + 1} tokens" in reason((1, tb + 1, H)) and f"tokens % {tb}" in \
        reason((1, tb + 1, H)), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fused_shared_experts_cuda_match_reference(name):
  """The whole block with its fused shared experts on the GPU (te_jax's
  grouped and fused MLP kernels) against the reference path on the CPU:
  CUDA's and XLA's float32 exp differ by ulps, so a few FP8 roundings move
  by one step (< 1% in norm, as test_grouped_mlp's)."""
  from te_jax.ops import _native   # pylint: disable=import-outside-toplevel
  from te_jax.ops import grouped_gemm_cuda as ggc   # pylint: disable=import-outside-toplevel
  reason = ("needs a GPU and the te_jax CUDA custom calls" if not _native.cuda_available()
            else ggc.build_reason() or ggc.device_reason())
  if reason:
    pytest.skip(reason)
  r = RECIPES[name]
  x, params, g = _setup(seed=4)
  # bfloat16 compute, float32 parameters: as the modules run the block
  x, g = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
  state = moe.init_fp8_state(r, CFG, shared=True)

  def run(impl, device):
    args = jax.device_put((x, params, g, state), device)
    return jax.jit(lambda x, p, g, s: _step(r, x, p, g, s, impl=impl))(*args)

  got = run("auto", jax.devices("gpu")[0])
  want = run("reference", jax.devices("cpu")[0])
  assert rel(got[0], want[0]) < 1e-2
  assert rel(got[1], want[1]) < 1e-2
  for k in ("shared_wi", "shared_wo", "wi", "wo"):
    assert rel(got[2][k], want[2][k]) < 1e-2, k
