"""Runs tests/test_moe_mesh.py on 8 fake CPU devices.

XLA fakes devices only when ``--xla_force_host_platform_device_count=8`` is
set before jax is imported, which other test files have done by then; so,
as ``test_sharding.py`` does for the dense layers, the 8-device file runs in
a subprocess (unless this process already has 8 devices, in which case
pytest collects it directly).
"""

import os
import subprocess
import sys

import jax
import pytest

from subprocess_flags import subprocess_xla_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


@pytest.mark.skipif(len(jax.devices()) >= 8,
                    reason="this process has 8 devices: test_moe_mesh.py runs directly")
def test_moe_eight_device_suite():
  """Sharded MoE == one device on EP=8, EP=4 x TP=2 with SP, FSDP=2 x EP=4."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = subprocess_xla_flags(devices=8)   # tiny programs compiled once
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(_HERE, "test_moe_mesh.py")]
  proc = subprocess.run(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=1200, check=False)
  assert proc.returncode == 0, proc.stdout[-6000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
