"""te_jax beside its peers: Transformer Engine for JAX and Flax's FP8 op, one process.

Times training steps of the same two blocks in each library, in one run:

* MLP block: LayerNorm, 4096 -> 16384 gelu -> 4096, plus the residual;
  x (8, 2048, 4096) bf16;
* TransformerLayer: hidden 4096, 32 heads, ffn 16384, causal self
  attention, gelu, no bias, no dropout;

for te_jax (FP8 off, DelayedScaling, Float8CurrentScaling,
Float8BlockScaling), TE-JAX (off, DelayedScaling, Float8CurrentScaling; when
``transformer_engine.jax`` imports, else skipped with a note; it has no
blockwise recipe) and Flax (bf16 and ``Fp8DirectDotGeneralOp``, MLP only).
Compute is bf16 everywhere. Parameters are bf16 by default
(``--param-dtype``): TE-JAX's modules take one ``dtype`` for both, so its
rows (built with ``dtype=bf16``) hold bf16 parameters (their optimized HLO
takes ``bf16[4096,16384]`` kernels), and te_jax and Flax get
``param_dtype=bf16`` to match. ``--param-dtype float32`` gives te_jax and
Flax their float32 default (the te_jax rows of runs T and U, before
2026-12-03's run V): each weight is then converted or quantized from float32 and its
gradient written in float32, which TE-JAX's bf16 rows do not pay.

Protocol (the issue's, as a user comparing libraries would): a step is
``jit(value_and_grad(mean(y**2), argnums=(variables, x)))``; every
non-``params`` collection is replaced by its gradient after each step (what
``TrainState.apply_gradients`` does for te_jax's and Flax's
``_overwrite_with_gradient`` and TE-JAX's ``fp8_metas``: the delayed-scaling
state advances; a frozen state makes gradients underflow and the backward
GEMMs multiply zeros, which is faster), two inputs alternate, 3 warm-up
steps, then ``--repeats`` timings of ``--k`` back-to-back steps, median.
Printed per row: ms per step, the ratio to the same library's FP8-off step,
max |dx| (0 means a frozen state), and the step's temporary memory from
``compiled.memory_analysis()``.

Usage::

  python3 benchmarks/bench_peers.py                      # full sizes (H200)
  python3 benchmarks/bench_peers.py --small --k 2 --repeats 1   # CPU smoke test
  python3 benchmarks/bench_peers.py --libs te_jax,flax --blocks mlp
  python3 benchmarks/bench_peers.py --libs te_jax,te --profile   # + kernel time by kind

Accumulation: te_jax's per-tensor recipes accumulate the dgrad and wgrad
GEMMs in split (float32-promoted) mode by default; TE-JAX 2.20.2 runs every
FP8 GEMM with fast accumulation unless
``NVTE_FP8_GEMM_HIGH_PRECISION_ACCUMULATION=1`` (its
``cpp_extensions/gemm.py``). ``--fastacc`` adds te_jax rows with fast
accumulation in every GEMM ("te_jax delayed fastacc", "te_jax current
fastacc"): the like-for-like rows beside TE-JAX's defaults.

``--backward-chunks N`` adds te_jax delayed and blockwise rows whose MLP
backward runs on N token chunks (``LayerNormMLP.backward_chunks``), e.g.
"te_jax delayed chunks4": their temp memory and step time against the
unchunked rows. ``--act-input-fp8`` adds delayed and blockwise rows that
keep the activation's input for the backward in E4M3
(``store_act_input_in_fp8``; "te_jax delayed chunks4 h-e4m3" with the
chunks). ``--keep-fp8-copies`` adds delayed, current and blockwise rows
that keep the forward's FP8 copies of norm(x) and the kernels for the
backward (``keep_fp8_copies``, "te_jax delayed keep"): the memory plan's
second quantize passes skipped, for one byte per element held longer.

With ``--profile`` each row also traces ``--profile-steps`` (3) carried
steps (``jax.profiler``) and reports kernel time per step by kind (GEMM,
attention, te_jax's own kernels, other, idle) and its largest kernels, so a
gap between the libraries can be located kernel by kernel in one call.

With ``--clocks`` a background ``nvidia-smi`` samples the SM clock, and each
row shows its mean clock over its timed steps and the share of samples held
down by the power cap: on the H200 these steps run capped, so two rows can
differ by the energy they spend as well as by their kernels.

``--rounds N`` times every row N times, the row order reversed in every
other round, and reports each row's median (its samples in ``ms_rounds``):
under the cap the same step moved by up to 3% between samples
(2026-12-04, run AB), more than the gaps between the libraries, and in one
round TE-JAX's rows always come after te_jax's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import flax.linen as nn

import te_jax
from te_jax import flax as tfx
from te_jax import recipe as recipe_lib

# pylint: disable=import-error  (benchmarks/ is on sys.path)
from _fp8_carry import run_steps, time_steps
from _gpu_clocks import ClockLog
from bench_layer import kernel_profile
from bench_model import KINDS, kernel_kind
# pylint: enable=import-error

LIBS = ("te_jax", "te", "flax")
BLOCKS = ("mlp", "layer")
BF16 = jnp.bfloat16


def sizes(small: bool):
  if small:
    return dict(batch=2, seq=128, hidden=256, mlp=512, heads=4)
  return dict(batch=8, seq=2048, hidden=4096, mlp=16384, heads=32)


class _Residual(nn.Module):
  """``x + block(x)`` (blocks that return a tuple give their first entry)."""
  block: nn.Module

  @nn.compact
  def __call__(self, x):
    y = self.block(x)
    y = y[0] if isinstance(y, tuple) else y
    return x + y.astype(x.dtype)


# ------------------------------------------------------------ the libraries --

def te_jax_rows(block, sz, fastacc=False, param_dtype=BF16, backward_chunks=1,
                act_input_fp8=False, keep_fp8_copies=False):
  """[(label, module, autocast context factory)] for te_jax; with ``fastacc``
  also delayed and current scaling with fast accumulation in every GEMM;
  with ``backward_chunks`` > 1 also delayed and blockwise scaling with the
  MLP's backward on that many token chunks ("delayed chunks4"); with
  ``act_input_fp8`` also delayed and blockwise scaling keeping the
  activation's input for the backward in E4M3 (``store_act_input_in_fp8``,
  "delayed h-e4m3"), with the chunks too when there are any; with
  ``keep_fp8_copies`` also delayed, current and blockwise scaling keeping
  the forward's FP8 copies for the backward ("delayed keep"); with both of
  the last two also delayed and blockwise doing both ("delayed keep
  h-e4m3")."""
  recipes = {"off": None, "delayed": recipe_lib.DelayedScaling(),
             "current": recipe_lib.Float8CurrentScaling(),
             "blockwise": recipe_lib.Float8BlockScaling()}
  if fastacc:
    fast = dict(fast_accum_fprop=True, fast_accum_dgrad=True, fast_accum_wgrad=True)
    recipes["delayed fastacc"] = recipe_lib.DelayedScaling(**fast)
    recipes["current fastacc"] = recipe_lib.Float8CurrentScaling(**fast)
  # (row name, recipe, chunks, store_act_input_in_fp8, keep_fp8_copies)
  specs = [(name, r, 1, False, False) for name, r in recipes.items()]
  if backward_chunks > 1:
    specs += [(f"{name} chunks{backward_chunks}", recipes[name], backward_chunks, False, False)
              for name in ("delayed", "blockwise")]
  if act_input_fp8:
    chunked = f" chunks{backward_chunks}" if backward_chunks > 1 else ""
    specs += [(f"{name}{chunked} h-e4m3", recipes[name], backward_chunks, True, False)
              for name in ("delayed", "blockwise")]
  if keep_fp8_copies:
    specs += [(f"{name} keep", recipes[name], 1, False, True)
              for name in ("delayed", "current", "blockwise")]
  if keep_fp8_copies and act_input_fp8:
    # both: the kept copies' speed in less memory than the default plan's
    # (the Llama preset compiled for an H100: 0.83x bf16, default 0.84x)
    specs += [(f"{name} keep h-e4m3", recipes[name], 1, True, True)
              for name in ("delayed", "blockwise")]
  rows = []
  for name, r, chunks, h_fp8, keep in specs:
    if block == "mlp":
      m = _Residual(tfx.LayerNormMLP(intermediate_dim=sz["mlp"], activations=("gelu",),
                                     dtype=BF16, param_dtype=param_dtype,
                                     backward_chunks=chunks))
    else:
      m = tfx.TransformerLayer(sz["hidden"], sz["mlp"], sz["heads"], layer_type="decoder",
                               activations=("gelu",), dtype=BF16, param_dtype=param_dtype,
                               mlp_backward_chunks=chunks)
    ctx = lambda r=r, h_fp8=h_fp8, keep=keep: te_jax.fp8_autocast(
        enabled=r is not None, fp8_recipe=r, store_act_input_in_fp8=h_fp8, keep_fp8_copies=keep)
    rows.append((f"te_jax {name}", m, ctx))
  return rows


def te_rows(block, sz):
  """The same rows for Transformer Engine for JAX, or (None, reason)."""
  try:
    import transformer_engine.jax as te  # pylint: disable=import-outside-toplevel
    import transformer_engine.jax.flax as te_flax  # pylint: disable=import-outside-toplevel
    from transformer_engine.common import recipe as te_recipe  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    return None, f"transformer_engine.jax does not import here ({type(e).__name__}: {e})"
  autocast = getattr(te, "autocast", None) or getattr(te, "fp8_autocast")
  recipes = {"off": None, "delayed": te_recipe.DelayedScaling(),
             "current": te_recipe.Float8CurrentScaling()}
  rows = []
  for name, r in recipes.items():
    if block == "mlp":
      m = _Residual(te_flax.LayerNormMLP(intermediate_dim=sz["mlp"], activations=("gelu",),
                                         dtype=BF16))
    else:
      m = te_flax.TransformerLayer(
          hidden_size=sz["hidden"], mlp_hidden_size=sz["mlp"],
          num_attention_heads=sz["heads"], layer_type=te_flax.TransformerLayerType.ENCODER,
          self_attn_mask_type="causal", mlp_activations=("gelu",),
          enable_relative_embedding=False, hidden_dropout=0.0, attention_dropout=0.0,
          intermediate_dropout=0.0, dtype=BF16, transpose_batch_sequence=False)

    def ctx(r=r):
      if r is None:
        return autocast(enabled=False)
      try:
        return autocast(enabled=True, recipe=r)
      except TypeError:   # older name of the argument
        return autocast(enabled=True, fp8_recipe=r)
    rows.append((f"TE-JAX {name}", m, ctx))
  return rows, ""


def flax_rows(block, sz, param_dtype=BF16):
  """Flax's own blocks (MLP only): bf16 and ``Fp8DirectDotGeneralOp``."""
  if block != "mlp":
    return []
  from flax.linen import fp8_ops  # pylint: disable=import-outside-toplevel
  op = getattr(fp8_ops, "Fp8DirectDotGeneralOp", None) or fp8_ops.Fp8DotGeneralOp

  class FlaxMLP(nn.Module):
    fp8: bool

    @nn.compact
    def __call__(self, x):
      kw = {"dot_general_cls": op} if self.fp8 else {}
      y = nn.LayerNorm(epsilon=1e-6, dtype=BF16, param_dtype=param_dtype)(x)
      y = nn.Dense(sz["mlp"], use_bias=False, dtype=BF16, param_dtype=param_dtype, **kw)(y)
      y = nn.gelu(y, approximate=True)
      return nn.Dense(sz["hidden"], use_bias=False, dtype=BF16, param_dtype=param_dtype,
                      **kw)(y)

  none = lambda: _NullContext()
  return [("Flax off", _Residual(FlaxMLP(False)), none),
          (f"Flax {op.__name__}", _Residual(FlaxMLP(True)), none)]


class _NullContext:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


# ------------------------------------------------------------------ timing --

def split_label(label):
  """A row label's (library, recipe): "te_jax delayed fastacc" ->
  ("te_jax", "delayed fastacc")."""
  lib, recipe = label.split(" ", 1)
  return lib, recipe


def keep_rows(rows, recipes):
  """The rows whose recipe (the label after the library's name) is in
  ``recipes``; ValueError naming any recipe no row has."""
  recipes = [r.strip() for r in recipes]
  names = {split_label(label)[1] for label, _, _ in rows}
  unknown = [r for r in recipes if r not in names]
  if unknown:
    raise ValueError(f"--recipes: no row is named {unknown}; the rows are {sorted(names)}")
  return [row for row in rows if split_label(row[0])[1] in recipes]


def merge_rounds(samples):
  """One row's result from its rounds' results: the first round's other
  fields (memory, |dx|, clock, profile) with ``ms`` the median over the
  rounds and every round's in ``ms_rounds``; a round that failed makes the
  row failed."""
  failed = [r for r in samples if "ms" not in r]
  if failed:
    return failed[0]
  merged = dict(samples[0])
  merged["ms_rounds"] = [r["ms"] for r in samples]
  merged["ms"] = statistics.median(merged["ms_rounds"])
  return merged


def carry_state(variables, grads):
  """The next step's variables: every non-``params`` collection is its gradient."""
  return {k: (v if k == "params" else grads[k]) for k, v in variables.items()}


def train_step(module):
  """The timed step of one block: ``jit(value_and_grad(mean(y**2), (params,
  x)))`` (also compiled by tools/deviceless_peers_memory.py)."""
  def loss(v, x):
    y = module.apply(v, x, rngs={"dropout": jax.random.key(2)})
    y = y[0] if isinstance(y, tuple) else y
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_row(module, ctx, sz, k, repeats, profile=False, hlo_path=None, profile_steps=3):
  """{"ms", "dx_abs_max", "temp_mib", "window"} of one block's training step.

  ``window`` is the wall-clock [start, end] (Unix seconds) of the timed
  steps: the H200 runs these steps at its power cap with lowered clocks,
  and ``_gpu_clocks.ClockLog`` (``--clocks``) reads the clock over it.

  With ``profile``, also ``kernel_ms`` (per step over ``profile_steps``
  traced steps, by kind and "idle"),
  ``largest`` ([name, ms per step, launches per step] of the 12 largest) and
  ``kernels`` (the same for every kernel, for the JSON file). With
  ``hlo_path``, the compiled step's optimized HLO is written there: XLA's
  kernels in a trace are named after its fusions (``loop_add_fusion``), and
  the HLO says what each one computes.
  """
  b, s, e = sz["batch"], sz["seq"], sz["hidden"]
  xs = [jax.random.normal(jax.random.key(i + 1), (b, s, e), BF16) for i in range(2)]
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  with ctx():
    variables = nn.unbox(jax.jit(module.init)(rngs, xs[0]))
    variables = dict(variables)
    compiled = train_step(module).lower(variables, xs[0]).compile()
  if hlo_path:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(compiled.as_text())
  temp = None
  try:
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
  except Exception:  # pylint: disable=broad-except
    temp = None

  times, variables, out = time_steps(compiled, variables, xs, k, repeats, carry_state)
  end = time.time()   # the timings ran back to back just before: their span ends here
  window = [round(end - sum(times) * k / 1e3, 3), round(end, 3)]
  dx = float(jnp.max(jnp.abs(out[1][1].astype(jnp.float32))))
  row = {"ms": statistics.median(times), "dx_abs_max": dx, "temp_mib": temp, "window": window}
  if profile:   # the state keeps advancing from where the timing left it
    kernels, total, span, _ = kernel_profile(
        lambda n: run_steps(compiled, variables, xs, n, carry_state)[1], steps=profile_steps,
        top=10**6)
    by_kind = dict.fromkeys(KINDS, 0.0)
    for name, ms, _ in kernels:
      by_kind[kernel_kind(name)] += ms
    by_kind["idle"] = max(span - total, 0.0)
    row["kernel_ms"] = {kind: round(ms, 3) for kind, ms in by_kind.items()}
    row["largest"] = [[name[:120], round(ms, 3), n] for name, ms, n in kernels[:12]]
    row["kernels"] = [[name, round(ms, 4), n] for name, ms, n in kernels]
  return row


def kernel_table(results):
  """Markdown: kernel ms per step by kind for every profiled row."""
  kinds = KINDS + ("idle",)
  lines = ["| block | row | " + " | ".join(f"{k} ms" for k in kinds) + " |",
           "|---|---|" + "---:|" * len(kinds)]
  for block, rows in results.items():
    for label, r in rows:
      if "kernel_ms" in r:
        lines.append(f"| {block} | {label} | "
                     + " | ".join(f"{r['kernel_ms'][k]:.3f}" for k in kinds) + " |")
  return "\n".join(lines) if len(lines) > 2 else ""


def peer_table(results):
  """Markdown: each te_jax row's step time over TE-JAX's row of the same
  recipe (a fast-accumulation row against TE-JAX's plain one, which
  accumulates fast by default); "" when no row pairs up."""
  lines = ["| block | te_jax row | TE-JAX row | te_jax / TE-JAX |", "|---|---|---|---|"]
  for block, rows in results.items():
    te = {split_label(label)[1]: r for label, r in rows if split_label(label)[0] == "TE-JAX"}
    for label, r in rows:
      lib, recipe = split_label(label)
      if lib != "te_jax" or "ms" not in r:
        continue
      recipe = recipe.removesuffix(" fastacc")
      peer = te.get(recipe)
      if peer is not None and "ms" in peer:
        lines.append(f"| {block} | {label} | TE-JAX {recipe} | {r['ms'] / peer['ms']:.3f} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def table(results, notes):
  """Markdown: ms, ratio to the library's own FP8-off row, max |dx|, temp MiB;
  with a clock log (``--clocks``) also the row's mean SM clock and the share
  of its samples held down by the power cap."""
  with_clock = any(r.get("clock") for rows in results.values() for _, r in rows)
  lines = ["| block | row | ms / step | vs own FP8 off | max abs dx | temp MiB |"
           + (" SM MHz (power-capped) |" if with_clock else ""),
           "|---|---|---|---|---|---|" + ("---|" if with_clock else "")]
  for block, rows in results.items():
    base = {}
    for label, r in rows:
      lib, recipe = split_label(label)
      if recipe == "off" and "ms" in r:   # a failed off row leaves no base
        base[lib] = r["ms"]
    for label, r in rows:
      lib = split_label(label)[0]
      ratio = f"{base[lib] / r['ms']:.3f}x" if lib in base and "ms" in r else "-"
      if "error" in r:
        lines.append(f"| {block} | {label} | failed: {r['error'][:80]} | | | |")
        continue
      temp = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.0f}"
      clock = ""
      if with_clock:
        c = r.get("clock")
        clock = " - |" if not c else f" {c['sm_mhz']:.0f} ({c['power_capped']:.0%}) |"
      lines.append(f"| {block} | {label} | {r['ms']:.3f} | {ratio} | {r['dx_abs_max']:.3g} "
                   f"| {temp} |" + clock)
  return "\n".join(lines + [f"\nNote: {n}" for n in notes])


def block_rows(block, libs, sz, args, notes):
  """The rows of ``block`` for the chosen libraries, in timing order; a
  library that cannot run adds its reason to ``notes`` instead."""
  rows = []
  if "te_jax" in libs:
    rows += te_jax_rows(block, sz, args.fastacc, jnp.dtype(args.param_dtype),
                        args.backward_chunks, args.act_input_fp8, args.keep_fp8_copies)
  if "te" in libs:
    te, why = te_rows(block, sz)
    if te is not None:
      rows += te
    elif why not in notes:
      notes.append(why)
  if "flax" in libs:
    rows += flax_rows(block, sz, jnp.dtype(args.param_dtype))
  return rows


def time_sample(block, label, module, ctx, sz, args, clocks, first_round: bool):
  """One timing of one row (:func:`time_row`) with its clock (``--clocks``);
  a failure becomes the row's {"error"}. The HLO dump and the trace
  (``--hlo-dir``, ``--profile``) are taken in the first round only."""
  hlo_path = None
  if args.hlo_dir and first_round:
    os.makedirs(args.hlo_dir, exist_ok=True)
    hlo_path = os.path.join(args.hlo_dir, f"{block}_{label.replace(' ', '_')}.hlo.txt")
  try:
    r = time_row(module, ctx, sz, args.k, args.repeats, args.profile and first_round,
                 hlo_path, args.profile_steps)
  except Exception as e:  # pylint: disable=broad-except
    r = {"error": f"{type(e).__name__}: {e}"}
  if clocks is not None and "window" in r:
    r["clock"] = clocks.summary(*r["window"])
  return r


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--libs", default=",".join(LIBS), help=f"subset of {LIBS}")
  p.add_argument("--blocks", default=",".join(BLOCKS), help=f"subset of {BLOCKS}")
  p.add_argument("--k", type=int, default=10, help="back-to-back steps per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  p.add_argument("--json-out", help="also write the results so far to this JSON file "
                                     "after each row")
  p.add_argument("--profile", action="store_true",
                 help="also trace --profile-steps steps per row: kernel time by kind, "
                      "largest kernels (every kernel in the --json-out file)")
  p.add_argument("--profile-steps", type=int, default=3,
                 help="steps in each --profile trace (default 3; a short trace runs at a "
                      "higher clock than the timed steps under the power cap)")
  p.add_argument("--clocks", action="store_true",
                 help="sample the SM clock with nvidia-smi and report each row's mean clock "
                      "and its share of samples held down by the power cap")
  p.add_argument("--fastacc", action="store_true",
                 help="add te_jax delayed/current rows with fast accumulation in every GEMM "
                      "(TE-JAX 2.20.2's default)")
  p.add_argument("--backward-chunks", type=int, default=1,
                 help="N > 1: add te_jax delayed/blockwise rows with the MLP backward on N "
                      "token chunks (LayerNormMLP.backward_chunks; less memory, more time)")
  p.add_argument("--act-input-fp8", action="store_true",
                 help="add te_jax delayed/blockwise rows that keep the activation's input "
                      "in E4M3 for the backward (store_act_input_in_fp8; with "
                      "--backward-chunks, chunked too)")
  p.add_argument("--keep-fp8-copies", action="store_true",
                 help="add te_jax delayed/current/blockwise rows that keep the forward's FP8 "
                      "copies of norm(x) and the kernels for the backward (keep_fp8_copies)")
  p.add_argument("--recipes", help="only these rows of each library, by recipe name "
                                    "(e.g. 'off' or 'off,delayed fastacc'); default all")
  p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="te_jax's and Flax's parameter dtype (TE-JAX's rows hold bf16 "
                      "parameters either way: its dtype=bf16 sets both)")
  p.add_argument("--rounds", type=int, default=1,
                 help="time every row this many times, reversing the row order in every "
                      "other round; a row's ms is the median over the rounds")
  p.add_argument("--hlo-dir", help="write each row's optimized HLO to DIR/<block>_<row>.hlo.txt "
                                   "(what XLA's fusions in the profile compute)")
  args = p.parse_args(argv)
  libs, blocks = args.libs.split(","), args.blocks.split(",")
  for name, got, allowed in (("--libs", libs, LIBS), ("--blocks", blocks, BLOCKS)):
    bad = [g for g in got if g not in allowed]
    if bad:
      p.error(f"{name}: unknown {bad}; choose from {allowed}")
  for name, value in (("--backward-chunks", args.backward_chunks), ("--rounds", args.rounds)):
    if value < 1:
      p.error(f"{name} must be >= 1, got {value}")
  sz = sizes(args.small)
  notes, results = [], {}
  clocks = ClockLog.start() if args.clocks else None
  if args.clocks and clocks is None:
    notes.append(ClockLog.why_not)
  # The background nvidia-smi must not outlive a failed run.
  with clocks or contextlib.nullcontext():
    for block in blocks:
      rows = block_rows(block, libs, sz, args, notes)
      if args.recipes:   # an A/B of one change times only the rows it touches
        try:
          rows = keep_rows(rows, args.recipes.split(","))
        except ValueError as e:
          p.error(str(e))
      samples = {label: [] for label, _, _ in rows}
      for rnd in range(args.rounds):
        # Every other round backwards: no row is always timed first under the cap.
        for label, module, ctx in (rows if rnd % 2 == 0 else rows[::-1]):
          r = time_sample(block, label, module, ctx, sz, args, clocks, rnd == 0)
          shown = {key: v for key, v in r.items() if key != "kernels"}
          print(json.dumps({"block": block, "row": label, "round": rnd, **shown}), flush=True)
          samples[label].append(r)
          results[block] = [(row, merge_rounds(samples[row])) for row, _, _ in rows
                            if samples[row]]
          if args.json_out:   # a call cut short keeps the rows it finished
            with open(args.json_out, "w", encoding="utf-8") as f:
              json.dump({"sizes": sz, "param_dtype": args.param_dtype, "rounds": args.rounds,
                         "results": results, "notes": notes}, f, indent=1)
          jax.clear_caches()
          gc.collect()
  print(f"\njax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"sizes {sz}, k={args.k}, repeats={args.repeats}, rounds={args.rounds}, "
        f"te_jax/Flax parameters {args.param_dtype}")
  print(table(results, notes))
  versus = peer_table(results)
  if versus:
    print("\nte_jax / TE-JAX, same recipe (below 1: te_jax faster):\n" + versus)
  if args.profile:
    print(f"\nGPU kernel time per step ({args.profile_steps}-step trace):\n"
          + kernel_table(results))


if __name__ == "__main__":
  main()
