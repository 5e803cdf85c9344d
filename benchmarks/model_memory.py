"""Where the memory of ``examples/train_gpt.py``'s training step goes, per recipe.

Two views, FP8 recipes side by side with bf16 (recipe ``none``):

* ``compile`` (default; for the GPU): for a preset, batch sizes and recipes,
  each in a fresh process, lowers and compiles the example's own jitted
  train step (no run, no parameters allocated) and prints
  ``memory_analysis()`` (arguments, temp, output, alias, peak; host
  memory too with ``--offload_optimizer``) in one table. With ``--dump DIR``
  XLA dumps the step's buffer assignment there (``--xla_dump_to``) and the
  N largest buffers live at the peak are printed with the jax operation that
  made each (the op_name of the HLO instruction's metadata), per recipe.
* ``residuals`` (runs anywhere, traces only): every array the step's
  backward pass reads from its forward pass (``jax.vjp``'s residuals: the
  custom VJPs' and XLA's alike), with its bytes, summed per layer and
  sublayer, against bf16. Arrays that are the step's own arguments
  (parameters, FP8 state; also through a reshape) are kept anyway and
  counted apart. On a CPU the attention core is XLA's (it keeps its
  probabilities), on a GPU cuDNN's; that row differs, the FP8-vs-bf16
  comparison of the others does not.

A recipe written ``<recipe>+keep`` (e.g. ``delayed+keep``) runs with
:func:`keep_fp8_copies`: the fused norm layers keep their FP8 copies for the
backward instead of quantizing again there (before/after in one table).

  python3 benchmarks/model_memory.py --batches 4,8 --recipes none,delayed,blockwise
  python3 benchmarks/model_memory.py --dump /tmp/xla_mem --top 25 --batches 8
  python3 benchmarks/model_memory.py residuals --preset llama --set layers=1,batch=1
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import glob
import json
import math
import os
import re
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
GIB = float(1 << 30)
MIB = float(1 << 20)
STATS = ("argument", "temp", "output", "alias", "peak")
HOST_STATS = ("host_argument", "host_temp", "host_output")


KEEP = "+keep"


@contextlib.contextmanager
def keep_fp8_copies(enabled: bool = True):
  """Within (inside an ``fp8_autocast``): the fused norm and MLP blocks keep
  the FP8 copies of their inputs and kernels for the backward, the residual
  plan before they quantized again there. That is the autocast's
  ``keep_fp8_copies=True``; a te_jax from before that option gets the same by
  ``save_original_input`` / ``save_original_kernel`` = False on its two fused
  functions (the modules look both up at call time), and an older one always
  keeps its copies. Nothing changes with ``enabled`` False."""
  import inspect  # pylint: disable=import-outside-toplevel
  import te_jax  # pylint: disable=import-outside-toplevel
  from te_jax import autocast, fused_mlp, norm_dense  # pylint: disable=import-outside-toplevel
  if not enabled:
    yield
    return
  if "keep_fp8_copies" in inspect.signature(te_jax.fp8_autocast).parameters:
    ctx = autocast.get_fp8_context()
    with te_jax.fp8_autocast(enabled=ctx.enabled, fp8_recipe=ctx.recipe,
                             mesh_resource=ctx.mesh_resource, keep_fp8_copies=True,
                             store_act_input_in_fp8=ctx.store_act_input_in_fp8):
      yield
    return
  saved = [(m, n, getattr(m, n)) for m, n in ((fused_mlp, "fp8_mlp"),
                                              (norm_dense, "fp8_norm_dense"))]
  if "save_original_input" in inspect.signature(saved[0][2]).parameters:
    for module, name, fn in saved:
      setattr(module, name, functools.partial(fn, save_original_input=False,
                                              save_original_kernel=False))
  try:
    yield
  finally:
    for module, name, fn in saved:
      setattr(module, name, fn)


def split_recipe(name: str):
  """``("delayed", True)`` for ``"delayed+keep"``, ``(name, False)`` otherwise."""
  return (name[:-len(KEEP)], True) if name.endswith(KEEP) else (name, False)


# ----------------------------------------------------- residuals (traced) --

class Residual(NamedTuple):
  """One array the backward pass reads from the forward pass.

  nbytes: its size. shape, dtype: its aval's. where: the jax name stack of
  the operation that made it (Flax module path, e.g.
  ``jvp(GPT)/layer_0/mlp``). source: ``file:line`` of that operation.
  argument: True when it is an argument of the differentiated function (a
  parameter; also through reshapes), hence alive anyway.
  """

  nbytes: int
  shape: tuple
  dtype: str
  where: str
  source: str
  argument: bool


# Primitives whose output XLA lays over its input (no new buffer).
_ALIASING = ("reshape", "squeeze", "expand_dims", "optimization_barrier")


def saved_residuals(f, *args) -> List[Residual]:
  """The residuals of ``jax.vjp(f, *args)``, each distinct array once.

  Traces only (``args`` may be ``jax.ShapeDtypeStruct`` trees). Like
  ``jax.ad_checkpoint.print_saved_residuals``, with sizes, the producer's
  name stack, and arguments told apart.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
  from jax.extend import core  # pylint: disable=import-outside-toplevel

  leaves, tree = jax.tree.flatten(args)
  closed, shapes = jax.make_jaxpr(
      lambda *a: jax.vjp(lambda *b: f(*jax.tree.unflatten(tree, b)), *a),
      return_shape=True)(*leaves)
  jaxpr = closed.jaxpr
  n_res = len(jax.tree.leaves(shapes[1]))
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)

  def origin(v):
    """The argument ``v`` aliases (through reshapes and barriers), or None."""
    while v not in inputs:
      e = producer.get(v)
      if e is None or e.primitive.name not in _ALIASING:
        return None
      v = e.invars[e.outvars.index(v) if e.primitive.name == "optimization_barrier" else 0]
    return v

  rows, seen = [], set()
  for v in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
    if isinstance(v, core.Literal) or v in seen:
      continue
    seen.add(v)
    aval = v.aval
    nbytes = math.prod(aval.shape) * aval.dtype.itemsize
    e = producer.get(v)
    where = str(e.source_info.name_stack) if e is not None else "<argument>"
    frame = source_info_util.user_frame(e.source_info.traceback) if e is not None else None
    source = f"{os.path.basename(frame.file_name)}:{frame.start_line}" if frame else ""
    rows.append(Residual(nbytes, tuple(aval.shape), str(aval.dtype), where, source,
                         origin(v) is not None))
  return rows


