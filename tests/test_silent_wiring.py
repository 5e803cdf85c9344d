"""Issue 44 item 4 at the module level: every read of a GEMM's FP8 state merges.

The Linen and NNX modules read each GEMM's delayed-scaling state through
``te_jax.fp8_state.merge_uses`` (``LinenStates.state``, ``NnxStates.state``),
so a module called several times in one step -- a shared layer, tied
weights, a block applied twice, a layer used twice inside a scanned block,
``nn.Dense(dot_general_cls=Fp8DotGeneral)`` called twice -- gets ONE update:
its amax history gains one entry, the largest of the uses' amaxes, and its
scale is the one that history gives. Before, autodiff summed the uses' new
states (newest entry the sum of the amaxes, histories growing geometrically).

Expected states come from the recipe itself: ``mode.update_state(old,
{role: largest amax})`` with the amaxes read from the constant inputs, or
from the same block run once per use (``_expected_from_uses``).
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import flax as tfx
from te_jax import nnx as tnx
from te_jax import recipe
from te_jax.fp8_state import FP8_COLLECTION
from te_jax.nnx import shared_fp8_state

HIST = 4
R = recipe.DelayedScaling(amax_history_len=HIST)
MODE = R.scaling_mode()
ROLES = ("x", "kernel", "grad")
# A TransformerLayer whose GEMMs take the fused paths on the reference
# implementation (embed and mlp multiples of 128, tokens of 16).
E, F, H = 128, 256, 2


def _gemm_states(tree, prefix=()):
  """{path: one GEMM's state} of an FP8 collection (dicts or FrozenDicts)."""
  if set(tree) == set(ROLES):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_gemm_states(v, prefix + (k,)))
  return out


def _with_history(fp8_tree):
  """``fp8_tree`` with every GEMM state two steps old (a wrong roll shows)."""
  def aged(_):
    def amaxes(a):
      return {"x": jnp.float32(a), "kernel": jnp.float32(0.25), "grad": jnp.float32(0.5)}
    return MODE.update_state(MODE.update_state(MODE.init_state(), amaxes(1.5)), amaxes(0.75))
  states = _gemm_states(fp8_tree)
  out = {}
  for path in states:
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = aged(states[path])
  return out


def _assert_state(got, want, where="", rtol=0.0):
  for role in ROLES:
    for leaf in ("amax_history", "scale"):
      np.testing.assert_allclose(np.asarray(got[role][leaf]), np.asarray(want[role][leaf]),
                                 rtol=rtol, atol=0, err_msg=f"{where} {role}/{leaf}")


def _expected(old, amaxes):
  return MODE.update_state(old, {r: jnp.float32(a) for r, a in amaxes.items()})


def _expected_from_uses(old_tree, use_trees):
  """{path: merged state} from the states each use alone gives: one update
  with, per role, the largest of the uses' newest amax entries."""
  old, uses = _gemm_states(old_tree), [_gemm_states(t) for t in use_trees]
  return {p: _expected(old[p], {r: max(float(u[p][r]["amax_history"][0]) for u in uses)
                                for r in ROLES}) for p in old}


def _assert_merged(got_tree, old_tree, use_trees, rtol=0.0):
  got = _gemm_states(got_tree)
  want = _expected_from_uses(old_tree, use_trees)
  assert set(got) == set(want)
  for p in want:
    _assert_state(got[p], want[p], "/".join(p), rtol)
  # The uses' amaxes differ (else a sum and a max could agree somewhere).
  newest = [float(_gemm_states(u)[p]["x"]["amax_history"][0]) for u in use_trees
            for p in want]
  assert len(set(newest)) > 1


# ------------------------------------------------------------ Linen -----

class Twice(nn.Module):
  """One TransformerLayer applied to two inputs (``which``: both, or one use)."""

  which: str = "both"

  @nn.compact
  def __call__(self, a, b):
    blk = tfx.TransformerLayer(E, F, H, layer_type="decoder", name="blk")
    loss = 0.0
    if self.which in ("both", "a"):
      loss = loss + jnp.sum(blk(a))
    if self.which in ("both", "b"):
      loss = loss + 2.0 * jnp.sum(blk(b))
    return loss


def _inputs():
  a = jax.random.normal(jax.random.PRNGKey(1), (2, 16, E))
  return a, 3.0 * jax.random.normal(jax.random.PRNGKey(2), (2, 16, E))


def _fp8_grads(model, variables, *args):
  with te_jax.fp8_autocast(True, R):
    return jax.jit(jax.grad(lambda v: model.apply(v, *args)))(variables)[FP8_COLLECTION]


