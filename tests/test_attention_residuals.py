"""What cuDNN attention keeps for its backward: no dense mask bias.

jax's cuDNN wrapper turns a boolean mask into a (B, 1, Sq, Skv) additive
bias before its custom VJP, which keeps the bias as a residual (6 GiB over
the Llama preset's 24 layers at batch 8). ``attention_core`` runs every
cuDNN path under a remat policy that keeps only cuDNN's forward outputs;
the bias is rebuilt in the backward. Traced on the CPU (cuDNN's version and
device checks answered as on a Hopper GPU): nothing here runs cuDNN.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from te_jax.layers import attention as core_lib
from te_jax.layers import packed_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import model_memory  # noqa: E402  pylint: disable=wrong-import-position,import-error

B, S, H, G, D = 2, 256, 4, 2, 64


@pytest.fixture
def hopper(monkeypatch):
  """cuDNN 9.10 on compute capability 9.0, for tracing."""
  monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)
  as_cc = lambda cap: tuple(int(x) for x in cap.split("."))
  monkeypatch.setattr(cudnn_attention, "check_compute_capability",
                      lambda cap: as_cc(cap) <= (9, 0))
  monkeypatch.setattr(cudnn_attention, "is_cuda_compute_capability_equal",
                      lambda cap: cap == "9.0")
  monkeypatch.setattr(packed_attention, "_unavailable_reason", lambda: "")


PATHS = {   # attention_core arguments of each cuDNN path that takes a mask
    "banded": dict(max_document_length=64),
    "packed": dict(),
    "masked": dict(mask=jnp.ones((B, 1, S, S), jnp.bool_)),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_cudnn_attention_keeps_no_mask_bias(hopper, path):  # pylint: disable=unused-argument
  q = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, G, D), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((B, S), jnp.int32)
  extra = PATHS[path]

  def loss(q, k, v, ids):
    out = core_lib.attention_core(q, k, v, self_attn=True, segment_ids=ids,
                                  kv_segment_ids=ids, attention_impl="cudnn", **extra)
    return out.astype(jnp.float32).sum()

  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv, ids))
  assert "dot_product_attention_fwd" in jaxpr, "not the cuDNN path"
  rows = model_memory.saved_residuals(loss, q, kv, kv, ids)
  square = [r for r in rows if r.shape[-2:] == (S, S) and not r.argument]
  assert not square, f"{path}: a (.., S, S) residual is kept: {square}"
  # cuDNN's output and softmax statistics are kept, so the backward does
  # not rerun the forward: their shapes are among the residuals.
  computed = {(r.shape, r.dtype) for r in rows if not r.argument}
  assert ((B, S, H, D), "bfloat16") in computed
  assert ((B, H, S), "float32") in computed


def _cudnn_forward_calls(compiled_text: str) -> int:
  return sum(1 for line in compiled_text.splitlines()
             if 'custom_call_target="__cudnn$fmha' in line and "Backward" not in line)


@pytest.mark.gpu
@pytest.mark.parametrize("path", sorted(PATHS))
def test_cuda_attention_rebuilds_the_mask_not_the_forward(path):
  """On the GPU: values and gradients equal to XLA attention's (float32
  reference), and the backward program calls cuDNN's forward no more often
  than the forward program does (the policy keeps its outputs)."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((B, S, G, D)), jnp.bfloat16) for _ in "kv")
  cot = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
  ids = np.zeros((B, S), np.int32)
  for i, start in enumerate(range(0, 240, 60)):    # 4 documents of 50 tokens a row
    ids[:, start:start + 50] = i + 1
  ids = jnp.asarray(ids)

  def run(impl, q, k, v):
    return core_lib.attention_core(q, k, v, self_attn=True, segment_ids=ids,
                                   kv_segment_ids=ids, attention_impl=impl, **PATHS[path])

  def loss(impl, q, k, v):
    return jnp.sum(run(impl, q, k, v).astype(jnp.float32) * cot)

  f32 = lambda t: t.astype(jnp.float32)
  rel = lambda a, r: float(jnp.linalg.norm(f32(a) - r) / jnp.linalg.norm(r))
  forward = jax.jit(functools.partial(run, "cudnn"))
  grad = jax.jit(jax.grad(functools.partial(loss, "cudnn"), argnums=(0, 1, 2)))
  ref_args = (f32(q), f32(k), f32(v))
  ref_grads = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(*ref_args)
  # bf16 inputs and probabilities (test_banded_attention's bounds)
  assert rel(forward(q, k, v), run("xla", *ref_args)) < 2e-2
  for name, g, rg in zip("qkv", grad(q, k, v), ref_grads):
    assert rel(g, rg) < 4e-2, name
  forward = forward.lower(q, k, v).compile().as_text()
  backward = grad.lower(q, k, v).compile().as_text()
  assert _cudnn_forward_calls(forward) >= 1
  assert _cudnn_forward_calls(backward) == _cudnn_forward_calls(forward)
