"""te_jax.checkpoint.restore into the targets users pass: fresh TrainStates, sharded states.

Every test runs with both backends (orbax, when installed, and the ``.npz``
fallback). The sharded tests need 8 devices, which XLA fakes on CPU only when
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before jax is
imported; as in ``tests/test_sharding.py``, :func:`test_eight_device_subprocess`
runs them in a subprocess with that flag unless this process already has 8
devices, in which case pytest runs them here directly.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import te_jax
from te_jax import checkpoint, fp8_state, recipe
from te_jax import flax as tfx

from subprocess_flags import subprocess_xla_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
NDEV = len(jax.devices())

BACKENDS = [
    pytest.param("orbax", marks=pytest.mark.skipif(
        not checkpoint.orbax_available(), reason="needs orbax-checkpoint")),
    "numpy",
]
needs8 = pytest.mark.skipif(
    NDEV < 8, reason="needs 8 devices: test_eight_device_subprocess runs these "
                     "with XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for path, g, w in zip([p for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]],
                        jax.tree.leaves(got), jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    assert np.asarray(g).dtype == np.asarray(w).dtype, name
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


# ------------------------------------------------- fresh TrainState target --

def _fp8_model_and_data():
  model = tfx.DenseGeneral(features=16)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 32), jnp.float32)
  return model, x


def _fresh_state(model, x, r):
  with te_jax.fp8_autocast(True, r):
    variables = model.init(jax.random.PRNGKey(0), x)
  return train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                       tx=optax.adam(1e-2))


def _make_step(model, x, r):
  def loss(v):
    return jnp.mean(model.apply(v, x) ** 2)

  @jax.jit
  def step(state):
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  def run(state):
    with te_jax.fp8_autocast(True, r):
      return step(state)
  return run


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_into_fresh_train_state(tmp_path, backend):
  """The docstring's recipe: target=TrainState.create(...), whose step is a Python int."""
  r = recipe.DelayedScaling(amax_history_len=4)
  model, x = _fp8_model_and_data()
  step = _make_step(model, x, r)
  trained = step(step(_fresh_state(model, x, r)))
  assert isinstance(_fresh_state(model, x, r).step, int)   # the case of the bug
  checkpoint.save(str(tmp_path), 2, trained, backend=backend)

  out = checkpoint.restore(str(tmp_path), 2, target=_fresh_state(model, x, r),
                           backend=backend)
  # The Python-int step comes back as what a jitted step makes of it: the
  # saved value as a weakly typed int32 array (so the restored state hits the
  # same jit cache entry as a state that never left the process).
  assert isinstance(out.step, jax.Array)
  assert int(out.step) == 2
  assert out.step.dtype == trained.step.dtype == jnp.int32
  assert out.step.weak_type == trained.step.weak_type
  hist = out.params[fp8_state.FP8_COLLECTION]
  assert any(np.any(np.asarray(h) > 0) for h in jax.tree.leaves(hist))  # the FP8 state moved
  _assert_trees_equal(out.params, trained.params)
  _assert_trees_equal(out.opt_state, trained.opt_state)
  # Training on from the restored state is the same as training on.
  _assert_trees_equal(step(out).params, step(trained).params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_scalar_leaves_restore_as_jax_would_hold_them(tmp_path, backend):
  saved = {"step": jnp.asarray(7, jnp.int32), "lr": jnp.asarray(0.25, jnp.float32),
           "flag": jnp.asarray(True), "n": 5, "w": jnp.arange(3.0)}
  checkpoint.save(str(tmp_path), 1, saved, backend=backend)
  target = {"step": 0, "lr": 1.0, "flag": False, "n": 0, "w": jnp.zeros(3)}
  out = checkpoint.restore(str(tmp_path), 1, target=target, backend=backend)
  want = {k: jax.jit(lambda v: v)(v) for k, v in
          {"step": 7, "lr": 0.25, "flag": True, "n": 5}.items()}
  for k, w in want.items():
    assert isinstance(out[k], jax.Array), k
    assert (out[k].dtype, out[k].weak_type) == (w.dtype, w.weak_type), k
    assert out[k].item() == w.item(), k
  np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(3.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_state_saved_restores_into_stepped_state(tmp_path, backend):
  """A Python-int step is saved as the int32 JAX would make of it, not numpy's int64."""
  checkpoint.save(str(tmp_path), 0, {"step": 0, "w": jnp.ones(2)}, backend=backend)
  target = {"step": jnp.asarray(5, jnp.int32), "w": jnp.zeros(2)}
  out = checkpoint.restore(str(tmp_path), 0, target=target, backend=backend)
  assert out["step"].dtype == jnp.int32 and int(out["step"]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_scalar_target_for_an_array_is_rejected_by_name(tmp_path, backend):
  checkpoint.save(str(tmp_path), 1, {"a": jnp.arange(3), "step": 1}, backend=backend)
  with pytest.raises(ValueError, match=r"\['a'\].*shape \(3,\)"):
    checkpoint.restore(str(tmp_path), 1, target={"a": 0, "step": 0}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_int_target_rejects_a_float_checkpoint(tmp_path, backend):
  checkpoint.save(str(tmp_path), 1, {"a": jnp.asarray(2.5)}, backend=backend)
  with pytest.raises(TypeError, match=r"\['a'\].*float32.*int"):
    checkpoint.restore(str(tmp_path), 1, target={"a": 0}, backend=backend)


# ------------------------------------------------------------- sharded ------

def _sharded_state(mesh, w_spec, b_spec):
  params = {"params": {"w": jax.device_put(jnp.arange(128.0).reshape(16, 8) / 7,
                                          NamedSharding(mesh, w_spec)),
                       "b": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, b_spec))},
            fp8_state.FP8_COLLECTION: {"d": fp8_state.init_dense_state(4)}}
  return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def _trained_sharded_state(mesh):
  state = _sharded_state(mesh, P("fsdp", "tp"), P("tp"))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), state.params)
  return jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)