def layer_of(where: str) -> str:
  """``layer_3/mlp`` from a name stack like ``jvp(GPT)/layer_3/mlp/mlp.foo``:
  the module path (no transforms, no method scopes)."""
  parts = [p for p in where.split("/") if p and "(" not in p and "." not in p]
  return "/".join(parts) or "(model)"


def residual_bytes_by_layer(rows: List[Residual], depth: int = 2) -> Dict[str, int]:
  """{module path cut to ``depth`` parts: bytes} of the non-argument residuals."""
  out = collections.defaultdict(int)
  for r in rows:
    if not r.argument:
      out["/".join(layer_of(r.where).split("/")[:depth])] += r.nbytes
  return dict(out)


def model_residuals(recipe: str, overrides: dict) -> List[Residual]:
  """The residuals of the example GPT's loss (``train_gpt.loss_fn``) for a
  preset with ``overrides`` (Config fields), traced on abstract values."""
  sys.path.insert(0, EXAMPLES)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import te_jax  # pylint: disable=import-outside-toplevel
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel

  recipe, keep = split_recipe(recipe)
  cfg = train_gpt.Config(recipe=recipe, out_dir=None, **overrides).resolved()
  model = train_gpt.GPT(train_gpt.VOCAB_SIZE, cfg.hidden, cfg.layers, cfg.heads, cfg.mlp,
                        dtype=jnp.dtype(cfg.dtype), arch=cfg.arch, kv_groups=cfg.kv_groups)
  rec = train_gpt.make_recipe(recipe, cfg.amax_history_len)
  shape = (cfg.batch, cfg.seq_len)
  tokens = jnp.zeros(shape, jnp.int32)
  batch = (tokens, tokens + 1, jnp.broadcast_to(jnp.arange(cfg.seq_len, dtype=jnp.int32), shape))
  # The Config's residual choice reaches this autocast as the trainer's.
  store = {"store_act_input_in_fp8": True} if cfg.store_act_input_in_fp8 else {}
  with te_jax.fp8_autocast(enabled=rec is not None, fp8_recipe=rec, **store), \
       keep_fp8_copies(keep or cfg.keep_fp8_copies):
    variables = nn.meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), *batch)))
    return saved_residuals(lambda v: train_gpt.loss_fn(model, v, batch)[0], variables)


