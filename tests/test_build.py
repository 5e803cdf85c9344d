"""The build and the test command.

pyproject.toml and custom_calls/ (CMakeLists.txt, cmake/) agree: under build
isolation CMake runs where only ``[build-system] requires`` is installed, so
every Python module it runs must come from there; the CUDA architecture is
named once, by a cache variable. These checks read the files as text; each is
run on the real files and on deliberately broken ones, so each is seen to fail.
The CUDA toolkit of the pip packages is test_build_pip_toolkit.py's (its
_configure also runs the whole configure here). CUTLASS for the sm90 GEMMs:
cmake/TeJaxCutlass.cmake and the configure with and without it. Last, the
test command's one-line skip summary (tests/conftest.py), with and without
pytest-xdist; its compile-fast XLA flags, and those of the tests' subprocesses.
"""

import ast
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_build_pip_toolkit import _configure

ROOT = pathlib.Path(__file__).resolve().parent.parent
CMAKE_DIR = ROOT / "custom_calls"
ARCH_VAR = "TE_JAX_CUDA_ARCHITECTURES"
# Distribution of an imported top-level module, where the names differ.
DIST_OF_MODULE = {}
SOURCE_SUFFIXES = (".cc", ".cu", ".cpp", ".cxx", ".c")
_PYTHON = re.compile(r"\$\{Python3?_EXECUTABLE\}|\$\{PYTHON_EXECUTABLE\}")


def _pyproject():
  return (ROOT / "pyproject.toml").read_text()


def _cmake():
  """CMakeLists.txt and the modules of custom_calls/cmake/ it includes."""
  return "\n".join(p.read_text() for p in
                   [CMAKE_DIR / "CMakeLists.txt", *sorted((CMAKE_DIR / "cmake").glob("*.cmake"))])


# ------------------------------------------------------------ CMake text ----

def cmake_code(text):
  """``text`` without its comments (``#`` outside quoted arguments, ``#[[ ]]``)."""
  text = re.sub(r"#\[(=*)\[.*?\]\1\]", "", text, flags=re.S)
  out, quoted, i = [], False, 0
  while i < len(text):
    ch = text[i]
    if ch == "\\" and quoted:
      out.append(text[i:i + 2])
      i += 2
      continue
    if ch == '"':
      quoted = not quoted
    elif ch == "#" and not quoted:
      while i < len(text) and text[i] != "\n":
        i += 1
      continue
    out.append(ch)
    i += 1
  return "".join(out)


def cmake_calls(code, command):
  """The argument text of every ``command(...)`` call in comment-free ``code``."""
  return [code[start:end - 1] for _, start, end in _call_spans(code, command)]


def _call_spans(code, command):
  """(call start, argument start, end) of every ``command(...)`` in ``code``."""
  spans = []
  for m in re.finditer(rf"\b{command}\s*\(", code, flags=re.I):
    depth, quoted, i = 1, False, m.end()
    while depth:
      ch = code[i]
      if ch == "\\" and quoted:
        i += 1
      elif ch == '"':
        quoted = not quoted
      elif not quoted:
        depth += {"(": 1, ")": -1}.get(ch, 0)
      i += 1
    spans.append((m.start(), m.end(), i))
  return spans


def _imports(src):
  """Top-level modules that Python source ``src`` imports (absolute imports)."""
  mods = set()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Import):
      mods.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      mods.add(node.module.split(".")[0])
  return mods


