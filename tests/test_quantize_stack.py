"""The stack quantize (``te_jax.ops.quantize_stack``) and its use for expert weights.

CPU: the stack references equal the 2-D references applied entry by entry,
bit for bit (odd M and K, E = 1 and 3, an all-zero entry, an entry holding
Inf and NaN); the dispatchers' argument checks; the scaling modes'
``quantize_stack`` equals the ``lax.map`` of their 2-D ``quantize`` (the
default a mode without a batched path gets, with a warning), also with
``amax_axes`` under a named ``vmap`` axis standing in for a mesh axis;
``grouped_dense.quantize_experts`` and the whole grouped dense (values and
gradients, the delayed-scaling state included) equal the ``lax.map`` code
they replace (copied below as ``_old_quantize_experts``); lowered for CUDA,
the expert weights take one stack custom call and no loop.

GPU (``gpu`` marker): the CUDA stack targets against the CPU reference bit
for bit (NaN compared as NaN) and against the 2-D CUDA op per entry, zero
sizes, and the handlers' argument checks.
"""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from te_jax import grouped_dense as gd
from te_jax import recipe, scaling
from te_jax.ops import quantize as q2d
from te_jax.ops import quantize_cuda
from te_jax.ops import quantize_stack as qs
from te_jax.ops import grouped_gemm_cuda as ggc
from te_jax.ops import grouped_gemm as gg
from te_jax.ops.fp8 import amax as amax_of
from te_jax.ops.grouped_gemm import GroupedScaledTensor
from cuda_lowering import cuda_text, gpu_host  # pylint: disable=unused-import  (a fixture)

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
FIELDS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax")
# (E, M, K): M and K off the 128 grid, one entry, a single row.
STACK_SHAPES = [(3, 200, 72), (1, 130, 300), (3, 1, 7), (3, 17, 260)]
# name -> (stack op, 2-D reference, options): every mode the stack ops have.
MODES = {
    "tensorwise": dict(scale=True),
    "current": {},
    "from_amax": dict(amax=True),
    "vec128": dict(block_shape=(1, 128)),
    "block128": dict(block_shape=(128, 128)),
    "block128_pow2": dict(block_shape=(128, 128), power_2_scale=True),
}
RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}


# ---------------------------------------------------------------- helpers --

