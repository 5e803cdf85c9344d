"""Finds a CUDA toolkit installed from pip, for custom_calls/CMakeLists.txt.

``pip install "jax[cuda13]"`` brings the CUDA 13 compiler and libraries as
pip packages that all unpack into one ``site-packages/nvidia/cu13/`` tree laid
out like a system toolkit (``bin/nvcc``, ``nvvm/bin/cicc``, ``include/``,
``lib/``). That is enough to build te_jax's kernels on a machine without a
system CUDA toolkit; this script says where such a tree is and what it lacks.

Where it looks: every ``sys.path`` entry of the interpreter running it, and of
the same interpreter started with ``-E``. Under pip's build isolation the
first is the temporary build environment and the second is the environment
being installed into (pip isolates the build through ``PYTHONPATH``, which
``-E`` ignores), so the packages a user installed with jax are found.

Stdlib only: it runs in the build environment, whose packages are only
pyproject.toml's ``[build-system] requires``.

Output, one ``key=value`` per line (CMake reads them):
  ``root=DIR``          the tree holding the compiler and the CUDA runtime
  ``cublaslt_root=DIR`` the tree holding cuBLASLt (usually the same)
  ``version=X.Y.Z``     the nvidia-cuda-nvcc package version, when known
  ``devrt=1`` or ``0``  whether ``lib/libcudadevrt.a`` (the device runtime,
                        needed only by relocatable device code) is there;
                        optional: some nvidia-cuda-runtime installs lack it,
                        and TeJaxCudaToolkit.cmake builds without it
  ``missing=TEXT``      what an incomplete tree lacks, by pip package name
Nothing is printed when no ``nvidia/cuNN`` tree with ``bin/nvcc`` exists.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

# Files the compiler tree must hold (nvcc finds its parts relative to its own
# folder, so they cannot come from another tree), and the package of each.
COMPILER_FILES = {
    "bin/nvcc": "nvidia-cuda-nvcc",
    "nvvm/bin/cicc": "nvidia-nvvm",
    "include/crt/host_config.h": "nvidia-cuda-crt",
    "include/cuda_runtime.h": "nvidia-cuda-runtime",
    "lib/libcudart_static.a": "nvidia-cuda-runtime",
    "include/nv/target": "nvidia-cuda-cccl",
}
CUDART_GLOB = "lib/libcudart.so*"
# Optional: nvcc links it into every executable by default, but te_jax
# compiles no relocatable device code, so it builds without it.
DEVRT_FILE = "lib/libcudadevrt.a"
CUBLASLT_FILES = ("include/cublasLt.h",)
CUBLASLT_GLOB = "lib/libcublasLt.so*"
CUBLASLT_PACKAGE = "nvidia-cublas"
_TREE = re.compile(r"cu(\d+)$")


def trees(search_paths):
  """``nvidia/cuNN`` folders under ``search_paths``, newest CUDA major first,
  then in search-path order."""
  found = []
  for order, entry in enumerate(search_paths):
    base = pathlib.Path(entry or ".") / "nvidia"
    if not base.is_dir():
      continue
    for tree in base.iterdir():
      m = _TREE.match(tree.name)
      if m and tree.is_dir():
        found.append((-int(m.group(1)), order, tree.resolve()))
  unique = []
  for _, _, tree in sorted(found):
    if tree not in unique:
      unique.append(tree)
  return unique


def _has_cublaslt(tree):
  return all((tree / f).is_file() for f in CUBLASLT_FILES) and any(tree.glob(CUBLASLT_GLOB))


def _compiler_missing(tree):
  """Pip packages whose files ``tree`` lacks, each with the file looked for."""
  missing = {}
  for rel, package in COMPILER_FILES.items():
    if not (tree / rel).is_file():
      missing.setdefault(package, rel)
  if not any(tree.glob(CUDART_GLOB)):
    missing.setdefault("nvidia-cuda-runtime", CUDART_GLOB)
  return [f"{package} ({rel})" for package, rel in missing.items()]


def _nvcc_version(tree):
  """Version of the nvidia-cuda-nvcc distribution installed beside ``tree``."""
  site = tree.parent.parent
  for info in sorted(site.glob("nvidia_cuda_nvcc-*.dist-info"), reverse=True):
    return info.name[len("nvidia_cuda_nvcc-"):-len(".dist-info")]
  return ""


def find(search_paths):
  """The pip toolkit under ``search_paths``.

  Returns:
    {} when no tree has ``bin/nvcc``; else a dict with ``root`` (the first
    tree with ``bin/nvcc``, newest CUDA major first), ``cublaslt_root`` (the
    first tree of the same CUDA major with cuBLASLt, the compiler tree
    preferred; "" if none), ``version`` (nvidia-cuda-nvcc's, "" if unknown),
    ``devrt`` (whether the root has ``DEVRT_FILE``) and ``missing`` (a list,
    empty when the toolkit is complete; ``DEVRT_FILE`` is never in it).
  """
  all_trees = trees(search_paths)
  compilers = [t for t in all_trees if (t / "bin/nvcc").is_file()]
  if not compilers:
    return {}
  root = compilers[0]
  same_major = [t for t in all_trees if t.name == root.name]
  lt_roots = [t for t in [root] + same_major if _has_cublaslt(t)]
  missing = _compiler_missing(root)
  if not lt_roots:
    missing.append(f"{CUBLASLT_PACKAGE} ({CUBLASLT_FILES[0]}, {CUBLASLT_GLOB})")
  return {"root": str(root), "cublaslt_root": str(lt_roots[0]) if lt_roots else "",
          "version": _nvcc_version(root), "devrt": (root / DEVRT_FILE).is_file(),
          "missing": missing}


def search_paths():
  """This interpreter's ``sys.path``, then the entries that the same
  interpreter started with ``-E`` (PYTHON* variables ignored) adds."""
  paths = list(sys.path)
  try:
    out = subprocess.run([sys.executable, "-E", "-c", "import sys, json; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    paths += [p for p in json.loads(out) if p not in paths]
  except (OSError, subprocess.SubprocessError, ValueError):
    pass   # the build environment's own path is still searched
  return paths


def report(result):
  """``result`` of :func:`find` as the ``key=value`` lines CMake reads."""
  if not result:
    return ""
  lines = [f"root={result['root']}", f"cublaslt_root={result['cublaslt_root']}",
           f"version={result['version']}", f"devrt={int(result['devrt'])}"]
  if result["missing"]:
    lines.append("missing=" + ", ".join(result["missing"]))
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.stdout.write(report(find(search_paths())))
