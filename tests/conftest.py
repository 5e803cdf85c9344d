"""Shared pytest setup: the ``gpu`` marker skips where no CUDA path exists."""

import pytest


def _cuda_available():
  try:
    from te_jax.ops import _native
    return _native.cuda_available()
  except Exception:  # pylint: disable=broad-except
    return False


def pytest_collection_modifyitems(config, items):
  del config
  if _cuda_available():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU and the te_jax CUDA custom calls")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
