"""How far ``store_act_input_in_fp8`` moves the fused MLP's gradients.

The option keeps the activation's input h in E4M3 (1x128 tiles) for the
backward instead of bf16, so the gradients differ from the default's by
that rounding. This script measures by how much, against what FP8 already
does to them: for each recipe it computes the gradients of
``sum(fp8_mlp(x) * g)`` (SwiGLU, Llama-like widths) with and without the
option and prints each gradient's relative error against the float32
reference MLP (``act(x @ wi) @ wo`` in float32, no FP8):

    rel_err = ||grad - grad_f32|| / ||grad_f32||    (Frobenius norms)

and the option's own distance from the default, on the same scale. If the
option's errors are at the default's, E4M3 h is lost in the noise FP8
already adds; a kernel bug (a wrong scale, a misread tile) shows as a
relative error near 1.

Delayed scaling runs two calls first, so its scales come from real amaxes.

    python3 benchmarks/act_input_accuracy.py                  # GPU: the CUDA kernels
    python3 benchmarks/act_input_accuracy.py --small          # CPU: the references
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import fp8_state, fused_mlp
from te_jax.ops import act_quantize as act_op

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_gpt import make_recipe  # pylint: disable=import-error,wrong-import-position

ACTS = ("silu", "linear")
RECIPES = ("delayed", "current", "blockwise")


def operands(m: int, k: int, f: int, seed: int = 0):
  """x (M, K) bf16, wi (K, 2F) and wo (F, K) float32 (1/sqrt(fan-in)
  scaled), and the output cotangent g (M, K) float32."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  wi = jnp.asarray(rng.standard_normal((k, 2 * f)) / np.sqrt(k), jnp.float32)
  wo = jnp.asarray(rng.standard_normal((f, k)) / np.sqrt(f), jnp.float32)
  g = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  return x, wi, wo, g


def reference_grads(x, wi, wo, g):
  """(dx, dwi, dwo) of the float32 MLP without FP8."""
  def loss(x, wi, wo):
    h = x.astype(jnp.float32) @ wi
    z = act_op.activation_forward(h, ACTS)
    return jnp.sum((z @ wo) * g)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, wi, wo)


def fp8_grads(recipe_name: str, store: bool, x, wi, wo, g):
  """(dx, dwi, dwo) of ``fused_mlp.fp8_mlp`` under the recipe."""
  recipe = make_recipe(recipe_name)
  delayed = recipe_name == "delayed"
  states = (fp8_state.init_dense_state(recipe.amax_history_len),
            fp8_state.init_dense_state(recipe.amax_history_len)) \
      if delayed else (None, None)

  @jax.jit
  def step(x, wi, wo, states):
    def loss(x, wi, wo, states):
      y = fused_mlp.fp8_mlp(x, wi, wo, activations=ACTS, recipe=recipe, wi_state=states[0],
                            wo_state=states[1], store_act_input_in_fp8=store)
      return jnp.sum(y.astype(jnp.float32) * g)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wi, wo, states)

  for _ in range(2 if delayed else 0):   # the state's updates come back as its gradient
    states = step(x, wi, wo, states)[3]
  return step(x, wi, wo, states)[:3]


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def measure(m: int, k: int, f: int, recipes=RECIPES):
  """Rows: dict(recipe, grad, default, stored, stored_vs_default)."""
  x, wi, wo, g = operands(m, k, f)
  ref = reference_grads(x, wi, wo, g)
  rows = []
  for name in recipes:
    default = fp8_grads(name, False, x, wi, wo, g)
    stored = fp8_grads(name, True, x, wi, wo, g)
    for grad, r, d, s in zip(("dx", "dwi", "dwo"), ref, default, stored):
      rows.append(dict(recipe=name, grad=grad, default=rel(d, r), stored=rel(s, r),
                       stored_vs_default=rel(s, d)))
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--small", action="store_true", help="CPU-sized shapes")
  p.add_argument("--recipes", default=",".join(RECIPES))
  args = p.parse_args(argv)
  m, k, f = (256, 128, 256) if args.small else (8192, 2048, 5632)
  recipes = tuple(r for r in args.recipes.split(",") if r)
  for r in recipes:
    if r not in RECIPES:
      p.error(f"--recipes: unknown recipe {r!r}; choose from {RECIPES}")
  print(f"backend {jax.default_backend()}, M={m} K={k} F={f}, SwiGLU, {jax.devices()[0]}")
  rows = measure(m, k, f, recipes)
  print("| recipe | grad | rel. error, h in bf16 | rel. error, h in E4M3 | E4M3 vs bf16 h |")
  print("|---|---|---:|---:|---:|")
  for r in rows:
    print(f"| {r['recipe']} | {r['grad']} | {r['default']:.3e} | {r['stored']:.3e} | "
          f"{r['stored_vs_default']:.3e} |")
  print("JSON " + json.dumps(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
