"""The build's two halves agree: pyproject.toml and custom_calls/CMakeLists.txt.

With build isolation (plain ``pip install .``) CMake runs in a fresh
environment holding only ``[build-system] requires``, so every Python module
CMakeLists.txt runs must come from there. The CUDA architecture is named once,
by a cache variable. CPU only, no network, no compiler: the files are read as
text. Each check is a function of the texts, run on the real files and on
deliberately broken ones, so each is seen to fail.
"""

import ast
import pathlib
import re
import shutil
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

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
  return (CMAKE_DIR / "CMakeLists.txt").read_text()


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


def python_modules(cmake_text):
  """Top-level modules that CMake's ``execute_process`` runs Python on
  (``-c "import x ..."``, ``-m x``)."""
  mods = set()
  for args in cmake_calls(cmake_code(cmake_text), "execute_process"):
    if not _PYTHON.search(args):
      continue
    for m in re.finditer(r'(?<!\S)-c\s+"((?:[^"\\]|\\.)*)"', args):
      src = re.sub(r"\\(.)", r"\1", m.group(1))
      for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
          mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          mods.add(node.module.split(".")[0])
    mods.update(m.group(1).split(".")[0] for m in re.finditer(r"(?<!\S)-m\s+([\w.]+)", args))
  return mods


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

def missing_build_requires(pyproject_text, cmake_text):
  """Modules CMake runs that no ``[build-system] requires`` entry provides."""
  requires = {canonicalize_name(Requirement(r).name)
              for r in tomllib.loads(pyproject_text)["build-system"]["requires"]}
  return sorted(m for m in python_modules(cmake_text)
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
  # Guards the parser: the real file runs jax (FFI headers) and nanobind.
  assert {"jax", "nanobind"} <= python_modules(_cmake())


@pytest.mark.parametrize("case", ["real", "unlisted import", "requires without jax"])
def test_build_requires_provide_what_cmake_imports(case):
  pyproject, cmake = _pyproject(), _cmake()
  if case == "unlisted import":
    cmake = cmake.replace("import jax;", "import jax, yaml;", 1)
  elif case == "requires without jax":
    pyproject = re.sub(r',\s*"jax[^"]*"', "", pyproject, count=1)
  assert missing_build_requires(pyproject, cmake) == {
      "real": [], "unlisted import": ["yaml"], "requires without jax": ["jax"]}[case]


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
