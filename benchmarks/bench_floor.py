"""The GEMM floor of the layer benchmarks: a step with nothing in it but its matrix products.

``bench_layer.py`` times whole fwd+bwd steps. This script times, under the
same protocol, one jitted program per configuration that runs *only* the
matrix products of such a step, on operands prepared beforehand:

* ``mlp``: the six GEMMs of LayerNormMLP 4096 -> 16384 -> 4096 (fprop,
  dgrad and wgrad of both dense layers), 16384 tokens;
* ``layer``: those six, the six of the attention projections (fused Q/K/V
  4096 -> 3 x 4096 and the output 4096 -> 4096) and the causal attention
  core forward and backward (``jax.nn.dot_product_attention``, bf16, cuDNN on
  GPU as in the module) -- every matrix product of a TransformerLayer step.

Each in four precisions: ``bf16`` (``lax.dot_general`` in bf16 with fp32
accumulation, as the FP8-off modules run), ``fp8`` (per-tensor E4M3/E5M2
with the recipes' default accumulation: fast for fprop, split for dgrad and
wgrad), ``fp8_fastacc`` (fast accumulation in all three) and ``block``
(1x128 activation and gradient tiles, 128x128 weight blocks). FP8 operands
are te_jax's own quantizations of N(0, 1) data (activations, weights and
gradients alike: after scaling, the FP8 bit patterns a GEMM sees are those of
a tensor of any magnitude), and the GEMMs run through ``te_jax.ops.gemm``,
the op the layers call.

What it is for: a step can be no faster than the matrix products in it, so
``(FP8-off step) / (FP8 GEMM floor)`` bounds the speed-up any FP8 step can
show against that FP8-off step, before a single LayerNorm, activation or
quantization runs. With ``--layer-json`` (a ``bench_layer.py --json-out``
file, best from the same device call) the table also says, for each target
ratio, how many milliseconds per step it leaves for all non-GEMM work.

Caveat, stated where the figures are used: on the H200 the timed steps run
against the board power cap (BENCHMARKS.md run J), and a program of nothing
but GEMMs draws more power than a step whose GEMMs alternate with
memory-bound kernels, so its GEMMs may run at lower clocks than those of a
real step. The floor is then a little pessimistic for the GEMMs' share, not
a strict bound. The other side: a ``bench_layer.py --profile`` trace gives
the time of the GEMM kernels inside the real step (``gemm_kernel_ms``); with
such a ``--layer-json`` the table shows it and what it leaves too.

Usage::

  python benchmarks/bench_floor.py                  # full sizes (H200)
  python benchmarks/bench_floor.py --small          # tiny sizes, CPU smoke test
  python benchmarks/bench_floor.py --layer-json layer.json --targets mlp/te_delayed=1.9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from te_jax import recipe as recipe_lib

if __package__:  # imported as benchmarks.bench_floor
  from .bench_layer import sizes
else:            # run by path (this folder is sys.path[0]) or imported as bench_floor
  from bench_layer import sizes  # pylint: disable=import-error

GROUPS = ("mlp", "layer")
PRECISIONS = ("bf16", "fp8", "fp8_fastacc", "block")
# The targets (issue 4), as "<bench_layer config>=<ratio vs FP8 off>".
DEFAULT_TARGETS = ("mlp/te_delayed=1.9", "mlp/te_current=1.65", "mlp/te_block=1.45",
                   "layer/te_delayed=1.7", "layer/te_current=1.45", "layer/te_block=1.35")
# Which GEMM floor a bench_layer config is bounded by.
FLOOR_OF = {"te_delayed": "fp8", "te_current": "fp8", "te_block": "block",
            "te_delayed_fastacc": "fp8_fastacc", "te_current_fastacc": "fp8_fastacc"}


def dense_shapes(group, sz):
  """(K, N) of each dense layer of one step of ``group``: y (T, N) = x (T, K) @ w (K, N)."""
  e, m = sz["hidden"], sz["mlp"]
  shapes = [(e, m), (m, e)]
  if group == "layer":
    shapes += [(e, 3 * e), (e, e)]
  return shapes


def _recipe(precision):
  if precision == "block":
    return recipe_lib.Float8BlockScaling()
  fast = precision == "fp8_fastacc"
  # Current and delayed scaling run the same GEMMs; current scaling prepares
  # the operands here without a state to carry.
  return recipe_lib.Float8CurrentScaling(fast_accum_fprop=True, fast_accum_dgrad=fast,
                                         fast_accum_wgrad=fast)


def _scaling_mode(precision):
  """The FP8 dense layers' scaling protocol for ``precision`` (None: bf16)."""
  if precision == "bf16":
    return None
  return _recipe(precision).scaling_mode()