def python_modules(cmake_text, cmake_dir=CMAKE_DIR):
  """Top-level non-stdlib modules that CMake's ``execute_process`` runs Python
  on: ``-c "import x ..."``, ``-m x``, and the imports of a script under
  ``cmake_dir`` run by path (``.../name.py``; a script not found there is
  reported as ``<missing script name.py>``)."""
  mods = set()
  for args in cmake_calls(cmake_code(cmake_text), "execute_process"):
    if not _PYTHON.search(args):
      continue
    for m in re.finditer(r'(?<!\S)-c\s+"((?:[^"\\]|\\.)*)"', args):
      mods |= _imports(re.sub(r"\\(.)", r"\1", m.group(1)))
    mods.update(m.group(1).split(".")[0] for m in re.finditer(r"(?<!\S)-m\s+([\w.]+)", args))
    for name in re.findall(r'([\w.-]+\.py)"?(?=\s|$)', args):
      scripts = sorted(cmake_dir.rglob(name))
      mods |= _imports(scripts[0].read_text()) if scripts else {f"<missing script {name}>"}
  return mods - set(sys.stdlib_module_names)


def cache_variables(cmake_text):
  """{name: default} of the ``set(NAME value CACHE TYPE ...)`` lines."""
  return {m.group(1): m.group(2).strip('"') for m in re.finditer(
      r'\bset\(\s*(\w+)\s+("[^"]*"|[^\s)]+)\s+CACHE\b', cmake_code(cmake_text))}


def listed_sources(cmake_text):
  """Source files named by ``nanobind_add_module``/``add_library``/``add_executable``/
  ``target_sources`` calls, as written (relative to custom_calls/)."""
  code = cmake_code(cmake_text)
  out = []
  for command in ("nanobind_add_module", "add_library", "add_executable", "target_sources"):
    for args in cmake_calls(code, command):
      out += [a.strip('"') for a in args.split() if a.strip('"').endswith(SOURCE_SUFFIXES)]
  return out


# ----------------------------------------------------------------- checks ---

def missing_build_requires(pyproject_text, cmake_text, cmake_dir=CMAKE_DIR):
  """Modules CMake runs that no ``[build-system] requires`` entry provides."""
  requires = {canonicalize_name(Requirement(r).name)
              for r in tomllib.loads(pyproject_text)["build-system"]["requires"]}
  return sorted(m for m in python_modules(cmake_text, cmake_dir)
                if canonicalize_name(DIST_OF_MODULE.get(m, m)) not in requires)


def build_floor_problems(pyproject_text):
  """Build requirements that exclude the oldest version ``[project] dependencies``
  allows of the same package (the FFI headers must come from a jax users may run)."""
  doc = tomllib.loads(pyproject_text)
  build = {canonicalize_name(r.name): r for r in map(Requirement, doc["build-system"]["requires"])}
  problems = []
  for dep in map(Requirement, doc["project"]["dependencies"]):
    floors = [Version(s.version) for s in dep.specifier if s.operator in (">=", "==", "~=")]
    want = build.get(canonicalize_name(dep.name))
    if want is not None and floors and not want.specifier.contains(max(floors), prereleases=True):
      problems.append(f"build {want} excludes {dep.name} {max(floors)}")
  return problems


def arch_problems(cmake_text):
  """Ways the CUDA architecture escapes its cache variable."""
  code = cmake_code(cmake_text)
  default = cache_variables(cmake_text).get(ARCH_VAR)
  if default is None:
    return [f"no set({ARCH_VAR} ... CACHE STRING ...)"]
  rest = code   # the code without the cache variable's definition
  for start, arg_start, end in reversed(_call_spans(code, "set")):
    if re.match(rf"\s*{ARCH_VAR}\s", code[arg_start:end]):
      rest = rest[:start] + rest[end:]
  problems = []
  uses = re.findall(r'(?<![\w{])((?:CMAKE_)?CUDA_ARCHITECTURES)\s+("[^"]*"|[^\s)]+)', rest)
  if not uses:
    problems.append(f"{ARCH_VAR} is defined but no CUDA_ARCHITECTURES is set from it")
  problems += [f"{name} {value}" for name, value in uses
               if value.strip('"') != "${%s}" % ARCH_VAR]
  literal = re.compile(r"\b(?:sm|compute|lto)_\d+[af]?\b|(?<![\w-])(?:-arch|-gencode|"
                       r"--generate-code|--gpu-architecture)\b|\b\d{2,3}[af]\b|"
                       + "|".join(rf"(?<![\w.]){re.escape(a)}(?![\w.])"
                                  for a in default.split(";") if a))
  problems += [f"literal architecture {m.group(0)!r}" for m in literal.finditer(rest)]
  return problems


