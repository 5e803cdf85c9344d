"""The runs of ``bench_train_scaling.py``: mesh names, the worker, the checks.

``parse_mesh`` reads a mesh name (``ep8``, ``ep4_tp2_sp``, ``fsdp8``, ...).
``worker`` runs in a subprocess started by the benchmark: it trains the runs
of one job (all on the same devices) with ``examples/train_gpt.py``'s
``Trainer``, compiling their steps in parallel threads first, and prints one
``JSON`` line per run with what the checks read: per-step losses, timings,
the collectives of the partitioned step, the real tokens of each device's
rows and the sizes the design predicts. The ``check_*`` functions are pure
(no jax), so the benchmark's parent process, which must not touch the GPUs,
runs them; each returns ``(ok, detail)`` with ``ok`` None where the check
does not apply.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import time
import traceback

AXES = ("dp", "ep", "fsdp", "tp")
FLOAT_DTYPES = ("bf16", "f16", "f32", "f64")
# Recipe names of the runs without FP8: "none" computes in the preset's dtype,
# "bf16" in bfloat16 whatever the preset's.
FP8_OFF = ("none", "bf16")
FP8_DTYPES = ("f8e4m3fn", "f8e5m2")
# The model parts that keep float weights (gpt_model.GPT), as a jax op name
# ("jit(train_step)/.../lm_head/dot_general") or a parameter path
# ("state.params['params']['lm_head']['kernel']", newer jax) names them.
_HIGHER_PRECISION_OP = re.compile(r"""(^|[/'\[])(embed|lm_head)([/'\]\\]|$)""")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MESH_PART = re.compile(r"^(dp|ep|fsdp|tp)([1-9][0-9]*)$")


def parse_mesh(name: str) -> dict:
  """``"ep4_tp2_sp"`` -> ``{"dp": 1, "ep": 4, "fsdp": 1, "tp": 2, "sp": True}``.

  A name is ``_``-separated parts: ``dp<n>``, ``ep<n>``, ``fsdp<n>``,
  ``tp<n>`` (each at most once; absent axes are 1) and ``sp`` (sequence
  parallelism over tp; needs tp > 1). Raises ValueError naming the bad part.
  """
  mesh = dict.fromkeys(AXES, 1)
  mesh["sp"] = False
  seen = set()
  for part in name.split("_"):
    m = _MESH_PART.match(part)
    key = m.group(1) if m else part
    if key in seen or not (m or part == "sp"):
      raise ValueError(f"mesh {name!r}: part {part!r} is repeated or not one of dp<n>, "
                       "ep<n>, fsdp<n>, tp<n>, sp (e.g. ep8, ep4_tp2_sp, fsdp8, dp2_fsdp2_tp2)")
    seen.add(key)
    if m:
      mesh[key] = int(m.group(2))
    else:
      mesh["sp"] = True
  if mesh["sp"] and mesh["tp"] < 2:
    raise ValueError(f"mesh {name!r}: sp (sequence parallelism) splits tokens over tp; "
                     "add tp<n> with n >= 2")
  return mesh


def mesh_size(mesh: dict) -> int:
  return math.prod(mesh[a] for a in AXES)


# ------------------------------------------------------------- worker ----

def _trainer_class(train_gpt):
  """train_gpt's Trainer, recording each step's real tokens per device."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  class ScalingTrainer(train_gpt.Trainer):
    """Trainer with ``token_counts[step]``: the real (segment id > 0) tokens
    of the rows each local device was fed."""

    def _build(self):
      self.token_counts = {}
      super()._build()

    def fuse_qkv(self):
      # Every mesh and its one-device baselines with one parameter layout
      # (the same initial weights): the one tensor parallelism takes.
      return False

    def batch(self, step, docs=None):
      arrays = super().batch(step, docs)
      if docs is None:   # a training batch (not evaluation): outside the step's timing
        shards = sorted(arrays[1].addressable_shards, key=lambda s: s.device.id)
        self.token_counts[step] = [int((np.asarray(s.data) > 0).sum()) for s in shards]
      return arrays

  return ScalingTrainer