def _quantize_pair(mode, a, role):
  """(rowwise, columnwise) ScaledTensors of ``a`` as the FP8 dense quantizes it."""
  q = mode.quantize(a, role)
  return q.rowwise(), q.columnwise()


def make_operands(group, precision, sz, seed):
  """One input set: per dense layer (x, w, g) -- bf16 arrays, or for FP8 the
  (rowwise, columnwise) ScaledTensor pairs the three GEMMs read -- and, for
  the layer, the attention core's (q, k, v, dout)."""
  t = sz["batch"] * sz["seq"]
  keys = iter(jax.random.split(jax.random.key(seed), 32))
  normal = lambda shape: jax.random.normal(next(keys), shape, jnp.bfloat16)
  mode = _scaling_mode(precision)
  layers = []
  for k, n in dense_shapes(group, sz):
    x, w, g = normal((t, k)), normal((k, n)), normal((t, n))
    if mode is not None:
      x, w, g = (_quantize_pair(mode, x, "x"), _quantize_pair(mode, w, "kernel"),
                 _quantize_pair(mode, g, "grad"))
    layers.append((x, w, g))
  core = None
  if group == "layer":
    b, s, h = sz["batch"], sz["seq"], sz["heads"]
    core = tuple(normal((b, s, h, sz["hidden"] // h)) for _ in range(4))
  return jax.block_until_ready((layers, core))


def make_step(precision):
  """``step(operands) -> outputs``: every GEMM of the step, nothing else."""
  mode = _scaling_mode(precision)
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"

  def bf16_dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32
                           ).astype(jnp.bfloat16)

  def step(operands):
    layers, core = operands
    out = []
    for x, w, g in layers:
      if mode is None:
        out += [bf16_dot(x, w, ((1,), (0,))),      # fprop  y  = x @ w
                bf16_dot(g, w, ((1,), (1,))),      # dgrad  dx = g @ w.T
                bf16_dot(x, g, ((0,), (0,)))]      # wgrad  dw = x.T @ g
      else:
        (qx, qx_t), (qw, qw_t), (qg, qg_t) = x, w, g
        out += [mode.gemm("fprop", qx, qw_t, out_dtype=jnp.bfloat16),
                mode.gemm("dgrad", qg, qw, out_dtype=jnp.bfloat16),
                mode.gemm("wgrad", qx_t, qg_t, out_dtype=jnp.bfloat16)]
    if core is not None:
      q, k, v, dout = core
      attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation=impl)
      o, vjp = jax.vjp(attn, q, k, v)
      out += [o, *vjp(dout)]
    return out
  return jax.jit(step)


def gemm_flops(group, sz):
  t = sz["batch"] * sz["seq"]
  flops = sum(3 * 2 * t * k * n for k, n in dense_shapes(group, sz))
  if group == "layer":     # causal core: half of 4*b*s*s*e forward, x3 fwd+bwd
    flops += 3 * 2 * sz["batch"] * sz["seq"] ** 2 * sz["hidden"]
  return flops


def time_floor(group, precision, sz, k, repeats):
  """Median ms per step over ``repeats`` timings of ``k`` back-to-back steps
  (3 warm-up steps first; two input sets alternate so neither sits in L2)."""
  step = make_step(precision)
  inputs = [make_operands(group, precision, sz, seed) for seed in (0, 1)]
  out = None
  for i in range(3):
    out = step(inputs[i % 2])
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    out = None
    t0 = time.perf_counter()
    for i in range(k):
      out = step(inputs[i % 2])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / k * 1e3)
  ms = statistics.median(times)
  return {"group": group, "precision": precision, "ms": ms, "times_ms": times,
          "tflops": gemm_flops(group, sz) / (ms * 1e-3) / 1e12}


def parse_targets(items):
  targets = {}
  for item in items:
    name, sep, ratio = item.partition("=")
    group, _, kind = name.partition("/")
    if not sep or group not in GROUPS or kind not in FLOOR_OF:
      raise ValueError(f"target {item!r}: expected <group>/<config>=<ratio> with group in "
                       f"{GROUPS} and config in {sorted(FLOOR_OF)}, e.g. mlp/te_delayed=1.9.")
    targets[name] = float(ratio)
  return targets


