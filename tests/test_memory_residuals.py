"""What the FP8 layers keep for their backward pass, and that keeping less changes nothing.

The fused norm layers (``te_jax.norm_dense``, ``te_jax.fused_mlp``) keep no
FP8 copy of an activation they keep anyway in 16 bits (x for the norm's
backward, h for the activation's), nor FP8 copies of their kernels: the
backward quantizes again with the forward's scales. ``te_jax.dense`` does
the same on request (``save_original_input`` / ``save_original_kernel``).
Here: the gradients equal those of the kept-copy path bit for bit (every
recipe, reference everywhere and CUDA on a GPU), and the residuals of a
small Llama-like model (``benchmarks/model_memory.py``) are per layer no
more than FP8-off's, with no FP8 array among the fused layers' residuals.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import dense, fused_mlp, norm_dense
from cuda_lowering import cuda_text, gpu_host  # pylint: disable=unused-import
from flax_cases import RECIPES, mlp_states, vjp_run

import model_memory  # pylint: disable=import-error  (benchmarks/ is on pytest's path)

M, K, F, N = 384, 128, 256, 256   # M apart from the others: token-sized = has M


def _rand(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale,
                     jnp.bfloat16)


def _assert_same(got, want):
  leaves_g, tree_g = jax.tree.flatten(got)
  leaves_w, tree_w = jax.tree.flatten(want)
  assert tree_g == tree_w
  for a, b in zip(leaves_g, leaves_w):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _cases(r, impl):
  """(name, fn(keep_originals) -> callable, args, cotangent) per layer kind."""
  x, w, w2 = _rand(0, (M, K)), _rand(1, (K, N), 0.1).astype(jnp.float32), _rand(2, (F, K), 0.1)
  gamma, beta = 1.0 + _rand(3, (K,), 0.1).astype(jnp.float32), _rand(4, (K,), 0.1)
  si, so = mlp_states(r)
  wi = _rand(5, (K, 2 * F), 0.1).astype(jnp.float32)

  def dense_fn(keep):
    return lambda x, w, s: dense.fp8_dense(x, w, recipe=r, fp8_state=s, impl=impl,
                                           save_original_input=keep,
                                           save_original_kernel=keep)

  def norm_fn(keep):
    def f(x, g, b, w, s):
      y, ln = norm_dense.fp8_norm_dense(
          x, g, b, w, norm_type="layernorm", epsilon=1e-6, zero_centered_gamma=False,
          recipe=r, fp8_state=s, impl=impl, return_norm_output=True, num_splits=2,
          save_original_input=keep, save_original_kernel=keep)
      return y, ln
    return f

  def mlp_fn(keep, norm, chunks):
    def f(x, g, wi, wo, si, so):
      params = norm_dense.NormParams(g, None, "rmsnorm", 1e-6, False) if norm else None
      return fused_mlp.fp8_mlp(x, wi, wo, activations=("silu", "linear"), recipe=r,
                               wi_state=si, wo_state=so, impl=impl, norm=params,
                               backward_chunks=chunks, save_original_input=keep,
                               save_original_kernel=keep)
    return f

  yield "dense", dense_fn, (x, w, si), _rand(6, (M, N))
  yield "norm_dense", norm_fn, (x, gamma, beta, w, si), (
      (_rand(7, (M, N // 2)), _rand(8, (M, N // 2))), _rand(9, (M, K)))
  chunks = 1 if r.scaling_mode().scales_from_whole_tensor else 2
  for norm in (True, False):
    yield (f"mlp norm={norm} chunks={chunks}",
           lambda keep, norm=norm: mlp_fn(keep, norm, chunks),
           (x, gamma, wi, w2, si, so), _rand(10, (M, K)))


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_requantizing_in_the_backward_changes_no_bit(rname, impl):
  r = RECIPES[rname]()
  for name, make, args, cot in _cases(r, impl):
    want = vjp_run(make(False), args, cot)
    got = vjp_run(make(True), args, cot)
    try:
      _assert_same(got, want)
    except AssertionError as e:
      raise AssertionError(f"{name}: {e}") from None


def test_keeping_originals_drops_the_fp8_residuals():
  """The kept tensors replace the FP8 copies among the residuals (and an
  argument kept is free)."""
  r = RECIPES["current"]()
  x, w = _rand(0, (M, K)), _rand(1, (K, N), 0.1).astype(jnp.float32)

  def fp8_residuals(keep):
    rows = model_memory.saved_residuals(
        lambda x, w: dense.fp8_dense(x, w, recipe=r, impl="reference",
                                     save_original_input=keep, save_original_kernel=keep),
        x, w)
    return [row for row in rows if row.dtype.startswith("float8")], rows

  kept, _ = fp8_residuals(False)
  assert sorted(row.shape for row in kept) == sorted([(K, M), (K, N)])   # x.T, kernel
  none, rows = fp8_residuals(True)
  assert not none and all(row.argument for row in rows if row.nbytes > 64)


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_fused_layers_keep_only_what_their_backward_reads(rname):
  """Token-sized residuals, in bytes: norm + dense keeps x; the norm + MLP
  block keeps x and h; beyond those, only per-row statistics and scales."""
  r = RECIPES[rname]()
  x, gamma = _rand(0, (M, K)), jnp.ones((K,), jnp.float32)
  w, wi, wo = (_rand(i, s, 0.1).astype(jnp.float32)
               for i, s in ((1, (K, N)), (2, (K, 2 * F)), (3, (F, K))))
  si, so = mlp_states(r)
  norm = norm_dense.NormParams(gamma, None, "rmsnorm", 1e-6, False)

  def kept(f, *args):   # token-sized residuals (either layout), arguments included
    return sum(row.nbytes for row in model_memory.saved_residuals(f, *args)
               if M in row.shape)

  nd = kept(lambda x, g, w, s: norm_dense.fp8_norm_dense(
      x, g, None, w, norm_type="rmsnorm", epsilon=1e-6, zero_centered_gamma=False,
      recipe=r, fp8_state=s, impl="reference"), x, gamma, w, si)
  mlp = kept(lambda x, g, wi, wo, si, so: fused_mlp.fp8_mlp(
      x, wi, wo, activations=("silu", "linear"), recipe=r, wi_state=si, wo_state=so,
      impl="reference", norm=norm._replace(gamma=g)), x, gamma, wi, wo, si, so)
  x_bytes, h_bytes, per_row = M * K * 2, M * 2 * F * 2, M * 16
  assert x_bytes <= nd <= x_bytes + per_row
  assert x_bytes + h_bytes <= mlp <= x_bytes + h_bytes + per_row


def _fp8_results(text, prefix):
  """The FP8 result types ("MxKxf8E4M3FN") of each custom call whose target
  starts with ``prefix``, in program order."""
  calls = []
  for line in text.splitlines():
    if re.search(rf"custom_call @{prefix}\w*\(", line):
      results = line.rsplit(") -> (", 1)[1]
      calls.append([t for t in re.findall(r"tensor<([^>]*)>", results) if "xf8" in t])
  return calls


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_fused_mlp_makes_each_fp8_copy_once(gpu_host, rname):  # pylint: disable=unused-argument
  """The CUDA program of the norm + MLP block's step (lowered without a GPU):
  two activation-quantize calls, the forward's writing act(h) rowwise only
  and the backward's dh both ways plus act(h) columnwise (no third pass over
  h); the norm's forward call writes norm(x) rowwise, its backward call the
  columnwise copy alone."""
  r = RECIPES[rname]()
  x, gamma = _rand(0, (M, K)), jnp.ones((K,), jnp.float32)
  wi, wo = _rand(2, (K, 2 * F), 0.1), _rand(3, (F, K), 0.1)
  si, so = mlp_states(r)
  norm = norm_dense.NormParams(gamma, None, "rmsnorm", 1e-6, False)

  def step(x, wi, wo):
    return jax.value_and_grad(lambda *a: jnp.sum(fused_mlp.fp8_mlp(
        *a, activations=("silu", "linear"), recipe=r, wi_state=si, wo_state=so,
        norm=norm).astype(jnp.float32)), argnums=(0, 1, 2))(x, wi, wo)
  text = cuda_text(step, x, wi, wo)
  e4, e5 = "f8E4M3FN", ("f8E5M2" if r.fp8_format.name == "HYBRID" else "f8E4M3FN")
  assert _fp8_results(text, "te_jax_act_quantize") == [
      [f"{M}x{F}x{e4}", f"0x0x{e4}", f"0x0x{e4}"],                    # forward: z
      [f"{M}x{2 * F}x{e5}", f"{2 * F}x{M}x{e5}", f"{F}x{M}x{e4}"]]    # backward: dh, z.T
  assert _fp8_results(text, "te_jax_norm_quantize") == [
      [f"{M}x{K}x{e4}", f"0x0x{e4}"], [f"0x0x{e4}", f"{K}x{M}x{e4}"]]


# The guard: a small Llama-like model (every FP8 layer on its fused path:
# dims multiples of 128) in bf16 and every recipe, under the library's memory
# plan (the autocast's defaults) and under the llama preset's (FP8 copies kept,
# the activation's input in E4M3).
_MODEL = dict(preset="llama", hidden=256, layers=2, heads=2, kv_groups=1, mlp=768,
              seq_len=256, batch=2, doc_window=False, num_docs=20)
_PLANS = {"library": dict(keep_fp8_copies=False, store_act_input_in_fp8=False),
          "llama preset": {}}


@pytest.fixture(scope="module")
def model_residuals():
  return {(plan, name): model_memory.model_residuals(name, dict(_MODEL, **_PLANS[plan]))
          for plan in _PLANS for name in ("none", "delayed", "current", "blockwise")}


@pytest.mark.parametrize("plan", list(_PLANS))
@pytest.mark.parametrize("rname", ["delayed", "current", "blockwise"])
def test_fp8_step_keeps_no_more_than_bf16_per_layer(model_residuals, rname, plan):
  base = model_memory.residual_bytes_by_layer(model_residuals[plan, "none"], depth=3)
  fp8 = model_memory.residual_bytes_by_layer(model_residuals[plan, rname], depth=3)
  assert {k for k in base if k.startswith("layer_")} == {
      k for k in fp8 if k.startswith("layer_")}
  over = {k: (fp8[k], base.get(k, 0)) for k in fp8 if fp8[k] > base.get(k, 0)}
  assert not over, f"{rname} keeps more than bf16 (bytes, FP8 vs bf16): {over}"


@pytest.mark.parametrize("rname", ["delayed", "current", "blockwise"])
def test_fused_norm_layers_keep_no_fp8_copies(model_residuals, rname):
  """The MLP block and the fused Q/K/V projection (norm fused into the
  quantization; grouped-query here) keep x and h in 16 bits and nothing in
  FP8; the output projection keeps its FP8 x.T and kernel (the modules'
  choice)."""
  fp8 = {}
  for row in model_residuals["library", rname]:
    if row.dtype.startswith("float8") and not row.argument:
      layer = model_memory.layer_of(row.where)
      fp8[layer] = fp8.get(layer, 0) + row.nbytes
  fused = {k: v for k, v in fp8.items() if k.endswith(("/mlp", "/qkv"))}
  assert not fused, f"FP8 copies kept by fused norm layers: {fused}"
  assert any(k.endswith("/out") for k in fp8)   # the check sees FP8 residuals where they are


@pytest.mark.gpu
def test_compiled_fp8_step_needs_no_more_device_memory_than_bf16():
  """On the GPU (CUDA custom calls, XLA's own buffer assignment): arguments
  + temp of the compiled train step of a small Llama-like model, every FP8
  recipe against bf16."""
  overrides = dict(hidden=512, layers=2, heads=4, kv_groups=2, mlp=1536, seq_len=1024,
                   doc_window=False, num_docs=200)
  for plan, options in _PLANS.items():
    totals = {}
    for name in ("none", "delayed", "current", "blockwise"):
      stats = model_memory.memory_stats(
          model_memory.compile_step("llama", name, 8, dict(overrides, **options)))
      totals[name] = stats["argument"] + stats["temp"]
    over = {k: v / totals["none"] for k, v in totals.items() if v > totals["none"]}
    assert not over, f"{plan} plan: arguments + temp above bf16's ({totals['none']} B): {over}"
