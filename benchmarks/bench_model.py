"""A whole training step of ``examples/train_gpt.py``, per recipe, with where its time goes.

For one preset (default ``llama``: 1.13B parameters, RMSNorm, SwiGLU,
rotary, grouped-query attention, 8 x 4096 tokens, AdamW) and each recipe
(``none`` is bf16), in a fresh process each:

* ms per training step and tokens/s: the benchmarks' protocol (state, FP8
  state included, carried from step to step by the example's own jitted
  step; 3 warm-ups, ``--repeats`` timings of ``--k`` steps, median); with the
  defaults 53 steps after compilation;
* model FLOP utilisation (the example's FLOP count and peak);
* GPU kernel time per step from a ``jax.profiler`` trace of
  ``--profile-steps`` steps, by kind: cuBLAS(Lt) matrix products, attention
  (cuDNN / flash kernels), te_jax's own kernels (quantize, norm, amax), and
  everything else (XLA fusions, copies, the optimizer); "idle" is the time
  per step the GPU ran no kernel;
* device memory: the compiled step's arguments + temp
  (``memory_analysis()``, what XLA reserves for one step; per buffer:
  ``benchmarks/model_memory.py``) and the device's peak bytes in use over
  the whole run (allocator statistics; GPU only).

The last table is the budget behind the speed-up: the FP8 step can only
gain what its GEMMs lose, less what quantization adds.

A recipe written ``<recipe>+keep`` (``delayed+keep``) runs with the fused
norm layers keeping their FP8 copies for the backward
(``model_memory.keep_fp8_copies``): the step time and memory of the layers
before they quantized again in the backward, beside today's.

  python3 benchmarks/bench_model.py                           # H200, llama preset
  python3 benchmarks/bench_model.py --preset cpu --small      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = ("none", "delayed", "current", "blockwise")
# te_jax's CUDA kernels (custom_calls/kernels), by name.
TE_JAX_KERNELS = ("Quantize", "AmaxKernel", "TileAmaxKernel", "NormStats", "NormBwd",
                  "AddBiasKernel", "te_jax")
ATTENTION_MARKS = ("cudnn", "flash", "fmha", "attention", "sdpa")
KINDS = ("gemm", "attention", "te_jax", "other")


def kernel_kind(name: str) -> str:
  """``gemm``, ``attention``, ``te_jax`` or ``other`` for a GPU kernel name."""
  from bench_layer import is_gemm_kernel  # pylint: disable=import-error,import-outside-toplevel
  low = name.lower()
  if any(m in low for m in ATTENTION_MARKS):
    return "attention"
  if is_gemm_kernel(name):
    return "gemm"
  if any(k in name for k in TE_JAX_KERNELS):
    return "te_jax"
  return "other"


def _norm_variant(kernels_from, bwd_blocks):
  """A/B switches for te_jax's norm kernels, set in this (one-recipe) process only:
  the narrowest hidden size that takes the unquantized norm kernels, and a fixed
  grid for the norm backward kernel instead of ``backward_blocks``' rule."""
  from te_jax.layers import norm as fused_norm  # pylint: disable=import-outside-toplevel
  from te_jax.ops import normalization_cuda  # pylint: disable=import-outside-toplevel
  label = []
  if kernels_from is not None:
    fused_norm.MIN_KERNEL_HIDDEN = kernels_from
    label.append(f"norm kernels from {kernels_from}")
  if bwd_blocks is not None:
    normalization_cuda.backward_blocks = lambda m, h: max(1, min(int(m), bwd_blocks))
    label.append(f"norm bwd {bwd_blocks} blocks")
  return ", ".join(label)