def budget_rows(floors, layer, targets):
  """Per target: the FP8-off step, the target's step time, the GEMM floor it
  must contain, the bound on the ratio, and what the target leaves for the
  rest of the step (negative: the GEMMs alone exceed the target's time).

  ``floors`` maps (group, precision) -> ms; ``layer`` maps bench_layer
  config -> its result (``ms``, and with ``--profile`` ``gemm_kernel_ms``,
  the GEMM kernels' time inside the traced step); its ``<group>/te_off`` row
  is the baseline."""
  rows = []
  for name, ratio in targets.items():
    group, kind = name.split("/")
    off, floor = layer.get(f"{group}/te_off"), floors.get((group, FLOOR_OF[kind]))
    if off is None or floor is None:
      continue
    need = off["ms"] / ratio
    measured = layer.get(name, {})
    step_gemm = measured.get("gemm_kernel_ms")
    rows.append({"target": name, "ratio": ratio, "off_ms": off["ms"], "need_ms": need,
                 "floor": FLOOR_OF[kind], "floor_ms": floor, "bound": off["ms"] / floor,
                 "left_ms": need - floor, "measured_ms": measured.get("ms"),
                 "step_gemm_ms": step_gemm,
                 "left_step_ms": None if step_gemm is None else need - step_gemm})
  return rows


def table(results, rows, sz):
  lines = [f"GEMM floor: tokens {sz['batch']}x{sz['seq']}, hidden {sz['hidden']}, mlp "
           f"{sz['mlp']}, heads {sz['heads']}; only the step's matrix products.", "",
           "| group | precision | ms / step | TFLOP/s |", "|---|---|---:|---:|"]
  lines += [f"| {r['group']} | {r['precision']} | {r['ms']:.3f} | {r['tflops']:.0f} |"
            for r in results]
  if rows:
    lines += ["", "| target | FP8-off step ms | target step ms | GEMM floor ms | ratio bound "
              "| ms left for non-GEMM work | measured step ms (ratio) | its GEMM kernels ms "
              "(ms left) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
      meas = "-" if r["measured_ms"] is None else \
          f"{r['measured_ms']:.3f} ({r['off_ms'] / r['measured_ms']:.2f}x)"
      step = "-" if r["step_gemm_ms"] is None else \
          f"{r['step_gemm_ms']:.3f} ({r['left_step_ms']:.3f})"
      lines.append(f"| {r['target']} >= {r['ratio']}x | {r['off_ms']:.3f} | {r['need_ms']:.3f} "
                   f"| {r['floor_ms']:.3f} ({r['floor']}) | {r['bound']:.2f}x "
                   f"| {r['left_ms']:.3f} | {meas} | {step} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--groups", default=",".join(GROUPS))
  p.add_argument("--precisions", default=",".join(PRECISIONS))
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  p.add_argument("--layer-json", help="bench_layer.py --json-out file with the step times")
  p.add_argument("--targets", nargs="*", default=list(DEFAULT_TARGETS))
  p.add_argument("--json-out", help="also write the results to this JSON file")
  args = p.parse_args(argv)
  targets = parse_targets(args.targets)
  groups = [g for g in args.groups.split(",") if g]
  precisions = [q for q in args.precisions.split(",") if q]
  for name, values, allowed in (("groups", groups, GROUPS),
                                ("precisions", precisions, PRECISIONS)):
    bad = [v for v in values if v not in allowed]
    if bad:
      p.error(f"unknown {name} {bad}; known: {allowed}")

  sz = sizes(args.small)
  results = []
  for group in groups:
    for precision in precisions:
      res = time_floor(group, precision, sz, args.k, args.repeats)
      print(f"{group}/{precision}: {res['ms']:.3f} ms", file=sys.stderr, flush=True)
      results.append(res)
  rows = []
  if args.layer_json:
    with open(args.layer_json) as f:
      layer = json.load(f)
    rows = budget_rows({(r["group"], r["precision"]): r["ms"] for r in results},
                       {r["config"]: r for r in layer["results"] if "ms" in r}, targets)
  print(table(results, rows, sz))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump({"results": results, "budget": rows,
                 "device": getattr(jax.devices()[0], "device_kind", "?")}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
