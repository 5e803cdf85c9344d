"""Checks on where a module's FP8 state comes from (issue 23 items 5 and 11).

* ``nn.scan`` over te_jax modules under ``DelayedScaling`` must carry the FP8
  collection per layer (``variable_axes``). Broadcast, every layer reads one
  state and the backward pass SUMS the layers' new states into it (an amax
  entry becomes the sum of the layers' amaxes): silently wrong, so it
  raises. Left out of the scan, the layers never see the collection, and the
  error names the scan's ``variable_axes``, not "initialize inside
  fp8_autocast".
* A ``MeshResource`` that names none of the active mesh's axes runs every
  FP8 GEMM replicated: te_jax warns once, as it does for a mesh resource
  without a mesh.
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import te_jax
from te_jax import flax as tfx
from te_jax import recipe, sharded_dense, sharding
from te_jax.fp8_state import FP8_COLLECTION

LAYERS, HIST = 3, 4
R = recipe.DelayedScaling(amax_history_len=HIST)
FIX = f'variable_axes={{"{FP8_COLLECTION}": 0'


class Block(nn.Module):
  """One scanned layer: x -> x + 0.5 * layer(x), carry only."""
  layer: str = "dense"

  @nn.compact
  def __call__(self, x, _):
    if self.layer == "dense":
      y = tfx.DenseGeneral(x.shape[-1], name="d")(x)
    else:   # embed 128, 16 tokens: the fused norm+quantize path (fused_states)
      y = tfx.LayerNormDenseGeneral(x.shape[-1], name="d")(x)
    return x + 0.5 * y, None


def scanned(fp8: str, remat: bool = False, layer: str = "dense"):
  """A model that nn.scan's LAYERS Blocks, with the FP8 collection
  ``fp8`` = "axes" (variable_axes, per layer), "broadcast" or "missing"."""
  axes = {"params": 0}
  if fp8 == "axes":
    axes[FP8_COLLECTION] = 0
  body = nn.remat(Block) if remat else Block

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(body, variable_axes=axes,
                     variable_broadcast=FP8_COLLECTION if fp8 == "broadcast" else False,
                     split_rngs={"params": True}, length=LAYERS,
                     metadata_params={nn.PARTITION_NAME: "layers"})
      return scan(layer=layer, name="layers")(x, None)[0]

  return Model()


def x_input(layer="dense"):
  shape = (4, 8) if layer == "dense" else (16, 128)
  return jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)


def init(model, x, enabled=True):
  # jit: one compile instead of one per op (the checks run while tracing).
  with te_jax.fp8_autocast(enabled, R):
    return jax.jit(model.init)(jax.random.PRNGKey(1), x)


def grad_step(model, variables, x, enabled=True):
  with te_jax.fp8_autocast(enabled, R):
    return jax.jit(jax.grad(lambda v: model.apply(v, x).astype(jnp.float32).sum()))(variables)


def layer_state(variables):
  return variables[FP8_COLLECTION]["layers"]["d"]["fp8_meta"]


# ----------------------------------------------------------- variable_axes --

@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_variable_axes_keeps_one_state_per_layer(remat):
  """The supported form: stacked state, each layer's own amax (the check
  must not fire here, with or without nn.remat inside the scan)."""
  model, x = scanned("axes", remat), x_input()
  v = init(model, x)
  assert layer_state(v)["x"]["amax_history"].shape == (LAYERS, HIST)
  g = layer_state(grad_step(model, v, x))
  newest = np.asarray(g["x"]["amax_history"][:, 0])
  # Layer 0 sees the model input; the layers' inputs differ.
  np.testing.assert_allclose(newest[0], float(jnp.max(jnp.abs(x))), rtol=1e-6)
  assert len(set(newest.tolist())) == LAYERS, newest


# --------------------------------------------------------------- broadcast --

@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("layer", ["dense", "norm_dense"])
def test_broadcast_state_raises_at_init_with_the_fix(remat, layer):
  model, x = scanned("broadcast", remat, layer), x_input(layer)
  with pytest.raises(ValueError) as info:
    init(model, x)
  msg = str(info.value)
  assert "broadcast" in msg and "sum the layers' new states" in msg, msg
  assert FIX in msg and "nn.scan(" in msg, msg
  assert "layers" in msg, msg   # which scan


def _one_layer_state(model_axes_vars):
  """Variables whose FP8 state is ONE layer's (hist,) state, as a broadcast
  scan (or a checkpoint of one) holds it."""
  v = jax.tree.map(lambda a: a, model_axes_vars)
  v[FP8_COLLECTION] = jax.tree.map(lambda a: a[0], v[FP8_COLLECTION])
  return v


@pytest.mark.parametrize("enabled", [True, False], ids=["fp8", "fp8_off"])
def test_broadcast_state_raises_at_apply(enabled):
  """State made elsewhere (a checkpoint, an older te_jax): applying it
  broadcast raises instead of summing the layers' updates into it, under
  jit and grad, and also with FP8 off (the kept state would be summed too)."""
  x = x_input()
  v = _one_layer_state(init(scanned("axes"), x))
  with pytest.raises(ValueError, match="broadcast") as info:
    grad_step(scanned("broadcast"), v, x, enabled)
  assert FIX in str(info.value)


def test_stacked_state_under_a_broadcast_scan_names_variable_axes():
  x = x_input()
  v = init(scanned("axes"), x)
  with pytest.raises(ValueError, match="variable_axes") as info:
    grad_step(scanned("broadcast"), v, x)
  assert FIX in str(info.value) and f"({LAYERS}, {HIST})" in str(info.value)


# ----------------------------------------------------------------- missing --

def test_collection_missing_from_the_scan_names_variable_axes_at_init():
  model, x = scanned("missing"), x_input()
  with pytest.raises(ValueError) as info:
    init(model, x)
  msg = str(info.value)
  assert FIX in msg and "layers" in msg, msg
  assert "Initialize the model inside fp8_autocast" not in msg, msg


def test_missing_state_inside_a_scan_at_apply_names_both_fixes():
  """At apply the module cannot tell a scan that drops the collection from a
  model initialized without DelayedScaling: the message gives both fixes."""
  model, x = scanned("axes"), x_input()
  v = init(model, x, enabled=False)
  assert FP8_COLLECTION not in v
  with pytest.raises(ValueError) as info:
    grad_step(model, v, x)
  msg = str(info.value)
  assert FIX in msg and "fp8_autocast" in msg, msg


def test_missing_state_outside_a_scan_keeps_the_autocast_fix():
  layer, x = tfx.DenseGeneral(8), x_input()
  v = layer.init(jax.random.PRNGKey(1), x)
  with pytest.raises(ValueError) as info:
    with te_jax.fp8_autocast(True, R):
      layer.apply(v, x)
  msg = str(info.value)
  assert "Initialize the model inside fp8_autocast" in msg and "nn.scan" not in msg, msg


# ------------------------------------------------- mesh resource vs mesh ----

def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == "te_jax" and r.levelno == logging.WARNING]


def _run_dense(mr, mesh):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 128), jnp.float32)
  layer = tfx.DenseGeneral(128, kernel_axes=("embed", "mlp"))
  with jax.set_mesh(mesh), te_jax.fp8_autocast(True, recipe.Float8CurrentScaling(),
                                                mesh_resource=mr):
    v = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
    return jax.jit(layer.apply)(v, x)


def test_mesh_resource_naming_no_mesh_axis_warns_once(caplog):
  sharded_dense.warn_unmatched_mesh_resource.cache_clear()
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  mr = sharding.MeshResource(dp_resource="batch", tp_resource="tp")
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    _run_dense(mr, mesh)
    _run_dense(mr, mesh)
  msgs = [m for m in _warnings(caplog) if "replicated" in m]
  assert len(msgs) == 1, _warnings(caplog)
  for name in ("batch", "tp", "data", "model", "MeshResource("):
    assert name in msgs[0], msgs[0]


def test_mesh_resource_naming_a_mesh_axis_does_not_warn(caplog):
  sharded_dense.warn_unmatched_mesh_resource.cache_clear()
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    _run_dense(sharding.MeshResource(dp_resource="data", tp_resource="model"), mesh)
  assert not _warnings(caplog), _warnings(caplog)
