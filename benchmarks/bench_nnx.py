"""NNX vs Linen step time: the same layer, the same parameters, one process.

``te_jax.nnx`` modules run the functional layer the Linen modules run, so a
training step should take the same time in both APIs. This script times,
for LayerNormMLP and TransformerLayer at ``bench_layer.py``'s sizes and for
each recipe:

* Linen: ``jax.jit(jax.value_and_grad(loss, argnums=(variables, x)))``, the
  delayed-scaling collection replaced by its gradient after each step (as
  ``bench_layer.py`` does);
* NNX: one ``nnx.jit`` step of ``nnx.value_and_grad(loss, argnums=
  (te_jax.nnx.diff_state(0), 1))`` followed by
  ``te_jax.nnx.apply_fp8_updates(model, grads)`` (the documented NNX loop,
  its run-time "state advanced" check included), returning the gradients
  as the Linen step does,

with the NNX model loaded from the Linen variables (``load_linen_variables``).
Loss ``mean(y**2)``; 3 warm-up steps, then ``--repeats`` timings of ``--k``
back-to-back steps, Linen and NNX alternating; median. Prints one markdown
table (ms per step, NNX / Linen) and max |dx| of both (0 would mean a frozen
state).

  python3 benchmarks/bench_nnx.py                 # H200 sizes
  python3 benchmarks/bench_nnx.py --small         # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

RECIPES = ("off", "delayed", "current", "block")
GROUPS = ("mlp", "layer")


def _modules(group, sz):
  """(Linen module, function building the NNX twin) of ``group``."""
  import jax.numpy as jnp
  from flax import nnx
  from te_jax import flax as tfx, nnx as tnx
  bf16 = jnp.bfloat16
  e, m, h = sz["hidden"], sz["mlp"], sz["heads"]
  kw = dict(dtype=bf16, param_dtype=bf16)
  if group == "mlp":
    return (tfx.LayerNormMLP(intermediate_dim=m, activations=("gelu",), **kw),
            lambda: tnx.LayerNormMLP(e, m, activations=("gelu",), rngs=nnx.Rngs(0), **kw))
  return (tfx.TransformerLayer(e, m, h, layer_type="decoder", **kw),
          lambda: tnx.TransformerLayer(e, m, h, layer_type="decoder", rngs=nnx.Rngs(0), **kw))


def _time_ms(run, k):
  """(time of ``run(k)`` until its result is ready) / k, in ms."""
  import jax
  t0 = time.perf_counter()
  jax.block_until_ready(run(k))
  return (time.perf_counter() - t0) / k * 1e3


def bench(group, recipe_name, sz, k, repeats):
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from flax import nnx
  import te_jax
  from te_jax import nnx as tnx
  from bench_layer import recipe_named  # pylint: disable=import-error
  from _fp8_carry import (WARMUP_STEPS, carry_fp8_state,  # pylint: disable=import-error
                          run_steps)

  r = recipe_named(recipe_name)
  b, s, e = sz["batch"], sz["seq"], sz["hidden"]
  xs = [jax.random.normal(kx, (b, s, e), jnp.bfloat16)
        for kx in jax.random.split(jax.random.key(1), 2)]

  def loss_of(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    linen, make_nnx = _modules(group, sz)
    variables = nn.unbox(jax.jit(linen.init)(jax.random.key(0), xs[0]))
    model = make_nnx()
    tnx.load_linen_variables(model, variables)

    linen_step = jax.jit(jax.value_and_grad(
        lambda v, x: loss_of(linen.apply(v, x)), argnums=(0, 1)))

    @nnx.jit
    def nnx_step(model, x):
      loss, (grads, dx) = nnx.value_and_grad(
          lambda mdl, x: loss_of(mdl(x)), argnums=(tnx.diff_state(0), 1))(model, x)
      tnx.apply_fp8_updates(model, grads)
      # Linen's output layout. The gradients are returned, as Linen's step
      # returns them: else XLA drops the weight-gradient GEMMs nothing reads.
      return loss, (grads, dx)

    # (step, carry) per API; the NNX model carries its own state in place.
    steps = {"linen": (linen_step, carry_fp8_state),
             "nnx": (lambda _, x: nnx_step(model, x), lambda v, g: v)}
    live, last = {"linen": variables, "nnx": None}, {}

    def run(name, n):
      step, carry = steps[name]
      live[name], last[name] = run_steps(step, live[name], xs, n, carry)
      return last[name]

    jax.block_until_ready([run(name, WARMUP_STEPS) for name in steps])  # compile, warm up
    times = {name: [] for name in steps}
    for _ in range(repeats):
      for name in steps:           # alternating, so drift hits both alike
        times[name].append(_time_ms(functools.partial(run, name), k))
  dx = {name: float(jnp.max(jnp.abs(out[1][1].astype(jnp.float32))))
        for name, out in last.items()}
  return {name: statistics.median(t) for name, t in times.items()}, times, dx


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--groups", default=",".join(GROUPS), help="mlp,layer")
  p.add_argument("--recipes", default=",".join(RECIPES), help="off,delayed,current,block")
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings of each API; the median is kept")
  p.add_argument("--no-state-check", action="store_true",
                 help="diagnostic: NNX modules without their run-time 'FP8 state advanced' "
                      "check (te_jax.nnx.state.track_updates replaced by a no-op), to see "
                      "what the check costs")
  args = p.parse_args(argv)
  if args.no_state_check:
    from te_jax.nnx import state as nnx_state
    nnx_state.track_updates = lambda module, kernel: None
  from bench_layer import environment, sizes  # pylint: disable=import-error
  sz = sizes(args.small)
  env = environment()
  lines = [f"### te_jax NNX vs Linen, {env['date']}, {env['device']}, jax {env['jax']}, "
           f"flax {env['flax']}", "",
           f"Tokens {sz['batch']}x{sz['seq']}, hidden {sz['hidden']}, mlp {sz['mlp']}, heads "
           f"{sz['heads']}, bf16; k={args.k} steps, median of {args.repeats}, alternating"
           + ("; NNX without its state check (diagnostic)." if args.no_state_check else "."),
           "", "| block | recipe | Linen ms | NNX ms | NNX / Linen | max abs dx Linen / NNX |",
           "|---|---|---:|---:|---:|---:|"]
  ok = True
  for group in [g for g in args.groups.split(",") if g]:
    for rn in [r for r in args.recipes.split(",") if r]:
      try:
        ms, _, dx = bench(group, rn, sz, args.k, args.repeats)
      except Exception as err:  # pylint: disable=broad-except
        ok = False
        lines.append(f"| {group} | {rn} | failed: {str(err)[:100]} | | | |")
        print(f"{group}/{rn}: FAILED {err}", file=sys.stderr, flush=True)
        continue
      lines.append(f"| {group} | {rn} | {ms['linen']:.3f} | {ms['nnx']:.3f} | "
                   f"{ms['nnx'] / ms['linen']:.3f} | {dx['linen']:.3g} / {dx['nnx']:.3g} |")
      print(f"{group}/{rn}: Linen {ms['linen']:.3f} ms, NNX {ms['nnx']:.3f} ms",
            file=sys.stderr, flush=True)
  print("\n".join(lines))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