def test_linen_block_applied_twice_gets_one_update_per_gemm():
  a, b = _inputs()
  with te_jax.fp8_autocast(True, R):
    variables = Twice().init(jax.random.PRNGKey(0), a, b)
  old = _with_history(variables[FP8_COLLECTION])
  variables = {**variables, FP8_COLLECTION: old}
  got = _fp8_grads(Twice(), variables, a, b)
  uses = [_fp8_grads(Twice(which=w), variables, a, b) for w in ("a", "b")]
  assert len(_gemm_states(old)) == 4            # qkv, out, wi, wo
  _assert_merged(got, old, uses)


def test_linen_dot_general_op_called_twice_merges():
  layer = nn.Dense(16, use_bias=False, dot_general_cls=tfx.Fp8DotGeneral)
  a, b = jnp.full((8, 32), 2.0), jnp.full((8, 32), -3.0)
  with te_jax.fp8_autocast(True, R):
    variables = layer.init(jax.random.PRNGKey(0), a)
  old = _with_history(variables[FP8_COLLECTION])
  variables = {**variables, FP8_COLLECTION: old}

  def loss(v):
    return jnp.sum(layer.apply(v, a)) + 2.0 * jnp.sum(layer.apply(v, b))
  with te_jax.fp8_autocast(True, R):
    got = jax.jit(jax.grad(loss))(variables)[FP8_COLLECTION]
  kernel_amax = float(jnp.max(jnp.abs(variables["params"]["kernel"])))
  (path, state), = _gemm_states(got).items()
  _assert_state(state, _expected(_gemm_states(old)[path],
                                 {"x": 3.0, "kernel": kernel_amax, "grad": 2.0}))


class ScannedPair(nn.Module):
  """A scanned block whose one DenseGeneral reads two inputs per layer."""

  @nn.compact
  def __call__(self, carry, xs):
    d = tfx.DenseGeneral(32, use_bias=False, name="d")
    return carry + jnp.sum(d(xs[0])) + 2.0 * jnp.sum(d(xs[1])), None


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_of_remat"])
def test_linen_shared_layer_in_a_scanned_block_merges_per_layer(remat):
  layers = 3
  body = nn.remat(ScannedPair) if remat else ScannedPair
  scan = nn.scan(body, variable_axes={FP8_COLLECTION: 0, "params": 0},
                 split_rngs={"params": True}, length=layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})
  # Layer l reads inputs of amax l + 1 and 2 (l + 1): its x entry 2 (l + 1).
  xs = jnp.stack([jnp.stack([jnp.full((16, 32), l + 1.0), jnp.full((16, 32), -2.0 * (l + 1))])
                  for l in range(layers)])
  with te_jax.fp8_autocast(True, R):
    variables = scan().init(jax.random.PRNGKey(0), jnp.float32(0), xs)
  stacked = variables[FP8_COLLECTION]["d"]["fp8_meta"]
  assert stacked["x"]["amax_history"].shape == (layers, HIST)

  def loss(v):
    return scan().apply(v, jnp.float32(0), xs)[0]
  with te_jax.fp8_autocast(True, R):
    got = jax.jit(jax.grad(loss))(variables)[FP8_COLLECTION]["d"]["fp8_meta"]
  for l in range(layers):
    kernel = nn.unbox(variables["params"]["d"]["kernel"])[l]
    want = _expected(jax.tree.map(lambda s, l=l: s[l], stacked),
                     {"x": 2.0 * (l + 1), "kernel": float(jnp.max(jnp.abs(kernel))),
                      "grad": 2.0})
    _assert_state(jax.tree.map(lambda s, l=l: s[l], got), want, f"layer {l}")


def test_linen_use_and_kept_use_in_one_step_give_the_use_update():
  """One call under DelayedScaling and one with FP8 off in the same step: the
  state comes back as the first call's update (tied separately, the kept
  call's "gradient" -- the state itself -- was added to it)."""
  layer = tfx.DenseGeneral(16, use_bias=False)
  a = jnp.full((8, 32), 3.0)
  with te_jax.fp8_autocast(True, R):
    variables = nn.unbox(layer.init(jax.random.PRNGKey(0), a))
  old = _with_history(variables[FP8_COLLECTION])
  variables = {**variables, FP8_COLLECTION: old}

  def loss(v):
    with te_jax.fp8_autocast(True, R):
      y = jnp.sum(layer.apply(v, a))
    with te_jax.fp8_autocast(enabled=False):
      return y + jnp.sum(layer.apply(v, a))
  got = jax.jit(jax.grad(loss))(variables)[FP8_COLLECTION]["fp8_meta"]
  kernel_amax = float(jnp.max(jnp.abs(variables["params"]["kernel"])))
  _assert_state(got, _expected(old["fp8_meta"], {"x": 3.0, "kernel": kernel_amax,
                                                 "grad": 1.0}))


