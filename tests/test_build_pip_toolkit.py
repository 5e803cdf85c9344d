"""The CUDA toolkit of the pip packages (custom_calls/cmake/pip_cuda_toolkit.py,
TeJaxCudaToolkit.cmake), what ``pip install "jax[cuda13]"`` brings: the finder
on made-up site-packages trees and under pip's build isolation, and CMake
configuring against made-up trees (cmake and a C++ compiler, no CUDA: a
made-up nvcc that records its arguments and fails). The real compile is
tools/nvcc_free.sh's.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

CMAKE_DIR = pathlib.Path(__file__).resolve().parent.parent / "custom_calls"


# ------------------------------------------------ pip CUDA toolkit finder ---

def _load_finder():
  path = CMAKE_DIR / "cmake" / "pip_cuda_toolkit.py"
  spec = importlib.util.spec_from_file_location("pip_cuda_toolkit", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


finder = _load_finder()
CUDA_PACKAGES = sorted(set(finder.COMPILER_FILES.values()) | {finder.CUBLASLT_PACKAGE})


def make_tree(site, major=13, without=(), nvcc_version="13.5.37", compiler=True, cublaslt=True,
              devrt=True):
  """A made-up ``site/nvidia/cu<major>`` tree of the pip CUDA packages minus
  the files of the packages in ``without`` (and minus ``lib/libcudadevrt.a``
  unless ``devrt``); returns the tree. ``bin/nvcc`` is a script that fails
  (CMake's test compile rejects it) and appends its arguments, one call a
  line, to ``bin/called``."""
  tree = site / "nvidia" / f"cu{major}"
  files = {}
  if compiler:
    files.update(finder.COMPILER_FILES)
    files[f"lib/libcudart.so.{major}"] = "nvidia-cuda-runtime"
    if devrt:
      files[finder.DEVRT_FILE] = "nvidia-cuda-runtime"
  if cublaslt:
    files.update({"include/cublasLt.h": finder.CUBLASLT_PACKAGE,
                  f"lib/libcublasLt.so.{major}": finder.CUBLASLT_PACKAGE})
  for rel, package in files.items():
    if package not in without:
      (tree / rel).parent.mkdir(parents=True, exist_ok=True)
      (tree / rel).write_text("")
  if compiler and "nvidia-cuda-nvcc" not in without:
    (tree / "bin/nvcc").write_text(  # leaves bin/called: CMake did try it
        "#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/called\"\necho 'made-up nvcc' >&2\nexit 1\n")
    (tree / "bin/nvcc").chmod(0o755)
    (site / f"nvidia_cuda_nvcc-{nvcc_version}.dist-info").mkdir(parents=True, exist_ok=True)
  return tree


@pytest.mark.parametrize("devrt", [True, False])
def test_finder_complete_tree(tmp_path, devrt):
  # Without lib/libcudadevrt.a (some nvidia-cuda-runtime installs lack it)
  # the tree is still complete; the finder says which it is.
  tree = make_tree(tmp_path, devrt=devrt)
  assert finder.find([str(tmp_path)]) == {
      "root": str(tree), "cublaslt_root": str(tree), "version": "13.5.37", "devrt": devrt,
      "missing": []}
  assert finder.report(finder.find([str(tmp_path)])).splitlines() == [
      f"root={tree}", f"cublaslt_root={tree}", "version=13.5.37", f"devrt={int(devrt)}"]


@pytest.mark.parametrize("package", [p for p in CUDA_PACKAGES if p != "nvidia-cuda-nvcc"])
def test_finder_names_the_missing_package(tmp_path, package):
  make_tree(tmp_path, without={package})
  missing = finder.find([str(tmp_path)])["missing"]
  assert [m.split()[0] for m in missing] == [package], missing
  assert f"missing={package} (" in finder.report(finder.find([str(tmp_path)]))


def test_finder_without_nvcc_finds_nothing(tmp_path):
  make_tree(tmp_path, without={"nvidia-cuda-nvcc"})
  assert finder.find([str(tmp_path)]) == {} and finder.report({}) == ""
  assert finder.find([str(tmp_path / "nowhere"), ""]) == {}


def test_finder_newest_cuda_first_and_cublaslt_from_another_site(tmp_path):
  make_tree(tmp_path / "a", major=12)
  new = make_tree(tmp_path / "b", major=13, cublaslt=False)
  lt = make_tree(tmp_path / "c", major=13, compiler=False)
  make_tree(tmp_path / "d", major=12, compiler=False)
  found = finder.find([str(tmp_path / s) for s in "abcd"])
  assert (found["root"], found["cublaslt_root"], found["missing"]) == (str(new), str(lt), [])


def test_finder_sees_the_installing_environment_under_build_isolation(tmp_path):
  # pip's build isolation: PYTHONPATH puts a sitecustomize first that drops
  # the interpreter's site-packages from sys.path (where jax[cuda13] put the
  # nvidia packages). The finder must still search them.
  import site  # pylint: disable=import-outside-toplevel
  hidden = [p for p in site.getsitepackages() if os.path.isdir(p)]
  assert hidden
  (tmp_path / "sitecustomize.py").write_text(
      f"import sys\nsys.path[:] = [p for p in sys.path if p not in {hidden!r}]\n")
  code = ("import importlib.util, json, sys\n"
          f"spec = importlib.util.spec_from_file_location('f', {str(finder.__file__)!r})\n"
          "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
          "print(json.dumps([sys.path, m.search_paths()]))\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env["PYTHONPATH"], env["PYTHONNOUSERSITE"] = str(tmp_path), "1"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
  own_path, searched = json.loads(out)
  assert not set(hidden) & set(own_path), "the isolation was not simulated"
  assert set(hidden) <= set(searched)


# ---------------------------------------- CMake against made-up trees ------

def _configure(tmp_path, site, *defines):
  """Configures custom_calls/ (no build) with no nvcc on PATH, no CUDA_HOME,
  and ``site`` on the build interpreter's path; returns (exit status, output,
  the build note or None)."""
  cmake, cxx, ninja = (shutil.which(tool) for tool in ("cmake", "c++", "ninja"))
  if not cmake or not cxx:
    pytest.skip("needs cmake and a C++ compiler")
  dirs = {os.path.dirname(tool) for tool in (cmake, cxx, ninja) if tool}
  if any(os.access(os.path.join(d, "nvcc"), os.X_OK) for d in dirs):
    pytest.skip("nvcc lies beside cmake, c++ or ninja: it cannot be left off PATH")
  path = os.pathsep.join(sorted(dirs))
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTHON", "CUDA")) and k not in ("CUDACXX", "CMAKE_ARGS")}
  env.update(PATH=path, PYTHONPATH=str(site), PYTHONNOUSERSITE="1")
  build = tmp_path / "build"
  proc = subprocess.run(
      [cmake, "-S", str(CMAKE_DIR), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
       *(["-G", "Ninja"] if ninja else []), *defines],
      env=env, capture_output=True, text=True, timeout=300)
  note = build / "_te_jax_ffi_build.txt"
  return proc.returncode, proc.stdout + proc.stderr, (note.read_text() if note.exists() else None)


def test_cmake_names_the_missing_pip_package(tmp_path):
  tree = make_tree(tmp_path / "site", without={"nvidia-nvvm"})
  rc, out, note = _configure(tmp_path, tmp_path / "site")
  assert rc == 0, out
  assert f"the pip CUDA packages at {tree} lack nvidia-nvvm (nvvm/bin/cicc)" in out
  assert note.startswith("not built: no CUDA compiler") and "nvidia-nvvm" in note


@pytest.mark.parametrize("devrt", [True, False])
def test_cmake_gives_the_pip_compiler_its_flags(tmp_path, devrt):
  """CMake's compiler identification calls the pip nvcc with the user's CUDA
  flags, then the tree's lib/ (the 13.0 nvcc.profile looks in
  lib64/), and, where lib/libcudadevrt.a is missing, no device runtime plus
  an empty archive in the build folder for the -lcudadevrt that CMake adds
  itself. The made-up nvcc fails, which CMake reports with those flags."""
  tree = make_tree(tmp_path / "site", devrt=devrt)
  rc, out, note = _configure(tmp_path, tmp_path / "site", "-DCMAKE_CUDA_FLAGS=--user-flag")
  assert rc == 0, out
  stand_in = tmp_path / "build" / "te_jax_pip_cuda"
  pip_flags = f"-L{tree}/lib" + ("" if devrt else f" -L{stand_in} -cudadevrt none")
  out = " ".join(out.split())   # CMake wraps long lines
  assert (f"the pip CUDA compiler {tree}/bin/nvcc (flags: {pip_flags}) failed CMake's test "
          "compile") in out, out
  assert "not built" in note
  assert (tree / "bin" / "called").exists(), "CMake never ran the pip nvcc"
  calls = [line.split() for line in (tree / "bin" / "called").read_text().splitlines()]
  want = ["--user-flag", *pip_flags.split()]
  assert any(c[i:i + len(want)] == want for c in calls for i in range(len(c))), calls
  assert (stand_in / "libcudadevrt.a").exists() == (not devrt)
  if not devrt and shutil.which("ar"):   # a valid archive, without members
    listing = subprocess.run(["ar", "t", str(stand_in / "libcudadevrt.a")], capture_output=True,
                             text=True, check=True)
    assert listing.stdout == ""


def test_cmake_without_any_toolkit(tmp_path):
  if finder.find(finder.search_paths()):
    pytest.skip("the pip CUDA packages are installed here: CMake finds them")
  (tmp_path / "site").mkdir()
  rc, out, note = _configure(tmp_path, tmp_path / "site")
  assert rc == 0, out
  assert "no pip CUDA packages" in out and note.startswith("not built: no CUDA compiler")


@pytest.mark.parametrize("mode, configures, says", [
    ("pip", False, "TE_JAX_CUDA_TOOLKIT=pip, but the pip CUDA packages at"),
    ("bogus", False, "TE_JAX_CUDA_TOOLKIT must be auto, system or pip, got 'bogus'"),
    ("system", True, "te_jax: no CUDA compiler (nvcc on PATH, CUDACXX or CMAKE_CUDA_COMPILER); "
                     "skipping")])
def test_cmake_toolkit_modes(tmp_path, mode, configures, says):
  # Made-up pip packages lacking CCCL: "pip" must fail loudly, "system" must
  # not look at them, and a mistyped mode is refused.
  make_tree(tmp_path / "site", without={"nvidia-cuda-cccl"})
  rc, out, _ = _configure(tmp_path, tmp_path / "site", f"-DTE_JAX_CUDA_TOOLKIT={mode}")
  assert (rc == 0) == configures and says in out, out


def _real_pip_toolkit():
  found = finder.find(finder.search_paths())
  return found if found and not found["missing"] else None


@pytest.mark.skipif(_real_pip_toolkit() is None or importlib.util.find_spec("nanobind") is None
                    or importlib.util.find_spec("jax") is None,
                    reason="need the pip CUDA packages (jax[cuda13] brings them) and nanobind")
def test_cmake_configures_with_the_real_pip_toolkit(tmp_path):
  # Where the packages are installed: CMake takes them with no nvcc on PATH,
  # and every CUDA path it records lies in their tree.
  root = _real_pip_toolkit()["root"]
  rc, out, note = _configure(tmp_path, tmp_path)
  assert rc == 0, out
  assert f"te_jax: CUDA toolkit: pip packages (nvidia-cuda-nvcc " in out and f"at {root}," in out
  assert note.startswith("built with the CUDA toolkit: pip packages"), note
  assert "; libraries from lib/" in note
  cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
  assert re.search(r"^CMAKE_CUDA_FLAGS:STRING=$", cache, flags=re.M), "pip flags in the cache"
  ninja = tmp_path / "build" / "build.ninja"
  assert not ninja.exists() or f"-L{root}/lib" in ninja.read_text()
  for var in ("CMAKE_CUDA_COMPILER", "CUDA_CUDART", "CUDA_cudart_static_LIBRARY", "TE_JAX_LT_LIB"):
    (value,) = re.findall(rf"^{var}:\w+=(.*)$", cache, flags=re.M)
    assert value.startswith(root), (var, value)