def documented_overrides_problems(pyproject_text, cmake_text):
  """``cmake.define.X`` / ``-DX`` overrides in pyproject.toml's comments that name
  no cache variable of CMakeLists.txt."""
  named = set(re.findall(r"cmake\.define\.(\w+)", pyproject_text)) | set(
      re.findall(r"-D(\w+)=", pyproject_text))
  return sorted(named - set(cache_variables(cmake_text)))


def source_problems(cmake_text, cmake_dir):
  """Listed sources that do not exist, and sources on disk that are not listed."""
  listed = listed_sources(cmake_text)
  problems = [f"listed, missing: {s}" for s in listed if not (cmake_dir / s).is_file()]
  on_disk = {p.relative_to(cmake_dir).as_posix() for p in cmake_dir.rglob("*")
             if p.suffix in SOURCE_SUFFIXES}
  problems += [f"not built: {s}" for s in sorted(on_disk - set(listed))]
  if not listed:
    problems.append("no sources found in CMakeLists.txt")
  return problems


# ------------------------------------------------------------------ tests ---

def test_cmake_runs_python_modules():
  # Guards the parser: the real files run jax (FFI headers), nanobind, and
  # the pip-toolkit script (stdlib only, so it adds nothing here).
  assert "pip_cuda_toolkit.py" in _cmake()
  assert python_modules(_cmake()) == {"jax", "nanobind"}


@pytest.mark.parametrize("case", ["real", "unlisted import", "requires without jax",
                                  "script imports yaml", "script missing"])
def test_build_requires_provide_what_cmake_imports(case, tmp_path):
  pyproject, cmake, cmake_dir = _pyproject(), _cmake(), CMAKE_DIR
  if case == "unlisted import":
    cmake = cmake.replace("import jax;", "import jax, yaml;", 1)
  elif case == "requires without jax":
    pyproject = re.sub(r',\s*"jax[^"]*"', "", pyproject, count=1)
  elif case.startswith("script"):
    cmake_dir = tmp_path / "custom_calls"
    shutil.copytree(CMAKE_DIR, cmake_dir)
    script = cmake_dir / "cmake" / "pip_cuda_toolkit.py"
    if case == "script missing":
      script.unlink()
    else:
      script.write_text(script.read_text().replace("import json\n", "import json\nimport yaml\n"))
  assert missing_build_requires(pyproject, cmake, cmake_dir) == {
      "real": [], "unlisted import": ["yaml"], "requires without jax": ["jax"],
      "script imports yaml": ["yaml"],
      "script missing": ["<missing script pip_cuda_toolkit.py>"]}[case]


@pytest.mark.parametrize("case", ["real", "build jax too new"])
def test_build_jax_admits_the_oldest_runtime_jax(case):
  pyproject = _pyproject()
  if case == "build jax too new":
    pyproject = re.sub(r'"jax[^"]*"\]', '"jax>=0.11"]', pyproject, count=1)
  assert bool(build_floor_problems(pyproject)) == (case != "real")


def test_build_jax_admits_the_cpu_and_gpu_versions():
  requires = tomllib.loads(_pyproject())["build-system"]["requires"]
  (jax_req,) = [Requirement(r) for r in requires if Requirement(r).name == "jax"]
  for v in ("0.10.2", "0.11.2"):       # CPU machines (PyPI), the H200 image
    assert jax_req.specifier.contains(v), (jax_req, v)


@pytest.mark.parametrize("case", ["real", "literal property", "gencode flag",
                                  "no cache variable", "unused variable"])
