"""The FP8 dense on the CUDA path: same answers as the reference, clean HLO.

Runs only where the CUDA custom calls are built and a GPU is present.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import dense, fp8_state, recipe

pytestmark = pytest.mark.gpu

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "blockwise": recipe.Float8BlockScaling(),
}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _setup(name, m=1024, k=512, n=768, dtype=jnp.bfloat16):
  r = RECIPES[name]
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k1, (m, k), dtype)
  w = (jax.random.normal(k2, (k, n)) * k ** -0.5).astype(dtype)
  g = jax.random.normal(k3, (m, n), dtype)
  st = None
  if isinstance(r, recipe.DelayedScaling):
    st = fp8_state.init_dense_state(r.amax_history_len)
    st = jax.grad(lambda s: jnp.sum(dense.fp8_dense(x, w, recipe=r, fp8_state=s,
                                                    impl="reference")))(st)
  return r, x, w, g, st


def _fwd_bwd(r, x, w, g, st, impl):
  def f(x, w, st):
    return dense.fp8_dense(x, w, recipe=r, fp8_state=st, impl=impl)
  y, vjp = jax.vjp(f, x, w, st)
  return (y,) + vjp(g)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m", [1024, 1000])
def test_cuda_dense_matches_reference(name, m):
  r, x, w, g, st = _setup(name, m=m)
  got = jax.jit(lambda *a: _fwd_bwd(r, *a, impl="cuda"))(x, w, g, st)
  # The reference runs on the CPU: XLA:GPU's float32 division is not
  # correctly rounded, which moves scales by an ulp and flips FP8 roundings.
  cpu = jax.devices("cpu")[0]
  want = jax.jit(lambda *a: _fwd_bwd(r, *a, impl="reference"))(
      *jax.device_put((x, w, g, st), cpu))
  # Quantization is bit-exact; the GEMMs differ from the reference only in
  # accumulation order (and fast accumulation in fprop for per-tensor
  # recipes) and the final bf16 rounding (2**-9 relative).
  for a, b in zip(got[:3], want[:3]):
    assert _rel(a, b) < 1e-2
  if st is not None:
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3])):
      np.testing.assert_allclose(a, b, rtol=1e-6)


_F8_OUT = re.compile(r"= f8e\w+\[[^\]]*\]\{?[^ ]*\s+(transpose|convert|copy)\(")
_F8_IN = re.compile(r"\b(transpose|convert|copy)\(f8e")


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_hlo_uses_custom_calls_and_no_xla_fp8_casts(name):
  r, x, w, g, st = _setup(name, m=2048, k=1024, n=2048)
  hlo = jax.jit(lambda *a: _fwd_bwd(r, *a, impl="cuda")).lower(
      x, w, g, st).compile().as_text()
  assert hlo.count('custom_call_target="te_jax_gemm"') == 3
  assert 'custom_call_target="te_jax_quantize' in hlo
  bad = [l.strip() for l in hlo.splitlines() if _F8_OUT.search(l) or _F8_IN.search(l)]
  assert not bad, "XLA transposes or converts FP8 operands:\n" + "\n".join(bad[:5])
