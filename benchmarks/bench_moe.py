"""The MoE layer and the ``moe`` preset per recipe: time, kernel time by part, memory.

Two parts, each recipe in a fresh process (``--in-process``: one process):

* ``layer``: a training step (forward + backward, FP8 state carried) of
  ``te_jax.flax.MoE`` as one layer of ``train_gpt.py --preset moe`` holds it
  (8 x 2048 tokens of width 1024, 64 experts of width 512, 8 per token, a
  shared expert of width 1024, bf16 compute; ``--layer-sizes wide``: 4 x 2048
  tokens of width 4096, 64 experts of width 2048, GEMM-bound, where FP8's
  GEMMs are most of the step). Rows: each recipe, against
  te_jax's FP8-off MoE (``none``: the same block, its grouped GEMMs te_jax's
  bf16 kernel) and ``ragged_dot`` (FP8 off, the grouped
  GEMMs by XLA's ``jax.lax.ragged_dot``).
* ``model``: ``examples/train_gpt.py --preset moe`` (``--small``: moe_tiny)
  training steps per recipe: tokens/s against bf16 (``none``).

Each row: ms per step (``--repeats`` timings of ``--k`` steps after 3
warm-ups, median; max |dx| of the layer's input gradient shows the state is
not frozen), GPU kernel time per step by part of the MoE from a profiler
trace (router, dispatch, grouped GEMMs with the experts' activation,
combine, shared expert; the all-to-alls of expert parallelism belong to
dispatch and combine; "other" is the rest: attention, norms, the optimizer),
told apart by the named scopes of ``te_jax.moe.SCOPES`` that the compiled
program's op names carry (the traced steps run the step compiled a second
time with XLA's command buffers off: a kernel inside a command buffer
carries the buffer's name, not its op's, so the grouped GEMMs and te_jax's
kernels would count as "other"; the timed steps keep them), device memory:
the compiled step's arguments + temp (``memory_analysis()``), and the
seconds of building the step,
phase by phase (``init``: the layer's ``jax.jit(module.init)`` traced,
compiled and run, or the model's trainer built and its state initialized;
the step's ``lower`` and ``compile``), which each row also prints to
stderr as it finishes them, before its timed steps.

The grouped GEMMs (FP8 per tensor and blockwise, and bf16 in the FP8-off
row) run te_jax's sm_90a kernels where the native module was built with them
(CUTLASS headers found at build time) on a Hopper GPU; elsewhere they run the
pure-JAX reference under XLA (operands in float32), and the tables say which
(``grouped_gemm_cuda.auto_reference_reason``).

  python3 benchmarks/bench_moe.py                     # GPU: layer and model, every recipe
  python3 benchmarks/bench_moe.py --parts layer --layer-sizes wide --top-kernels 12
  python3 benchmarks/bench_moe.py --small --in-process     # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from moe_trace import KINDS, PARTS, count_parts, kernel_time_by_part  # pylint: disable=import-error

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = ("none", "delayed", "current", "blockwise")
LAYER_ROWS = RECIPES + ("ragged_dot",)
# (tokens as batch x seq, hidden, experts, per token, expert width, shared width)
# "full": the moe preset's layer; "wide": GEMM-bound experts (DeepSeek-V3's
# are 7168 x 2048), where FP8's GEMM time is most of the step; "small": CPU.
LAYER_SIZES = {"full": dict(batch=8, seq=2048, hidden=1024, experts=64, k=8, mlp=512,
                            shared=1024),
               "wide": dict(batch=4, seq=2048, hidden=4096, experts=64, k=8, mlp=2048,
                            shared=4096),
               "small": dict(batch=2, seq=64, hidden=128, experts=8, k=2, mlp=128, shared=128)}


def grouped_gemm_note() -> str:
  """Which implementation the rows' grouped GEMMs ran, and why."""
  from te_jax.ops import grouped_gemm_cuda  # pylint: disable=import-outside-toplevel
  why = grouped_gemm_cuda.auto_reference_reason()
  if why:
    return (f"Grouped GEMMs: the pure-JAX reference under XLA ({why}: the rows time that "
            "reference, not tensor cores).")
  return ("Grouped GEMMs: te_jax's sm_90a kernels (FP8 per tensor and blockwise; bf16 in "
          "the FP8-off row).")


