"""benchmarks/bench_train_scaling.py on 8 fake CPU devices, and its checks.

The benchmark (run in a subprocess, as on a GPU machine: one process per job)
trains the tiny mixture of experts, one layer, 3 steps, DelayedScaling, on
one device (1 row and 8 rows) and on two 8-device meshes: experts over 2 x
FSDP over 4 (the expert weights and the attention weights all-gathered in
FP8) and experts over 4 x TP 2 with sequence parallelism. Its checks must
pass: every run finishes, the meshes' losses equal the 8-row one-device run,
the devices get different real token counts, the all-to-alls have the
routing-independent buffer size, FSDP gathers weights in FP8 only. The check
functions are also run on records altered to break each rule, so that each
can be seen to fail. About 50 s on two CPU cores.
"""

import copy
import json
import os
import subprocess
import sys
import time
import types

import pytest

import bench_train_scaling as bench  # pylint: disable=import-error  # benchmarks/
import _train_scaling_run as runs_lib  # pylint: disable=import-error
from subprocess_flags import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ("ep2_fsdp4", "ep4_tp2_sp")
ARGS = ["--preset", "moe_tiny", "--layers", "1", "--meshes", ",".join(MESHES),
        "--recipes", "delayed", "--steps", "3", "--per_device_batch", "1",
        "--num_docs", "1000", "--fake_cpu_devices", "8"]


def _run_benchmark(tmp) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  # Compiled to compile fast: compiling, not running, is the cost here (the
  # benchmark sets the fake-device count of each of its processes).
  env["XLA_FLAGS"] = subprocess_xla_flags()
  out = str(tmp / "results.json")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_train_scaling.py"), *ARGS,
       "--json-out", out, "--log_dir", str(tmp / "logs"), "--timeout", "400"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      timeout=900, check=False)
  results = None
  if os.path.exists(out):
    with open(out) as fh:
      results = json.load(fh)
  return dict(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr,
              results=results)


def _run_once(tmp_path_factory) -> dict:
  """The benchmark's run, once per test session: under pytest-xdist the
  first worker to get here runs it, the others read its result (each
  worker would otherwise run the 40 s benchmark for its share of the
  tests)."""
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  done = shared / "train_scaling.json"
  try:
    os.mkdir(shared / "train_scaling.lock")
  except FileExistsError:
    deadline = time.monotonic() + 960
    while not done.exists():
      if time.monotonic() > deadline:
        pytest.fail("another worker's benchmark run did not finish in 960 s")
      time.sleep(1)
    return json.loads(done.read_text())
  run = _run_benchmark(tmp_path_factory.mktemp("train_scaling"))
  partial = shared / "train_scaling.json.partial"
  partial.write_text(json.dumps(run))
  os.replace(partial, done)
  return run


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
  run = _run_once(tmp_path_factory)
  assert run["results"] is not None, run["stdout"][-3000:] + run["stderr"][-3000:]
  proc = types.SimpleNamespace(returncode=run["returncode"], stdout=run["stdout"],
                               stderr=run["stderr"])
  lines = {}
  for line in proc.stdout.splitlines():   # "PASS parity vs 1gpu_nb delayed/ep8: ..."
    if line.startswith(("PASS ", "FAIL ", "INFO ")):
      head = line.split(":", 1)[0]
      lines[head[5:]] = (head[:4], line)
  return proc, run["results"], lines


def _verdict(lines, name):
  assert name in lines, f"no check {name!r} in {sorted(lines)}"
  return lines[name][0]


def test_every_run_finishes_and_the_meshes_match_one_device(bench_run):
  _, results, lines = bench_run
  names = sorted(r["name"] for r in results)
  assert names == sorted(("1gpu_b", "1gpu_nb") + MESHES)
  for r in results:
    assert "error" not in r, r["error"]
    assert _verdict(lines, f"finished delayed/{r['name']}") == "PASS"
  for m in MESHES:
    assert _verdict(lines, f"parity vs 1gpu_nb delayed/{m}") == "PASS", lines
    assert _verdict(lines, f"packed tokens delayed/{m}") == "PASS", lines


def test_collective_checks_pass(bench_run):
  _, _, lines = bench_run
  for m in MESHES:
    assert _verdict(lines, f"all-to-all delayed/{m}") == "PASS", lines[f"all-to-all delayed/{m}"]
  assert _verdict(lines, "fsdp weight gathers delayed/ep2_fsdp4") == "PASS", lines
  assert "fsdp weight gathers delayed/ep4_tp2_sp" not in lines   # no fsdp axis


def test_exit_status_is_one_exactly_when_a_check_fails(bench_run):
  proc, _, lines = bench_run
  failed = [line for verdict, line in lines.values() if verdict == "FAIL"]
  assert proc.returncode == (1 if failed else 0), (proc.returncode, failed)


def test_no_full_activation_gather(bench_run):
  """No float all-gather of every token's activations (the router's top-k
  used to gather all scores: te_jax.moe.route's token_sharding)."""
  _, _, lines = bench_run
  for m in MESHES:
    assert _verdict(lines, f"activation gathers delayed/{m}") == "PASS", lines


# ------------------------------------------------- the checks can fail ----

def _record(bench_run, name):
  return copy.deepcopy(next(r for r in bench_run[1] if r["name"] == name))


def test_parity_fails_on_a_different_loss(bench_run):
  x, ref = _record(bench_run, "ep2_fsdp4"), _record(bench_run, "1gpu_nb")
  assert runs_lib.check_parity(x, ref, 2e-3, 1e-2)[0] is True
  x["losses"][0] *= 1.01
  assert runs_lib.check_parity(x, ref, 2e-3, 1e-2)[0] is False
  x = _record(bench_run, "ep2_fsdp4")
  x["final_loss"] *= 1.02
  assert runs_lib.check_parity(x, ref, 2e-3, 1e-2)[0] is False
  assert runs_lib.check_parity(x, None, 2e-3, 1e-2)[0] is False


