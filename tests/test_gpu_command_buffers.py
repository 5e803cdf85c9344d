"""te_jax's custom calls inside XLA command buffers (H200, ``gpu`` marker).

Every te_jax FFI handler is declared command-buffer compatible
(``custom_calls/ffi/*.cc``), so XLA records a whole FP8 training step as CUDA
graphs instead of launching thunk by thunk. These tests check that it does
(from the thunk sequence XLA dumps) and that the recorded program computes
what the same program computes without command buffers, also for new inputs
(new buffer addresses, which make XLA update or re-record the graphs).
"""

import glob
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx

from flax_cases import RECIPES
from test_gpu_flax import rand, vjp_fn

pytestmark = pytest.mark.gpu

B, S, E, MLP, H = 2, 256, 256, 1024, 4
BF16, F32 = jnp.bfloat16, jnp.float32
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


def thunk_kinds(lowered, dump_dir, options=None):
  """Kinds of the top-level thunks of `lowered` compiled with `options`, and
  the kinds nested in command buffers (XLA's thunk sequence dump)."""
  lowered.compile(dict(options or {}, xla_dump_to=str(dump_dir)))
  # XLA writes the sequence after its thunk passes (which build the command
  # buffers) only when they changed it.
  files = (glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes.txt"))
           or glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))
  assert len(files) == 1, f"expected one thunk sequence dump, got {files}"
  top, nested = [], []
  for line in open(files[0], encoding="utf-8").read().splitlines():
    if not line.strip():
      continue
    kind = line.split()[1]   # "000: kCommandBuffer [...]"
    (nested if line.startswith(" ") else top).append(kind)
  return top, nested


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_layer_step_is_one_command_buffer(name, tmp_path):
  """A TransformerLayer fwd+bwd (FP8 GEMMs, quantize and fused activation
  custom calls, cuDNN attention) runs as one command buffer. Before the
  handlers were declared compatible (2026-12-01) each custom call split the
  program into separately launched thunks."""
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", dtype=BF16)
  x, cot = rand(0, (B, S, E)).astype(BF16), rand(1, (B, S, E)).astype(BF16)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    v = nn.unbox(jax.jit(layer.init)(jax.random.key(0), x))
    lowered = jax.jit(vjp_fn(layer.apply)).lower(v, x, cot)
  assert 'custom_call_target="te_jax_gemm"' in lowered.compile().as_text()
  top, nested = thunk_kinds(lowered, tmp_path / "on")
  assert top == ["kCommandBuffer"], top
  assert nested.count("kCustomCall") >= 6, nested   # >= 6 GEMMs alone
  # The same check tells the programs apart: without command buffers the
  # custom calls are top-level thunks.
  top_off, _ = thunk_kinds(lowered, tmp_path / "off", NO_COMMAND_BUFFERS)
  assert "kCommandBuffer" not in top_off and "kCustomCall" in top_off, top_off


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recorded_step_matches_unrecorded(name):
  """LayerNormMLP fwd+bwd with and without command buffers: bit-equal (same
  kernels, all deterministic), for two inputs in turn and with the
  DelayedScaling state of the first step carried into the second."""
  mlp = tfx.LayerNormMLP(intermediate_dim=MLP, dtype=BF16)
  x, cot = rand(0, (B, S, E)).astype(BF16), rand(1, (B, S, E)).astype(BF16)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
    v = nn.unbox(jax.jit(mlp.init)(jax.random.key(0), x))
    lowered = jax.jit(vjp_fn(mlp.apply)).lower(v, x, cot)
  steps = [lowered.compile(), lowered.compile(NO_COMMAND_BUFFERS)]
  results = []
  for step in steps:
    out1 = step(v, x, cot)
    v2 = fp8_state.apply_fp8_updates(v, out1[1][0]) if name == "delayed" else v
    out2 = step(v2, (rand(2, (B, S, E)) * 3).astype(BF16), cot)
    results.append((out1, out2))
  (on1, on2), (off1, off2) = results
  for a, b in zip(jax.tree.leaves((on1, on2)), jax.tree.leaves((off1, off2))):
    np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))
  # the second input really went through the recorded program (no stale replay)
  assert not np.array_equal(np.asarray(on1[0], F32), np.asarray(on2[0], F32))
