"""The MoE layer's FP8 training step, as lowered for a GPU (issue 47).

Lowered for CUDA on this machine (``cuda_lowering``), as a GPU machine whose
build has the sm90 GEMMs would compile it, the step of a Linen ``MoE`` with
float32 parameters and bfloat16 compute must run its expert GEMMs as
te_jax's grouped FP8 kernels only: fprop, dgrad and wgrad of ``wi`` and
``wo``, six ``te_jax_grouped_gemm`` calls. A GEMM that falls back to the
pure-JAX reference shows up three ways in the program, each checked here:
a float32 x float32 ``dot_general`` outside the router (the one part that
runs in float32 by design), a loop whose trip count comes from the group
sizes (the GPU copies its condition to the host every iteration), and
fewer kernel calls. A host callback (``jax.debug``, ``io_callback``) would be
a custom call that is not te_jax's.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import te_jax
from te_jax import flax as tfx, moe, recipe
from te_jax.moe.scopes import SCOPES
from te_jax.ops import grouped_gemm as gg
from te_jax.ops import grouped_gemm_cuda as ggc

from cuda_lowering import gpu_host  # pylint: disable=unused-import  (a fixture)

RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling(),
           "blockwise": recipe.Float8BlockScaling()}
# Hidden, expert and shared widths of 128: every dim a whole 128-block.
BATCH, SEQ, HIDDEN, EXPERTS, TOP_K, WIDTH = 2, 64, 128, 4, 2, 128
EXPERT_GEMMS = 6   # (fprop, dgrad, wgrad) x (wi, wo)

_LOC_DEF = re.compile(r"^(#loc\d+) = loc\(\"([^\"]*)\"", re.M)
_LOC_REF = re.compile(r"loc\((#loc\d+)\)\s*$")
_DOT = re.compile(r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)")
_TARGET = re.compile(r"custom_call @(\w+)\(|call_target_name = \"(\w+)\"")
_COND = re.compile(r"cond \{\n(.*?)\n\s*\} do \{", re.S)
_SCATTER = re.compile(r'"stablehlo\.scatter"\(.*?\}\) : \([^)]*\) -> tensor<([^>]*)> loc\((#loc\d+)\)',
                      re.S)


@pytest.fixture
def sm90_build(gpu_host, monkeypatch):  # pylint: disable=redefined-outer-name,unused-argument
  """"auto" resolves to CUDA and the build note lists the sm90 GEMMs: the
  grouped-GEMM dispatchers stage their kernels where they take the call."""
  monkeypatch.setattr(ggc, "_build_note",
                      lambda: "sm90 GEMMs: built with the CUTLASS 4.2.0 headers in /x/include")
  gg._log_reference.cache_clear()   # pylint: disable=protected-access


def _step_text(fp8_recipe) -> str:
  """StableHLO (with op names) of the layer's loss and its gradients with
  respect to the parameters and FP8 state, and the input, for CUDA."""
  module = tfx.MoE(num_experts=EXPERTS, num_experts_per_token=TOP_K, intermediate_dim=WIDTH,
                   shared_intermediate_dim=WIDTH, dtype=jnp.bfloat16)
  x = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.float32)

  def loss(variables, x, g):
    y, st = module.apply(variables, x, mutable=["intermediates"])
    return jnp.sum(y.astype(jnp.float32) * g) + moe.aux_totals(st)["aux_loss"]

  with te_jax.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.trace(variables, x, g).lower(lowering_platforms=("cuda",)).as_text(
        debug_info=True)


def _op_name(line: str, names: dict) -> str:
  ref = _LOC_REF.search(line)
  return names.get(ref.group(1), "?") if ref else "?"


def float32_dots(text: str):
  """[(op name, operand types)] of the float32 x float32 dot_generals."""
  names = dict(_LOC_DEF.findall(text))
  dots = []
  for line in text.splitlines():
    m = _DOT.search(line)
    if m and all(t.split("x")[-1] == "f32" for t in m.groups()):
      dots.append((_op_name(line, names), m.groups()))
  return dots


def custom_call_targets(text: str):
  return [a or b for a, b in _TARGET.findall(text)]


def data_dependent_loops(text: str):
  """The condition blocks of while loops whose bound is not a constant of
  the block (a static trip count, which the GPU runs without reading the
  condition back to the host)."""
  loops = []
  for cond in _COND.findall(text):
    consts = set(re.findall(r"(%[\w#]+) = stablehlo\.constant", cond))
    bound = re.search(r"stablehlo\.compare\s+LT, %[\w]+, (%[\w]+)", cond)
    if bound is None or bound.group(1) not in consts:
      loops.append(cond.strip())
  return loops


def float_row_scatters(text: str):
  """[(op name, result type)] of the scatters into float arrays of rank 2 or
  more: on a GPU, atomic adds (bfloat16 ones in the MoE's activations)."""
  names = dict(_LOC_DEF.findall(text))
  return [(names.get(loc, "?"), ty) for ty, loc in _SCATTER.findall(text)
          if "x" in ty and ty.split("x")[-1].startswith(("f", "bf"))]


def test_the_finders_find_what_they_look_for():
  """On a made-up program: so that finding nothing in the step means absent."""
  text = "\n".join([
      '%1 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : '
      '(tensor<8x4xf32>, tensor<4x2xf32>) -> tensor<8x2xf32> loc(#loc7)',
      '%2 = stablehlo.custom_call @xla_ffi_python_gpu_callback(%1) : (tensor<8x2xf32>) -> ()',
      '%3:2 = stablehlo.while(%iterArg = %c, %iterArg_1 = %n) : tensor<i32>, tensor<i32>',
      ' cond {',
      '  %4 = stablehlo.compare LT, %iterArg, %iterArg_1, SIGNED : (tensor<i32>, tensor<i32>)',
      '  stablehlo.return %4 : tensor<i1>',
      ' } do {',
      '#loc7 = loc("while/body/dot_general"(#loc3))'])
  assert float32_dots(text) == [("while/body/dot_general", ("8x4xf32", "4x2xf32"))]
  assert custom_call_targets(text) == ["xla_ffi_python_gpu_callback"]
  assert len(data_dependent_loops(text)) == 1
  static = text.replace("%iterArg, %iterArg_1,", "%iterArg, %c_5,").replace(
      " cond {", " cond {\n  %c_5 = stablehlo.constant dense<4> : tensor<i32>")
  assert not data_dependent_loops(static)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_moe_step_runs_the_grouped_kernels_only(sm90_build, name):  # pylint: disable=redefined-outer-name,unused-argument
  """Six te_jax_grouped_gemm calls; float32 dots only in the router; every
  custom call te_jax's (no host callback); every loop of static length."""
  text = _step_text(RECIPES[name])
  targets = custom_call_targets(text)
  assert targets.count(ggc.TARGET) == EXPERT_GEMMS, sorted(set(targets))
  assert all(t.startswith("te_jax_") for t in targets), sorted(set(targets))
  stray = [(op, types) for op, types in float32_dots(text) if f"/{SCOPES['router']}/" not in op]
  assert not stray, stray
  assert not data_dependent_loops(text), data_dependent_loops(text)[0]


@pytest.mark.parametrize("name", ["none", "delayed"])
def test_dispatch_and_combine_gradients_are_gathers(sm90_build, name):  # pylint: disable=redefined-outer-name,unused-argument
  """The tokens' rows move between the token order and the experts' buffer
  by gathers in the backward too (te_jax.moe.dispatch): no scatter into an
  array of rows of the hidden width, where autodiff of the forward gathers
  would scatter-add (bfloat16 atomics, order-dependent sums on a GPU; their
  op names carry no scope, hence the shape). The router's (T, E) top-k
  gradient may scatter."""
  text = _step_text(RECIPES.get(name))
  moved = [(op, ty) for op, ty in float_row_scatters(text)
           if ty.split("x")[-2] == str(HIDDEN)]
  assert not moved, moved
  assert float_row_scatters(text), "the router's top-k gradient is a float scatter: none found"


_ACT_OP = re.compile(r"stablehlo\.(logistic|exponential|tanh|erf)\b.*loc\((#loc\d+)\)\s*$")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_experts_activation_runs_in_the_fused_quantize(sm90_build, name):  # pylint: disable=redefined-outer-name,unused-argument
  """The routed experts' activation runs inside te_jax's activation-quantize
  kernels (te_jax.grouped_mlp): the mode's te_jax_act_quantize_* target in
  the forward and the backward, and no transcendental XLA op under the
  experts' scope (the unfused path's float32 activation and its backward
  were XLA fusions there)."""
  text = _step_text(RECIPES[name])
  mode = {"delayed": "tensorwise", "current": "current", "blockwise": "blockwise"}[name]
  targets = custom_call_targets(text)
  assert targets.count(f"te_jax_act_quantize_{mode}") >= 2, sorted(set(targets))
  names = dict(_LOC_DEF.findall(text))
  in_experts = [m.group(1) for m in map(_ACT_OP.search, text.splitlines())
                if m and f"/{SCOPES['experts']}/" in names.get(m.group(2), "")]
  assert not in_experts, in_experts


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_shared_experts_activation_runs_in_the_fused_quantize(sm90_build, name):  # pylint: disable=redefined-outer-name,unused-argument
  """The shared experts run as one fused FP8 MLP (te_jax.fused_mlp) here
  (unsharded, whole 128-blocks): no transcendental XLA op under the shared
  experts' scope, where the two-dense-layer path's activation and its
  backward were XLA fusions; the activation-quantize targets count the
  shared experts' forward and backward beside the routed experts'."""
  text = _step_text(RECIPES[name])
  mode = {"delayed": "tensorwise", "current": "current", "blockwise": "blockwise"}[name]
  assert custom_call_targets(text).count(f"te_jax_act_quantize_{mode}") >= 4
  names = dict(_LOC_DEF.findall(text))
  in_shared = [m.group(1) for m in map(_ACT_OP.search, text.splitlines())
               if m and f"/{SCOPES['shared']}/" in names.get(m.group(2), "")]
  assert not in_shared, in_shared
