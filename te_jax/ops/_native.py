"""Loading the CUDA custom calls and choosing between them and the reference.

The native module ``te_jax._te_jax_ffi`` exists only where the package was
built with nvcc and cuBLASLt. Every op takes ``impl``:

* ``"auto"`` (default): CUDA when the module loaded and the default backend
  is a GPU, else the pure-JAX reference. On a GPU without the module a warning
  is logged once.
* ``"cuda"``: the custom call, or a ``RuntimeError`` saying why not.
* ``"reference"``: the pure-JAX spec.

The environment variable ``TE_JAX_IMPL`` (``reference`` or ``cuda``) replaces
``"auto"``; it is the only environment variable te_jax reads.
"""

from __future__ import annotations

import functools
import logging
import os

import jax

__all__ = ["cuda_available", "resolve_impl", "IMPLS"]

IMPLS = ("auto", "cuda", "reference")
_log = logging.getLogger("te_jax")


@functools.lru_cache(maxsize=None)
def _load_native():
  """Imports the nanobind module and registers its FFI targets once.

  Returns:
    (module or None, reason string when None).
  """
  try:
    from te_jax import _te_jax_ffi as native  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, f"the native module te_jax._te_jax_ffi is not built ({e})"
  for name, capsule in native.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return native, ""


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


def resolve_impl(impl: str) -> str:
  """Maps ``impl`` ("auto", "cuda", "reference") to "cuda" or "reference"."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}.")
  if impl == "auto":
    env = os.environ.get("TE_JAX_IMPL", "")
    if env:
      if env not in ("cuda", "reference"):
        raise ValueError(
            f"TE_JAX_IMPL must be 'cuda' or 'reference', got {env!r}.")
      impl = env
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
