"""te_jax.moe.router: scores, top-k, weights, balancing losses, bias update.

Expected values are worked out by hand (or by numpy from the formulas of the
module doc) on tiny routings; the router kernel is the identity so the
tokens are the logits.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.moe import router

EYE4 = jnp.eye(4, dtype=jnp.float32)


def _route(logits, **kw):
  kw.setdefault("num_experts_per_token", 2)
  return router.route(jnp.asarray(logits, jnp.float32), EYE4, **kw)


def test_softmax_top2_normalized_weights():
  r = _route([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
  np.testing.assert_array_equal(r.expert_ids, [[0, 1], [2, 3]])
  e = math.e
  np.testing.assert_allclose(r.weights[0], [e / (e + 1), 1 / (e + 1)], rtol=1e-6)
  np.testing.assert_allclose(r.weights[1], [e * e / (e * e + 1), 1 / (e * e + 1)], rtol=1e-6)
  probs0 = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
  np.testing.assert_allclose(r.probs[0], probs0, rtol=1e-6)


def test_unnormalized_weights_are_the_probabilities_times_the_scaling():
  r = _route([[2.0, 1.0, 0.0, -1.0]], normalize_weights=False, scaling_factor=2.5)
  p = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
  np.testing.assert_allclose(r.weights[0], 2.5 * p[:2], rtol=1e-6)


def test_sigmoid_scores():
  logits = [0.5, -1.0, 2.0, 0.0]
  r = _route([logits], score_function="sigmoid")
  s = 1 / (1 + np.exp(-np.asarray(logits)))
  np.testing.assert_array_equal(r.expert_ids[0], [2, 0])
  np.testing.assert_allclose(r.weights[0], s[[2, 0]] / s[[2, 0]].sum(), rtol=1e-6)
  np.testing.assert_allclose(r.probs[0], s / s.sum(), rtol=1e-6)


def test_bias_picks_but_never_weights():
  logits = [[2.0, 1.0, 0.0, -1.0]]
  bias = jnp.asarray([0.0, 0.0, 0.0, 10.0])
  r = _route(logits, num_experts_per_token=1, normalize_weights=False, bias=bias)
  p = np.exp(logits[0]) / np.exp(logits[0]).sum()
  np.testing.assert_array_equal(r.expert_ids, [[3]])
  np.testing.assert_allclose(r.weights, [[p[3]]], rtol=1e-6)
  # and no gradient reaches the bias
  g = jax.grad(lambda b: jnp.sum(_route(logits, bias=b).weights))(bias)
  assert not np.asarray(g).any()


def test_masked_tokens_are_routed_nowhere():
  r = _route([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]],
             token_mask=jnp.asarray([True, False]))
  np.testing.assert_array_equal(r.expert_ids[1], [4, 4])
  np.testing.assert_array_equal(r.weights[1], [0.0, 0.0])
  np.testing.assert_array_equal(router.tokens_per_expert(r, 4), [1, 1, 0, 0])


def test_load_balancing_loss_by_hand():
  # balanced: token t strongly prefers expert t -> f_e = 1/4, P_e ~ 1/4 -> 1
  strong = 20.0 * np.eye(4)
  r = _route(strong, num_experts_per_token=1)
  np.testing.assert_allclose(router.load_balancing_loss(r), 1.0, rtol=1e-6)
  # collapsed: every token prefers expert 0 -> f_0 = 1, P_0 ~ 1 -> E = 4
  r = _route(np.tile([20.0, 0, 0, 0], (4, 1)), num_experts_per_token=1)
  np.testing.assert_allclose(router.load_balancing_loss(r), 4.0, rtol=1e-6)
  # a mixed case from the formula: E * sum_e f_e * P_e
  logits = np.array([[1.0, 0.5, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
  r = _route(logits, num_experts_per_token=2)
  p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  counts = np.zeros(4)
  for row in np.argsort(-p, axis=1, kind="stable")[:, :2]:
    counts[row] += 1
  want = 4 * np.sum(counts / (3 * 2) * p.mean(0))
  np.testing.assert_allclose(router.load_balancing_loss(r), want, rtol=1e-6)


def test_load_balancing_loss_ignores_masked_tokens_and_has_a_gradient():
  logits = np.array([[1.0, 0.5, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0], [9.0, 0.0, 0.0, 0.0]])
  mask = jnp.asarray([True, True, False])
  full = router.load_balancing_loss(_route(logits[:2]))
  masked = router.load_balancing_loss(_route(logits, token_mask=mask))
  np.testing.assert_allclose(masked, full, rtol=1e-6)
  g = jax.grad(lambda l: router.load_balancing_loss(_route(l)))(jnp.asarray(logits))
  assert np.isfinite(np.asarray(g)).all() and np.asarray(g).any()


def test_router_z_loss_by_hand():
  r = _route([[0.0, 0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0, 0.0]])
  want = (math.log(4.0) ** 2 + math.log(5.0) ** 2) / 2
  np.testing.assert_allclose(router.router_z_loss(r), want, rtol=1e-6)


def test_update_balance_bias():
  bias = jnp.asarray([0.1, 0.0, -0.2, 0.0])
  new = router.update_balance_bias(bias, jnp.asarray([4.0, 0.0, 2.0, 2.0]), 0.01)
  np.testing.assert_allclose(new, [0.09, 0.01, -0.2, 0.0], rtol=1e-6)
  with pytest.raises(ValueError, match="same shape"):
    router.update_balance_bias(bias, jnp.zeros(3), 0.01)


def test_router_runs_in_float32():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), jnp.bfloat16)
  k = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.bfloat16)
  r = router.route(x, k, num_experts_per_token=2)
  assert r.logits.dtype == r.weights.dtype == r.probs.dtype == jnp.float32
  want = np.asarray(x, np.float64) @ np.asarray(k, np.float64)
  np.testing.assert_allclose(r.logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(num_experts_per_token=5), ValueError, r"in \[1, 4\]"),
    (dict(num_experts_per_token=2, score_function="relu"), ValueError, "score_function"),
    (dict(num_experts_per_token=2, bias=jnp.zeros(3)), ValueError, "bias must have shape"),
    (dict(num_experts_per_token=2, token_mask=jnp.ones(3, bool)), ValueError,
     "token_mask must have shape"),
])
def test_argument_checks(kw, exc, msg):
  with pytest.raises(exc, match=msg):
    router.route(jnp.ones((2, 4)), EYE4, **kw)
  with pytest.raises(ValueError, match="must share H"):
    router.route(jnp.ones((2, 5)), EYE4, num_experts_per_token=1)