def _assert_shardings(out, target):
  for (path, o), t in zip(jax.tree_util.tree_flatten_with_path(out)[0],
                          jax.tree.leaves(target)):
    want = getattr(t, "sharding", None)
    if want is None:   # no sharding in the target: the default device
      want = jnp.zeros(()).sharding
    assert o.sharding.is_equivalent_to(want, np.ndim(o)), (
        jax.tree_util.keystr(path), o.sharding, want)


@needs8
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_restore_into_differently_sharded_fresh_state(tmp_path, backend):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
  trained = _trained_sharded_state(mesh)
  assert trained.params["params"]["w"].sharding.spec == P("fsdp", "tp")
  checkpoint.save(str(tmp_path), 1, trained, backend=backend)
  # Another layout than the saved one, and a Python-int step.
  target = _sharded_state(mesh, P("tp", "fsdp"), P())
  assert isinstance(target.step, int)
  out = checkpoint.restore(str(tmp_path), 1, target=target, backend=backend)
  assert out.params["params"]["w"].sharding == NamedSharding(mesh, P("tp", "fsdp"))
  assert out.params["params"]["b"].sharding == NamedSharding(mesh, P())
  _assert_shardings(out, target)
  assert int(out.step) == 1 and out.step.dtype == jnp.int32
  _assert_trees_equal(out.params, trained.params)
  _assert_trees_equal(out.opt_state, trained.opt_state)


@needs8
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_restore_into_abstract_target(tmp_path, backend):
  """ShapeDtypeStruct targets: their shardings where given, else the default device."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
  trained = _trained_sharded_state(mesh)
  checkpoint.save(str(tmp_path), 1, trained, backend=backend)
  other = NamedSharding(mesh, P(None, "fsdp"))

  def with_sharding(x):
    sh = other if np.ndim(x) == 2 else x.sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
  abstract = jax.tree.map(with_sharding, trained)
  out = checkpoint.restore(str(tmp_path), 1, target=abstract, backend=backend)
  assert out.params["params"]["w"].sharding == other
  _assert_shardings(out, abstract)
  _assert_trees_equal(out.params, trained.params)

  # A plain jax.eval_shape keeps no shardings: the result is on the default
  # device with either backend (orbax alone would reuse the saved layout).
  bare = jax.eval_shape(lambda: trained)
  assert all(getattr(x, "sharding", None) is None for x in jax.tree.leaves(bare))
  out = checkpoint.restore(str(tmp_path), 1, target=bare, backend=backend)
  _assert_shardings(out, bare)
  _assert_trees_equal(out.params, trained.params)


@pytest.mark.skipif(NDEV >= 8, reason="this process has 8 devices: the sharded tests run here")
def test_eight_device_subprocess():
  """Runs this file's sharded tests on 8 fake CPU devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = subprocess_xla_flags(devices=8)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.abspath(__file__), "-k", "sharded", "-rs"]
  proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-6000:]
  # Each sharded test ran (none skipped for want of devices).
  n_sharded = 2 * (2 if checkpoint.orbax_available() else 1)
  assert f"{n_sharded} passed" in out, out[-3000:]


def test_save_refuses_to_race_across_processes(tmp_path, monkeypatch):
  """One of several JAX processes: save would have every process write and
  rename the same directory; it says so instead, before writing anything."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(ValueError, match="process 1 of 2.*orbax"):
    checkpoint.save(str(tmp_path / "ckpt"), 0, {"w": jnp.ones(3)})
  assert not (tmp_path / "ckpt").exists()
