"""Shared pytest setup: the ``gpu`` marker skips where no CUDA path exists; one
XLA compilation cache for the run; XLA:CPU set to compile fast; one line at
the end that counts the skipped tests by reason; the long files first."""

import collections
import functools
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Many tests compile the same programs (the same ops and shapes under several
# parametrizations and modules, the three training runs of the resume test,
# the subprocesses of the example tests). XLA's persistent compilation cache
# serves the repeats, small programs included (min compile time 0). The key
# is the program, the compile options, the devices and the jax/jaxlib
# versions, so a hit is the same executable. The directory is made for the
# run and removed after it; the xdist workers and the tests' subprocesses
# inherit it through the environment. JAX_COMPILATION_CACHE_DIR set by the
# caller is used and kept (a cache across runs);
# TE_JAX_TEST_COMPILE_CACHE=0 compiles everything afresh.
_CACHE_ENV = "TE_JAX_TEST_COMPILE_CACHE"
_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
_made_cache_dir = None   # the directory this process made, removed at the end


# XLA:CPU spends most of a test's time compiling, and these programs are
# small: fast compilation matters, fast code does not. For the run (the xdist
# workers and the tests' subprocesses inherit XLA_FLAGS), unless a GPU plugin
# is installed (the flags would slow the kernels XLA writes for the GPU),
# TE_JAX_TEST_XLA_OPT=1, or the caller's XLA_FLAGS set an optimization level:
# - LLVM's optimizations of the generated code off;
# - the LLVM IR fusion emitters instead of the MLIR ones that jaxlib 0.10
#   uses by default, which take much longer to compile a program; both
#   emit the same HLO fusions, and a test compares programs compiled the
#   same way;
# - code generation in one piece (splitting it buys nothing on 2 cores).
# Newer XLA knows neither of the last two (its MLIR emitters are its only
# ones, and compile fast) and aborts a process whose XLA_FLAGS name an
# unknown flag: each is tried in a short subprocess first.
_FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
_FAST_COMPILE_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false",
                          "--xla_cpu_parallel_codegen_split_count=1")
_unknown_flags = []   # the flags of _FAST_COMPILE_IF_KNOWN this jaxlib's XLA refused


def _gpu_plugin_installed() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pkgutil  # pylint: disable=import-outside-toplevel
  try:
    spec = importlib.util.find_spec("jax_plugins")
  except (ImportError, ValueError):
    return False
  if spec is None or not spec.submodule_search_locations:
    return False
  return any("cuda" in m.name or "rocm" in m.name
             for m in pkgutil.iter_modules(spec.submodule_search_locations))


def _xla_accepts(flags) -> list:
  """Which of ``flags`` XLA accepts in XLA_FLAGS: one process per flag (in
  parallel) makes the CPU client with that flag alone."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [(flag, subprocess.Popen([sys.executable, "-c", "import jax; jax.devices()"],
                                   env=dict(env, XLA_FLAGS=flag), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)) for flag in flags]
  accepted = []
  for flag, proc in procs:
    try:
      if proc.wait(timeout=120) == 0:
        accepted.append(flag)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  return accepted


def _compile_fast() -> None:
  flags = os.environ.get("XLA_FLAGS", "")
  if (os.environ.get("TE_JAX_TEST_XLA_OPT", "0") == "1" or "xla_backend_optimization_level"
      in flags or _gpu_plugin_installed()):
    return
  known = _xla_accepts(_FAST_COMPILE_IF_KNOWN)
  _unknown_flags.extend(f for f in _FAST_COMPILE_IF_KNOWN if f not in known)
  os.environ["XLA_FLAGS"] = " ".join([flags, _FAST_COMPILE_FLAG, *known]).strip()


def pytest_configure(config):
  global _made_cache_dir  # pylint: disable=global-statement
  _compile_fast()
  if os.environ.get(_CACHE_ENV, "1") == "0":
    return
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    if hasattr(config, "workerinput"):   # an xdist worker without one: the caller's choice
      return
    _made_cache_dir = tempfile.mkdtemp(prefix="te_jax_pytest_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache_dir
  for name, value in _CACHE_SETTINGS.items():
    os.environ.setdefault(name, value)
  # jax may be imported already (its config read these variables then).
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def pytest_unconfigure(config):
  del config
  if _made_cache_dir is not None:
    shutil.rmtree(_made_cache_dir, ignore_errors=True)


def pytest_report_header(config):
  del config
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  lines = [f"XLA compilation cache: {cache} ({_CACHE_ENV}=0 turns it off)" if cache
           else "XLA compilation cache: off",
           f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r}"]
  if _unknown_flags:
    lines.append(f"not known to this XLA, not used: {' '.join(_unknown_flags)}")
  return lines


GPU_SKIP_REASON = "need an NVIDIA GPU and the te_jax CUDA custom calls (gpu marker)"


def skip_reason(report):
  """The reason a skipped test report gives, without pytest's "Skipped: ".

  A skip's ``longrepr`` is (path, line, message); pytest-xdist sends it from
  its workers as a list.
  """
  longrepr = report.longrepr
  message = longrepr[2] if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
  return message.removeprefix("Skipped: ")


def skip_summary(reports):
  """One line counting skipped-test ``reports`` by reason, most frequent
  first: ``"12 skipped: 10 need a GPU; 2 need orbax"``; "" for none. Where
  the custom calls cannot run, tests with the ``gpu`` marker count as one
  reason, whichever skip mark fired (some files have their own skipif for
  the same cause); where they can, a ``gpu`` test skipped for another
  reason (float64 without x64, say) gives its own."""
  no_gpu = not _cuda_available()
  counts = collections.Counter(
      GPU_SKIP_REASON if no_gpu and "gpu" in getattr(r, "keywords", {}) else skip_reason(r)
      for r in reports)
  if not counts:
    return ""
  parts = [f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
  return f"{sum(counts.values())} skipped: " + "; ".join(parts)


def pytest_terminal_summary(terminalreporter):
  """Says why tests were skipped, in one line before pytest's closing line
  (``-rs`` lists each one). Runs in the main process, which under
  pytest-xdist holds every worker's reports."""
  line = skip_summary(terminalreporter.stats.get("skipped", []))
  if line:
    terminalreporter.write_line(line)


@functools.lru_cache(maxsize=1)
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


# Files whose tests run subprocesses for a minute or more (8-device and
# two-process suites, the benchmarks' CPU runs). They go first: under
# pytest-xdist they then overlap the many short tests instead of running
# alone at the end, in collection order, after them.
LONG_FILES = ("test_sharding.py", "test_moe_sharding.py", "test_moe_layer_sharding.py",
              "test_multihost.py", "test_train_scaling.py", "test_moe_bench.py")


def pytest_collection_modifyitems(config, items):
  del config
  items.sort(key=lambda item: item.path.name not in LONG_FILES)   # stable
  if _cuda_available():
    return
  skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