# ------------------------------------------------------------- NNX ------

class NnxTwice(nnx.Module):
  def __init__(self, which="both"):
    self.blk = tnx.TransformerLayer(E, F, H, layer_type="decoder", rngs=nnx.Rngs(0))
    self.which = which

  def __call__(self, a, b):
    loss = 0.0
    if self.which in ("both", "a"):
      loss = loss + jnp.sum(self.blk(a))
    if self.which in ("both", "b"):
      loss = loss + 2.0 * jnp.sum(self.blk(b))
    return loss


def _nnx_fp8(tree):
  return tnx.linen_variables(tree)[FP8_COLLECTION]


def test_nnx_block_applied_twice_gets_one_update_per_gemm():
  a, b = _inputs()
  with te_jax.fp8_autocast(True, R):
    model = NnxTwice()
  old = _with_history(_nnx_fp8(model))
  tnx.load_linen_variables(model, {**tnx.linen_variables(model), FP8_COLLECTION: old})
  optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, a, b):
    grads = nnx.grad(lambda m: m(a, b), argnums=tnx.diff_state(0))(model)
    optimizer.update(model, grads)
    tnx.apply_fp8_updates(model, grads)
    return grads

  uses = []
  for which in ("a", "b"):
    with te_jax.fp8_autocast(True, R):
      single = NnxTwice(which)
      tnx.load_linen_variables(single, tnx.linen_variables(model))
      uses.append(_nnx_fp8(nnx.jit(lambda m: nnx.grad(
          lambda m: m(a, b), argnums=tnx.diff_state(0))(m))(single)))
  with te_jax.fp8_autocast(True, R):
    step(model, optimizer, a, b)
  # The one-use references are other compiled programs: the amax of a
  # computed activation (the normalized input) may differ in its last bit.
  _assert_merged(_nnx_fp8(model), old, uses, rtol=1e-6)


def test_nnx_shared_linear_merges_under_nnx_jit():
  with te_jax.fp8_autocast(True, R):
    layer = tnx.Linear(32, 16, rngs=nnx.Rngs(0))
  a, b = jnp.full((8, 32), 2.0), jnp.full((8, 32), 3.0)

  @nnx.jit
  def grads(m):
    return nnx.grad(lambda m: jnp.sum(m(a)) + 2.0 * jnp.sum(m(b)),
                    argnums=tnx.diff_state(0))(m)
  old = layer.fp8_meta.get_value()
  with te_jax.fp8_autocast(True, R):
    got = grads(layer)["fp8_meta"].get_value()
  kernel_amax = float(jnp.max(jnp.abs(layer.kernel[...])))
  _assert_state(got, _expected(old, {"x": 3.0, "kernel": kernel_amax, "grad": 2.0}))
  np.testing.assert_array_equal(got["x"]["amax_history"], [3.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_of_remat"])
def test_nnx_scan_over_vmapped_layers_merges_per_layer(remat):
  """Layers stacked by nnx.vmap, applied by nnx.scan, each used twice per body
  (directly, or through an nnx.remat shared inside the body, the fix that
  te_jax.nnx.state's remat error names)."""
  layers_n = 3
  with te_jax.fp8_autocast(True, R):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return tnx.Linear(32, 32, rngs=nnx.Rngs(key))
    layers = make(jax.random.split(jax.random.PRNGKey(0), layers_n))
  xs = jnp.stack([jnp.stack([jnp.full((8, 32), l + 1.0), jnp.full((8, 32), -2.0 * (l + 1))])
                  for l in range(layers_n)])

  call = nnx.remat(lambda m, x: m(x)) if remat else (lambda m, x: m(x))

  def loss(layers):
    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
    def body(c, layer, x):
      with shared_fp8_state(layer) if remat else contextlib.nullcontext():
        return c + jnp.sum(call(layer, x[0])) + 2.0 * jnp.sum(call(layer, x[1]))
    return body(jnp.float32(0), layers, xs)

  old = layers.fp8_meta.get_value()
  with te_jax.fp8_autocast(True, R):
    got = nnx.jit(lambda m: nnx.grad(loss, argnums=tnx.diff_state(0))(m))(layers)
  got = got["fp8_meta"].get_value()
  for l in range(layers_n):
    want = _expected(jax.tree.map(lambda s, l=l: s[l], old),
                     {"x": 2.0 * (l + 1), "kernel": float(jnp.max(jnp.abs(layers.kernel[...][l]))),
                      "grad": 2.0})
    _assert_state(jax.tree.map(lambda s, l=l: s[l], got), want, f"layer {l}")