def test_cuda_architecture_only_through_cache_variable(case):
  cmake = _cmake()
  assert "90a" in cmake and "${%s}" % ARCH_VAR in cmake
  broken = {
      "literal property": lambda t: t.replace(
          'CUDA_ARCHITECTURES "${%s}"\n' % ARCH_VAR, "CUDA_ARCHITECTURES 90a\n"),
      "gencode flag": lambda t: t.replace(
          "-prec-div=true", "-prec-div=true -gencode=arch=compute_90a,code=sm_90a"),
      "no cache variable": lambda t: re.sub(rf"set\({ARCH_VAR} .*?\)\n", "", t, flags=re.S),
      "unused variable": lambda t: t.replace(
          'set(CMAKE_CUDA_ARCHITECTURES "${%s}")\n' % ARCH_VAR, "").replace(
              ' CUDA_ARCHITECTURES "${%s}"' % ARCH_VAR, ""),
  }
  if case != "real":
    cmake2 = broken[case](cmake)
    assert cmake2 != cmake, "the breakage did not apply"
    cmake = cmake2
  assert bool(arch_problems(cmake)) == (case != "real"), arch_problems(cmake)


def test_architecture_in_comments_is_not_a_literal():
  assert arch_problems(_cmake() + "\n# e.g. sm_90a, -gencode, 100a\n") == []


@pytest.mark.parametrize("case", ["real", "renamed variable"])
def test_documented_overrides_name_real_cache_variables(case):
  pyproject = _pyproject()
  assert f"cmake.define.{ARCH_VAR}=" in pyproject
  if case == "renamed variable":
    pyproject = pyproject.replace(f"cmake.define.{ARCH_VAR}", "cmake.define.TE_JAX_CUDA_ARCH")
  assert bool(documented_overrides_problems(pyproject, _cmake())) == (case != "real")


@pytest.mark.parametrize("case", ["real", "source deleted", "source not listed"])
def test_cmake_sources_match_the_tree(case, tmp_path):
  cmake_dir = CMAKE_DIR
  if case != "real":
    cmake_dir = tmp_path / "custom_calls"
    shutil.copytree(CMAKE_DIR, cmake_dir)
    if case == "source deleted":
      (cmake_dir / "ffi" / "gemm.cc").unlink()
    else:
      (cmake_dir / "ffi" / "new_op.cc").write_text("// forgot to list me\n")
  problems = source_problems((cmake_dir / "CMakeLists.txt").read_text(), cmake_dir)
  assert bool(problems) == (case != "real"), problems


# ------------------------------------------- CUTLASS: the sm90 GEMMs -----
# cmake/TeJaxCutlass.cmake on made-up header trees and a made-up
# nvidia-cutlass package (cmake alone, script mode), then the whole
# configure with and without the headers where a CUDA compiler and nanobind
# exist (a made-up cuBLASLt: configuring never links).

def make_cutlass(root, version=(4, 2, 0)):
  """A made-up CUTLASS include tree of ``version`` under ``root``; returns it."""
  (root / "cutlass").mkdir(parents=True)
  (root / "cute").mkdir()
  (root / "cutlass" / "version.h").write_text(
      "".join(f"#define CUTLASS_{p} {v}\n" for p, v in zip(("MAJOR", "MINOR", "PATCH"), version)))
  (root / "cute" / "tensor.hpp").write_text("")
  return root


def make_cutlass_package(site, version=(4, 2, 0)):
  """A made-up nvidia-cutlass install in ``site``: cutlass_library/ with the
  headers in source/include; returns that include folder."""
  pkg = site / "cutlass_library"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("raise ImportError('find it, do not import it')\n")
  return make_cutlass(pkg / "source" / "include", version)