def residual_table(recipes, overrides: dict, top: int = 0) -> str:
  """Markdown: MiB of non-argument residuals per layer/sublayer and recipe,
  with each FP8 recipe's ratio to bf16 per row; then the ``top`` largest
  residuals of ``layer_0`` per recipe."""
  per = {r: model_residuals(r, overrides) for r in recipes}
  by = {r: residual_bytes_by_layer(rows, depth=3) for r, rows in per.items()}
  keys = sorted(set().union(*by.values()))
  base = by.get("none")
  head = "| layer | " + " | ".join(f"{r} MiB" for r in recipes) + " |"
  lines = [f"Residuals of the train step's backward, {overrides or 'preset'} "
           "(parameters and other arguments excluded)", "", head,
           "|---|" + "---:|" * len(recipes)]
  for k in keys + ["total"]:
    vals = {r: (sum(b.values()) if k == "total" else b.get(k, 0)) for r, b in by.items()}
    cells = []
    for r in recipes:
      cell = f"{vals[r] / MIB:.1f}"
      ref = (sum(base.values()) if k == "total" else base.get(k, 0)) if base else 0
      if r != "none" and ref:
        cell += f" ({vals[r] / ref:.2f}x)"
      cells.append(cell)
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  for r, rows in per.items():
    if not top:
      break
    lines += ["", f"{r}: largest residuals of layer_0", ""]
    mine = sorted((x for x in rows if layer_of(x.where).startswith("layer_0")),
                  key=lambda x: -x.nbytes)[:top]
    lines += [f"    {x.nbytes / MIB:9.2f} MiB {x.dtype}{list(x.shape)} {layer_of(x.where)} "
              f"{x.source}{' (argument)' if x.argument else ''}" for x in mine]
  return "\n".join(lines)


# ---------------------------------------------------- compiled (XLA) ------

def compile_step(preset: str, recipe: str, batch: int, overrides: dict,
                 offload_optimizer: bool = False):
  """Lowers and compiles train_gpt's train step for ``batch`` rows (abstract
  state and batch: nothing is allocated); returns the compiled executable."""
  sys.path.insert(0, EXAMPLES)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import train_gpt  # pylint: disable=import-error,import-outside-toplevel

  kw = dict(overrides)
  recipe, keep = split_recipe(recipe)
  if offload_optimizer:
    kw["offload_optimizer"] = True
  cfg = train_gpt.Config(preset=preset, recipe=recipe, batch=batch, out_dir=None,
                         progress=False, eval_batches=0, **kw)
  trainer = train_gpt.Trainer(cfg)
  rows = jax.ShapeDtypeStruct((batch, trainer.cfg.seq_len), jnp.int32)
  with trainer._ctx(), keep_fp8_copies(keep):  # pylint: disable=protected-access
    state = jax.eval_shape(trainer._init, jax.random.PRNGKey(0))  # pylint: disable=protected-access
    return trainer._step.lower(state, (rows,) * 3).compile()  # pylint: disable=protected-access


def memory_stats(compiled) -> Dict[str, int]:
  """``memory_analysis()`` as {name: bytes} (``STATS`` and ``HOST_STATS``)."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in STATS if k != "peak"}
  out["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  out.update({k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in HOST_STATS})
  return out


_REMAT = re.compile(r"^\s*(?:ROOT )?%?([\w\-]+(?:\.[\w\-]+)*\.remat\d*(?:\.[\w\-]+)*) = ",
                    re.MULTILINE)


def remat_instructions(hlo_text: str) -> int:
  """How many instructions of a compiled HLO module XLA's rematerialization
  pass made (it names each copy ``<original>.remat<n>``): above zero, the
  compiler recomputed values to fit the device's memory, so the step's
  memory figure is what it squeezed the program into, at the cost of the
  recomputation, not what the program needs."""
  return len(set(_REMAT.findall(hlo_text)))


_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^\s+([\w.\-]+)\{[^}]*\}: (\d+) bytes")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')
_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


def op_names(hlo_text: str) -> Dict[str, str]:
  """{HLO instruction name: op_name of its metadata} of an HLO module's text."""
  out = {}
  for line in hlo_text.splitlines():
    m = _OP_NAME.match(line)
    if m:
      out[m.group(1)] = m.group(2)
  return out


