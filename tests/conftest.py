"""Shared pytest setup: the ``gpu`` marker skips where no CUDA path exists."""

import pytest


def _cuda_available():
  try:
    from te_jax.ops import _native
    return _native.cuda_available()
  except Exception:  # pylint: disable=broad-except
    return False


@pytest.fixture(params=["reference", pytest.param("cuda", marks=pytest.mark.gpu)])
def impl(request):
  """The te_jax ops implementation a module test runs on: the pure-JAX
  reference everywhere, and the CUDA custom calls under the ``gpu`` marker
  (skipped where there is none). Modules take it as their ``impl`` attribute."""
  return request.param


def pytest_collection_modifyitems(config, items):
  del config
  if _cuda_available():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU and the te_jax CUDA custom calls")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