def _find_cutlass(tmp_path, mode="AUTO", include="", site=None):
  """Runs te_jax_find_cutlass(mode, include) in CMake's script mode with
  ``site`` on the interpreter's path; (exit status, {VAR: value}, output)."""
  cmake = shutil.which("cmake")
  if not cmake:
    pytest.skip("needs cmake")
  script = tmp_path / "find.cmake"
  script.write_text(
      f'include("{CMAKE_DIR}/cmake/TeJaxCutlass.cmake")\n'
      f'te_jax_find_cutlass("{mode}" "{include}")\n'
      'foreach(v DIR VERSION WHY)\n  message(STATUS "${v}=${TE_JAX_CUTLASS_${v}}")\nendforeach()\n')
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env.update(PYTHONPATH=str(site or tmp_path / "empty"), PYTHONNOUSERSITE="1")
  proc = subprocess.run([cmake, f"-DPython_EXECUTABLE={sys.executable}", "-P", str(script)],
                        env=env, capture_output=True, text=True, timeout=120)
  out = proc.stdout + proc.stderr
  found = dict(re.findall(r"^-- (DIR|VERSION|WHY)=(.*)$", out, flags=re.M))
  return proc.returncode, found, " ".join(out.split())   # CMake wraps its error lines


def _installed_cutlass():
  return importlib.util.find_spec("cutlass_library") is not None


def test_cutlass_from_an_include_folder(tmp_path):
  inc = make_cutlass(tmp_path / "inc")
  rc, found, out = _find_cutlass(tmp_path, include=inc)
  assert rc == 0, out
  assert found == {"DIR": str(inc), "VERSION": "4.2.0", "WHY": ""}
  rc, found, _ = _find_cutlass(tmp_path, "OFF", include=inc)     # OFF wins over a folder
  assert rc == 0 and found == {"DIR": "", "VERSION": "", "WHY": "TE_JAX_SM90_GEMMS=OFF"}


@pytest.mark.parametrize("case, says", [
    ("not cutlass", "which holds no CUTLASS headers"),
    ("too old", "are version 4.1.9; the sm90 GEMMs need 4.2 or newer"),
    ("bad mode", "TE_JAX_SM90_GEMMS must be AUTO, ON or OFF, got 'MAYBE'"),
])
def test_cutlass_folder_problems_stop_the_configure(tmp_path, case, says):
  inc = tmp_path / "inc"
  inc.mkdir()
  if case == "too old":
    make_cutlass(inc / "x", (4, 1, 9))
    inc = inc / "x"
  rc, _, out = _find_cutlass(tmp_path, "MAYBE" if case == "bad mode" else "AUTO", include=inc)
  assert rc != 0 and says in out, out


@pytest.mark.skipif(_installed_cutlass(), reason="nvidia-cutlass is installed here: CMake finds it")
def test_cutlass_from_the_nvidia_cutlass_package(tmp_path):
  inc = make_cutlass_package(tmp_path / "site")
  rc, found, out = _find_cutlass(tmp_path, site=tmp_path / "site")
  assert rc == 0 and found["DIR"] == str(inc) and found["VERSION"] == "4.2.0", out
  old = tmp_path / "old"
  make_cutlass_package(old, (4, 1, 0))    # too old from a package: left out, not an error
  rc, found, out = _find_cutlass(tmp_path, site=old)
  assert rc == 0 and found["DIR"] == "" and "need 4.2 or newer" in found["WHY"], out


@pytest.mark.skipif(_installed_cutlass(), reason="nvidia-cutlass is installed here: CMake finds it")
def test_no_cutlass_leaves_the_sm90_gemms_out(tmp_path):
  rc, found, out = _find_cutlass(tmp_path)
  assert rc == 0 and found["DIR"] == "", out
  assert found["WHY"].startswith("no CUTLASS headers (neither -DTE_JAX_CUTLASS_INCLUDE=DIR nor")
  rc, _, out = _find_cutlass(tmp_path, "ON")
  assert rc != 0 and "TE_JAX_SM90_GEMMS=ON, but no CUTLASS headers" in out, out


