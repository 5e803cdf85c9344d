"""Runs tests/test_moe_layer_mesh.py on 8 fake CPU devices, and checks that two
fresh processes compute the same sharded MoE training step bit for bit.

XLA fakes devices only when ``--xla_force_host_platform_device_count=8`` is
set before jax is imported, so (as ``test_moe_sharding.py`` does for the
functional block) the 8-device file runs in subprocesses.
"""

import os
import subprocess
import sys

import jax
import pytest

from subprocess_flags import subprocess_xla_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_MESH_FILE = os.path.join(_HERE, "test_moe_layer_mesh.py")


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = subprocess_xla_flags(devices=8)   # small programs compiled once
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, _HERE, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


@pytest.mark.skipif(len(jax.devices()) >= 8,
                    reason="this process has 8 devices: test_moe_layer_mesh.py runs directly")
def test_moe_layer_eight_device_suite():
  """MoE modules on EP=8, EP=4 x TP=2 with SP, FSDP=2 x EP=4 == one device."""
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", _MESH_FILE]
  proc = subprocess.run(cmd, cwd=_ROOT, env=_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stdout[-6000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def _digest():
  env = _env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # each process compiles for itself
  proc = subprocess.run([sys.executable, _MESH_FILE, "--digest"], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("DIGEST ")]
  return line.split()[1]


def test_two_fresh_processes_agree_bit_for_bit():
  """The routing, the all-to-alls and the reductions of a sharded delayed-scaling
  step (EP=4 x TP=2 with SP) give the same bits in two fresh processes."""
  first, second = _digest(), _digest()
  assert len(first) == 64 and first == second