@contextlib.contextmanager
def _ragged_dot_gemms():
  """Within: te_jax's grouped GEMMs are ``jax.lax.ragged_dot`` (FP8 off only),
  so the ``ragged_dot`` row's block is te_jax's with XLA's grouped GEMMs."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from te_jax.ops import grouped_gemm as op  # pylint: disable=import-outside-toplevel

  def gemm(lhs, rhs, group_sizes, *, out_dtype=jnp.bfloat16, **_):
    return lax.ragged_dot(lhs, rhs, group_sizes,
                          preferred_element_type=jnp.float32).astype(out_dtype)

  def contraction_over(dim):
    """A grouped wgrad contracting both operands' ``dim``, the grouped one:
    1 for ``grouped_wgrad``'s (k, m) and (n, m), 0 for the FP8-off layer's
    ``grouped_wgrad_rows`` on x (m, k) and grad (m, n) as stored."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([dim], [dim]), ([], [])), lhs_ragged_dimensions=[dim],
        rhs_group_dimensions=[])

    def wgrad(a, b, group_sizes, *, out_dtype=jnp.float32, **_):
      return lax.ragged_dot_general(a, b, group_sizes, dims,
                                    preferred_element_type=jnp.float32).astype(out_dtype)
    return wgrad
  wgrad, wgrad_rows = contraction_over(1), contraction_over(0)
  saved = op.grouped_gemm, op.grouped_wgrad, op.grouped_wgrad_rows
  op.grouped_gemm, op.grouped_wgrad, op.grouped_wgrad_rows = gemm, wgrad, wgrad_rows
  try:
    yield
  finally:
    op.grouped_gemm, op.grouped_wgrad, op.grouped_wgrad_rows = saved


