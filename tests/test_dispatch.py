"""impl="auto" and the platform a computation is compiled for (_native.dispatch).

On a GPU machine with the CUDA module built, "auto" stages the custom calls
and the pure-JAX reference side by side (``jax.lax.platform_dependent``);
lowering keeps the custom calls for a GPU and the reference for the CPU. The
CPU tests stand in for such a machine by making ``resolve_impl`` answer
"cuda" for "auto" (``gpu_host``), then lower the same step for both
platforms: the CPU program must be the reference path exactly, the GPU
program must hold the te_jax custom calls and no reference arithmetic
branch. (On the H200 the same is checked with real CPU arrays:
tests/test_gpu_flax.py::test_cpu_arrays_on_gpu_host.)
"""

import os
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import fp8_state
from te_jax import fused_mlp
from te_jax import recipe as recipe_lib
from te_jax.ops import _native
from cuda_lowering import gpu_host  # pylint: disable=unused-import  (a fixture)

RECIPES = {"delayed": recipe_lib.DelayedScaling, "current": recipe_lib.Float8CurrentScaling,
           "block": recipe_lib.Float8BlockScaling}
M, K, F = 128, 256, 384


def _operands():
  """x, wi, wo on the CPU (also on a GPU machine: the CPU program is tested)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K))
  wi = rng.standard_normal((K, F)) * K ** -0.5
  wo = rng.standard_normal((F, K)) * F ** -0.5
  return jax.device_put(tuple(jnp.asarray(a, jnp.bfloat16) for a in (x, wi, wo)),
                        jax.devices("cpu")[0])


def _step(name, impl="auto"):
  """fwd+bwd of an FP8 dense followed by the fused FP8 MLP (every op kind:
  quantize, act_quantize, dact_quantize, GEMM)."""
  r = RECIPES[name]()
  delayed = name == "delayed"
  st = [fp8_state.init_dense_state(r.amax_history_len) if delayed else None for _ in "123"]

  def loss(x, wi, wo):
    y = dense_lib.fp8_dense(x, wi[:, :K], recipe=r, fp8_state=st[0], impl=impl)
    z = fused_mlp.fp8_mlp(y, wi, wo, activations=("gelu",), recipe=r, wi_state=st[1],
                          wo_state=st[2], impl=impl)
    return jnp.sum(jnp.square(z.astype(jnp.float32)))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _custom_calls(text):
  return {t for t in ("te_jax_gemm", "te_jax_quantize", "te_jax_act_quantize") if t in text}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_auto_on_gpu_host_lowers_per_platform(gpu_host, name):  # pylint: disable=unused-argument
  args = _operands()
  traced = jax.jit(_step(name)).trace(*args)
  assert "platform_index" in str(traced.jaxpr)       # both paths were staged
  gpu_text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert _custom_calls(gpu_text) == {"te_jax_gemm", "te_jax_quantize", "te_jax_act_quantize"}
  cpu = jax.jit(_step(name)).lower(*args).compile()
  assert not _custom_calls(cpu.as_text())
  # The CPU program is the reference path: the same numbers, bit for bit.
  got = cpu(*args)
  want = jax.jit(_step(name, impl="reference"))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert float(jnp.abs(got[1][0]).max()) > 0      # a real step: gradients reach x


def test_reference_is_never_staged(gpu_host, monkeypatch):  # pylint: disable=unused-argument
  args = _operands()
  traced = jax.jit(_step("current", impl="reference")).trace(*args)
  assert "platform_index" not in str(traced.jaxpr)
  assert not _custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text())
  monkeypatch.setenv("TE_JAX_IMPL", "reference")   # "auto" under the env variable
  assert "platform_index" not in str(jax.jit(_step("current")).trace(*args).jaxpr)


def test_auto_without_gpu_is_the_reference_alone(monkeypatch):
  monkeypatch.delenv("TE_JAX_IMPL", raising=False)
  if _native.cuda_available():
    pytest.skip("a GPU with the module: 'auto' stages both paths here")
  traced = jax.jit(_step("delayed")).trace(*_operands())
  assert "platform_index" not in str(traced.jaxpr)


def test_impl_errors(monkeypatch):
  with pytest.raises(ValueError, match="impl must be one of"):
    _native.dispatch("gpu", lambda: 0, lambda: 1)
  monkeypatch.setenv("TE_JAX_IMPL", "fast")
  with pytest.raises(ValueError, match="TE_JAX_IMPL must be"):
    _native.dispatch("auto", lambda: 0, lambda: 1)
  monkeypatch.setenv("TE_JAX_IMPL", "reference")
  assert _native.dispatch("auto", lambda: 0, lambda: 1) == 1
  if not _native.cuda_available():
    monkeypatch.delenv("TE_JAX_IMPL")
    with pytest.raises(RuntimeError, match="impl='cuda' was requested"):
      _native.dispatch("cuda", lambda: 0, lambda: 1)


def environment_variables(sources):
  """Names of the environment variables read in ``sources`` ({path: text}):
  ``os.environ.get("X"`` / ``os.environ["X"]`` / ``os.getenv("X"`` in Python,
  ``std::getenv("X")`` / ``getenv("X")`` in C++."""
  pattern = re.compile(r"""(?:os\.environ(?:\.get)?|os\.getenv|getenv)[(\[]\s*["'](\w+)["']""")
  return {name for text in sources.values() for name in pattern.findall(text)}


def _library_sources():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = {}
  for sub, exts in (("te_jax", (".py",)), ("custom_calls", (".cc", ".cu", ".h", ".cuh"))):
    for dirpath, _, files in os.walk(os.path.join(root, sub)):
      for f in files:
        if f.endswith(exts):
          with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
            out[os.path.join(dirpath, f)] = fh.read()
  return out


def test_native_docstring_lists_every_environment_variable():
  names = environment_variables(_library_sources())
  assert "TE_JAX_IMPL" in names and len(names) >= 4
  doc = _native.__doc__
  missing = sorted(n for n in names if f"``{n}``" not in doc)
  assert not missing, f"read but not listed in te_jax/ops/_native.py's docstring: {missing}"
  # the check sees a variable added in Python or C++
  assert environment_variables({"a.py": 'os.environ.get("TE_JAX_NEW", "")',
                                "b.h": 'std::getenv("TE_JAX_OTHER")'}) == {
                                    "TE_JAX_NEW", "TE_JAX_OTHER"}


def test_missing_module_reason_quotes_the_build_note(tmp_path, monkeypatch):
  """Without the native module, the reason te_jax logs on a GPU names what the
  build recorded (which toolkit, or why no kernels were built)."""
  from te_jax.ops import _native
  pkg = tmp_path / "te_jax"
  (pkg / "ops").mkdir(parents=True)
  (pkg / "_te_jax_ffi_build.txt").write_text("te_jax: not built: no CUDA compiler found\n")
  monkeypatch.setattr(_native, "__file__", str(pkg / "ops" / "_native.py"))
  assert _native.build_note() == "te_jax: not built: no CUDA compiler found"
  if _native._load_native()[0] is None:     # no module here: the reason quotes the note
    assert "no CUDA compiler found" in _native._load_native.__wrapped__()[1]
  (pkg / "_te_jax_ffi_build.txt").unlink()
  assert _native.build_note() == ""