def test_token_check_fails_when_every_device_gets_the_same_count(bench_run):
  x = _record(bench_run, "ep2_fsdp4")
  x["token_counts"] = [[128] * 8 for _ in x["token_counts"]]
  assert runs_lib.check_token_counts(x)[0] is False


def test_all_to_all_check_fails_on_another_buffer_or_count(bench_run):
  x = _record(bench_run, "ep4_tp2_sp")
  a2a = [c for c in x["collectives"] if c[0] == "all-to-all" and c[1] == "f32"]
  a2a[0][2] = [a2a[0][2][0] + 16, a2a[0][2][1]]     # a routing-sized buffer
  assert runs_lib.check_moe_all_to_all(x)[0] is False
  x = _record(bench_run, "ep4_tp2_sp")
  x["collectives"] = [c for c in x["collectives"] if c[0] != "all-to-all"]
  assert runs_lib.check_moe_all_to_all(x)[0] is False


def test_fsdp_check_fails_on_a_float_weight_gather_or_missing_fp8(bench_run):
  x = _record(bench_run, "ep2_fsdp4")
  kernel = x["expect"]["fsdp"]["layer_kernels"][0]            # e.g. (64, 2, 64)
  flat = [kernel[0], kernel[1] * kernel[2]] if len(kernel) == 3 else kernel
  x["collectives"].append(["all-gather", "bf16", flat, 2 * flat[0] * flat[1], "all_gather"])
  assert runs_lib.check_fsdp_gathers(x)[0] is False
  x["collectives"][-1][4] = "jit(train_step)/jvp(GPT)/lm_head/dot_general"   # allowed there
  assert runs_lib.check_fsdp_gathers(x)[0] is True
  x["collectives"][-1][4] = "state.params['params']['lm_head']['kernel']"   # newer jax's name
  assert runs_lib.check_fsdp_gathers(x)[0] is True
  x["collectives"] = [c for c in x["collectives"] if c[1] != "f8e4m3fn"]
  assert runs_lib.check_fsdp_gathers(x)[0] is False
  x["recipe"] = "none"                                        # FP8 off: reported only
  assert runs_lib.check_fsdp_gathers(x)[0] is None


def test_activation_check_sees_a_gathered_batch(bench_run):
  x = _record(bench_run, "ep2_fsdp4")
  x["collectives"] = [["all-gather", "f32", [8, 128, 64], 4 * 8 * 128 * 64,
                       "jit(train_step)/jvp(GPT)/layer_0/mlp/dot_general"]]
  assert runs_lib.check_activation_gathers(x)[0] is False
  x["collectives"] = [["all-gather", "f32", [64], 256, "jit(train_step)/jvp(GPT)/final_norm/mul"]]
  assert runs_lib.check_activation_gathers(x)[0] is True


def test_failed_run_fails_its_checks_and_the_report():
  spec = dict(name="ep8", recipe="delayed", mesh=runs_lib.parse_mesh("ep8"), batch=8,
              steps=3, preset="moe_tiny")
  rec = dict(spec, error="killed after 400 s (--timeout/--deadline): a hang or too slow")
  found = bench.checks([rec], 2e-3, 1e-2)
  assert [(ok, name) for ok, name, *_ in found] == [(False, "finished"),
                                                    (False, "parity vs 1gpu_nb")]
  args = types.SimpleNamespace(first_rtol=2e-3, loss_rtol=1e-2)
  assert bench.report([rec], args, "header", {"ep8": 400.0}) is False


@pytest.mark.parametrize("name, want", [
    ("ep8", dict(dp=1, ep=8, fsdp=1, tp=1, sp=False)),
    ("ep4_tp2_sp", dict(dp=1, ep=4, fsdp=1, tp=2, sp=True)),
    ("dp2_fsdp2_tp2", dict(dp=2, ep=1, fsdp=2, tp=2, sp=False)),
])
def test_parse_mesh(name, want):
  assert runs_lib.parse_mesh(name) == want


@pytest.mark.parametrize("name, message", [
    ("ep8_sp", "add tp<n>"), ("ep2_ep4", "repeated"), ("xp8", "not one of"), ("ep0", "not one")])
def test_parse_mesh_rejects(name, message):
  with pytest.raises(ValueError, match=message):
    runs_lib.parse_mesh(name)


def test_one_gpu_runs_spread_over_every_gpu():
  args = types.SimpleNamespace(preset="moe", steps=50, layers=4, num_docs=100, recipes=
                               "none,delayed,current,blockwise", per_device_batch=1,
                               meshes="ep8,ep4_tp2_sp", two_process="ep8")
  jobs = bench.plan_jobs(args, 8, one_device_slots=8)
  ones = [j for j in jobs if j["devices"] == 1]
  assert len(ones) == 8 and all(len(j["runs"]) == 1 for j in ones)
  assert [(j["name"], j["devices"], j["processes"], len(j["runs"])) for j in jobs[8:]] == [
      ("ep8", 8, 1, 4), ("ep4_tp2_sp", 8, 1, 4), ("ep8@2proc", 8, 2, 1)]
  assert jobs[-1]["runs"][0]["recipe"] == "delayed"     # the first FP8 recipe
  two = bench.plan_jobs(args, 8, one_device_slots=2)
  assert [len(j["runs"]) for j in two if j["devices"] == 1] == [4, 4]