def layer_case(row: str, small: bool, sizes: str = "full") -> dict:
  """What one layer row (``LAYER_ROWS``) runs, built but not traced.

  Returns a dict: ``module`` (the ``te_jax.flax.MoE``), ``xs`` (two
  (batch, seq, hidden) bfloat16 inputs), ``g`` (a float32 offset of the
  output in the quadratic loss), ``grad_step`` (jitted ``(variables, x, g) -> (loss,
  (variable grads, input grad))``), ``context`` (a function returning the
  context to trace in: the recipe's autocast, and for ``ragged_dot`` the
  swapped grouped GEMMs) and ``sizes`` (``LAYER_SIZES[sizes]``, or the
  small ones with ``small``).

  ``g`` is an argument of the step, not a value its loss closes over: a
  closed-over array is a constant of the program (64 MiB at the full size),
  and XLA then constant-folds what depends on it alone -- the FP8 amaxes
  of the output gradient -- which took most of the FP8 rows' compile time.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import te_jax  # pylint: disable=import-outside-toplevel
  from te_jax import flax as tfx, moe  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(HERE, "..", "examples"))
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel

  sz = LAYER_SIZES["small" if small else sizes]
  recipe = None if row in ("none", "ragged_dot") else train_gpt.make_recipe(row)
  cfg = train_gpt.moe_config(train_gpt.Config(preset="moe_tiny" if small else "moe",
                                              experts=sz["experts"],
                                              experts_per_token=sz["k"],
                                              shared_mlp=sz["shared"]).resolved())
  module = tfx.MoE(intermediate_dim=sz["mlp"], dtype=jnp.bfloat16, **dataclasses.asdict(cfg))
  rng = np.random.default_rng(0)
  shape = (sz["batch"], sz["seq"], sz["hidden"])
  xs = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2)]
  g = jnp.asarray(rng.standard_normal(shape), jnp.float32) / np.sqrt(np.prod(shape))

  # Quadratic in y, as a model's loss is through the layers above: its
  # cotangent 2 (y + g) needs the whole forward, so XLA cannot move the
  # experts' forward into the backward, as it did with a loss linear in y
  # (whose cotangent g is known up front), and a residual the forward
  # keeps (store_act_input_in_fp8's copy of h) is measured as a model holds it.
  def loss(v, x, g):
    y, st = module.apply(v, x, mutable=["intermediates"])
    return jnp.sum(jnp.square(y.astype(jnp.float32) + g)) + moe.aux_totals(st)["aux_loss"]

  @contextlib.contextmanager
  def context():
    swap = _ragged_dot_gemms() if row == "ragged_dot" else contextlib.nullcontext()
    with swap, te_jax.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
      yield
  return {"module": module, "xs": xs, "g": g, "context": context, "sizes": sz,
          "grad_step": jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))}


def run_layer(row: str, small: bool, k: int, repeats: int, profile_steps: int,
              top_kernels: int = 0, sizes: str = "full") -> dict:
  """Times one layer row (``LAYER_ROWS``); returns a JSON-ready dict.

  Before the timed steps, each phase of building the step is timed on its
  own and printed (``_phases``): ``init`` (``jax.jit(module.init)``
  traced, compiled and run), ``lower`` and ``compile`` of the step; a row
  that runs out of time says which one it was in."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from _fp8_carry import run_steps, time_steps  # pylint: disable=import-error,import-outside-toplevel
  from model_memory import memory_stats  # pylint: disable=import-error,import-outside-toplevel

  case = layer_case(row, small, sizes)
  module, xs, g, sz = case["module"], case["xs"], case["g"], case["sizes"]
  phase = _phases()
  with case["context"]():
    variables = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), xs[0]))
    jax.block_until_ready(variables)
    seconds = {"init": phase("init (trace + compile + run)")}
    lowered, compiled = _lower_and_compile(case["grad_step"], (variables, xs[0], g), phase,
                                           seconds)

    def step(v, x):   # the compiled program: the timed steps compile nothing again
      return compiled(v, x, g)
    times, variables, out = time_steps(step, variables, xs, k, repeats)
    phase(f"{k * repeats} timed steps")
    live = {"v": variables}
    traced = _trace_program(lowered, compiled, phase)

    def profiled(n):
      live["v"], last = run_steps(lambda v, x: traced(v, x, g), live["v"], xs, n)
      return last
    kinds = kernel_time_by_part(profiled, profile_steps, traced.as_text(), top=top_kernels)
    phase(f"{profile_steps} profiled steps + trace")
  stats = memory_stats(compiled)
  tokens = sz["batch"] * sz["seq"]
  ms = statistics.median(times)
  return {"part": "layer", "row": row, "ms": ms, "times": times,
          "tokens_per_s": tokens / (ms / 1e3),
          "max_abs_dx": float(jnp.max(jnp.abs(out[1][1].astype(jnp.float32)))),
          "kernels_ms": kinds, "hlo_ops": count_parts(compiled.as_text()),
          "args_temp": stats["argument"] + stats["temp"], "sizes": sz, "build_s": seconds}