def _stack(shape, dtype, seed=0, mixed=True):
  """(E, M, K) with magnitudes varying by entry; with ``mixed`` and E >= 2,
  entry 1 is all zeros and the last entry (E >= 3) holds +Inf, -Inf, NaN and
  large values; E = 1 with ``mixed``: the one entry holds them."""
  e, m, k = shape
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, size=(e, 1, 1))
  # No float16 subnormals: XLA:CPU, where the GPU tests run the reference,
  # may flush them.
  x = np.where(np.abs(x) < 1e-3, np.copysign(1e-3, x), x)
  if mixed:
    if e >= 2:
      x[1] = 0.0
    if e != 2:
      s = x[-1]
      s[0, 0] = np.inf
      s[m // 2, k // 2] = -np.inf
      s[m - 1, k - 1] = 1e6 if dtype != F16 else 6e4
      s[(m - 1) // 3, k // 3] = np.nan
  return jnp.asarray(x, dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits_equal(got, want, what):
  """Bitwise equality; where ``want`` is NaN, ``got`` need only be NaN (the
  kernels and XLA may disagree on a NaN's sign bit)."""
  if want is None:
    assert got is None, what
    return
  g, w = np.asarray(got), np.asarray(want)
  assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
  nan = np.isnan(w.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(g.astype(np.float32)), nan, err_msg=f"{what}: NaNs")
  bad = np.flatnonzero(_bits(g)[~nan] != _bits(w)[~nan])
  assert bad.size == 0, f"{what}: {bad.size} of {g.size} differ"


def _assert_q_equal(got, want, what="", nan_only=()):
  """Every field bit for bit; those in ``nan_only`` only in their NaN positions."""
  assert got.block_shape == want.block_shape, what
  for f in FIELDS:
    g, w = getattr(got, f), getattr(want, f)
    if f in nan_only and w is not None:
      np.testing.assert_array_equal(np.isnan(np.asarray(g)), np.isnan(np.asarray(w)), f)
    else:
      _assert_bits_equal(g, w, f"{what} {f}")


def _scales(e, fp8):
  """Per-entry scales, some pushing values past the FP8 max."""
  base = [3.0, 0.5, 7.0, 1.0] if fp8 == E4M3 else [300.0, 0.5, 7.0, 1.0]
  return jnp.asarray((base * e)[:e], jnp.float32)


def _run_stack(mode, x, fp8, columnwise, impl):
  """The stack op of ``mode`` (a MODES key) on x."""
  o = MODES[mode]
  e = x.shape[0]
  if "scale" in o:
    return qs.quantize_stack_tensorwise(x, _scales(e, fp8), fp8, columnwise=columnwise,
                                        impl=impl)
  if mode == "current":
    return qs.quantize_stack_current(x, fp8, columnwise=columnwise, impl=impl)
  if "amax" in o:
    amax = amax_of(x, axis=(1, 2)) * 1.5   # NaN-propagating on every backend
    return qs.quantize_stack_from_amax(x, amax, fp8, columnwise=columnwise, impl=impl)
  return qs.quantize_stack_blockwise(x, o["block_shape"], fp8, o.get("power_2_scale", False),
                                     columnwise=columnwise, impl=impl)


def _run_2d(mode, x, e, xe, fp8, columnwise, impl="reference"):
  """Entry ``e`` (``xe`` = x[e]) quantized by the 2-D op of ``mode``."""
  o = MODES[mode]
  if "scale" in o:
    return q2d.quantize_tensorwise(xe, _scales(x.shape[0], fp8)[e], fp8,
                                   columnwise=columnwise, impl=impl)
  if mode == "current":
    return q2d.quantize_current(xe, fp8, columnwise=columnwise, impl=impl)
  if "amax" in o:
    amax = amax_of(x, axis=(1, 2)) * 1.5
    return q2d.quantize_from_amax(xe, amax[e], fp8, columnwise=columnwise, impl=impl)
  return q2d.quantize_blockwise(xe, o["block_shape"], fp8, o.get("power_2_scale", False),
                                columnwise=columnwise, impl=impl)


def _entry(qt, e):
  return jax.tree.map(lambda a: a[e], qt)


# ------------------------------------------------- the reference is the spec --

@pytest.mark.parametrize("shape", STACK_SHAPES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("in_dtype", [F32, BF16, F16])
def test_reference_equals_the_2d_reference_per_entry(shape, mode, in_dtype):
  x = _stack(shape, in_dtype, seed=1)
  combos = [(fp8, columnwise) for fp8 in (E4M3, E5M2) for columnwise in (True, False)]
  # One program for the stack op of every combination, and one (apart from
  # it) for the 2-D op of every combination and entry: two compilations
  # instead of one per combination and entry.
  got = jax.jit(lambda x: [_run_stack(mode, x, fp8, cw, "reference") for fp8, cw in combos])(x)
  want = jax.jit(lambda x: [[_run_2d(mode, x, e, x[e], fp8, cw) for e in range(shape[0])]
                            for fp8, cw in combos])(x)
  for (fp8, columnwise), g, w in zip(combos, got, want):
    for e in range(shape[0]):
      _assert_q_equal(_entry(g, e), w[e], f"{mode} {fp8} cw={columnwise} entry {e}")


@pytest.mark.parametrize("mode", ["tensorwise", "current", "block128"])
def test_non_finite_entry_surfaces_in_that_entry_only(mode):
  x = _stack((3, 200, 260), F32, seed=2)   # entry 1 zeros, entry 2 Inf/NaN
  qt = _run_stack(mode, x, E4M3, True, "reference")
  for e in (0, 1):
    assert np.isfinite(np.asarray(qt.scale_inv[e])).all(), e
    assert np.isfinite(np.asarray(qt.data[e], np.float32)).all(), e
  assert np.isnan(np.asarray(qt.scale_inv[2])).any()
  if qt.amax is not None:
    assert np.asarray(qt.amax[1]) == 0 and np.isnan(np.asarray(qt.amax[2]))
  if mode == "current":   # a zero entry gets scale 1
    assert np.asarray(qt.scale_inv[1]) == 1


def test_empty_stack_is_empty():
  x = jnp.zeros((0, 130, 72), BF16)
  qt = qs.quantize_stack_current(x, columnwise=True, impl="reference")
  assert qt.data.shape == (0, 130, 72) and qt.data_t.shape == (0, 72, 130)
  assert qt.amax.shape == (0,) and qt.scale_inv.shape == (0,)
  qb = qs.quantize_stack_blockwise(x, (128, 128), columnwise=True, impl="reference")
  assert qb.scale_inv.shape == (0, 2, 1) and qb.scale_inv_t.shape == (0, 1, 2)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: qs.quantize_stack_current(jnp.ones((4, 8))), ValueError, r"x must be 3-D \(E, M, K\)"),
    (lambda: qs.quantize_stack_current(jnp.ones((2, 4, 8, 8))), ValueError, "x must be 3-D"),
    (lambda: qs.quantize_stack_current(jnp.ones((2, 4, 8), jnp.int32)), TypeError,
     "x must be a float32"),
    (lambda: qs.quantize_stack_current(jnp.ones((2, 0, 8))), ValueError, "non-empty matrices"),
    (lambda: qs.quantize_stack_current(jnp.ones((2, 4, 8)), jnp.int8), TypeError,
     "dtype must be jnp.float8"),
    (lambda: qs.quantize_stack_tensorwise(jnp.ones((2, 4, 8)), jnp.float32(2.0)), ValueError,
     r"scale must have shape \(E,\) = \(2,\).*jnp.full"),
    (lambda: qs.quantize_stack_tensorwise(jnp.ones((2, 4, 8)), jnp.ones(3)), ValueError,
     r"scale must have shape \(E,\)"),
    (lambda: qs.quantize_stack_tensorwise(jnp.ones((2, 4, 8)), jnp.ones(2, jnp.int32)),
     TypeError, "scale must be a float array"),
    (lambda: qs.quantize_stack_from_amax(jnp.ones((2, 4, 8)), jnp.ones((2, 1))), ValueError,
     r"amax must have shape \(E,\)"),
    (lambda: qs.quantize_stack_blockwise(jnp.ones((2, 4, 8)), (0, 128)), ValueError,
     "block_shape must be a pair of positive ints"),
    (lambda: qs.quantize_stack_blockwise(jnp.ones((2, 4, 8)), (1, 128), power_2_scale=1),
     TypeError, "power_2_scale must be a Python bool"),
    (lambda: qs.quantize_stack_current(jnp.ones((2, 4, 8)), columnwise="yes"), TypeError,
     "columnwise must be a Python bool"),
])
def test_bad_arguments_name_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


def test_cuda_path_refuses_stacks_past_the_grid(gpu_host):  # pylint: disable=unused-argument
  with pytest.raises(ValueError, match="at most 65535"):
    cuda_text(lambda x: qs.quantize_stack_current(x), jnp.ones((65536, 1, 8), BF16))


def test_cuda_path_refuses_tiles_without_a_kernel(gpu_host):  # pylint: disable=unused-argument
  with pytest.raises(ValueError, match=r"block_shape must be \(1, 128\) or \(128, 128\)"):
    cuda_text(lambda x: qs.quantize_stack_blockwise(x, (32, 64)), jnp.ones((2, 64, 128)))


@pytest.mark.parametrize("mode, target", [
    ("tensorwise", "te_jax_quantize_stack_tensorwise"),
    ("current", "te_jax_quantize_stack_current"),
    ("from_amax", "te_jax_quantize_stack_from_amax"),
    ("vec128", "te_jax_quantize_stack_blockwise"),
    ("block128", "te_jax_quantize_stack_blockwise"),
])
def test_cuda_path_is_one_custom_call(gpu_host, mode, target):  # pylint: disable=unused-argument
  x = _stack((3, 200, 72), BF16, mixed=False)
  text = cuda_text(lambda x: _run_stack(mode, x, E4M3, True, "auto"), x)
  assert re.findall(r"custom_call @(\w+)\(", text) == [target]
  assert "tensor<3x72x200xf8E4M3FN>" in text and "stablehlo.while" not in text


# ------------------------------------------------------------ scaling modes --

def _delayed_state(e, seed=0):
  """A delayed-scaling GEMM state whose kernel entries have their own
  scales (one pushing values past the FP8 max) and histories."""
  st = gd.init_grouped_state(RECIPES["delayed"], e)
  rng = np.random.default_rng(seed)
  scale = np.array([40.0, 0.5, 3e3, 7.0, 1.0][:e] + [2.0] * max(0, e - 5), np.float32)
  hist = rng.uniform(0, 5, size=(e, 4)).astype(np.float32)
  return dict(st, kernel={"amax_history": jnp.asarray(hist), "scale": jnp.asarray(scale)})


def _state_for(name, e):
  return _delayed_state(e) if name == "delayed" else None


def _by_entry(mode, *args, **kwargs):
  """The default ``ScalingMode.quantize_stack`` (``lax.map`` of ``quantize``),
  its once-only warning silenced."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    return scaling.ScalingMode.quantize_stack(mode, *args, **kwargs)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("role", ["kernel", "x"])
@pytest.mark.parametrize("shape", [(3, 200, 136), (1, 130, 300)])
def test_mode_quantize_stack_equals_the_entry_by_entry_map(name, role, shape):
  mode = RECIPES[name].scaling_mode()
  x = _stack(shape, F32, seed=3, mixed=shape[0] > 1)
  st = _state_for(name, shape[0])
  if st is not None and role == "x":   # per-entry state for the role asked for
    st = dict(st, x=st["kernel"])
  for columnwise in (True, False):
    f = lambda x, st, cw=columnwise: mode.quantize_stack(x, role, st, impl="reference",
                                                          columnwise=cw)
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # the built-in modes have a batched path: no warning
      got = jax.jit(f)(x, st)
    want = jax.jit(lambda x, st, cw=columnwise: _by_entry(
        mode, x, role, st, impl="reference", columnwise=cw))(x, st)
    _assert_q_equal(got, want, f"{name} {role} cw={columnwise}")


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_amax_axes_reduce_each_entry_over_the_mesh_axis(name):
  """``amax_axes`` under a named ``vmap`` axis (as a mesh axis over which the
  kernel's K dim is split, FSDP): each entry's amax is the max over both
  shards, as the lax.map path gives it; for current scaling each shard is
  quantized with the whole entry's scale (the unsharded data, sliced)."""
  mode = RECIPES[name].scaling_mode()
  x = _stack((3, 256, 96), F32, seed=4, mixed=False)
  x = x.at[1, :128].multiply(50.0)    # entry 1's amax lives in shard 0 only
  shards = jnp.stack([x[:, :128], x[:, 128:]])   # (2, E, K/2, N)
  st = _state_for(name, 3)

  def sharded(fn):
    return jax.jit(jax.vmap(lambda s: fn(s), axis_name="fsdp"))(shards)

  got = sharded(lambda s: mode.quantize_stack(s, "kernel", st, impl="reference",
                                              amax_axes=("fsdp",)))
  want = sharded(lambda s: _by_entry(mode, s, "kernel", st, impl="reference",
                                     amax_axes=("fsdp",)))
  _assert_q_equal(got, want, name)
  whole = jnp.max(jnp.abs(x), axis=(1, 2))
  for d in range(2):
    np.testing.assert_array_equal(np.asarray(got.amax[d]), np.asarray(whole))
  if name == "current":
    full = qs.quantize_stack_current(x, mode.dtype("kernel"), impl="reference")
    np.testing.assert_array_equal(_bits(got.data[0]), _bits(full.data[:, :128]))
    np.testing.assert_array_equal(_bits(got.data[1]), _bits(full.data[:, 128:]))


@dataclasses.dataclass(frozen=True)
class _EntryOnlyMode(scaling.ScalingMode):
  """A made-up recipe mode with a 2-D quantize only (no batched path)."""

  def quantize(self, x, role, state=None, *, impl="auto", columnwise=True, amax_axes=()):
    return q2d.quantize_current(x, self.dtype(role), columnwise=columnwise, impl=impl)

  def quantize_fused(self, op, role, state=None, *, impl="auto", **operands):
    raise NotImplementedError


def test_mode_without_batched_path_maps_entries_and_warns_once():
  mode = _EntryOnlyMode(RECIPES["current"])
  x = _stack((3, 130, 72), BF16, seed=5)
  scaling._warn_stack_by_entry.cache_clear()   # pylint: disable=protected-access
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got = mode.quantize_stack(x, "kernel", impl="reference")
    mode.quantize_stack(x, "kernel", impl="reference")
  msgs = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
  assert len(msgs) == 1 and "_EntryOnlyMode has no batched quantize_stack" in msgs[0], msgs
  _assert_q_equal(got, qs.quantize_stack_current(x, E4M3, columnwise=True, impl="reference"))


# ------------------------------------------------ grouped dense, old vs new --

def _old_quantize_experts(mode, kernel, state, impl, amax_axes, transposed: bool = False):
  """``grouped_dense.quantize_experts`` before the stack ops, verbatim: the
  protocol's 2-D quantize once per expert in a ``lax.map``."""
  kstate = None if state is None else state["kernel"]
  block = []

  def one(args):
    w, st = args
    q = mode.quantize(w, "kernel", None if st is None else {"kernel": st}, impl=impl,
                      columnwise=transposed, amax_axes=amax_axes)
    block.append(q.block_shape)
    return q.data, q.scale_inv, q.amax, (q.data_t, q.scale_inv_t) if transposed else None

  data, scale_inv, amax, cols = lax.map(one, (kernel, kstate))
  rows = GroupedScaledTensor(data, scale_inv, block[0])
  return rows, None if cols is None else GroupedScaledTensor(*cols, block[0]), amax


def _assert_tree_bits_equal(got, want, what):
  gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for i, (g, w) in enumerate(zip(gl, wl)):
    _assert_bits_equal(g, w, f"{what} leaf {i}")


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("e", [1, 3])
def test_quantize_experts_equals_the_lax_map_code(name, e):
  mode = RECIPES[name].scaling_mode()
  w = _stack((e, 256, 136), F32, seed=6)
  st = _state_for(name, e)
  for transposed in (True, False):
    f = lambda fn, t=transposed: jax.jit(lambda w, st: fn(mode, w, st, "reference", (), t))
    got, want = f(gd.quantize_experts)(w, st), f(_old_quantize_experts)(w, st)
    _assert_tree_bits_equal(got, want, f"{name} transposed={transposed}")
    if transposed:
      assert got[1].data.shape == (e, 136, 256)


SIZES = [128, 0, 256, 128]


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_dense_values_and_gradients_equal_the_lax_map_code(name, monkeypatch):
  r = RECIPES[name]
  rng = np.random.default_rng(7)
  m, k, n = 640, 200, 136     # K, N padded inside; rows past the groups
  x = jnp.asarray(rng.standard_normal((m, k)), BF16)
  w = jnp.asarray(rng.standard_normal((4, k, n)) * np.array([1.0, 1.0, 30.0, 0.02])[:, None, None]
                  / 16, F32)
  g = jnp.asarray(rng.standard_normal((m, n)), BF16)
  gs = jnp.asarray(SIZES, jnp.int32)
  st = _state_for(name, 4)

  def step():   # a fresh function: traced anew with whichever quantize_experts is set
    def f(x, w, st, g):
      y, vjp = jax.vjp(lambda x, w, st: gd.grouped_dense(x, w, gs, recipe=r, fp8_state=st,
                                                        impl="reference"), x, w, st)
      return y, vjp(g)
    return jax.jit(f)(x, w, st, g)

  new = step()
  monkeypatch.setattr(gd, "quantize_experts", _old_quantize_experts)
  old = step()
  _assert_tree_bits_equal(new, old, name)
  if name == "delayed":   # the per-expert histories advanced (the state's "gradient")
    assert np.asarray(new[1][2]["kernel"]["amax_history"][:, 0]).all()


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(item, "jaxpr") and hasattr(item, "consts"):   # a ClosedJaxpr
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


def _quantize_calls(jaxpr, in_loop=False):
  """[(target, inside a while/scan)] of the te_jax_quantize* ffi_calls in
  ``jaxpr`` and every jaxpr nested in it."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call" and eqn.params["target_name"].startswith(
        "te_jax_quantize"):
      out.append((eqn.params["target_name"], in_loop))
    loop = in_loop or eqn.primitive.name in ("while", "scan")
    for sub in _sub_jaxprs(eqn):
      out += _quantize_calls(sub, loop)
  return out


def test_fp8_moe_weights_take_one_stack_call_outside_any_loop(gpu_host, monkeypatch):  # pylint: disable=unused-argument
  """With the CUDA branch staged (a build with the sm90 GEMMs), the grouped
  dense step quantizes the expert weights with one stack custom call, and no
  quantize runs in a loop; the lax.map code called a 2-D quantize in a scan."""
  monkeypatch.setattr(ggc, "_build_note",
                      lambda: "sm90 GEMMs: built with the CUTLASS 4.2.0 headers in /x/include")
  gg._log_reference.cache_clear()   # pylint: disable=protected-access
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((512, 256)), BF16)
  w = jnp.asarray(rng.standard_normal((4, 256, 128)) * 0.05, F32)
  gs = jnp.asarray(SIZES, jnp.int32)
  for name, r in RECIPES.items():
    st = _state_for(name, 4)
    step = lambda x, w, r=r, st=st: jax.grad(
        lambda x, w: jnp.sum(gd.grouped_dense(x, w, gs, recipe=r, fp8_state=st)
                             .astype(F32)), argnums=(0, 1))(x, w)
    calls = _quantize_calls(jax.make_jaxpr(step)(x, w).jaxpr)
    assert len([t for t, _ in calls if t.startswith("te_jax_quantize_stack_")]) == 1, (name, calls)
    assert not [t for t, loop in calls if loop], (name, calls)
    text = cuda_text(step, x, w)
    assert len(re.findall(r"custom_call @te_jax_quantize_stack_\w+\(", text)) == 1, name


# ------------------------------------------------------------------- GPU --

_CPU = jax.devices("cpu")[0]
GPU_SHAPES = [(1, 200, 72), (3, 200, 72), (3, 130, 300), (3, 1, 7), (3, 17, 1000),
              (2, 256, 384), (3, 257, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("in_dtype", [F32, BF16, F16])
def test_gpu_stack_equals_reference_and_2d_kernel(shape, mode, in_dtype):
  """CUDA stack vs the reference evaluated on the CPU backend (IEEE
  division, as the kernels; tests/test_cuda_ops.py's doc says why not the
  GPU-compiled reference), and vs the 2-D CUDA op per entry. With a given
  scale, scale_inv = 1/scale is XLA's division on either side (not a
  kernel's; on the GPU not correctly rounded): against the CPU only its NaNs
  are compared."""
  x = _stack(shape, in_dtype, seed=9)
  nan_only = ("scale_inv", "scale_inv_t") if mode == "tensorwise" else ()
  for fp8 in (E4M3, E5M2):
    for columnwise in (True, False):
      f = lambda impl, cw=columnwise: jax.jit(lambda x: _run_stack(mode, x, fp8, cw, impl))
      got = f("cuda")(x)
      want = f("reference")(jax.device_put(x, _CPU))
      _assert_q_equal(got, want, f"{mode} {fp8} cw={columnwise}", nan_only)
      for e in range(shape[0]):
        one = jax.jit(lambda x, xe, e=e, cw=columnwise: _run_2d(mode, x, e, xe, fp8, cw,
                                                                impl="cuda"))(x, x[e])
        _assert_q_equal(_entry(got, e), one, f"{mode} {fp8} cw={columnwise} entry {e} (2-D)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RECIPES))
def test_gpu_quantize_experts_equals_the_lax_map_code(name):
  mode = RECIPES[name].scaling_mode()
  w = _stack((3, 256, 136), F32, seed=10)
  st = _state_for(name, 3)
  f = lambda fn: jax.jit(lambda w, st: fn(mode, w, st, "cuda", (), True))
  _assert_tree_bits_equal(f(gd.quantize_experts)(w, st), f(_old_quantize_experts)(w, st),
                          name)


@pytest.mark.gpu
def test_gpu_zero_sizes_are_no_ops():
  qt = qs.quantize_stack_current(jnp.zeros((0, 130, 72), BF16), columnwise=True, impl="cuda")
  assert qt.data.shape == (0, 130, 72)
  qb = qs.quantize_stack_blockwise(jnp.zeros((0, 130, 72), F32), (128, 128), columnwise=True,
                                   impl="cuda")
  assert qb.scale_inv.shape == (0, 2, 1)
  # M or K of 0 (refused by the dispatchers, taken by the handlers): nothing
  # launched, the amaxes zeroed.
  for x in (jnp.zeros((2, 0, 5), F32), jnp.zeros((2, 5, 0), BF16)):
    c = jax.jit(lambda x: quantize_cuda.quantize_stack_current(x, E4M3, True))(x)
    np.testing.assert_array_equal(np.asarray(c.amax), np.zeros(2, np.float32))
    t = jax.jit(lambda x: quantize_cuda.quantize_stack_tensorwise(
        x, jnp.ones(2, F32), E4M3, True))(x)
    np.testing.assert_array_equal(np.asarray(t.amax), np.zeros(2, np.float32))
    jax.block_until_ready(jax.jit(lambda x: quantize_cuda.quantize_stack_blockwise(
        x, (128, 128), E4M3, False, True))(x))


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("target, outs, args, attrs, match", [
    ("te_jax_quantize_stack_tensorwise",
     (_sds((2, 4, 8), E4M3), _sds((0, 0, 0), E4M3), _sds((2,), F32)),
     (jnp.ones((2, 4, 8)), jnp.ones(3)), dict(columnwise=np.int64(0)), r"scale must be \(E,\)"),
    ("te_jax_quantize_stack_tensorwise",
     (_sds((2, 4, 8), E4M3), _sds((2, 4, 8), E4M3), _sds((2,), F32)),
     (jnp.ones((2, 4, 8)), jnp.ones(2)), dict(columnwise=np.int64(1)),
     r"data_t must be \(E, K, M\)"),
    ("te_jax_quantize_stack_current",
     (_sds((2, 4, 8), E4M3), _sds((0, 0, 0), E4M3), _sds((2,), F32), _sds((2,), F32)),
     (jnp.ones((8, 4)),), dict(columnwise=np.int64(0)), r"x must be 3-D"),
    ("te_jax_quantize_stack_blockwise",
     (_sds((2, 4, 8), E4M3), _sds((2, 1, 8), F32), _sds((0, 0, 0), E4M3),
      _sds((0, 0, 0), F32)),
     (jnp.ones((2, 4, 8)),), dict(block_rows=np.int64(128), power_2_scale=np.int64(0),
                                  columnwise=np.int64(0)), r"sinv must be \(E, ceil\(M/128\)"),
    ("te_jax_quantize_stack_blockwise",
     (_sds((2, 4, 8), E4M3), _sds((2, 1, 4), F32), _sds((0, 0, 0), E4M3),
      _sds((0, 0, 0), F32)),
     (jnp.ones((2, 4, 8)),), dict(block_rows=np.int64(64), power_2_scale=np.int64(0),
                                  columnwise=np.int64(0)), "block_rows must be 1 or 128"),
])
def test_gpu_handlers_check_their_arguments(target, outs, args, attrs, match):
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args))
