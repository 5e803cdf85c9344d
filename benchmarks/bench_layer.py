"""Layer benchmarks of te_jax.flax: LayerNormMLP and TransformerLayer, fwd+bwd.

Each configuration runs in a fresh subprocess of this script (``--config
NAME``), so that its peak device memory (``memory_stats()["peak_bytes_in_use"]``)
is its own; the parent collects one JSON line per configuration and prints a
markdown table for BENCHMARKS.md.

(a) LayerNormMLP 4096 -> 16384 -> 4096, gelu, 16384 tokens (8 x 2048), bf16
    params and activations: te_jax with FP8 off / DelayedScaling /
    Float8CurrentScaling / Float8BlockScaling, the same block built from
    flax.linen LayerNorm + Dense with Flax's FP8 op
    (``dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, or
    ``Fp8DotGeneralOp`` where the direct op does not exist: the label says
    which), and plain bf16 flax.
(b) TransformerLayer (hidden 4096, 32 heads, mlp 16384, causal decoder) for
    each recipe vs FP8 off, plus the attention core alone
    (``jax.nn.dot_product_attention`` fwd+bwd, same implementation choice as
    the module) and the whole MultiHeadAttention module with FP8 off and
    under each recipe (``attn/te_<recipe>``, ratios against ``attn/module_off``);
    a last table splits each layer step into MLP block, attention core,
    attention projections and the rest, from those rows (``step_shares``).

Timed step: ``jit(value_and_grad(loss, argnums=(params, input)))`` with loss
``mean(y**2)`` in fp32, the delayed-scaling state carried from each step to
the next as in training (``_fp8_carry.py``; a config name ending in
``_frozen`` times the initial state every step instead, which makes the
backward GEMMs multiply zeros). Protocol: 3 warmup steps, then k
back-to-back steps with one block at the end (inputs rotated between two
buffers), time / k; median of ``--repeats`` such measurements. FLOP counts
are the matmul FLOPs of fwd+bwd (3x forward).

Name suffixes: ``_unfused`` sets ``fuse_activation_quantize=False`` (the
modules' default is the fused MLP core); ``_xlanorm`` sets
``fuse_norm_quantize=False`` (XLA's LayerNorm before the fused core instead
of the norm + quantize kernels; with ``te_off``, XLA's norm instead of te_jax's
unquantized norm kernels); ``_fastacc`` turns on fast
accumulation in all three GEMMs (TE-JAX's default, not ours); ``_noguard``
sets ``DelayedScaling(outlier_factor=None)`` (no outlier guard, TE's rule);
``_keep`` keeps the fused norm and MLP layers' FP8 copies of their inputs and
kernels for the backward instead of quantizing again there
(the autocast's ``keep_fp8_copies=True``: the residual plan before the memory work;
on a te_jax that predates the choice, what it always did); ``_packed``
feeds the TransformerLayer packed rows (``segment_ids``: documents of 700,
500, 400, 300 and 148 tokens in a row-dependent order, the last row ending
in 148 tokens of padding), which on GPU run in cuDNN's packed layout;
``_packed_xla`` the same rows with ``attention_impl="xla"`` (masked XLA
attention, the only packed path before 2026-12-01).

Usage::

  python benchmarks/bench_layer.py                # full sizes (H200)
  python benchmarks/bench_layer.py --small        # tiny sizes, CPU smoke test
  python benchmarks/bench_layer.py --config mlp/te_block --small   # one config
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys

MLP_CONFIGS = ["mlp/te_off", "mlp/te_delayed", "mlp/te_current", "mlp/te_block",
               "mlp/flax_fp8", "mlp/flax_bf16", "mlp/te_delayed_unfused",
               "mlp/te_current_unfused", "mlp/te_block_unfused", "mlp/te_delayed_fastacc",
               "mlp/te_current_fastacc", "mlp/te_delayed_xlanorm", "mlp/te_current_xlanorm",
               "mlp/te_block_xlanorm", "mlp/te_delayed_noguard", "mlp/te_off_xlanorm"]
LAYER_CONFIGS = ["layer/te_off", "layer/te_delayed", "layer/te_current", "layer/te_block",
                 "layer/te_delayed_unfused", "layer/te_current_unfused",
                 "layer/te_block_unfused", "layer/te_delayed_fastacc",
                 "layer/te_current_fastacc", "layer/te_delayed_xlanorm",
                 "layer/te_current_xlanorm", "layer/te_block_xlanorm",
                 "layer/te_delayed_noguard", "layer/te_off_xlanorm",
                 "layer/te_off_packed", "layer/te_block_packed",
                 "layer/te_block_packed_xla",
                 "attn/core", "attn/module_off", "attn/te_delayed", "attn/te_current",
                 "attn/te_block"]
CONFIGS = MLP_CONFIGS + LAYER_CONFIGS
# Run on request only (--config/--configs), for A/Bs across the memory plan.
KEEP_CONFIGS = [f"{g}/te_{r}_keep" for g in ("mlp", "layer") for r in ("delayed", "current", "block")]
# Suffix of a configuration timed with its initial FP8 state every step, as
# this script did before 2026-11-30 (see _fp8_carry.py): kept to show the gap.
FROZEN = "_frozen"
BASELINE = {"mlp": "mlp/te_off", "layer": "layer/te_off", "attn": "attn/module_off"}


def sizes(small: bool):
  if small:
    return dict(batch=2, seq=128, hidden=256, mlp=1024, heads=4)
  return dict(batch=8, seq=2048, hidden=4096, mlp=16384, heads=32)


def recipe_named(name):
  """The te_jax recipe of a config name's recipe part (None for "off")."""
  from te_jax import recipe
  return {"off": None, "delayed": recipe.DelayedScaling(),
          "current": recipe.Float8CurrentScaling(),
          "block": recipe.Float8BlockScaling()}[name]


