"""examples/train_gpt.py on 1 GPU and on N-GPU meshes: parity, scaling, collectives.

For one preset (``--preset``: ``moe``, ``llama``, ``h200``, or ``moe_tiny`` /
``llama_tiny`` / ``tiny`` for CPU smoke runs) and each recipe of
``--recipes`` (``none``: FP8 off in the preset's dtype, bf16 for the GPU
presets; ``bf16``: FP8 off in bfloat16), trains the same model on the same
packed documents for ``--steps`` steps:

* ``1gpu_b``: one GPU, ``--per_device_batch`` rows (the scaling baseline);
* ``1gpu_nb``: one GPU, N x that batch (the parity baseline: the global
  batch of the N-GPU runs);
* each mesh of ``--meshes`` with N x the batch, i.e. the same rows per batch
  shard as ``1gpu_b``. A mesh name joins ``dp<n>``, ``ep<n>`` (experts split
  over n devices), ``fsdp<n>``, ``tp<n>`` and ``sp`` (sequence parallelism
  over tp, which train_gpt has no flag for: the worker's Trainer sets it in
  its mesh resource): ``ep8``, ``ep4_tp2_sp``, ``fsdp8``, ``dp2_fsdp2_tp2``;
* ``--two_process MESH``: that mesh once more as two ``jax.distributed``
  processes with half the GPUs each (the multi-host path, on one host), for
  the first FP8 recipe of ``--recipes``.

Prints a table (final loss and its ratio to ``1gpu_nb``, ms/step, tokens/s,
scaling efficiency = tokens/s / (N x tokens/s of ``1gpu_b``), tokens/s
against the FP8-off run of the same mesh, compiled memory per device), the
collectives of each partitioned step (``te_jax.hlo_inspect``), the seconds
each job took, then one ``PASS``/``FAIL`` line per check (``INFO`` for what
is only reported), and exits 1 if any fails:

* finished: every step ran (no hang: each job has ``--timeout`` seconds),
  every loss finite;
* parity: against ``1gpu_nb`` (and a two-process run against the same mesh
  in one process): step 0 within ``--first_rtol`` (2e-3: the same
  parameters and batch, rounding only), the final loss (mean of the last 10
  steps) within ``--loss_rtol`` (1e-2). A sharded run differs from the
  1-GPU run only in the order of its float sums, which FP8 rounding and
  top-k routing amplify over the steps; the dense 2-GPU runs of
  docs/benchmarks-log-2026-11.md stayed far inside 1e-2, which is below the
  loss gap between the FP8 recipes and bf16 there;
* packed tokens: the packed rows give the devices different real token counts;
* all-to-all (meshes with ``ep``), FSDP weight gathers (``fsdp``) and
  activation gathers (more than one batch shard): the design's collectives,
  see ``check_moe_all_to_all``, ``check_fsdp_gathers`` and
  ``check_activation_gathers`` in ``_train_scaling_run.py``.

Scheduling: a job is runs that share devices; 1-GPU runs are spread over
all GPUs at once (as many jobs as GPUs), each mesh is one job holding its
devices alone, its recipes compiled in parallel threads and then timed one
after the other. Logs per process in ``--log_dir``.

  python benchmarks/bench_train_scaling.py --preset moe --layers 4 \\
      --meshes ep8,ep4_tp2_sp --two_process ep8 --per_device_batch 1 --steps 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import _train_scaling_run as runs_lib  # pylint: disable=import-error  # beside this file

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
_ONE = {"dp": 1, "ep": 1, "fsdp": 1, "tp": 1, "sp": False}
BASELINES = ("1gpu_b", "1gpu_nb")


def plan_jobs(args, n: int, one_device_slots: int) -> list:
  """The jobs of a run: 1-device runs in ``one_device_slots`` contiguous
  chunks, one job per mesh, the two-process job last."""
  base = dict(preset=args.preset, steps=args.steps, layers=args.layers, num_docs=args.num_docs)
  recipes = [r for r in args.recipes.split(",") if r]
  b = args.per_device_batch
  ones = [dict(base, name=name, recipe=r, mesh=_ONE, batch=rows)
          for r in recipes for name, rows in zip(BASELINES, (b, n * b))]
  per = -(-len(ones) // max(1, min(one_device_slots, len(ones))))
  jobs = [dict(name=f"1gpu_{i // per}", devices=1, processes=1, runs=ones[i:i + per])
          for i in range(0, len(ones), per)]
  for m in [m for m in args.meshes.split(",") if m]:
    mesh = runs_lib.parse_mesh(m)
    jobs.append(dict(name=m, devices=runs_lib.mesh_size(mesh), processes=1,
                     runs=[dict(base, name=m, recipe=r, mesh=mesh, batch=n * b)
                           for r in recipes]))
  if args.two_process:
    mesh = runs_lib.parse_mesh(args.two_process)
    fp8 = [r for r in recipes if r not in runs_lib.FP8_OFF] or recipes
    jobs.append(dict(name=f"{args.two_process}@2proc", devices=runs_lib.mesh_size(mesh),
                     processes=2, runs=[dict(base, name=f"{args.two_process}@2proc",
                                             recipe=fp8[0], mesh=mesh, batch=n * b)]))
  return jobs


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(job: dict, devices: list, fake: bool, log_dir: str, compile_threads: int) -> list:
  """Starts the job's processes (each in its own session); returns
  [(Popen, log path)]. Process i uses the i-th share of ``devices``."""
  per = job["devices"] // job["processes"]
  coordinator = f"127.0.0.1:{_free_port()}" if job["processes"] > 1 else None
  threads = compile_threads or (1 if fake else len(job["runs"]))
  procs = []
  for i in range(job["processes"]):
    env = dict(os.environ)
    # The worker imports examples/train_gpt.py (examples/ is not a package).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_EXAMPLES, env.get("PYTHONPATH")) if p)
    if fake:   # exactly as many fake CPU devices as this process holds
      flags = [f for f in env.get("XLA_FLAGS", "").split()
               if not f.startswith("--xla_force_host_platform_device_count")]
      env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
          flags + [f"--xla_force_host_platform_device_count={per}"]))
    else:   # every process sees all the job's GPUs (NCCL's peer-to-peer paths), uses its share
      env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    local = None if fake or job["processes"] == 1 else list(range(i * per, (i + 1) * per))
    spec = dict(job, process_id=i, num_processes=job["processes"], coordinator=coordinator,
                local_device_ids=local)
    log = os.path.join(log_dir, f"{job['name']}.p{i}.log".replace("/", "_"))
    with open(log, "w") as fh:
      procs.append((subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec),
           "--compile_threads", str(threads)], env=env, stdout=fh, stderr=subprocess.STDOUT,
          start_new_session=True), log))
  return procs


def _stop(procs) -> None:
  for p, _ in procs:   # our own processes, by their ids (each leads its own group)
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def _records(job: dict, procs, why: str | None) -> list:
  """One record per run of the job: process 0's JSON lines, an error for
  each run without one (``why``, or the end of a failing process's log)."""
  with open(procs[0][1]) as fh:
    got = [json.loads(l[5:]) for l in fh.read().splitlines() if l.startswith("JSON ")]
  by = {(r["recipe"], r["name"]): r for r in got}
  tails = []
  for p, log in procs:
    if p.returncode:
      with open(log) as fh:
        tails.append(f"{os.path.basename(log)} exit {p.returncode}: "
                     + " | ".join(fh.read().strip().splitlines()[-3:]))
  reason = why or "; ".join(tails) or "no result"
  return [by.get((s["recipe"], s["name"])) or _failed(s, reason) for s in job["runs"]]


def _failed(spec: dict, why: str) -> dict:
  """The record of a run that gave no result."""
  return dict(runs_lib.run_head(spec), error=why)


def run_jobs(jobs: list, n_dev: int, max_jobs: int, fake: bool, args) -> list:
  """Runs the jobs, each on devices of its own, at most ``max_jobs`` at once,
  in order (a job waits until enough devices are free). A job past
  ``--timeout`` is killed; none starts after ``--deadline``. Returns (the
  runs' records, {job name: seconds})."""
  t_end = time.time() + (args.deadline or 1e9)
  queue, running, free, out, seconds = list(jobs), [], list(range(n_dev)), [], {}
  while queue or running:
    while queue and len(running) < max_jobs and queue[0]["devices"] <= len(free):
      job = queue.pop(0)
      if time.time() > t_end - 10:
        out.extend(_failed(s, "not started: --deadline") for s in job["runs"])
        continue
      devs, free = free[:job["devices"]], free[job["devices"]:]
      procs = _launch(job, devs, fake, args.log_dir, args.compile_threads)
      running.append((job, devs, procs, time.time()))
      print(f"started {job['name']} ({len(job['runs'])} runs) on devices {devs}",
            file=sys.stderr, flush=True)
    if queue and queue[0]["devices"] > n_dev:
      job = queue.pop(0)
      out.extend(_failed(s, f"needs {job['devices']} devices, {n_dev} here")
                 for s in job["runs"])
      continue
    time.sleep(0.2)
    for entry in list(running):
      job, devs, procs, t0 = entry
      done = all(p.poll() is not None for p, _ in procs)
      late = time.time() - t0 > args.timeout or time.time() > t_end
      if done or late:
        _stop(procs)
        recs = _records(job, procs, None if done else f"killed after {time.time() - t0:.0f} s "
                        "(--timeout/--deadline): a hang or too slow")
        for r in recs:   # the whole record, so a log cut short keeps it
          print("JSON " + json.dumps(r), file=sys.stderr, flush=True)
        out.extend(recs)
        seconds[job["name"]] = time.time() - t0
        running.remove(entry)
        free = sorted(free + devs)
  return out, seconds


def checks(results: list, first_rtol: float, loss_rtol: float) -> list:
  """[(ok, check name, run, detail)] of every check that applies or reports
  (ok None: information only)."""
  by = {(x["recipe"], x["name"]): x for x in results}
  out = []
  for x in results:
    run = f"{x['recipe']}/{x['name']}"
    found = [("finished", runs_lib.check_finished(x))]
    if x["name"] not in BASELINES:
      ref = by.get((x["recipe"], "1gpu_nb"))
      found.append(("parity vs 1gpu_nb", runs_lib.check_parity(x, ref, first_rtol, loss_rtol)))
      if x["name"].endswith("@2proc"):
        one = by.get((x["recipe"], x["name"][:-len("@2proc")]))
        found.append(("parity vs 1 process", runs_lib.check_parity(x, one, first_rtol,
                                                                  loss_rtol)))
      if "error" not in x:
        found += [("packed tokens", runs_lib.check_token_counts(x)),
                  ("all-to-all", runs_lib.check_moe_all_to_all(x)),
                  ("fsdp weight gathers", runs_lib.check_fsdp_gathers(x)),
                  ("activation gathers", runs_lib.check_activation_gathers(x))]
    out += [(ok, name, run, detail) for name, (ok, detail) in found if ok is not None or detail]
  return out


def _fmt(v, f):
  return "-" if v is None else format(v, f)


def report(results: list, args, header: str, job_seconds: dict) -> bool:
  """Prints the table, the collectives, the jobs' seconds and the checks;
  True if all pass."""
  by = {(x["recipe"], x["name"]): x for x in results if "error" not in x}
  print(f"\n{header}\n")
  print("| recipe | run | devices | batch | final loss | vs 1 GPU same batch | step 0 diff | "
        "ms/step | tokens/s | scaling eff. | vs FP8 off | GiB/device | compile s |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for x in results:
    if "error" in x:
      print(f"| {x['recipe']} | {x['name']} | | {x['batch']} | FAILED: "
            f"{x['error'].splitlines()[-1][-100:]!r} | | | | | | | | |")
      continue
    ref, one = by.get((x["recipe"], "1gpu_nb")), by.get((x["recipe"], "1gpu_b"))
    off = by.get(("bf16", x["name"])) or by.get(("none", x["name"]))
    cmp = ref if ref and x["name"] != "1gpu_b" else None
    ratio = x["final_loss"] / cmp["final_loss"] if cmp else None
    diff = abs(x["losses"][0] - cmp["losses"][0]) if cmp and x["losses"] else None
    eff = (x["tokens_per_s"] / (x["devices"] * one["tokens_per_s"])
           if one and x["name"] not in BASELINES else None)
    vs_off = (x["tokens_per_s"] / off["tokens_per_s"]
              if off and x["recipe"] not in runs_lib.FP8_OFF else None)
    mem = x.get("memory")
    gib = (mem["argument_bytes"] + mem["temp_bytes"]) / 2**30 if mem else None
    label = f"none ({x['dtype']})" if x["recipe"] == "none" else x["recipe"]
    print(f"| {label} | {x['name']} | {x['devices']} | {x['batch']} | {x['final_loss']:.4f} | "
          f"{_fmt(ratio, '.4f')} | {_fmt(diff, '.2e')} | {x['step_time_s'] * 1e3:.1f} | "
          f"{x['tokens_per_s']:,.0f} | {_fmt(eff, '.2f')} | {_fmt(vs_off, '.2f')} | "
          f"{_fmt(gib, '.2f')} | {x['compile_s']:.0f} |")
  print()
  for x in results:
    if x.get("collectives"):
      summary = {}
      for kind, dtype, _, nbytes, _ in x["collectives"]:
        e = summary.setdefault(f"{kind} {dtype}", [0, 0])
        e[0], e[1] = e[0] + 1, e[1] + nbytes
      print(f"collectives {x['recipe']}/{x['name']} (count, MiB per device): "
            + ", ".join(f"{k} {c} {b / 2**20:.2f}" for k, (c, b) in sorted(summary.items())))
  print("\njob seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in job_seconds.items()) + "\n")
  found = checks(results, args.first_rtol, args.loss_rtol)
  for ok, name, run, detail in found:
    print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'} {name} {run}: {detail}")
  failed = sum(ok is False for ok, *_ in found)
  passed = sum(ok is True for ok, *_ in found)
  print(f"\n{passed} checks passed, {failed} failed")
  return failed == 0


def _gpus() -> list:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout
  except FileNotFoundError:
    return []
  return [g for g in out.split("\n") if g.strip()]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--compile_threads", type=int, default=0,
                 help="parallel compiles per job; 0: one per run on GPUs, 1 on fake CPUs")
  p.add_argument("--recipes", default="none,delayed,current,blockwise")
  p.add_argument("--meshes", default="fsdp2,tp2", help="e.g. ep8,ep4_tp2_sp or fsdp8")
  p.add_argument("--two_process", help="a mesh to run again as 2 jax.distributed processes")
  p.add_argument("--preset", default="h200")
  p.add_argument("--layers", type=int, default=4, help="overrides the preset's depth")
  p.add_argument("--num_docs", type=int, default=20000)
  p.add_argument("--per_device_batch", type=int, default=8,
                 help="rows per batch shard (dp x ep x fsdp); global batch N x this")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--first_rtol", type=float, default=2e-3)
  p.add_argument("--loss_rtol", type=float, default=1e-2)
  p.add_argument("--timeout", type=int, default=600, help="seconds per job")
  p.add_argument("--deadline", type=int, default=0, help="seconds for everything (0: none)")
  p.add_argument("--fake_cpu_devices", type=int, default=0,
                 help="smoke test without GPUs: N fake CPU devices")
  p.add_argument("--jobs", type=int, default=1, help="jobs at once with fake CPU devices")
  p.add_argument("--log_dir", help="per-process logs (default: a new temporary folder)")
  p.add_argument("--json-out")
  args = p.parse_args(argv)
  if args.worker:
    runs_lib.worker(json.loads(args.worker), args.compile_threads)
    return 0

  # No jax in this process: it would take GPU memory from the runs.
  gpus = _gpus()
  fake = bool(args.fake_cpu_devices)
  n_dev = args.fake_cpu_devices if fake else len(gpus)
  try:
    sizes = {m: runs_lib.mesh_size(runs_lib.parse_mesh(m))
             for m in args.meshes.split(",") + [args.two_process or ""] if m}
  except ValueError as e:
    p.error(str(e))
  if len(set(sizes.values())) != 1:
    p.error(f"all meshes of one run must have the same size (one parity baseline): {sizes}")
  n = max(sizes.values())
  if args.two_process and n % 2:
    p.error(f"--two_process {args.two_process}: {n} devices do not split over 2 processes")
  args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="train_scaling_")
  os.makedirs(args.log_dir, exist_ok=True)
  slots = args.jobs if fake else max(1, n_dev)
  jobs = plan_jobs(args, n, slots)
  planned = [(s["recipe"], s["name"]) for j in jobs for s in j["runs"]]
  recipes = [r for r in args.recipes.split(",") if r]
  order = {key: (recipes.index(key[0]), i) for i, key in enumerate(planned)}
  records, job_seconds = run_jobs(jobs, n_dev, slots, fake, args)
  results = sorted(records, key=lambda x: order[(x["recipe"], x["name"])])  # recipe, then plan
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  device = "fake CPU devices" if fake else (gpus[0] if gpus else "no GPU")
  header = (f"{datetime.date.today().isoformat()} {device} x{n_dev}, jax "
            f"{metadata.version('jax')}; preset {args.preset}, {args.layers} layers, "
            f"{args.per_device_batch} rows per batch shard, {args.steps} steps; logs "
            f"{args.log_dir}")
  ok = report(results, args, header, job_seconds)
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