def _expectations(trainer, abstract_state, rows: int, mesh: dict) -> dict:
  """What the design predicts of the partitioned step (see the checks)."""
  import jax  # pylint: disable=import-outside-toplevel
  cfg, out = trainer.cfg, {}
  moe = trainer.model.moe
  if moe is not None and mesh["ep"] > 1:
    from te_jax.moe import dispatch, experts  # pylint: disable=import-outside-toplevel
    tokens = rows // trainer.batch_shards * cfg.seq_len   # per ep rank (SP gathers over tp)
    assignments = tokens * moe.num_experts_per_token
    block = experts.token_block(trainer.recipe)
    capacity = (dispatch.capacity_rows(moe.capacity_factor, assignments, moe.num_experts, block)
                if moe.capacity_factor else None)
    seg = dispatch.segment_rows(assignments, moe.num_experts // mesh["ep"], block, capacity)
    out["all_to_all"] = {"shape": [mesh["ep"] * seg, cfg.hidden], "count": 4 * cfg.layers,
                         "segment_rows": seg, "assignments": assignments}
  out["tokens"] = {"rows": rows, "seq_len": cfg.seq_len, "batch_shards": trainer.batch_shards}
  if mesh["fsdp"] > 1:
    layer = []

    def visit(path, leaf, shd):
      keys = [str(getattr(k, "key", k)) for k in path]
      axes = [[a for a in (e if isinstance(e, tuple) else (e,)) if a] for e in shd.spec]
      if (any(k.startswith("layer_") for k in keys) and keys[-1].endswith("kernel")
          and "router" not in keys[-1] and any("fsdp" in a for a in axes)):
        local = shd.shard_shape(leaf.shape)   # this shard, then its fsdp dim gathered
        layer.append([d * mesh["fsdp"] if "fsdp" in a else d for d, a in zip(local, axes)])

    jax.tree_util.tree_map_with_path(visit, abstract_state.params["params"],
                                     trainer.state_sharding.params["params"])
    out["fsdp"] = {"layer_kernels": layer}
  return out


def _prepare(spec: dict, train_gpt):
  """(trainer, lowered step, expectations) of one run spec."""
  import jax  # pylint: disable=import-outside-toplevel
  mesh = spec["mesh"]
  bf16 = spec["recipe"] == "bf16"
  cfg = train_gpt.Config(recipe="none" if bf16 else spec["recipe"], preset=spec["preset"],
                         steps=spec["steps"], batch=spec["batch"], layers=spec.get("layers"),
                         num_docs=spec.get("num_docs"), dtype="bfloat16" if bf16 else None,
                         dp=mesh["dp"], ep=mesh["ep"], fsdp=mesh["fsdp"], tp=mesh["tp"],
                         sp=mesh["sp"], out_dir=None, sample_chars=0, eval_batches=0, progress=False,
                         log_every=10**9)
  trainer = _trainer_class(train_gpt)(cfg)
  # pylint: disable=protected-access  # the Trainer's jitted init and step, lowered
  with trainer._ctx():
    abstract = jax.eval_shape(trainer._init, jax.random.PRNGKey(cfg.seed))
    batch = trainer.batch(0)
    lowered = trainer._step.lower(abstract, batch)
  # pylint: enable=protected-access
  expect = _expectations(trainer, abstract, batch[0].shape[0], mesh)
  return trainer, lowered, expect


def _compile(lowered, sharded: bool):
  """(compiled, partitioned HLO text or None, seconds)."""
  from te_jax import hlo_inspect  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  if sharded:
    text, compiled = hlo_inspect.partitioned_hlo(lowered)
  else:
    text, compiled = None, lowered.compile()
  return compiled, text, time.perf_counter() - t0


def _memory(compiled) -> dict | None:
  try:
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes)}
  except Exception:  # pylint: disable=broad-except  # not every backend reports it
    return None


def worker(job: dict, compile_threads: int = 1) -> None:
  """Trains ``job["runs"]`` in this process; prints ``JSON {...}`` per run.

  Every run is first traced (one after the other: the autocast is process
  state) and compiled (``compile_threads`` at a time: XLA's compiler runs
  outside the GIL), then trained one after the other, so no two runs share
  the devices while timed. A run's step is the one compiled executable for
  all its steps (it takes no other shapes). With ``job["num_processes"]`` >
  1 this is process ``job["process_id"]`` of a ``jax.distributed`` run; only
  process 0 prints.
  """
  import jax  # pylint: disable=import-outside-toplevel
  # The persistent compilation cache keys programs without XLA's dump flags:
  # a hit would skip the passes that write the partitioned HLO the checks read.
  jax.config.update("jax_enable_compilation_cache", False)
  if job.get("num_processes", 1) > 1:
    jax.distributed.initialize(job["coordinator"], job["num_processes"], job["process_id"],
                               local_device_ids=job.get("local_device_ids"))
  import numpy as np  # pylint: disable=import-outside-toplevel
  import train_gpt  # pylint: disable=import-outside-toplevel,import-error  # examples/

  def emit(rec):
    if jax.process_index() == 0:
      print("JSON " + json.dumps(rec), flush=True)

  prepared = {}
  for i, spec in enumerate(job["runs"]):
    try:
      prepared[i] = _prepare(spec, train_gpt)
    except Exception as e:  # pylint: disable=broad-except  # reported, the others go on
      emit(dict(run_head(spec), error=_error(e)))
  sharded = mesh_size(job["runs"][0]["mesh"]) > 1
  with concurrent.futures.ThreadPoolExecutor(max(1, compile_threads)) as pool:
    futures = {i: pool.submit(_compile, p[1], sharded) for i, p in prepared.items()}
  for i, (trainer, _, expect) in prepared.items():
    spec = job["runs"][i]
    try:
      compiled, text, compile_s = futures[i].result()
      trainer._step = compiled  # pylint: disable=protected-access
      res = train_gpt.train(trainer.cfg, trainer)
    except Exception as e:  # pylint: disable=broad-except
      emit(dict(run_head(spec), error=_error(e)))
      continue
    emit(dict(run_head(spec), losses=res["losses"], final_loss=res["final_loss"],
              step_time_s=res["step_time_s"], tokens_per_s=res["tokens_per_s"],
              step_times=[float(t) for t in np.asarray(res["step_times"])],
              params=res["params"], devices=res["devices"], processes=res["processes"],
              dtype=trainer.cfg.dtype, compile_s=compile_s, memory=_memory(compiled),
              token_counts=_all_token_counts(trainer, res["steps"]),
              collectives=_collectives(text or ""), expect=expect))
    del res, trainer._step   # pylint: disable=protected-access  # the final state, the executable


