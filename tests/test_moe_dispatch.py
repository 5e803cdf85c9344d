"""te_jax.moe.dispatch (and parallel.regroup): static-shape placement by expert.

The buffer bound is checked against every routing of small cases (brute
force); dispatch + combine against a per-token loop for 1..N tokens; the
capacity's drops by hand; static shapes by counting traces.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.moe import dispatch, parallel


def _compositions(total, parts):
  """Every way to split ``total`` assignments among ``parts`` experts."""
  for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
    edges = (0,) + cuts + (total,)
    yield [edges[i + 1] - edges[i] for i in range(parts)]


@pytest.mark.parametrize("block", [1, 4, 8])
def test_rows_bound_is_the_worst_routing(block):
  for a in range(1, 13):
    for e in range(1, 5):
      worst = max(sum(-(-c // block) * block for c in counts)
                  for counts in _compositions(a, e))
      assert dispatch.rows_bound(a, e, block) == worst, (a, e, block)


def test_capacity_rows():
  assert dispatch.capacity_rows(1.0, 100, 4, 16) == 32   # 25 -> 32
  assert dispatch.capacity_rows(2.0, 100, 4, 1) == 50
  assert dispatch.capacity_rows(0.01, 100, 4, 8) == 8    # at least one block
  assert dispatch.segment_rows(100, 4, 16, capacity=32) == 128
  assert dispatch.segment_rows(10, 4, 16, capacity=32) == 16 * ((10 + 4 * 15) // 16)
  for bad in (0, -1.0, float("inf"), True):
    with pytest.raises(ValueError, match="capacity_factor"):
      dispatch.capacity_rows(bad, 10, 2, 1)


def _plan(ids, e, block, capacity=None, segments=1):
  ids = jnp.asarray(ids, jnp.int32)
  rows = dispatch.segment_rows(ids.shape[0], e // segments, block, capacity)
  return dispatch.plan(ids, num_experts=e, block=block, rows_per_segment=rows,
                       segments=segments, capacity=capacity), rows


def test_plan_groups_are_contiguous_padded_and_in_assignment_order():
  ids = np.array([2, 0, 2, 3, 0, 2, 4, 2])   # 4 = routed nowhere
  d, rows = _plan(ids, 4, 4)
  np.testing.assert_array_equal(d.group_sizes, [4, 0, 4, 4])
  dest = np.asarray(d.dest)
  # expert 0 at rows 0.., expert 2 at 4.., expert 3 at 8..; order kept in a group
  np.testing.assert_array_equal(dest, [4, 0, 5, 8, 1, 6, rows, 7])
  assert int(d.dropped) == 0


def _identity_experts(buf, group_sizes):
  """Expert e multiplies its rows by (e + 1): a stand-in MLP with a known answer."""
  e = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                 total_repeat_length=buf.shape[0])
  return buf * (e + 1.0)[:, None]


def _per_token(x, ids, w, e, capacity_kept=None):
  """sum_j w[t, j] * (ids[t, j] + 1) * x[t] over the kept (t, j)."""
  scale = np.where(ids < e, ids + 1.0, 0.0) * np.asarray(w)
  if capacity_kept is not None:
    scale = scale * capacity_kept
  return scale.sum(1, keepdims=True) * np.asarray(x)


@pytest.mark.parametrize("block, counts", [(16, range(1, 10)), (1, (1, 5))])
def test_dispatch_combine_for_1_to_n_tokens(block, counts):
  e, k, h = 4, 2, 3
  rng = np.random.default_rng(0)

  @jax.jit
  def run(x, ids, w):
    d, rows = _plan(dispatch.flat_assignments(ids), e, block)
    buf = dispatch.dispatch_rows(x, d, rows)
    return dispatch.combine_rows(_identity_experts(buf, d.group_sizes), d, w)

  for t in counts:
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    np.testing.assert_allclose(run(x, jnp.asarray(ids), w), _per_token(x, ids, w, e),
                               rtol=1e-6, atol=1e-6)


def test_every_token_to_one_expert():
  t, e = 7, 4
  x = jnp.asarray(np.random.default_rng(1).standard_normal((t, 2)), jnp.float32)
  ids = np.full((t, 1), 3, np.int32)
  d, rows = _plan(dispatch.flat_assignments(jnp.asarray(ids)), e, 4)
  np.testing.assert_array_equal(d.group_sizes, [0, 0, 0, 8])
  assert rows >= 8 and int(d.dropped) == 0
  buf = dispatch.dispatch_rows(x, d, rows)
  np.testing.assert_array_equal(buf[:7], x)
  y = dispatch.combine_rows(_identity_experts(buf, d.group_sizes), d, jnp.ones((t, 1)))
  np.testing.assert_allclose(y, 4 * x, rtol=1e-6)


def test_capacity_drops_are_counted_first_choices_first():
  # 6 tokens, k=2; expert 0 is every token's first choice, expert 1 the second
  t, e = 6, 2
  ids = jnp.asarray(np.tile([0, 1], (t, 1)), jnp.int32)
  d, rows = _plan(dispatch.flat_assignments(ids), e, 2, capacity=4)
  assert rows == 8
  assert int(d.dropped) == 4   # 2 of each expert's 6
  np.testing.assert_array_equal(d.group_sizes, [4, 4])
  x = jnp.asarray(np.arange(1.0, 7.0)[:, None], jnp.float32)
  w = jnp.full((t, 2), 0.5)
  buf = dispatch.dispatch_rows(x, d, rows)
  y = dispatch.combine_rows(_identity_experts(buf, d.group_sizes), d, w)
  kept = np.array([[1, 1]] * 4 + [[0, 0]] * 2)   # tokens 0-3 fit in both experts
  np.testing.assert_allclose(y, _per_token(x, np.asarray(ids), w, e, kept), rtol=1e-6)
  # choice-major priority: with second choices spread, first choices survive
  ids2 = jnp.asarray([[0, 1], [0, 1], [1, 0], [0, 1]], jnp.int32)
  d2, _ = _plan(dispatch.flat_assignments(ids2), e, 1, capacity=2)
  dest = np.asarray(d2.dest).reshape(2, 4)   # (choice, token)
  assert int(d2.dropped) == 4
  # expert 0 keeps the first choices of tokens 0, 1 (not token 2's second)
  assert (dest[0, :2] < 4).all() and dest[1, 2] == 4 and dest[0, 3] == 4


def test_segments_lay_out_one_chunk_per_device():
  ids = jnp.asarray([3, 0, 1, 3, 2, 0], jnp.int32)   # 4 experts over 2 segments
  d, rows = _plan(ids, 4, 2, segments=2)
  dest = np.asarray(d.dest)
  assert (dest[[1, 2, 5]] < rows).all()          # experts 0, 1 in chunk 0
  assert (dest[[0, 3, 4]] >= rows).all()         # experts 2, 3 in chunk 1
  np.testing.assert_array_equal(d.group_sizes, [2, 2, 2, 2])
  np.testing.assert_array_equal(np.sort(dest[[1, 5]]), [0, 1])   # expert 0 first


def test_regroup_puts_each_local_expert_together():
  # 2 senders, 2 local experts; sender 0 sent 2 rows for e0 and 1 for e1,
  # sender 1 sent 0 for e0 and 2 for e1 (chunks of 4 rows)
  dest, sizes = parallel.regroup(jnp.asarray([[2, 1], [0, 2]], jnp.int32), 4)
  np.testing.assert_array_equal(sizes, [2, 3])
  # e0: sender 0 rows 0,1 -> 0,1; e1: sender 0 row 2 -> 2, sender 1 rows 0,1 -> 3,4
  np.testing.assert_array_equal(dest, [0, 1, 2, 8, 3, 4, 8, 8])


def test_one_trace_for_two_routings():
  traces = []
  e, t, k = 4, 5, 2

  @jax.jit
  def run(x, ids):
    traces.append(1)
    d, rows = _plan(dispatch.flat_assignments(ids), e, 8)
    buf = dispatch.dispatch_rows(x, d, rows)
    return dispatch.combine_rows(_identity_experts(buf, d.group_sizes), d,
                                 jnp.ones((t, k))), d.dropped

  x = jnp.ones((t, 3))
  for ids in (np.tile([0, 1], (t, 1)), np.tile([3, 2], (t, 1))):
    y, dropped = run(x, jnp.asarray(ids, jnp.int32))
    np.testing.assert_allclose(y, _per_token(x, ids, np.ones((t, k)), e), rtol=1e-6)
    assert int(dropped) == 0
  assert len(traces) == 1


def test_gradients_of_the_k_copies_add_up():
  e, t = 3, 4
  ids = jnp.asarray([[0, 2], [1, 0], [2, 1], [0, 1]], jnp.int32)
  w = jnp.asarray(np.random.default_rng(2).random((t, 2)), jnp.float32)

  def f(x):
    d, rows = _plan(dispatch.flat_assignments(ids), e, 4)
    buf = dispatch.dispatch_rows(x, d, rows)
    return jnp.sum(dispatch.combine_rows(_identity_experts(buf, d.group_sizes), d, w))

  g = jax.grad(f)(jnp.ones((t, 2)))
  want = (np.asarray(w) * (np.asarray(ids) + 1.0)).sum(1)
  np.testing.assert_allclose(g, np.repeat(want[:, None], 2, 1), rtol=1e-6)


def _autodiff_dispatch_combine(x, d, rows, w):
  """dispatch_rows then combine_rows written as plain gathers: what autodiff
  of them gives (scatter-adds) is the reference of their custom VJPs."""
  t, k = w.shape
  a = d.dest.shape[0]
  buf = dispatch.place_rows(x, jnp.arange(a, dtype=jnp.int32) % t, d.dest, rows)
  picked = dispatch.pick_rows(buf * 2.0, d.dest).reshape(k, t, x.shape[1])
  return jnp.sum(picked.astype(jnp.float32) * w.astype(jnp.float32).T[:, :, None], axis=0)


def _dispatch_combine(x, d, rows, w):
  return dispatch.combine_rows(dispatch.dispatch_rows(x, d, rows) * 2.0, d, w).astype(
      jnp.float32)


def test_gradients_equal_autodiff_of_the_gathers():
  """float32, with a drop (capacity) and an unrouted assignment: the custom
  VJPs give autodiff's gradients, for x and the weights."""
  rng = np.random.default_rng(5)
  e, t, k, h = 3, 6, 2, 8
  ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32).at[0, 1].set(e)   # routed nowhere
  d = dispatch.plan(dispatch.flat_assignments(ids), num_experts=e, block=2,
                    rows_per_segment=6, capacity=2)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  got = jax.vjp(lambda x, w: _dispatch_combine(x, d, 6, w), x, w)[1](g)
  want = jax.vjp(lambda x, w: _autodiff_dispatch_combine(x, d, 6, w), x, w)[1](g)
  assert int(d.dropped) > 0
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_token_gradient_sums_its_copies_in_float32():
  """bfloat16 tokens: each token's gradient is the float32 sum of its k
  rows' gradients, rounded once (a bfloat16 scatter-add rounds k times, in
  whatever order its atomics land on a GPU)."""
  rng = np.random.default_rng(6)
  e, t, k, h = 4, 64, 8, 16
  ids = jnp.asarray(np.stack([rng.permutation(e * 2)[:k] % e for _ in range(t)]), jnp.int32)
  d = dispatch.plan(dispatch.flat_assignments(ids), num_experts=e, block=1,
                    rows_per_segment=t * k)
  x = jnp.zeros((t, h), jnp.bfloat16)
  g_buf = jnp.asarray(rng.standard_normal((t * k, h)) * 100, jnp.bfloat16)
  dx = jax.vjp(lambda x: dispatch.dispatch_rows(x, d, t * k), x)[1](g_buf)[0]
  per_copy = np.asarray(g_buf, np.float32)[np.asarray(d.dest)].reshape(k, t, h)
  want = per_copy.sum(0).astype(jnp.bfloat16)
  assert dx.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want, np.float32))


def test_dispatch_rows_needs_k_rows_per_token():
  d = dispatch.plan(jnp.zeros(6, jnp.int32), num_experts=2, block=1, rows_per_segment=6)
  with pytest.raises(ValueError, match="multiple of 4"):
    dispatch.dispatch_rows(jnp.ones((4, 2)), d, 6)


def test_plan_argument_checks():
  with pytest.raises(ValueError, match="multiple of segments"):
    dispatch.plan(jnp.zeros(4, jnp.int32), num_experts=3, block=1, rows_per_segment=4,
                  segments=2)
  with pytest.raises(ValueError, match="multiple of block"):
    dispatch.plan(jnp.zeros(4, jnp.int32), num_experts=2, block=4, rows_per_segment=8,
                  capacity=6)
  with pytest.raises(ValueError, match="block must be an int"):
    dispatch.rows_bound(4, 2, 0)