def peak_buffers(live_range_text: str) -> List[tuple]:
  """[(instruction, bytes)] live at the peak, from XLA's ``*-live-range.txt``
  dump (its "Live ranges at N (peak)" section), largest first."""
  rows, inside = [], False
  for line in live_range_text.splitlines():
    if _PEAK.match(line):
      inside = True
      continue
    if inside:
      m = _LIVE.match(line)
      if not m:
        break
      rows.append((m.group(1), int(m.group(2))))
  return sorted(rows, key=lambda r: -r[1])


def temp_values(buffer_assignment_text: str) -> List[tuple]:
  """[(instruction, bytes, shape)] of the values in the temp allocation of
  XLA's ``*-buffer-assignment.txt`` dump, largest first (where no live-range
  dump exists: values sharing an offset are not live at once)."""
  rows, inside = [], False
  for line in buffer_assignment_text.splitlines():
    if line.startswith("allocation "):
      inside = "preallocated-temp" in line
      continue
    m = _VALUE.match(line) if inside else None
    if m:
      rows.append((m.group(1), int(m.group(2)), m.group(3)))
  return sorted(rows, key=lambda r: -r[1])


def summarize_dump(dump_dir: str, top: int) -> Dict[str, object]:
  """The largest buffers at the peak of the train step's dump in ``dump_dir``,
  each with its op_name: {"source": file, "buffers": [(name, bytes, op_name)]}."""
  def newest(pattern):
    files = sorted(glob.glob(os.path.join(dump_dir, f"*train_step*{pattern}")),
                   key=os.path.getmtime)
    return files[-1] if files else None

  hlo = newest("after_optimizations.txt")
  names = op_names(open(hlo, encoding="utf-8").read()) if hlo else {}
  live = newest("live-range.txt")
  if live:
    rows = [(n, b, "") for n, b in peak_buffers(open(live, encoding="utf-8").read())]
  else:
    assignment = newest("buffer-assignment.txt")
    if assignment is None:
      return {"source": None, "buffers": []}
    rows = temp_values(open(assignment, encoding="utf-8").read())
  buffers = [(n, b, names.get(n, "")) for n, b, _ in rows[:top]]
  return {"source": os.path.basename(live or assignment), "buffers": buffers}


def run_one(args) -> Dict[str, object]:
  """One (recipe, batch) in this process: its memory stats (and peak buffers)."""
  recipe, batch = args.one.split(":")
  compiled = compile_step(args.preset, recipe, int(batch), parse_overrides(args.set),
                          args.offload_optimizer)
  out = {"recipe": recipe, "batch": int(batch), "stats": memory_stats(compiled),
         "remat": remat_instructions(compiled.as_text())}
  if args.dump:
    out["peak"] = summarize_dump(os.path.join(args.dump, f"{recipe}_b{batch}"), args.top)
  return out


