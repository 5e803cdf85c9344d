"""Rematerialization policies on a stack of FP8 TransformerLayers: time and memory.

``te_jax.remat``'s policies save the outputs of te_jax's FP8 GEMMs (CUDA
custom calls, which ``jax.checkpoint_policies.checkpoint_dots`` does not
see). This script times one training step of ``--layers`` causal
TransformerLayers (``bench_layer.py``'s layer: hidden 4096, 32 heads, mlp
16384; 8 x 2048 tokens) with each layer wrapped in ``nn.remat`` under
each policy, and without remat:

* ``none``: no remat (every residual kept);
* ``nothing``: ``nn.remat``'s default (nothing saved; the whole layer
  forward runs again in the backward pass);
* ``dots``: ``jax.checkpoint_policies.checkpoint_dots`` (XLA dots only: in
  an FP8 layer only attention's products, when attention is XLA's);
* ``fp8_gemms``: ``te_jax.remat.checkpoint_fp8_gemms``;
* ``dots_and_fp8_gemms``: ``te_jax.remat.checkpoint_dots_and_fp8_gemms``.

Per policy: ms per step (the protocol of ``bench_layer.py``: FP8 state
carried, 3 warm-ups, ``--k`` steps per timing, median of ``--repeats``),
the compiled step's temporary memory (``memory_analysis()``), and the
number of GEMM custom calls in the compiled step (te_jax's FP8 GEMMs: the
forward GEMMs a policy recomputes show up as extra calls).

  python3 benchmarks/bench_remat.py                 # H200 sizes
  python3 benchmarks/bench_remat.py --small         # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys

POLICIES = ("none", "nothing", "dots", "fp8_gemms", "dots_and_fp8_gemms")


def _policy(name):
  import jax
  from te_jax import remat
  return {"nothing": None, "dots": jax.checkpoint_policies.checkpoint_dots,
          "fp8_gemms": remat.checkpoint_fp8_gemms,
          "dots_and_fp8_gemms": remat.checkpoint_dots_and_fp8_gemms}[name]


def _stack(policy_name, layers, sz):
  import jax.numpy as jnp
  import flax.linen as nn
  from te_jax import flax as tfx
  layer_cls = tfx.TransformerLayer
  if policy_name != "none":
    layer_cls = nn.remat(tfx.TransformerLayer, policy=_policy(policy_name))

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(layers):
        x = layer_cls(sz["hidden"], sz["mlp"], sz["heads"], layer_type="decoder",
                      dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name=f"layer_{i}")(x)
      return x
  return Stack()


def bench(policy_name, recipe_name, layers, sz, k, repeats):
  """{"ms", "times_ms", "temp_mib", "gemm_calls", "dx_abs_max"} of one policy."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  import te_jax
  from bench_layer import recipe_named  # pylint: disable=import-error
  from _fp8_carry import time_steps  # pylint: disable=import-error

  r = recipe_named(recipe_name)
  b, s, e = sz["batch"], sz["seq"], sz["hidden"]
  xs = [jax.random.normal(kx, (b, s, e), jnp.bfloat16)
        for kx in jax.random.split(jax.random.key(1), 2)]
  model = _stack(policy_name, layers, sz)
  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), xs[0]))

    def loss(v, x):
      return jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, xs[0]).compile()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  hlo = compiled.as_text()
  gemm_calls = hlo.count('custom_call_target="te_jax_gemm"')

  times, _, out = time_steps(compiled, variables, xs, k, repeats)
  dx = float(jnp.max(jnp.abs(out[1][1].astype(jnp.float32))))
  return {"ms": statistics.median(times), "times_ms": times,
          "temp_mib": temp / 2**20 if temp is not None else None,
          "gemm_calls": gemm_calls, "dx_abs_max": dx}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--layers", type=int, default=4, help="TransformerLayers in the stack")
  p.add_argument("--recipe", default="delayed", help="off, delayed, current or block")
  p.add_argument("--policies", default=",".join(POLICIES))
  p.add_argument("--k", type=int, default=5, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  args = p.parse_args(argv)
  from bench_layer import environment, sizes  # pylint: disable=import-error
  sz, env = sizes(args.small), environment()
  lines = [f"### te_jax remat policies, {env['date']}, {env['device']}, jax {env['jax']}, "
           f"flax {env['flax']}", "",
           f"{args.layers} TransformerLayers (hidden {sz['hidden']}, mlp {sz['mlp']}, heads "
           f"{sz['heads']}), tokens {sz['batch']}x{sz['seq']}, bf16, recipe {args.recipe}; "
           f"k={args.k}, median of {args.repeats}.", "",
           "| policy | ms / step | vs no remat | temp MiB | GEMM custom calls | max abs dx |",
           "|---|---:|---:|---:|---:|---:|"]
  base, ok = None, True
  for name in [n for n in args.policies.split(",") if n]:
    try:
      res = bench(name, args.recipe, args.layers, sz, args.k, args.repeats)
    except Exception as err:  # pylint: disable=broad-except
      ok = False
      lines.append(f"| {name} | failed: {str(err)[:100]} | | | | |")
      continue
    base = res["ms"] if name == "none" else base
    ratio = f"{res['ms'] / base:.3f}" if base else "-"
    temp = f"{res['temp_mib']:.0f}" if res["temp_mib"] is not None else "n/a"
    lines.append(f"| {name} | {res['ms']:.3f} | {ratio} | {temp} | {res['gemm_calls']} | "
                 f"{res['dx_abs_max']:.3g} |")
    print(f"{name}: {res['ms']:.3f} ms, temp {temp} MiB", file=sys.stderr, flush=True)
  print("\n".join(lines))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
