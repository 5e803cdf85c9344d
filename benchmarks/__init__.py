"""te_jax benchmarks: scripts, each also importable as a module.

Run them by path, from any directory, with te_jax installed::

  python3 benchmarks/bench_layer.py --small
  cd /tmp && python3 /path/to/te_jax/benchmarks/bench_floor.py --small

A script run by path has its own folder first on ``sys.path``, so there the
benchmarks import one another by plain name (``bench_layer``, ``_fp8_carry``);
imported as this package (``python3 -m benchmarks.bench_floor`` from the
repository root, ``import benchmarks.bench_layer``) they import one another
relatively. The tests import them by plain name: pytest's ``pythonpath``
(pyproject.toml) puts ``benchmarks/`` and ``examples/`` on ``sys.path``.

Run by path, not with ``-m``, where an installed te_jax (with its CUDA module)
must be the one imported, as on the GPU machine (``tools/``): ``-m`` puts the
repository root first on ``sys.path``, and the source tree's ``te_jax/`` has
no CUDA module unless it was installed in editable mode.
"""
