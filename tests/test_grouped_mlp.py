"""te_jax.grouped_mlp (the experts' activation fused into quantization) and the
MoE experts' use of it.

The fused core must compute what two ``grouped_dense`` calls around the same
float32 activation compute (``_emulated``), bit for bit on the reference
path: the activation's backward there is the fused op's spec
(``act_quantize.activation_backward``) applied to its cotangent rounded to
the compute dtype, which is what the fused backward's dgrad GEMM writes.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import grouped_dense as gd
from te_jax import grouped_mlp
from te_jax.moe import experts
from te_jax.ops import act_quantize as act_op
from te_jax.ops import quantize as quantize_op

from flax_cases import RECIPES, rand, rel

E, M, H, F = 4, 512, 256, 128
# An empty expert, and 128 rows after the last group (they give 0).
SIZES = (128, 0, 256, 0)


def _args(acts, f=F):
  x = rand(0, (M, H), dtype=jnp.bfloat16)
  wi = rand(1, (E, H, len(acts) * f), 0.06)
  wo = rand(2, (E, f, H), 0.06)
  return x, wi, wo, jnp.asarray(SIZES, jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(h, acts, round_h):
  """activation_forward(h) in float32, differentiated as the fused op's spec:
  activation_backward(dz, h) with dz in h's dtype (the fused dz's), and with
  ``round_h`` at h rounded as store_act_input_in_fp8 keeps it."""
  del round_h
  return act_op.activation_forward(h, acts)


def _activation_fwd(h, acts, round_h):
  del round_h
  return act_op.activation_forward(h, acts), h


def _activation_bwd(acts, round_h, h, g):
  if round_h:
    h = quantize_op.quantize_blockwise_reference(
        h, act_op.H_COPY_BLOCK, act_op.H_COPY_DTYPE,
        act_op.H_COPY_POWER_2_SCALE).rowwise().dequantize(h.dtype)
  return (act_op.activation_backward(g.astype(h.dtype), h, acts),)


_activation.defvjp(_activation_fwd, _activation_bwd)


def _emulated(x, wi, wo, sizes, states, r, acts, fp8_h=False):
  st = states or {}
  h = gd.grouped_dense(x, wi, sizes, recipe=r, fp8_state=st.get("wi"), impl="reference")
  z = _activation(h, acts, fp8_h)
  y = gd.grouped_dense(z, wo, sizes, recipe=r, fp8_state=st.get("wo"), impl="reference")
  return y.astype(x.dtype)


def _fused(x, wi, wo, sizes, states, r, acts, fp8_h=False):
  return grouped_mlp.fp8_grouped_mlp(x, wi, wo, sizes, activations=acts, recipe=r,
                                     fp8_state=states, impl="reference",
                                     store_act_input_in_fp8=fp8_h)


def _run(fn, r, acts, args, states, **kw):
  cot = rand(5, (M, H), dtype=jnp.bfloat16)

  def f(*a):
    y, vjp = jax.vjp(lambda *p: fn(*p[:4], p[4], r, acts, **kw), *a)
    return y, vjp(cot)
  return jax.jit(f)(*args, states)


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("acts", [("silu", "linear"), ("gelu",)])
def test_fused_matches_two_grouped_dense(rname, acts):
  r = RECIPES[rname]()
  args = _args(acts)
  states = experts.init_expert_states(r, E)
  y1, g1 = _run(_fused, r, acts, args, states)
  y0, g0 = _run(_emulated, r, acts, args, states)
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  assert not np.any(np.asarray(y1[sum(SIZES):], np.float32)), "rows outside every group"
  for i, name in enumerate(("x", "wi", "wo")):
    assert g1[i].dtype == args[i].dtype, name
    np.testing.assert_array_equal(np.asarray(g1[i], np.float32), np.asarray(g0[i], np.float32),
                                  err_msg=name)
  assert np.any(np.asarray(g1[0], np.float32)) and np.any(np.asarray(g1[1]))
  if states is not None:   # the same state after the step, and this step's amaxes in it
    jax.tree.map(np.testing.assert_array_equal, g1[4], g0[4])
    for gemm in ("wi", "wo"):
      for role in ("x", "grad"):
        assert np.asarray(g1[4][gemm][role]["amax_history"])[..., 0].max() > 0, (gemm, role)


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_act_input_in_fp8(rname):
  """store_act_input_in_fp8 keeps h in E4M3 (1x128 tiles, power-of-two
  scales): the output is the default's, the gradients those of the
  emulation whose activation backward reads h so rounded, bit for bit."""
  r, acts = RECIPES[rname](), ("silu", "linear")
  args, states = _args(acts), experts.init_expert_states(r, E)
  y1, g1 = _run(_fused, r, acts, args, states, fp8_h=True)
  y0, g0 = _run(_fused, r, acts, args, states)
  y2, g2 = _run(_emulated, r, acts, args, states, fp8_h=True)
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y0, np.float32))
  for a, b in zip(jax.tree.leaves((g1[:3], g1[4])), jax.tree.leaves((g2[:3], g2[4]))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert rel(g1[0], g0[0]) > 0   # the option changed the gradient through act'(h)


def test_expert_mlp_takes_the_fused_path(monkeypatch):
  """FP8 experts at aligned sizes run as one fused grouped MLP; FP8 off does not."""
  calls = []
  real = grouped_mlp.fp8_grouped_mlp
  monkeypatch.setattr(grouped_mlp, "fp8_grouped_mlp",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  x, wi, wo, sizes = _args(("silu", "linear"))
  wi4 = wi.reshape(E, H, 2, F)
  r = RECIPES["block"]()
  experts.expert_mlp(x, sizes, wi4, wo, activations=("silu", "linear"), recipe=r,
                     impl="reference")
  assert calls == [1]
  experts.expert_mlp(x, sizes, wi4, wo, activations=("silu", "linear"), recipe=None,
                     impl="reference")
  assert calls == [1]


def test_unaligned_experts_warn_and_run_unfused(caplog):
  """An expert width that is not a multiple of 128 takes the unfused path
  (grouped_dense pads it), with one warning naming why."""
  experts._warn_unfused.cache_clear()   # pylint: disable=protected-access
  f = 72
  x, wi, wo, sizes = _args(("gelu",), f)
  r = RECIPES["current"]()
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    y = experts.expert_mlp(x, sizes, wi.reshape(E, H, 1, f), wo, activations=("gelu",),
                           recipe=r, impl="reference")
    experts.expert_mlp(x, sizes, wi.reshape(E, H, 1, f), wo, activations=("gelu",),
                       recipe=r, impl="reference")
  warned = [m for m in caplog.messages if "grouped_mlp" in m]
  assert len(warned) == 1 and "expert width 72" in warned[0], caplog.messages
  h = gd.grouped_dense(x, wi, sizes, recipe=r, impl="reference")
  z = act_op.activation_forward(h, ("gelu",)).astype(x.dtype)
  want = gd.grouped_dense(z, wo, sizes, recipe=r, impl="reference")
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_supported_and_bad_arguments():
  r = RECIPES["block"]()
  assert not grouped_mlp.why_not_supported(256, 128, 384, r)
  assert grouped_mlp.why_not_supported(200, 128, 384, r)   # rows: not whole 128-row tiles
  assert grouped_mlp.why_not_supported(256, 128, 72, r)
  assert grouped_mlp.why_not_supported(256, 128, 128, None) == "FP8 is off"
  x, wi, wo, sizes = _args(("silu", "linear"))
  with pytest.raises(ValueError, match="must agree"):
    grouped_mlp.fp8_grouped_mlp(x, wi, wo, sizes, activations=("gelu",), recipe=r)
  with pytest.raises(ValueError, match=r"x must be \(M, H\)"):
    grouped_mlp.fp8_grouped_mlp(x[:, :128], wi, wo, sizes, activations=("silu", "linear"),
                                recipe=r)
  with pytest.raises(ValueError, match="buffer's 200 rows must be a multiple of 128"):
    grouped_mlp.fp8_grouped_mlp(x[:200], wi, wo, sizes, activations=("silu", "linear"),
                                recipe=r)
  # Inside shard_map current scaling would need z's amax over every device.
  assert "amax over every device" in grouped_mlp.why_not_supported(
      512, 256, 128, RECIPES["current"](), sharded=True)
  assert not grouped_mlp.why_not_supported(512, 256, 128, RECIPES["delayed"](), sharded=True)
  # An FSDP-gathered local kernel dim must be whole 128-blocks (a 1-device axis here).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  why = []

  def body(x, wi, wo):
    why.append(grouped_mlp.check_args(
        x, wi[:, :64], wo[:, :, :64], ("silu", "linear"), r,
        gd.GroupedAxes(k_gather_axes=("fsdp",)), gd.GroupedAxes(n_gather_axes=("fsdp",))))
    return x
  P = jax.sharding.PartitionSpec
  jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P()),
                 x[:, :64], wi, wo)
  assert "FSDP-gathered kernel dims [64, 64]" in why[0], why


def _sm90_reason() -> str:
  from te_jax.ops import _native   # pylint: disable=import-outside-toplevel
  from te_jax.ops import grouped_gemm_cuda as ggc   # pylint: disable=import-outside-toplevel
  if not _native.cuda_available():
    return "needs a GPU and the te_jax CUDA custom calls"
  return ggc.build_reason() or ggc.device_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("fp8_h", [False, True])
def test_fused_cuda_matches_reference(rname, fp8_h):
  """The CUDA program (te_jax's grouped kernels and fused activation
  quantize) against the reference on the CPU: CUDA's and XLA's float32
  exp differ by ulps, so a few FP8 roundings move by one step (< 1% in
  norm, as for the dense fused MLP)."""
  reason = _sm90_reason()
  if reason:
    pytest.skip(reason)
  r, acts = RECIPES[rname](), ("silu", "linear")
  args, states = _args(acts), experts.init_expert_states(r, E)
  cot = rand(5, (M, H), dtype=jnp.bfloat16)

  def run(impl, device):
    def f(x, wi, wo, sizes, st, cot):
      y, vjp = jax.vjp(lambda *p: grouped_mlp.fp8_grouped_mlp(
          p[0], p[1], p[2], sizes, activations=acts, recipe=r, fp8_state=p[3], impl=impl,
          store_act_input_in_fp8=fp8_h), x, wi, wo, st)
      return y, vjp(cot)
    return jax.jit(f)(*jax.device_put((*args, states, cot), device))

  y1, g1 = run("auto", jax.devices("gpu")[0])
  y0, g0 = run("reference", jax.devices("cpu")[0])
  assert rel(y1, y0) < 1e-2
  for a, b in zip(g1[:3], g0[:3]):
    assert rel(a, b) < 1e-2
  assert not np.any(np.asarray(y1[sum(SIZES):], np.float32))