def run_one(preset, recipe, k, repeats, profile_steps, small, doc_window=None, variant="",
            overrides=None, top_per_kind=4):
  """Times and profiles one recipe; returns a dict (one JSON line). ``overrides``:
  ``train_gpt.Config`` fields (``--set``), e.g. ``batch`` or ``offload_optimizer``;
  ``top_per_kind``: the largest kernels kept per kind (``"top"``), with their
  launches per step (``"launches"``)."""
  sys.path.insert(0, os.path.join(HERE, "..", "examples"))
  import jax  # pylint: disable=import-outside-toplevel
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel
  from _fp8_carry import (FP8_COLLECTION,  # pylint: disable=import-error,import-outside-toplevel
                          time_steps)
  from bench_layer import kernel_profile  # pylint: disable=import-error,import-outside-toplevel

  extra = dict(hidden=64, layers=2, heads=4, mlp=128, seq_len=128, batch=2) if small else {}
  cfg = train_gpt.Config(preset=preset, recipe=recipe, num_docs=2000 if small else 20000,
                         out_dir=None, progress=False, eval_batches=0, doc_window=doc_window,
                         **{**extra, **(overrides or {})})
  trainer = train_gpt.Trainer(cfg)
  state = trainer.init()
  batches = [trainer.batch(i) for i in range(2)]

  def step(st, batch):        # run_steps' layout: (output, (next state,))
    new, metrics = trainer.step(st, batch)
    return metrics, (new,)

  def carry(_, new):
    return new

  times, state, out = time_steps(step, state, batches, k, repeats, carry)
  # Delayed scaling: scales that left their initial 1 show the state was carried.
  fp8 = state.params.get(FP8_COLLECTION, {}) if hasattr(state.params, "get") else {}
  moved = sum(float(v) != 1.0 for path, v in jax.tree_util.tree_leaves_with_path(fp8)
              if "'scale'" in jax.tree_util.keystr(path))
  loss = float(out[0]["loss"])
  tokens = trainer.cfg.batch * trainer.cfg.seq_len
  ms = statistics.median(times)
  flops = train_gpt.model_flops_per_token(trainer.cfg, state) * tokens / (ms / 1e3)
  peak = train_gpt.peak_flops(jax.devices()[0])
  live = {"state": state}

  def profiled(n):
    from _fp8_carry import run_steps  # pylint: disable=import-error,import-outside-toplevel
    live["state"], last = run_steps(step, live["state"], batches, n, carry)
    return last

  rows, total, span, _ = kernel_profile(profiled, steps=profile_steps, top=10**6)
  memory = device_memory(trainer, live["state"], batches[0])
  kinds = {kind: 0.0 for kind in KINDS}
  for name, kms, _ in rows:
    kinds[kernel_kind(name)] += kms
  top = {kind: sorted(((n, round(t, 3)) for n, t, _ in rows if kernel_kind(n) == kind),
                      key=lambda r: -r[1])[:top_per_kind] for kind in KINDS}
  kept = {n for rows_of_kind in top.values() for n, _ in rows_of_kind}
  launches = {n: round(c, 2) for n, _, c in rows if n in kept}
  return {"recipe": recipe + (f" ({variant})" if variant else ""), "overrides": overrides or {},
          "doc_window": trainer.doc_window, "ms": ms, "times": times,
          "tokens_per_s": tokens / (ms / 1e3),
          "mfu": None if peak is None else flops / peak, "loss": loss,
          "params": train_gpt.param_count(state), "kernels_ms": kinds, "kernel_total_ms": total,
          "idle_ms": max(span - total, 0.0), "top": top, "launches": launches,
          "steps_timed": k * repeats,
          "fp8_scales_moved": moved, "memory": memory}


