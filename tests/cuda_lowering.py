"""Test helpers: the CUDA program of an op, lowered on a machine without a GPU.

``gpu_host`` makes ``resolve_impl`` answer as on a GPU machine with the
native module built ("auto" -> "cuda"), so ``dispatch`` stages the custom
calls; :func:`cuda_text` lowers a function for the CUDA platform (no GPU and
no registered targets needed) and returns its StableHLO text, where the
custom calls' targets, operand shapes and attributes can be read.
"""

import re

import jax
import pytest

from te_jax.ops import _native


@pytest.fixture
def gpu_host(monkeypatch):
  """resolve_impl as on a GPU machine with the module built: "auto" -> "cuda"."""
  real = _native.resolve_impl
  monkeypatch.delenv("TE_JAX_IMPL", raising=False)
  monkeypatch.setattr(_native, "resolve_impl",
                      lambda impl: "cuda" if _native._requested(impl) == "auto" else real(impl))


def cuda_text(fn, *args) -> str:
  """StableHLO text of ``jax.jit(fn)(*args)`` lowered for the CUDA platform."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text, prefix):
  """(target, operand types, result types) of the custom calls whose target
  starts with ``prefix`` in a StableHLO text; types as "256x384xf8E4M3FN"."""
  calls = []
  for line in text.splitlines():
    m = re.search(r"custom_call @(\w+)\(", line)
    if m and m.group(1).startswith(prefix):
      operands, results = line.rsplit(" : (", 1)[1].split(") -> (")
      calls.append((m.group(1), re.findall(r"tensor<([^>]*)>", operands),
                    re.findall(r"tensor<([^>]*)>", results)))
  return calls