def run_model(recipe: str, small: bool, k: int, repeats: int, profile_steps: int,
              overrides: dict = None, top_kernels: int = 0) -> dict:
  """Times ``train_gpt.py --preset moe`` (moe_tiny with ``small``) steps,
  with ``overrides`` (``Config`` fields, ``--model-set``) on the preset.

  As for the layer, building the step is timed phase by phase before the
  timed steps: ``init`` (the ``Trainer`` built, its state initialized),
  the step's ``lower`` and ``compile``; the timed steps run that compiled
  step (calling the jitted one would compile it again)."""
  import jax  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(HERE, "..", "examples"))
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel
  from _fp8_carry import run_steps, time_steps  # pylint: disable=import-error,import-outside-toplevel
  from model_memory import memory_stats  # pylint: disable=import-error,import-outside-toplevel

  base = dict(preset="moe_tiny" if small else "moe", recipe=recipe,
              num_docs=1000 if small else 20000, out_dir=None, progress=False, eval_batches=0)
  cfg = train_gpt.Config(**(base | (overrides or {})))
  phase = _phases()
  trainer = train_gpt.Trainer(cfg)
  state = jax.block_until_ready(trainer.init())
  seconds = {"init": phase("init (Trainer built + state initialized)")}
  batches = [trainer.batch(i) for i in range(2)]
  with trainer._ctx():  # pylint: disable=protected-access
    step_fn = trainer._step  # pylint: disable=protected-access
    lowered, compiled = _lower_and_compile(step_fn, (state, batches[0]), phase, seconds)

  def step(st, batch, program=compiled):   # time_steps' layout: (output, (next state,))
    with trainer._ctx():  # pylint: disable=protected-access
      new, metrics = program(st, batch)
    return metrics, (new,)

  def carry(_, new):
    return new

  times, state, out = time_steps(step, state, batches, k, repeats, carry)
  phase(f"{k * repeats} timed steps")
  live = {"state": state}
  traced = _trace_program(lowered, compiled, phase)

  def profiled(n):
    live["state"], last = run_steps(lambda st, b: step(st, b, traced), live["state"], batches, n,
                                    carry)
    return last
  kinds = kernel_time_by_part(profiled, profile_steps, traced.as_text(), top=top_kernels)
  stats = memory_stats(compiled)
  ms = statistics.median(times)
  tokens = trainer.cfg.batch * trainer.cfg.seq_len
  return {"part": "model", "row": recipe, "ms": ms, "times": times,
          "tokens_per_s": tokens / (ms / 1e3), "loss": float(out[0]["loss"]),
          "dropped": int(out[0]["dropped"]), "params": train_gpt.param_count(state),
          "kernels_ms": kinds, "args_temp": stats["argument"] + stats["temp"],
          "device": jax.devices()[0].device_kind, "build_s": seconds}


def _fmt_kinds(r) -> str:
  k = r.get("kernels_ms")
  if not k:
    return " | ".join("-" for _ in KINDS)
  return " | ".join(f"{k[kind]:.2f}" for kind in KINDS)


def _fmt_build(r) -> str:
  """The seconds of building a row's step: init / lower / compile."""
  return " / ".join(f"{r['build_s'][p]:.1f}" for p in ("init", "lower", "compile"))


def _against(r, base):
  """(speed-up, memory ratio) of row ``r`` against the baseline row ``base``
  ("-" without one): base time / time, and args+temp / the base's."""
  if base is None:
    return "-", "-"
  return f"{base['ms'] / r['ms']:.3f}x", f"{r['args_temp'] / base['args_temp']:.3f}x"