def _flax_fp8_op():
  from flax.linen import fp8_ops
  if hasattr(fp8_ops, "Fp8DirectDotGeneralOp"):
    return fp8_ops.Fp8DirectDotGeneralOp, "Fp8DirectDotGeneralOp"
  return fp8_ops.Fp8DotGeneralOp, "Fp8DotGeneralOp"


def _packed_segment_ids(b, s):
  """(b, s) int32 rows of documents (700, 500, 400, 300, 148 tokens, scaled
  to s, order rotated per row); the last row ends in 148 tokens of padding."""
  import numpy as np
  lens = [max(1, s * n // 2048) for n in (700, 500, 400, 300)]
  lens.append(s - sum(lens))
  rows = []
  for r in range(b):
    order = lens[r % 5:] + lens[:r % 5]
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(order)])
    if r == b - 1:
      row[s - lens[-1]:] = 0
    rows.append(row)
  import jax.numpy as jnp
  return jnp.asarray(np.stack(rows), jnp.int32)


def _keep_fp8_copies():
  """``model_memory.keep_fp8_copies`` (inside the autocast)."""
  if __package__:
    from .model_memory import keep_fp8_copies  # pylint: disable=import-outside-toplevel
  else:
    from model_memory import keep_fp8_copies  # pylint: disable=import-error,import-outside-toplevel
  return keep_fp8_copies(True)