def test_default_module_sources_and_cutlass_order():
  """Without CUTLASS the module is today's: no sm90 unit among
  nanobind_add_module's sources, they join only under if(TE_JAX_CUTLASS_DIR);
  and CUTLASS is looked for only after cuBLASLt was found (CI's CPU machine,
  which has none, never gets that far). Every sm90 translation unit under
  kernels/ is listed there (a new variant's file left out would leave its
  entry points undefined at link time)."""
  code = cmake_code(_cmake())
  (module,) = cmake_calls(code, "nanobind_add_module")
  assert "sm90" not in module and "grouped_gemm" not in module
  (extra,) = cmake_calls(code, "target_sources")
  units = sorted(f"kernels/{p.name}" for p in (ROOT / "custom_calls" / "kernels").glob("*_sm90*.cu"))
  assert len(units) >= 13
  assert "ffi/grouped_gemm.cc" in extra and sorted(re.findall(r"kernels/\S+_sm90\S*\.cu", extra)) == units
  at = code.index("target_sources(")
  opened = code.rindex("if(", 0, at)
  assert code.startswith("if(TE_JAX_CUTLASS_DIR)", opened) and "endif(" not in code[opened:at]
  assert code.index("te_jax_find_cutlass(") > code.index('"te_jax: cuBLASLt not found; skipping')


def _nvcc():
  return next((p for p in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc")
               if p and os.access(p, os.X_OK)), None)


@pytest.mark.skipif(_nvcc() is None or importlib.util.find_spec("nanobind") is None
                    or _installed_cutlass(),
                    reason="needs an nvcc and nanobind, and no nvidia-cutlass installed")
@pytest.mark.parametrize("with_cutlass", [False, True])
def test_configure_with_and_without_cutlass(tmp_path, with_cutlass):
  """The whole configure (a real nvcc, a made-up cuBLASLt): the build note's
  last clause says whether the sm90 GEMMs are in, and the generated build
  compiles their units and the grouped handler only with the headers."""
  import nanobind  # pylint: disable=import-outside-toplevel
  site = tmp_path / "site"
  site.mkdir()
  (site / "nanobind").symlink_to(os.path.dirname(nanobind.__file__))
  lt = tmp_path / "cublas"
  (lt / "include").mkdir(parents=True)
  (lt / "lib").mkdir()
  (lt / "include" / "cublasLt.h").write_text("")
  (lt / "lib" / "libcublasLt.so.13").write_text("")
  defines = [f"-DCMAKE_CUDA_COMPILER={_nvcc()}", f"-DTE_JAX_CUBLASLT_ROOT={lt}"]
  if with_cutlass:
    defines.append(f"-DTE_JAX_CUTLASS_INCLUDE={make_cutlass(tmp_path / 'inc')}")
  rc, out, note = _configure(tmp_path, site, *defines)
  assert rc == 0, out
  build = "".join(p.read_text() for p in (tmp_path / "build").glob("*.ninja")) + "".join(
      p.read_text() for p in (tmp_path / "build").rglob("build.make"))
  if with_cutlass:
    assert note.rstrip().endswith(
        f"; sm90 GEMMs: built with the CUTLASS 4.2.0 headers in {tmp_path / 'inc'}"), note
    assert "grouped_gemm_sm90_tensor_e4m3.cu" in build and "TE_JAX_HAVE_SM90" in build
    assert "ffi/grouped_gemm.cc" in build
  else:
    assert note.rstrip().endswith("; sm90 GEMMs: left out (no CUTLASS headers (neither "
                                  "-DTE_JAX_CUTLASS_INCLUDE=DIR nor an installed "
                                  "nvidia-cutlass package))"), note
    assert "sm90" not in build and "TE_JAX_HAVE_SM90" not in build
    assert "grouped_gemm" not in build
    assert "te_jax: sm90 GEMMs: left out (no CUTLASS headers" in out