def format_tables(results, args) -> str:
  """The markdown tables of the rows measured (layer, then model)."""
  from bench_layer import environment  # pylint: disable=import-error,import-outside-toplevel
  env = environment()
  lines = [f"### bench_moe.py{' --small' if args.small else ''}, {env['date']}, "
           f"{env['device']}, jax {env['jax']}, flax {env['flax']}", "", grouped_gemm_note(), "",
           f"Median of {args.repeats} timings of {args.k} steps after 3 warm-ups, FP8 state "
           f"carried; kernel ms per step from a trace of {args.profile_steps} steps, by part "
           "of the MoE (- : no GPU trace); args+temp: the compiled step's device memory; "
           "init / lower / compile s: building the step (init: the layer's jax.jit(module.init) "
           "traced, compiled and run; the model's Trainer built and its state initialized).",
           ""]
  kinds_head = " | ".join(f"{kind} ms" for kind in KINDS)
  layer = [r for r in results if r["part"] == "layer"]
  if layer:
    base = next((r for r in layer if r["row"] == "none"), None)
    sz = layer[0]["sizes"]
    lines += [f"MoE layer: {sz['batch']} x {sz['seq']} tokens, hidden {sz['hidden']}, "
              f"{sz['experts']} experts of width {sz['mlp']}, {sz['k']} per token, shared "
              f"expert {sz['shared']}; against te_jax's FP8-off MoE (none).", "",
              f"| row | ms / step | vs FP8 off | {kinds_head} | args+temp MiB | mem vs FP8 off "
              "| max abs dx | init / lower / compile s |", "|---|" + "---:|" * (len(KINDS) + 6)]
    for r in layer:
      speed, mem = _against(r, base)
      lines.append(f"| {r['row']} | {r['ms']:.2f} | {speed} | {_fmt_kinds(r)} | "
                   f"{r['args_temp'] / 2**20:.1f} | {mem} | {r['max_abs_dx']:.3g} | "
                   f"{_fmt_build(r)} |")
    lines.append("")
  model = [r for r in results if r["part"] == "model"]
  if model:
    base = next((r for r in model if r["row"] == "none"), None)
    model_set = getattr(args, "model_set", "")   # callers' Namespaces may predate it
    lines += [f"train_gpt.py --preset {'moe_tiny' if args.small else 'moe'}"
              f"{' --set ' + model_set if model_set else ''} "
              f"({model[0]['params'] / 1e6:.1f}M parameters): tokens/s per recipe against "
              "bf16 (none).", "",
              f"| recipe | ms / step | tokens/s | vs bf16 | {kinds_head} | args+temp GiB "
              "| mem vs bf16 | loss | dropped | init / lower / compile s |",
              "|---|" + "---:|" * (len(KINDS) + 8)]
    for r in model:
      speed, mem = _against(r, base)
      lines.append(f"| {r['row']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {speed} | "
                   f"{_fmt_kinds(r)} | {r['args_temp'] / 2**30:.2f} | {mem} | "
                   f"{r['loss']:.3f} | {r['dropped']} | {_fmt_build(r)} |")
  blind = [r["row"] for r in results if r.get("kernels_ms")
           and not any(r["kernels_ms"][part] for part in PARTS)]
  if blind:
    lines += ["", f"Rows {blind}: no kernel of the trace named a MoE scope or an HLO op of "
              "the step (all time is in 'other'): this trace format does not say which op a "
              "kernel ran, so the parts could not be told apart."]
  return "\n".join(lines)


def _phases():
  """A function that prints, to stderr, each phase's name and its seconds
  since the previous one, and returns those seconds: a row that runs out of
  time says where it was."""
  last = [time.perf_counter()]

  def phase(name):
    now = time.perf_counter()
    seconds = now - last[0]
    print(f"phase: {name} {seconds:.1f} s", file=sys.stderr, flush=True)
    last[0] = now
    return seconds
  return phase


def _lower_and_compile(jitted, args, phase, seconds: dict):
  """``jitted`` lowered for ``args`` and compiled, each timed as its own
  phase (``_phases``) into ``seconds["lower"]`` and ``seconds["compile"]``;
  returns the lowered and the compiled step."""
  lowered = jitted.lower(*args)
  seconds["lower"] = phase("step lower")
  compiled = lowered.compile()
  seconds["compile"] = phase("step compile")
  return lowered, compiled


# XLA's debug option as jax's compiler_options spell it: no command buffers.
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