def _build(config, sz):
  """Returns (apply(variables, x) -> y, variables, xs, flops, label)."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  import te_jax
  from te_jax import flax as tfx

  bf16 = jnp.bfloat16
  b, s, e, m, h = sz["batch"], sz["seq"], sz["hidden"], sz["mlp"], sz["heads"]
  t = b * s
  kx = jax.random.split(jax.random.key(1), 2)
  xs = [jax.random.normal(k, (b, s, e), bf16) for k in kx]
  group, kind = config.split("/")
  label = config
  mlp_flops = 3 * 2 * t * e * m * 2
  attn_core_flops = 3 * 2 * b * s * s * e      # causal: half of 4*b*s*s*e, x3 fwd+bwd
  proj_flops = 3 * 2 * t * e * e * 4

  if config == "attn/core":
    d = e // h
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    qkv = [jax.random.normal(jax.random.key(i), (b, s, h, d), bf16) for i in range(3)]

    def apply(variables, x):  # x unused: the core's inputs are q, k, v
      del x
      q, k, v = variables["qkv"]
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return apply, {"qkv": qkv}, xs, attn_core_flops, f"{config} ({impl})"

  packed = None       # attention_impl for packed rows (None: no segment ids)
  for suffix, impl in (("_packed_xla", "xla"), ("_packed", "auto")):
    if kind.endswith(suffix):
      packed, kind = impl, kind[:-len(suffix)]
      break
  keep = kind.endswith("_keep")   # the FP8 copies kept for the backward
  if keep:
    kind = kind[:-len("_keep")]
  guard = not kind.endswith("_noguard")   # DelayedScaling's outlier guard (default on)
  if not guard:
    kind = kind[:-len("_noguard")]
  fast = kind.endswith("_fastacc")  # fast accumulation in every GEMM (TE-JAX default, GPU.md)
  if fast:
    kind = kind[:-len("_fastacc")]
  # fuse_norm_quantize=False only when asked: an A/B against a te_jax older
  # than that attribute (tools/gpu_ab.sh) runs this script too.
  norm_kw = {}
  if kind.endswith("_xlanorm"):
    norm_kw, kind = {"fuse_norm_quantize": False}, kind[:-len("_xlanorm")]
  # The MLP's fuse_activation_quantize: the module default (True) unless the
  # name ends in "_unfused" (two FP8 dense layers around an XLA activation).
  fused = not kind.endswith("_unfused")
  if not fused:
    kind = kind[:-len("_unfused")]
  if kind.startswith("te_") or kind == "module_off":
    r = recipe_named(kind[3:]) if kind.startswith("te_") else None
    if not guard:
      r = dataclasses.replace(r, outlier_factor=None)
    if fast:
      r = dataclasses.replace(r, fast_accum_fprop=True, fast_accum_dgrad=True,
                              fast_accum_wgrad=True)
    if group == "mlp":
      module = tfx.LayerNormMLP(intermediate_dim=m, activations=("gelu",),
                                fuse_activation_quantize=fused, dtype=bf16,
                                param_dtype=bf16, **norm_kw)
      flops = mlp_flops
    elif group == "layer":
      module = tfx.TransformerLayer(e, m, h, layer_type="decoder", dtype=bf16,
                                    param_dtype=bf16, fuse_activation_quantize=fused,
                                    **norm_kw,
                                    attention_impl=packed or "auto")
      flops = mlp_flops + proj_flops + attn_core_flops
    else:
      module = tfx.MultiHeadAttention(h, attn_mask_type="causal", dtype=bf16,
                                      param_dtype=bf16)
      flops = proj_flops + attn_core_flops
    with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
      variables = nn.unbox(jax.jit(module.init)(jax.random.key(0), xs[0]))

    kwargs = {"segment_ids": _packed_segment_ids(b, s)} if packed else {}
    kept = _keep_fp8_copies if keep else contextlib.nullcontext

    def apply(variables, x, module=module, r=r):
      with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r), kept():
        return module.apply(variables, x, **kwargs)
    return apply, variables, xs, flops, label

  # Flax reference blocks (mlp group only)
  op, op_name = _flax_fp8_op()
  fp8 = kind == "flax_fp8"
  if fp8:
    label = f"{config} ({op_name})"

  class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dot_general_cls": op} if fp8 else {}
      y = nn.LayerNorm(epsilon=1e-6, dtype=bf16, param_dtype=bf16)(x)
      y = nn.Dense(m, use_bias=False, dtype=bf16, param_dtype=bf16, **kw)(y)
      y = nn.gelu(y, approximate=True)
      return nn.Dense(e, use_bias=False, dtype=bf16, param_dtype=bf16, **kw)(y)

  module = FlaxMLP()
  variables = jax.jit(module.init)(jax.random.key(0), xs[0])
  return module.apply, variables, xs, mlp_flops, label


def gpu_kernel_events(run_steps, steps):
  """The GPU kernel events of a ``jax.profiler`` trace of ``run_steps(steps)``.

  ``run_steps(steps)`` dispatches ``steps`` steps back to back (as the timed
  loop does) and returns something to block on. Returns the trace's complete
  ("X") events on the GPU devices' stream threads (the kernels; XLA's op and
  module summary lines on other threads would count their time twice); an
  empty list where the trace holds no GPU (a CPU).
  """
  import glob
  import gzip
  import tempfile
  import jax
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    jax.block_until_ready(run_steps(steps))
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not files:
      return []
    with gzip.open(files[0]) as fh:
      return kernel_events(json.load(fh).get("traceEvents", []))


def kernel_events(events):
  """The GPU kernel events among a Chrome trace's ``events`` (see
  :func:`gpu_kernel_events`)."""
  pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
  streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
             and e.get("name") == "thread_name" and e.get("pid") in pids
             and "stream" in str(e.get("args", {}).get("name", "")).lower()}
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids
          and (not streams or (e["pid"], e.get("tid")) in streams)]


def kernel_profile(run_steps, steps=3, top=25):
  """GPU kernel time per step by kernel name, from a jax.profiler trace
  (:func:`gpu_kernel_events`).

  Returns ([(name, ms per step, launches per step)] largest first, total
  kernel ms per step, span ms per step, GEMM kernel ms per step): the span
  runs from the first kernel's start to the last one's end, so span - total
  is the time per step the GPU sat idle between kernels; the GEMM sum counts
  the kernels whose names mark them as cuBLAS(Lt) matrix products
  (``GEMM_KERNEL_MARKS``).
  """
  agg = {}
  start, end = float("inf"), float("-inf")
  for e in gpu_kernel_events(run_steps, steps):
    ms, n = agg.get(e["name"], (0.0, 0))
    agg[e["name"]] = (ms + e.get("dur", 0) / 1e3, n + 1)
    start = min(start, e["ts"])
    end = max(end, e["ts"] + e.get("dur", 0))
  rows = sorted(((k, v[0] / steps, v[1] / steps) for k, v in agg.items()),
                key=lambda r: -r[1])
  span = (end - start) / 1e3 / steps if rows else 0.0
  gemm = sum(r[1] for r in rows if is_gemm_kernel(r[0]))
  return rows[:top], sum(r[1] for r in rows), span, gemm


# Name fragments of the matrix-product kernels cuBLAS/cuBLASLt launch on
# Hopper (nvjet: cuBLAS 12.8+'s own kernels; sm90_xmma / cutlass: older and
# block-scaled ones); cuDNN's attention kernels are not counted.
GEMM_KERNEL_MARKS = ("nvjet", "gemm", "xmma", "cutlass")


def is_gemm_kernel(name: str) -> bool:
  low = name.lower()
  return any(m in low for m in GEMM_KERNEL_MARKS) and "cudnn" not in low


def run_one(config, small, k, repeats, profile=False, profile_steps=3):
  import jax
  import jax.numpy as jnp
  # pylint: disable=import-outside-toplevel
  if __package__:  # imported as benchmarks.bench_layer
    from ._fp8_carry import carry_fp8_state, run_steps, time_steps
  else:            # run by path (this folder is sys.path[0]) or imported as bench_layer
    # pylint: disable-next=import-error
    from _fp8_carry import carry_fp8_state, run_steps, time_steps

  frozen = config.endswith(FROZEN)      # the initial FP8 state every step
  sz = sizes(small)
  apply, variables, xs, flops, label = _build(config[:-len(FROZEN)] if frozen else config, sz)

  def loss(variables, x):
    y = apply(variables, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  carry = (lambda v, g: v) if frozen else carry_fp8_state
  times, variables, out = time_steps(step, variables, xs, k, repeats, carry)
  ms = statistics.median(times)
  # How much gradient reaches the input: 0 means every backward GEMM
  # multiplied zeros (a frozen delayed-scaling state does that).
  dx_abs_max = float(jnp.max(jnp.abs(out[1][1].astype(jnp.float32))))
  stats = None
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  peak = stats.get("peak_bytes_in_use") if stats else None
  kernels = total = span = gemm = None
  if profile:
    kernels, total, span, gemm = kernel_profile(
        lambda n: run_steps(step, variables, xs, n, carry)[1], steps=profile_steps)
  from te_jax.ops import _native  # pylint: disable=import-outside-toplevel
  native = _native.resolve_impl("auto")
  return {"config": config, "label": label + (" [frozen FP8 state]" if frozen else ""),
          "ms": ms, "impl": native, "frozen_fp8_state": frozen, "dx_abs_max": dx_abs_max,
          "tflops": flops / (ms * 1e-3) / 1e12, "peak_bytes": peak,
          "times_ms": times, "kernels": kernels,
          "kernel_ms_total": total, "kernel_span_ms": span, "gemm_kernel_ms": gemm}


def environment():
  import jax
  import flax
  dev = jax.devices()[0]
  return {"date": datetime.date.today().isoformat(),
          "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
          "jax": jax.__version__, "flax": flax.__version__}


def table(results, env, sz, k, repeats):
  lines = [
      f"### te_jax.flax layers, {env['date']}, {env['device']}, "
      f"jax {env['jax']}, flax {env['flax']}",
      "",
      f"Tokens {sz['batch']}x{sz['seq']}, hidden {sz['hidden']}, mlp {sz['mlp']}, "
      f"heads {sz['heads']}, bf16 params/activations, fwd+bwd (value_and_grad wrt "
      f"params and input); k={k} back-to-back steps, median of {repeats}; te_jax "
      f"quantize/GEMM ops: {', '.join(sorted({r.get('impl', '?') for r in results}))}.",
      "",
      "| config | ms / step | speed-up vs FP8 off | TFLOP/s | peak mem (MiB) | max abs dx |",
      "|---|---:|---:|---:|---:|---:|",
  ]
  by = {r["config"]: r for r in results if "ms" in r}
  for r in results:
    if "ms" not in r:
      lines.append(f"| {r['config']} | failed: {r.get('error', '?')[:80]} | | | | |")
      continue
    base_name = BASELINE[r["config"].split("/")[0]]
    if "_packed" in r["config"]:   # packed rows against FP8 off on the same rows
      base_name += "_packed"
    base = by.get(base_name) if r["config"] != "attn/core" else None
    ratio = f"{base['ms'] / r['ms']:.2f}x" if base else "-"
    peak = f"{r['peak_bytes'] / 2**20:.0f}" if r.get("peak_bytes") else "n/a"
    dx = f"{r['dx_abs_max']:.3g}" if r.get("dx_abs_max") is not None else "-"
    lines.append(f"| {r['label']} | {r['ms']:.3f} | {ratio} | {r['tflops']:.3g} | {peak} | {dx} |")
  core, layer = by.get("attn/core"), by.get("layer/te_off")
  module = by.get("attn/module_off")
  if core and layer:
    lines.append("")
    share = f"Attention share of the FP8-off TransformerLayer step: core " \
            f"{100 * core['ms'] / layer['ms']:.0f}%"
    if module:
      share += f", whole attention module {100 * module['ms'] / layer['ms']:.0f}%"
    lines.append(share + ".")
  lines += step_shares(by)
  return "\n".join(lines)


def step_shares(by):
  """Table lines splitting each TransformerLayer step into its parts.

  From the rows that time each part alone, in its own process: the MLP block
  (``mlp/te_<recipe>``, LayerNorm included), the attention core
  (``attn/core``: bf16 cuDNN in every recipe), the attention projections
  (the MultiHeadAttention module, ``attn/module_off`` or ``attn/te_<recipe>``,
  minus the core) and the rest (the layer minus those: the attention's
  LayerNorm, residual adds, and whatever the parts do not share when fused).
  """
  core = by.get("attn/core")
  rows = []
  for recipe in ("off", "delayed", "current", "block"):
    layer, mlp = by.get(f"layer/te_{recipe}"), by.get(f"mlp/te_{recipe}")
    module = by.get("attn/module_off" if recipe == "off" else f"attn/te_{recipe}")
    if not (core and layer and mlp and module):
      continue
    total = layer["ms"]
    parts = (mlp["ms"], core["ms"], module["ms"] - core["ms"],
             total - mlp["ms"] - module["ms"])
    rows.append(f"| {recipe} | {total:.3f} | "
                + " | ".join(f"{v:.2f} ({100 * v / total:.0f}%)" for v in parts) + " |")
  if not rows:
    return []
  return ["", "TransformerLayer step by part (ms and share; each part timed alone):", "",
          "| recipe | layer ms | MLP block | attention core (bf16) | attention projections "
          "| rest |", "|---|---:|---:|---:|---:|---:|"] + rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--config", help="run one configuration and print one JSON line")
  p.add_argument("--configs", default=",".join(CONFIGS),
                 help="comma-separated configurations to run (default: all)")
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
  p.add_argument("--json-out", help="also write all results to this JSON file")
  p.add_argument("--profile", action="store_true",
                 help="also trace steps after the timings and list GPU kernel time by kernel")
  p.add_argument("--profile-steps", type=int, default=3,
                 help="steps in the --profile trace (more: the trace runs at the power-capped "
                      "clocks of the timed steps instead of mostly before the cap bites)")
  args = p.parse_args(argv)

  if args.config:
    if args.config.removesuffix(FROZEN) not in CONFIGS + KEEP_CONFIGS:
      p.error(f"unknown config {args.config}; known: {CONFIGS + KEEP_CONFIGS}")
    print("JSON " + json.dumps(run_one(args.config, args.small, args.k, args.repeats,
                                       args.profile, args.profile_steps)), flush=True)
    return 0

  results = []
  for config in [c for c in args.configs.split(",") if c]:
    cmd = [sys.executable, os.path.abspath(__file__), "--config", config,
           "--k", str(args.k), "--repeats", str(args.repeats)]
    if args.small:
      cmd.append("--small")
    if args.profile:
      cmd += ["--profile", "--profile-steps", str(args.profile_steps)]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
      line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
      if line:
        res = json.loads(line[-1][5:])
      else:
        res = {"config": config, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    except subprocess.TimeoutExpired:
      res = {"config": config, "error": f"timeout after {args.timeout}s"}
    results.append(res)
    msg = (f"{res['label']}: {res['ms']:.3f} ms" if "ms" in res
           else f"{config}: FAILED {res['error']}")
    print(msg, file=sys.stderr, flush=True)

  env = environment()
  out = table(results, env, sizes(args.small), args.k, args.repeats)
  print(out)
  for r in results:
    if r.get("kernels"):
      print(f"\nkernels of {r['config']}: {r['kernel_ms_total']:.3f} ms of GPU kernels per step, "
            f"first start to last end {r['kernel_span_ms']:.3f} ms per step (back to back), "
            f"GEMM kernels {r['gemm_kernel_ms']:.3f} ms")
      for name, ms, n in r["kernels"][:15]:
        print(f"  {ms:8.3f} ms  x{n:4.0f}  {name[:110]}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump({"env": env, "results": results}, f, indent=1)
  return 0 if all("ms" in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
