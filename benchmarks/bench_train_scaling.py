"""examples/train_gpt.py on 1 GPU and on N-GPU meshes: parity, scaling, bytes moved.

For each recipe, trains the same GPT (packed variable-length documents) for
``--steps`` steps:

* ``1gpu_b``: one GPU, ``--per_device_batch`` rows (the scaling baseline);
* ``1gpu_nb``: one GPU, N x that batch (the parity baseline: same data as the
  N-GPU runs);
* each mesh of ``--meshes`` (``fsdp2``, ``tp2``, ``fsdp8``, ``fsdp4_tp2``,
  ``dp2_fsdp2_tp2``, ...) with N x the batch, i.e. the same per-device batch
  as ``1gpu_b`` (for TP meshes, the same work per device).

Reports per run: final loss (mean of the last 10 steps) and its ratio to
``1gpu_nb``, the largest per-step loss difference, median step time, tokens/s,
scaling efficiency = tokens/s / (N x tokens/s of ``1gpu_b``), and every
collective of the partitioned train step (count and bytes per device, by kind
and dtype; ``te_jax.hlo_inspect``). The two 1-GPU runs of a recipe run at the
same time on GPUs 0 and 1 when there are two or more GPUs.

  python benchmarks/bench_train_scaling.py --meshes fsdp2,tp2 --steps 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

MESHES = {  # name -> (dp, fsdp, tp)
    "fsdp2": (1, 2, 1), "tp2": (1, 1, 2), "fsdp4": (1, 4, 1), "fsdp8": (1, 8, 1),
    "fsdp4_tp2": (1, 4, 2), "dp2_fsdp2_tp2": (2, 2, 2),
}


def worker(spec):
  """Runs one training run in this process; prints one JSON line."""
  import numpy as np
  # examples/train_gpt.py: _launch puts examples/ on the worker's PYTHONPATH.
  import train_gpt  # pylint: disable=import-error
  from te_jax import hlo_inspect

  dp, fsdp, tp = spec["mesh"]
  cfg = train_gpt.Config(recipe=spec["recipe"], preset=spec["preset"], steps=spec["steps"],
                         batch=spec["batch"], layers=spec.get("layers"),
                         num_docs=spec.get("num_docs"), dp=dp, fsdp=fsdp, tp=tp,
                         out_dir=None, sample_chars=0, eval_batches=0, progress=False,
                         log_every=10**9)
  trainer = train_gpt.Trainer(cfg)
  colls = None
  if dp * fsdp * tp > 1:
    with trainer._ctx():  # pylint: disable=protected-access
      state = trainer.init()
      text, compiled = hlo_inspect.partitioned_hlo(
          trainer._step.lower(state, trainer.batch(0)))  # pylint: disable=protected-access
      trainer._step = compiled  # pylint: disable=protected-access
      del state
    colls = hlo_inspect.summarize(hlo_inspect.collectives(text))
  res = train_gpt.train(cfg, trainer)
  out = {k: res[k] for k in ("losses", "final_loss", "step_time_s", "tokens_per_s",
                             "params", "devices")}
  out.update(name=spec["name"], recipe=spec["recipe"], mesh=spec["mesh"],
             batch=spec["batch"], collectives=colls,
             step_times=[float(t) for t in np.asarray(res["step_times"])])
  print("JSON " + json.dumps(out), flush=True)


def _launch(spec, gpus=None, fake_cpu=False):
  env = dict(os.environ)
  # The worker imports examples/train_gpt.py (examples/ is not a package).
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_EXAMPLES, env.get("PYTHONPATH")) if p)
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpus
  if fake_cpu:   # exactly as many fake CPU devices as the mesh takes
    n = spec["mesh"][0] * spec["mesh"][1] * spec["mesh"][2]
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                           json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _collect(proc, spec, timeout):
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    return {"name": spec["name"], "recipe": spec["recipe"], "error": f"timeout {timeout}s"}
  lines = [l for l in out.splitlines() if l.startswith("JSON ")]
  if not lines:
    return {"name": spec["name"], "recipe": spec["recipe"],
            "error": "\n".join(out.strip().splitlines()[-3:])}
  return json.loads(lines[-1][5:])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--recipes", default="none,delayed,current,blockwise")
  p.add_argument("--meshes", default="fsdp2,tp2")
  p.add_argument("--preset", default="h200")
  p.add_argument("--layers", type=int, default=4, help="overrides the preset's depth")
  p.add_argument("--num_docs", type=int, default=20000)
  p.add_argument("--per_device_batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--timeout", type=int, default=300, help="seconds per run")
  p.add_argument("--fake_cpu_devices", type=int, default=0,
                 help="smoke test without GPUs: N fake CPU devices per run")
  p.add_argument("--json-out")
  args = p.parse_args(argv)
  if args.worker:
    worker(json.loads(args.worker))
    return 0

  # No jax in this process: it would take GPU memory from the runs.
  try:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False).stdout.split("\n")
  except FileNotFoundError:
    gpus = []
  gpus = [g for g in gpus if g.strip()]
  n_gpu = len(gpus)
  fake = bool(args.fake_cpu_devices)
  if fake:
    n_gpu, gpus = args.fake_cpu_devices, ["cpu"]
  meshes = [m for m in args.meshes.split(",") if m]
  unknown = [m for m in meshes if m not in MESHES]
  if unknown:
    p.error(f"unknown meshes {unknown}; known: {sorted(MESHES)}")
  sizes = {m: MESHES[m][0] * MESHES[m][1] * MESHES[m][2] for m in meshes}
  n = max(sizes.values())
  if len(set(sizes.values())) != 1:
    p.error(f"all meshes of one run must have the same size (one parity baseline): {sizes}")
  base = dict(preset=args.preset, steps=args.steps, layers=args.layers,
              num_docs=args.num_docs)
  results = []
  for r in args.recipes.split(","):
    b = args.per_device_batch
    one_b = dict(base, name="1gpu_b", recipe=r, mesh=(1, 1, 1), batch=b)
    one_nb = dict(base, name="1gpu_nb", recipe=r, mesh=(1, 1, 1), batch=n * b)
    if n_gpu >= 2:   # the two 1-GPU runs side by side on GPUs 0 and 1
      pa, pb = _launch(one_b, "0", fake), _launch(one_nb, "1", fake)
      runs = [_collect(pa, one_b, args.timeout), _collect(pb, one_nb, args.timeout)]
    else:
      runs = [_collect(_launch(s, "0", fake), s, args.timeout) for s in (one_b, one_nb)]
    for m in meshes:
      dp, fsdp, tp = MESHES[m]
      spec = dict(base, name=m, recipe=r, mesh=(dp, fsdp, tp), batch=n * b)
      if sizes[m] > n_gpu:
        runs.append({"name": m, "recipe": r, "error": f"needs {sizes[m]} GPUs"})
        continue
      runs.append(_collect(_launch(spec, None, fake), spec, args.timeout))
    for res in runs:   # the whole record, so a log cut short by a time limit keeps it
      print("JSON " + json.dumps(res), file=sys.stderr, flush=True)
    results.extend(runs)

  by = {(x["recipe"], x["name"]): x for x in results if "error" not in x}
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  print(f"\n{datetime.date.today().isoformat()} {gpus[0] if gpus else 'no GPU'} x{n_gpu}, "
        f"jax {metadata.version('jax')}; preset {args.preset} with {args.layers} layers, "
        f"{args.per_device_batch} rows/device, {args.steps} steps\n")
  print("| recipe | run | batch | final loss | vs 1 GPU same batch | max step loss diff | "
        "ms/step | tokens/s | scaling eff. |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for x in results:
    if "error" in x:
      print(f"| {x['recipe']} | {x['name']} | | FAILED: {x['error'][-80:]!r} | | | | | |")
      continue
    ref, one = by.get((x["recipe"], "1gpu_nb")), by.get((x["recipe"], "1gpu_b"))
    ratio = x["final_loss"] / ref["final_loss"] if ref and x["name"] != "1gpu_b" else None
    diff = (max(abs(a - c) for a, c in zip(x["losses"], ref["losses"]))
            if ref and x["name"] != "1gpu_b" else None)
    eff = None
    if one and x["name"] not in ("1gpu_b", "1gpu_nb"):
      eff = x["tokens_per_s"] / (x["devices"] * one["tokens_per_s"])
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"| {x['recipe']} | {x['name']} | {x['batch']} | {x['final_loss']:.4f} | "
          f"{fmt(ratio, '.4f')} | {fmt(diff, '.4f')} | {x['step_time_s'] * 1e3:.1f} | "
          f"{x['tokens_per_s']:,.0f} | {fmt(eff, '.2f')} |")
  for x in results:
    if x.get("collectives"):
      print(f"collectives {x['recipe']}/{x['name']}: {json.dumps(x['collectives'])}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)
  return 0 if all("error" not in x for x in results) else 1


if __name__ == "__main__":
  sys.exit(main())