def _trace_program(lowered, compiled, phase):
  """The step of ``lowered`` (``compiled``) compiled again for the profiler
  trace, with XLA's command buffers off (``NO_COMMAND_BUFFERS``) on a GPU: inside a
  command buffer the trace names a kernel's buffer, not its op, and the
  grouped GEMMs and te_jax's kernels could not be told apart by part. Same
  kernels, launched one by one; the timed steps keep the command buffers.
  On a CPU (no command buffers) ``compiled`` itself."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "gpu":
    return compiled
  traced = lowered.compile(compiler_options=NO_COMMAND_BUFFERS)
  phase("step compiled again without command buffers (for the trace)")
  return traced


def _one(part, row, args) -> dict:
  if part == "layer":
    return run_layer(row, args.small, args.k, args.repeats, args.profile_steps,
                     args.top_kernels, args.layer_sizes)
  from model_memory import parse_overrides  # pylint: disable=import-error,import-outside-toplevel
  return run_model(row, args.small, args.k, args.repeats, args.profile_steps,
                   parse_overrides(args.model_set), args.top_kernels)


def _child(part, row, args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{part}:{row}", "--k",
         str(args.k), "--repeats", str(args.repeats), "--profile-steps",
         str(args.profile_steps), "--top-kernels", str(args.top_kernels),
         "--layer-sizes", args.layer_sizes] + (
             ["--small"] if args.small else []) + (
             ["--model-set", args.model_set] if args.model_set else [])
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=HERE,
                          check=False)
  except subprocess.TimeoutExpired as e:
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    done = [l[len("phase: "):] for l in err.splitlines() if l.startswith("phase: ")]
    raise RuntimeError(f"timed out after {args.timeout} s; phases done: "
                       f"{'; '.join(done) or 'none (still importing, or in the init phase)'}") from None
  line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
  if not line:
    raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                       else f"exit {proc.returncode}")
  return json.loads(line[0][5:])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parts", default="layer,model", help="layer, model or both")
  p.add_argument("--recipes", default=",".join(RECIPES),
                 help="none,delayed,current,blockwise (the layer part also takes ragged_dot; "
                      "it always runs none and ragged_dot as its baselines)")
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  p.add_argument("--profile-steps", type=int, default=2, help="steps in the kernel trace")
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--layer-sizes", default="full", choices=[n for n in LAYER_SIZES if n != "small"],
                 help="the layer rows' sizes (LAYER_SIZES): full, the moe preset's layer; wide, "
                      "GEMM-bound experts")
  p.add_argument("--model-set", default="",
                 help="Config overrides on the model part's preset, e.g. "
                      "hidden=2048,layers=8,experts=32,mlp=1408 (model_memory.py's --set)")
  p.add_argument("--top-kernels", type=int, default=0,
                 help="print each row's N GPU kernels with the most time, their part and HLO op")
  p.add_argument("--in-process", action="store_true",
                 help="every row in this process (default: a fresh process each)")
  p.add_argument("--timeout", type=int, default=900, help="seconds per row")
  p.add_argument("--json-out", help="write the rows so far to this JSON file after each")
  p.add_argument("--one", help=argparse.SUPPRESS)   # part:row, print one JSON line
  args = p.parse_args(argv)
  if args.one:
    part, row = args.one.split(":")
    print("JSON " + json.dumps(_one(part, row, args)), flush=True)
    return 0
  recipes = [r for r in args.recipes.split(",") if r]
  bad = [r for r in recipes if r not in LAYER_ROWS]
  if bad:
    p.error(f"unknown recipe(s) {bad}; choose from {LAYER_ROWS}")
  todo = []
  for part in [q for q in args.parts.split(",") if q]:
    if part not in ("layer", "model"):
      p.error(f"--parts takes layer and/or model, got {part!r}")
    rows = list(dict.fromkeys(["none"] + recipes + (["ragged_dot"] if part == "layer"
                                                     else [])))
    todo += [(part, row) for row in rows if part == "layer" or row != "ragged_dot"]
  results, ok = [], True
  for part, row in todo:
    try:
      r = _one(part, row, args) if args.in_process else _child(part, row, args)
      results.append(r)
      kinds = dict(r["kernels_ms"] or {})
      top = kinds.pop("top", [])
      by_name = kinds.pop("by_name", {})
      print(f"{part} {row}: {r['ms']:.2f} ms/step, kernels {kinds}", file=sys.stderr,
            flush=True)
      for ms, kind, name in top:
        print(f"  {ms:8.3f} ms  {kind:9s} {name}", file=sys.stderr, flush=True)
      for kind, rows in by_name.items():  # each part's budget by kernel name
        for ms, n, name in rows:
          print(f"  {kind:9s} {ms:8.3f} ms  {n:5.0f} launches  {name}", file=sys.stderr,
                flush=True)
      if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
          json.dump(results, fh, indent=1)
    except Exception as err:  # pylint: disable=broad-except
      ok = False
      print(f"{part} {row}: FAILED {type(err).__name__}: {err}", file=sys.stderr, flush=True)
  print(format_tables(results, args))
  return 0 if ok and results else 1


if __name__ == "__main__":
  sys.exit(main())
