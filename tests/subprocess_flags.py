"""Test helper: the XLA_FLAGS of a test's subprocess that runs jax on CPU.

Such a subprocess (an 8-device suite, a multi-process training run, a
benchmark) compiles programs once and runs them on tiny shapes, so it gets
the flags that make XLA:CPU compile fast: those conftest.py put in this
process's XLA_FLAGS for the run (which depend on what this jaxlib's XLA
knows), and LLVM's backend optimizations off in any case.
"""

import os

_DEVICE_COUNT = "--xla_force_host_platform_device_count"
_BACKEND_OPT = "--xla_backend_optimization_level"


def subprocess_xla_flags(devices=None) -> str:
  """This process's XLA_FLAGS for a subprocess: any fake-device count
  replaced by ``devices`` (int, or None for XLA's default of one), and
  ``--xla_backend_optimization_level=0`` unless the flags set a level."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
  if not any(f.startswith(_BACKEND_OPT) for f in flags):
    flags.append(f"{_BACKEND_OPT}=0")
  if devices is not None:
    flags.append(f"{_DEVICE_COUNT}={devices}")
  return " ".join(flags)