def _toolkit_has_cublaslt(nvcc):
  root = pathlib.Path(nvcc).resolve().parent.parent
  return any(root.glob("lib*/libcublasLt.so*")) or any(root.glob("targets/*/lib/libcublasLt.so*"))


@pytest.mark.skipif(_nvcc() is None or _toolkit_has_cublaslt(_nvcc() or "/"),
                    reason="needs an nvcc whose toolkit has no cuBLASLt (as on CI's CPU machine)")
def test_no_cublaslt_builds_nothing_even_with_cutlass(tmp_path):
  """CI's CPU machine: nvcc but no cuBLASLt. Even with CUTLASS headers named,
  CMake stops before looking at them and builds nothing."""
  rc, out, note = _configure(tmp_path, tmp_path, f"-DCMAKE_CUDA_COMPILER={_nvcc()}",
                             f"-DTE_JAX_CUTLASS_INCLUDE={make_cutlass(tmp_path / 'inc')}")
  assert rc == 0, out
  assert note.startswith("not built: cuBLASLt not found"), note
  assert "sm90" not in out and "CUTLASS" not in out, out
  build = tmp_path / "build"
  assert "sm90" not in "".join(f.read_text() for f in [*build.glob("*.ninja"),
                                                         *build.rglob("build.make")])


# ----------------------------------------------------- skip summary line ---

SKIP_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(3))
def test_needs_a(i):
  pytest.skip("needs thing A")

@pytest.mark.skipif(True, reason="needs thing B")
def test_needs_b():
  pass

@pytest.mark.gpu
def test_gpu():
  pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="its own words for needing a GPU")
def test_gpu_own_reason():
  pass

def test_runs():
  assert True
"""


@pytest.mark.parametrize("workers", [None, "2"])
def test_skip_summary_line(tmp_path, workers):
  if workers and importlib.util.find_spec("xdist") is None:
    pytest.skip("needs pytest-xdist")
  shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
  (tmp_path / "test_made_up.py").write_text(SKIP_TESTS)
  (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  gpu: made up\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path),
       *(["-n", workers] if workers else [])],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300).stdout
  lines = out.strip().splitlines()
  import conftest  # pylint: disable=import-outside-toplevel  # tests/ is on sys.path
  # With the custom calls a gpu test skipped for its own reason counts as that reason.
  want = ("5 skipped: 3 needs thing A; 1 its own words for needing a GPU; 1 needs thing B"
          if conftest._cuda_available() else
          f"6 skipped: 3 needs thing A; 2 {conftest.GPU_SKIP_REASON}; 1 needs thing B")
  assert want in lines, out
  assert lines.index(want) == len(lines) - 2, "not the line before pytest's closing line"


def test_compile_fast_flags_are_those_xla_accepts():
  """conftest.py puts a compile-fast flag in XLA_FLAGS only where this XLA
  accepts it: an unknown one would abort every process of the run."""
  import conftest  # pylint: disable=import-outside-toplevel  # tests/ is on sys.path
  real, unknown = "--xla_backend_optimization_level=0", "--xla_te_jax_no_such_flag=1"
  assert conftest._xla_accepts([unknown, real]) == [real]   # pylint: disable=protected-access


def test_subprocess_xla_flags_keep_the_runs_flags_and_set_the_device_count(monkeypatch):
  from subprocess_flags import subprocess_xla_flags  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_a=1 --xla_force_host_platform_device_count=2")
  assert subprocess_xla_flags(8).split() == [
      "--xla_cpu_a=1", "--xla_backend_optimization_level=0",
      "--xla_force_host_platform_device_count=8"]
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")   # the caller's level
  assert subprocess_xla_flags() == "--xla_backend_optimization_level=2"
  monkeypatch.delenv("XLA_FLAGS")
  assert subprocess_xla_flags(4).split() == [
      "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=4"]
