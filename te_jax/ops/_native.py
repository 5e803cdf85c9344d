"""Loading the CUDA custom calls and choosing between them and the reference.

The native module ``te_jax._te_jax_ffi`` exists only where the package was
built with nvcc and cuBLASLt. Every op takes ``impl``:

* ``"auto"`` (default): CUDA when the module loaded and the default backend
  is a GPU, else the pure-JAX reference. On a GPU without the module a warning
  is logged once. With the module on a GPU host, ``dispatch`` stages both
  paths and the platform a computation is compiled for picks one: arrays
  placed on the host CPU of a GPU machine get the reference.
* ``"cuda"``: the custom call, or a ``RuntimeError`` saying why not.
* ``"reference"``: the pure-JAX spec.

The environment variable ``TE_JAX_IMPL`` (``reference`` or ``cuda``) replaces
``"auto"``. te_jax reads five environment variables: this one, in Python
whenever an op is traced, and four in the CUDA GEMM handler
(``custom_calls/ffi/gemm_autotune.h``), read once per process at the first
GEMM:

* ``TE_JAX_IMPL``: ``reference`` or ``cuda`` in place of ``impl="auto"``;
* ``TE_JAX_GEMM_AUTOTUNE_ALGOS``: how many of cuBLASLt's heuristic answers
  to time on a GEMM problem's first call (unset: 1, the first answer untimed);
* ``TE_JAX_GEMM_PICK``: an experiment knob naming the answer to use
  (``K``, ``split=K``, ``fast=K`` or ``fast=K,split=L``);
* ``TE_JAX_GEMM_LOG``: set and not ``0``, prints each problem's candidates
  and choice to stderr;
* ``TE_JAX_GEMM_SM90``: ``1`` adds te_jax's own sm_90a blockwise GEMMs
  (builds with the CUTLASS headers) to the candidates, ``only`` uses them
  alone where they take the problem; unset or ``0``: cuBLASLt alone.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, TypeVar

import jax

__all__ = ["build_note", "cuda_available", "check_impl", "dispatch", "resolve_impl", "IMPLS"]

IMPLS = ("auto", "cuda", "reference")
_log = logging.getLogger("te_jax")
T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _load_native():
  """Imports the nanobind module and registers its FFI targets once.

  Returns:
    (module or None, reason string when None).
  """
  try:
    from te_jax import _te_jax_ffi as native  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    note = build_note()
    return None, (f"the native module te_jax._te_jax_ffi is not built ({e})"
                  + (f"; the build says: {note}" if note else ""))
  for name, capsule in native.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return native, ""


def build_note() -> str:
  """What the build recorded beside the module (``_te_jax_ffi_build.txt``:
  which CUDA toolkit it used, or why it built no kernels); "" when absent."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "_te_jax_ffi_build.txt")
  try:
    with open(path, encoding="utf-8") as f:
      return " ".join(f.read().split())
  except OSError:
    return ""


def _gpu_backend() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def cuda_available() -> bool:
  """True when the CUDA custom calls are built and the backend is a GPU."""
  return _gpu_backend() and _load_native()[0] is not None


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str):
  _log.warning("te_jax: CUDA custom calls unavailable, using the pure-JAX "
               "reference path: %s", reason)


def check_impl(impl: str) -> str:
  """Returns ``impl`` after checking it is one of :data:`IMPLS`."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  return impl


def _requested(impl: str) -> str:
  """``impl`` checked, with ``TE_JAX_IMPL`` standing in for "auto"."""
  check_impl(impl)
  env = os.environ.get("TE_JAX_IMPL", "") if impl == "auto" else ""
  if env and env not in ("cuda", "reference"):
    raise ValueError(f"TE_JAX_IMPL must be 'cuda' or 'reference', got {env!r}.")
  return env or impl


def resolve_impl(impl: str) -> str:
  """Maps ``impl`` ("auto", "cuda", "reference") to "cuda" or "reference".

  This is the choice for computations on the default backend; ``dispatch``
  refines "auto" per computation.
  """
  impl = _requested(impl)
  if impl == "reference":
    return "reference"
  native, reason = _load_native()
  gpu = _gpu_backend()
  if native is not None and gpu:
    return "cuda"
  if not gpu:
    reason = f"the default JAX backend is {jax.default_backend()!r}, not 'gpu'"
  if impl == "cuda":
    raise RuntimeError(f"impl='cuda' was requested but {reason}.")
  if gpu:  # a GPU user expects the kernels: say that they are not used
    _warn_once(reason)
  return "reference"


def dispatch(impl: str, cuda_fn: Callable[[], T], reference_fn: Callable[[], T]) -> T:
  """``cuda_fn()`` or ``reference_fn()``, as ``impl`` chooses.

  Both take no arguments (close over the operands) and must return the same
  pytree of shapes and dtypes. "cuda" (asked for, or by ``TE_JAX_IMPL``)
  always calls ``cuda_fn``; "auto" where ``resolve_impl`` says "cuda" stages
  both with ``jax.lax.platform_dependent`` and lowering keeps the one for the
  platform being compiled for: the custom calls on a GPU, the reference for
  a computation placed on the host CPU of a GPU machine. (A Python choice by
  the default backend would send that CPU computation to custom calls that
  have no CPU implementation: it would fail to compile.) Only the kept
  branch is lowered, so a GPU program is the same as with ``cuda_fn`` alone;
  both are traced, so checks in ``cuda_fn`` (shapes the kernels take) raise
  for a CPU computation too.

  >>> import jax.numpy as jnp
  >>> x = jnp.arange(4.0)
  >>> dispatch("reference", lambda: x + 1, lambda: x * 2).tolist()
  [0.0, 2.0, 4.0, 6.0]
  """
  if resolve_impl(impl) == "reference":
    return reference_fn()
  if _requested(impl) == "cuda":
    return cuda_fn()
  return jax.lax.platform_dependent(cuda=cuda_fn, default=reference_fn)