def _collectives(hlo_text: str) -> list:
  """[kind, dtype, shape, bytes per device, jax op name] of every collective
  result in ``hlo_text`` (``te_jax.hlo_inspect.collectives``, line by line to
  keep each one's op name: which part of the model it serves)."""
  from te_jax import hlo_inspect  # pylint: disable=import-outside-toplevel
  out = []
  for line in hlo_text.splitlines():
    for c in hlo_inspect.collectives(line):
      op = _OP_NAME.search(line)
      out.append([c.kind, c.dtype, list(c.shape), c.bytes, op.group(1) if op else "?"])
  return out


def _all_token_counts(trainer, steps) -> list:
  """[step][device] real tokens fed, over the devices of every process (a
  collective with several processes: each knows only its own devices')."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  local = np.asarray([trainer.token_counts[s] for s in steps], np.int32)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    every = np.asarray(multihost_utils.process_allgather(local))   # (processes, steps, local)
    local = np.concatenate(list(every), axis=-1)
  return local.tolist()


def run_head(spec: dict) -> dict:
  """The fields that name a run (also of a record without results)."""
  return {k: spec[k] for k in ("name", "recipe", "mesh", "batch", "steps", "preset")}


def _error(e: Exception) -> str:
  return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


# ------------------------------------------------------------- checks ----

def check_finished(rec: dict):
  """No hang, no error: every step ran and every loss is finite."""
  if "error" in rec:
    return False, rec["error"].splitlines()[-1][:300]
  losses = rec["losses"]
  finite = all(math.isfinite(x) for x in losses)
  return (len(losses) == rec["steps"] and finite,
          f"{len(losses)}/{rec['steps']} steps, losses {'finite' if finite else 'NOT finite'}")


def check_parity(rec: dict, ref: dict, first_rtol: float, final_rtol: float):
  """The losses of ``rec`` against ``ref`` (the same global batch):
  step 0 (same parameters, same batch: rounding only) within ``first_rtol``,
  the final loss (mean of the last steps) within ``final_rtol``."""
  if "error" in rec or ref is None or "error" in ref:
    return False, "no reference run" if ref is None or "error" in ref else "run failed"
  if len(rec["losses"]) != len(ref["losses"]) or not rec["losses"]:
    return False, f"{len(rec['losses'])} steps vs the reference's {len(ref['losses'])}"
  first = abs(rec["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
  final = abs(rec["final_loss"] / ref["final_loss"] - 1)
  ok = first <= first_rtol and final <= final_rtol
  return ok, (f"step 0 rel. diff {first:.2e} (<= {first_rtol:g}), final loss "
              f"{rec['final_loss']:.4f} vs {ref['final_loss']:.4f}, rel. diff {final:.2e} "
              f"(<= {final_rtol:g})")


def check_token_counts(rec: dict):
  """Packed rows give each device a different number of real tokens (in
  the same static shapes), on at least one step."""
  counts = [c for c in rec.get("token_counts") or [] if c]
  if not counts or len(counts[0]) < 2:
    return None, ""
  differ = sum(len(set(c)) > 1 for c in counts)
  return differ > 0, (f"real tokens per device differ in {differ}/{len(counts)} steps "
                      f"(step 0: {counts[0]})")


def check_moe_all_to_all(rec: dict):
  """Expert parallelism moves tokens by all-to-all in buffers of a size
  fixed at trace time: every float all-to-all of the step is (ep x S, hidden)
  with S the dropless bound of this device's assignments (independent of
  the routing), 4 per MoE layer (dispatch and combine, forward and
  backward); every step ran that one executable."""
  exp = (rec.get("expect") or {}).get("all_to_all")
  if exp is None:
    return None, ""
  a2a = [c for c in rec["collectives"] if c[0] == "all-to-all" and c[1] in FLOAT_DTYPES]
  shapes = sorted({tuple(c[2]) for c in a2a})
  ok = len(a2a) == exp["count"] and shapes == [tuple(exp["shape"])]
  return ok, (f"{len(a2a)} float all-to-alls (expected {exp['count']}), shapes {shapes} "
              f"(expected {tuple(exp['shape'])}: ep x S, S = {exp['segment_rows']} rows hold "
              f"any routing of this device's {exp['assignments']} assignments); every step "
              "ran this one executable")


def _dim_runs(shape) -> set:
  """Products of consecutive dims of ``shape``: the dims of its reshapes
  that merge neighbours (a kernel (H, N, D) gathered as (H, N*D))."""
  return {math.prod(shape[i:j]) for i in range(len(shape)) for j in range(i + 1, len(shape) + 1)}


def _is_view_of(shape, kernel) -> bool:
  runs = _dim_runs(kernel)
  return math.prod(shape) == math.prod(kernel) and all(d in runs for d in shape if d != 1)


def check_fsdp_gathers(rec: dict):
  """FSDP with an FP8 recipe: every layer weight sharded over fsdp is
  all-gathered in FP8 (at least one FP8 all-gather per such weight, at
  least one byte per element in all; a blockwise shard's rows are padded to
  128) and none in a float type (a float all-gather of the weight's
  gathered shape or a reshape merging neighbouring dims, unless its jax op
  name puts it in the embedding or the LM head, which stay in higher
  precision by design, as do norms and router). FP8 off: not checked (XLA partitions the
  float program its own way); its float gathers are reported."""
  exp = (rec.get("expect") or {}).get("fsdp")
  if exp is None or not exp["layer_kernels"]:
    return None, ""
  gathers = [c[1:3] + c[4:] for c in rec["collectives"] if c[0] == "all-gather"]
  if rec["recipe"] in FP8_OFF:
    floats = [(d, math.prod(sh)) for d, sh, _ in gathers if d in FLOAT_DTYPES]
    return None, (f"FP8 off, partitioned by XLA (not checked): {len(floats)} float all-gathers "
                  f"of {sum(n for _, n in floats) / 2**20:.2f} M elements in "
                  f"{sorted({d for d, _ in floats})}")
  fp8_elements = [math.prod(sh) for d, sh, _ in gathers if d in FP8_DTYPES]
  float_w = [(d, tuple(sh), op) for d, sh, op in gathers
             if d in FLOAT_DTYPES and not _HIGHER_PRECISION_OP.search(op)
             and any(_is_view_of(sh, k) for k in exp["layer_kernels"])]
  n, need = len(exp["layer_kernels"]), sum(math.prod(k) for k in exp["layer_kernels"])
  got = sum(fp8_elements)
  return len(fp8_elements) >= n and got >= need and not float_w, (
      f"{len(fp8_elements)} FP8 all-gathers of {got / 2**20:.2f} MiB for {n} layer weights of "
      f"{need / 2**20:.2f} M elements; float gathers of a layer weight: {float_w or 'none'}")


def check_activation_gathers(rec: dict):
  """No float all-gather of a whole batch's activations (a dim of all the
  rows x seq_len tokens, or leading (rows, seq_len)): tokens stay split over
  the batch axes; only sequence parallelism gathers over tp, and MoE moves
  tokens by all-to-all. FP8 off: reported, not checked."""
  exp = (rec.get("expect") or {}).get("tokens")
  if exp is None or exp["batch_shards"] < 2:
    return None, ""
  rows, seq = exp["rows"], exp["seq_len"]
  full = [c[1:3] + c[4:] for c in rec["collectives"] if c[0] == "all-gather"
          and c[1] in FLOAT_DTYPES and (rows * seq in c[2] or tuple(c[2][:2]) == (rows, seq))]
  shown = "; ".join(f"{d}{tuple(sh)} at {op}" for d, sh, op in full[:3])
  more = f"; {len(full) - 3} more" if len(full) > 3 else ""
  detail = f"float all-gathers holding all {rows} x {seq} tokens: {shown or 'none'}{more}"
  if rec["recipe"] in FP8_OFF:
    return None, "FP8 off, partitioned by XLA (not checked): " + detail
  return not full, detail