def child(args, recipe: str, batch: int) -> Dict[str, object]:
  """Runs one (recipe, batch) in a fresh process (XLA flags of its own)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if args.dump:
    where = os.path.join(os.path.abspath(args.dump), f"{recipe}_b{batch}")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_dump_to={where} --xla_dump_hlo_module_re=.*train_step.*")
  cmd = [sys.executable, os.path.abspath(__file__), "compile", "--one", f"{recipe}:{batch}",
         "--preset", args.preset, "--top", str(args.top)] + (
             ["--set", args.set] if args.set else []) + (
             ["--dump", os.path.abspath(args.dump)] if args.dump else []) + (
             ["--offload_optimizer"] if args.offload_optimizer else [])
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout,
                        check=False)
  line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
  if not line:
    tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return {"recipe": recipe, "batch": batch, "error": tail}
  return json.loads(line[0][5:])


def format_compiled(results, args) -> str:
  """The memory table (GiB; ratios of arguments + temp against bf16 of the
  same batch) and each run's largest peak buffers."""
  host = any(r.get("stats", {}).get("host_argument") for r in results)
  cols = ["arguments", "temp", "output", "alias", "peak", "args+temp", "vs bf16"]
  if host:
    cols += ["host arguments", "host temp"]
  cols += ["XLA remat copies"]
  lines = [f"### train_gpt.py --preset {args.preset} {args.set or ''}: compiled train step "
           f"memory (GiB){' with --offload_optimizer' if args.offload_optimizer else ''}", "",
           "| batch | recipe | " + " | ".join(cols) + " |",
           "|---:|---|" + "---:|" * len(cols)]
  base = {r["batch"]: r["stats"] for r in results if r["recipe"] == "none" and "stats" in r}
  for r in results:
    if "stats" not in r:
      lines.append(f"| {r['batch']} | {r['recipe']} | FAILED: {r['error'][:200]} |")
      continue
    s = r["stats"]
    total = s["argument"] + s["temp"]
    ref = base.get(r["batch"])
    vs = f"{total / (ref['argument'] + ref['temp']):.3f}x" if ref else "-"
    cells = [f"{s[k] / GIB:.2f}" for k in ("argument", "temp", "output", "alias", "peak")]
    cells += [f"{total / GIB:.2f}", vs]
    if host:
      cells += [f"{s['host_argument'] / GIB:.2f}", f"{s['host_temp'] / GIB:.2f}"]
    cells += [str(r.get("remat", "-"))]
    lines.append(f"| {r['batch']} | {r['recipe']} | " + " | ".join(cells) + " |")
  for r in results:
    peak = r.get("peak")
    if not peak:
      continue
    lines += ["", f"batch {r['batch']}, {r['recipe']}: largest buffers at the peak "
              f"({peak['source']})", ""]
    lines += [f"    {b / MIB:10.1f} MiB  {n}  {op}" for n, b, op in peak["buffers"]]
  return "\n".join(lines)


def parse_overrides(text: Optional[str]) -> dict:
  """``"layers=2,hidden=512,dtype=bfloat16"`` -> Config overrides (ints,
  floats, booleans and strings as written)."""
  out = {}
  for item in filter(None, (text or "").split(",")):
    key, _, val = item.partition("=")
    if not _:
      raise SystemExit(f"--set takes name=value pairs, got {item!r}")
    for conv in (int, float):
      try:
        out[key] = conv(val)
        break
      except ValueError:
        continue
    else:
      out[key] = {"true": True, "false": False}.get(val.lower(), val)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("mode", nargs="?", default="compile", choices=("compile", "residuals"))
  p.add_argument("--preset", default="llama", help="a train_gpt.py preset")
  p.add_argument("--recipes", default="none,delayed,blockwise",
                 help="comma-separated train_gpt recipes (none = bf16)")
  p.add_argument("--batches", default="4,8", help="comma-separated batch sizes (compile)")
  p.add_argument("--set", default="", help="Config overrides, e.g. layers=2,hidden=512")
  p.add_argument("--dump", default=None,
                 help="compile: dump XLA's buffer assignment under this directory and "
                      "print the largest buffers live at the peak")
  p.add_argument("--top", type=int, default=20, help="buffers (residuals) listed per run")
  p.add_argument("--jobs", type=int, default=2, help="compile: processes at once")
  p.add_argument("--timeout", type=int, default=540, help="compile: seconds per process")
  p.add_argument("--offload_optimizer", action="store_true",
                 help="compile: train_gpt's --offload_optimizer (host memory columns)")
  p.add_argument("--json-out", help="compile: write the results to this JSON file")
  p.add_argument("--one", help=argparse.SUPPRESS)   # recipe:batch in this process
  args = p.parse_args(argv)
  recipes = [r for r in args.recipes.split(",") if r]
  if args.mode == "residuals":
    overrides = dict(preset=args.preset, **parse_overrides(args.set))
    print(residual_table(recipes, overrides, args.top))
    return 0
  if args.one:
    print("JSON " + json.dumps(run_one(args)), flush=True)
    return 0
  jobs = [(r, int(b)) for b in args.batches.split(",") if b for r in recipes]
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    results = list(pool.map(lambda rb: child(args, *rb), jobs))
  for r in results:
    if "error" in r:
      print(f"batch {r['batch']} {r['recipe']}: FAILED {r['error']}", file=sys.stderr)
  if args.json_out:
    with open(args.json_out, "w", encoding="utf-8") as fh:
      json.dump(results, fh, indent=1)
  print(format_compiled(results, args))
  return 0 if all("stats" in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