def device_memory(trainer, state, batch):
  """{"args_temp": bytes, "peak_in_use": bytes or None}: the compiled step's
  arguments + temp (the step was compiled already: jax's compilation cache
  serves it) and the device allocator's peak so far (None where the backend
  keeps no statistics, e.g. the CPU)."""
  from model_memory import memory_stats  # pylint: disable=import-error,import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  with trainer._ctx():  # pylint: disable=protected-access
    stats = memory_stats(trainer._step.lower(state, batch).compile())  # pylint: disable=protected-access
  allocator = jax.devices()[0].memory_stats() or {}
  return {"args_temp": stats["argument"] + stats["temp"],
          "peak_in_use": allocator.get("peak_bytes_in_use")}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="llama", help="a train_gpt.py preset")
  p.add_argument("--recipes", default=",".join(RECIPES),
                 help="none,delayed,current,blockwise; <recipe>+keep: the FP8 copies kept "
                      "(see above)")
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  p.add_argument("--profile-steps", type=int, default=2, help="steps in the kernel trace")
  p.add_argument("--small", action="store_true", help="tiny model (CPU smoke test)")
  p.add_argument("--one", help=argparse.SUPPRESS)   # run one recipe, print one JSON line
  p.add_argument("--timeout", type=int, default=300, help="seconds per recipe")
  p.add_argument("--json-out", help="write the results so far to this JSON file after each recipe")
  p.add_argument("--doc-window", action=argparse.BooleanOptionalAction, default=None,
                 help="train_gpt's --doc_window: attention only over a band as wide as the "
                      "longest document (default: the preset's, on for llama)")
  p.add_argument("--norm-kernels-from", type=int, default=None,
                 help="A/B: take the unquantized norm kernels from this hidden size on "
                      "(te_jax.layers.norm.MIN_KERNEL_HIDDEN)")
  p.add_argument("--norm-bwd-blocks", type=int, default=None,
                 help="A/B: a fixed CUDA grid for the norm backward kernel")
  p.add_argument("--top", type=int, default=4,
                 help="the largest kernels per kind kept and printed, with launches per step")
  p.add_argument("--set", default="",
                 help="train_gpt Config overrides, e.g. batch=4 or offload_optimizer=true")
  args = p.parse_args(argv)
  if args.one:
    from model_memory import (keep_fp8_copies,  # pylint: disable=import-error,import-outside-toplevel
                              parse_overrides, split_recipe)
    variant = _norm_variant(args.norm_kernels_from, args.norm_bwd_blocks)
    recipe, keep = split_recipe(args.one)
    with keep_fp8_copies(keep):
      res = run_one(args.preset, recipe, args.k, args.repeats, args.profile_steps, args.small,
                    args.doc_window, ", ".join(v for v in (variant, keep and "FP8 copies kept")
                                               if v), parse_overrides(args.set), args.top)
    print("JSON " + json.dumps(res), flush=True)
    return 0

  results, ok = [], True
  for recipe in [r for r in args.recipes.split(",") if r]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", recipe, "--preset", args.preset,
           "--k", str(args.k), "--repeats", str(args.repeats),
           "--profile-steps", str(args.profile_steps), "--top", str(args.top)] + (
               ["--small"] if args.small else []) + (
               ["--set", args.set] if args.set else []) + (
               [] if args.doc_window is None else
               ["--doc-window" if args.doc_window else "--no-doc-window"]) + [
                   f"--{name}={val}" for name, val in (
                       ("norm-kernels-from", args.norm_kernels_from),
                       ("norm-bwd-blocks", args.norm_bwd_blocks)) if val is not None]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                            cwd=HERE, check=False)
      line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
      if not line:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                           else f"exit {proc.returncode}")
      results.append(json.loads(line[0][5:]))
      r = results[-1]
      print(f"{recipe}: {r['ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s; kernels "
            + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_ms"].items())
            + f", idle {r['idle_ms']:.1f} ms", file=sys.stderr, flush=True)
      print(f"{recipe} largest kernels: {json.dumps(r['top'])}", file=sys.stderr, flush=True)
      print(f"{recipe} launches per step: {json.dumps(r['launches'])}", file=sys.stderr,
            flush=True)
      if args.json_out:           # after each recipe: a cut run keeps what it measured
        with open(args.json_out, "w", encoding="utf-8") as fh:
          json.dump(results, fh, indent=1)
    except Exception as err:  # pylint: disable=broad-except
      ok = False
      print(f"{recipe}: FAILED {err}", file=sys.stderr, flush=True)
  print(format_tables(results, args))
  return 0 if ok and results else 1


def format_tables(results, args) -> str:
  from bench_layer import environment  # pylint: disable=import-error,import-outside-toplevel
  env = environment()
  base = next((r for r in results if r["recipe"].split(" (")[0] == "none"), None)
  bands = sorted({r["doc_window"] for r in results if r.get("doc_window")})
  window = f" (attention band {', '.join(map(str, bands))} tokens)" if bands else ""
  overrides = f" --set {args.set}" if getattr(args, "set", "") else ""
  lines = [f"### train_gpt.py --preset {args.preset}{overrides}{window}, {env['date']}, "
           f"{env['device']}, "
           f"jax {env['jax']}, flax {env['flax']}", "",
           f"Median of {args.repeats} timings of {args.k} steps after 3 warm-ups, state carried; "
           f"kernel time from a trace of {args.profile_steps} steps.", "",
           "Device memory: the compiled step's arguments + temp (GiB, and against bf16) "
           "and the allocator's peak in use over the run.", "",
           "| recipe | ms / step | tokens/s | vs bf16 | MFU | loss | GEMM ms | attention ms "
           "| te_jax kernels ms | other ms | idle ms | args+temp GiB | mem vs bf16 "
           "| peak in use GiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    k = r["kernels_ms"]
    vs = f"{base['ms'] / r['ms']:.3f}x" if base else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    mem = r.get("memory") or {}
    ref = (base.get("memory") or {}).get("args_temp") if base else None
    used = mem.get("args_temp")
    peak = mem.get("peak_in_use")
    lines.append(f"| {r['recipe']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {vs} | {mfu} | "
                 f"{r['loss']:.3f} | {k['gemm']:.1f} | {k['attention']:.1f} | {k['te_jax']:.1f} "
                 f"| {k['other']:.1f} | {r['idle_ms']:.1f} | "
                 f"{'-' if used is None else f'{used / 2**30:.2f}'} | "
                 f"{f'{used / ref:.3f}x' if used and ref else '-'} | "
                 f"{'-' if peak is None else f'{peak / 2**30:.2f}'} |")
  lines += ["", "Largest kernels per kind (ms per step):", ""]
  for r in [r for r in results if r["kernel_total_ms"] > 0]:
    lines.append(f"- {r['recipe']}: " + "; ".join(
        f"{kind}: " + ", ".join(f"{n[:60]} {t}" for n, t in r["top"][kind][:3])
        for kind in KINDS if r["top"][kind]))
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
